// The CUDA backend's KV cache element types (no CUDA headers: the backend's
// public header and the kernels' both use it).
#pragma once

#include <string>

namespace lily::cuda {

// Q8: a row (one position of one KV head, hd values) is hd bytes of
// offset-binary codes u = c + 128, c in [-127, 127], and one f32 scale s, the
// value c * s. The row is quantized from its bf16 rounding b: m = max |b|,
// s = m / 127, c = rn(b * (127 / m)) (0 when m = 0), in f32 with IEEE
// division (kv_q8_quantize_ref in the tests is the host twin). Scales sit
// apart from the rows: [nkv][q8_scale_stride(capacity)].
enum class KvType : int { F32 = 0, BF16 = 1, Q8 = 2 };
inline const char* kv_type_name(KvType t) { return t == KvType::F32 ? "f32" : t == KvType::BF16 ? "bf16" : "q8"; }
inline int kv_elem_bytes(KvType t) { return t == KvType::F32 ? 4 : t == KvType::BF16 ? 2 : 1; }
// Positions per KV head in the scale arrays: the capacity rounded up to 8, so
// a step's 8 scales are whole 16-byte pieces.
inline int q8_scale_stride(int capacity) { return (capacity + 7) / 8 * 8; }

// "f32", "bf16" or "q8"; false for anything else.
inline bool parse_kv_type(const std::string& s, KvType& t) {
  if (s == "f32") t = KvType::F32;
  else if (s == "bf16") t = KvType::BF16;
  else if (s == "q8") t = KvType::Q8;
  else return false;
  return true;
}

}  // namespace lily::cuda

// Small kernels that connect the prefill building blocks (prefill.h) into the
// CUDA backend's many-token forward pass: embedding rows for a run of tokens,
// and the attention input preparation (q/k RMSNorm, partial RoPE, bf16
// conversion, K/V append into the bf16 cache).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace lily::cuda {

// x[t][0..cols) (f32, row stride ldx) = row tokens[t] of the embedding matrix
// `m` (any decode upload format), t in [0, T). Token ids must be in range.
void launch_embed_rows(const DevMatView& m, const int* tokens, int T, float* x, size_t ldx,
                       cudaStream_t s);

// Attention inputs of T tokens at positions [P, P + T), from the f32
// projection rows proj[t * ld_proj]: [q heads x q_head_stride | k nkv x hd |
// v nkv x hd] (a q head is its query, then its gate when gated).
//   qg (bf16) [T][nh * q_head_stride]: the normed, roped query and the gate
//     converted as is, at the same offsets as in proj.
//   k_cache / v_cache (bf16) [nkv][capacity][hd]: rows P + t written (k normed
//     and roped).
struct AttnPrepParams {
  const float* proj = nullptr;
  size_t ld_proj = 0;
  int T = 0, P = 0;
  int nh = 0, nkv = 0, hd = 0, q_head_stride = 0, gated = 0;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  int rotary_dim = 0;
  uint16_t* qg = nullptr;
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  int capacity = 0;
};
void launch_attn_prep(const AttnPrepParams& p, cudaStream_t s);

// A q8 KV cache's K or V (KvType::Q8): rows [nkv][capacity][hd] of codes,
// scales [nkv][scale_stride].
struct KvQ8Rows {
  uint8_t* rows = nullptr;
  float* scales = nullptr;
  int capacity = 0, scale_stride = 0;
};
// dst (bf16) [nkv][dst_cap][hd] rows [p0, p1) = the q8 rows' values c * s.
void launch_kv_q8_expand(const KvQ8Rows& q, int nkv, int hd, int p0, int p1, uint16_t* dst, int dst_cap,
                         cudaStream_t s);
// Quantizes bf16 rows [p0, p1) of src [nkv][src_cap][hd] into q (as the
// decode step quantizes a new row) and writes their values c * s back to src.
void launch_kv_q8_store(uint16_t* src, int src_cap, int nkv, int hd, int p0, int p1, const KvQ8Rows& q,
                        cudaStream_t s);


}  // namespace lily::cuda

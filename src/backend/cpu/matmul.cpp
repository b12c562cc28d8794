#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/half.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LILY_CPU_X86 1
#include <immintrin.h>
#endif

namespace lily::cpu {

namespace {

// Element i of an array of f32, f16 or bf16 values (scales, biases, weights).
inline float load_value(const uint8_t* p, DType dt, size_t i) {
  uint16_t h;
  switch (dt) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::F16:
      std::memcpy(&h, p + 2 * i, 2);
      return f16_to_f32(h);
    default:
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_f32(h);
  }
}

}  // namespace

void dequantize_row(const Matrix& w, int row, float* out) {
  const uint8_t* src = w.data + w.row_bytes() * row;
  const int n = w.cols;
  switch (w.format) {
    case WeightFormat::F32:
      std::memcpy(out, src, sizeof(float) * n);
      return;
    // Tensors need not be 2-byte aligned in the file (the safetensors header
    // length is arbitrary), so halves are loaded with memcpy.
    case WeightFormat::BF16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case WeightFormat::F16:
      for (int i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return;
    case WeightFormat::Affine4:
    case WeightFormat::Affine8: {
      const int bits = w.bits();
      const uint32_t mask = (1u << bits) - 1;
      const int per_word = 32 / bits;
      const size_t groups = w.groups_per_row();
      const size_t g0 = groups * row;
      for (size_t g = 0; g < groups; ++g) {
        const float scale = load_value(w.scales, w.scale_dtype, g0 + g);
        const float bias = load_value(w.biases, w.scale_dtype, g0 + g);
        const int base = static_cast<int>(g) * w.group_size;
        for (int i = 0; i < w.group_size; i += per_word) {
          uint32_t word;
          std::memcpy(&word, src + (static_cast<size_t>(base + i) * bits) / 8, 4);
          for (int j = 0; j < per_word; ++j) {
            out[base + i + j] = scale * static_cast<float>((word >> (bits * j)) & mask) + bias;
          }
        }
      }
      return;
    }
  }
}

namespace {

// sum a[i] b[i] over n floats, portably: eight partial sums let the
// compiler vectorise without -ffast-math.
float dot_portable(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[c + j] * b[c + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// The portable path: each weight row expanded once into a per-thread buffer
// and reused across the T input rows.
void rows_generic(const Matrix& w, const float* x, int T, size_t x_stride, size_t r0, size_t r1, float* y,
                  size_t y_stride) {
  const int cols = w.cols;
  thread_local std::vector<float> row;
  row.resize(cols);
  for (size_t r = r0; r < r1; ++r) {
    dequantize_row(w, static_cast<int>(r), row.data());
    const float* wr = row.data();
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = dot_portable(wr, x + t * x_stride, cols);
  }
}

// One weight value of an unquantized row at column c (the SIMD rows' tails).
template <WeightFormat F>
inline float load1(const uint8_t* src, int c) {
  return load_value(src, F == WeightFormat::F32 ? DType::F32 : F == WeightFormat::F16 ? DType::F16 : DType::BF16, c);
}

}  // namespace

#ifdef LILY_CPU_X86
// The SIMD paths (chosen at run time): weights are decoded a vector at a time
// in registers and never stored, for several input rows at once, so a decode
// step reads each weight byte once and does about one instruction per weight
// and input row. A quantized row's sum is taken per group as
// scale * sum(q x) + bias * sum(x) (the group sums of x computed once per
// call), in f32 like the portable path; they differ only in summation order.
// matmul_simd.inc holds the row kernel, compiled once per instruction set.

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace simd_avx2 {
// Eight weights: 4-bit codes by a variable shift of the word per lane.
constexpr int kW = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n for integral n with n + 127 in (0, 255).
inline V vldexp(V p, V n) {
  return vmul(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <WeightFormat F>
inline V loadw(const uint8_t* src, int c) {
  if constexpr (F == WeightFormat::Affine4) {
    uint32_t word;
    std::memcpy(&word, src + c / 2, 4);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), sh),
                                       _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(q);
  } else if constexpr (F == WeightFormat::Affine8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c))));
  } else if constexpr (F == WeightFormat::BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * size_t(c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == WeightFormat::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * size_t(c))));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * size_t(c)));
  }
}
#include "backend/cpu/matmul_simd.inc"

// 4-bit rows on integer inputs without VNNI (AVX2): as simd_vnni's kernel
// (below), with 32-byte loads of 64 weights, whose inputs are stored per 64
// columns as the 32 even then the 32 odd ones; VPMADDUBSW (code x input,
// pairs summed to 16 bits: at most 4 x 15 x 128 for a nibble pair of both
// halves, no saturation) then VPMADDWD by ones to 32-bit lanes of 8 columns.
// 8-bit weights would saturate VPMADDUBSW: they keep the f32 kernel.
namespace ints {
constexpr int kChunk = 64;
template <bool Wide, int NT>
void rows(const Matrix& w, const int8_t* xi, size_t xi_stride, const float* xs, size_t xs_stride,
          const float* xsum, size_t r0, size_t r1, float* y, size_t y_stride) {
  const int gs = w.group_size, groups = w.cols / gs, chunks = w.cols / kChunk;
  const size_t row_bytes = w.row_bytes();
  alignas(32) int lane_group[8];
  for (int l = 0; l < 8; ++l) lane_group[l] = gs >= kChunk ? 0 : l * 8 / gs;
  const __m256i gidx = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_group));
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  thread_local std::vector<float> ws, wb, comb;
  ws.resize(groups);
  wb.resize(groups);
  comb.resize(size_t(NT) * (groups + 8));
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* src = w.data + row_bytes * r;
    for (int g = 0; g < groups; ++g) {
      ws[g] = load_value(w.scales, w.scale_dtype, r * groups + g);
      wb[g] = load_value(w.biases, w.scale_dtype, r * groups + g);
    }
    float tail[NT];
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) {
      const float* xst = xs + t * xs_stride;
      const float* xm = xsum + size_t(t) * groups;
      float* c = &comb[size_t(t) * (groups + 8)];
      float b = 0.f;
      for (int g = 0; g < groups; ++g) {
        c[g] = ws[g] * xst[g];
        b += wb[g] * xm[g];
      }
      tail[t] = b;
      acc[t] = _mm256_setzero_ps();
    }
    for (int ch = 0; ch < chunks; ++ch) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + size_t(ch) * 32));
      const __m256i lo = _mm256_and_si256(bytes, nib), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);
      const int g0 = ch * kChunk / gs;
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const int8_t* xt = xi + t * xi_stride + size_t(ch) * kChunk;
        auto part = [&](const int8_t* p) {
          const __m256i a = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
          const __m256i b = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
          return _mm256_madd_epi16(_mm256_add_epi16(a, b), ones);
        };
        __m256i d = part(xt);
        if constexpr (Wide) d = _mm256_add_epi32(_mm256_slli_epi32(d, 8), part(xt + w.cols));
        const __m256 sc = _mm256_permutevar8x32_ps(_mm256_loadu_ps(&comb[size_t(t) * (groups + 8) + g0]), gidx);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = vsum(acc[t]) + tail[t];
  }
}

void rows_any(const Matrix& w, bool wide, const int8_t* xi, size_t xi_stride, const float* xs, size_t xs_stride,
              const float* xsum, size_t groups, int T, size_t r0, size_t r1, float* y, size_t y_stride) {
  for (int t0 = 0; t0 < T; t0 += 4) {
    const int n = std::min(4, T - t0);
    const int8_t* x0 = xi + size_t(t0) * xi_stride;
    const float *s0 = xs + size_t(t0) * xs_stride, *m0 = xsum + size_t(t0) * groups;
    float* y0 = y + size_t(t0) * y_stride;
#define LILY_INTS_CASE(W, N) rows<W, N>(w, x0, xi_stride, s0, xs_stride, m0, r0, r1, y0, y_stride)
    if (wide) {
      if (n == 1) LILY_INTS_CASE(true, 1);
      else if (n == 2) LILY_INTS_CASE(true, 2);
      else if (n == 3) LILY_INTS_CASE(true, 3);
      else LILY_INTS_CASE(true, 4);
    } else {
      if (n == 1) LILY_INTS_CASE(false, 1);
      else if (n == 2) LILY_INTS_CASE(false, 2);
      else if (n == 3) LILY_INTS_CASE(false, 3);
      else LILY_INTS_CASE(false, 4);
    }
#undef LILY_INTS_CASE
  }
}
}  // namespace ints
}  // namespace simd_avx2
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics take an undefined pass-through register that
// it then reports as maybe uninitialized (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace {
namespace simd_avx512 {
// Sixteen weights. 4-bit: the two words broadcast as 64-bit pairs, shifted
// per lane, and the low nibble of each lane used as the index of a 16-entry
// table (vpermps reads only those bits): lanes 2i and 2i + 1 hold columns i
// and 8 + i, so the inputs of 4-bit rows are permuted to match (once per
// call, permute16 below).
constexpr int kW = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
inline V vldexp(V p, V n) { return _mm512_scalef_ps(p, n); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <WeightFormat F>
inline V loadw(const uint8_t* src, int c) {
  if constexpr (F == WeightFormat::Affine4) {
    uint64_t pair;
    std::memcpy(&pair, src + c / 2, 8);
    const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(static_cast<long long>(pair)), sh), table);
  } else if constexpr (F == WeightFormat::Affine8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
  } else if constexpr (F == WeightFormat::BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * size_t(c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (F == WeightFormat::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * size_t(c))));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(src + 4 * size_t(c)));
  }
}
#include "backend/cpu/matmul_simd.inc"
}  // namespace simd_avx512
}  // namespace
#pragma GCC diagnostic pop
#pragma GCC pop_options

// Quantized rows on integer inputs (ActPrecision::Q16 / Q8): each input row
// is rounded to codes per weight group (quantize_inputs; Q16 as two int8
// planes) and the weight codes (unsigned) multiply them four at a time with
// VPDPBUSD into 32-bit sums (Q16: the high plane's sums x 256 + the low's): one 64-byte load of a row is 128 4-bit or 64 8-bit weights,
// decoded by two ANDs and a shift. Each 32-bit lane covers 8 (4-bit) or 4
// (8-bit) consecutive columns, so a chunk's lanes are scaled per group by
// weight scale x input scale and accumulated in f32; the bias term is
// bias * sum(x) per group from the f32 inputs, as in the f32 kernels.
// 4-bit inputs are stored per 128-column chunk as the 64 even columns then
// the 64 odd ones (the low and high nibbles of the row's bytes).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace {
namespace simd_vnni {

template <WeightFormat F>
constexpr int kChunk = F == WeightFormat::Affine4 ? 128 : 64;  // columns per 64-byte load

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// Up to 16 consecutive f32 / f16 / bf16 values from element `first`, as
// f32 (lanes outside `mask` zero).
inline __m512 load16(const uint8_t* p, DType dt, size_t first, __mmask16 mask) {
  if (dt == DType::BF16)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p + 2 * first)), 16));
  if (dt == DType::F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p + 2 * first));
  return _mm512_maskz_loadu_ps(mask, p + 4 * first);
}

// Rows [r0, r1) against NT quantized input rows: xi (int8 codes, xi_stride
// apart; Wide: the 16-bit codes' high bytes, then their low bytes, each
// `cols` long), xs (their per-group scales, xs_stride apart, 16 floats of
// room after the last group) and xsum (f32 group sums, `groups` apart).
template <WeightFormat F, bool Wide, int NT>
void rows(const Matrix& w, const int8_t* xi, size_t xi_stride, const float* xs, size_t xs_stride,
          const float* xsum, size_t r0, size_t r1, float* y, size_t y_stride) {
  constexpr int C = kChunk<F>;
  constexpr int per_lane = C / 16;
  const int gs = w.group_size, groups = w.cols / gs, chunks = w.cols / C;
  const size_t row_bytes = w.row_bytes();
  alignas(64) int lane_group[16];
  for (int l = 0; l < 16; ++l) lane_group[l] = gs >= C ? 0 : l * per_lane / gs;
  const __m512i gidx = _mm512_load_si512(lane_group);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  thread_local std::vector<float> comb;
  comb.resize(size_t(NT) * (groups + 16));
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* src = w.data + row_bytes * r;
    // Per group: weight scale x input scale (comb), and the bias term
    // bias . sum(x), 16 groups at a time.
    __m512 acc[NT], tailv[NT];
    for (int t = 0; t < NT; ++t) tailv[t] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g += 16) {
      const __mmask16 m = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      const __m512 wsv = load16(w.scales, w.scale_dtype, r * groups + g, m);
      const __m512 wbv = load16(w.biases, w.scale_dtype, r * groups + g, m);
      for (int t = 0; t < NT; ++t) {
        _mm512_storeu_ps(&comb[size_t(t) * (groups + 16) + g],
                         _mm512_mul_ps(wsv, _mm512_maskz_loadu_ps(m, xs + t * xs_stride + g)));
        tailv[t] = _mm512_fmadd_ps(wbv, _mm512_maskz_loadu_ps(m, xsum + size_t(t) * groups + g), tailv[t]);
      }
    }
    float tail[NT];
    for (int t = 0; t < NT; ++t) {
      tail[t] = hsum(tailv[t]);
      acc[t] = _mm512_setzero_ps();
    }
    for (int ch = 0; ch < chunks; ++ch) {
      const __m512i b = _mm512_loadu_si512(src + size_t(ch) * 64);
      const int g0 = ch * C / gs;
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const int8_t* xt = xi + t * xi_stride + size_t(ch) * C;
        auto part = [&](const int8_t* p) {
          if constexpr (F == WeightFormat::Affine4) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(b, nib), _mm512_loadu_si512(p));
            return _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(b, 4), nib), _mm512_loadu_si512(p + 64));
          } else {
            return _mm512_dpbusd_epi32(_mm512_setzero_si512(), b, _mm512_loadu_si512(p));
          }
        };
        __m512i d = part(xt);
        if constexpr (Wide) d = _mm512_add_epi32(_mm512_slli_epi32(d, 8), part(xt + w.cols));
        const __m512 sc = _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(&comb[size_t(t) * (groups + 16) + g0]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = hsum(acc[t]) + tail[t];
  }
}

template <WeightFormat F, bool Wide>
void rows_all(const Matrix& w, const int8_t* xi, size_t xi_stride, const float* xs, size_t xs_stride,
              const float* xsum, size_t groups, int T, size_t r0, size_t r1, float* y, size_t y_stride) {
  for (int t0 = 0; t0 < T; t0 += 4) {
    const int n = std::min(4, T - t0);
    const int8_t* x0 = xi + size_t(t0) * xi_stride;
    const float *s0 = xs + size_t(t0) * xs_stride, *m0 = xsum + size_t(t0) * groups;
    float* y0 = y + size_t(t0) * y_stride;
    switch (n) {
      case 1: rows<F, Wide, 1>(w, x0, xi_stride, s0, xs_stride, m0, r0, r1, y0, y_stride); break;
      case 2: rows<F, Wide, 2>(w, x0, xi_stride, s0, xs_stride, m0, r0, r1, y0, y_stride); break;
      case 3: rows<F, Wide, 3>(w, x0, xi_stride, s0, xs_stride, m0, r0, r1, y0, y_stride); break;
      default: rows<F, Wide, 4>(w, x0, xi_stride, s0, xs_stride, m0, r0, r1, y0, y_stride); break;
    }
  }
}

void rows_any(const Matrix& w, bool wide, const int8_t* xi, size_t xi_stride, const float* xs, size_t xs_stride,
              const float* xsum, size_t groups, int T, size_t r0, size_t r1, float* y, size_t y_stride) {
  using WF = WeightFormat;
  if (w.format == WF::Affine4) {
    if (wide) rows_all<WF::Affine4, true>(w, xi, xi_stride, xs, xs_stride, xsum, groups, T, r0, r1, y, y_stride);
    else rows_all<WF::Affine4, false>(w, xi, xi_stride, xs, xs_stride, xsum, groups, T, r0, r1, y, y_stride);
  } else {
    if (wide) rows_all<WF::Affine8, true>(w, xi, xi_stride, xs, xs_stride, xsum, groups, T, r0, r1, y, y_stride);
    else rows_all<WF::Affine8, false>(w, xi, xi_stride, xs, xs_stride, xsum, groups, T, r0, r1, y, y_stride);
  }
}

// One input row as the kernel takes it (quantize_inputs' codes, the same
// values): hi (and, wide, lo) planes, 4-bit rows' chunks split into even
// and odd columns. Needs group_size % 32 == 0 (a deinterleaved vector of 16
// lies in one group).
void quantize_row(const float* x, int cols, int gs, bool four_bit, bool wide, int max_code, int8_t* hi,
                  int8_t* lo, float* scales, std::vector<float>& inv) {
  const int groups = cols / gs;
  inv.resize(groups);
  const float top = static_cast<float>(max_code);
  for (int g = 0; g < groups; ++g) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < gs; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + g * gs + i)));
    const float amax = _mm512_reduce_max_ps(m);
    scales[g] = amax / top;
    inv[g] = amax > 0.f ? top / amax : 0.f;
  }
  const __m512i lim = _mm512_set1_epi32(max_code), nlim = _mm512_set1_epi32(-max_code);
  auto put = [&](__m512 v, int group, int at) {
    __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv[group])),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
    if (!wide) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + at), _mm512_cvtepi32_epi8(q));
      return;
    }
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
    const __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + at), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + at), _mm512_cvtepi32_epi8(l));
  };
  if (four_bit) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int c = 0; c < cols; c += 128)
      for (int k = 0; k < 4; ++k) {  // columns c + 32k .. c + 32k + 31
        const __m512 a = _mm512_loadu_ps(x + c + 32 * k), b = _mm512_loadu_ps(x + c + 32 * k + 16);
        const int group = (c + 32 * k) / gs;
        put(_mm512_permutex2var_ps(a, even, b), group, c + 16 * k);
        put(_mm512_permutex2var_ps(a, odd, b), group, c + 64 + 16 * k);
      }
  } else {
    for (int c = 0; c < cols; c += 16) put(_mm512_loadu_ps(x + c), c / gs, c);
  }
}

}  // namespace simd_vnni
}  // namespace
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace {

MatmulIsa cpu_isa() {
#ifdef LILY_CPU_X86
  static const MatmulIsa isa = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
      return MatmulIsa::Portable;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return MatmulIsa::Avx512;
    return MatmulIsa::Avx2;
  }();
  return isa;
#else
  return MatmulIsa::Portable;
#endif
}

// The cap on the instruction set (set_matmul_isa; -1: from LILY_CPU_SIMD).
std::atomic<int> g_isa_cap{-1};

// 4-bit inputs for the AVX-512 kernel: each block of 16 in loadw's lane
// order (lane 2i: column i, lane 2i + 1: column 8 + i).
void permute16(const float* x, int T, size_t x_stride, int cols, std::vector<float>& out) {
  out.resize(size_t(T) * cols);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < cols; c += 16)
      for (int i = 0; i < 8; ++i) {
        out[size_t(t) * cols + c + 2 * i] = x[size_t(t) * x_stride + c + i];
        out[size_t(t) * cols + c + 2 * i + 1] = x[size_t(t) * x_stride + c + 8 + i];
      }
}

}  // namespace

const char* matmul_isa_name(MatmulIsa isa) {
  switch (isa) {
    case MatmulIsa::Avx2: return "avx2";
    case MatmulIsa::Avx512: return "avx512";
    default: return "portable";
  }
}

void set_matmul_isa(MatmulIsa cap) { g_isa_cap = static_cast<int>(cap); }

MatmulIsa matmul_isa() {
  int cap = g_isa_cap.load();
  if (cap < 0) {
    const char* e = std::getenv("LILY_CPU_SIMD");
    const std::string v = e ? e : "";
    cap = v == "0" || v == "portable" ? 0 : v == "avx2" ? 1 : 2;
    g_isa_cap = cap;
  }
  return static_cast<MatmulIsa>(std::min(cap, static_cast<int>(cpu_isa())));
}

void quantize_inputs(const float* x, int cols, int group_size, int max_code, int32_t* codes, float* scales) {
  const float top = static_cast<float>(max_code);
  for (int g = 0; g * group_size < cols; ++g) {
    const float* xg = x + size_t(g) * group_size;
    float amax = 0.f;
    for (int i = 0; i < group_size; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float inv = amax > 0.f ? top / amax : 0.f;
    scales[g] = amax / top;
    for (int i = 0; i < group_size; ++i) {
      const float q = std::nearbyint(xg[i] * inv);
      codes[size_t(g) * group_size + i] = static_cast<int32_t>(std::clamp(q, -top, top));
    }
  }
}

IntKernel integer_kernel() {
#ifdef LILY_CPU_X86
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  const MatmulIsa isa = matmul_isa();
  if (isa == MatmulIsa::Avx512 && vnni) return IntKernel::Avx512Vnni;
  if (isa >= MatmulIsa::Avx2) return IntKernel::Avx2;
#endif
  return IntKernel::None;
}

const char* integer_kernel_name(IntKernel k) {
  switch (k) {
    case IntKernel::Avx512Vnni: return "avx512-vnni";
    case IntKernel::Avx2: return "avx2";
    default: return "none";
  }
}

bool integer_inputs_fit(const Matrix& w, IntKernel k) {
  if (k == IntKernel::None || !w.quantized() || w.group_size <= 0 || w.cols % w.group_size != 0) return false;
  if (k == IntKernel::Avx2 && w.format != WeightFormat::Affine4) return false;  // VPMADDUBSW would saturate
  const int chunk = k == IntKernel::Avx2 ? 64 : w.format == WeightFormat::Affine4 ? 128 : 64;
  const int lanes = k == IntKernel::Avx2 ? 8 : 16;
  const int per_lane = chunk / lanes;
  return w.cols % chunk == 0 && (w.group_size % chunk == 0 || chunk % w.group_size == 0) &&
         w.group_size % per_lane == 0;
}

void matmul_many(ThreadPool& pool, std::span<const MatmulJob> jobs, ActPrecision act) {
  // Per job: its kernel, the group sums of its inputs (SIMD, quantized), the
  // permuted inputs (AVX-512, 4-bit) or the 8-bit ones (q8), its first row
  // in the combined range.
  struct Prep {
    MatmulIsa isa = MatmulIsa::Portable;
    IntKernel ik = IntKernel::None;  // integer inputs through this kernel (None: f32 inputs)
    size_t groups = 0;
    std::vector<float> xsum, xperm, xs;
    std::vector<int8_t> xi;
    const Prep* inputs = nullptr;  // the prep whose inputs this job reads (itself, or an earlier job's: the same x)
  };
  const IntKernel want_ik = act != ActPrecision::F32 ? integer_kernel() : IntKernel::None;
  const bool wide = act == ActPrecision::Q16;
  const int max_code = wide ? kMaxCode16 : 127;
  std::vector<Prep> prep(jobs.size());
  std::vector<size_t> first(jobs.size() + 1, 0);
  size_t grain = SIZE_MAX;
  [[maybe_unused]] const MatmulIsa isa = matmul_isa();
  for (size_t j = 0; j < jobs.size(); ++j) {
    const MatmulJob& J = jobs[j];
    const Matrix& w = *J.w;
    const int T = J.T > 0 && w.rows > 0 ? J.T : 0;
    first[j + 1] = first[j] + (T > 0 ? w.rows : 0);
    if (T == 0) continue;
    Prep& P = prep[j];
    P.inputs = &P;
#ifdef LILY_CPU_X86
    if (isa == MatmulIsa::Avx512 && simd_avx512::fits(w)) P.isa = MatmulIsa::Avx512;
    else if (isa >= MatmulIsa::Avx2 && simd_avx2::fits(w)) P.isa = MatmulIsa::Avx2;
    if (P.isa != MatmulIsa::Portable && integer_inputs_fit(w, want_ik)) {
      P.ik = want_ik;
      if (P.ik == IntKernel::Avx2) P.isa = MatmulIsa::Avx2;  // also on AVX-512 CPUs without VNNI
    }
    if (P.ik != IntKernel::None) {
      // An earlier job with the same inputs in the same layout (a layer's
      // q / k / v, an expert's gate and up) lends its codes.
      for (size_t k = 0; k < j; ++k) {
        const Prep& Q = prep[k];
        const MatmulJob& K = jobs[k];
        if (Q.ik == P.ik && Q.inputs == &Q && K.x == J.x && K.x_stride == J.x_stride && K.T == J.T &&
            K.w->cols == w.cols && K.w->group_size == w.group_size && K.w->format == w.format) {
          P.inputs = &Q;
          break;
        }
      }
    }
    if (P.ik != IntKernel::None && P.inputs == &P) {
      // Codes in the kernel's order (4-bit: per 128 columns the even ones,
      // then the odd ones), scales with 16 floats of room. Wide: a 16-bit
      // code as two int8 parts, hi = floor((code + 128) / 256) and lo =
      // code - 256 hi, each plane `cols` long.
      const size_t groups = w.cols / w.group_size;
      const size_t planes = wide ? 2 : 1;
      const bool four_bit = w.format == WeightFormat::Affine4;
      const int chunk = P.ik == IntKernel::Avx2 ? 64 : 128;  // 4-bit: columns per even / odd split
      P.xi.resize(size_t(T) * planes * w.cols);
      P.xs.assign(size_t(T) * (groups + 16), 0.f);
      std::vector<int32_t> codes;
      std::vector<float> inv;
      for (int t = 0; t < T; ++t) {
        const float* xt = J.x + size_t(t) * J.x_stride;
        int8_t* hi = &P.xi[size_t(t) * planes * w.cols];
        int8_t* lo = hi + w.cols;
        float* scales = &P.xs[size_t(t) * (groups + 16)];
        if (P.ik == IntKernel::Avx512Vnni && w.group_size % 32 == 0) {
          simd_vnni::quantize_row(xt, w.cols, w.group_size, four_bit, wide, max_code, hi, lo, scales, inv);
          continue;
        }
        codes.resize(w.cols);
        quantize_inputs(xt, w.cols, w.group_size, max_code, codes.data(), scales);
        auto put = [&](int at, int32_t code) {
          if (!wide) {
            hi[at] = static_cast<int8_t>(code);
            return;
          }
          const int32_t h = (code + 128) >> 8;  // floor division by 256
          hi[at] = static_cast<int8_t>(h);
          lo[at] = static_cast<int8_t>(code - 256 * h);
        };
        if (four_bit) {
          const int half = chunk / 2;
          for (int c = 0; c < w.cols; c += chunk)
            for (int i = 0; i < half; ++i) {
              put(c + i, codes[c + 2 * i]);
              put(c + half + i, codes[c + 2 * i + 1]);
            }
        } else {
          for (int c = 0; c < w.cols; ++c) put(c, codes[c]);
        }
      }
    } else if (P.isa == MatmulIsa::Avx512 && w.format == WeightFormat::Affine4) {
      permute16(J.x, T, J.x_stride, w.cols, P.xperm);
    }
#endif
    if (P.isa != MatmulIsa::Portable && w.quantized()) P.groups = w.cols / w.group_size;
    if (P.isa != MatmulIsa::Portable && w.quantized() && P.inputs == &P) {
      P.xsum.resize(size_t(T) * P.groups);
      for (int t = 0; t < T; ++t)
        for (size_t g = 0; g < P.groups; ++g) {
          const float* xg = J.x + size_t(t) * J.x_stride + g * w.group_size;
          float sum = 0.f;
          for (int i = 0; i < w.group_size; ++i) sum += xg[i];
          P.xsum[size_t(t) * P.groups + g] = sum;
        }
    }
    // Rows per task: SIMD ~16 KB of weights and at least 8 rows; portable,
    // enough rows that the per-task overhead stays small.
    const size_t g = P.isa != MatmulIsa::Portable
                         ? std::max<size_t>(8, (16u << 10) / std::max<size_t>(1, w.row_bytes()))
                         : std::max<size_t>(1, 16384 / std::max(1, w.cols));
    grain = std::min(grain, g);
  }
  const size_t total = first.back();
  if (total == 0) return;
  pool.parallel_for(total, grain, [&](size_t b, size_t e) {
    size_t j = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (; b < e; ++j) {
      const size_t r0 = b - first[j], r1 = std::min(e, first[j + 1]) - first[j];
      b = first[j] + r1;
      if (r1 <= r0) continue;
      const MatmulJob& J = jobs[j];
      const Prep& P = prep[j];
      [[maybe_unused]] const float* xsum = P.inputs->xsum.empty() ? nullptr : P.inputs->xsum.data();
      switch (P.isa) {
#ifdef LILY_CPU_X86
        case MatmulIsa::Avx512:
          if (P.ik == IntKernel::Avx512Vnni)
            simd_vnni::rows_any(*J.w, wide, P.inputs->xi.data(), J.w->cols * (wide ? 2 : 1), P.inputs->xs.data(),
                                P.groups + 16, xsum, P.groups, J.T, r0, r1, J.y, J.y_stride);
          else if (!P.xperm.empty())
            simd_avx512::rows_any(*J.w, P.xperm.data(), J.T, J.w->cols, xsum, P.groups, r0, r1, J.y, J.y_stride);
          else
            simd_avx512::rows_any(*J.w, J.x, J.T, J.x_stride, xsum, P.groups, r0, r1, J.y, J.y_stride);
          break;
        case MatmulIsa::Avx2:
          if (P.ik == IntKernel::Avx2)
            simd_avx2::ints::rows_any(*J.w, wide, P.inputs->xi.data(), J.w->cols * (wide ? 2 : 1), P.inputs->xs.data(),
                                      P.groups + 16, xsum, P.groups, J.T, r0, r1, J.y, J.y_stride);
          else
            simd_avx2::rows_any(*J.w, J.x, J.T, J.x_stride, xsum, P.groups, r0, r1, J.y, J.y_stride);
          break;
#endif
        default: rows_generic(*J.w, J.x, J.T, J.x_stride, r0, r1, J.y, J.y_stride);
      }
    }
  });
}

void attention_scores(const float* q, size_t q_stride, int G, const float* k, size_t kv_row, int n, int hd,
                      float scale, float* s) {
#ifdef LILY_CPU_X86
  switch (matmul_isa()) {
    case MatmulIsa::Avx512: return simd_avx512::attn_scores(q, q_stride, G, k, kv_row, n, hd, scale, s);
    case MatmulIsa::Avx2: return simd_avx2::attn_scores(q, q_stride, G, k, kv_row, n, hd, scale, s);
    default: break;
  }
#endif
  for (int p = 0; p < n; ++p)
    for (int g = 0; g < G; ++g) s[size_t(g) * n + p] = dot_portable(q + g * q_stride, k + p * kv_row, hd) * scale;
}

void attention_values(const float* w, int G, int n, const float* v, size_t kv_row, int hd, float* o,
                      size_t o_stride) {
#ifdef LILY_CPU_X86
  switch (matmul_isa()) {
    case MatmulIsa::Avx512: return simd_avx512::attn_values(w, G, n, v, kv_row, hd, o, o_stride);
    case MatmulIsa::Avx2: return simd_avx2::attn_values(w, G, n, v, kv_row, hd, o, o_stride);
    default: break;
  }
#endif
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < n; ++p) {
      const float wp = w[size_t(g) * n + p];
      const float* vp = v + p * kv_row;
      float* og = o + g * o_stride;
      for (int x = 0; x < hd; ++x) og[x] += wp * vp[x];
    }
}

float exp_shift_sum(float* s, int n, float m) {
#ifdef LILY_CPU_X86
  switch (matmul_isa()) {
    case MatmulIsa::Avx512: return simd_avx512::exp_shift_sum(s, n, m);
    case MatmulIsa::Avx2: return simd_avx2::exp_shift_sum(s, n, m);
    default: break;
  }
#endif
  float sum = 0;
  for (int i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
  return sum;
}

void matmul(ThreadPool& pool, const Matrix& w, const float* x, int T, size_t x_stride, float* y,
            size_t y_stride, ActPrecision act) {
  const MatmulJob job{&w, x, T, x_stride, y, y_stride};
  matmul_many(pool, std::span<const MatmulJob>(&job, 1), act);
}

}  // namespace lily::cpu

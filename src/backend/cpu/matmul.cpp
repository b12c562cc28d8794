#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/half.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LILY_CPU_AVX2 1
#include <immintrin.h>
#endif

namespace lily::cpu {

namespace {

inline float load_scale(const uint8_t* p, DType dt, size_t i) {
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
        const float scale = load_scale(w.scales, w.scale_dtype, g0 + g);
        const float bias = load_scale(w.biases, w.scale_dtype, g0 + g);
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
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * x_stride;
      // Eight partial sums let the compiler vectorise without -ffast-math.
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int c = 0;
      for (; c + 8 <= cols; c += 8)
        for (int j = 0; j < 8; ++j) acc[j] += wr[c + j] * xt[c + j];
      float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; c < cols; ++c) s += wr[c] * xt[c];
      y[t * y_stride + r] = s;
    }
  }
}

#ifdef LILY_CPU_AVX2
// The AVX2 + FMA path (chosen at run time): weights are decoded eight at a
// time in registers and never stored, for up to eight input rows at once, so
// a decode step reads each weight byte once and does ~1 instruction per
// weight per input row. A quantized row's sum is taken per group as
// scale * sum(q x) + bias * sum(x) (the group sums of x computed once per
// call), in f32 like the portable path; the two differ only in summation
// order.
#define LILY_AVX2_FN __attribute__((target("avx2,fma,f16c")))

// Eight weights of row `src` from column c (a multiple of 8): their codes
// (quantized formats) or their values.
template <WeightFormat F>
LILY_AVX2_FN inline __m256 load8(const uint8_t* src, int c) {
  if constexpr (F == WeightFormat::Affine4) {
    uint32_t word;
    std::memcpy(&word, src + c / 2, 4);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), sh),
                                       _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(q);
  } else if constexpr (F == WeightFormat::Affine8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else if constexpr (F == WeightFormat::BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * size_t(c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == WeightFormat::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * size_t(c))));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * size_t(c)));
  }
}

LILY_AVX2_FN inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight value of a row at column c (the unquantized formats' tails).
template <WeightFormat F>
inline float load1(const uint8_t* src, int c) {
  uint16_t h;
  if constexpr (F == WeightFormat::F32) {
    float f;
    std::memcpy(&f, src + 4 * size_t(c), 4);
    return f;
  } else {
    std::memcpy(&h, src + 2 * size_t(c), 2);
    return F == WeightFormat::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
}

// Rows [r0, r1) against NT input rows (x: the first; xsum: their group sums,
// groups per row apart). U independent accumulators per input row hide the
// FMA latency when NT is small.
template <WeightFormat F, int NT>
LILY_AVX2_FN void rows_avx2(const Matrix& w, const float* x, size_t x_stride, const float* xsum, size_t r0,
                            size_t r1, float* y, size_t y_stride) {
  constexpr int U = NT == 1 ? 4 : NT == 2 ? 2 : 1;
  constexpr bool kQuant = F == WeightFormat::Affine4 || F == WeightFormat::Affine8;
  const int cols = w.cols;
  const size_t row_bytes = w.row_bytes();
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* src = w.data + row_bytes * r;
    __m256 racc[NT][U];
    float tail[NT];
    #pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      tail[t] = 0.f;
      #pragma GCC unroll 8
      for (int u = 0; u < U; ++u) racc[t][u] = _mm256_setzero_ps();
    }
    if constexpr (kQuant) {
      const int gs = w.group_size, groups = cols / gs;
      const size_t g0 = size_t(groups) * r;
      for (int g = 0; g < groups; ++g) {
        __m256 gacc[NT][U];
        #pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
          #pragma GCC unroll 8
          for (int u = 0; u < U; ++u) gacc[t][u] = _mm256_setzero_ps();
        const int c0 = g * gs, c1 = c0 + gs;
        int c = c0;
        for (; c + 8 * U <= c1; c += 8 * U)
          #pragma GCC unroll 8
          for (int u = 0; u < U; ++u) {
            const __m256 q = load8<F>(src, c + 8 * u);
            #pragma GCC unroll 8
            for (int t = 0; t < NT; ++t)
              gacc[t][u] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x + t * x_stride + c + 8 * u), gacc[t][u]);
          }
        for (; c < c1; c += 8) {
          const __m256 q = load8<F>(src, c);
          #pragma GCC unroll 8
          for (int t = 0; t < NT; ++t)
            gacc[t][0] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x + t * x_stride + c), gacc[t][0]);
        }
        const float scale = load_scale(w.scales, w.scale_dtype, g0 + g);
        const float bias = load_scale(w.biases, w.scale_dtype, g0 + g);
        const __m256 sv = _mm256_set1_ps(scale);
        #pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          #pragma GCC unroll 8
          for (int u = 0; u < U; ++u) racc[t][u] = _mm256_fmadd_ps(sv, gacc[t][u], racc[t][u]);
          tail[t] += bias * xsum[size_t(t) * groups + g];
        }
      }
    } else {
      int c = 0;
      for (; c + 8 * U <= cols; c += 8 * U)
        #pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const __m256 v = load8<F>(src, c + 8 * u);
          #pragma GCC unroll 8
          for (int t = 0; t < NT; ++t)
            racc[t][u] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * x_stride + c + 8 * u), racc[t][u]);
        }
      for (; c + 8 <= cols; c += 8) {
        const __m256 v = load8<F>(src, c);
        #pragma GCC unroll 8
        for (int t = 0; t < NT; ++t)
          racc[t][0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * x_stride + c), racc[t][0]);
      }
      for (; c < cols; ++c) {
        const float v = load1<F>(src, c);
        #pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) tail[t] += v * x[t * x_stride + c];
      }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      __m256 a = racc[t][0];
      #pragma GCC unroll 8
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, racc[t][u]);
      y[t * y_stride + r] = hsum(a) + tail[t];
    }
  }
}

// Input rows in blocks of kMaxNT (the block's x stays in L1 / L2 while the
// task's rows go by; each weight is decoded once per block); NT for the last.
// A quantized row keeps two accumulators per input row (its group's and its
// own), so fewer input rows fit the 16 vector registers.
template <WeightFormat F>
constexpr int kMaxNT = F == WeightFormat::Affine4 || F == WeightFormat::Affine8 ? 4 : 8;
template <WeightFormat F, int NT = 1>
void rows_block(int n, const Matrix& w, const float* x, size_t x_stride, const float* xsum, size_t r0, size_t r1,
                float* y, size_t y_stride) {
  if constexpr (NT < kMaxNT<F>) {
    if (n > NT) return rows_block<F, NT + 1>(n, w, x, x_stride, xsum, r0, r1, y, y_stride);
  }
  rows_avx2<F, NT>(w, x, x_stride, xsum, r0, r1, y, y_stride);
}
template <WeightFormat F>
void rows_all_tokens(const Matrix& w, const float* x, int T, size_t x_stride, const float* xsum, size_t groups,
                     size_t r0, size_t r1, float* y, size_t y_stride) {
  for (int t0 = 0; t0 < T; t0 += kMaxNT<F>) {
    const float* st = xsum ? xsum + size_t(t0) * groups : nullptr;
    rows_block<F>(std::min(kMaxNT<F>, T - t0), w, x + size_t(t0) * x_stride, x_stride, st, r0, r1,
                  y + size_t(t0) * y_stride, y_stride);
  }
}

bool cpu_has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

bool simd_fits(const Matrix& w) {
  return !w.quantized() || (w.group_size > 0 && w.group_size % 8 == 0 && w.cols % w.group_size == 0);
}

void rows_avx2_any(const Matrix& w, const float* x, int T, size_t x_stride, const float* xsum, size_t groups,
                   size_t r0, size_t r1, float* y, size_t y_stride) {
  switch (w.format) {
    case WeightFormat::Affine4:
      return rows_all_tokens<WeightFormat::Affine4>(w, x, T, x_stride, xsum, groups, r0, r1, y, y_stride);
    case WeightFormat::Affine8:
      return rows_all_tokens<WeightFormat::Affine8>(w, x, T, x_stride, xsum, groups, r0, r1, y, y_stride);
    case WeightFormat::BF16:
      return rows_all_tokens<WeightFormat::BF16>(w, x, T, x_stride, xsum, groups, r0, r1, y, y_stride);
    case WeightFormat::F16:
      return rows_all_tokens<WeightFormat::F16>(w, x, T, x_stride, xsum, groups, r0, r1, y, y_stride);
    case WeightFormat::F32:
      return rows_all_tokens<WeightFormat::F32>(w, x, T, x_stride, xsum, groups, r0, r1, y, y_stride);
  }
}
#endif

// LILY_CPU_SIMD=0 turns the SIMD path off (A/B); set_matmul_simd overrides.
std::atomic<int> g_simd{-1};

}  // namespace

void set_matmul_simd(bool on) { g_simd = on ? 1 : 0; }

bool matmul_simd_active() {
#ifdef LILY_CPU_AVX2
  int s = g_simd.load();
  if (s < 0) {
    const char* e = std::getenv("LILY_CPU_SIMD");
    s = (e && std::string(e) == "0") ? 0 : 1;
    g_simd = s;
  }
  return s == 1 && cpu_has_avx2();
#else
  return false;
#endif
}

void matmul_many(ThreadPool& pool, std::span<const MatmulJob> jobs) {
  // Per job: its path, the group sums of its inputs (SIMD, quantized), its
  // first row in the combined row range.
  struct Prep {
    bool simd = false;
    size_t groups = 0;
    std::vector<float> xsum;
  };
  std::vector<Prep> prep(jobs.size());
  std::vector<size_t> first(jobs.size() + 1, 0);
  size_t grain = SIZE_MAX;
  [[maybe_unused]] const bool simd = matmul_simd_active();
  for (size_t j = 0; j < jobs.size(); ++j) {
    const MatmulJob& J = jobs[j];
    const Matrix& w = *J.w;
    const int T = J.T > 0 && w.rows > 0 ? J.T : 0;
    first[j + 1] = first[j] + (T > 0 ? w.rows : 0);
    if (T == 0) continue;
    Prep& P = prep[j];
#ifdef LILY_CPU_AVX2
    P.simd = simd && simd_fits(w);
#endif
    if (P.simd && w.quantized()) {
      P.groups = w.cols / w.group_size;
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
    const size_t g = P.simd ? std::max<size_t>(8, (16u << 10) / std::max<size_t>(1, w.row_bytes()))
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
#ifdef LILY_CPU_AVX2
      if (prep[j].simd) {
        rows_avx2_any(*J.w, J.x, J.T, J.x_stride, prep[j].xsum.empty() ? nullptr : prep[j].xsum.data(),
                      prep[j].groups, r0, r1, J.y, J.y_stride);
        continue;
      }
#endif
      rows_generic(*J.w, J.x, J.T, J.x_stride, r0, r1, J.y, J.y_stride);
    }
  });
}

void matmul(ThreadPool& pool, const Matrix& w, const float* x, int T, size_t x_stride, float* y,
            size_t y_stride) {
  const MatmulJob job{&w, x, T, x_stride, y, y_stride};
  matmul_many(pool, std::span<const MatmulJob>(&job, 1));
}

}  // namespace lily::cpu

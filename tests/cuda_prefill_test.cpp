// Prefill CUDA kernels (src/backend/cuda/prefill*.cu) against CPU references
// on random inputs at sizes that are not multiples of the tiles. Every test
// skips when no CUDA device is present (CI builds with nvcc but has no GPU).
// LILY_PREFILL_BENCH=1 also runs the timing tests (CudaPrefillBench.*) at the
// model's real shapes; they print a table and check nothing but sanity.
#include <gtest/gtest.h>

#ifdef LILY_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <tuple>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/prefill.h"
#include "core/error.h"
#include "core/half.h"

namespace lily::cuda {
namespace {

#define REQUIRE_GPU() \
  if (!::lily::cuda_device_available()) GTEST_SKIP() << ::lily::cuda_unavailable_reason()

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " " + cudaGetErrorString(e));
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  Dev() = default;
  explicit Dev(size_t n) : bytes(n) { ck(cudaMalloc(&p, std::max<size_t>(n, 16)), "cudaMalloc"); }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev(Dev&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};
template <typename T>
Dev upload(const std::vector<T>& v) {
  Dev d(v.size() * sizeof(T));
  ck(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}
template <typename T>
std::vector<T> download(const Dev& d, size_t count) {
  std::vector<T> v(count);
  ck(cudaDeviceSynchronize(), "kernel execution");
  ck(cudaMemcpy(v.data(), d.p, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}
void sync() { ck(cudaDeviceSynchronize(), "kernel execution"); }

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float((next() >> 40) * (1.0 / 16777216.0)); }
  float normal() {
    const double u1 = ((next() >> 11) + 1.0) * (1.0 / 9007199254740993.0), u2 = (next() >> 11) * (1.0 / 9007199254740992.0);
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

// Random bf16 values (bits) and their f32 values.
void random_bf16(Rng& r, size_t n, float scale, std::vector<uint16_t>& bits, std::vector<float>& vals) {
  bits.resize(n);
  vals.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = f32_to_bf16(r.normal() * scale);
    vals[i] = bf16_to_f32(bits[i]);
  }
}

uint16_t f32_to_f16(float f) {  // round to nearest, normal range only (test scales)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  int exp = int((b >> 23) & 0xff) - 127 + 15;
  uint32_t mant = b & 0x7fffffu;
  if (exp <= 0) return uint16_t(sign);
  uint32_t h = sign | (uint32_t(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(h);
}

// A random weight in the prefill layout plus its dequantized f32 values
// (scale * q + bias, as cpu::dequantize_row computes them).
struct HostWeight {
  PrefillWeightFormat fmt;
  int rows, cols;
  bool sb_f16 = false;
  std::vector<uint32_t> data;  // codes, or bf16 pairs
  std::vector<uint32_t> sb;
  std::vector<float> deq;      // [rows][cols]
};
HostWeight make_weight(Rng& r, PrefillWeightFormat fmt, int rows, int cols, bool sb_f16 = false) {
  HostWeight w{fmt, rows, cols, sb_f16, {}, {}, {}};
  w.deq.resize(size_t(rows) * cols);
  if (fmt == PrefillWeightFormat::BF16) {
    w.data.resize(size_t(rows) * cols / 2);
    uint16_t* d = reinterpret_cast<uint16_t*>(w.data.data());
    for (size_t i = 0; i < w.deq.size(); ++i) {
      d[i] = f32_to_bf16(r.normal() * 0.05f);
      w.deq[i] = bf16_to_f32(d[i]);
    }
    return w;
  }
  const int bits = fmt == PrefillWeightFormat::Q4 ? 4 : 8;
  const int qmax = (1 << bits) - 1;
  const int groups = cols / 64;
  w.data.assign(size_t(rows) * cols * bits / 32, 0u);
  w.sb.resize(size_t(rows) * groups);
  for (int n = 0; n < rows; ++n)
    for (int g = 0; g < groups; ++g) {
      float scale = r.uniform(0.5f, 1.5f) * (bits == 4 ? 0.02f : 0.0015f);
      float bias = -scale * qmax * 0.5f + r.uniform(-0.01f, 0.01f);
      uint16_t sbits, bbits;
      if (sb_f16) {
        sbits = f32_to_f16(scale);
        bbits = f32_to_f16(bias);
        scale = f16_to_f32(sbits);
        bias = f16_to_f32(bbits);
      } else {
        sbits = f32_to_bf16(scale);
        bbits = f32_to_bf16(bias);
        scale = bf16_to_f32(sbits);
        bias = bf16_to_f32(bbits);
      }
      w.sb[size_t(n) * groups + g] = uint32_t(sbits) | (uint32_t(bbits) << 16);
      for (int i = 0; i < 64; ++i) {
        const int c = g * 64 + i;
        const uint32_t q = uint32_t(r.next() % (qmax + 1));
        const size_t bit = (size_t(n) * cols + c) * bits;
        w.data[bit / 32] |= q << (bit % 32);
        w.deq[size_t(n) * cols + c] = scale * static_cast<float>(q) + bias;
      }
    }
  return w;
}

// Gate and up stacks (E experts of rows x cols each, q4 / q8) as one stack
// with each expert's rows interleaved: gate i at row 2i, up i at 2i + 1 (the
// decode upload's layout).
HostWeight interleave_rows(const HostWeight& g, const HostWeight& u, int E) {
  HostWeight w{g.fmt, 2 * g.rows, g.cols, g.sb_f16, {}, {}, {}};
  const int bits = g.fmt == PrefillWeightFormat::Q4 ? 4 : 8;
  const size_t wpr = size_t(g.cols) * bits / 32, spr = size_t(g.cols) / 64, rows = size_t(g.rows) / E;
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < rows; ++i)
      for (const HostWeight* src : {&g, &u}) {
        const size_t r = e * rows + i;
        w.data.insert(w.data.end(), src->data.begin() + r * wpr, src->data.begin() + (r + 1) * wpr);
        w.sb.insert(w.sb.end(), src->sb.begin() + r * spr, src->sb.begin() + (r + 1) * spr);
      }
  return w;  // deq left empty: the references use g's and u's
}

struct DevWeight {
  Dev data, sb;
  PrefillWeight view;
};
DevWeight upload_weight(const HostWeight& h) {
  DevWeight d{upload(h.data), h.sb.empty() ? Dev() : upload(h.sb), {}};
  d.view.fmt = h.fmt;
  d.view.rows = h.rows;
  d.view.cols = h.cols;
  d.view.w = d.data.p;
  d.view.sb = h.sb.empty() ? nullptr : d.sb.as<uint32_t>();
  d.view.sb_f16 = h.sb_f16;
  return d;
}

// ||a - b|| / ||b||; NaN / Inf anywhere -> infinity.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - b[i];
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
std::vector<float> bf16_vec_to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_f32(v[i]);
  return r;
}

// y[t][n] = sum_k w[n][k] x[t][k], double accumulation.
std::vector<float> ref_matmul(const std::vector<float>& w, int N, int K, const std::vector<float>& x, int T) {
  std::vector<float> y(size_t(T) * N);
  for (int t = 0; t < T; ++t)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      const float* wr = &w[size_t(n) * K];
      const float* xr = &x[size_t(t) * K];
      for (int k = 0; k < K; ++k) s += double(wr[k]) * xr[k];
      y[size_t(t) * N + n] = float(s);
    }
  return y;
}

// bf16 inputs, f32 accumulation: ~1e-6 for bf16 weights. Quantized weights are
// rounded to bf16 after dequantization (the MMA takes bf16): ~2^-9/sqrt(3)
// relative per weight, ~1e-3 on a dot product of random terms.
constexpr double kTolExact = 1e-4;
constexpr double kTolQuant = 5e-3;

// expand: a scratch with min_rows 1, so quantized weights go through the
// expansion to bf16 first (PrefillScratch). ldy_pad: output row stride N +
// ldy_pad (odd: the element-wise stores of the TMA kernel's epilogue).
void run_gemm_case(PrefillWeightFormat fmt, int T, int N, int K, PrefillOut out_kind, bool sb_f16,
                   uint64_t seed, bool expand = false, int ldy_pad = 3) {
  SCOPED_TRACE(::testing::Message() << "fmt " << int(fmt) << " T " << T << " N " << N << " K " << K
                                    << " out " << int(out_kind) << " f16 " << sb_f16 << " expand " << expand);
  Dev scr(expand ? size_t(N) * K * 2 : 16);
  const PrefillScratch sc{expand ? scr.p : nullptr, scr.bytes, 1};
  Rng r(seed);
  HostWeight hw = make_weight(r, fmt, N, K, sb_f16);
  const size_t ldx = K + 8;  // a padded stride
  std::vector<uint16_t> xb;
  std::vector<float> xf;
  random_bf16(r, size_t(T) * ldx, 1.f, xb, xf);
  std::vector<float> xdense(size_t(T) * K);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) xdense[size_t(t) * K + k] = xf[size_t(t) * ldx + k];
  std::vector<float> ref = ref_matmul(hw.deq, N, K, xdense, T);
  DevWeight dw = upload_weight(hw);
  Dev x = upload(xb);
  const size_t ldy = N + ldy_pad;
  std::vector<float> got(size_t(T) * N);
  if (out_kind == PrefillOut::BF16) {
    std::vector<uint16_t> init(size_t(T) * ldy, 0x7FC0);  // NaN poison
    Dev y = upload(init);
    prefill_gemm(dw.view, x.as<uint16_t>(), T, ldx, y.p, ldy, out_kind, nullptr, sc);
    auto h = download<uint16_t>(y, init.size());
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < N; ++n) got[size_t(t) * N + n] = bf16_to_f32(h[size_t(t) * ldy + n]);
    // padding columns untouched
    for (int t = 0; t < T; ++t)
      for (size_t n = N; n < ldy; ++n) ASSERT_EQ(h[size_t(t) * ldy + n], 0x7FC0);
  } else {
    std::vector<float> init(size_t(T) * ldy);
    for (auto& v : init) v = out_kind == PrefillOut::F32Add ? r.uniform(-1, 1) : NAN;
    Dev y = upload(init);
    prefill_gemm(dw.view, x.as<uint16_t>(), T, ldx, y.p, ldy, out_kind, nullptr, sc);
    auto h = download<float>(y, init.size());
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < N; ++n) {
        float v = h[size_t(t) * ldy + n];
        if (out_kind == PrefillOut::F32Add) v -= init[size_t(t) * ldy + n];
        got[size_t(t) * N + n] = v;
      }
  }
  double tol = fmt == PrefillWeightFormat::BF16 ? kTolExact : kTolQuant;
  if (out_kind == PrefillOut::BF16) tol += 4e-3;  // output rounding, 2^-9 relative
  if (out_kind == PrefillOut::F32Add) tol += 1e-5;
  const double e = rel_err(got, ref);
  std::printf("  gemm fmt=%d T=%d N=%d K=%d out=%d f16=%d expand=%d: rel err %.3g\n", int(fmt), T, N, K,
              int(out_kind), int(sb_f16), int(expand), e);
  EXPECT_LT(e, tol);
}

TEST(CudaPrefillGemm, Bf16MatchesCpu) {
  REQUIRE_GPU();
  run_gemm_case(PrefillWeightFormat::BF16, 77, 200, 320, PrefillOut::F32, false, 1);
  run_gemm_case(PrefillWeightFormat::BF16, 33, 136, 192, PrefillOut::F32, false, 2);
  run_gemm_case(PrefillWeightFormat::BF16, 150, 72, 128, PrefillOut::BF16, false, 3);
}

// 128 rows and more: the TMA-fed warp-specialized kernel (prefill_gemm_tma.cu),
// 128- and 256-wide tiles, row and column tails, paired and single stores.
TEST(CudaPrefillGemm, Bf16ManyRowsMatchesCpu) {
  REQUIRE_GPU();
  run_gemm_case(PrefillWeightFormat::BF16, 300, 264, 320, PrefillOut::F32, false, 12, false, 0);
  run_gemm_case(PrefillWeightFormat::BF16, 129, 522, 192, PrefillOut::F32Add, false, 13, false, 2);
  run_gemm_case(PrefillWeightFormat::BF16, 200, 131, 256, PrefillOut::F32Add, false, 14, false, 3);
  run_gemm_case(PrefillWeightFormat::BF16, 700, 8200, 128, PrefillOut::BF16, false, 15, false, 0);
  run_gemm_case(PrefillWeightFormat::BF16, 1111, 5000, 64, PrefillOut::F32, false, 16, false, 1);
}

TEST(CudaPrefillGemm, Q4MatchesCpu) {
  REQUIRE_GPU();
  run_gemm_case(PrefillWeightFormat::Q4, 77, 200, 320, PrefillOut::F32, false, 4);
  run_gemm_case(PrefillWeightFormat::Q4, 33, 136, 192, PrefillOut::F32Add, false, 5);
  run_gemm_case(PrefillWeightFormat::Q4, 1, 130, 256, PrefillOut::F32, false, 6);
  run_gemm_case(PrefillWeightFormat::Q4, 5, 32, 2048, PrefillOut::F32, false, 7);
  run_gemm_case(PrefillWeightFormat::Q4, 257, 264, 128, PrefillOut::BF16, false, 8);
  run_gemm_case(PrefillWeightFormat::Q4, 70, 100, 192, PrefillOut::F32, true, 9);
}

TEST(CudaPrefillGemm, Q8MatchesCpu) {
  REQUIRE_GPU();
  run_gemm_case(PrefillWeightFormat::Q8, 77, 200, 320, PrefillOut::F32, false, 10);
  run_gemm_case(PrefillWeightFormat::Q8, 9, 256, 512, PrefillOut::F32Add, false, 11);
}

// Split-K (few output tiles, a long K): correct, and the same bits from
// one run to the next for F32 and F32Add outputs: the partial sums are
// added in the order of their k ranges (float atomics added them in arrival
// order, and two prefills of one prompt differed in the last bits).
TEST(CudaPrefillGemm, SplitKIsCorrectAndTheSameBitsEveryRun) {
  REQUIRE_GPU();
  struct Case {
    PrefillWeightFormat fmt;
    int T, N, K;
    PrefillOut out;
  };
  const Case cases[] = {
      {PrefillWeightFormat::Q4, 40, 200, 2368, PrefillOut::F32},
      {PrefillWeightFormat::Q4, 100, 1976, 4096, PrefillOut::F32Add},
      {PrefillWeightFormat::Q8, 33, 136, 1088, PrefillOut::F32Add},
      {PrefillWeightFormat::BF16, 77, 300, 2048, PrefillOut::F32},
      {PrefillWeightFormat::Q4, 33, 2100, 512, PrefillOut::F32Add},  // a short tile: 33 rows of 64
  };
  uint64_t seed = 40;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "fmt " << int(c.fmt) << " T " << c.T << " N " << c.N << " K " << c.K);
    run_gemm_case(c.fmt, c.T, c.N, c.K, c.out, false, seed++);
    Rng r(seed++);
    HostWeight hw = make_weight(r, c.fmt, c.N, c.K);
    DevWeight dw = upload_weight(hw);
    ASSERT_GT(prefill_gemm_k_splits(dw.view, c.T, c.out), 1) << "the case does not split: it tests nothing";
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    random_bf16(r, size_t(c.T) * c.K, 1.f, xb, xf);
    Dev x = upload(xb);
    std::vector<float> init(size_t(c.T) * c.N);
    for (auto& v : init) v = c.out == PrefillOut::F32Add ? r.uniform(-1, 1) : NAN;
    std::vector<float> first;
    int differ = 0;
    for (int run = 0; run < 20; ++run) {
      Dev y = upload(init);
      prefill_gemm(dw.view, x.as<uint16_t>(), c.T, c.K, y.p, c.N, c.out, nullptr);
      const std::vector<float> got = download<float>(y, init.size());
      if (run == 0) first = got;
      else differ += std::memcmp(got.data(), first.data(), got.size() * sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0) << "runs whose output differs from the first's in some bit";
  }
}

TEST(CudaPrefillGemm, SwigluMatchesCpu) {
  REQUIRE_GPU();
  // bf16 at 150 rows and at 1000 x 3200: the TMA kernel with 128- and 256-wide tiles.
  struct Case {
    PrefillWeightFormat fmt;
    int T, N, K;
  };
  for (const Case c : {Case{PrefillWeightFormat::Q4, 150, 96, 256}, Case{PrefillWeightFormat::BF16, 150, 96, 256},
                       Case{PrefillWeightFormat::BF16, 1000, 3200, 128}}) {
    const auto fmt = c.fmt;
    Rng r(20 + int(fmt) + c.T);
    const int T = c.T, N = c.N, K = c.K;
    HostWeight g = make_weight(r, fmt, N, K), u = make_weight(r, fmt, N, K);
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    random_bf16(r, size_t(T) * K, 1.f, xb, xf);
    auto rg = ref_matmul(g.deq, N, K, xf, T), ru = ref_matmul(u.deq, N, K, xf, T);
    std::vector<float> ref(rg.size());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = cpu::silu(rg[i]) * ru[i];
    DevWeight dg = upload_weight(g), du = upload_weight(u);
    Dev x = upload(xb);
    Dev h(size_t(T) * N * 2);
    ck(cudaMemset(h.p, 0xFF, h.bytes), "memset");
    prefill_gemm_swiglu(dg.view, du.view, x.as<uint16_t>(), T, K, h.as<uint16_t>(), N, nullptr);
    const double e = rel_err(bf16_vec_to_f32(download<uint16_t>(h, size_t(T) * N)), ref);
    std::printf("  swiglu fmt=%d T=%d N=%d: rel err %.3g\n", int(fmt), T, N, e);
    EXPECT_LT(e, 1e-2);
  }
}

// Gate / up rows interleaved in one q4 matrix (gate i at row 2i, up i at
// 2i + 1: the decode backend's fused SwiGLU upload), its two strided views,
// and the double reference silu(gate . x) * (up . x) [T][N].
struct InterleavedSwiglu {
  DevWeight d;
  PrefillWeight g, u;
  std::vector<float> ref;
};
InterleavedSwiglu make_interleaved_swiglu(Rng& r, int N, int K, const std::vector<float>& xf, int T) {
  HostWeight gu = make_weight(r, PrefillWeightFormat::Q4, 2 * N, K);
  const std::vector<float> all = ref_matmul(gu.deq, 2 * N, K, xf, T);
  InterleavedSwiglu w{upload_weight(gu), {}, {}, std::vector<float>(size_t(T) * N)};
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < N; ++i)
      w.ref[size_t(t) * N + i] = cpu::silu(all[size_t(t) * 2 * N + 2 * i]) * all[size_t(t) * 2 * N + 2 * i + 1];
  w.g = w.u = w.d.view;
  w.g.rows = w.u.rows = N;
  w.g.row_stride_bytes = w.u.row_stride_bytes = size_t(K);  // two packed q4 rows
  w.g.sb_row_stride_words = w.u.sb_row_stride_words = size_t(K) / 32;
  w.u.w = static_cast<const uint8_t*>(w.d.view.w) + K / 2;
  w.u.sb = w.d.view.sb + K / 64;
  return w;
}

// Gate/up interleaved by rows (the decode backend's fused SwiGLU upload),
// read through two strided views: one plain GEMM over both with the pairs
// output (64- and 128-row tiles, K split or not), and through the expansion
// to bf16 (the SwiGLU form on two matrices).
TEST(CudaPrefillGemm, SwigluInterleavedRows) {
  REQUIRE_GPU();
  struct Case { int T, N, K; };
  for (const Case c : {Case{70, 96, 192}, Case{40, 96, 192}, Case{150, 96, 1024}, Case{300, 520, 512}}) {
    const int T = c.T, N = c.N, K = c.K;
    SCOPED_TRACE(::testing::Message() << "T " << T << " N " << N << " K " << K);
    Rng r(25 + T);
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    random_bf16(r, size_t(T) * K, 1.f, xb, xf);
    const InterleavedSwiglu w = make_interleaved_swiglu(r, N, K, xf, T);
    const PrefillWeight &g = w.g, &u = w.u;
    const std::vector<float>& ref = w.ref;
    Dev x = upload(xb);
    Dev h(size_t(T) * N * 2);
    prefill_gemm_swiglu(g, u, x.as<uint16_t>(), T, K, h.as<uint16_t>(), N, nullptr);
    const double e = rel_err(bf16_vec_to_f32(download<uint16_t>(h, size_t(T) * N)), ref);
    // The same through the expansion to bf16 (strided rows read correctly).
    Dev scr(size_t(2) * N * K * 2);
    Dev h2(size_t(T) * N * 2);
    prefill_gemm_swiglu(g, u, x.as<uint16_t>(), T, K, h2.as<uint16_t>(), N, nullptr,
                        PrefillScratch{scr.p, scr.bytes, 1});
    const double e2 = rel_err(bf16_vec_to_f32(download<uint16_t>(h2, size_t(T) * N)), ref);
    std::printf("  swiglu interleaved T=%d N=%d K=%d: rel err %.3g, expanded %.3g\n", T, N, K, e, e2);
    EXPECT_LT(e, 1e-2);
    EXPECT_LT(e2, 1e-2);
  }
}

// Quantized weights expanded to bf16 once (PrefillScratch) give what the
// tile-wise expansion gives: the same bf16 weights, the same kernel.
TEST(CudaPrefillGemm, ExpandedWeightsMatchCpu) {
  REQUIRE_GPU();
  run_gemm_case(PrefillWeightFormat::Q4, 150, 200, 320, PrefillOut::F32, false, 71, true);
  run_gemm_case(PrefillWeightFormat::Q4, 33, 136, 192, PrefillOut::F32Add, true, 72, true);
  run_gemm_case(PrefillWeightFormat::Q8, 129, 264, 256, PrefillOut::BF16, false, 73, true);
  run_gemm_case(PrefillWeightFormat::BF16, 77, 200, 128, PrefillOut::F32, false, 74, true);  // bf16: no expansion
}

// prefill_gemm_fused of the parts w (adjacent output columns, F32Add into a
// random output with 5 padding columns) on random x [T][K]: the padding
// stays untouched; e gets the relative error against the double reference.
void run_fused_parts(Rng& r, const std::vector<HostWeight>& w, int T, int K, const PrefillScratch& sc, double& e) {
  int N = 0;
  std::vector<float> deq;
  for (const HostWeight& h : w) {
    deq.insert(deq.end(), h.deq.begin(), h.deq.end());
    N += h.rows;
  }
  std::vector<uint16_t> xb;
  std::vector<float> xf;
  random_bf16(r, size_t(T) * K, 1.f, xb, xf);
  const std::vector<float> ref = ref_matmul(deq, N, K, xf, T);
  std::vector<DevWeight> d;
  std::vector<PrefillWeight> parts;
  for (const HostWeight& h : w) d.push_back(upload_weight(h));
  for (const DevWeight& dw : d) parts.push_back(dw.view);
  Dev x = upload(xb);
  const size_t ldy = N + 5;
  std::vector<float> init(size_t(T) * ldy);
  for (auto& v : init) v = r.uniform(-1, 1);
  Dev y = upload(init);
  prefill_gemm_fused(parts.data(), int(parts.size()), x.as<uint16_t>(), T, K, y.p, ldy, PrefillOut::F32Add, nullptr,
                     sc);
  const auto h = download<float>(y, init.size());
  std::vector<float> got(size_t(T) * N);
  for (int t = 0; t < T; ++t) {
    for (int n = 0; n < N; ++n) got[size_t(t) * N + n] = h[size_t(t) * ldy + n] - init[size_t(t) * ldy + n];
    for (size_t n = N; n < ldy; ++n) ASSERT_EQ(h[size_t(t) * ldy + n], init[size_t(t) * ldy + n]);
  }
  e = rel_err(got, ref);
}

// Several projections of one input into adjacent output columns: expanded
// into one bf16 matrix and run as one GEMM (all quantized, scratch big
// enough), or one GEMM per part (a bf16 part, no scratch).
TEST(CudaPrefillGemm, FusedPartsMatchCpu) {
  REQUIRE_GPU();
  const int T = 150, K = 192;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    Rng r(80 + variant);
    const PrefillWeightFormat f2 = variant == 2 ? PrefillWeightFormat::BF16 : PrefillWeightFormat::Q8;
    HostWeight w[3] = {make_weight(r, PrefillWeightFormat::Q4, 200, K), make_weight(r, f2, 40, K),
                       make_weight(r, PrefillWeightFormat::Q4, 8, K, true)};
    Dev scr(size_t(200 + 40 + 8) * K * 2);
    const PrefillScratch sc = variant == 1 ? PrefillScratch{} : PrefillScratch{scr.p, scr.bytes, 1};
    double e = 0;
    run_fused_parts(r, {w, w + 3}, T, K, sc, e);
    std::printf("  fused parts variant %d: rel err %.3g\n", variant, e);
    EXPECT_LT(e, kTolQuant);
  }
  // One format for every part and no expansion: the generic kernel over all
  // parts in one launch (blockIdx.y picks the part), K split or not, parts
  // of 1 and 33 rows (odd output columns: unpaired stores), the model's
  // router + shared gate shape.
  struct Case { PrefillWeightFormat f; std::vector<int> rows; int T, K; };
  const Case cases[] = {{PrefillWeightFormat::Q4, {200, 32, 1, 33}, 150, 2048},
                        {PrefillWeightFormat::Q4, {130, 33}, 300, 192},
                        {PrefillWeightFormat::Q8, {256, 1}, 100, 1024},
                        {PrefillWeightFormat::BF16, {64, 7, 100}, 40, 512}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "parts of one format, T " << c.T << " K " << c.K << " fmt " << int(c.f));
    Rng r(90 + c.T);
    std::vector<HostWeight> w;
    for (int rows : c.rows) w.push_back(make_weight(r, c.f, rows, c.K));
    double e = 0;
    run_fused_parts(r, w, c.T, c.K, PrefillScratch{}, e);
    std::printf("  fused parts, one format (T %d, K %d, %zu parts): rel err %.3g\n", c.T, c.K, c.rows.size(), e);
    EXPECT_LT(e, kTolQuant);
  }
}

// Runs of <= 16 rows over q4 weights: the skinny kernels (weights as the
// MMA's A operand, read once per run in 64-byte units; one and two n8
// halves, rings of 1, 2 and 4 units, K split over a block's warps or not;
// q4 with K % 128 != 0 takes the tiled kernels, f16 and bf16 scales, every output kind, row and
// column tails), fused parts in one launch, SwiGLU with packed and
// interleaved gate/up rows; a row's result does not depend on the run's
// length; prefill_set_skinny_rows(0) takes the tiled kernels.
TEST(CudaPrefillGemm, SkinnyRowsMatchCpu) {
  REQUIRE_GPU();
  struct Case {
    int T, N, K;
    PrefillOut out;
    bool f16;
  };
  const Case cases[] = {{1, 130, 256, PrefillOut::F32, false},   {2, 37, 512, PrefillOut::F32Add, false},
                        {3, 200, 768, PrefillOut::BF16, true},   {7, 513, 2048, PrefillOut::F32, false},
                        {8, 64, 4096, PrefillOut::F32Add, true}, {9, 129, 256, PrefillOut::F32, false},
                        {13, 300, 1280, PrefillOut::BF16, false}, {16, 77, 4096, PrefillOut::F32Add, false},
                        {4, 70, 64, PrefillOut::F32, false},     {11, 90, 192, PrefillOut::F32Add, true},
                        {5, 33, 128, PrefillOut::BF16, false},
                        // >= 2 blocks per SM of 64 rows: each warp over all of K (the others split K in 4)
                        {3, 17000, 256, PrefillOut::F32, false}, {10, 16900, 512, PrefillOut::BF16, true},
                        // a grid of 16-row blocks over one wave (Qwen3.6's in_proj): K over 2 warps
                        {2, 12352, 2048, PrefillOut::F32, false}, {16, 12352, 2048, PrefillOut::F32Add, false},
                        // 17..32 rows: four n8 halves
                        {17, 130, 256, PrefillOut::F32, false}, {24, 513, 2048, PrefillOut::F32Add, false},
                        {32, 300, 1280, PrefillOut::BF16, true}, {20, 77, 4096, PrefillOut::F32Add, false},
                        {32, 12352, 2048, PrefillOut::F32, false}};
  uint64_t seed = 400;
  for (const Case& c : cases) run_gemm_case(PrefillWeightFormat::Q4, c.T, c.N, c.K, c.out, c.f16, seed++);
  // q8 codes (16 bytes a lane per group): the router's shape, tails, f16 scales.
  run_gemm_case(PrefillWeightFormat::Q8, 2, 257, 2048, PrefillOut::F32, false, 415);
  run_gemm_case(PrefillWeightFormat::Q8, 12, 70, 192, PrefillOut::F32Add, true, 416);
  run_gemm_case(PrefillWeightFormat::Q8, 9, 129, 512, PrefillOut::BF16, false, 417);
  run_gemm_case(PrefillWeightFormat::Q8, 32, 257, 2048, PrefillOut::F32, false, 418);
  run_gemm_case(PrefillWeightFormat::Q8, 21, 70, 192, PrefillOut::F32Add, true, 419);
  // The tiled kernels at such shapes still pass (the model tests' backends
  // with skinny_rows 0 take them too).
  prefill_set_skinny_rows(0);
  run_gemm_case(PrefillWeightFormat::Q4, 5, 130, 512, PrefillOut::F32, false, 420);
  run_gemm_case(PrefillWeightFormat::Q4, 16, 130, 320, PrefillOut::F32Add, false, 421);
  prefill_set_skinny_rows(16);

  // A row's outputs are the same bits in a run of 5, of 12 and of 27 (one,
  // two and four n8 halves), also where the split of K follows from the waves.
  for (const auto& [N, K] : {std::pair{150, 1024}, std::pair{12352, 2048}}) {
    Rng r(430);
    HostWeight hw = make_weight(r, PrefillWeightFormat::Q4, N, K);
    DevWeight dw = upload_weight(hw);
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    random_bf16(r, size_t(27) * K, 1.f, xb, xf);
    Dev x = upload(xb);
    Dev y5(size_t(5) * N * 4), y12(size_t(12) * N * 4), y27(size_t(27) * N * 4);
    prefill_gemm(dw.view, x.as<uint16_t>(), 5, K, y5.p, N, PrefillOut::F32, nullptr);
    prefill_gemm(dw.view, x.as<uint16_t>(), 12, K, y12.p, N, PrefillOut::F32, nullptr);
    prefill_gemm(dw.view, x.as<uint16_t>(), 27, K, y27.p, N, PrefillOut::F32, nullptr);
    const auto a = download<float>(y5, size_t(5) * N), b = download<float>(y12, size_t(12) * N),
               c = download<float>(y27, size_t(27) * N);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "rows of a run of 5 vs the same rows of a run of 12";
    EXPECT_TRUE(std::equal(b.begin(), b.end(), c.begin())) << "rows of a run of 12 vs the same rows of a run of 27";
  }

  // Fused parts: one launch into adjacent columns (parts of one format: q4,
  // q8); a q8 part among q4 ones takes one GEMM per part.
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(::testing::Message() << "fused variant " << variant);
    Rng r(440 + variant);
    const int T = variant == 1 ? 11 : 4, K = 512;
    const PrefillWeightFormat f1 = variant == 2 ? PrefillWeightFormat::Q8 : PrefillWeightFormat::Q4;
    const PrefillWeightFormat f2 = variant ? PrefillWeightFormat::Q8 : PrefillWeightFormat::Q4;
    HostWeight w[4] = {make_weight(r, f1, 200, K), make_weight(r, f2, 40, K), make_weight(r, f1, 8, K, true),
                       make_weight(r, f1, 65, K)};
    double e = 0;
    run_fused_parts(r, {w, w + 4}, T, K, PrefillScratch{}, e);
    std::printf("  skinny fused parts variant %d: rel err %.3g\n", variant, e);
    EXPECT_LT(e, kTolQuant);
  }

  // SwiGLU, packed gate / up and interleaved rows (two strided views).
  for (const int T : {3, 6, 14, 20, 32}) {
    SCOPED_TRACE(::testing::Message() << "swiglu T " << T);
    Rng r(450 + T);
    const int N = T == 6 ? 600 : 96, K = T == 14 ? 256 : 512;
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    random_bf16(r, size_t(T) * K, 1.f, xb, xf);
    Dev x = upload(xb);
    // packed
    HostWeight g = make_weight(r, PrefillWeightFormat::Q4, N, K), u = make_weight(r, PrefillWeightFormat::Q4, N, K);
    auto rg = ref_matmul(g.deq, N, K, xf, T), ru = ref_matmul(u.deq, N, K, xf, T);
    std::vector<float> ref(rg.size());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = cpu::silu(rg[i]) * ru[i];
    DevWeight dg = upload_weight(g), du = upload_weight(u);
    Dev h(size_t(T) * N * 2);
    prefill_gemm_swiglu(dg.view, du.view, x.as<uint16_t>(), T, K, h.as<uint16_t>(), N, nullptr);
    const double e = rel_err(bf16_vec_to_f32(download<uint16_t>(h, size_t(T) * N)), ref);
    // interleaved
    const InterleavedSwiglu w = make_interleaved_swiglu(r, N, K, xf, T);
    Dev h2(size_t(T) * N * 2);
    prefill_gemm_swiglu(w.g, w.u, x.as<uint16_t>(), T, K, h2.as<uint16_t>(), N, nullptr);
    const double e2 = rel_err(bf16_vec_to_f32(download<uint16_t>(h2, size_t(T) * N)), w.ref);
    std::printf("  skinny swiglu T=%d N=%d K=%d: rel err %.3g packed, %.3g interleaved\n", T, N, K, e, e2);
    EXPECT_LT(e, 1e-2);
    EXPECT_LT(e2, 1e-2);
  }
}

TEST(CudaPrefillGemm, RejectsBadShapes) {
  REQUIRE_GPU();
  PrefillWeight w;
  w.fmt = PrefillWeightFormat::Q4;
  w.rows = 64;
  w.cols = 100;  // not a multiple of 64
  Dev buf(1 << 16);
  w.w = buf.p;
  w.sb = buf.as<uint32_t>();
  EXPECT_THROW(prefill_gemm(w, buf.as<uint16_t>(), 4, 128, buf.p, 64, PrefillOut::F32, nullptr), Error);
}

// ---- MoE ------------------------------------------------------------------------

struct CpuRoute {
  std::vector<int> ids;
  std::vector<float> w;
};
CpuRoute cpu_route(const std::vector<float>& logits, int T, int E, int k, bool norm) {
  CpuRoute r{std::vector<int>(size_t(T) * k), std::vector<float>(size_t(T) * k)};
  std::vector<int> idx(E);
  std::vector<float> p(E);
  for (int t = 0; t < T; ++t) {
    const float* l = &logits[size_t(t) * E];
    const float mx = *std::max_element(l, l + E);
    float sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float top = 0;
    for (int j = 0; j < k; ++j) top += p[idx[j]];
    for (int j = 0; j < k; ++j) {
      r.ids[size_t(t) * k + j] = idx[j];
      r.w[size_t(t) * k + j] = norm ? p[idx[j]] / top : p[idx[j]];
    }
  }
  return r;
}

TEST(CudaPrefillMoe, RouteMatchesCpu) {
  REQUIRE_GPU();
  Rng r(31);
  const int T = 100, E = 256, k = 8;
  std::vector<float> logits(size_t(T) * E);
  for (auto& v : logits) v = r.normal() * 2.f;
  const CpuRoute ref = cpu_route(logits, T, E, k, true);
  Dev dl = upload(logits), ids(size_t(T) * k * 4), w(size_t(T) * k * 4);
  prefill_moe_route(dl.as<float>(), E, T, E, k, true, ids.as<int>(), w.as<float>(), nullptr);
  auto gi = download<int>(ids, size_t(T) * k);
  auto gw = download<float>(w, size_t(T) * k);
  for (size_t i = 0; i < gi.size(); ++i) {
    ASSERT_EQ(gi[i], ref.ids[i]) << "slot " << i;
    EXPECT_NEAR(gw[i], ref.w[i], 1e-6f + 1e-5f * ref.w[i]);
  }
}

// tile_rows: 0 = the launcher's choice, 16, 64 or 128 forced (128: the
// choice at >= 32 rows per expert, wgmma; 16: q4 experts only).
// > 0: run_moe_case sets the skinny MoE kernel's wave to the plan's 16-row
// tiles divided by this (prefill_set_moe_skinny_blocks), so that a case
// lands in a chosen part of the kernel's schedule.
double g_tiles_per_block = 0;

void run_moe_case(int T, int E, int k, int hidden, int inter, bool shared, bool accumulate, uint64_t seed,
                  PrefillWeightFormat fmt = PrefillWeightFormat::Q4, int tile_rows = 0, int ldo_pad = 0,
                  bool sb_f16 = false, int shared_inter = 0, bool interleave = false) {
  SCOPED_TRACE(::testing::Message() << "T " << T << " E " << E << " k " << k << " hidden " << hidden
                                    << " inter " << inter << " fmt " << int(fmt) << " tile rows " << tile_rows
                                    << " ldo pad " << ldo_pad << " f16 scales " << sb_f16 << " shared weights "
                                    << shared_inter << " interleaved " << interleave);
  Rng r(seed);
  // Stacked experts: one HostWeight of E*rows rows is the stack.
  HostWeight g = make_weight(r, fmt, E * inter, hidden, sb_f16);
  HostWeight u = make_weight(r, fmt, E * inter, hidden, sb_f16);
  HostWeight d = make_weight(r, fmt, E * hidden, inter, sb_f16);
  const size_t bits = fmt == PrefillWeightFormat::Q4 ? 4 : fmt == PrefillWeightFormat::Q8 ? 8 : 16;
  std::vector<uint16_t> xb;
  std::vector<float> xf;
  random_bf16(r, size_t(T) * hidden, 1.f, xb, xf);
  std::vector<float> logits(size_t(T) * E);
  for (auto& v : logits) v = r.normal() * 2.f;
  std::vector<float> sh(size_t(T) * hidden), sg(T), init(size_t(T) * hidden);
  for (auto& v : sh) v = r.normal();
  for (auto& v : sg) v = r.normal();
  for (auto& v : init) v = r.normal();
  // shared_inter > 0: the shared expert's weights go to prefill_moe, which
  // computes it (sh is then its output, intermediate rounded to bf16).
  HostWeight sg_w, su_w, sd_w;
  if (shared && shared_inter > 0) {
    sg_w = make_weight(r, fmt, shared_inter, hidden, sb_f16);
    su_w = make_weight(r, fmt, shared_inter, hidden, sb_f16);
    sd_w = make_weight(r, fmt, hidden, shared_inter, sb_f16);
    std::vector<float> hs(shared_inter);
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < shared_inter; ++i) {
        double a = 0, b = 0;
        for (int c = 0; c < hidden; ++c) {
          a += double(sg_w.deq[size_t(i) * hidden + c]) * xf[size_t(t) * hidden + c];
          b += double(su_w.deq[size_t(i) * hidden + c]) * xf[size_t(t) * hidden + c];
        }
        hs[i] = bf16_to_f32(f32_to_bf16(cpu::silu(float(a)) * float(b)));
      }
      for (int j = 0; j < hidden; ++j) {
        double y = 0;
        for (int i = 0; i < shared_inter; ++i) y += double(sd_w.deq[size_t(j) * shared_inter + i]) * hs[i];
        sh[size_t(t) * hidden + j] = float(y);
      }
    }
  }

  // CPU reference: route, per (token, slot) SwiGLU with the intermediate
  // rounded to bf16 (the GPU keeps it in bf16 between the two launches).
  const CpuRoute route = cpu_route(logits, T, E, k, true);
  int tiles16 = 0, wave = 0;
  if (g_tiles_per_block > 0) {
    std::vector<int> count(E, 0);
    for (int id : route.ids) ++count[id];
    for (int c : count) tiles16 += (c + 15) / 16;
    wave = std::max(1, int(tiles16 / g_tiles_per_block));
    prefill_set_moe_skinny_blocks(wave);
  }
  SCOPED_TRACE(::testing::Message() << "16-row tiles " << tiles16 << ", skinny wave " << wave);
  std::vector<float> ref(size_t(T) * hidden, 0.f);
  std::vector<float> hbuf(inter);
  for (int t = 0; t < T; ++t) {
    for (int s = 0; s < k; ++s) {
      const int e = route.ids[size_t(t) * k + s];
      for (int i = 0; i < inter; ++i) {
        double a = 0, b = 0;
        const float* gr = &g.deq[(size_t(e) * inter + i) * hidden];
        const float* ur = &u.deq[(size_t(e) * inter + i) * hidden];
        for (int c = 0; c < hidden; ++c) {
          a += double(gr[c]) * xf[size_t(t) * hidden + c];
          b += double(ur[c]) * xf[size_t(t) * hidden + c];
        }
        hbuf[i] = bf16_to_f32(f32_to_bf16(cpu::silu(float(a)) * float(b)));
      }
      for (int j = 0; j < hidden; ++j) {
        double y = 0;
        const float* dr = &d.deq[(size_t(e) * hidden + j) * inter];
        for (int i = 0; i < inter; ++i) y += double(dr[i]) * hbuf[i];
        ref[size_t(t) * hidden + j] += route.w[size_t(t) * k + s] * float(y);
      }
    }
    for (int j = 0; j < hidden; ++j) {
      if (shared) ref[size_t(t) * hidden + j] += cpu::sigmoid(sg[t]) * sh[size_t(t) * hidden + j];
      if (accumulate) ref[size_t(t) * hidden + j] += init[size_t(t) * hidden + j];
    }
  }

  DevWeight dg = upload_weight(interleave ? interleave_rows(g, u, E) : g), du = upload_weight(u),
            dd = upload_weight(d);
  auto stack = [&](DevWeight& w, int rows, int cols) {
    PrefillWeight v = w.view;
    v.rows = rows;
    v.cols = cols;
    v.expert_w_bytes = size_t(rows) * cols * bits / 8;
    v.expert_sb_words = bits == 16 ? 0 : size_t(rows) * cols / 64;
    return v;
  };
  // Interleaved: gate and up views of one stack of 2 inter rows an expert.
  auto pair_views = [&](DevWeight& w, int rows, int cols, int experts, PrefillWeight& gv, PrefillWeight& uv) {
    gv = w.view;
    gv.rows = rows;
    gv.cols = cols;
    gv.row_stride_bytes = size_t(cols) * bits / 8 * 2;
    gv.sb_row_stride_words = size_t(cols) / 64 * 2;
    gv.expert_w_bytes = experts > 1 ? size_t(2 * rows) * cols * bits / 8 : 0;
    gv.expert_sb_words = experts > 1 ? size_t(2 * rows) * cols / 64 : 0;
    uv = gv;
    uv.w = static_cast<const uint8_t*>(gv.w) + size_t(cols) * bits / 8;
    uv.sb = gv.sb + cols / 64;
  };
  Dev x = upload(xb), dl = upload(logits), dsh = upload(sh), dsg = upload(sg);
  // The output rows are hidden + ldo_pad apart (an odd pad takes the
  // combine's unvectorised path); the pad columns must stay untouched.
  const size_t ldo = size_t(hidden) + ldo_pad;
  std::vector<float> out0(size_t(T) * ldo, 7.f);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < hidden; ++j) out0[size_t(t) * ldo + j] = accumulate ? init[size_t(t) * hidden + j] : NAN;
  Dev out = upload(out0);
  PrefillMoeArgs a;
  a.T = T;
  a.E = E;
  a.k = k;
  a.hidden = hidden;
  a.inter = inter;
  a.x = x.as<uint16_t>();
  a.ldx = hidden;
  a.router_logits = dl.as<float>();
  a.ld_logits = E;
  if (interleave) {
    pair_views(dg, inter, hidden, E, a.gate, a.up);
  } else {
    a.gate = stack(dg, inter, hidden);
    a.up = stack(du, inter, hidden);
  }
  a.down = stack(dd, hidden, inter);
  if (shared) {
    a.shared_out = dsh.as<float>();
    a.ld_shared = hidden;
    a.shared_gate_logit = dsg.as<float>();
    a.ld_shared_gate = 1;
  }
  std::vector<DevWeight> dshw;
  if (shared && shared_inter > 0) {
    if (interleave) {
      dshw.push_back(upload_weight(interleave_rows(sg_w, su_w, 1)));
      dshw.push_back(upload_weight(sd_w));
      pair_views(dshw[0], shared_inter, hidden, 1, a.sh_gate, a.sh_up);
      a.sh_down = dshw[1].view;
    } else {
      for (const HostWeight* w : {&sg_w, &su_w, &sd_w}) dshw.push_back(upload_weight(*w));
      a.sh_gate = dshw[0].view;
      a.sh_up = dshw[1].view;
      a.sh_down = dshw[2].view;
    }
    ck(cudaMemset(dsh.p, 0xff, dsh.bytes), "memset");  // NaN until prefill_moe writes it
  }
  a.out = out.as<float>();
  a.ldo = ldo;
  a.accumulate = accumulate;
  a.workspace_bytes = prefill_moe_workspace_bytes(T, E, k, hidden, inter);
  a.tile_rows = tile_rows;
  // Every case also has the combine write the RMSNorm of its rows over x
  // itself (as the backend folds the next layer's input norm).
  std::vector<float> nw(hidden);
  for (auto& v : nw) v = r.uniform(0.5f, 1.5f);
  Dev dnw = upload(nw);
  a.norm_w = dnw.as<float>();
  a.norm_eps = 1e-6f;
  a.norm_out = x.as<uint16_t>();
  a.ld_norm_out = hidden;
  Dev ws(a.workspace_bytes);
  a.workspace = ws.p;
  prefill_moe(a, nullptr);
  const std::vector<float> h = download<float>(out, out0.size());
  std::vector<float> got(ref.size());
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < hidden; ++j) got[size_t(t) * hidden + j] = h[size_t(t) * ldo + j];
    for (size_t j = hidden; j < ldo; ++j) ASSERT_EQ(h[size_t(t) * ldo + j], 7.f) << "row " << t;
  }
  {  // the norm of the rows the GPU wrote: within bf16's rounding
    const auto xn = download<uint16_t>(x, size_t(T) * hidden);
    double worst = 0;
    for (int t = 0; t < T; ++t) {
      double ss = 0;
      for (int j = 0; j < hidden; ++j) ss += double(got[size_t(t) * hidden + j]) * got[size_t(t) * hidden + j];
      const double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
      for (int j = 0; j < hidden; ++j) {
        const double want = got[size_t(t) * hidden + j] * inv * nw[j];
        const double have = bf16_to_f32(xn[size_t(t) * hidden + j]);
        worst = std::max(worst, std::fabs(have - want) / (std::fabs(want) + 1e-3));
      }
    }
    EXPECT_LT(worst, 1.0 / 256) << "the combine's output norm";
  }
  const double e = rel_err(got, ref);
  std::printf("  moe T=%d E=%d k=%d hidden=%d inter=%d fmt=%d tile=%d: rel err %.3g\n", T, E, k, hidden, inter,
              int(fmt), tile_rows, e);
  EXPECT_LT(e, 1e-2);
}

TEST(CudaPrefillMoe, MatchesCpuSmall) {
  REQUIRE_GPU();
  run_moe_case(300, 16, 4, 256, 128, true, false, 41);  // ~75 rows per expert: 128-row tiles, partly filled
  run_moe_case(7, 16, 4, 192, 64, false, true, 42);
  run_moe_case(90, 16, 4, 192, 64, true, true, 43, PrefillWeightFormat::Q4, 0, 3);  // unaligned output rows
}

// 128-row tiles (the wgmma path of the grouped kernel) in q4, q8 and bf16:
// expert tiles partly filled and split in two, rows per expert from ~50 to
// ~150.
TEST(CudaPrefillMoe, MatchesCpuTallTiles) {
  REQUIRE_GPU();
  run_moe_case(300, 8, 2, 256, 192, true, false, 44, PrefillWeightFormat::Q4, 128);
  run_moe_case(600, 4, 1, 192, 128, false, true, 45, PrefillWeightFormat::Q4, 128);
  run_moe_case(200, 4, 2, 320, 128, true, true, 46, PrefillWeightFormat::Q8, 128);
  run_moe_case(150, 4, 2, 128, 64, false, false, 47, PrefillWeightFormat::BF16, 128);
  run_moe_case(96, 32, 8, 2048, 512, true, false, 48, PrefillWeightFormat::Q4, 128);  // the model's expert shape
  run_moe_case(300, 8, 2, 256, 192, true, true, 49, PrefillWeightFormat::Q4, 128, 0, true);  // f16 scales
  run_moe_case(300, 8, 2, 256, 192, true, true, 50, PrefillWeightFormat::Q4, 64, 0, true);
}

// 16-row tiles (q4 experts, weights as the MMA's A operand): a few rows per
// expert, experts over several tiles, f16 scales, the model's shape.
TEST(CudaPrefillMoe, MatchesCpuSkinnyTiles) {
  REQUIRE_GPU();
  run_moe_case(40, 8, 2, 256, 256, true, false, 60, PrefillWeightFormat::Q4, 16);
  run_moe_case(300, 8, 2, 512, 256, false, true, 61, PrefillWeightFormat::Q4, 16);
  run_moe_case(70, 8, 2, 256, 512, true, true, 62, PrefillWeightFormat::Q4, 16, 3, true);
  run_moe_case(96, 32, 8, 2048, 512, true, false, 63, PrefillWeightFormat::Q4, 16);
  // Gate / up interleaved (the backend's layout), partly filled row blocks.
  run_moe_case(96, 32, 8, 2048, 512, false, true, 81, PrefillWeightFormat::Q4, 16, 0, false, 0, true);
  run_moe_case(50, 8, 2, 512, 768, true, false, 82, PrefillWeightFormat::Q4, 16, 3, true, 0, true);
  // The schedule's three parts, by the wave set against the plan's tiles:
  // two blocks a tile (parts of a tile); equal shares of all the units
  // (1.15 tiles a block: runs that start and end inside a tile, blocks over
  // two or three tiles); whole tiles in several waves (2.5 tiles a block).
  // (The default wave leaves blocks with no unit where the plan has fewer
  // tiles than its bound: the cases above.)
  for (double per_block : {0.5, 1.15, 2.5}) {
    SCOPED_TRACE(::testing::Message() << "tiles a block " << per_block);
    g_tiles_per_block = per_block;
    run_moe_case(300, 8, 2, 512, 256, false, true, 61, PrefillWeightFormat::Q4, 16);
    run_moe_case(70, 8, 2, 256, 512, true, true, 62, PrefillWeightFormat::Q4, 16, 3, true);
    run_moe_case(96, 32, 8, 2048, 512, false, true, 81, PrefillWeightFormat::Q4, 16, 0, false, 0, true);
  }
  g_tiles_per_block = 0;
  prefill_set_moe_skinny_blocks(0);
}

// Runs of at most 16 tokens plan the routing in one block (moe_plan_kernel:
// routing, counts, tiles and the permutation in (token, slot) order): one
// token, experts shared by several tokens of the run, 16- and 64-row tiles,
// q8 and bf16 experts (the tiled grouped kernels), the model's shape.
TEST(CudaPrefillMoe, MatchesCpuShortRuns) {
  REQUIRE_GPU();
  run_moe_case(1, 16, 4, 256, 128, true, false, 64);
  run_moe_case(2, 256, 8, 2048, 512, true, true, 65);  // the model's shape
  run_moe_case(16, 256, 8, 2048, 512, true, false, 66);
  run_moe_case(16, 8, 4, 256, 256, false, true, 67);  // ~8 rows per expert
  run_moe_case(7, 16, 4, 192, 64, true, true, 68, PrefillWeightFormat::Q4, 64, 3);
  run_moe_case(9, 8, 2, 320, 128, true, false, 69, PrefillWeightFormat::Q8);
  run_moe_case(5, 4, 2, 128, 64, false, false, 70, PrefillWeightFormat::BF16);
  // 17..96 tokens plan in one block too (8-row tiles, experts over several).
  run_moe_case(24, 256, 8, 2048, 512, true, false, 83);
  run_moe_case(32, 32, 8, 512, 256, false, true, 84);
  run_moe_case(48, 256, 8, 2048, 512, true, true, 87, PrefillWeightFormat::Q4, 0, 0, false, 512, true);
  run_moe_case(64, 32, 8, 512, 256, true, false, 88);
  run_moe_case(96, 256, 8, 2048, 512, true, true, 89, PrefillWeightFormat::Q4, 0, 0, false, 512, true);
  run_moe_case(90, 16, 8, 256, 128, false, false, 90);  // ~45 rows an expert: 6 tiles each
}

// A short run's MoE with the shared expert's weights: q4 in the stacks'
// layout runs it as one more tile of the grouped skinny launches (the
// model's shape at T = 2, T = 9 with two n8 halves and f16 scales, T = 16);
// a narrower shared expert, q8 experts, and the grouped form turned off
// take separate launches inside prefill_moe.
TEST(CudaPrefillMoe, MatchesCpuShortRunsSharedWeights) {
  REQUIRE_GPU();
  run_moe_case(2, 256, 8, 2048, 512, true, true, 71, PrefillWeightFormat::Q4, 0, 0, false, 512);
  run_moe_case(9, 16, 4, 256, 128, true, false, 72, PrefillWeightFormat::Q4, 0, 0, true, 128);
  run_moe_case(16, 32, 8, 512, 256, true, true, 73, PrefillWeightFormat::Q4, 0, 3, false, 256);
  run_moe_case(3, 16, 4, 256, 128, true, true, 74, PrefillWeightFormat::Q4, 0, 0, false, 64);
  run_moe_case(5, 16, 4, 256, 128, true, false, 75, PrefillWeightFormat::Q8, 0, 0, false, 128);
  // Gate / up interleaved (the backend's layout): one plain launch over
  // both, the shared expert (interleaved too) as one more tile.
  run_moe_case(2, 256, 8, 2048, 512, true, true, 78, PrefillWeightFormat::Q4, 0, 0, false, 512, true);
  run_moe_case(13, 32, 8, 512, 256, true, false, 79, PrefillWeightFormat::Q4, 0, 5, true, 256, true);
  run_moe_case(4, 16, 4, 256, 128, false, true, 80, PrefillWeightFormat::Q4, 0, 0, false, 0, true);
  run_moe_case(32, 256, 8, 2048, 512, true, true, 85, PrefillWeightFormat::Q4, 0, 0, false, 512, true);
  run_moe_case(20, 16, 4, 256, 128, true, false, 86, PrefillWeightFormat::Q4, 0, 0, false, 128);
  prefill_set_moe_grouped(false);
  run_moe_case(2, 256, 8, 2048, 512, true, true, 76, PrefillWeightFormat::Q4, 0, 0, false, 512);
  run_moe_case(7, 32, 4, 256, 256, true, false, 77);
  prefill_set_moe_grouped(true);
}

TEST(CudaPrefillMoe, MatchesCpuModelShape) {
  REQUIRE_GPU();
  // The model's hidden / intermediate sizes and top-8; 32 experts keep the CPU
  // reference small (routing over 256 is RouteMatchesCpu, speed is the bench).
  run_moe_case(24, 32, 8, 2048, 512, true, true, 43);
}

// ---- Gated DeltaNet -------------------------------------------------------------

// The chunked delta rule's products run on tensor cores in TF32: every input
// of a product is rounded to 10 mantissa bits (relative error <= 2^-11 =
// 4.9e-4), sums accumulate in f32. The outputs are dot products of such
// rounded terms over 64-128 entries through two or three chained products
// (T (beta v), W S, P v_new), so their error is a few times 2^-11 of the
// largest term; the state carries the same relative error from chunk to
// chunk, damped by the decay (e^(c_L) < 1) rather than compounded. Bound:
// 4e-3 of max|ref|, 8x the rounding of one input; an indexing or
// synchronisation error moves outputs by O(1).
constexpr double kTolDn = 4e-3;

struct DnModel {
  int nk, nv, d, C;  // dk = dv = d; C = 2*nk*d + nv*d
  std::vector<float> conv_w, a_log, dt_bias;
};
DnModel make_dn_model(Rng& r, int nk, int nv, int d) {
  DnModel m{nk, nv, d, 2 * nk * d + nv * d, {}, {}, {}};
  m.conv_w.resize(size_t(m.C) * 4);
  for (auto& v : m.conv_w) v = r.uniform(-0.6f, 0.6f);
  m.a_log.resize(m.nv);
  m.dt_bias.resize(m.nv);
  for (auto& v : m.a_log) v = r.uniform(-2.f, 1.f);
  for (auto& v : m.dt_bias) v = r.uniform(-1.f, 1.f);
  return m;
}

// The CPU backend's DeltaNet layer between the projections and the gated
// norm (cpu::deltanet_layer, the same function cpu_backend.cpp runs).
void cpu_deltanet(const DnModel& m, const std::vector<float>& qkv, const std::vector<float>& a,
                  const std::vector<float>& b, int T, std::vector<float>& conv_state /*[C][3]*/,
                  std::vector<float>& state, std::vector<float>& out) {
  static ThreadPool pool(1);
  out.assign(size_t(T) * m.nv * m.d, 0.f);
  cpu::deltanet_layer(pool, {T, m.nk, m.nv, m.d, m.d, 4, qkv.data(), a.data(), b.data(), m.conv_w.data(),
                             m.a_log.data(), m.dt_bias.data(), conv_state.data(), state.data(), out.data()});
}

// One sequence's device-side DeltaNet layer: weights, conv ring and state.
struct DnDevice {
  Dev conv_w, a_log, dt_bias, ring, state;
};
// Ring zeroed (positions < 0 read as zero); state from `state0` ([nv][d][d]).
DnDevice make_dn_device(const DnModel& m, const std::vector<float>& state0) {
  DnDevice d{upload(m.conv_w), upload(m.a_log), upload(m.dt_bias), Dev(size_t(m.C) * 4 * 4), upload(state0)};
  ck(cudaMemset(d.ring.p, 0, d.ring.bytes), "memset");
  return d;
}

// Random projections for T tokens: qkv [T][C], a and b [T][nv].
struct DnInputs {
  std::vector<float> qkv, a, b;
};
DnInputs make_dn_inputs(Rng& r, const DnModel& m, int T) {
  DnInputs in{std::vector<float>(size_t(T) * m.C), std::vector<float>(size_t(T) * m.nv),
              std::vector<float>(size_t(T) * m.nv)};
  for (auto& v : in.qkv) v = r.normal();
  for (auto& v : in.a) v = r.normal();
  for (auto& v : in.b) v = r.normal();
  return in;
}
// Tokens [t0, t0 + T) of `in`.
DnInputs dn_slice(const DnModel& m, const DnInputs& in, int t0, int T) {
  auto rows = [&](const std::vector<float>& v, size_t w) {
    return std::vector<float>(v.begin() + size_t(t0) * w, v.begin() + size_t(t0 + T) * w);
  };
  return {rows(in.qkv, m.C), rows(in.a, m.nv), rows(in.b, m.nv)};
}

// prefill_deltanet over T tokens after P on `dev` (ring and state updated);
// returns the core outputs [T][nv*d] (written with a padded row stride, NaN
// poisoned first). backup: the call also writes the state and ring as they
// were (PrefillDeltaNetArgs::state_backup / ring_backup), checked here bit
// for bit against copies taken before it.
// The arguments for T tokens after P on `dev` from device inputs (rows of
// C, and of nv for a / b), outputs to out [T][ld_out]; no workspace.
PrefillDeltaNetArgs dn_args(const DnModel& m, DnDevice& dev, const Dev& dq, const Dev& da, const Dev& db, int T,
                            int P, Dev& out, size_t ld_out) {
  PrefillDeltaNetArgs args;
  args.T = T;
  args.first_position = P;
  args.nk = m.nk;
  args.nv = m.nv;
  args.dk = m.d;
  args.dv = m.d;
  args.qkv = dq.as<float>();
  args.ld_qkv = m.C;
  args.a = da.as<float>();
  args.b = db.as<float>();
  args.ld_ab = m.nv;
  args.conv_w = dev.conv_w.as<float>();
  args.conv_ring = dev.ring.as<float>();
  args.a_log = dev.a_log.as<float>();
  args.dt_bias = dev.dt_bias.as<float>();
  args.state = dev.state.as<float>();
  args.out = out.as<float>();
  args.ld_out = ld_out;
  return args;
}

std::vector<float> gpu_deltanet(const DnModel& m, DnDevice& dev, const DnInputs& in, int T, int P,
                                bool backup = false) {
  Dev dq = upload(in.qkv), da = upload(in.a), db = upload(in.b);
  const size_t ld_out = size_t(m.nv) * m.d + 4;
  Dev out(size_t(T) * ld_out * 4);
  ck(cudaMemset(out.p, 0xFF, out.bytes), "memset");
  PrefillDeltaNetArgs args = dn_args(m, dev, dq, da, db, T, P, out, ld_out);
  args.workspace_bytes = prefill_deltanet_workspace_bytes(T, m.nk, m.nv, m.d, m.d);
  Dev ws(args.workspace_bytes);
  args.workspace = ws.p;
  const size_t state_n = size_t(m.nv) * m.d * m.d, ring_n = size_t(m.C) * 4;
  Dev sb(backup ? state_n * 4 : 4), rb(backup ? ring_n * 4 : 4);
  std::vector<float> state0, ring0;
  if (backup) {
    state0 = download<float>(dev.state, state_n);
    ring0 = download<float>(dev.ring, ring_n);
    args.state_backup = sb.as<float>();
    args.ring_backup = rb.as<float>();
  }
  prefill_deltanet(args, nullptr);
  if (backup) {
    EXPECT_TRUE(download<float>(sb, state_n) == state0) << "the state backup";
    EXPECT_TRUE(download<float>(rb, ring_n) == ring0) << "the ring backup";
  }
  auto h = download<float>(out, size_t(T) * ld_out);
  const size_t row = size_t(m.nv) * m.d;
  std::vector<float> got(size_t(T) * row);
  for (int t = 0; t < T; ++t)
    for (size_t i = 0; i < row; ++i) got[size_t(t) * row + i] = h[size_t(t) * ld_out + i];
  return got;
}

// The ring must hold the last 4 raw inputs by position, n positions done:
// the largest difference from the 3 the CPU keeps ([C][3], oldest first).
double ring_max_diff(const DnModel& m, const DnDevice& dev, const std::vector<float>& cpu_conv, int n) {
  auto hr = download<float>(dev.ring, size_t(m.C) * 4);
  double ring_max = 0;
  for (int ch = 0; ch < m.C; ++ch)
    for (int j = 0; j < 3; ++j) {
      const int pos = n - 3 + j;
      const float want = cpu_conv[size_t(ch) * 3 + j];
      const float have = pos >= 0 ? hr[size_t(ch) * 4 + pos % 4] : 0.f;
      ring_max = std::max(ring_max, double(std::fabs(have - want)));
    }
  return ring_max;
}

TEST(CudaPrefillDeltaNet, MatchesCpuAcrossCallsAndChunks) {
  REQUIRE_GPU();
  Rng r(51);
  const DnModel m = make_dn_model(r, 16, 32, 128);
  std::vector<float> cpu_conv(size_t(m.C) * 3, 0.f), cpu_state(size_t(m.nv) * m.d * m.d, 0.f);
  DnDevice dev = make_dn_device(m, cpu_state);
  int P = 0;
  for (int T : {100, 70, 3, 1000}) {  // 100: chunk 64 + 36; 70 crosses 128 from 100; 3: shorter than the conv;
                                     // 1000: 16 chunks carried in one call
    SCOPED_TRACE(::testing::Message() << "call with T " << T << " after P " << P);
    const DnInputs in = make_dn_inputs(r, m, T);
    std::vector<float> ref;
    cpu_deltanet(m, in.qkv, in.a, in.b, T, cpu_conv, cpu_state, ref);
    const std::vector<float> got = gpu_deltanet(m, dev, in, T, P);
    const double e_out = rel_err(got, ref);
    const double e_state = rel_err(download<float>(dev.state, cpu_state.size()), cpu_state);
    const double ring_max = ring_max_diff(m, dev, cpu_conv, P + T);
    std::printf("  deltanet T=%d P=%d: out rel err %.3g, state rel err %.3g, ring max diff %.3g\n", T, P,
                e_out, e_state, ring_max);
    EXPECT_LT(e_out, kTolDn);
    EXPECT_LT(e_state, kTolDn);
    EXPECT_EQ(ring_max, 0.0);
    P += T;
  }
}

// Runs of at most 16 tokens take the recurrent form (prefill_deltanet_run.cu,
// f32 throughout, as the decode step): several short runs in a row on the
// production shape from a random state, the ring carried between them and
// read back, against the CPU to 1e-4 (the chunked kernels' TF32 products
// give ~1e-3: the tight bound tells the two apart); then a chunked call and
// a short one after it; the same short runs with the form switched off
// (prefill_set_skinny_rows(0)) take the chunked kernels and stay within
// kTolDn. The short runs also write the state and ring as they were
// (state_backup / ring_backup: bit for bit), a run again from that record
// (state_src / ring_src) gives the same bits; longer runs refuse a backup.
TEST(CudaPrefillDeltaNet, ShortRunsMatchCpu) {
  REQUIRE_GPU();
  for (const int limit : {16, 0}) {
    SCOPED_TRACE(::testing::Message() << "short-run limit " << limit);
    prefill_set_skinny_rows(limit);
    Rng r(58);
    const DnModel m = make_dn_model(r, 16, 32, 128);
    std::vector<float> cpu_conv(size_t(m.C) * 3, 0.f), cpu_state(size_t(m.nv) * m.d * m.d);
    for (auto& v : cpu_state) v = r.normal() * 0.1f;
    DnDevice dev = make_dn_device(m, cpu_state);
    int P = 0;
    bool chunked_before = false;
    for (int T : {2, 16, 1, 7, 3, 17, 9}) {
      SCOPED_TRACE(::testing::Message() << "call with T " << T << " after P " << P);
      const DnInputs in = make_dn_inputs(r, m, T);
      std::vector<float> ref;
      cpu_deltanet(m, in.qkv, in.a, in.b, T, cpu_conv, cpu_state, ref);
      const std::vector<float> got = gpu_deltanet(m, dev, in, T, P, /*backup=*/T <= limit);
      const double e_out = rel_err(got, ref);
      const double e_state = rel_err(download<float>(dev.state, cpu_state.size()), cpu_state);
      const double ring_max = ring_max_diff(m, dev, cpu_conv, P + T);
      chunked_before = chunked_before || T > limit;
      std::printf("  deltanet short runs (limit %d) T=%d P=%d: out rel err %.3g, state rel err %.3g, ring %.3g\n",
                  limit, T, P, e_out, e_state, ring_max);
      const double tol = chunked_before ? kTolDn : 1e-4;
      EXPECT_LT(e_out, tol);
      EXPECT_LT(e_state, tol);
      EXPECT_EQ(ring_max, 0.0);
      P += T;
    }
  }
  prefill_set_skinny_rows(16);
  // A replay from the record: a run of 5 with its backup, then the same run
  // again from the backup (state_src / ring_src) on top of the state the
  // first left: the same outputs, state and ring, bit for bit.
  {
    Rng r(60);
    const DnModel m = make_dn_model(r, 16, 32, 128);
    std::vector<float> st(size_t(m.nv) * m.d * m.d);
    for (auto& v : st) v = r.normal() * 0.1f;
    DnDevice dev = make_dn_device(m, st);
    gpu_deltanet(m, dev, make_dn_inputs(r, m, 7), 7, 0);  // a ring with content
    const DnInputs in = make_dn_inputs(r, m, 5);
    Dev dq = upload(in.qkv), da = upload(in.a), db = upload(in.b);
    const size_t state_n = st.size(), ring_n = size_t(m.C) * 4, ld_out = size_t(m.nv) * m.d;
    Dev sb(state_n * 4), rb(ring_n * 4), o1(5 * ld_out * 4), o2(5 * ld_out * 4);
    PrefillDeltaNetArgs args = dn_args(m, dev, dq, da, db, 5, 7, o1, ld_out);
    args.workspace_bytes = prefill_deltanet_workspace_bytes(5, m.nk, m.nv, m.d, m.d);
    Dev ws(args.workspace_bytes);
    args.workspace = ws.p;
    args.state_backup = sb.as<float>();
    args.ring_backup = rb.as<float>();
    prefill_deltanet(args, nullptr);
    const auto s1 = download<float>(dev.state, state_n), r1 = download<float>(dev.ring, ring_n);
    args.state_backup = args.ring_backup = nullptr;
    args.state_src = sb.as<float>();
    args.ring_src = rb.as<float>();
    args.out = o2.as<float>();
    prefill_deltanet(args, nullptr);
    EXPECT_TRUE(download<float>(o2, 5 * ld_out) == download<float>(o1, 5 * ld_out)) << "replay outputs";
    EXPECT_TRUE(download<float>(dev.state, state_n) == s1) << "replay state";
    EXPECT_TRUE(download<float>(dev.ring, ring_n) == r1) << "replay ring";
  }
  // A backup is refused for a run the chunked kernels take.
  Rng r(59);
  const DnModel m = make_dn_model(r, 2, 4, 32);
  DnDevice dev = make_dn_device(m, std::vector<float>(size_t(m.nv) * m.d * m.d, 0.f));
  EXPECT_THROW(gpu_deltanet(m, dev, make_dn_inputs(r, m, 17), 17, 0, true), Error);
}

// Small head dims (the test fixtures' dk = dv = 32 with 2 key / 4 value heads,
// and 64): one call each from a random state, T around the 64-token chunk.
void run_deltanet_small_dims(int d, uint64_t seed) {
  Rng r(seed);
  const DnModel m = make_dn_model(r, 2, 4, d);
  for (int T : {1, 5, 63, 64, 65, 150}) {
    SCOPED_TRACE(::testing::Message() << "d " << d << " T " << T);
    std::vector<float> cpu_conv(size_t(m.C) * 3, 0.f), cpu_state(size_t(m.nv) * d * d);
    for (auto& v : cpu_state) v = r.normal() * 0.5f;
    DnDevice dev = make_dn_device(m, cpu_state);
    const DnInputs in = make_dn_inputs(r, m, T);
    std::vector<float> ref;
    cpu_deltanet(m, in.qkv, in.a, in.b, T, cpu_conv, cpu_state, ref);
    const std::vector<float> got = gpu_deltanet(m, dev, in, T, 0);
    const double e_out = rel_err(got, ref);
    const double e_state = rel_err(download<float>(dev.state, cpu_state.size()), cpu_state);
    const double ring_max = ring_max_diff(m, dev, cpu_conv, T);
    std::printf("  deltanet d=%d T=%d: out rel err %.3g, state rel err %.3g, ring max diff %.3g\n", d, T,
                e_out, e_state, ring_max);
    EXPECT_LT(e_out, kTolDn);
    EXPECT_LT(e_state, kTolDn);
    EXPECT_EQ(ring_max, 0.0);
  }
}

TEST(CudaPrefillDeltaNet, HeadDim32MatchesCpu) {
  REQUIRE_GPU();
  run_deltanet_small_dims(32, 52);
}

TEST(CudaPrefillDeltaNet, HeadDim64MatchesCpu) {
  REQUIRE_GPU();
  run_deltanet_small_dims(64, 53);
}

// Two calls (the second at first_position = T1, with the state and the conv
// ring the first left) against one call over all T1 + T2 tokens from the same
// random state, and against the CPU reference over all tokens.
void run_deltanet_two_calls(int d, int T1, int T2, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "d " << d << " T1 " << T1 << " T2 " << T2);
  Rng r(seed);
  const DnModel m = make_dn_model(r, 2, 4, d);
  const int N = T1 + T2;
  std::vector<float> state0(size_t(m.nv) * d * d);
  for (auto& v : state0) v = r.normal() * 0.5f;
  const DnInputs in = make_dn_inputs(r, m, N);

  std::vector<float> cpu_conv(size_t(m.C) * 3, 0.f), cpu_state = state0, ref;
  cpu_deltanet(m, in.qkv, in.a, in.b, N, cpu_conv, cpu_state, ref);

  DnDevice one = make_dn_device(m, state0);
  const std::vector<float> got_one = gpu_deltanet(m, one, in, N, 0);

  DnDevice two = make_dn_device(m, state0);
  std::vector<float> got_two = gpu_deltanet(m, two, dn_slice(m, in, 0, T1), T1, 0);
  const std::vector<float> second = gpu_deltanet(m, two, dn_slice(m, in, T1, T2), T2, T1);
  got_two.insert(got_two.end(), second.begin(), second.end());

  const auto st_one = download<float>(one.state, state0.size());
  const auto st_two = download<float>(two.state, state0.size());
  const auto ring_one = download<float>(one.ring, size_t(m.C) * 4);
  const auto ring_two = download<float>(two.ring, size_t(m.C) * 4);
  const double e_split = rel_err(got_two, got_one), e_split_state = rel_err(st_two, st_one);
  const double e_out = rel_err(got_two, ref), e_state = rel_err(st_two, cpu_state);
  const double e_one = rel_err(got_one, ref), e_one_state = rel_err(st_one, cpu_state);
  const double ring_max = ring_max_diff(m, two, cpu_conv, N);
  std::printf("  deltanet d=%d %d+%d: split vs one call out %.3g state %.3g; vs cpu out %.3g state %.3g "
              "(one call: %.3g, %.3g); ring max diff %.3g\n",
              d, T1, T2, e_split, e_split_state, e_out, e_state, e_one, e_one_state, ring_max);
  EXPECT_LT(e_split, kTolDn);
  EXPECT_LT(e_split_state, kTolDn);
  EXPECT_LT(e_out, kTolDn);
  EXPECT_LT(e_state, kTolDn);
  EXPECT_LT(e_one, kTolDn);
  EXPECT_LT(e_one_state, kTolDn);
  EXPECT_EQ(ring_max, 0.0);
  EXPECT_TRUE(ring_one == ring_two) << "the ring after two calls differs from the one-call ring";
}

TEST(CudaPrefillDeltaNet, SmallHeadDimsTwoCallsMatchOneCall) {
  REQUIRE_GPU();
  for (int d : {32, 64}) {
    run_deltanet_two_calls(d, 70, 80, 54 + d);  // both calls cross a chunk boundary
    run_deltanet_two_calls(d, 3, 62, 55 + d);   // first call shorter than the conv window
    run_deltanet_two_calls(d, 64, 1, 56 + d);   // one full chunk, then a single token
  }
}

TEST(CudaPrefillDeltaNet, RejectsUnsupportedHeadDims) {
  REQUIRE_GPU();
  PrefillDeltaNetArgs a;
  a.T = 4;
  a.nk = 2;
  a.nv = 4;
  a.dk = a.dv = 96;
  EXPECT_THROW(prefill_deltanet(a, nullptr), Error);
  a.dk = 64;
  a.dv = 128;
  EXPECT_THROW(prefill_deltanet(a, nullptr), Error);
  a.dk = a.dv = 256;
  EXPECT_THROW(prefill_deltanet(a, nullptr), Error);
}

TEST(CudaPrefillDeltaNet, GatedRmsNormMatchesCpu) {
  REQUIRE_GPU();
  Rng r(61);
  const int T = 37, heads = 32, dim = 128;
  std::vector<float> o(size_t(T) * heads * dim), z(o.size()), w(dim);
  for (auto& v : o) v = r.normal();
  for (auto& v : z) v = r.normal();
  for (auto& v : w) v = r.uniform(0.5f, 1.5f);
  std::vector<float> ref(o.size());
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h) {
      const size_t base = (size_t(t) * heads + h) * dim;
      cpu::rms_norm(&o[base], w.data(), dim, 1e-6f, &ref[base]);
      for (int i = 0; i < dim; ++i) ref[base + i] *= cpu::silu(z[base + i]);
    }
  Dev dout(o.size() * 2), dO = upload(o), dz = upload(z), dw = upload(w);
  prefill_gated_rmsnorm(dO.as<float>(), size_t(heads) * dim, dz.as<float>(), size_t(heads) * dim,
                        dw.as<float>(), T, heads, dim, 1e-6f, dout.as<uint16_t>(), size_t(heads) * dim, nullptr);
  const double e = rel_err(bf16_vec_to_f32(download<uint16_t>(dout, o.size())), ref);
  EXPECT_LT(e, 5e-3);
}

// ---- attention --------------------------------------------------------------------

// split: give the launcher the workspace of the split form (few queries
// over a long context), and require that it is taken.
// q8: the cache's rows as q8 codes and scales (kv_type.h), read in place
// (split form only); the reference takes the rows' q8 values.
void run_attention_case(int T, int P, bool gated, uint64_t seed, int nh = 16, int nkv = 2, int hd = 256,
                        bool split = false, bool q8 = false) {
  SCOPED_TRACE(::testing::Message() << "T " << T << " P " << P << " gated " << gated << " nh " << nh
                                    << " nkv " << nkv << " head_dim " << hd << " split " << split << " q8 " << q8);
  Rng r(seed);
  const int cap = P + T + 5;
  const size_t q_row = size_t(nh) * 2 * hd, q_head = 2 * hd;  // the q_proj layout: [query | gate] per head
  std::vector<uint16_t> qb, kb, vb;
  std::vector<float> qf, kf, vf;
  random_bf16(r, size_t(T) * q_row, 1.f, qb, qf);
  random_bf16(r, size_t(nkv) * cap * hd, 1.f, kb, kf);
  random_bf16(r, size_t(nkv) * cap * hd, 1.f, vb, vf);
  const int sst = (cap + 7) / 8 * 8;
  std::vector<uint8_t> kq(kf.size()), vq(vf.size());
  std::vector<float> ksc(size_t(nkv) * sst), vsc(ksc.size());
  if (q8) {  // m = max |x|, s = m / 127, code = rn(x 127 / m) + 128; the values (code - 128) s
    for (auto [f, q, sc] : {std::tuple{&kf, &kq, &ksc}, std::tuple{&vf, &vq, &vsc}})
      for (int h = 0; h < nkv; ++h)
        for (int pos = 0; pos < cap; ++pos) {
          float* x = &(*f)[(size_t(h) * cap + pos) * hd];
          float m = 0.f;
          for (int i = 0; i < hd; ++i) m = std::max(m, std::fabs(x[i]));
          const float inv = m > 0.f ? 127.f / m : 0.f, st = m / 127.f;
          for (int i = 0; i < hd; ++i) {
            const long c = std::clamp(std::lrint(x[i] * inv), -127l, 127l);
            (*q)[(size_t(h) * cap + pos) * hd + i] = static_cast<uint8_t>(c + 128);
            x[i] = float(c) * st;
          }
          (*sc)[size_t(h) * sst + pos] = st;
        }
  }
  std::vector<float> ref(size_t(T) * nh * hd);
  const double scale = 1.0 / std::sqrt(double(hd));
  std::vector<double> sc(P + T);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < nh; ++h) {
      const int kvh = h / (nh / nkv), n = P + t + 1;
      const float* q = &qf[t * q_row + h * q_head];
      double mx = -1e300;
      for (int p = 0; p < n; ++p) {
        const float* k = &kf[(size_t(kvh) * cap + p) * hd];
        double d = 0;
        for (int x = 0; x < hd; ++x) d += double(q[x]) * k[x];
        sc[p] = d * scale;
        mx = std::max(mx, sc[p]);
      }
      double sum = 0;
      for (int p = 0; p < n; ++p) sum += (sc[p] = std::exp(sc[p] - mx));
      for (int x = 0; x < hd; ++x) {
        double o = 0;
        for (int p = 0; p < n; ++p) o += sc[p] * vf[(size_t(kvh) * cap + p) * hd + x];
        o /= sum;
        if (gated) o *= 1.0 / (1.0 + std::exp(-double(qf[t * q_row + h * q_head + hd + x])));
        ref[(size_t(t) * nh + h) * hd + x] = float(o);
      }
    }
  Dev dq = upload(qb), dk = upload(kb), dv = upload(vb);
  const size_t out_row = size_t(nh) * hd + 8;
  Dev out(size_t(T) * out_row * 2);
  ck(cudaMemset(out.p, 0xFF, out.bytes), "memset");
  PrefillAttentionArgs a;
  a.T = T;
  a.first_position = P;
  a.nh = nh;
  a.nkv = nkv;
  a.head_dim = hd;
  a.q = dq.as<uint16_t>();
  a.gate = gated ? dq.as<uint16_t>() + hd : nullptr;
  a.q_row_stride = q_row;
  a.q_head_stride = q_head;
  a.k_cache = dk.as<uint16_t>();
  a.v_cache = dv.as<uint16_t>();
  a.capacity = cap;
  a.out = out.as<uint16_t>();
  a.out_row_stride = out_row;
  Dev ws(split ? prefill_attention_workspace_bytes(nh, nkv, hd) : 0);
  Dev dkq = upload(kq), dvq = upload(vq), dks = upload(ksc), dvs = upload(vsc);
  if (q8) {
    a.k_cache = a.v_cache = nullptr;
    a.k_q8 = dkq.as<uint8_t>();
    a.v_q8 = dvq.as<uint8_t>();
    a.k_scale = dks.as<float>();
    a.v_scale = dvs.as<float>();
    a.scale_stride = sst;
  }
  if (split) {
    ck(cudaMemset(ws.p, 0xFF, ws.bytes), "memset");  // NaN: nothing may read what was not written
    a.workspace = ws.p;
    a.workspace_bytes = ws.bytes;
  }
  EXPECT_EQ(prefill_attention_splits(a) > 0, split && T * (nh / nkv) <= 512);
  prefill_attention(a, nullptr);
  auto h = download<uint16_t>(out, size_t(T) * out_row);
  std::vector<float> got(ref.size());
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < nh * hd; ++i) got[size_t(t) * nh * hd + i] = bf16_to_f32(h[size_t(t) * out_row + i]);
  const double e = rel_err(got, ref);
  std::printf("  attention hd=%d nh=%d nkv=%d T=%d P=%d gated=%d splits=%d: rel err %.3g\n", hd, nh, nkv, T, P,
              int(gated), prefill_attention_splits(a), e);
  // P is rounded to bf16 before P.V (2^-9 relative per weight) and the output
  // to bf16 (2^-9): a few 1e-3.
  EXPECT_LT(e, 1e-2);
  // The split form's f32 rows (PrefillAttentionArgs::out_f32): the values
  // the bf16 rows round (every element bit for bit after rounding), and
  // refused by the whole-context kernel.
  Dev out32(size_t(T) * out_row * 4);
  ck(cudaMemset(out32.p, 0xFF, out32.bytes), "memset");
  a.out = nullptr;
  a.out_f32 = out32.as<float>();
  if (prefill_attention_splits(a) == 0) {
    EXPECT_THROW(prefill_attention(a, nullptr), Error);
    return;
  }
  prefill_attention(a, nullptr);
  const auto h32 = download<float>(out32, size_t(T) * out_row);
  size_t diff = 0;
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < nh * hd; ++i)
      diff += f32_to_bf16(h32[size_t(t) * out_row + i]) != h[size_t(t) * out_row + i];
  EXPECT_EQ(diff, 0u) << "f32 rows against the bf16 rows";
}

TEST(CudaPrefillAttention, MatchesCpu) {
  REQUIRE_GPU();
  run_attention_case(150, 77, true, 71);
  run_attention_case(200, 0, true, 72);
  run_attention_case(5, 300, false, 73);
}

// Smaller head dims: T not a multiple of the 128-row query tile or the
// 64-position key tile, with and without cached positions before the queries,
// with and without the gate.
void run_attention_small(int hd, int nh, int nkv, uint64_t seed) {
  run_attention_case(1, 0, false, seed + 0, nh, nkv, hd);
  run_attention_case(1, 45, true, seed + 1, nh, nkv, hd);
  run_attention_case(37, 0, true, seed + 2, nh, nkv, hd);
  run_attention_case(37, 91, false, seed + 3, nh, nkv, hd);
  run_attention_case(200, 0, false, seed + 4, nh, nkv, hd);
  run_attention_case(200, 70, true, seed + 5, nh, nkv, hd);
}

TEST(CudaPrefillAttention, HeadDim32MatchesCpu) {  // the test fixtures' shape
  REQUIRE_GPU();
  run_attention_small(32, 4, 2, 74);
}

TEST(CudaPrefillAttention, HeadDim64MatchesCpu) {
  REQUIRE_GPU();
  run_attention_small(64, 6, 2, 80);
}

TEST(CudaPrefillAttention, HeadDim128MatchesCpu) {
  REQUIRE_GPU();
  run_attention_small(128, 8, 4, 86);
}

// The split form: 128 of a KV head's T x group <= 512 query rows per block
// over a range of key tiles, merged by a second launch. Runs of 1-64 tokens
// (T x 8 up to four whole 128-row blocks) after 0 to 4,000 cached positions
// (one key tile to 63 ranges; ranges past some of the queries' positions),
// each head dim, groups of 2-8 query heads.
TEST(CudaPrefillAttention, SplitFormMatchesCpu) {
  REQUIRE_GPU();
  run_attention_case(1, 0, true, 90, 16, 2, 256, true);
  run_attention_case(2, 4000, true, 91, 16, 2, 256, true);
  run_attention_case(5, 131, false, 92, 16, 2, 256, true);
  run_attention_case(16, 1000, true, 93, 16, 2, 256, true);
  run_attention_case(9, 61, true, 94, 16, 2, 256, true);
  run_attention_case(3, 700, true, 95, 4, 2, 32, true);
  run_attention_case(37, 300, false, 96, 6, 2, 64, true);
  run_attention_case(7, 2500, true, 97, 8, 4, 128, true);
  run_attention_case(17, 200, true, 98, 16, 2, 256, true);   // two row blocks, the second one row
  run_attention_case(33, 2100, false, 99, 16, 2, 256, true);
  run_attention_case(64, 640, true, 106, 16, 2, 256, true);  // four whole row blocks
  run_attention_case(50, 90, true, 107, 8, 4, 128, true);
  // Past 512 query rows per KV head the whole-context kernel runs even with
  // the workspace.
  run_attention_case(65, 300, true, 108, 16, 2, 256, true);
  // A q8 cache read in place.
  run_attention_case(1, 0, true, 100, 16, 2, 256, true, true);
  run_attention_case(4, 3000, true, 101, 16, 2, 256, true, true);
  run_attention_case(16, 77, false, 102, 16, 2, 256, true, true);
  run_attention_case(5, 500, true, 103, 4, 2, 32, true, true);
  run_attention_case(6, 900, false, 104, 8, 4, 128, true, true);
  run_attention_case(3, 129, true, 105, 6, 2, 64, true, true);
}

// The whole-context kernel cannot read a q8 cache: refused, not misread.
TEST(CudaPrefillAttention, RefusesQ8WithoutTheSplitForm) {
  REQUIRE_GPU();
  PrefillAttentionArgs a;
  a.T = 80;  // 80 x 8 rows > 512
  a.first_position = 10;
  a.nh = 16;
  a.nkv = 2;
  a.head_dim = 256;
  Dev q(size_t(80) * 16 * 512 * 2), kq(size_t(2) * 128 * 256), ks(2 * 128 * 4), out(size_t(80) * 16 * 256 * 2);
  Dev ws(prefill_attention_workspace_bytes(16, 2, 256));
  a.q = q.as<uint16_t>();
  a.q_row_stride = 16 * 512;
  a.q_head_stride = 512;
  a.k_q8 = a.v_q8 = kq.as<uint8_t>();
  a.k_scale = a.v_scale = ks.as<float>();
  a.scale_stride = 128;
  a.capacity = 128;
  a.out = out.as<uint16_t>();
  a.out_row_stride = 16 * 256;
  a.workspace = ws.p;
  a.workspace_bytes = ws.bytes;
  EXPECT_THROW(prefill_attention(a, nullptr), Error);
}

TEST(CudaPrefillAttention, RejectsUnsupportedHeadDim) {
  REQUIRE_GPU();
  Dev buf(1 << 16);
  PrefillAttentionArgs a;
  a.T = 4;
  a.nh = 4;
  a.nkv = 2;
  a.q = a.k_cache = a.v_cache = buf.as<uint16_t>();
  a.out = buf.as<uint16_t>();
  a.q_row_stride = 512;
  a.q_head_stride = 128;
  a.capacity = 64;
  a.out_row_stride = 512;
  for (int hd : {16, 48, 96, 512}) {
    a.head_dim = hd;
    EXPECT_THROW(prefill_attention(a, nullptr), Error) << "head_dim " << hd;
  }
}

// ---- timings (LILY_PREFILL_BENCH=1) ---------------------------------------------------

bool bench_enabled() {
  const char* v = std::getenv("LILY_PREFILL_BENCH");
  return v && std::string(v) != "0";
}
#define REQUIRE_BENCH()                                                  \
  REQUIRE_GPU();                                                         \
  if (!bench_enabled()) GTEST_SKIP() << "set LILY_PREFILL_BENCH=1 to time"

// Median milliseconds of `reps` runs after `warm` warm-ups, with events.
template <typename F>
double time_ms(F&& f, int warm = 2, int reps = 7) {
  for (int i = 0; i < warm; ++i) f();
  sync();
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "event");
  ck(cudaEventCreate(&b), "event");
  std::vector<double> ts;
  for (int i = 0; i < reps; ++i) {
    ck(cudaEventRecord(a), "record");
    f();
    ck(cudaEventRecord(b), "record");
    ck(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Timing data: a random block of up to 32 MiB made on the host, repeated
// across the buffer on the device (far larger than L2, so no cache effect).
template <typename T>
void fill_block(Dev& d, const std::vector<T>& block) {
  const size_t bb = block.size() * sizeof(T);
  for (size_t off = 0; off < d.bytes; off += bb)
    ck(cudaMemcpy(static_cast<char*>(d.p) + off, block.data(), std::min(bb, d.bytes - off),
                  cudaMemcpyHostToDevice), "fill");
}
void fill_random(Dev& d, uint64_t seed) {
  std::vector<uint32_t> h(std::min<size_t>(d.bytes, 32u << 20) / 4);
  Rng r(seed);
  for (auto& v : h) v = uint32_t(r.next());
  fill_block(d, h);
}
void fill_bf16(Dev& d, uint64_t seed, float scale) {
  std::vector<uint16_t> h(std::min<size_t>(d.bytes, 32u << 20) / 2);
  Rng r(seed);
  for (auto& v : h) v = f32_to_bf16(r.uniform(-scale, scale));
  fill_block(d, h);
}
void fill_sb(Dev& d, uint64_t seed) {
  std::vector<uint32_t> h(std::min<size_t>(d.bytes, 32u << 20) / 4);
  Rng r(seed);
  for (auto& v : h) {
    const float s = r.uniform(0.01f, 0.03f);
    v = uint32_t(f32_to_bf16(s)) | (uint32_t(f32_to_bf16(-8 * s)) << 16);
  }
  fill_block(d, h);
}

struct BenchWeight {
  Dev data, sb;
  PrefillWeight view;
};
BenchWeight bench_weight(PrefillWeightFormat fmt, int rows, int cols, uint64_t seed, int experts = 1) {
  const int bits = fmt == PrefillWeightFormat::Q4 ? 4 : fmt == PrefillWeightFormat::Q8 ? 8 : 16;
  const size_t wbytes = size_t(rows) * cols * bits / 8;
  BenchWeight w{Dev(wbytes * experts), Dev(bits == 16 ? 16 : size_t(rows) * cols / 64 * 4 * experts), {}};
  if (bits == 16) fill_bf16(w.data, seed, 0.05f);
  else {
    fill_random(w.data, seed);
    fill_sb(w.sb, seed + 1);
  }
  w.view.fmt = fmt;
  w.view.rows = rows;
  w.view.cols = cols;
  w.view.w = w.data.p;
  w.view.sb = bits == 16 ? nullptr : w.sb.as<uint32_t>();
  w.view.expert_w_bytes = wbytes;
  w.view.expert_sb_words = size_t(rows) * cols / 64;
  return w;
}

// The generic kernel's split-K shapes (few output tiles): out_proj /
// o_proj and the shared expert's down at the row counts that split them.
TEST(CudaPrefillBench, SplitK) {
  REQUIRE_BENCH();
  Dev x(size_t(1024) * 4096 * 2);
  fill_bf16(x, 1, 1.f);
  Dev y(size_t(1024) * 2048 * 4);
  struct Shape { int N, K; const char* what; };
  const Shape shapes[] = {{2048, 4096, "out_proj"}, {2048, 512, "shared expert down"}};
  std::printf("\n| N x K | what | T | splits | ms F32Add | TFLOP/s |\n|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    BenchWeight w = bench_weight(PrefillWeightFormat::Q4, s.N, s.K, 7);
    for (int T : {24, 64, 100, 200, 512, 1000}) {
      const double ms = time_ms([&] { prefill_gemm(w.view, x.as<uint16_t>(), T, s.K, y.p, s.N, PrefillOut::F32Add, nullptr); });
      std::printf("| %d x %d | %s | %d | %d | %.4f | %.1f |\n", s.N, s.K, s.what, T,
                  prefill_gemm_k_splits(w.view, T, PrefillOut::F32Add), ms, 2.0 * T * s.N * s.K / (ms * 1e-3) / 1e12);
    }
  }
}

// Few-row matrices at prompt lengths past the skinny kernel (the DeltaNet's
// b / a projections, the router and the shared expert's gate, attention's k
// / v) next to the large ones: what one launch of each costs alone (a
// fused launch takes the small ones along with a large one).
TEST(CudaPrefillBench, SmallN) {
  REQUIRE_BENCH();
  Dev x(size_t(1024) * 4096 * 2);
  fill_bf16(x, 1, 1.f);
  Dev y(size_t(1024) * 8192 * 4);
  struct Shape { int N, K; PrefillWeightFormat f; const char* what; };
  const Shape shapes[] = {{32, 2048, PrefillWeightFormat::Q4, "dn b / a"},
                          {1, 2048, PrefillWeightFormat::Q8, "shared gate"},
                          {256, 2048, PrefillWeightFormat::Q8, "router"},
                          {512, 2048, PrefillWeightFormat::Q4, "attn k / v"},
                          {2048, 4096, PrefillWeightFormat::Q4, "out_proj"},
                          {4096, 2048, PrefillWeightFormat::Q4, "z"},
                          {8192, 2048, PrefillWeightFormat::Q4, "qkv"}};
  std::printf("\n| N x K | what | T | splits | ms |\n|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    BenchWeight w = bench_weight(s.f, s.N, s.K, 7);
    for (int T : {64, 256, 512, 1000}) {
      const double ms = time_ms([&] { prefill_gemm(w.view, x.as<uint16_t>(), T, s.K, y.p, 8192, PrefillOut::F32, nullptr); });
      std::printf("| %d x %d | %s | %d | %d | %.4f |\n", s.N, s.K, s.what, T,
                  prefill_gemm_k_splits(w.view, T, PrefillOut::F32, {}), ms);
    }
  }
}

TEST(CudaPrefillBench, Gemm) {
  REQUIRE_BENCH();
  const int T = 4096;
  Dev x(size_t(T) * 4096 * 2);
  fill_bf16(x, 1, 1.f);
  struct Shape { int N, K; const char* what; };
  const Shape shapes[] = {{8192, 2048, "deltanet qkv"}, {4096, 2048, "deltanet z / attn q"},
                          {2048, 4096, "out_proj"}, {512, 2048, "attn k / v"},
                          {2048, 512, "shared expert down"}, {248320, 2048, "lm_head"}};
  Dev y(size_t(T) * 248320 * 4);
  std::printf("\n| weights | N x K | what | T | ms | TFLOP/s | of 790 |\n|---|---|---|---|---|---|---|\n");
  for (auto fmt : {PrefillWeightFormat::Q4, PrefillWeightFormat::Q8, PrefillWeightFormat::BF16})
    for (const Shape& s : shapes) {
      if (s.N > 100000 && fmt != PrefillWeightFormat::Q4) continue;  // lm_head: 4-bit only
      BenchWeight w = bench_weight(fmt, s.N, s.K, 7);
      const double ms = time_ms([&] { prefill_gemm(w.view, x.as<uint16_t>(), T, s.K, y.p, s.N, PrefillOut::F32, nullptr); });
      const double tf = 2.0 * T * s.N * s.K / (ms * 1e-3) / 1e12;
      const char* fname = fmt == PrefillWeightFormat::Q4 ? "q4" : fmt == PrefillWeightFormat::Q8 ? "q8" : "bf16";
      std::printf("| %s | %d x %d | %s | %d | %.3f | %.0f | %.0f%% |\n", fname, s.N, s.K, s.what, T, ms, tf,
                  100 * tf / 790);
      if (fmt != PrefillWeightFormat::BF16 && s.N < 100000) {  // expanded to bf16 first (the backend's path)
        Dev scr(size_t(s.N) * s.K * 2);
        const PrefillScratch sc{scr.p, scr.bytes};
        const double me = time_ms([&] { prefill_gemm(w.view, x.as<uint16_t>(), T, s.K, y.p, s.N, PrefillOut::F32, nullptr, sc); });
        const double te = 2.0 * T * s.N * s.K / (me * 1e-3) / 1e12;
        std::printf("| %s expanded | %d x %d | %s | %d | %.3f | %.0f | %.0f%% |\n", fname, s.N, s.K, s.what, T, me, te,
                    100 * te / 790);
      }
    }
  // Row-count sweep for the dispatch table: weight bytes streamed per ms.
  std::printf("\n| rows T | q4 4096x2048 ms | weight GB/s | TFLOP/s | bf16 ms | bf16 GB/s |\n|---|---|---|---|---|---|\n");
  BenchWeight wq = bench_weight(PrefillWeightFormat::Q4, 4096, 2048, 9);
  BenchWeight wb = bench_weight(PrefillWeightFormat::BF16, 4096, 2048, 10);
  for (int t : {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}) {
    const double mq = time_ms([&] { prefill_gemm(wq.view, x.as<uint16_t>(), t, 2048, y.p, 4096, PrefillOut::F32, nullptr); }, 3, 15);
    const double mb = time_ms([&] { prefill_gemm(wb.view, x.as<uint16_t>(), t, 2048, y.p, 4096, PrefillOut::F32, nullptr); }, 3, 15);
    const double qbytes = 4096.0 * 2048 * (0.5 + 4.0 / 64), bbytes = 4096.0 * 2048 * 2;
    std::printf("| %d | %.4f | %.0f | %.1f | %.4f | %.0f |\n", t, mq, qbytes / (mq * 1e-3) / 1e9,
                2.0 * t * 4096 * 2048 / (mq * 1e-3) / 1e12, mb, bbytes / (mb * 1e-3) / 1e9);
  }
}

TEST(CudaPrefillBench, Moe) {
  REQUIRE_BENCH();
  const int E = 256, k = 8, H = 2048, I = 512;
  BenchWeight g = bench_weight(PrefillWeightFormat::Q4, I, H, 21, E), u = bench_weight(PrefillWeightFormat::Q4, I, H, 22, E),
              d = bench_weight(PrefillWeightFormat::Q4, H, I, 23, E);
  std::printf("\n| MoE T | tile rows | ms | useful TFLOP/s | of 790 | tok/s | route ms | gate/up ms | down ms | combine ms |\n|---|---|---|---|---|---|---|---|---|---|\n");
  // LILY_MOE_BENCH_T / LILY_MOE_BENCH_BM restrict the table to one prompt
  // length / tile height (e.g. to profile one launch).
  const int only_t = std::getenv("LILY_MOE_BENCH_T") ? std::atoi(std::getenv("LILY_MOE_BENCH_T")) : 0;
  const int only_bm = std::getenv("LILY_MOE_BENCH_BM") ? std::atoi(std::getenv("LILY_MOE_BENCH_BM")) : 0;
  for (int T : {256, 384, 512, 768, 1024, 2048, 4096, 16384})
  for (int bm : {16, 64, 128}) {
    if (bm == 16 && T > 1024) continue;
    if ((only_t && T != only_t) || (only_bm && bm != only_bm)) continue;
    Dev x(size_t(T) * H * 2), logits(size_t(T) * E * 4), out(size_t(T) * H * 4);
    fill_bf16(x, 3, 1.f);
    std::vector<float> hl(size_t(T) * E);
    Rng r(5);
    for (auto& v : hl) v = r.normal();
    ck(cudaMemcpy(logits.p, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice), "copy");
    PrefillMoeArgs a;
    a.T = T; a.E = E; a.k = k; a.hidden = H; a.inter = I;
    a.x = x.as<uint16_t>(); a.ldx = H;
    a.router_logits = logits.as<float>(); a.ld_logits = E;
    a.gate = g.view; a.up = u.view; a.down = d.view;
    a.out = out.as<float>(); a.ldo = H;
    a.tile_rows = bm;
    a.workspace_bytes = prefill_moe_workspace_bytes(T, E, k, H, I);
    Dev ws(a.workspace_bytes);
    a.workspace = ws.p;
    const double ms = time_ms([&] { prefill_moe(a, nullptr); });
    const double fl = 2.0 * T * k * (3.0 * H * I);
    float ph[4];
    prefill_moe_timed(a, nullptr, ph);
    std::printf("| %d | %d | %.3f | %.0f | %.0f%% | %.0f | %.3f | %.3f | %.3f | %.3f |\n", T, bm, ms,
                fl / (ms * 1e-3) / 1e12, 100 * fl / (ms * 1e-3) / 1e12 / 790, T / (ms * 1e-3), ph[0], ph[1],
                ph[2], ph[3]);
  }
}

TEST(CudaPrefillBench, DeltaNet) {
  REQUIRE_BENCH();
  const int nk = 16, nv = 32, C = 8192;
  std::printf("\n| DeltaNet T | ms | tok/s | prep ms | ring ms | chunk pass ms | state pass ms |\n|---|---|---|---|---|---|---|\n");
  for (int T : {512, 4096}) {
    Dev qkv(size_t(T) * C * 4), ab(size_t(T) * nv * 4 * 2), conv(size_t(C) * 4 * 4), ring(size_t(C) * 4 * 4),
        par(nv * 4 * 2), state(size_t(nv) * 128 * 128 * 4), out(size_t(T) * nv * 128 * 4);
    std::vector<float> h(size_t(T) * C);
    Rng r(9);
    for (auto& v : h) v = r.uniform(-2.f, 2.f);
    ck(cudaMemcpy(qkv.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "copy");
    h.assign(size_t(T) * nv * 2, 0.f);
    for (auto& v : h) v = r.normal();
    ck(cudaMemcpy(ab.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "copy");
    h.assign(size_t(C) * 4, 0.f);
    for (auto& v : h) v = r.uniform(-0.5f, 0.5f);
    ck(cudaMemcpy(conv.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "copy");
    h.assign(size_t(nv) * 2, 0.f);
    for (auto& v : h) v = r.uniform(-1, 1);
    ck(cudaMemcpy(par.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "copy");
    ck(cudaMemset(ring.p, 0, ring.bytes), "memset");
    ck(cudaMemset(state.p, 0, state.bytes), "memset");
    PrefillDeltaNetArgs a;
    a.T = T; a.nk = nk; a.nv = nv;
    a.qkv = qkv.as<float>(); a.ld_qkv = C;
    a.a = ab.as<float>(); a.b = ab.as<float>() + size_t(T) * nv; a.ld_ab = nv;
    a.conv_w = conv.as<float>(); a.conv_ring = ring.as<float>();
    a.a_log = par.as<float>(); a.dt_bias = par.as<float>() + nv;
    a.state = state.as<float>(); a.out = out.as<float>(); a.ld_out = size_t(nv) * 128;
    a.workspace_bytes = prefill_deltanet_workspace_bytes(T, nk, nv, 128, 128);
    Dev ws(a.workspace_bytes);
    a.workspace = ws.p;
    const double ms = time_ms([&] { prefill_deltanet(a, nullptr); });
    // Per-launch times: the median of 7 timed runs, each launch on its own.
    std::vector<float> runs[4];
    for (int rep = 0; rep < 7; ++rep) {
      float ph[4];
      prefill_deltanet_timed(a, nullptr, ph);
      for (int i = 0; i < 4; ++i) runs[i].push_back(ph[i]);
    }
    float med[4];
    for (int i = 0; i < 4; ++i) {
      std::sort(runs[i].begin(), runs[i].end());
      med[i] = runs[i][runs[i].size() / 2];
    }
    std::printf("| %d | %.3f | %.0f | %.3f | %.3f | %.3f | %.3f |\n", T, ms, T / (ms * 1e-3), med[0], med[1], med[2],
                med[3]);
  }
}

TEST(CudaPrefillBench, Attention) {
  REQUIRE_BENCH();
  const int nh = 16, nkv = 2, hd = 256;
  struct Case { int T, P; };
  const Case cases[] = {{4096, 0}, {4096, 28672}, {4096, 126976}, {32768, 0}};
  std::printf("\n| attention T | P | ms | TFLOP/s | of 790 |\n|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    const int cap = c.P + c.T;
    Dev q(size_t(c.T) * nh * 2 * hd * 2), k(size_t(nkv) * cap * hd * 2), v(k.bytes), out(size_t(c.T) * nh * hd * 2);
    fill_bf16(q, 1, 1.f);
    fill_bf16(k, 2, 1.f);
    fill_bf16(v, 3, 1.f);
    PrefillAttentionArgs a;
    a.T = c.T; a.first_position = c.P;
    a.q = q.as<uint16_t>(); a.gate = q.as<uint16_t>() + hd;
    a.q_row_stride = size_t(nh) * 2 * hd; a.q_head_stride = 2 * hd;
    a.k_cache = k.as<uint16_t>(); a.v_cache = v.as<uint16_t>(); a.capacity = cap;
    a.out = out.as<uint16_t>(); a.out_row_stride = size_t(nh) * hd;
    const double ms = time_ms([&] { prefill_attention(a, nullptr); }, 1, 5);
    const double pairs = double(c.T) * c.P + double(c.T) * (c.T + 1) / 2;
    const double fl = 4.0 * nh * hd * pairs;
    std::printf("| %d | %d | %.3f | %.0f | %.0f%% |\n", c.T, c.P, ms, fl / (ms * 1e-3) / 1e12,
                100 * fl / (ms * 1e-3) / 1e12 / 790);
  }
}

}  // namespace
}  // namespace lily::cuda

#else  // !LILY_HAVE_CUDA

TEST(CudaPrefill, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif

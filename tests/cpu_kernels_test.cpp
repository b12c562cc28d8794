// CPU kernels against plain references on random, odd-sized inputs.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/kernels.h"
#include "core/half.h"
#include "core/thread_pool.h"

namespace lily {
namespace {

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// An MLX-style affine matrix with random codes, scales and biases.
struct AffineMatrix {
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;  // bf16
  std::vector<float> dense;              // the dequantized reference
  Matrix m;

  AffineMatrix(int rows, int cols, int bits, int group, uint32_t seed) {
    std::mt19937 rng(seed);
    const int per_word = 32 / bits, groups = cols / group;
    codes.assign(static_cast<size_t>(rows) * cols / per_word, 0);
    scales.resize(static_cast<size_t>(rows) * groups);
    biases.resize(scales.size());
    dense.resize(static_cast<size_t>(rows) * cols);
    std::uniform_real_distribution<float> sd(0.001f, 0.05f), bd(-0.5f, 0.5f);
    for (size_t i = 0; i < scales.size(); ++i) {
      scales[i] = f32_to_bf16(sd(rng));
      biases[i] = f32_to_bf16(bd(rng));
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        uint32_t q = rng() & ((1u << bits) - 1);
        size_t flat = static_cast<size_t>(r) * cols + c;
        codes[flat / per_word] |= q << (bits * (flat % per_word));
        size_t g = static_cast<size_t>(r) * groups + c / group;
        dense[flat] = bf16_to_f32(scales[g]) * q + bf16_to_f32(biases[g]);
      }
    m.format = bits == 4 ? WeightFormat::Affine4 : WeightFormat::Affine8;
    m.rows = rows;
    m.cols = cols;
    m.group_size = group;
    m.scale_dtype = DType::BF16;
    m.data = reinterpret_cast<const uint8_t*>(codes.data());
    m.scales = reinterpret_cast<const uint8_t*>(scales.data());
    m.biases = reinterpret_cast<const uint8_t*>(biases.data());
  }
};

void naive_matmul(const std::vector<float>& w, int rows, int cols, const std::vector<float>& x,
                  int T, std::vector<double>& y) {
  y.assign(static_cast<size_t>(T) * rows, 0);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < rows; ++r) {
      double s = 0;
      for (int c = 0; c < cols; ++c) s += double(w[size_t(r) * cols + c]) * x[size_t(t) * cols + c];
      y[size_t(t) * rows + r] = s;
    }
}

// Both matmul paths (the SIMD one where the CPU has it, and the portable
// one) against the double-precision product of the dequantized weights.
struct SimdScope {
  explicit SimdScope(cpu::MatmulIsa cap) { cpu::set_matmul_isa(cap); }
  ~SimdScope() { cpu::set_matmul_isa(cpu::MatmulIsa::Avx512); }
};
// Every kernel this CPU can run (the portable one everywhere).
std::vector<cpu::MatmulIsa> matmul_paths() {
  cpu::set_matmul_isa(cpu::MatmulIsa::Avx512);
  std::vector<cpu::MatmulIsa> paths;
  for (int i = 0; i <= static_cast<int>(cpu::matmul_isa()); ++i) paths.push_back(static_cast<cpu::MatmulIsa>(i));
  return paths;
}

class AffineMatmul : public ::testing::TestWithParam<std::tuple<int, int, int, int, int>> {};

TEST_P(AffineMatmul, MatchesDequantizedReference) {
  auto [bits, rows, cols, T, group] = GetParam();
  AffineMatrix a(rows, cols, bits, group, 7u + bits + rows);
  std::vector<float> row(cols);
  for (int r = 0; r < rows; ++r) {
    cpu::dequantize_row(a.m, r, row.data());
    for (int c = 0; c < cols; ++c) ASSERT_EQ(row[c], a.dense[size_t(r) * cols + c]) << r << "," << c;
  }
  ThreadPool pool(3);
  // Inputs with a mean (as after a SiLU), so the group sums are not small.
  auto x = random_floats(size_t(T) * cols, 11);
  for (auto& v : x) v += 0.5f;
  std::vector<double> want;
  naive_matmul(a.dense, rows, cols, x, T, want);
  for (cpu::MatmulIsa isa : matmul_paths()) {
    SimdScope scope(isa);
    std::vector<float> y(size_t(T) * rows);
    cpu::matmul(pool, a.m, x.data(), T, cols, y.data(), rows);
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_NEAR(y[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << "kernel " << cpu::matmul_isa_name(isa) << " at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AffineMatmul,
                         ::testing::Values(std::make_tuple(4, 37, 192, 1, 64), std::make_tuple(4, 5, 64, 3, 64),
                                           std::make_tuple(8, 29, 320, 2, 64), std::make_tuple(8, 1, 128, 5, 64),
                                           std::make_tuple(4, 23, 96, 9, 32), std::make_tuple(4, 11, 384, 4, 128),
                                           std::make_tuple(8, 13, 256, 7, 128), std::make_tuple(4, 3, 48, 2, 16),
                                           std::make_tuple(4, 9, 40, 6, 8)));

// --- 8-bit inputs (ActPrecision::Q8, AVX-512 VNNI) ---------------------------

TEST(Q8, QuantizeRoundsPerGroup) {
  for (int max_code : {127, cpu::kMaxCode16}) {
    auto x = random_floats(200, 5, 3.f);
    std::fill(x.begin() + 100, x.begin() + 150, 0.f);  // an all-zero group
    std::vector<int32_t> q(200);
    std::vector<float> sc(4);
    cpu::quantize_inputs(x.data(), 200, 50, max_code, q.data(), sc.data());
    EXPECT_EQ(sc[2], 0.f);
    for (int g = 0; g < 4; ++g) {
      int top = 0;
      for (int i = 0; i < 50; ++i) {
        const float v = x[g * 50 + i];
        const int c = q[g * 50 + i];
        ASSERT_LE(std::abs(c), max_code);
        ASSERT_LE(std::fabs(v - c * sc[g]), sc[g] * 0.5f * (1 + 1e-3f) + 1e-7f) << g << "," << i;
        top = std::max(top, std::abs(c));
      }
      EXPECT_EQ(top, g == 2 ? 0 : max_code);
    }
  }
}

class Q8Matmul : public ::testing::TestWithParam<std::tuple<int, int, int, int, int>> {};

// The VNNI kernel against the same arithmetic in double: the weights' codes
// times the inputs' int8 codes, scaled per group, plus bias x the f32 group
// sum; and against the f32 product within the inputs' rounding.
// Every integer kernel this CPU runs (AVX-512 VNNI and / or AVX2).
std::vector<cpu::MatmulIsa> integer_paths() {
  std::vector<cpu::MatmulIsa> caps;
  for (cpu::MatmulIsa cap : {cpu::MatmulIsa::Avx512, cpu::MatmulIsa::Avx2}) {
    SimdScope scope(cap);
    if (cpu::integer_kernel() != cpu::IntKernel::None &&
        (caps.empty() || cpu::integer_kernel() == cpu::IntKernel::Avx2))
      caps.push_back(cap);
  }
  return caps;
}

TEST_P(Q8Matmul, MatchesQuantizedReference) {
  auto [bits, rows, cols, T, group] = GetParam();
  const auto caps = integer_paths();
  if (caps.empty()) GTEST_SKIP() << "no integer kernel (AVX2, AVX-512 VNNI) on this CPU";
  AffineMatrix a(rows, cols, bits, group, 31u + bits + rows);
  ThreadPool pool(3);
  int ran = 0;
  for (cpu::MatmulIsa cap : caps) {
  SimdScope scope(cap);
  const cpu::IntKernel kernel = cpu::integer_kernel();
  if (!cpu::integer_inputs_fit(a.m, kernel)) continue;
  SCOPED_TRACE(cpu::integer_kernel_name(kernel));
  ++ran;
  auto x = random_floats(size_t(T) * cols, 13);
  for (size_t i = 0; i < x.size(); ++i) x[i] += 0.5f * ((i / 7) % 3 == 0);
  const int groups = cols / group;
  std::vector<float> yf(size_t(T) * rows);
  cpu::matmul(pool, a.m, x.data(), T, cols, yf.data(), rows, cpu::ActPrecision::F32);
  for (auto act : {cpu::ActPrecision::Q8, cpu::ActPrecision::Q16}) {
  SCOPED_TRACE(act == cpu::ActPrecision::Q8 ? "q8" : "q16");
  std::vector<int32_t> xq(size_t(T) * cols);
  std::vector<float> xs(size_t(T) * groups);
  for (int t = 0; t < T; ++t)
    cpu::quantize_inputs(&x[size_t(t) * cols], cols, group, act == cpu::ActPrecision::Q8 ? 127 : cpu::kMaxCode16,
                         &xq[size_t(t) * cols], &xs[size_t(t) * groups]);
  std::vector<float> y(size_t(T) * rows);
  cpu::matmul(pool, a.m, x.data(), T, cols, y.data(), rows, act);
  const int per_word = 32 / bits;
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < rows; ++r) {
      double want = 0, bound = 0;
      for (int g = 0; g < groups; ++g) {
        const double sc = bf16_to_f32(a.scales[size_t(r) * groups + g]);
        const double bias = bf16_to_f32(a.biases[size_t(r) * groups + g]);
        double dot = 0, sum = 0, mag = 0;
        for (int c = g * group; c < (g + 1) * group; ++c) {
          const size_t flat = size_t(r) * cols + c;
          const double q = (a.codes[flat / per_word] >> (bits * (flat % per_word))) & ((1u << bits) - 1);
          dot += q * xq[size_t(t) * cols + c];
          sum += x[size_t(t) * cols + c];
          mag += sc * q;
        }
        want += sc * xs[size_t(t) * groups + g] * dot + bias * sum;
        bound += mag * xs[size_t(t) * groups + g] * 0.5;  // each input off by at most half a step
      }
      const float got = y[size_t(t) * rows + r];
      ASSERT_NEAR(got, want, 2e-5 * (1 + std::fabs(want))) << "row " << r << " input " << t;
      ASSERT_LE(std::fabs(got - yf[size_t(t) * rows + r]), bound * 1.001 + 1e-4) << "row " << r << " input " << t;
    }
  }
  }
  EXPECT_GT(ran, 0) << "no kernel takes this shape";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Q8Matmul,
                         ::testing::Values(std::make_tuple(4, 37, 256, 1, 64), std::make_tuple(4, 5, 128, 3, 32),
                                           std::make_tuple(4, 19, 384, 5, 128), std::make_tuple(4, 7, 512, 9, 256),
                                           std::make_tuple(4, 3, 128, 2, 16), std::make_tuple(4, 9, 192, 3, 64),
                                           std::make_tuple(4, 6, 64, 4, 8), std::make_tuple(4, 5, 1280, 2, 64),
                                           std::make_tuple(8, 29, 320, 2, 64),
                                           std::make_tuple(8, 1, 64, 7, 16), std::make_tuple(8, 13, 256, 4, 128),
                                           std::make_tuple(8, 11, 192, 6, 32)));

// Matrices the 8-bit kernel cannot tile, and unquantized ones, run the f32
// kernels: the same bits as asking for f32.
TEST(Q8, OtherLayoutsRunTheF32Kernels) {
  ThreadPool pool(2);
  for (auto [bits, cols, group] : {std::tuple{4, 96, 32}, std::tuple{8, 96, 32}, std::tuple{4, 40, 8}}) {
    AffineMatrix a(9, cols, bits, group, 3);
    for (auto k : {cpu::IntKernel::Avx512Vnni, cpu::IntKernel::Avx2})
      EXPECT_FALSE(cpu::integer_inputs_fit(a.m, k)) << bits << "/" << cols << "/" << group;
    auto x = random_floats(size_t(3) * cols, 17);
    std::vector<float> y(27), yf(27);
    cpu::matmul(pool, a.m, x.data(), 3, cols, yf.data(), 9, cpu::ActPrecision::F32);
    for (auto act : {cpu::ActPrecision::Q8, cpu::ActPrecision::Q16}) {
      cpu::matmul(pool, a.m, x.data(), 3, cols, y.data(), 9, act);
      EXPECT_EQ(y, yf);
    }
  }
}

// The SIMD path's row results do not depend on the number of threads, and
// it reads weights at any byte offset (tensors in a file need no alignment).
TEST(Matmul, SameBitsForAnyThreadCountAndAlignment) {
  const int rows = 70, cols = 136, T = 6;
  AffineMatrix a(rows, cols, 4, 8, 99);
  auto x = random_floats(size_t(T) * cols, 12);
  ThreadPool one(1), three(3);
  std::vector<float> y1(size_t(T) * rows), y3(y1.size());
  cpu::matmul(one, a.m, x.data(), T, cols, y1.data(), rows);
  cpu::matmul(three, a.m, x.data(), T, cols, y3.data(), rows);
  EXPECT_EQ(y1, y3);
  // bf16 weights one byte past an aligned address.
  auto wf = random_floats(size_t(rows) * cols, 4, 0.2f);
  std::vector<uint8_t> buf(wf.size() * 2 + 1);
  std::vector<float> dense(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    const uint16_t b = f32_to_bf16(wf[i]);
    std::memcpy(buf.data() + 1 + 2 * i, &b, 2);
    dense[i] = bf16_to_f32(b);
  }
  Matrix m;
  m.format = WeightFormat::BF16;
  m.rows = rows;
  m.cols = cols;
  m.data = buf.data() + 1;
  std::vector<double> want;
  naive_matmul(dense, rows, cols, x, T, want);
  for (cpu::MatmulIsa isa : matmul_paths()) {
    SimdScope scope(isa);
    cpu::matmul(three, m, x.data(), T, cols, y3.data(), rows);
    for (size_t i = 0; i < y3.size(); ++i) ASSERT_NEAR(y3[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << i;
  }
}

// Several matmuls in one loop give the bits of one call each, on both paths,
// with jobs of other formats, input counts (one none) and output strides.
TEST(Matmul, ManyJobsGiveTheBitsOfOneCallEach) {
  AffineMatrix a(37, 192, 4, 64, 5), b(19, 128, 8, 32, 6), c(8, 64, 4, 16, 7);
  auto wf = random_floats(size_t(23) * 77, 8, 0.2f);
  Matrix f;
  f.format = WeightFormat::F32;
  f.rows = 23;
  f.cols = 77;
  f.data = reinterpret_cast<const uint8_t*>(wf.data());
  auto x = random_floats(size_t(5) * 200, 9);
  const Matrix* ms[] = {&a.m, &b.m, &f, &c.m};
  const int Ts[] = {3, 1, 5, 0};
  ThreadPool pool(3);
  for (cpu::MatmulIsa isa : matmul_paths()) {
    SimdScope scope(isa);
    std::vector<std::vector<float>> one(4), many(4);
    std::vector<cpu::MatmulJob> jobs;
    for (int j = 0; j < 4; ++j) {
      const size_t ys = ms[j]->rows + 3;  // a padded output stride
      one[j].assign(std::max(1, Ts[j]) * ys, -1.f);
      many[j] = one[j];
      if (Ts[j] > 0) cpu::matmul(pool, *ms[j], x.data(), Ts[j], 200, one[j].data(), ys);
      jobs.push_back({ms[j], x.data(), Ts[j], 200, many[j].data(), ys});
    }
    cpu::matmul_many(pool, jobs);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(one[j], many[j]) << "job " << j << " kernel " << cpu::matmul_isa_name(isa);
  }
}

// Integer inputs: jobs that share an input (the same x, and the same
// column count and grouping: q / k / v, an expert's gate and up) share its
// codes; every job still gets the bits of a call of its own.
TEST(Q8, ManyJobsSharingAnInputGiveTheBitsOfOneCallEach) {
  const auto caps = integer_paths();
  if (caps.empty()) GTEST_SKIP() << "no integer kernel (AVX2, AVX-512 VNNI) on this CPU";
  AffineMatrix a(37, 256, 4, 64, 5), b(19, 256, 4, 64, 6), c(11, 256, 8, 64, 7), d(9, 256, 4, 32, 8);
  auto x = random_floats(size_t(5) * 300, 9);
  auto x2 = random_floats(size_t(5) * 300, 10);
  const Matrix* ms[] = {&a.m, &b.m, &c.m, &d.m, &a.m};
  const float* xs[] = {x.data(), x.data(), x.data(), x.data(), x2.data()};
  const int Ts[] = {3, 3, 3, 3, 3};
  ThreadPool pool(3);
  for (cpu::MatmulIsa cap : caps)
  for (auto act : {cpu::ActPrecision::Q16, cpu::ActPrecision::Q8}) {
    SimdScope scope(cap);
    std::vector<std::vector<float>> one(5), many(5);
    std::vector<cpu::MatmulJob> jobs;
    for (int j = 0; j < 5; ++j) {
      const size_t ys = ms[j]->rows;
      one[j].assign(Ts[j] * ys, -1.f);
      many[j] = one[j];
      cpu::matmul(pool, *ms[j], xs[j], Ts[j], 300, one[j].data(), ys, act);
      jobs.push_back({ms[j], xs[j], Ts[j], 300, many[j].data(), ys});
    }
    cpu::matmul_many(pool, jobs, act);
    for (int j = 0; j < 5; ++j) EXPECT_EQ(one[j], many[j]) << "job " << j << " " << cpu::matmul_isa_name(cap);
  }
}

TEST(Matmul, Bf16F16AndF32MatchReference) {
  const int rows = 41, cols = 77;
  auto wf = random_floats(size_t(rows) * cols, 3, 0.2f);
  std::vector<uint16_t> wb(wf.size()), wh(wf.size());
  std::vector<float> dense_b(wf.size()), dense_h(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wb[i] = f32_to_bf16(wf[i]);
    dense_b[i] = bf16_to_f32(wb[i]);
    // f16 of simple values: use the bf16 value's f16 encoding via float ops.
    float v = dense_b[i];
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    int e = int((bits >> 23) & 0xff) - 127 + 15;
    uint16_t h = uint16_t((bits >> 16) & 0x8000);
    if (e > 0 && e < 31) h |= uint16_t((e << 10) | ((bits >> 13) & 0x3ff));
    wh[i] = h;
    dense_h[i] = f16_to_f32(h);
  }
  ThreadPool pool(2);
  for (int T : {1, 2, 4, 5}) {
    auto x = random_floats(size_t(T) * cols, 5 + T);
    for (int pass = 0; pass < 3; ++pass) {
      Matrix m;
      m.format = pass == 0 ? WeightFormat::BF16 : pass == 1 ? WeightFormat::F16 : WeightFormat::F32;
      m.rows = rows;
      m.cols = cols;
      m.data = pass == 0   ? reinterpret_cast<const uint8_t*>(wb.data())
               : pass == 1 ? reinterpret_cast<const uint8_t*>(wh.data())
                           : reinterpret_cast<const uint8_t*>(wf.data());
      std::vector<double> want;
      naive_matmul(pass == 0 ? dense_b : pass == 1 ? dense_h : wf, rows, cols, x, T, want);
      for (cpu::MatmulIsa isa : matmul_paths()) {
        SimdScope scope(isa);
        std::vector<float> y(size_t(T) * rows);
        cpu::matmul(pool, m, x.data(), T, cols, y.data(), rows);
        for (size_t i = 0; i < y.size(); ++i)
          ASSERT_NEAR(y[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << "pass " << pass << " kernel " << cpu::matmul_isa_name(isa) << " T " << T;
      }
    }
  }
}

TEST(Half, F16Conversions) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);  // ties to even
}

// The chunked DeltaNet equals the recurrent one, from a non-zero state, for
// lengths that are not chunk multiples and chunk sizes that do not divide them.
TEST(DeltaNet, ChunkedEqualsRecurrent) {
  for (auto [T, dk, dv, chunk] : {std::tuple{150, 24, 40, 64}, std::tuple{37, 16, 8, 7},
                                  std::tuple{1, 8, 8, 64}, std::tuple{64, 12, 20, 64}}) {
    auto q = random_floats(size_t(T) * dk, 1), k = random_floats(size_t(T) * dk, 2),
         v = random_floats(size_t(T) * dv, 3), graw = random_floats(T, 4), braw = random_floats(T, 5);
    auto l2 = [&](std::vector<float>& x) {
      for (int t = 0; t < T; ++t) {
        float s = 0;
        for (int i = 0; i < dk; ++i) s += x[t * dk + i] * x[t * dk + i];
        for (int i = 0; i < dk; ++i) x[t * dk + i] /= std::sqrt(s + 1e-6f);
      }
    };
    l2(q);
    l2(k);
    std::vector<float> g(T), beta(T);
    for (int t = 0; t < T; ++t) {
      g[t] = -std::exp(-1.f) * cpu::softplus(graw[t]);
      beta[t] = cpu::sigmoid(braw[t]);
    }
    auto s0 = random_floats(size_t(dk) * dv, 6, 0.3f);
    std::vector<float> s1 = s0, s2 = s0, o1(size_t(T) * dv), o2(size_t(T) * dv);
    cpu::DeltaNetHeadIO io{q.data(), size_t(dk), k.data(), size_t(dk), v.data(), size_t(dv),
                           g.data(), beta.data(), 1, o1.data(), size_t(dv), T, dk, dv};
    cpu::deltanet_recurrent(io, s1.data());
    io.out = o2.data();
    cpu::deltanet_chunked(io, s2.data(), chunk);
    for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 2e-4 * (1 + std::fabs(o1[i]))) << "T=" << T << " i=" << i;
    for (size_t i = 0; i < s1.size(); ++i) ASSERT_NEAR(s1[i], s2[i], 2e-4 * (1 + std::fabs(s1[i]))) << "state " << i;
  }
}

// One recurrent step written out from the definition.
TEST(DeltaNet, RecurrentStepMatchesDefinition) {
  const int dk = 3, dv = 2;
  std::vector<float> S = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f};  // [dk][dv]
  float q[3] = {0.5f, -1.f, 0.25f}, k[3] = {1.f, 0.5f, -0.5f}, v[2] = {2.f, -1.f};
  float g = -0.3f, beta = 0.7f, o[2];
  std::vector<float> want = S;
  for (auto& s : want) s *= std::exp(g);
  float kv[2] = {0, 0};
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) kv[j] += want[i * dv + j] * k[i];
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) want[i * dv + j] += k[i] * (v[j] - kv[j]) * beta;
  float wo[2] = {0, 0};
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) wo[j] += want[i * dv + j] * q[i];
  cpu::DeltaNetHeadIO io{q, 3, k, 3, v, 2, &g, &beta, 1, o, 2, 1, dk, dv};
  cpu::deltanet_recurrent(io, S.data());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(S[i], want[i], 1e-6);
  EXPECT_NEAR(o[0], wo[0], 1e-6);
  EXPECT_NEAR(o[1], wo[1], 1e-6);
}

// Both cache layouts: position-major ([positions][kv heads][hd], the cuda
// test's host copies) and head-major with spare capacity (the cpu
// backend's: [kv heads][capacity][hd]).
void check_attention(int T, int past, int nh, int nkv, int hd, int threads) {
  const int total = past + T;
  auto q = random_floats(size_t(T) * nh * hd, 1);
  for (bool head_major : {false, true}) {
    const int cap = head_major ? total + 3 : total;
    const size_t head_stride = head_major ? size_t(cap) * hd : size_t(hd);
    const size_t pos_stride = head_major ? size_t(hd) : size_t(nkv) * hd;
    auto k = random_floats(size_t(cap) * nkv * hd, 2), v = random_floats(size_t(cap) * nkv * hd, 3);
    auto at = [&](const std::vector<float>& c, int p, int g, int x) { return c[g * head_stride + p * pos_stride + x]; };
    std::vector<float> out(size_t(T) * nh * hd);
    ThreadPool pool(threads);
    cpu::attention(pool, {q.data(), size_t(nh * hd), size_t(hd), k.data(), v.data(), head_stride, pos_stride,
                          out.data(), size_t(nh * hd), T, past, nh, nkv, hd});
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nh; ++h) {
        const int g = h / (nh / nkv), n = past + t + 1;
        std::vector<double> s(n);
        double mx = -1e30, sum = 0;
        for (int p = 0; p < n; ++p) {
          double d = 0;
          for (int x = 0; x < hd; ++x) d += double(q[(t * nh + h) * hd + x]) * at(k, p, g, x);
          s[p] = d / std::sqrt(double(hd));
          mx = std::max(mx, s[p]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int x = 0; x < hd; ++x) {
          double o = 0;
          for (int p = 0; p < n; ++p) o += s[p] / sum * at(v, p, g, x);
          ASSERT_NEAR(out[(t * nh + h) * hd + x], o, 1e-5)
              << "T " << T << " past " << past << " t " << t << " h " << h << " head-major " << head_major;
        }
      }
  }
}

TEST(Attention, MatchesNaiveCausalGqa) {
  check_attention(5, 6, 6, 2, 24, 2);
  check_attention(9, 0, 4, 4, 40, 3);
}

// The softmax's exp on every kernel: within a few ulp of std::exp over the
// range attention scores take (and 0-ish far below), sums included.
TEST(Attention, ExpShiftSumMatchesStdExp) {
  std::vector<float> x;
  for (int i = 0; i < 1003; ++i) x.push_back(-120.f + 120.f * i / 1002);  // to exactly 0
  for (auto isa : matmul_paths()) {
    SimdScope scope(isa);
    for (float m : {0.f, 3.5f}) {
      std::vector<float> s(x);
      for (auto& v : s) v += m;
      const float sum = cpu::exp_shift_sum(s.data(), static_cast<int>(s.size()), m);
      double want_sum = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const double want = std::exp(double(x[i]));
        want_sum += want;
        if (x[i] >= -87.f) ASSERT_NEAR(s[i], want, 4e-7 * want) << x[i] << " " << cpu::matmul_isa_name(isa);
        else ASSERT_LT(s[i], 2e-38f);
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
    }
  }
}

// A decode token (and two) over a long context: the positions are split into
// slices across the threads and merged.
TEST(Attention, LongContextSlicesMatchNaive) {
  for (auto isa : matmul_paths()) {
    SimdScope scope(isa);
    check_attention(1, 1500, 8, 2, 72, 3);
    check_attention(2, 1023, 6, 3, 40, 4);
    check_attention(1, 700, 4, 1, 256, 8);
  }
}

TEST(Rope, RotatesPairsAndKeepsTheRest) {
  auto head = random_floats(32, 9);
  auto orig = head;
  cpu::rope_neox(head.data(), 8, 0, 1e7f);  // position 0: identity
  EXPECT_EQ(head, orig);
  cpu::rope_neox(head.data(), 8, 17, 1e7f);
  for (int i = 8; i < 32; ++i) EXPECT_EQ(head[i], orig[i]);  // partial rotary
  for (int i = 0; i < 4; ++i) {
    float before = orig[i] * orig[i] + orig[i + 4] * orig[i + 4];
    float after = head[i] * head[i] + head[i + 4] * head[i + 4];
    EXPECT_NEAR(before, after, 1e-5);
  }
  // Pair 0 has frequency 1: angle = position.
  EXPECT_NEAR(head[0], orig[0] * std::cos(17.f) - orig[4] * std::sin(17.f), 1e-5);
}

TEST(RmsNorm, MatchesDefinition) {
  auto x = random_floats(33, 4), w = random_floats(33, 5);
  std::vector<float> y(33);
  cpu::rms_norm(x.data(), w.data(), 33, 1e-6f, y.data());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  double inv = 1 / std::sqrt(ss / 33 + 1e-6);
  for (int i = 0; i < 33; ++i) EXPECT_NEAR(y[i], x[i] * inv * w[i], 1e-5);
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(4);
  for (size_t n : {1u, 7u, 1000u, 12345u}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, 3, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i]++;
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1);
  }
}

}  // namespace
}  // namespace lily

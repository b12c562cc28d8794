// Each CUDA decode kernel against the CPU kernels on random inputs at sizes
// that are not multiples of the tiles. Skipped when no GPU is present.
#include <gtest/gtest.h>

#ifdef LILY_HAVE_CUDA

#include <cfloat>
#include <cstring>
#include <cstdlib>
#include <numeric>

#include "backend/cpu/attention.h"
#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/prefill_glue.h"
#include "backend/cuda/weights_upload.h"
#include "core/thread_pool.h"
#include "cuda_test_util.h"

namespace lily {
namespace {

using cuda::DeviceBuffer;
using test::random_matrix;
using test::random_vec;
using test::rel_err;

ThreadPool& pool() {
  static ThreadPool p(2);
  return p;
}

template <typename T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b;
  cuda::upload(b, v.data(), v.size());
  return b;
}
template <typename T>
std::vector<T> to_host(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  LILY_CUDA(cudaDeviceSynchronize());
  LILY_CUDA(cudaMemcpy(v.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
DeviceBuffer poisoned(size_t n) {  // NaN-filled f32 outputs: unwritten values show
  DeviceBuffer b(n * 4);
  LILY_CUDA(cudaMemset(b.get(), 0xff, n * 4));
  return b;
}

std::vector<float> cpu_matvec(const Matrix& m, const std::vector<float>& x) {
  std::vector<float> y(m.rows);
  cpu::matmul(pool(), m, x.data(), 1, m.cols, y.data(), m.rows);
  return y;
}

// One matrix's launch parameters: all its rows into out, from x.
cuda::MatvecParams one_job(const cuda::DevMatView& v, float* out, const float* x) {
  cuda::MatvecParams p;
  cuda::set_layout(p, v);
  p.njobs = 1;
  p.jobs[0] = {v.w, v.sb, v.rows, -1, 0, 0, out};
  p.x = x;
  return p;
}

struct FormatCase {
  WeightFormat f;
  int group;
  DType sdt;
  const char* name;
};
const FormatCase kFormats[] = {
    {WeightFormat::Affine4, 64, DType::BF16, "q4g64"}, {WeightFormat::Affine4, 32, DType::BF16, "q4g32"},
    {WeightFormat::Affine4, 128, DType::F16, "q4g128f16"}, {WeightFormat::Affine8, 64, DType::BF16, "q8g64"},
    {WeightFormat::Affine8, 32, DType::F16, "q8g32f16"}, {WeightFormat::BF16, 0, DType::BF16, "bf16"},
    {WeightFormat::F16, 0, DType::BF16, "f16"}, {WeightFormat::F32, 0, DType::BF16, "f32"},
};

// Sets an A/B switch (e.g. LILY_CUDA_FAST_STAGE, the one-pass input staging)
// for one scope; the launchers read them per launch.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name); }
};
// Runs a test body with the one-pass input staging (the default where it
// applies) and with the general one.
void with_both_stagings(void (*body)()) {
  for (const char* fast : {"1", "0"}) {
    ScopedEnv env("LILY_CUDA_FAST_STAGE", fast);
    SCOPED_TRACE(std::string("LILY_CUDA_FAST_STAGE=") + fast);
    body();
  }
}

void every_format_and_prologue() {
  std::mt19937 rng(7);
  for (const FormatCase& fc : kFormats) {
    const bool affine = fc.f == WeightFormat::Affine4 || fc.f == WeightFormat::Affine8;
    for (int cols : {384, 1152, 2816}) {
      if (affine && cols % fc.group) continue;
      SCOPED_TRACE(std::string(fc.name) + " cols " + std::to_string(cols));
      // Three matrices sharing the input: rows not multiples of the tile.
      auto a = random_matrix(fc.f, 77, cols, fc.group, fc.sdt, rng);
      auto b = random_matrix(fc.f, 5, cols, fc.group, fc.sdt, rng);
      auto c = random_matrix(fc.f, 130, cols, fc.group, fc.sdt, rng);
      auto da = cuda::upload_matrix(a.m, 1), db = cuda::upload_matrix(b.m, 2), dc = cuda::upload_matrix(c.m, 3);
      const auto x = random_vec(cols, rng), nw = random_vec(cols, rng, 0.5f, 1.5f), z = random_vec(cols, rng, -3, 3);
      auto dx = to_device(x), dnw = to_device(nw), dz = to_device(z);
      // 0: none, 1: RMSNorm, 2: gated RMSNorm over 64-wide segments, 3:
      // over 128-wide ones (the one-pass staging) with z read before the wait.
      for (int pv = 0; pv < 4; ++pv) {
        const int pro = pv < 3 ? pv : 2;
        // Reference input after the prologue.
        std::vector<float> xin = x;
        const int seg = pv == 2 ? 64 : pv == 3 ? 128 : cols;
        if (pro > 0) {
          std::vector<float> segw(seg);
          for (int s = 0; s < cols / seg; ++s) {
            std::copy(nw.begin(), nw.begin() + seg, segw.begin());
            cpu::rms_norm(&x[s * seg], segw.data(), seg, 1e-6f, &xin[s * seg]);
          }
          if (pro == 2)
            for (int i = 0; i < cols; ++i) xin[i] *= cpu::silu(z[i]);
        }
        auto ya = cpu_matvec(a.m, xin), yb = cpu_matvec(b.m, xin), yc = cpu_matvec(c.m, xin);
        auto oa = poisoned(77), ob = poisoned(5), oc = poisoned(130);
        cuda::MatvecParams p;
        cuda::set_layout(p, da.v);
        p.njobs = 3;
        const cuda::DevMat* ms[3] = {&da, &db, &dc};
        DeviceBuffer* os[3] = {&oa, &ob, &oc};
        for (int j = 0; j < 3; ++j) {
          p.jobs[j].w = ms[j]->v.w;
          p.jobs[j].sb = ms[j]->v.sb;
          p.jobs[j].rows = ms[j]->v.rows;
          p.jobs[j].out = os[j]->as<float>();
        }
        p.x = dx.as<float>();
        p.pro = static_cast<cuda::Prologue>(pro);
        p.norm_w = dnw.as<float>();
        p.seg = seg;
        p.gate_z = pro == 2 ? dz.as<float>() : nullptr;
        p.gate_z_early = pv == 3;
        p.eps = 1e-6f;
        cuda::launch_matvec(p, nullptr, false);
        EXPECT_LT(rel_err(to_host<float>(oa, 77), ya), 2e-5) << "prologue " << pv;
        EXPECT_LT(rel_err(to_host<float>(ob, 5), yb), 2e-5) << "prologue " << pv;
        EXPECT_LT(rel_err(to_host<float>(oc, 130), yc), 2e-5) << "prologue " << pv;
      }
    }
  }
}

TEST(CudaMatvec, EveryFormatAndPrologueMatchesCpu) {
  LILY_SKIP_WITHOUT_GPU();
  with_both_stagings(every_format_and_prologue);
}

// ---- Integer inputs (MatvecParams::act_bits, q4) ----
// The device's integer input, emulated: per 32-input chunk m = max |x|,
// codes rn(x * (C * (1 / max(m, FLT_MIN)))) in f32 (C = 32512 for 16 bits, 127 for 8,
// as matvec.cu computes them), each input taken as code * m / C; the bias term
// takes the exact sum(x).
struct IntInput {
  std::vector<int> code;
  std::vector<double> step, sum;  // per chunk
};
IntInput int_input(const std::vector<float>& x, int bits) {
  IntInput in;
  const float C = bits == 16 ? 32512.f : 127.f;
  const int n = static_cast<int>(x.size());
  in.code.resize(n);
  for (int c = 0; c * 32 < n; ++c) {
    float m = 0.f;
    double sum = 0;
    for (int i = c * 32; i < std::min(n, c * 32 + 32); ++i) {
      m = std::max(m, std::fabs(x[i]));
      sum += x[i];
    }
    const float mm = m > 0.f ? std::max(m, FLT_MIN) : 0.f;
    const float inv = mm > 0.f ? C * (1.f / mm) : 0.f;
    for (int i = c * 32; i < std::min(n, c * 32 + 32); ++i) {
      const float t = x[i] * inv;
      in.code[i] = static_cast<int>(std::nearbyint(t));
    }
    in.step.push_back(double(mm) / C);
    in.sum.push_back(sum);
  }
  return in;
}
// A q4 matrix (MLX layout: input 2k in byte k's low nibble) times an integer
// input, in double.
std::vector<float> int_matvec(const test::HostMatrix& h, const IntInput& in) {
  const Matrix& m = h.m;
  const int G = m.group_size, ng = m.cols / G;
  auto half = [&](const std::vector<uint8_t>& v, size_t i) {
    uint16_t b;
    std::memcpy(&b, &v[2 * i], 2);
    return m.scale_dtype == DType::F16 ? f16_to_f32(b) : bf16_to_f32(b);
  };
  std::vector<float> y(m.rows);
  for (int r = 0; r < m.rows; ++r) {
    double acc = 0;
    for (int c = 0; c < m.cols / 32; ++c) {
      const size_t g = size_t(r) * ng + (c * 32) / G;
      long long qx = 0;
      for (int i = c * 32; i < c * 32 + 32; ++i) {
        const size_t e = size_t(r) * m.cols + i;
        const int q = (h.data[e / 2] >> (4 * (e & 1))) & 15;
        qx += q * in.code[i];
      }
      acc += half(h.scales, g) * in.step[c] * double(qx) + half(h.biases, g) * in.sum[c];
    }
    y[r] = static_cast<float>(acc);
  }
  return y;
}
// The bound against the emulation: 8 bits after a norm prologue, an input
// within an ulp of a rounding boundary may take the other code (the device
// normalises in another order), a step of m / 127 on one product, hence
// 1e-3; otherwise (and at 16 bits, where such a step is m / 32512) f32
// rounding only. Against the f32 product: each input is off by at most half
// a step (m / 254, m / 65024).
double emu_tol(int bits, bool prologue) { return bits == 8 && prologue ? 1e-3 : 2e-5; }
double f32_tol(int bits) { return bits == 8 ? 2e-2 : 1e-4; }

// The q4 matvec with integer inputs, every prologue and three q4 layouts:
// against the emulation and against the f32 product.
void int_inputs_every_prologue(int bits) {
  std::mt19937 rng(17);
  for (const FormatCase& fc : kFormats) {
    if (fc.f != WeightFormat::Affine4) continue;
    for (int cols : {384, 1152, 2816, 4096}) {
      if (cols % fc.group) continue;
      SCOPED_TRACE(std::string(fc.name) + " cols " + std::to_string(cols) + " bits " + std::to_string(bits));
      auto a = random_matrix(fc.f, 77, cols, fc.group, fc.sdt, rng);
      auto b = random_matrix(fc.f, 130, cols, fc.group, fc.sdt, rng);
      auto da = cuda::upload_matrix(a.m, 1), db = cuda::upload_matrix(b.m, 2);
      const auto x = random_vec(cols, rng, -2, 2), nw = random_vec(cols, rng, 0.5f, 1.5f),
                 z = random_vec(cols, rng, -3, 3);
      auto dx = to_device(x), dnw = to_device(nw), dz = to_device(z);
      for (int pv = 0; pv < 3; ++pv) {  // none, RMSNorm, gated RMSNorm over 128-wide segments
        std::vector<float> xin = x;
        const int seg = pv == 2 ? 128 : cols;
        if (pv > 0)
          for (int s = 0; s < cols / seg; ++s) cpu::rms_norm(&x[s * seg], nw.data(), seg, 1e-6f, &xin[s * seg]);
        if (pv == 2)
          for (int i = 0; i < cols; ++i) xin[i] *= cpu::silu(z[i]);
        const IntInput in = int_input(xin, bits);
        auto oa = poisoned(77), ob = poisoned(130);
        cuda::MatvecParams p;
        cuda::set_layout(p, da.v);
        p.njobs = 2;
        p.jobs[0] = {da.v.w, da.v.sb, 77, -1, 0, 0, oa.as<float>()};
        p.jobs[1] = {db.v.w, db.v.sb, 130, -1, 0, 0, ob.as<float>()};
        p.x = dx.as<float>();
        p.pro = static_cast<cuda::Prologue>(pv == 0 ? 0 : pv == 1 ? 1 : 2);
        p.norm_w = dnw.as<float>();
        p.seg = seg;
        p.gate_z = pv == 2 ? dz.as<float>() : nullptr;
        p.eps = 1e-6f;
        p.act_bits = bits;
        cuda::launch_matvec(p, nullptr, false);
        const auto ga = to_host<float>(oa, 77), gb = to_host<float>(ob, 130);
        EXPECT_LT(rel_err(ga, int_matvec(a, in)), emu_tol(bits, pv > 0)) << "prologue " << pv;
        EXPECT_LT(rel_err(gb, int_matvec(b, in)), emu_tol(bits, pv > 0)) << "prologue " << pv;
        EXPECT_LT(rel_err(ga, cpu_matvec(a.m, xin)), f32_tol(bits)) << "prologue " << pv;
        EXPECT_LT(rel_err(gb, cpu_matvec(b.m, xin)), f32_tol(bits)) << "prologue " << pv;
      }
    }
  }
}

TEST(CudaMatvecIntInputs, EveryPrologueMatchesEmulation) {
  LILY_SKIP_WITHOUT_GPU();
  for (int bits : {16, 8}) int_inputs_every_prologue(bits);
  {
    // A chunk of zeros and a chunk with one outlier 3,000x its neighbours
    // (a massive activation): each chunk keeps its own scale.
    std::mt19937 rng(31);
    const int cols = 1152;
    auto a = random_matrix(WeightFormat::Affine4, 77, cols, 64, DType::BF16, rng);
    auto da = cuda::upload_matrix(a.m, 1);
    auto x = random_vec(cols, rng);
    std::fill(x.begin(), x.begin() + 32, 0.f);
    x[3 * 32 + 5] = 3000.f;
    auto dx = to_device(x);
    for (int bits : {16, 8}) {
      SCOPED_TRACE("zeros and an outlier, bits " + std::to_string(bits));
      auto out = poisoned(77);
      cuda::MatvecParams p = one_job(da.v, out.as<float>(), dx.as<float>());
      p.act_bits = bits;
      cuda::launch_matvec(p, nullptr, false);
      const auto y = to_host<float>(out, 77);
      EXPECT_LT(rel_err(y, int_matvec(a, int_input(x, bits))), 2e-5);
      EXPECT_LT(rel_err(y, cpu_matvec(a.m, x)), f32_tol(bits));
    }
  }
  // Where the one-pass staging does not apply the launch keeps f32 inputs.
  ScopedEnv env("LILY_CUDA_FAST_STAGE", "0");
  std::mt19937 rng(19);
  auto a = random_matrix(WeightFormat::Affine4, 45, 256, 64, DType::BF16, rng);
  auto da = cuda::upload_matrix(a.m, 1);
  const auto x = random_vec(256, rng);
  auto dx = to_device(x);
  auto out = poisoned(45);
  cuda::MatvecParams p = one_job(da.v, out.as<float>(), dx.as<float>());
  p.act_bits = 8;
  cuda::launch_matvec(p, nullptr, false);
  EXPECT_LT(rel_err(to_host<float>(out, 45), cpu_matvec(a.m, x)), 2e-5);
}

// ---- Several input rows in one launch (MatvecParams::nrows) ----
// Each row's outputs are those of a launch of that row alone, bit for bit
// (the same staging and sums per row), for every prologue, epilogue and q4
// layout, with row strides that leave gaps (the gaps stay unwritten).
void rows_match_one_row_launches() {
  std::mt19937 rng(23);
  for (const FormatCase& fc : kFormats) {
    if (fc.f != WeightFormat::Affine4) continue;
    for (int cols : {384, 1152, 4096}) {
      if (cols % fc.group) continue;
      auto a = random_matrix(fc.f, 77, cols, fc.group, fc.sdt, rng);
      auto b = random_matrix(fc.f, 130, cols, fc.group, fc.sdt, rng);
      auto da = cuda::upload_matrix(a.m, 1), db = cuda::upload_matrix(b.m, 2);
      const int R = cuda::kMaxMatvecRows, ldx = cols + 12, ldz = cols + 4;
      const auto X = random_vec(size_t(R) * ldx, rng, -2, 2), Z = random_vec(size_t(R) * ldz, rng, -3, 3),
                 nw = random_vec(cols, rng, 0.5f, 1.5f);
      auto dX = to_device(X), dZ = to_device(Z), dnw = to_device(nw);
      for (int bits : {16, 8})
        for (int nrows = 2; nrows <= R; ++nrows)
          for (int pv = 0; pv < 3; ++pv)
            for (int ep = 0; ep < 3; ++ep) {
              SCOPED_TRACE(std::string(fc.name) + " cols " + std::to_string(cols) + " bits " +
                           std::to_string(bits) + " rows " + std::to_string(nrows) + " prologue " +
                           std::to_string(pv) + " epilogue " + std::to_string(ep));
              const bool swiglu = ep == 2;  // one job: a's rows as gate / up pairs (76 rows: 38 outputs)
              const int ld = 130 + 3;  // one output row stride for every job
              cuda::MatvecParams p;
              cuda::set_layout(p, da.v);
              p.njobs = swiglu ? 1 : 2;
              p.jobs[0] = {da.v.w, da.v.sb, swiglu ? 76 : 77, -1, 0, 0, nullptr};
              p.jobs[1] = {db.v.w, db.v.sb, 130, -1, 0, 0, nullptr};
              p.pro = static_cast<cuda::Prologue>(pv);
              p.norm_w = dnw.as<float>();
              p.seg = pv == 2 ? 128 : cols;
              p.gate_z = pv == 2 ? dZ.as<float>() : nullptr;
              p.eps = 1e-6f;
              p.epi = static_cast<cuda::Epilogue>(ep);
              p.act_bits = bits;
              // Outputs: NaN (Store, SwiGLU) or random values to add to.
              const size_t na = size_t(nrows) * ld, nb = size_t(nrows) * ld;
              const auto init_a = random_vec(na, rng), init_b = random_vec(nb, rng);
              auto fill = [&](DeviceBuffer& d, const std::vector<float>& init) {
                if (ep == 1) cuda::upload(d, init.data(), init.size());
                else d = poisoned(init.size());
              };
              DeviceBuffer oa, ob;
              fill(oa, init_a);
              fill(ob, init_b);
              cuda::MatvecParams q = p;
              q.nrows = nrows;
              q.x = dX.as<float>();
              q.ldx = ldx;
              q.ldz = ldz;
              q.ldo = ld;
              q.jobs[0].out = oa.as<float>();
              q.jobs[1].out = ob.as<float>();
              ASSERT_TRUE(cuda::matvec_rows_ok(q));
              cuda::launch_matvec(q, nullptr, false);
              const auto ga = to_host<float>(oa, na), gb = to_host<float>(ob, nb);
              for (int i = 0; i < nrows; ++i) {
                DeviceBuffer ra1, rb1;
                const std::vector<float> ia(init_a.begin() + size_t(i) * ld, init_a.begin() + size_t(i + 1) * ld),
                    ib(init_b.begin() + size_t(i) * ld, init_b.begin() + size_t(i + 1) * ld);
                fill(ra1, ia);
                fill(rb1, ib);
                cuda::MatvecParams o = p;
                o.x = dX.as<float>() + size_t(i) * ldx;
                if (p.gate_z) o.gate_z = dZ.as<float>() + size_t(i) * ldz;
                o.jobs[0].out = ra1.as<float>();
                o.jobs[1].out = rb1.as<float>();
                cuda::launch_matvec(o, nullptr, false);
                const auto ea = to_host<float>(ra1, ld), eb = to_host<float>(rb1, ld);
                // Bit for bit, the gaps included (NaN or the initial values).
                EXPECT_EQ(0, std::memcmp(ea.data(), ga.data() + size_t(i) * ld, ld * 4)) << "row " << i;
                if (!swiglu) {
                  EXPECT_EQ(0, std::memcmp(eb.data(), gb.data() + size_t(i) * ld, ld * 4)) << "row " << i;
                }
                if (i == nrows - 1 && ep == 0) {
                  // And against the f32 product (the one-row kernel's own test
                  // bounds it; this keeps the check able to fail alone).
                  std::vector<float> xin(X.begin() + size_t(i) * ldx, X.begin() + size_t(i) * ldx + cols);
                  if (pv > 0)
                    for (int sg = 0; sg < cols / p.seg; ++sg)
                      cpu::rms_norm(&X[size_t(i) * ldx + sg * p.seg], nw.data(), p.seg, 1e-6f, &xin[sg * p.seg]);
                  if (pv == 2)
                    for (int k = 0; k < cols; ++k) xin[k] *= cpu::silu(Z[size_t(i) * ldz + k]);
                  std::vector<float> got(ga.begin() + size_t(i) * ld, ga.begin() + size_t(i) * ld + 77);
                  EXPECT_LT(rel_err(got, cpu_matvec(a.m, xin)), f32_tol(bits));
                }
              }
            }
    }
  }
}

TEST(CudaMatvecRows, EachRowMatchesItsOwnLaunchBitForBit) {
  LILY_SKIP_WITHOUT_GPU();
  rows_match_one_row_launches();
}

TEST(CudaMatvecRows, RefusesWhatItCannotTake) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  auto a = random_matrix(WeightFormat::Affine4, 40, 256, 64, DType::BF16, rng);
  auto q8 = random_matrix(WeightFormat::Affine8, 40, 256, 64, DType::BF16, rng);
  auto da = cuda::upload_matrix(a.m, 1), d8 = cuda::upload_matrix(q8.m, 2);
  auto x = to_device(random_vec(4 * 256, rng));
  auto out = poisoned(4 * 40);
  cuda::MatvecParams ok = one_job(da.v, out.as<float>(), x.as<float>());
  ok.act_bits = 16;
  ok.nrows = 3;
  ok.ldx = 256;
  ok.ldo = 40;
  EXPECT_TRUE(cuda::matvec_rows_ok(ok));
  std::vector<cuda::MatvecParams> bad(7, ok);
  bad[0].act_bits = 0;  // f32 inputs
  bad[1] = one_job(d8.v, out.as<float>(), x.as<float>());  // q8 weights
  bad[1].act_bits = 16;
  bad[1].nrows = 2;
  bad[2].nrows = cuda::kMaxMatvecRows + 1;
  bad[3].ldx = 258;  // rows not 16-byte aligned
  bad[4].argmax = 1;
  bad[5].jobs[0].slot = 0;  // a routed job
  bad[6].gate_z_early = 1;
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_FALSE(cuda::matvec_rows_ok(bad[i])) << "case " << i;
    EXPECT_THROW(cuda::launch_matvec(bad[i], nullptr, false), std::exception) << "case " << i;
  }
}

// E experts' gate and up (I x H, q4 g64), uploaded as the backend does: one
// stack with each expert's gate and up rows interleaved.
struct ExpertStack {
  std::vector<test::HostMatrix> gates, ups;
  cuda::DevMat stack;
};
ExpertStack random_expert_stack(int E, int I, int H, std::mt19937& rng, uint64_t seed) {
  ExpertStack s;
  for (int e = 0; e < E; ++e) {
    s.gates.push_back(random_matrix(WeightFormat::Affine4, I, H, 64, DType::BF16, rng));
    s.ups.push_back(random_matrix(WeightFormat::Affine4, I, H, 64, DType::BF16, rng));
  }
  cuda::MatPacker pk(s.gates[0].m, 2 * I * E);
  for (int e = 0; e < E; ++e) pk.add_interleaved(s.gates[e].m, s.ups[e].m);
  s.stack = pk.finish(seed);
  return s;
}

TEST(CudaMatvec, AddAndSwiGlu) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const int E = 5, I = 45, H = 320;
  ExpertStack es = random_expert_stack(E, I, H, rng, 1);
  const auto& gates = es.gates;
  const auto& ups = es.ups;
  const auto& stack = es.stack;
  const auto x = random_vec(H, rng);
  auto dx = to_device(x);
  // SwiGLU over two experts of the interleaved stack (offsets from the host).
  const std::vector<int> sel = {3, 0};
  auto out = poisoned(2 * I);
  cuda::MatvecParams p;
  cuda::set_layout(p, stack.v);
  p.njobs = 2;
  for (int j = 0; j < 2; ++j) {
    p.jobs[j].w = stack.v.w + size_t(sel[j]) * 2 * I * stack.v.chunks;
    p.jobs[j].sb = stack.v.sb + size_t(sel[j]) * 2 * I * stack.v.groups;
    p.jobs[j].rows = 2 * I;
    p.jobs[j].out = out.as<float>() + j * I;
  }
  p.x = dx.as<float>();
  p.epi = cuda::Epilogue::SwiGLU;
  cuda::launch_matvec(p, nullptr, false);
  auto got = to_host<float>(out, 2 * I);
  std::vector<float> want;
  for (int e : sel) {
    auto g = cpu_matvec(gates[e].m, x), u = cpu_matvec(ups[e].m, x);
    for (int i = 0; i < I; ++i) want.push_back(cpu::silu(g[i]) * u[i]);
  }
  EXPECT_LT(rel_err(got, want), 2e-5);

  // Add epilogue: out += W x, on 99 rows and on 5,003 (more tiles than an
  // H200 holds blocks); twice, the second adding to the first.
  for (int R : {99, 5003}) {
    SCOPED_TRACE("Add, rows " + std::to_string(R));
    auto m = random_matrix(WeightFormat::BF16, R, H, 0, DType::BF16, rng);
    auto dm = cuda::upload_matrix(m.m, 2);
    const auto base = random_vec(R, rng);
    auto dout = to_device(base);
    cuda::MatvecParams q = one_job(dm.v, dout.as<float>(), dx.as<float>());
    q.epi = cuda::Epilogue::Add;
    cuda::launch_matvec(q, nullptr, false);
    const auto wx = cpu_matvec(m.m, x);
    std::vector<float> y(R);
    for (int i = 0; i < R; ++i) y[i] = base[i] + wx[i];
    EXPECT_LT(rel_err(to_host<float>(dout, R), y), 2e-5);
    cuda::launch_matvec(q, nullptr, false);
    for (int i = 0; i < R; ++i) y[i] += wx[i];
    EXPECT_LT(rel_err(to_host<float>(dout, R), y), 2e-5) << "second add";
  }
}

// The MoE block's first two launches as the backend issues them: the router
// matvec writes E logits (+ the shared-expert gate logit), then gate_up's
// route prologue takes softmax -> top-k -> renormalisation and runs the
// selected experts (+ the shared expert) with SwiGLU. Against the CPU
// backend's routing on the device's logits, and the CPU matvec.
// fold: the router folded into the launch before (RouterFold): an out_proj
// (q4, residual add) writes h and sums the router's fixed-point logits into
// an accumulator that a third launch zeroed first (it starts as garbage),
// and gate_up routes from those.
int g_route_bits = 0;  // routed_gate_up with integer inputs on the q4 launches (against the emulation)
void routed_gate_up() {
  std::mt19937 rng(5);
  struct Case {
    int E, k, shared, norm, ties, fold = 0, H = 320;
    WeightFormat rf = WeightFormat::Affine8;
    DType sdt = DType::BF16;
  };
  // ties: logits from the host, three distinct values (many exact ties);
  // those cases also run gate_up without an input prologue. The 4,480-wide
  // fold case runs 280 blocks (a tile each), more than an H200 holds at once.
  const Case cases[] = {{37, 5, 1, 1, 0},
                        {37, 5, 0, 0, 0},
                        {300, 8, 1, 0, 0},
                        {512, 11, 1, 1, 0},
                        {256, 8, 0, 1, 0},
                        {70, 6, 1, 1, 1},
                        {45, 7, 0, 0, 1},
                        {256, 8, 1, 1, 1},
                        {37, 5, 1, 1, 0, 1},
                        {256, 8, 1, 1, 0, 1, 2048},
                        {128, 8, 0, 1, 0, 1, 320, WeightFormat::Affine4, DType::F16},
                        {300, 8, 1, 0, 0, 1, 4480},
                        {383, 9, 1, 1, 0, 1, 192, WeightFormat::Affine4}};
  const int I = 45, Is = 29;
  for (const Case& rc : cases) {
    const int E = rc.E, k = rc.k, H = rc.H;
    SCOPED_TRACE("E " + std::to_string(E) + " k " + std::to_string(k) + " shared " +
                 std::to_string(rc.shared) + " norm " + std::to_string(rc.norm) + " ties " +
                 std::to_string(rc.ties) + " fold " + std::to_string(rc.fold) + " H " + std::to_string(H));
    auto r = random_matrix(rc.rf, E, H, 64, rc.sdt, rng);
    auto sg = random_matrix(rc.rf, 1, H, 64, rc.sdt, rng);
    auto dr = cuda::upload_matrix(r.m, 1), dsg = cuda::upload_matrix(sg.m, 2);
    ExpertStack es = random_expert_stack(E, I, H, rng, 3);
    const auto& gates = es.gates;
    const auto& ups = es.ups;
    const auto& stack = es.stack;
    auto shg = random_matrix(WeightFormat::Affine4, Is, H, 64, DType::BF16, rng);
    auto shu = random_matrix(WeightFormat::Affine4, Is, H, 64, DType::BF16, rng);
    auto dsh = cuda::upload_interleaved(shg.m, shu.m, 4);
    auto x = random_vec(H, rng, -3, 3);
    const auto nw = random_vec(H, rng, 0.5f, 1.5f);
    auto dx = to_device(x), dnw = to_device(nw);
    const cuda::Prologue pro = rc.ties ? cuda::Prologue::None : cuda::Prologue::Norm;

    DeviceBuffer acc, fold_q, fold_sb;
    float inv_r = 1.f;
    if (rc.fold) {
      // h = x + W_o a with the router fold, after a launch that zeroes acc.
      const cuda::DevMatView* psg = rc.shared ? &dsg.v : nullptr;
      ASSERT_TRUE(cuda::router_fold_ok(dr.v, psg, H));
      const cuda::RouterFold shape = cuda::router_fold_shape(dr.v, psg);
      const int ld = shape.ld;
      fold_q = DeviceBuffer(size_t(H) * ld);
      fold_sb = DeviceBuffer(size_t(dr.v.groups) * ld * 4);
      acc = DeviceBuffer(size_t(ld) * 8);
      LILY_CUDA(cudaMemset(acc.get(), 0x5a, acc.bytes()));
      cuda::build_router_fold(dr.v, psg, fold_q.as<uint32_t>(), fold_sb.as<uint32_t>(), nullptr);
      const int A = 192;
      auto wo = random_matrix(WeightFormat::Affine4, H, A, 64, DType::BF16, rng);
      auto dwo = cuda::upload_matrix(wo.m, 6);
      const auto a = random_vec(A, rng);
      auto da = to_device(a);
      {
        auto scratch = poisoned(7);
        cuda::MatvecParams z = one_job(dwo.v, scratch.as<float>(), da.as<float>());
        z.jobs[0].rows = 7;
        z.zero_acc = acc.as<unsigned long long>();
        z.zero_n = E + rc.shared;
        cuda::launch_matvec(z, nullptr, false);
      }
      cuda::MatvecParams o = one_job(dwo.v, dx.as<float>(), da.as<float>());
      o.epi = cuda::Epilogue::Add;
      o.act_bits = g_route_bits;
      o.fold = shape;
      o.fold.q = fold_q.as<uint32_t>();
      o.fold.sb = fold_sb.as<uint32_t>();
      o.fold.g = dnw.as<float>();
      o.fold.acc = acc.as<unsigned long long>();
      cuda::launch_matvec(o, nullptr, false);
      auto want_h = g_route_bits ? int_matvec(wo, int_input(a, g_route_bits)) : cpu_matvec(wo.m, a);
      for (int i = 0; i < H; ++i) want_h[i] += x[i];
      x = to_host<float>(dx, H);
      EXPECT_LT(rel_err(x, want_h), 2e-5);
      double ss = 0;
      for (float v : x) ss += double(v) * v;
      inv_r = static_cast<float>(1.0 / std::sqrt(ss / H + 1e-6));
    }
    std::vector<float> xn = x;
    if (pro == cuda::Prologue::Norm) cpu::rms_norm(x.data(), nw.data(), H, 1e-6f, xn.data());

    auto logits = poisoned(E + 1);
    if (rc.ties) {
      std::vector<float> tl(E + 1);
      for (float& v : tl) v = 0.5f * static_cast<float>(rng() % 3);
      cuda::upload(logits, tl.data(), tl.size());
    } else if (!rc.fold) {
      cuda::MatvecParams p;
      cuda::set_layout(p, dr.v);
      p.njobs = rc.shared ? 2 : 1;
      p.jobs[0] = {dr.v.w, dr.v.sb, E, -1, 0, 0, logits.as<float>()};
      p.jobs[1] = {dsg.v.w, dsg.v.sb, 1, -1, 0, 0, logits.as<float>() + E};
      p.x = dx.as<float>();
      p.pro = cuda::Prologue::Norm;
      p.norm_w = dnw.as<float>();
      p.seg = H;
      cuda::launch_matvec(p, nullptr, false);
    }

    auto sel_w = poisoned(k + 1), out = poisoned(size_t(k) * I + Is);
    DeviceBuffer sel_idx(k * 4);
    LILY_CUDA(cudaMemset(sel_idx.get(), 0xff, k * 4));
    cuda::MatvecParams g;
    cuda::set_layout(g, stack.v);
    g.route = {logits.as<float>(), E, k, rc.norm, rc.shared ? logits.as<float>() + E : nullptr,
               sel_idx.as<int>(), sel_w.as<float>()};
    if (rc.fold) {
      g.route.logits = nullptr;
      g.route.shared_gate_logit = nullptr;
      g.route.acc = acc.as<unsigned long long>();
      g.route.acc_shared = rc.shared;
    }
    g.njobs = k + rc.shared;
    for (int j = 0; j < k; ++j)
      g.jobs[j] = {stack.v.w, stack.v.sb, 2 * I, j, 2LL * I * stack.v.chunks, 2LL * I * stack.v.groups,
                   out.as<float>() + j * I};
    if (rc.shared) g.jobs[k] = {dsh.v.w, dsh.v.sb, 2 * Is, -1, 0, 0, out.as<float>() + k * I};
    g.x = dx.as<float>();
    g.pro = pro;
    g.norm_w = dnw.as<float>();
    g.seg = H;
    g.epi = cuda::Epilogue::SwiGLU;
    g.act_bits = g_route_bits;
    cuda::launch_matvec(g, nullptr, false);

    // Router logits against the CPU, then the CPU's routing on the device's
    // logits (routing is what is tested; near-ties would otherwise flip).
    // Folded: the fixed-point sums over the RMS the host takes of h.
    auto lg = to_host<float>(logits, E + 1);
    if (rc.fold) {
      auto a = to_host<long long>(acc, E + rc.shared);
      for (int e = 0; e < E + rc.shared; ++e) lg[e] = static_cast<float>(double(a[e]) / 4294967296.0) * inv_r;
    }
    if (!rc.ties) {
      auto want_lg = cpu_matvec(r.m, xn);
      if (rc.shared) want_lg.push_back(cpu_matvec(sg.m, xn)[0]);
      EXPECT_LT(rel_err(lg, want_lg), 2e-5);
    }
    std::vector<float> pr(lg.begin(), lg.begin() + E);
    const float mx = *std::max_element(pr.begin(), pr.end());
    float sum = 0;
    for (float& v : pr) sum += (v = std::exp(v - mx));
    for (float& v : pr) v /= sum;
    std::vector<int> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int a, int b) { return pr[a] > pr[b] || (pr[a] == pr[b] && a < b); });
    float top = 0;
    for (int j = 0; j < k; ++j) top += pr[idx[j]];
    auto gi = to_host<int>(sel_idx, k);
    auto gw = to_host<float>(sel_w, k + 1);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(gi[j], idx[j]) << "slot " << j;
      EXPECT_NEAR(gw[j], rc.norm ? pr[idx[j]] / top : pr[idx[j]], 1e-6) << "slot " << j;
    }
    if (rc.shared) {
      EXPECT_NEAR(gw[k], cpu::sigmoid(lg[E]), 1e-6);
    }

    // The selected experts' SwiGLU outputs (+ the shared expert's).
    // (Integer inputs: emu_tol.)
    std::vector<float> want;
    // The one-pass staging (and so int8) needs the 224 staging threads to
    // hold the input in 4 float4s each: H <= 3,584 (the 4,480 case stays f32).
    const bool xi = g_route_bits && H <= 4 * 4 * (cuda::kMatvecThreads - 32);
    const IntInput xq = int_input(xn, g_route_bits ? g_route_bits : 16);
    auto swiglu = [&](const test::HostMatrix& gm, const test::HostMatrix& um) {
      auto gg = xi ? int_matvec(gm, xq) : cpu_matvec(gm.m, xn);
      auto uu = xi ? int_matvec(um, xq) : cpu_matvec(um.m, xn);
      for (size_t i = 0; i < gg.size(); ++i) want.push_back(cpu::silu(gg[i]) * uu[i]);
    };
    for (int j = 0; j < k; ++j) swiglu(gates[idx[j]], ups[idx[j]]);
    if (rc.shared) swiglu(shg, shu);
    const double tol = xi ? emu_tol(g_route_bits, pro != cuda::Prologue::None) : 2e-5;
    EXPECT_LT(rel_err(to_host<float>(out, want.size()), want), tol);
  }
}

TEST(CudaMatvec, RoutedGateUpMatchesCpu) {
  LILY_SKIP_WITHOUT_GPU();
  with_both_stagings(routed_gate_up);
}

// The route and fold launches with integer inputs (the one-pass staging).
TEST(CudaMatvecIntInputs, RoutedGateUpAndFoldMatchEmulation) {
  LILY_SKIP_WITHOUT_GPU();
  for (int bits : {16, 8}) {
    SCOPED_TRACE("bits " + std::to_string(bits));
    g_route_bits = bits;
    routed_gate_up();
  }
  g_route_bits = 0;
}

// One lm_head launch (a single q4 job of V rows, stored, with the argmax
// and the position step; the input RMSNorm when `norm`) against the CPU.
// bits: integer inputs (act_bits), against the emulation.
void check_lm_head_launch(int V, int H, DType sdt, bool norm, std::mt19937& rng, int bits = 0) {
  auto m = random_matrix(WeightFormat::Affine4, V, H, 64, sdt, rng);
  auto dm = cuda::upload_matrix(m.m, 1);
  const auto x = random_vec(H, rng), nw = random_vec(H, rng, 0.5f, 1.5f);
  auto dx = to_device(x), dnw = to_device(nw);
  std::vector<float> xin = x;
  if (norm) cpu::rms_norm(x.data(), nw.data(), H, 1e-6f, xin.data());
  auto out = poisoned(V);
  cuda::DecodeCtrl h = {41, 0, 0, 0, 0};
  DeviceBuffer ctrl(sizeof h), counter(4);
  LILY_CUDA(cudaMemcpy(ctrl.get(), &h, sizeof h, cudaMemcpyHostToDevice));
  LILY_CUDA(cudaMemset(counter.get(), 0, 4));
  cuda::MatvecParams p = one_job(dm.v, out.as<float>(), dx.as<float>());
  if (norm) {
    p.pro = cuda::Prologue::Norm;
    p.norm_w = dnw.as<float>();
    p.seg = H;
  }
  p.argmax = 1;
  p.fin = cuda::Finish::LmHead;
  p.counter = counter.as<unsigned>();
  p.ctrl = ctrl.as<cuda::DecodeCtrl>();
  p.act_bits = bits;
  cuda::launch_matvec(p, nullptr, false);
  auto y = to_host<float>(out, V);
  if (bits) EXPECT_LT(rel_err(y, int_matvec(m, int_input(xin, bits))), emu_tol(bits, norm));
  else EXPECT_LT(rel_err(y, cpu_matvec(m.m, xin)), 2e-5);
  LILY_CUDA(cudaMemcpy(&h, ctrl.get(), sizeof h, cudaMemcpyDeviceToHost));
  const int want = static_cast<int>(std::max_element(y.begin(), y.end()) - y.begin());
  EXPECT_EQ(static_cast<int>(0xFFFFFFFFu - uint32_t(h.argmax_key & 0xFFFFFFFFu)), want);
  EXPECT_EQ(h.pos, 42);
}

TEST(CudaMatvec, ArgmaxAndPositionAdvance) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  check_lm_head_launch(5003, 192, DType::BF16, false, rng);
}

// The lm_head's shape class: so many tiles that every block runs more than
// 16 of them; rows not a multiple of the tile, one and two steps per tile,
// bf16 and f16 scales, the input RMSNorm, the argmax and the position step;
// also with integer inputs.
TEST(CudaMatvec, LmHeadShapeManyTilesPerBlock) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  int dev = 0, sms = 0;
  LILY_CUDA(cudaGetDevice(&dev));
  LILY_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  for (auto [H, sdt] : {std::pair{192, DType::BF16}, std::pair{2112, DType::F16}}) {
    SCOPED_TRACE("H " + std::to_string(H));
    check_lm_head_launch(17 * 16 * sms + 37, H, sdt, true, rng);
  }
  // With integer inputs (the model's hidden size).
  for (int bits : {16, 8}) {
    SCOPED_TRACE("bits " + std::to_string(bits));
    check_lm_head_launch(17 * 16 * sms + 37, 2048, DType::BF16, bits == 16, rng, bits);
  }
}

// Blocks with several tiles each, across a job boundary (the loop steps to
// the next tile of a job without the job search): 4,500 + 4,501 rows, three
// formats, the input RMSNorm.
TEST(CudaMatvec, ManyTilesPerBlockAcrossJobs) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  const int R0 = 4500, R1 = 4501, H = 512;
  for (WeightFormat f : {WeightFormat::Affine4, WeightFormat::Affine8, WeightFormat::BF16}) {
    SCOPED_TRACE(weight_format_name(f));
    auto a = random_matrix(f, R0, H, 64, DType::BF16, rng), b = random_matrix(f, R1, H, 64, DType::BF16, rng);
    auto da = cuda::upload_matrix(a.m, 1), db = cuda::upload_matrix(b.m, 2);
    const auto x = random_vec(H, rng), nw = random_vec(H, rng, 0.5f, 1.5f);
    auto dx = to_device(x), dnw = to_device(nw);
    std::vector<float> xn(H);
    cpu::rms_norm(x.data(), nw.data(), H, 1e-6f, xn.data());
    auto oa = poisoned(R0), ob = poisoned(R1);
    cuda::MatvecParams p;
    cuda::set_layout(p, da.v);
    p.njobs = 2;
    p.jobs[0] = {da.v.w, da.v.sb, R0, -1, 0, 0, oa.as<float>()};
    p.jobs[1] = {db.v.w, db.v.sb, R1, -1, 0, 0, ob.as<float>()};
    p.x = dx.as<float>();
    p.pro = cuda::Prologue::Norm;
    p.norm_w = dnw.as<float>();
    p.seg = H;
    cuda::launch_matvec(p, nullptr, false);
    EXPECT_LT(rel_err(to_host<float>(oa, R0), cpu_matvec(a.m, xn)), 2e-5);
    EXPECT_LT(rel_err(to_host<float>(ob, R1), cpu_matvec(b.m, xn)), 2e-5);
  }
}

int g_down_bits = 0;  // moe_down_weighted_sum with integer inputs (q4 only, against the emulation)
void moe_down_weighted_sum() {
  std::mt19937 rng(3);
  struct Shape {
    int E, H, I, J;
  };
  // Few items per row (one warp per row pair), and the model's 9 x 512
  // (two or four warps per row pair: q4 144 items, bf16 576), each also
  // with LILY_CUDA_DOWN_SPLIT=0 (one warp per row pair throughout).
  const Shape shapes[] = {{6, 77, 192, 4}, {12, 77, 512, 9}};
  for (const Shape& sh_ : shapes)
  for (const char* split : {"1", "0"})
  for (auto [f, sdt] : {std::pair{WeightFormat::Affine4, DType::BF16}, std::pair{WeightFormat::Affine4, DType::F16},
                        std::pair{WeightFormat::BF16, DType::BF16}}) {
    if (g_down_bits && f != WeightFormat::Affine4) continue;
    setenv("LILY_CUDA_DOWN_SPLIT", split, 1);
    SCOPED_TRACE(std::string("I ") + std::to_string(sh_.I) + " J " + std::to_string(sh_.J) +
                 " LILY_CUDA_DOWN_SPLIT=" + split + (sdt == DType::F16 ? " f16 scales" : ""));
    const int E = sh_.E, H = sh_.H, I = sh_.I, J = sh_.J;
    std::vector<test::HostMatrix> downs;
    for (int e = 0; e < E; ++e) downs.push_back(random_matrix(f, H, I, 64, sdt, rng));
    cuda::MatPacker pk(downs[0].m, H * E);
    for (auto& d : downs) pk.add_all(d.m);
    auto stack = pk.finish(1);
    auto shared = random_matrix(f, H, I, 64, sdt, rng);
    auto dshared = cuda::upload_matrix(shared.m, 2);
    std::vector<int> sel;  // J - 1 distinct routed experts (the last job is the shared one)
    for (int j = 0; j < J - 1; ++j) sel.push_back((4 + 7 * j) % E);
    const auto coef = random_vec(J, rng, 0.1f, 1.f);
    const auto xs = random_vec(size_t(J) * I, rng);
    const auto base = random_vec(H, rng);
    auto dsel = to_device(sel), dcoef = to_device(coef), dxs = to_device(xs), dout = to_device(base);
    cuda::MoeDownParams p;
    cuda::set_layout(p, stack.v);
    p.rows = H;
    p.njobs = J;
    for (int j = 0; j < J; ++j) {
      cuda::MoeDownJob& q = p.jobs[j];
      const bool sh = j == J - 1;
      q.w = sh ? dshared.v.w : stack.v.w;
      q.sb = sh ? dshared.v.sb : stack.v.sb;
      q.expert = sh ? nullptr : dsel.as<int>() + j;
      q.experts = E;
      q.w_expert_stride = 1LL * H * stack.v.chunks;
      q.sb_expert_stride = 1LL * H * stack.v.groups;
      q.x = dxs.as<float>() + j * I;
      q.coef = dcoef.as<float>() + j;
    }
    p.out = dout.as<float>();
    p.act_bits = g_down_bits;
    cuda::launch_moe_down(p, nullptr, false);
    std::vector<float> want = base;
    for (int j = 0; j < J; ++j) {
      const test::HostMatrix& hm = j == J - 1 ? shared : downs[sel[j]];
      const std::vector<float> xj(xs.begin() + j * I, xs.begin() + (j + 1) * I);
      auto y = g_down_bits ? int_matvec(hm, int_input(xj, g_down_bits)) : cpu_matvec(hm.m, xj);
      for (int r = 0; r < H; ++r) want[r] += coef[j] * y[r];
    }
    EXPECT_LT(rel_err(to_host<float>(dout, H), want), 2e-5) << weight_format_name(f);
    unsetenv("LILY_CUDA_DOWN_SPLIT");
  }
}

// Also with the expert ids read after the wait only, and with the read
// before it made wrong on purpose (the loads must be issued again).
TEST(CudaMoeDown, WeightedSumOverExpertsMatchesCpu) {
  LILY_SKIP_WITHOUT_GPU();
  for (const char* spec : {"1", "0", "2"}) {
    ScopedEnv env("LILY_CUDA_SPEC_IDS", spec);
    SCOPED_TRACE(std::string("LILY_CUDA_SPEC_IDS=") + spec);
    with_both_stagings(moe_down_weighted_sum);
  }
}

// With integer inputs (q4, the one-pass staging), against the emulation.
TEST(CudaMoeDown, IntInputsMatchEmulation) {
  LILY_SKIP_WITHOUT_GPU();
  for (int bits : {16, 8})
    for (const char* spec : {"1", "2"}) {
      ScopedEnv env("LILY_CUDA_SPEC_IDS", spec);
      SCOPED_TRACE(std::string("LILY_CUDA_SPEC_IDS=") + spec + " bits " + std::to_string(bits));
      g_down_bits = bits;
      moe_down_weighted_sum();
    }
  g_down_bits = 0;
}

// A short run's MoE rows as one launch per kernel (launch_matvec_grid,
// launch_moe_down_grid): T residual rows each through the decode MoE (q8
// router + shared gate with the input RMSNorm, routed q4 gate_up, weighted
// down added to the row), once as three launches per row and once as three
// launches over all rows; every output of every row bit for bit equal.
// fold: the router folded into a preceding residual-add launch of each row
// (an out_proj: RouterFold, its sums zeroed for all rows by one several-row
// launch where T allows, MatvecParams::zero_acc) and gate_up routing from
// the sums, as a decode step's DeltaNet layer.
// 45 experts (router rows off the tiles), top 5, 320 inputs, 128-wide
// experts (the shared one too: one down launch takes one layout; every
// matrix's inputs a whole number of 64-wide groups).
void moe_grid_rows_match_row_launches(int T, int bits, bool fold) {
  std::mt19937 rng(11 + T);
  const int E = 45, k = 5, H = 320, I = 128, Is = I, A = 192;
  auto r = random_matrix(WeightFormat::Affine8, E, H, 64, DType::BF16, rng);
  auto sg = random_matrix(WeightFormat::Affine8, 1, H, 64, DType::BF16, rng);
  auto dr = cuda::upload_matrix(r.m, 1), dsg = cuda::upload_matrix(sg.m, 2);
  ExpertStack es = random_expert_stack(E, I, H, rng, 3);
  auto shg = random_matrix(WeightFormat::Affine4, Is, H, 64, DType::BF16, rng);
  auto shu = random_matrix(WeightFormat::Affine4, Is, H, 64, DType::BF16, rng);
  auto dsh = cuda::upload_interleaved(shg.m, shu.m, 4);
  std::vector<test::HostMatrix> downs;
  for (int e = 0; e < E; ++e) downs.push_back(random_matrix(WeightFormat::Affine4, H, I, 64, DType::BF16, rng));
  cuda::MatPacker pk(downs[0].m, H * E);
  for (auto& d : downs) pk.add_all(d.m);
  auto dstack = pk.finish(5);
  auto shd = random_matrix(WeightFormat::Affine4, H, Is, 64, DType::BF16, rng);
  auto dshd = cuda::upload_matrix(shd.m, 6);
  const auto nw = random_vec(H, rng, 0.5f, 1.5f);
  auto dnw = to_device(nw);
  const auto x0 = random_vec(size_t(T) * H, rng, -3, 3);
  // The fold: the router transposed, the residual-add launch's weights
  // (H x A) and inputs (T rows of A).
  ASSERT_TRUE(cuda::router_fold_ok(dr.v, &dsg.v, H));
  const cuda::RouterFold shape = cuda::router_fold_shape(dr.v, &dsg.v);
  const int ld = shape.ld;
  DeviceBuffer fold_q(size_t(H) * ld), fold_sb(size_t(dr.v.groups) * ld * 4);
  cuda::build_router_fold(dr.v, &dsg.v, fold_q.as<uint32_t>(), fold_sb.as<uint32_t>(), nullptr);
  auto wo = random_matrix(WeightFormat::Affine4, H, A, 64, DType::BF16, rng);
  auto dwo = cuda::upload_matrix(wo.m, 7);
  auto da = to_device(random_vec(size_t(T) * A, rng));
  // Per row: logits [E + 1], selection ids [k], weights [k + 1], the
  // experts' activations [k * I + Is], the fold's sums [ld]; two sets (row
  // launches, grid).
  const int hb = k * I + Is;
  struct Set {
    DeviceBuffer x, logits, sel_idx, sel_w, act, acc, scratch;
  };
  auto make_set = [&] {
    Set z{to_device(x0), poisoned(size_t(T) * (E + 1)), DeviceBuffer(size_t(T) * k * 4),
          poisoned(size_t(T) * (k + 1)), poisoned(size_t(T) * hb), DeviceBuffer(size_t(T) * ld * 8),
          poisoned(size_t(T) * H)};
    LILY_CUDA(cudaMemset(z.sel_idx.get(), 0xff, z.sel_idx.bytes()));
    LILY_CUDA(cudaMemset(z.acc.get(), 0x5a, z.acc.bytes()));  // garbage the zeroing must clear
    return z;
  };
  Set a = make_set(), g = make_set();
  // The first launch of a row: the router (logits), or the residual add
  // with the fold (sums).
  auto row_params = [&](Set& z, int i, cuda::MatvecParams& rp, cuda::MatvecParams& gp, cuda::MoeDownParams& dp) {
    float* x = z.x.as<float>() + size_t(i) * H;
    float* lg = z.logits.as<float>() + size_t(i) * (E + 1);
    int* sidx = z.sel_idx.as<int>() + size_t(i) * k;
    float* sw = z.sel_w.as<float>() + size_t(i) * (k + 1);
    float* act = z.act.as<float>() + size_t(i) * hb;
    unsigned long long* acc = z.acc.as<unsigned long long>() + size_t(i) * ld;
    // The row's input RMSNorm in the prologue (router, gate_up).
    auto normed = [&](cuda::MatvecParams& p) {
      p.x = x;
      p.pro = cuda::Prologue::Norm;
      p.norm_w = dnw.as<float>();
      p.seg = H;
    };
    rp = cuda::MatvecParams{};
    if (fold) {
      rp = one_job(dwo.v, x, da.as<float>() + size_t(i) * A);
      rp.epi = cuda::Epilogue::Add;
      rp.fold = shape;
      rp.fold.q = fold_q.as<uint32_t>();
      rp.fold.sb = fold_sb.as<uint32_t>();
      rp.fold.g = dnw.as<float>();
      rp.fold.acc = acc;
    } else {
      cuda::set_layout(rp, dr.v);
      rp.njobs = 2;
      rp.jobs[0] = {dr.v.w, dr.v.sb, E, -1, 0, 0, lg};
      rp.jobs[1] = {dsg.v.w, dsg.v.sb, 1, -1, 0, 0, lg + E};
      normed(rp);
    }
    rp.act_bits = bits;
    rp.grid_div = T;
    gp = cuda::MatvecParams{};
    cuda::set_layout(gp, es.stack.v);
    normed(gp);
    gp.act_bits = bits;
    gp.grid_div = T;
    gp.route = {lg, E, k, 1, lg + E, sidx, sw};
    if (fold) {
      gp.route.logits = nullptr;
      gp.route.shared_gate_logit = nullptr;
      gp.route.acc = acc;
      gp.route.acc_shared = 1;
    }
    gp.njobs = k + 1;
    for (int j = 0; j < k; ++j)
      gp.jobs[j] = {es.stack.v.w, es.stack.v.sb, 2 * I, j, 2LL * I * es.stack.v.chunks,
                    2LL * I * es.stack.v.groups, act + j * I};
    gp.jobs[k] = {dsh.v.w, dsh.v.sb, 2 * Is, -1, 0, 0, act + k * I};
    gp.epi = cuda::Epilogue::SwiGLU;
    dp = cuda::MoeDownParams{};
    cuda::set_layout(dp, dstack.v);
    dp.rows = H;
    dp.njobs = k + 1;
    for (int j = 0; j <= k; ++j) {
      cuda::MoeDownJob& q = dp.jobs[j];
      const bool sh = j == k;
      q.w = sh ? dshd.v.w : dstack.v.w;
      q.sb = sh ? dshd.v.sb : dstack.v.sb;
      q.expert = sh ? nullptr : sidx + j;
      q.experts = E;
      q.w_expert_stride = 1LL * H * dstack.v.chunks;
      q.sb_expert_stride = 1LL * H * dstack.v.groups;
      q.x = act + j * I;
      q.coef = sw + j;
    }
    dp.out = x;
    dp.act_bits = bits;
    dp.grid_div = T;
  };
  // The fold's sums zeroed for all rows by one launch before the rows: a
  // several-row launch (the run's in_proj) where T allows, else one row's.
  auto zero_sums = [&](Set& z) {
    if (!fold) return;
    cuda::MatvecParams p = one_job(dwo.v, z.scratch.as<float>(), da.as<float>());
    p.act_bits = 16;
    if (T <= cuda::kMaxMatvecRows) {
      p.nrows = T;
      p.ldx = A;
      p.ldo = H;
    }
    p.zero_acc = z.acc.as<unsigned long long>();
    p.zero_n = T * ld;
    ASSERT_TRUE(cuda::matvec_rows_ok(p));
    cuda::launch_matvec(p, nullptr, false);
  };
  std::vector<cuda::MatvecParams> rps(T), gps(T);
  std::vector<cuda::MoeDownParams> dps(T);
  zero_sums(a);
  for (int i = 0; i < T; ++i) {
    row_params(a, i, rps[i], gps[i], dps[i]);
    cuda::launch_matvec(rps[i], nullptr, false);
    cuda::launch_matvec(gps[i], nullptr, false);
    cuda::launch_moe_down(dps[i], nullptr, false);
  }
  for (int i = 0; i < T; ++i) row_params(g, i, rps[i], gps[i], dps[i]);
  ASSERT_TRUE(cuda::matvec_grid_ok(rps.data(), T));
  ASSERT_TRUE(cuda::matvec_grid_ok(gps.data(), T));
  ASSERT_TRUE(cuda::moe_down_grid_ok(dps.data(), T));
  zero_sums(g);
  cuda::launch_matvec_grid(rps.data(), T, nullptr, fold);
  cuda::launch_matvec_grid(gps.data(), T, nullptr, true);
  cuda::launch_moe_down_grid(dps.data(), T, nullptr, true);
  auto same = [&](const DeviceBuffer& p, const DeviceBuffer& q, size_t n, const char* what) {
    const auto u = to_host<uint32_t>(p, n), v = to_host<uint32_t>(q, n);
    size_t diff = 0;
    for (size_t i = 0; i < n; ++i) diff += u[i] != v[i];
    EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << n << " words differ";
  };
  if (fold) {
    same(a.acc, g.acc, size_t(T) * ld * 2, "folded router sums");
  } else {
    same(a.logits, g.logits, size_t(T) * (E + 1), "router logits");
  }
  same(a.sel_idx, g.sel_idx, size_t(T) * k, "selection");
  same(a.sel_w, g.sel_w, size_t(T) * (k + 1), "selection weights");
  same(a.act, g.act, size_t(T) * hb, "expert activations");
  same(a.x, g.x, size_t(T) * H, "residual rows");
  // Every output written and finite (poisoned buffers compare equal too);
  // the fold's sums zeroed first (0x5a garbage would show as huge logits:
  // the padding words past E + 1 stay zero).
  auto finite = [&](const DeviceBuffer& b, size_t n, const char* what) {
    const auto v = to_host<float>(b, n);
    EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); })) << what;
  };
  if (!fold) finite(g.logits, size_t(T) * (E + 1), "router logits");
  finite(g.sel_w, size_t(T) * (k + 1), "selection weights");
  finite(g.act, size_t(T) * hb, "expert activations");
  finite(g.x, size_t(T) * H, "residual rows");
  for (int e : to_host<int>(g.sel_idx, size_t(T) * k)) EXPECT_TRUE(e >= 0 && e < E) << e;
  if (fold) {
    const auto sums = to_host<unsigned long long>(g.acc, size_t(T) * ld);
    for (int i = 0; i < T; ++i)
      for (int e = E + 1; e < ld; ++e) EXPECT_EQ(sums[size_t(i) * ld + e], 0ull) << "row " << i << " word " << e;
  }
  // The rows differ from each other (a grid that ran row 0 T times fails).
  const auto xs = to_host<float>(g.x, size_t(T) * H);
  EXPECT_NE(std::memcmp(xs.data(), xs.data() + H, H * 4), 0);
  if (fold) {
    // A fold together with routing: the fold's kernel has no route path.
    auto both = rps;
    for (auto& p : both) p.route = gps[0].route;
    EXPECT_FALSE(cuda::matvec_grid_ok(both.data(), T));
    return;
  }

  // What the grid refuses: too many or no rows, a row of another shape, a
  // row not aligned for the one-pass staging, f32 inputs.
  EXPECT_FALSE(cuda::matvec_grid_ok(gps.data(), 0));
  std::vector<cuda::MatvecParams> many(cuda::kMaxGridRows + 1, rps[0]);
  EXPECT_FALSE(cuda::matvec_grid_ok(many.data(), int(many.size())));
  EXPECT_THROW(cuda::launch_matvec_grid(many.data(), int(many.size()), nullptr, false), std::exception);
  auto other = gps;
  other[T - 1].jobs[k].rows -= 2;
  EXPECT_FALSE(cuda::matvec_grid_ok(other.data(), T));
  other = gps;
  other[T - 1].x += 1;
  EXPECT_FALSE(cuda::matvec_grid_ok(other.data(), T));
  other = gps;
  for (auto& p : other) p.act_bits = 0;
  EXPECT_FALSE(cuda::matvec_grid_ok(other.data(), T));
  auto dother = dps;
  dother[T - 1].jobs[0].x += 1;
  EXPECT_FALSE(cuda::moe_down_grid_ok(dother.data(), T));
  EXPECT_THROW(cuda::launch_moe_down_grid(dother.data(), T, nullptr, false), std::exception);
  dother = dps;
  dother[0].rows -= 1;
  EXPECT_FALSE(cuda::moe_down_grid_ok(dother.data(), T));
}

TEST(CudaMoeGrid, EachRowMatchesItsOwnLaunchesBitForBit) {
  LILY_SKIP_WITHOUT_GPU();
  for (bool fold : {false, true})
    for (int T : {2, 3, cuda::kMaxGridRows})
      for (int bits : {16, 8}) {
        SCOPED_TRACE("rows " + std::to_string(T) + " bits " + std::to_string(bits) + (fold ? " fold" : ""));
        moe_grid_rows_match_row_launches(T, bits, fold);
      }
}

// Several decode steps of one DeltaNet layer against the CPU recurrence.
// A DeltaNet step's parameters over the test's buffers.
struct DnDims {
  int nk, nv, dk, dv, K;
};
cuda::DeltaNetParams dn_params(DnDims d, float* proj, DeviceBuffer& ring, DeviceBuffer& conv_w, DeviceBuffer& state,
                               DeviceBuffer& a_log, DeviceBuffer& dt_bias, DeviceBuffer& out, DeviceBuffer& ctrl) {
  cuda::DeltaNetParams p;
  p.proj = proj;
  p.conv_ring = ring.as<float>();
  p.conv_w = conv_w.as<float>();
  p.state = state.as<float>();
  p.a_log = a_log.as<float>();
  p.dt_bias = dt_bias.as<float>();
  p.out = out.as<float>();
  p.ctrl = ctrl.as<cuda::DecodeCtrl>();
  p.nk = d.nk;
  p.nv = d.nv;
  p.dk = d.dk;
  p.dv = d.dv;
  p.K = d.K;
  return p;
}

TEST(CudaDeltaNet, StepsMatchCpuRecurrence) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  struct Dims { int nk, nv, dk, dv, K; };
  for (const char* fused : {"1", "0"})
  for (Dims d : {Dims{2, 4, 32, 32, 4}, Dims{3, 6, 128, 96, 4}, Dims{1, 3, 64, 64, 3}}) {
    ScopedEnv env("LILY_CUDA_DN_FUSED", fused);
    SCOPED_TRACE(std::to_string(d.dk) + "x" + std::to_string(d.dv) + " LILY_CUDA_DN_FUSED=" + fused);
    const int C = 2 * d.nk * d.dk + d.nv * d.dv, V = d.nv * d.dv;
    const auto conv_w = random_vec(size_t(C) * d.K, rng, -0.5f, 0.5f);
    const auto a_log = random_vec(d.nv, rng, 0.f, 1.f), dt_bias = random_vec(d.nv, rng, -1, 1);
    auto dconv_w = to_device(conv_w), dalog = to_device(a_log), ddt = to_device(dt_bias);
    DeviceBuffer ring(size_t(C) * d.K * 4), state(size_t(V) * d.dk * 4), ctrl(sizeof(cuda::DecodeCtrl));
    LILY_CUDA(cudaMemset(ring.get(), 0, ring.bytes()));
    auto init_state = random_vec(size_t(V) * d.dk, rng, -0.1f, 0.1f);
    LILY_CUDA(cudaMemcpy(state.get(), init_state.data(), init_state.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float> S = init_state, conv_state(size_t(C) * (d.K - 1), 0.f);
    for (int step = 0; step < 6; ++step) {
      const auto proj = random_vec(size_t(C) + V + 2 * d.nv, rng, -2, 2);
      auto dproj = to_device(proj);
      auto out = poisoned(V);
      cuda::DecodeCtrl h = {step, 0, 0, 0, 0};
      LILY_CUDA(cudaMemcpy(ctrl.get(), &h, sizeof h, cudaMemcpyHostToDevice));
      const cuda::DeltaNetParams p = dn_params({d.nk, d.nv, d.dk, d.dv, d.K}, dproj.as<float>(), ring, dconv_w, state,
                                               dalog, ddt, out, ctrl);
      cuda::launch_deltanet_step(p, nullptr, false);
      // CPU: as cpu_backend.cpp's deltanet_block for T = 1.
      std::vector<float> conv(C);
      const int keep = d.K - 1;
      for (int ch = 0; ch < C; ++ch) {
        std::vector<float> win(keep + 1);
        for (int j = 0; j < keep; ++j) win[j] = conv_state[ch * keep + j];
        win[keep] = proj[ch];
        float s = 0;
        for (int j = 0; j < d.K; ++j) s += conv_w[ch * d.K + j] * win[j];
        conv[ch] = cpu::silu(s);
        for (int j = 0; j < keep; ++j) conv_state[ch * keep + j] = win[1 + j];
      }
      for (int hh = 0; hh < 2 * d.nk; ++hh) {
        float* q = &conv[hh * d.dk];
        float ss = 0;
        for (int i = 0; i < d.dk; ++i) ss += q[i] * q[i];
        float inv = 1.f / std::sqrt(ss + 1e-6f);
        if (hh < d.nk) inv *= 1.f / std::sqrt(static_cast<float>(d.dk));
        for (int i = 0; i < d.dk; ++i) q[i] *= inv;
      }
      std::vector<float> o(V), beta(d.nv), g(d.nv);
      for (int hh = 0; hh < d.nv; ++hh) {
        beta[hh] = cpu::sigmoid(proj[C + V + hh]);
        g[hh] = -std::exp(a_log[hh]) * cpu::softplus(proj[C + V + d.nv + hh] + dt_bias[hh]);
      }
      const int ratio = d.nv / d.nk;
      for (int hh = 0; hh < d.nv; ++hh) {
        const int kh = hh / ratio;
        cpu::DeltaNetHeadIO io{&conv[kh * d.dk], 0, &conv[d.nk * d.dk + kh * d.dk], 0,
                               &conv[2 * d.nk * d.dk + hh * d.dv], 0, &g[hh], &beta[hh], 0,
                               &o[hh * d.dv], 0, 1, d.dk, d.dv};
        cpu::deltanet_recurrent(io, &S[size_t(hh) * d.dk * d.dv]);
      }
      EXPECT_LT(rel_err(to_host<float>(out, V), o), 1e-5) << "step " << step;
      EXPECT_LT(rel_err(to_host<float>(state, S.size()), S), 1e-5) << "step " << step;
    }
  }
}

// The in_proj with the DeltaNet step in its launch (launch_matvec_dn, one
// cluster per key head) against the two launches it replaces: the projected
// rows, the state, the conv ring and the outputs bit for bit over several
// steps, for the model's shape (the one-pass staging on 16- and 8-bit
// integer inputs), the fixtures' and a 3-value-heads-per-key-head one, in
// three weight formats.
void dn_in_step_matches_two_launches() {
  std::mt19937 rng(17);
  struct Dims { int nk, nv, dk, dv, K, H; };
  struct Fmt { WeightFormat f; int group; int bits; const char* name; };
  const Fmt fmts[] = {{WeightFormat::Affine4, 64, 16, "q4 q16"}, {WeightFormat::Affine4, 64, 8, "q4 q8"},
                      {WeightFormat::Affine4, 64, 0, "q4 f32"}, {WeightFormat::Affine8, 32, 0, "q8"},
                      {WeightFormat::BF16, 0, 0, "bf16"}};
  for (Dims d : {Dims{16, 32, 128, 128, 4, 2048}, Dims{2, 4, 32, 32, 4, 128}, Dims{1, 3, 64, 64, 3, 384}})
    for (const Fmt& fm : fmts) {
      SCOPED_TRACE(std::string(fm.name) + " dk " + std::to_string(d.dk) + " dv " + std::to_string(d.dv) +
                   " nv " + std::to_string(d.nv));
      const int C = 2 * d.nk * d.dk + d.nv * d.dv, V = d.nv * d.dv, NP = C + V + 2 * d.nv;
      auto wqkv = random_matrix(fm.f, C, d.H, fm.group, DType::BF16, rng);
      auto wz = random_matrix(fm.f, V, d.H, fm.group, DType::BF16, rng);
      auto wb = random_matrix(fm.f, d.nv, d.H, fm.group, DType::BF16, rng);
      auto wa = random_matrix(fm.f, d.nv, d.H, fm.group, DType::BF16, rng);
      auto dqkv = cuda::upload_matrix(wqkv.m, 1), dz = cuda::upload_matrix(wz.m, 2);
      auto db = cuda::upload_matrix(wb.m, 3), da = cuda::upload_matrix(wa.m, 4);
      const auto nw = random_vec(d.H, rng, 0.5f, 1.5f);
      const auto conv_w = random_vec(size_t(C) * d.K, rng, -0.5f, 0.5f);
      const auto a_log = random_vec(d.nv, rng, 0.f, 1.f), dt_bias = random_vec(d.nv, rng, -1, 1);
      const auto state0 = random_vec(size_t(V) * d.dk, rng, -0.1f, 0.1f);
      const auto ring0 = random_vec(size_t(C) * d.K, rng, -1, 1);
      auto dnw = to_device(nw), dconv_w = to_device(conv_w), dalog = to_device(a_log), ddt = to_device(dt_bias);
      // [0]: two launches, [1]: one.
      DeviceBuffer proj[2] = {poisoned(NP), poisoned(NP)}, out[2] = {poisoned(V), poisoned(V)};
      DeviceBuffer state[2] = {to_device(state0), to_device(state0)}, ring[2] = {to_device(ring0), to_device(ring0)};
      DeviceBuffer ctrl(sizeof(cuda::DecodeCtrl));
      for (int step = 0; step < 3; ++step) {
        const auto x = random_vec(d.H, rng, -2, 2);
        auto dx = to_device(x);
        cuda::DecodeCtrl hc = {step + 5, 0, 0, 0, 0};
        LILY_CUDA(cudaMemcpy(ctrl.get(), &hc, sizeof hc, cudaMemcpyHostToDevice));
        for (int v = 0; v < 2; ++v) {
          float* P = proj[v].as<float>();
          cuda::MatvecParams in;
          cuda::set_layout(in, dqkv.v);
          in.act_bits = fm.bits;
          in.njobs = 4;
          const cuda::DevMat* ms[4] = {&dqkv, &dz, &db, &da};
          float* outs[4] = {P, P + C, P + C + V, P + C + V + d.nv};
          for (int j = 0; j < 4; ++j) in.jobs[j] = {ms[j]->v.w, ms[j]->v.sb, ms[j]->v.rows, -1, 0, 0, outs[j]};
          in.x = dx.as<float>();
          in.pro = cuda::Prologue::Norm;
          in.norm_w = dnw.as<float>();
          in.seg = d.H;
          in.eps = 1e-6f;
          const cuda::DeltaNetParams p =
              dn_params({d.nk, d.nv, d.dk, d.dv, d.K}, P, ring[v], dconv_w, state[v], dalog, ddt, out[v], ctrl);
          ASSERT_TRUE(cuda::matvec_dn_ok(in, p));
          if (v == 0) {
            cuda::launch_matvec(in, nullptr, false);
            cuda::launch_deltanet_step(p, nullptr, false);
          } else {
            cuda::launch_matvec_dn(in, p, nullptr, false);
          }
        }
        auto eq = [](const DeviceBuffer& a, const DeviceBuffer& b, size_t n) {
          const auto ha = to_host<uint32_t>(a, n), hb = to_host<uint32_t>(b, n);
          size_t diff = 0;
          for (size_t i = 0; i < n; ++i) diff += ha[i] != hb[i];
          return diff;
        };
        EXPECT_EQ(eq(proj[0], proj[1], NP), 0u) << "projected rows differ, step " << step;
        EXPECT_EQ(eq(out[0], out[1], V), 0u) << "outputs differ, step " << step;
        EXPECT_EQ(eq(state[0], state[1], size_t(V) * d.dk), 0u) << "states differ, step " << step;
        EXPECT_EQ(eq(ring[0], ring[1], size_t(C) * d.K), 0u) << "conv rings differ, step " << step;
        const auto o = to_host<float>(out[1], V);
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float f) { return std::isfinite(f); }));
      }
    }
}
TEST(CudaDeltaNet, InProjWithStepMatchesTwoLaunches) {
  LILY_SKIP_WITHOUT_GPU();
  for (const char* cl : {"2", "1"}) {
    ScopedEnv env("LILY_CUDA_DN_CLUSTER", cl);
    SCOPED_TRACE(std::string("LILY_CUDA_DN_CLUSTER=") + cl);
    with_both_stagings(dn_in_step_matches_two_launches);
  }
}
// The row map (no GPU needed): the clusters' tiles cover every row of the
// four jobs exactly once, and each row in the cluster of the key head whose
// step reads it (q, k of key head g; v, z, b, a of g's value heads).
TEST(CudaDeltaNet, InProjWithStepRowMapCoversEveryRowOnce) {
  struct Dims { int nk, nv, dk, dv; };
  for (Dims dm : {Dims{16, 32, 128, 128}, Dims{2, 4, 32, 32}, Dims{1, 3, 64, 64}, Dims{4, 4, 16, 32},
                  Dims{2, 16, 48, 32}}) {
    cuda::DeltaNetParams d;
    d.nk = dm.nk;
    d.nv = dm.nv;
    d.dk = dm.dk;
    d.dv = dm.dv;
    const int ratio = d.nv / d.nk, C = 2 * d.nk * d.dk + d.nv * d.dv, V = d.nv * d.dv;
    const int rows[4] = {C, V, d.nv, d.nv};
    const int sbk = cuda::dn_step_blocks(d), ns = cuda::dn_step_tiles(d);
    ASSERT_LE(sbk, 8);
    for (int cs : {sbk, 2 * sbk}) {
      SCOPED_TRACE("dk " + std::to_string(d.dk) + " nv " + std::to_string(d.nv) + " cluster " + std::to_string(cs));
      std::vector<int> owner[4];
      for (int j = 0; j < 4; ++j) owner[j].assign(rows[j], -1);
      int covered = 0, max_tiles = 0, min_tiles = 1 << 30;
      for (int g = 0; g < d.nk; ++g)
        for (int rank = 0; rank < cs; ++rank) {
          const cuda::DnBlockTiles bt = cuda::dn_block_tiles(d, cs, rank);
          const int n_step = bt.se - bt.sb, n = n_step + bt.ze - bt.zb;
          max_tiles = std::max(max_tiles, n);
          min_tiles = std::min(min_tiles, n);
          for (int i = 0; i < n; ++i) {
            const int t = i < n_step ? bt.sb + i : bt.zb + i - n_step;  // as the kernel walks them
            for (int w = 0; w < cuda::kRowsPerTile / 2; ++w) {
              const cuda::DnRowPair rp = cuda::dn_row_pair(d, g, t * cuda::kRowsPerTile + 2 * w);
              // A step tile's rows are the step's (q, k, v, b, a), a z tile's z.
              if (rp.n > 0) {
                EXPECT_EQ(rp.job == 1, t >= ns) << "tile " << t;
              }
              for (int k = 0; k < rp.n; ++k) {
                ASSERT_GE(rp.job, 0);
                ASSERT_LT(rp.job, 4);
                ASSERT_LT(rp.row + k, rows[rp.job]) << "job " << rp.job;
                EXPECT_EQ(owner[rp.job][rp.row + k], -1) << "job " << rp.job << " row " << rp.row + k << " twice";
                owner[rp.job][rp.row + k] = g;
                ++covered;
              }
            }
          }
        }
      EXPECT_LE(max_tiles - min_tiles, 1) << "tiles per block";
      EXPECT_EQ(covered, C + V + 2 * d.nv);
      for (int r = 0; r < C; ++r) {
        const int want =
            r < 2 * d.nk * d.dk ? (r % (d.nk * d.dk)) / d.dk : (r - 2 * d.nk * d.dk) / (ratio * d.dv);
        EXPECT_EQ(owner[0][r], want) << "q|k|v row " << r;
      }
      for (int r = 0; r < V; ++r) EXPECT_EQ(owner[1][r], r / (ratio * d.dv)) << "z row " << r;
      for (int h = 0; h < d.nv; ++h) {
        EXPECT_EQ(owner[2][h], h / ratio) << "b row " << h;
        EXPECT_EQ(owner[3][h], h / ratio) << "a row " << h;
      }
    }
  }
}
// The shapes it refuses (the launches stay separate there).
TEST(CudaDeltaNet, InProjWithStepRefusesOtherShapes) {
  cuda::DeltaNetParams d;
  d.nk = 16;
  d.nv = 32;
  d.dk = 128;
  d.dv = 128;
  d.K = 4;
  float* P = reinterpret_cast<float*>(uintptr_t(1) << 20);
  const int C = 2 * 16 * 128 + 32 * 128, V = 32 * 128;
  cuda::MatvecParams in;
  in.njobs = 4;
  d.proj = P;
  float* outs[4] = {P, P + C, P + C + V, P + C + V + 32};
  const int rows[4] = {C, V, 32, 32};
  for (int j = 0; j < 4; ++j) {
    in.jobs[j].rows = rows[j];
    in.jobs[j].out = outs[j];
  }
  EXPECT_TRUE(cuda::matvec_dn_ok(in, d));
  auto refused = [&](auto change) {
    cuda::MatvecParams i2 = in;
    cuda::DeltaNetParams d2 = d;
    change(i2, d2);
    return !cuda::matvec_dn_ok(i2, d2);
  };
  EXPECT_TRUE(refused([](cuda::MatvecParams&, cuda::DeltaNetParams& e) { e.dv = 96; }));   // rows per key head
  EXPECT_TRUE(refused([](cuda::MatvecParams&, cuda::DeltaNetParams& e) { e.nv = 64; }));   // 16 blocks a cluster
  EXPECT_TRUE(refused([](cuda::MatvecParams&, cuda::DeltaNetParams& e) { e.dk = 120; }));  // dk not a tile multiple
  EXPECT_TRUE(refused([](cuda::MatvecParams& i, cuda::DeltaNetParams&) { i.njobs = 3; }));
  EXPECT_TRUE(refused([](cuda::MatvecParams& i, cuda::DeltaNetParams&) { i.jobs[1].out += 1; }));
  EXPECT_TRUE(refused([](cuda::MatvecParams& i, cuda::DeltaNetParams&) { i.argmax = 1; }));
}

// The host twin of the kernels' q8 row quantization (KvType::Q8): codes
// (offset binary) and the scale of one row of n values.
float kv_q8_quantize_ref(const float* x, int n, uint8_t* codes) {
  float m = 0.f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(bf16_to_f32(f32_to_bf16(x[i]))));
  const float inv = m > 0.f ? 127.f / m : 0.f;
  for (int i = 0; i < n; ++i) {
    const long c = std::lrint(bf16_to_f32(f32_to_bf16(x[i])) * inv);
    codes[i] = static_cast<uint8_t>(std::clamp(c, -127l, 127l) + 128);
  }
  return m / 127.f;
}

// Attention over a random cache: GQA groups of 4, 8 and 12 heads, f32, bf16
// and q8 caches (bf16 and q8 with head_dim 64 / 128 / 256 on tensor cores,
// and on the CUDA-core loop with LILY_CUDA_ATTN_TC=0), short, split and long
// contexts (n = 37 and 5000 leave partial 8-position steps, capacities leave
// the q8 scale arrays' padding); checks the written K/V row too. q8 on tensor
// cores takes the queries as 16-bit codes: the reference rounds them alike.
TEST(CudaAttention, SplitDecodeMatchesCpu) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  struct Case { int hd, nh, nkv, rot; bool gated; };
  for (Case cs : {Case{32, 4, 2, 8, true}, Case{128, 32, 4, 128, false}, Case{256, 16, 2, 64, true},
                  Case{64, 24, 2, 32, true}, Case{256, 6, 2, 64, false}}) {
    // f32 cache, bf16 cache, bf16 on the CUDA-core loop, q8, q8 on the CUDA-core loop
    for (int mode : {0, 1, 2, 3, 4}) {
      const bool bf = mode == 1 || mode == 2, q8 = mode >= 3;
      ScopedEnv env("LILY_CUDA_ATTN_TC", mode == 2 || mode == 4 ? "0" : "1");
      // 140,000: RoPE angles past cosf / sinf's fast argument reduction.
      for (int n : {1, 37, 700, 5000, 140000}) {
        if (n > 5000 && (cs.hd != 64 || (mode != 1 && mode != 3))) continue;
        SCOPED_TRACE("hd " + std::to_string(cs.hd) + " nh " + std::to_string(cs.nh) + " n " +
                     std::to_string(n) + (q8 ? " q8" : bf ? " bf16" : " f32") +
                     (mode == 2 || mode == 4 ? " cuda cores" : ""));
        const int hd = cs.hd, nh = cs.nh, nkv = cs.nkv, cap = n + 3, pos = n - 1;
        const int sst = cuda::q8_scale_stride(cap);
        const int qhs = hd * (cs.gated ? 2 : 1);
        const auto qkv = random_vec(size_t(nh) * qhs + 2 * nkv * hd, rng, -2, 2);
        const auto qn = random_vec(hd, rng, 0.5f, 1.5f), kn = random_vec(hd, rng, 0.5f, 1.5f);
        std::vector<float> kc = random_vec(size_t(nkv) * cap * hd, rng), vc = random_vec(size_t(nkv) * cap * hd, rng);
        auto round = [&](std::vector<float>& v) {
          if (bf)
            for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
        };
        round(kc);
        round(vc);
        // q8: codes and scales of every row; kc / vc then hold their values.
        std::vector<uint8_t> kq(kc.size()), vq(vc.size());
        std::vector<float> ks(size_t(nkv) * sst, 1e30f), vs(size_t(nkv) * sst, 1e30f);  // padding: huge, masked
        auto quantize_rows = [&](std::vector<float>& v, std::vector<uint8_t>& q, std::vector<float>& sc) {
          for (int kh = 0; kh < nkv; ++kh)
            for (int t = 0; t < cap; ++t) {
              const size_t r = (size_t(kh) * cap + t) * hd;
              const float st = kv_q8_quantize_ref(&v[r], hd, &q[r]);
              sc[size_t(kh) * sst + t] = st;
              for (int e = 0; e < hd; ++e) v[r + e] = (float(q[r + e]) - 128.f) * st;
            }
        };
        DeviceBuffer dk, dv, dks, dvs;
        if (q8) {
          quantize_rows(kc, kq, ks);
          quantize_rows(vc, vq, vs);
          dk = to_device(kq);
          dv = to_device(vq);
          dks = to_device(ks);
          dvs = to_device(vs);
        } else if (bf) {
          std::vector<uint16_t> a(kc.size()), b(vc.size());
          for (size_t i = 0; i < a.size(); ++i) {
            a[i] = f32_to_bf16(kc[i]);
            b[i] = f32_to_bf16(vc[i]);
          }
          dk = to_device(a);
          dv = to_device(b);
        } else {
          dk = to_device(kc);
          dv = to_device(vc);
        }
        std::vector<float> inv(cs.rot / 2);
        for (int i = 0; i < cs.rot / 2; ++i)
          inv[i] = static_cast<float>(1.0 / std::pow(1e6, (2.0 * i) / cs.rot));
        const int max_splits = 128;
        auto dqkv = to_device(qkv), dqn = to_device(qn), dkn = to_device(kn), dinv = to_device(inv);
        DeviceBuffer part_o(size_t(nh) * max_splits * hd * 4), part_ml(size_t(nh) * max_splits * 8);
        auto out = poisoned(size_t(nh) * hd);
        cuda::DecodeCtrl h = {pos, 0, 0, 0, 0};
        DeviceBuffer ctrl(sizeof h);
        LILY_CUDA(cudaMemcpy(ctrl.get(), &h, sizeof h, cudaMemcpyHostToDevice));
        cuda::AttentionParams p;
        p.qkv = dqkv.as<float>();
        p.q_norm = dqn.as<float>();
        p.k_norm = dkn.as<float>();
        p.eps = 1e-6f;
        p.inv_freq = dinv.as<float>();
        p.rotary_dim = cs.rot;
        p.k_cache = dk.get();
        p.v_cache = dv.get();
        p.kv = q8 ? cuda::KvType::Q8 : bf ? cuda::KvType::BF16 : cuda::KvType::F32;
        if (q8) {
          p.k_scale = dks.as<float>();
          p.v_scale = dvs.as<float>();
          p.scale_stride = sst;
        }
        p.capacity = cap;
        p.part_o = part_o.as<float>();
        p.part_ml = part_ml.as<float>();
        p.max_splits = max_splits;
        p.ctrl = ctrl.as<cuda::DecodeCtrl>();
        p.nh = nh;
        p.nkv = nkv;
        p.hd = hd;
        p.q_head_stride = qhs;
        p.gated = cs.gated;
        p.out = out.as<float>();
        cuda::launch_attention(p, nullptr, false);
        cuda::launch_attention_combine(p, nullptr, false);
        // CPU reference.
        std::vector<float> q(size_t(nh) * hd);
        for (int hh = 0; hh < nh; ++hh) {
          cpu::rms_norm(&qkv[size_t(hh) * qhs], qn.data(), hd, 1e-6f, &q[size_t(hh) * hd]);
          cpu::rope_neox(&q[size_t(hh) * hd], cs.rot, pos, 1e6f);
          // q8 on tensor cores: the scores take each query as a 16-bit code
          // under its head's largest value, code * max / 32512.
          if (mode == 3 && hd % 64 == 0) {
            float* qh = &q[size_t(hh) * hd];
            float m = 0.f;
            for (int e = 0; e < hd; ++e) m = std::max(m, std::fabs(qh[e]));
            const float inv = m > 0.f ? 32512.f / m : 0.f;
            for (int e = 0; e < hd; ++e)
              qh[e] = static_cast<float>(std::clamp(std::lrint(qh[e] * inv), -32512l, 32512l)) * (m / 32512.f);
          }
        }
        std::vector<float> kcpu(size_t(n) * nkv * hd), vcpu(kcpu.size());
        for (int kh = 0; kh < nkv; ++kh) {
          std::vector<float> knew(hd), vnew(hd);
          cpu::rms_norm(&qkv[size_t(nh) * qhs + kh * hd], kn.data(), hd, 1e-6f, knew.data());
          cpu::rope_neox(knew.data(), cs.rot, pos, 1e6f);
          for (int e = 0; e < hd; ++e) vnew[e] = qkv[size_t(nh) * qhs + size_t(nkv) * hd + kh * hd + e];
          round(knew);
          round(vnew);
          if (q8) {
            const size_t r = (size_t(kh) * cap + pos) * hd;
            ks[size_t(kh) * sst + pos] = kv_q8_quantize_ref(knew.data(), hd, &kq[r]);
            vs[size_t(kh) * sst + pos] = kv_q8_quantize_ref(vnew.data(), hd, &vq[r]);
            for (int e = 0; e < hd; ++e) {
              knew[e] = (float(kq[r + e]) - 128.f) * ks[size_t(kh) * sst + pos];
              vnew[e] = (float(vq[r + e]) - 128.f) * vs[size_t(kh) * sst + pos];
            }
          }
          for (int e = 0; e < hd; ++e) {
            kc[(size_t(kh) * cap + pos) * hd + e] = knew[e];
            vc[(size_t(kh) * cap + pos) * hd + e] = vnew[e];
          }
          for (int t = 0; t < n; ++t)
            for (int e = 0; e < hd; ++e) {
              kcpu[(size_t(t) * nkv + kh) * hd + e] = kc[(size_t(kh) * cap + t) * hd + e];
              vcpu[(size_t(t) * nkv + kh) * hd + e] = vc[(size_t(kh) * cap + t) * hd + e];
            }
        }
        std::vector<float> o(size_t(nh) * hd);
        cpu::AttentionIO io{q.data(), size_t(nh) * hd, size_t(hd), kcpu.data(), vcpu.data(), size_t(hd),
                            size_t(nkv) * hd, o.data(), size_t(nh) * hd, 1, pos, nh, nkv, hd};
        cpu::attention(pool(), io);
        if (cs.gated)
          for (int hh = 0; hh < nh; ++hh)
            for (int e = 0; e < hd; ++e) o[hh * hd + e] *= cpu::sigmoid(qkv[size_t(hh) * qhs + hd + e]);
        EXPECT_LT(rel_err(to_host<float>(out, o.size()), o), 2e-5);
        // The new row went into the cache.
        if (q8) {
          // Codes equal the host's (one step apart where the device's
          // normed row lands within an ulp of a rounding boundary).
          const auto gk = to_host<uint8_t>(dk, kq.size()), gv = to_host<uint8_t>(dv, vq.size());
          const auto gks = to_host<float>(dks, ks.size()), gvs = to_host<float>(dvs, vs.size());
          int off = 0;
          for (int kh = 0; kh < nkv; ++kh) {
            const size_t r = (size_t(kh) * cap + pos) * hd;
            for (int e = 0; e < hd; ++e) {
              ASSERT_LE(std::abs(int(gk[r + e]) - int(kq[r + e])), 1) << "k code " << e;
              ASSERT_EQ(gv[r + e], vq[r + e]) << "v code " << e;
              off += gk[r + e] != kq[r + e];
            }
            ASSERT_NEAR(gks[size_t(kh) * sst + pos], ks[size_t(kh) * sst + pos], 1e-5f * ks[size_t(kh) * sst + pos]);
            ASSERT_EQ(gvs[size_t(kh) * sst + pos], vs[size_t(kh) * sst + pos]);
          }
          EXPECT_LE(off, 2);
        } else if (bf) {
          auto got = to_host<uint16_t>(dk, kc.size());
          for (int kh = 0; kh < nkv; ++kh)
            for (int e = 0; e < hd; ++e)
              ASSERT_NEAR(bf16_to_f32(got[(size_t(kh) * cap + pos) * hd + e]), kc[(size_t(kh) * cap + pos) * hd + e],
                          1e-2f * std::fabs(kc[(size_t(kh) * cap + pos) * hd + e]) + 1e-6f);
        } else {
          auto got = to_host<float>(dk, kc.size());
          for (int kh = 0; kh < nkv; ++kh)
            for (int e = 0; e < hd; ++e)
              ASSERT_NEAR(got[(size_t(kh) * cap + pos) * hd + e], kc[(size_t(kh) * cap + pos) * hd + e], 1e-5f);
        }
      }
    }
  }
}

// The prefill path's q8 rows: bf16 rows quantized into a q8 cache as the
// decode step quantizes (host twin), their values written back, and rows
// expanded from the cache to bf16; odd sizes, rows not starting at 0.
TEST(CudaKvQ8, StoreAndExpandMatchHostTwin) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(29);
  for (int hd : {32, 96, 256}) {
    const int nkv = 3, cap = 45, src_cap = 41, p0 = 5, p1 = 40, sst = cuda::q8_scale_stride(cap);
    SCOPED_TRACE("hd " + std::to_string(hd));
    auto vals = random_vec(size_t(nkv) * src_cap * hd, rng, -3, 3);
    for (int e = 0; e < hd; e += 7) vals[e] *= 40.f;  // rows with outliers
    for (int e = 0; e < hd; ++e) vals[(size_t(1) * src_cap + 9) * hd + e] = 0.f;  // an all-zero row
    std::vector<uint16_t> src(vals.size());
    for (size_t i = 0; i < src.size(); ++i) src[i] = f32_to_bf16(vals[i]);
    auto dsrc = to_device(src);
    DeviceBuffer rows(size_t(nkv) * cap * hd), scales(size_t(nkv) * sst * 4);
    LILY_CUDA(cudaMemset(rows.get(), 0, rows.bytes()));
    LILY_CUDA(cudaMemset(scales.get(), 0, scales.bytes()));
    const cuda::KvQ8Rows q{rows.as<uint8_t>(), scales.as<float>(), cap, sst};
    cuda::launch_kv_q8_store(dsrc.as<uint16_t>(), src_cap, nkv, hd, p0, p1, q, nullptr);
    auto dst = poisoned(size_t(nkv) * cap * hd / 2 + 1);  // bf16 [nkv][cap][hd]
    cuda::launch_kv_q8_expand(q, nkv, hd, p0, p1, reinterpret_cast<uint16_t*>(dst.get()), cap, nullptr);
    const auto gr = to_host<uint8_t>(rows, rows.bytes());
    const auto gs = to_host<float>(scales, size_t(nkv) * sst);
    const auto back = to_host<uint16_t>(dsrc, src.size());
    const auto ex = to_host<uint16_t>(dst, size_t(nkv) * cap * hd);
    std::vector<uint8_t> codes(hd);
    for (int h = 0; h < nkv; ++h)
      for (int t = 0; t < src_cap; ++t) {
        std::vector<float> row(hd);
        for (int e = 0; e < hd; ++e) row[e] = bf16_to_f32(src[(size_t(h) * src_cap + t) * hd + e]);
        const bool in = t >= p0 && t < p1;
        const float st = kv_q8_quantize_ref(row.data(), hd, codes.data());
        ASSERT_EQ(gs[size_t(h) * sst + t], in ? st : 0.f) << "scale of head " << h << " row " << t;
        for (int e = 0; e < hd; ++e) {
          const size_t i = (size_t(h) * src_cap + t) * hd + e;
          const float v = (float(codes[e]) - 128.f) * st;
          ASSERT_EQ(gr[(size_t(h) * cap + t) * hd + e], in ? codes[e] : 0) << h << " " << t << " " << e;
          ASSERT_EQ(back[i], in ? f32_to_bf16(v) : src[i]) << "written back, " << h << " " << t << " " << e;
          if (in) {
            ASSERT_EQ(ex[(size_t(h) * cap + t) * hd + e], f32_to_bf16(v)) << "expanded";
          }
        }
      }
  }
}

// The hand-over probe (lily bench --handover): one launch of each rung from
// a random x against its host twin, y[o] = x[o] / 2 + 1e-3 v scale (v the
// sum of warp o % 8's 256 inputs, scale 1 / rms(x) from stage 2 on; zero
// weights, so stage 3's dot products add nothing), stage 0 copying x[0]
// only; a stage out of range is refused.
TEST(CudaHandoverProbe, EachRungMatchesTheHostTwin) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(41);
  const int N = 2048, blocks = 264;
  const auto x0 = random_vec(N, rng);
  DeviceBuffer w(size_t(blocks) * 1024 * 16);
  LILY_CUDA(cudaMemset(w.get(), 0, w.bytes()));  // zero weights: the dot products add nothing
  for (int stage = 0; stage <= 3; ++stage)
    for (int pre : {0, 4}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + " pre " + std::to_string(pre));
      auto a = to_device(x0), b = poisoned(N);
      cuda::launch_handover_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), stage, pre, blocks, nullptr, true);
      const auto y = to_host<float>(b, N);
      if (stage == 0) {
        EXPECT_EQ(y[0], x0[0]);
        continue;
      }
      // Host twin: per block of 8 warps, warp k's v is the sum over its 32
      // lanes' 8 inputs; the scale is 1 / rms(x) from stage 2 on.
      double ss = 0;
      for (float v : x0) ss += double(v) * v;
      const float scale = stage >= 2 ? float(1.0 / std::sqrt(ss / N + 1e-6)) : 1.f;
      double worst = 0;
      for (int o = 0; o < N; ++o) {
        double v = 0;
        for (int i = 0; i < 256; ++i) v += x0[size_t(o % 8) * 256 + i];  // warp o % 8's 32 lanes x 8 inputs
        const double want = 0.5 * x0[o] + 1e-3 * v * scale;
        worst = std::max(worst, std::fabs(y[o] - want));
      }
      EXPECT_LT(worst, 1e-5);
    }
  EXPECT_THROW(cuda::launch_handover_probe(nullptr, nullptr, nullptr, 4, 0, blocks, nullptr, false), Error);
}

// The probes' host twin for 2048 inputs x: the RMSNorm's scale, the
// xbits (8 or 16) codes per 32-input chunk and their scales, and a q4 row's
// dot product with them (byte j of piece p: input 32p + j low, 32p + 16 + j
// high), as the resident and persistent probes compute them.
struct ProbeTwin {
  double scale = 0;
  std::vector<int> c;
  std::vector<float> cs;
  ProbeTwin(const std::vector<float>& x, int xbits) : c(x.size()), cs(x.size() / 32) {
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    scale = 1.0 / std::sqrt(ss / double(x.size()) + 1e-6);
    const float kMax = xbits == 16 ? 32512.f : 127.f;
    for (size_t k = 0; k < cs.size(); ++k) {
      float m = 0.f;
      for (int i = 0; i < 32; ++i) m = std::max(m, std::fabs(x[32 * k + i]));
      const float inv = m > 0.f ? kMax / m : 0.f;
      for (int i = 0; i < 32; ++i) c[32 * k + i] = int(std::nearbyint(x[32 * k + i] * inv));
      cs[k] = m / kMax;
    }
  }
  double dot(const uint8_t* row) const {
    double v = 0;
    for (size_t p = 0; p < cs.size(); ++p) {
      long d = 0;
      for (int j = 0; j < 16; ++j)
        d += long(row[16 * p + j] & 15) * c[32 * p + j] + long(row[16 * p + j] >> 4) * c[32 * p + 16 + j];
      v += double(d) * cs[p];
    }
    return v;
  }
};

// The resident probe (lily bench --handover): every mode (trigger, copies
// before / after / without the wait, bulk copy sizes) and block shape
// against its host twin on random weights, rows per block that are not a
// multiple of the warps (31, 93), x of mixed signs and magnitudes: the
// RMSNorm, the 8-bit codes per 32-input chunk, the nibble layout (byte j of
// piece p: input 32p + j low, 32p + 16 + j high) and the per-row scale.
TEST(CudaResidentProbe, RowsMatchTheHostTwin) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(43);
  const int N = 2048;
  auto x0 = random_vec(N, rng);
  for (int i = 0; i < N; i += 97) x0[i] *= 40.f;  // outliers set their chunks' scales
  for (int xbits : {8, 16})
  for (int rows : {31, 93}) {
    const int blocks = (N + rows - 1) / rows + 1, stride = (rows + 3) & ~3;
    std::vector<uint8_t> wh(size_t(blocks) * rows * 1024);
    for (auto& b : wh) b = static_cast<uint8_t>(rng() & 0xff);
    std::vector<float> rsh(size_t(blocks) * stride);
    for (auto& v : rsh) v = 0.5f + float(rng() % 1000) / 1000.f;
    auto w = to_device(wh);
    auto rs = to_device(rsh);
    // Host twin.
    const ProbeTwin t(x0, xbits);
    std::vector<double> want(N);
    for (int o = 0; o < N; ++o)
      want[o] = 0.5 * x0[o] + 1e-3 * t.dot(wh.data() + size_t(o) * 1024) * t.scale *
                               rsh[size_t(o / rows) * stride + o % rows];
    for (int threads : {256, 512, -256})
      for (int mode : {0, 1, 2, 3, 5, 9, 17, 25, 33, 35, 65, 69, 97, 131}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " threads " + std::to_string(threads) + " mode " +
                     std::to_string(mode) + " xbits " + std::to_string(xbits));
        auto a = to_device(x0), b = poisoned(N);
        cuda::launch_resident_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), rs.as<float>(), rows, blocks,
                                    threads, xbits, mode, nullptr, nullptr, true);
        const auto y = to_host<float>(b, N);
        double worst = 0;
        for (int o = 0; o < N; ++o) worst = std::max(worst, std::fabs(y[o] - want[o]) / (1.0 + std::fabs(want[o])));
        EXPECT_LT(worst, 1e-5);
      }
  }
  EXPECT_THROW(cuda::launch_resident_probe(nullptr, nullptr, nullptr, nullptr, 200, 132, 256, 16, 0, nullptr, nullptr,
                                           false),
               Error);  // 200 KB of shared memory
}

// The persistent probe (lily bench --persistent): a chain of stages in one
// launch, the weights streamed through the ring ahead of the chain, against
// a host twin of every stage in turn (each stage's x is the previous stage's
// output: a stage that read a stale x, a slot read before its copy landed
// or after it was refilled, or a wrong slice would show). Stages of rows
// that are not a multiple of the 16-row slot or of the warps, two routed
// ones, rings of 2 (every slot refilled many times), 5 and 13 slots, and
// each routed mode.
TEST(CudaPersistentProbe, ChainMatchesTheHostTwin) {
  LILY_SKIP_WITHOUT_GPU();
  int dev = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  const int N = 2048, min_rows = (N + sms - 1) / sms;
  if (min_rows > 128) GTEST_SKIP() << "fewer than 16 SMs";
  std::mt19937 rng(47);
  std::vector<int2> st;
  for (int2 v : {int2{16, 0}, int2{31, 0}, int2{93, 0}, int2{20, 1}, int2{45, 0}, int2{128, 0}, int2{17, 1}})
    st.push_back(make_int2(std::max(v.x, min_rows), v.y));
  size_t total = 0;
  for (int2 v : st) total += size_t(v.x) * sms;
  std::vector<uint8_t> wh(total * 1024);
  for (auto& b : wh) b = static_cast<uint8_t>(rng() & 0xff);
  auto x0 = random_vec(N, rng);
  for (int i = 0; i < N; i += 89) x0[i] *= 30.f;  // outliers set their chunks' scales
  // Host twin, stage by stage.
  std::vector<float> x = x0;
  size_t off = 0;
  for (int2 v : st) {
    const ProbeTwin t(x, 16);
    std::vector<float> y(N);
    for (int o = 0; o < N; ++o) y[o] = float(0.5 * x[o] + 1e-3 * t.dot(wh.data() + off + size_t(o) * 1024) * t.scale);
    x = y;
    off += size_t(v.x) * sms * 1024;
  }
  auto w = to_device(wh);
  auto a = to_device(x0);
  DeviceBuffer stages(st.size() * sizeof(int2)), counter(16), marks(size_t(sms) * 32);
  ASSERT_EQ(cudaMemcpy(stages.get(), st.data(), stages.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  const int last = static_cast<int>(st.size()) - 1;
  for (int slots : {2, 5, 13})
    for (int mode : {0, 1, 3}) {
      SCOPED_TRACE("slots " + std::to_string(slots) + " mode " + std::to_string(mode));
      auto b = poisoned(2 * N);
      cuda::launch_persistent_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), stages.as<int2>(), st.data(),
                                    static_cast<int>(st.size()), slots, mode, counter.as<unsigned>(),
                                    mode == 3 ? marks.as<unsigned long long>() : nullptr, nullptr);
      const auto out = to_host<float>(b, 2 * N);
      double worst = 0;
      for (int o = 0; o < N; ++o)
        worst = std::max(worst, std::fabs(double(out[size_t(last & 1) * N + o]) - x[o]) / (1.0 + std::fabs(x[o])));
      EXPECT_LT(worst, 1e-4);
      EXPECT_EQ(to_host<unsigned>(counter, 1)[0], unsigned(st.size()) * unsigned(sms));
    }
  // Without the dependency (timing only) it runs to the end.
  auto b = poisoned(2 * N);
  cuda::launch_persistent_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), stages.as<int2>(), st.data(),
                                static_cast<int>(st.size()), 3, 4, counter.as<unsigned>(), nullptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int2> bad = st;
  bad[2].x = 129;
  EXPECT_THROW(cuda::launch_persistent_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), stages.as<int2>(),
                                             bad.data(), static_cast<int>(bad.size()), 5, 0, counter.as<unsigned>(),
                                             nullptr, nullptr),
               Error);
  EXPECT_THROW(cuda::launch_persistent_probe(a.as<float>(), b.as<float>(), w.as<uint4>(), stages.as<int2>(), st.data(),
                                             static_cast<int>(st.size()), 14, 0, counter.as<unsigned>(), nullptr,
                                             nullptr),
               Error);
}

TEST(CudaEmbed, LookupMatchesCpuDequantization) {
  LILY_SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  for (const FormatCase& fc : kFormats) {
    const int V = 301, H = 384;
    auto m = random_matrix(fc.f, V, H, fc.group, fc.sdt, rng);
    auto dm = cuda::upload_matrix(m.m, 1);
    for (int use_argmax : {0, 1}) {
      const int tok = use_argmax ? 123 : 250;
      cuda::DecodeCtrl h = {0, use_argmax ? 7 : tok, use_argmax, 0,
                            use_argmax ? ((0x80000000ull << 32) | (0xFFFFFFFFull - 123)) : 0ull};
      DeviceBuffer ctrl(sizeof h);
      LILY_CUDA(cudaMemcpy(ctrl.get(), &h, sizeof h, cudaMemcpyHostToDevice));
      auto x = poisoned(H);
      cuda::EmbedParams p;
      p.m = dm.v;
      p.ctrl = ctrl.as<cuda::DecodeCtrl>();
      p.x = x.as<float>();
      cuda::launch_embed(p, nullptr, false);
      std::vector<float> want(H);
      cpu::dequantize_row(m.m, tok, want.data());
      EXPECT_LT(rel_err(to_host<float>(x, H), want), 1e-6) << fc.name;
      LILY_CUDA(cudaMemcpy(&h, ctrl.get(), sizeof h, cudaMemcpyDeviceToHost));
      EXPECT_EQ(h.token, tok);
      EXPECT_EQ(h.argmax_key, 0ull);
    }
  }
}

// A group size the kernels cannot index with a shift (a power of two times
// the chunk's 32 q4 inputs) is refused at upload, naming the tensor; this
// needs no GPU (the check comes before any device memory).
TEST(CudaUpload, RefusesGroupSizesTheKernelsCannotIndex) {
  Matrix m;
  m.name = "layers.0.mlp.down_proj";
  m.format = WeightFormat::Affine4;
  m.rows = 4;
  m.cols = 192;
  m.group_size = 96;  // 3 chunks per group
  try {
    cuda::MatPacker pk(m, 4);
    ADD_FAILURE() << "group size 96 was accepted";
  } catch (const lily::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layers.0.mlp.down_proj"), std::string::npos) << what;
    EXPECT_NE(what.find("power of two"), std::string::npos) << what;
  }
  m.group_size = 64;  // 2 chunks per group: accepted
  EXPECT_NO_THROW(cuda::MatPacker(m, 4));
}

}  // namespace
}  // namespace lily

#else

TEST(CudaKernels, SkippedWithoutCuda) { GTEST_SKIP() << "lily was built without CUDA"; }

#endif  // LILY_HAVE_CUDA

// Gated DeltaNet prefill: causal conv1d + SiLU with the carried ring, L2 norm
// of q/k, gates, then the chunked (64-token) delta rule, matching the CPU
// deltanet_chunked (which equals the recurrent form).
//
// Per chunk of L tokens, cumulative log-decay c_i (see cpu/deltanet.cpp):
//   A_ij = -(beta_i k_i.k_j) e^(c_i-c_j) (j<i), T = (I - A)^-1 (forward substitution)
//   U = T (beta v), W = T (beta k e^c), P_ij = (q_i.k_j) e^(c_i-c_j) (j<=i)
//   v_new = U - W S;  o = (q e^c) S + P v_new;  S = e^(c_L) S + (k e^(c_L-c))^T v_new
// Everything except the last line's dependence on S is independent per
// chunk, so it runs in two passes:
//  1. dn_chunk_kernel, one block per (chunk, value head), all in parallel:
//     A, P, the substitution, U and W, written to the workspace.
//  2. dn_state_kernel, one block per (value head, 32-column slice of S): the
//     columns of S evolve independently (v_new, o and the update all act
//     column-wise), so D / 32 blocks per head carry the state through the
//     chunks sequentially, each with its D x 32 slice of S in registers (f32).
// The matrix products (k k^T, q k^T, T (beta v), T (beta k e^c), W S, q S,
// P v_new, k^T v_new) run on tensor cores in TF32 with f32 accumulation
// (inputs rounded to 10 mantissa bits); the substitution, the decays and the
// state itself stay f32. docs/cuda-prefill.md gives the error this costs.
//
// Head dims: dk = dv = D with D in {32, 64, 128}; every kernel that depends on
// D is a template on it (128 is the production model's, the smaller ones serve
// the test fixtures and other Qwen3-family sizes). Conv kernel 4 only.
#include <algorithm>
#include <cmath>

#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

using namespace prefill_detail;

constexpr int kChunk = 64;
constexpr int kConvK = 4;
constexpr int kPadA = 68;   // row stride (floats) of 64-wide tiles
constexpr int kSlice = 32;  // state columns per block in the sequential pass
constexpr int kSlicePad = kSlice + 8;
constexpr int kDnThreads = 256;

// Compile-time sizes of one head-dim instantiation (dk = dv = D). Row strides
// (floats) are chosen by how a tile is read with the tensor-core fragments
// (g = lane / 4, t = lane % 4): tiles read as M[g][t] (A row-major, B as
// [n][k]) through ldmatrix use a stride = 4 (mod 8) (kPad, kPadA, kPadQ: the 8
// rows of a 16-byte-wide phase hit 8 distinct bank quads), tiles read as
// M[t][g] (A transposed) a stride = 8 (mod 32) (kPadT, kSlicePad), so the 32
// lanes hit 32 banks.
template <int D>
struct DnShape {
  static_assert(D == 32 || D == 64 || D == 128, "DeltaNet head dim 32, 64 or 128");
  static_assert(kSlice <= D && D % kSlice == 0, "state slices must tile the columns");
  static constexpr int kPad = D + 4;
  static constexpr int kPadT = D + 8;
  // The chunk kernel's Q tile is reused for X and A (two 64 x 64 tiles,
  // stride kPadA).
  static constexpr int kPadQ = D + 12;
  static constexpr int kQRegion =
      kChunk * kPadQ > 2 * kChunk * kPadA ? kChunk * kPadQ : 2 * kChunk * kPadA;
  static constexpr size_t kChunkSmemFloats = kChunk * kPad + kQRegion + kChunk * kPadT + 3 * kChunk;
  static constexpr size_t kStateSmemFloats = 2 * kChunk * kPad + kChunk * kPadT + kChunk * kPadA +
                                             kChunk * kSlicePad + kSlice * kPadA + kSlice * kPad + 3 * kChunk;
};

// ---- tensor cores: TF32 mma.sync m16n8k8 (row.col, f32 accumulate) ---------------
// Fragment coordinates, g = lane / 4, t = lane % 4:
//   A (16 x 8): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
//   B (8 x 8):  b0 (k = t, n = g), b1 (k = t + 4, n = g)
//   C (16 x 8): c0, c1 (g, 2t + {0, 1}), c2, c3 (g + 8, 2t + {0, 1})
// Inputs are rounded to TF32 (10-bit mantissa, relative error <= 2^-11);
// products are accumulated in f32.
__device__ __forceinline__ uint32_t tf32(float f) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(f));
  return r;
}
// A(m, k) = M[k0 + k][m0 + m] * f[k0 + k]
__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], const float* M, int ld, const float* f, int m0,
                                         int k0, int g, int t) {
  const float* q = M + (k0 + t) * ld + m0 + g;
  const float f0 = f[k0 + t], f1 = f[k0 + t + 4];
  a[0] = tf32(q[0] * f0);
  a[1] = tf32(q[8] * f0);
  a[2] = tf32(q[4 * ld] * f1);
  a[3] = tf32(q[4 * ld + 8] * f1);
}
// f rounded to TF32, kept as a float: tiles that are only ever MMA operands
// are stored rounded, so their fragments need no conversion when loaded.
__device__ __forceinline__ float round_tf32(float f) { return __uint_as_float(tf32(f)); }
__device__ __forceinline__ void to_tf32(uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = tf32(__uint_as_float(r[i]));
}

// Fragments through ldmatrix: an 8 x 8 b16 matrix is an 8 x 4 f32 one, and
// lane (g, t) receives its row g, element t, which is the TF32 fragment
// layout. Lanes 8q .. 8q + 7 give the row addresses of matrix q; rows must be
// 16-byte aligned and, for conflict-free phases, the row stride = 4 (mod 8)
// floats (the strides above that are = 4 or 12 mod 32). The values are
// loaded as they are stored (round them first, or convert after).
// A(m, k) = M[m0 + m][k0 + k]; matrices (rows +0, +8) x (columns +0, +4).
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const float* M, int ld, int m0, int k0, int lane) {
  const int q = lane >> 3, r = lane & 7;
  ldmatrix_x4(a, M + (m0 + r + 8 * (q & 1)) * ld + k0 + 4 * (q >> 1));
}
// B(k, n) = M[n0 + n][k0 + k] for NT = 1 or 2 column tiles of 8 (n0, n0 + 8):
// b[2 j], b[2 j + 1] are tile j's b0, b1.
template <int NT>
__device__ __forceinline__ void ldsm_b(uint32_t (&b)[2 * NT], const float* M, int ld, int k0, int n0, int lane) {
  static_assert(NT == 1 || NT == 2, "one or two column tiles");
  const int q = lane >> 3, r = lane & 7;
  const float* p = M + (n0 + r + 8 * (q >> 1)) * ld + k0 + 4 * (q & 1);
  if constexpr (NT == 2) {
    ldmatrix_x4(b, p);
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0]), "=r"(b[1])
                 : "r"(smem_u32(p)));
  }
}

// ---- 1. conv + SiLU + norms + gates ----------------------------------------------
struct PrepParams {
  const float* qkv;
  size_t ld_qkv;
  const float* a;
  const float* b;
  size_t ld_ab;
  const float* conv_w;
  const float* ring;
  const float* a_log;
  const float* dt_bias;
  int T, P, nk, nv, C;
  float* act;  // [T][C]
  float* beta; // [T][nv]
  float* g;    // [T][nv]
};

// Warp per (kPrepRows consecutive tokens, head of D channels): the causal
// conv1d over this call's rows or the ring, SiLU, and for q / k heads the L2
// norm (q also / sqrt(D)); lane l takes channels l, l + 32, ... The warp loads
// each of the kPrepRows + 3 input rows it needs once (a warp per token would
// load each 4 times), all before the first use; no block waits for another.
// Threads also compute the gates, one (token, value head) each.
constexpr int kPrepRows = 4;
template <int D>
__global__ void __launch_bounds__(kDnThreads) dn_prep_kernel(const PrepParams p) {
  constexpr int kD = D, kPer = D / 32, R = kPrepRows, NX = R + kConvK - 1;
  const int H2 = 2 * p.nk + p.nv;
  const int lane = threadIdx.x & 31;
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long w = gid >> 5;
  if (w < static_cast<long long>((p.T + R - 1) / R) * H2) {
    const int t0 = static_cast<int>(w / H2) * R, hh = static_cast<int>(w % H2);
    float x[kPer][NX], cw[kPer][kConvK];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int ch = hh * kD + lane + 32 * i;
#pragma unroll
      for (int j = 0; j < kConvK; ++j) cw[i][j] = __ldg(p.conv_w + size_t(ch) * kConvK + j);
#pragma unroll
      for (int j = 0; j < NX; ++j) {
        const int idx = t0 - (kConvK - 1) + j;
        const int pos = p.P + idx;
        x[i][j] = idx >= 0 ? (idx < p.T ? p.qkv[size_t(idx) * p.ld_qkv + ch] : 0.f)
                           : (pos >= 0 ? p.ring[size_t(ch) * kConvK + pos % kConvK] : 0.f);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v[kPer], ss = 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < kConvK; ++j) s = fmaf(cw[i][j], x[i][r + j], s);
        v[i] = s / (1.f + expf(-s));
        ss = fmaf(v[i], v[i], ss);
      }
      if (hh < 2 * p.nk) {
        ss = p_warp_sum(ss);
        float inv = 1.f / sqrtf(ss + 1e-6f);
        if (hh < p.nk) inv *= 1.f / sqrtf(float(kD));
#pragma unroll
        for (int i = 0; i < kPer; ++i) v[i] *= inv;
      }
      if (t0 + r < p.T) {
        // q is only ever an MMA operand (q k^T, q S): stored rounded to TF32.
        float* out = p.act + size_t(t0 + r) * p.C + hh * kD;
#pragma unroll
        for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = hh < p.nk ? round_tf32(v[i]) : v[i];
      }
    }
  }
  if (gid < static_cast<long long>(p.T) * p.nv) {
    const int t = static_cast<int>(gid / p.nv), h = static_cast<int>(gid % p.nv);
    const float bb = p.b[size_t(t) * p.ld_ab + h];
    const float aa = p.a[size_t(t) * p.ld_ab + h] + p.dt_bias[h];
    const float sp = aa > 20.f ? aa : log1pf(expf(aa));
    p.beta[size_t(t) * p.nv + h] = 1.f / (1.f + expf(-bb));
    p.g[size_t(t) * p.nv + h] = -expf(p.a_log[h]) * sp;
  }
}

// The ring keeps the raw input of position p in slot p % K: write the last K
// (backup: the channel's slots as they were, first; src: the slots before
// the run taken from there).
__global__ void dn_ring_kernel(const float* qkv, size_t ld, int T, int P, int C, float* ring,
                               float* backup = nullptr, const float* src = nullptr) {
  pdl_wait();
  pdl_launch_dependents();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= C) return;
  if (backup)
    for (int m = 0; m < kConvK; ++m) backup[size_t(ch) * kConvK + m] = ring[size_t(ch) * kConvK + m];
  if (src)  // the slots before the run from src
    for (int m = 0; m < kConvK; ++m) ring[size_t(ch) * kConvK + m] = src[size_t(ch) * kConvK + m];
  for (int t = max(0, T - kConvK); t < T; ++t)
    ring[size_t(ch) * kConvK + (P + t) % kConvK] = qkv[size_t(t) * ld + ch];
}

// ---- 2. per (chunk, head): A, substitution, U, W, P ------------------------------
struct ChunkParams {
  const float* act;  // [T][C]
  const float* beta; // [T][nv]
  const float* g;
  int T, nk, nv, C, nchunks;
  float* U;  // [nv][T][D]
  float* W;  // [nv][T][D]
  float* Pm; // [nv][nchunks][64][64]
  float* c;  // [nv][T]
};

// Warp w works on the 16-row block mr = w % 4 and the column half nh = w / 4
// of each 64 x 64 / 64 x D product.
template <int D>
__global__ void __launch_bounds__(kDnThreads, 2) dn_chunk_kernel(const ChunkParams p) {
  using Sh = DnShape<D>;
  constexpr int kD = D, kPad = Sh::kPad, kPadT = Sh::kPadT, kPadQ = Sh::kPadQ;
  extern __shared__ __align__(16) float sm[];
  float* Ks = sm;                    // [64][kPad]
  float* Qs = Ks + kChunk * kPad;    // [64][kPadQ]; after the products: X, A
  float* X = Qs;                     // [64][kPadA]
  float* As = Qs + kChunk * kPadA;   // [64][kPadA]
  float* Vs = Qs + Sh::kQRegion;     // [64][kPadT]
  float* cs = Vs + kChunk * kPadT;
  float* bs = cs + kChunk;
  float* ec = bs + kChunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ci = blockIdx.x, h = blockIdx.y;
  const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
  const int kh = h / (p.nv / p.nk);

  // All three 64 x D tiles in flight at once (rows past the end zero-filled).
  for (int idx = tid; idx < kChunk * (kD / 4); idx += blockDim.x) {
    const int i = idx / (kD / 4), x = (idx % (kD / 4)) * 4;
    const bool ok = i < L;
    const float* row = p.act + size_t(ok ? t0 + i : 0) * p.C;
    cp_async16(Qs + i * kPadQ + x, row + kh * kD + x, ok ? 16 : 0);
    cp_async16(Ks + i * kPad + x, row + p.nk * kD + kh * kD + x, ok ? 16 : 0);
    cp_async16(Vs + i * kPadT + x, row + 2 * p.nk * kD + h * kD + x, ok ? 16 : 0);
  }
  cp_async_commit();
  if (tid < kChunk) {
    bs[tid] = tid < L ? p.beta[size_t(t0 + tid) * p.nv + h] : 0.f;
    cs[tid] = tid < L ? p.g[size_t(t0 + tid) * p.nv + h] : 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tid == 0) {  // sequential, as the CPU accumulates it
    float acc = 0.f;
    for (int i = 0; i < kChunk; ++i) {
      acc += cs[i];
      cs[i] = acc;
    }
  }
  __syncthreads();
  if (tid < kChunk) {
    ec[tid] = expf(cs[tid]);
    if (tid < L) p.c[size_t(h) * p.T + t0 + tid] = cs[tid];
  }

  // k k^T and q k^T on the 20 column tiles (8 wide) on and below the
  // diagonal, at most 3 per warp: warp w takes row block qm and tiles qn0 ..
  // qn0 + qcnt - 1. The tiles above are never read (the substitution reads A
  // below the diagonal, the state pass P up to its diagonal block), so they
  // are not written.
  {
    const int qm = (0x33322110 >> (4 * warp)) & 15, qn0 = (0x63030200 >> (4 * warp)) & 15,
              qcnt = (0x23333222 >> (4 * warp)) & 15;
    float kk[3][4], qk[3][4];
#pragma unroll
    for (int n = 0; n < 3; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) kk[n][e] = qk[n][e] = 0.f;
    for (int k0 = 0; k0 < kD; k0 += 8) {
      uint32_t ak[4], aq[4], b01[4], b2[2] = {0u, 0u};
      ldsm_a(ak, Ks, kPad, 16 * qm, k0, lane);
      to_tf32(ak);
      ldsm_a(aq, Qs, kPadQ, 16 * qm, k0, lane);  // q is stored rounded
      ldsm_b<2>(b01, Ks, kPad, k0, 8 * qn0, lane);
      if (qcnt == 3) ldsm_b<1>(b2, Ks, kPad, k0, 8 * qn0 + 16, lane);  // warp-uniform
      const uint32_t b[6] = {b01[0], b01[1], b01[2], b01[3], b2[0], b2[1]};
#pragma unroll
      for (int n = 0; n < 3; ++n) {
        if (n == 2 && qcnt < 3) continue;
        const uint32_t b0 = tf32(__uint_as_float(b[2 * n])), b1 = tf32(__uint_as_float(b[2 * n + 1]));
        mma_tf32(kk[n], ak, b0, b1);
        mma_tf32(qk[n], aq, b0, b1);
      }
    }
    __syncthreads();  // every warp has read Q: A may overwrite its storage
    float* Pout = p.Pm + (size_t(h) * p.nchunks + ci) * kChunk * kChunk;
#pragma unroll
    for (int n = 0; n < 3; ++n) {
      if (n == 2 && qcnt < 3) continue;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * qm + g + 8 * hf, j = 8 * (qn0 + n) + 2 * t;
        float av[2], pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jj = j + e;
          const float decay = jj <= i ? expf(cs[i] - cs[jj]) : 0.f;
          av[e] = jj < i ? -bs[i] * kk[n][2 * hf + e] * decay : 0.f;
          pv[e] = jj <= i ? qk[n][2 * hf + e] * decay : 0.f;
        }
        *reinterpret_cast<float2*>(As + i * kPadA + j) = make_float2(av[0], av[1]);
        *reinterpret_cast<float2*>(Pout + i * kChunk + j) = make_float2(round_tf32(pv[0]), round_tf32(pv[1]));
      }
    }
  }
  __syncthreads();

  // Forward substitution into X = (I - A)^-1 - I (strictly lower):
  //   X[i][j] = A[i][j] + sum_{j<m<i} A[i][m] X[m][j].
  // Columns are independent and each is sequential in i, so warp w owns
  // columns 8w .. 8w+7, four lanes per column splitting the sum over m; a
  // column's earlier rows were written by the same warp (__syncwarp orders them).
  {
    const int j = warp * 8 + (lane >> 2), part = lane & 3;
    for (int i = 0; i < kChunk; ++i) {
      float sum = 0.f;
      for (int m = j + 1 + part; m < i; m += 4) sum = fmaf(As[i * kPadA + m], X[m * kPadA + j], sum);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0) X[i * kPadA + j] = j < i ? As[i * kPadA + j] + sum : 0.f;
      __syncwarp();
    }
  }
  __syncthreads();

  // U = (I + X)(beta v), W = (I + X)(beta e^c k), 64 x D each, U then W. X
  // is strictly lower, so row block m (16 rows) reads only its first
  // 16 (m + 1) columns: warp w takes the row blocks rb = w % 2 and 3 - rb (the
  // same work for every warp) and the column quarter w / 2 (D / 32 tiles); the
  // B fragments of the k-steps both row blocks need are loaded once.
  {
    constexpr int NT = kD / 32;
    const int rb[2] = {warp & 1, 3 - (warp & 1)}, c0 = (warp >> 1) * (kD / 4);
#pragma unroll 1
    for (int which = 0; which < 2; ++which) {
      const float* B = which ? Ks : Vs;
      const int ldb = which ? kPad : kPadT;
      float acc[2][NT][4];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[r][n][e] = 0.f;
      for (int k0 = 0; k0 < 16 * (rb[1] + 1); k0 += 8) {
        const bool both = k0 < 16 * (rb[0] + 1);  // warp-uniform
        uint32_t a0[4], a1[4];
        ldsm_a(a1, X, kPadA, 16 * rb[1], k0, lane);
        to_tf32(a1);
        if (both) {
          ldsm_a(a0, X, kPadA, 16 * rb[0], k0, lane);
          to_tf32(a0);
        }
        const float f0 = bs[k0 + t] * (which ? ec[k0 + t] : 1.f);
        const float f1 = bs[k0 + t + 4] * (which ? ec[k0 + t + 4] : 1.f);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int col = c0 + 8 * n + g;
          const uint32_t b0 = tf32(B[(k0 + t) * ldb + col] * f0), b1 = tf32(B[(k0 + t + 4) * ldb + col] * f1);
          mma_tf32(acc[1][n], a1, b0, b1);
          if (both) mma_tf32(acc[0][n], a0, b0, b1);
        }
      }
      float* dst = which ? p.W : p.U;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = 16 * rb[r] + g + 8 * hf, y = c0 + 8 * n + 2 * t;
            if (i >= L) continue;
            const float f = bs[i] * (which ? ec[i] : 1.f);
            float2 v = make_float2(fmaf(B[i * ldb + y], f, acc[r][n][2 * hf]),
                                   fmaf(B[i * ldb + y + 1], f, acc[r][n][2 * hf + 1]));
            if (which) v = make_float2(round_tf32(v.x), round_tf32(v.y));  // W: only the state pass's MMA operand
            *reinterpret_cast<float2*>(dst + (size_t(h) * p.T + t0 + i) * kD + y) = v;
          }
    }
  }
}

// ---- 3. per (head, column slice): carry S through the chunks ---------------------
struct StateParams {
  const float* act;
  const float* U;
  const float* W;
  const float* Pm;
  const float* c;
  float* state;  // [nv][D][D]
  float* out;
  size_t ld_out;
  int T, nk, nv, C, nchunks;
};

// Chunk ci's tiles arrive by cp.async in two groups, each issued as soon as
// its buffers are free in chunk ci-1, so the loads overlap the previous
// chunk's arithmetic: group A = {W, q, U slice, c} (needed first), group
// B = {P, k} (needed after v_new). q and k are copied raw; their decay
// factors are applied to the sums instead (o: e^c_i, update: e^(c_L - c_j)).
// Warp w computes v_new and o for rows 16 (w % 4) .. and columns 16 (w / 4) ..;
// the f32 state slice [D x 32] lives in the warps' accumulator registers
// (warp w: rows 16 (w / (4 / SN)) .., SN column tiles); a transposed copy
// rounded to TF32 in shared memory is the B operand of the next chunk's W S
// and q S, and v_new is kept the same way for P v_new and k^T v_new, so that
// W, q, P (stored rounded), S and v_new all load through ldmatrix.
template <int D>
__global__ void __launch_bounds__(kDnThreads, 1) dn_state_kernel(const StateParams p) {
  using Sh = DnShape<D>;
  constexpr int kD = D, kPad = Sh::kPad, kPadT = Sh::kPadT, kSP = kSlicePad;
  constexpr int NO = 2;         // 8-column tiles of v_new and o per warp
  constexpr int SN = kD / 32;   // 8-column tiles of the state per warp: 4, 2, 1
  extern __shared__ __align__(16) float sm[];
  float* Wc = sm;                     // [64][kPad]
  float* Qc = Wc + kChunk * kPad;     // [64][kPad]
  float* Kc = Qc + kChunk * kPad;     // [64][kPadT]
  float* Pc = Kc + kChunk * kPadT;    // [64][kPadA]
  float* Uc = Pc + kChunk * kPadA;    // [64][kSP] U slice
  float* VNt = Uc + kChunk * kSP;     // [32][kPadA] v_new slice, transposed, TF32
  float* St = VNt + kSlice * kPadA;   // [32][kPad] S slice, transposed, TF32
  float* cc = St + kSlice * kPad;     // [2][64]
  float* fj = cc + 2 * kChunk;        // e^(c_L - c_j)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, mr = warp & 3, on = 16 * (warp >> 2);
  const int slices = kD / kSlice;
  const int h = blockIdx.x / slices, y0 = (blockIdx.x % slices) * kSlice;
  const int kh = h / (p.nv / p.nk);
  float* st = p.state + size_t(h) * kD * kD;

  const int s_m = 16 * (warp / (4 / SN)), s_n = 8 * SN * (warp % (4 / SN));
  float sreg[SN][4];
#pragma unroll
  for (int n = 0; n < SN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int x = s_m + g + 8 * (e >> 1), y = s_n + 8 * n + 2 * t + (e & 1);
      sreg[n][e] = st[x * kD + y0 + y];
      St[y * kPad + x] = round_tf32(sreg[n][e]);
    }

  auto issue_a = [&](int ci) {
    const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
    float* cb = cc + (ci & 1) * kChunk;
    for (int idx = tid; idx < kChunk * (kD / 4); idx += blockDim.x) {
      const int i = idx / (kD / 4), x = (idx % (kD / 4)) * 4;
      const bool ok = i < L;
      const int tt = ok ? t0 + i : 0;
      cp_async16(Wc + i * kPad + x, p.W + (size_t(h) * p.T + tt) * kD + x, ok ? 16 : 0);
      cp_async16(Qc + i * kPad + x, p.act + size_t(tt) * p.C + kh * kD + x, ok ? 16 : 0);
    }
    for (int idx = tid; idx < kChunk * (kSlice / 4); idx += blockDim.x) {
      const int i = idx / (kSlice / 4), y = (idx % (kSlice / 4)) * 4;
      const bool ok = i < L;
      const int tt = ok ? t0 + i : 0;
      cp_async16(Uc + i * kSP + y, p.U + (size_t(h) * p.T + tt) * kD + y0 + y, ok ? 16 : 0);
    }
    if (tid < kChunk) {
      const bool ok = tid < L;
      cp_async4(cb + tid, p.c + size_t(h) * p.T + (ok ? t0 + tid : 0), ok ? 4 : 0);
    }
  };
  auto issue_b = [&](int ci) {
    const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
    for (int idx = tid; idx < kChunk * (kD / 4); idx += blockDim.x) {
      const int i = idx / (kD / 4), x = (idx % (kD / 4)) * 4;
      const bool ok = i < L;
      const int tt = ok ? t0 + i : 0;
      cp_async16(Kc + i * kPadT + x, p.act + size_t(tt) * p.C + p.nk * kD + kh * kD + x, ok ? 16 : 0);
    }
    const float* Psrc = p.Pm + (size_t(h) * p.nchunks + ci) * kChunk * kChunk;
    for (int idx = tid; idx < kChunk * kChunk / 4; idx += blockDim.x) {
      const int i = idx / (kChunk / 4), j = (idx % (kChunk / 4)) * 4;
      cp_async16(Pc + i * kPadA + j, Psrc + i * kChunk + j, 16);
    }
  };

  issue_a(0);
  cp_async_commit();
  issue_b(0);
  cp_async_commit();

  for (int ci = 0; ci < p.nchunks; ++ci) {
    const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
    const float* cb = cc + (ci & 1) * kChunk;
    cp_async_wait<1>();  // group A of this chunk
    __syncthreads();
    const float cL = cb[L - 1];
    if (tid < kChunk) fj[tid] = expf(cL - cb[tid]);

    // v_new = U - W S and q S: rows 16 mr .., columns on .. (NO tiles).
    float vn[NO][4], qs[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) vn[n][e] = qs[n][e] = 0.f;
    for (int k0 = 0; k0 < kD; k0 += 8) {
      uint32_t aw[4], aq[4], b[2 * NO];
      ldsm_a(aw, Wc, kPad, 16 * mr, k0, lane);
      ldsm_a(aq, Qc, kPad, 16 * mr, k0, lane);
      ldsm_b<NO>(b, St, kPad, k0, on, lane);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        mma_tf32(vn[n], aw, b[2 * n], b[2 * n + 1]);
        mma_tf32(qs[n], aq, b[2 * n], b[2 * n + 1]);
      }
    }
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * mr + g + 8 * hf, y = on + 8 * n + 2 * t;
        const float2 u = *reinterpret_cast<const float2*>(Uc + i * kSP + y);
        VNt[y * kPadA + i] = round_tf32(u.x - vn[n][2 * hf]);
        VNt[(y + 1) * kPadA + i] = round_tf32(u.y - vn[n][2 * hf + 1]);
        const float e = expf(cb[i]);
        qs[n][2 * hf] *= e;
        qs[n][2 * hf + 1] *= e;
      }
    __syncthreads();  // W, q, U, S consumed; v_new and fj visible
    if (ci + 1 < p.nchunks) issue_a(ci + 1);
    cp_async_commit();
    cp_async_wait<1>();  // group B of this chunk
    __syncthreads();

    // o = (q e^c) S + P v_new (P is lower triangular: its first 16 (mr + 1) columns).
    for (int k0 = 0; k0 < 16 * (mr + 1); k0 += 8) {
      uint32_t a[4], b[2 * NO];
      ldsm_a(a, Pc, kPadA, 16 * mr, k0, lane);
      ldsm_b<NO>(b, VNt, kPadA, k0, on, lane);
#pragma unroll
      for (int n = 0; n < NO; ++n) mma_tf32(qs[n], a, b[2 * n], b[2 * n + 1]);
    }
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * mr + g + 8 * hf;
        if (i >= L) continue;
        float* o = p.out + size_t(t0 + i) * p.ld_out + h * kD + y0 + on + 8 * n + 2 * t;
        o[0] = qs[n][2 * hf];
        o[1] = qs[n][2 * hf + 1];
      }
    // S = e^(c_L) S + sum_j (k_j e^(c_L - c_j)) v_new_j^T
    {
      const float eL = expf(cL);
#pragma unroll
      for (int n = 0; n < SN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sreg[n][e] *= eL;
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        uint32_t a[4];
        frag_a_t(a, Kc, kPadT, fj, s_m, k0, g, t);
        if constexpr (SN == 1) {
          uint32_t b[2];
          ldsm_b<1>(b, VNt, kPadA, k0, s_n, lane);
          mma_tf32(sreg[0], a, b[0], b[1]);
        } else {
#pragma unroll
          for (int n2 = 0; n2 < SN / 2; ++n2) {
            uint32_t b[4];
            ldsm_b<2>(b, VNt, kPadA, k0, s_n + 16 * n2, lane);
            mma_tf32(sreg[2 * n2], a, b[0], b[1]);
            mma_tf32(sreg[2 * n2 + 1], a, b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int n = 0; n < SN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          St[(s_n + 8 * n + 2 * t + (e & 1)) * kPad + s_m + g + 8 * (e >> 1)] = round_tf32(sreg[n][e]);
    }
    __syncthreads();  // P, k, v_new consumed; S visible
    if (ci + 1 < p.nchunks) issue_b(ci + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int n = 0; n < SN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int x = s_m + g + 8 * (e >> 1), y = s_n + 8 * n + 2 * t + (e & 1);
      st[x * kD + y0 + y] = sreg[n][e];
    }
}

struct DnLayout {
  size_t act, beta, g, U, W, Pm, c, total;
};
DnLayout dn_layout(int T, int nk, int nv, int dk, int dv) {
  DnLayout L{};
  const size_t C = size_t(2) * nk * dk + size_t(nv) * dv;
  const size_t nch = (size_t(T) + kChunk - 1) / kChunk;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) & ~size_t(255);
    return at;
  };
  L.act = take(size_t(T) * C * 4);
  L.beta = take(size_t(T) * nv * 4);
  L.g = take(size_t(T) * nv * 4);
  L.U = take(size_t(nv) * T * dv * 4);
  L.W = take(size_t(nv) * T * dk * 4);
  L.Pm = take(size_t(nv) * nch * kChunk * kChunk * 4);
  L.c = take(size_t(nv) * T * 4);
  L.total = off;
  return L;
}

// ---- gated RMSNorm / RMSNorm to bf16 ------------------------------------------------
__global__ void gated_rmsnorm_kernel(const float* o, size_t ld_o, const float* z, size_t ld_z,
                                     const float* w, int heads, int dim, float eps, uint16_t* out,
                                     size_t ld_out) {
  pdl_wait();
  pdl_launch_dependents();
  const int t = blockIdx.x, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  for (int hh = blockIdx.y * wpb + (threadIdx.x >> 5); hh < heads; hh += gridDim.y * wpb) {
    const float* src = o + size_t(t) * ld_o + size_t(hh) * dim;
    float ss = 0.f;
    for (int i = lane; i < dim; i += 32) ss = fmaf(src[i], src[i], ss);
    ss = p_warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / float(dim) + eps);
    const float* zz = z + size_t(t) * ld_z + size_t(hh) * dim;
    uint16_t* dst = out + size_t(t) * ld_out + size_t(hh) * dim;
    for (int i = lane; i < dim; i += 32) {
      const float zv = zz[i];
      dst[i] = f32_to_bf16_bits(src[i] * inv * w[i] * (zv / (1.f + expf(-zv))));
    }
  }
}

// The first kNormCache values of each thread stay in registers between the sum
// and the output (the same sum order as reading them twice).
constexpr int kNormCache = 4;
__global__ void rmsnorm_kernel(const float* x, size_t ldx, const float* w, int n, float eps,
                               uint16_t* out, size_t ldo) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float red[32];
  const int t = blockIdx.x;
  const float* src = x + size_t(t) * ldx;
  float ss = 0.f, xv[kNormCache];
#pragma unroll
  for (int k = 0; k < kNormCache; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    xv[k] = i < n ? src[i] : 0.f;
    if (i < n) ss = fmaf(xv[k], xv[k], ss);
  }
  for (int i = threadIdx.x + kNormCache * blockDim.x; i < n; i += blockDim.x) ss = fmaf(src[i], src[i], ss);
  const float inv = 1.f / sqrtf(p_block_sum(ss, red) / float(n) + eps);
#pragma unroll
  for (int k = 0; k < kNormCache; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n) out[size_t(t) * ldo + i] = f32_to_bf16_bits(xv[k] * inv * w[i]);
  }
  for (int i = threadIdx.x + kNormCache * blockDim.x; i < n; i += blockDim.x)
    out[size_t(t) * ldo + i] = f32_to_bf16_bits(src[i] * inv * w[i]);
}

template <typename K>
void set_smem(K kernel, size_t bytes, const char* name) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), name);
}

}  // namespace

size_t prefill_deltanet_workspace_bytes(int T, int nk, int nv, int dk, int dv) {
  return dn_layout(T, nk, nv, dk, dv).total;
}

namespace {

// The launches for dk = dv = D, after run_deltanet's checks.
// ev (optional): 5 events recorded around the 4 launches.
template <int D>
void run_deltanet_d(const PrefillDeltaNetArgs& a, cudaStream_t stream, cudaEvent_t* ev) {
  using Sh = DnShape<D>;
  constexpr int kD = D;
  auto mark = [&](int i) {
    if (ev) check(cudaEventRecord(ev[i], stream), "cudaEventRecord");
  };
  const int C = 2 * a.nk * kD + a.nv * kD;
  if (a.ld_qkv < size_t(C) || a.ld_ab < size_t(a.nv) || a.ld_out < size_t(a.nv) * kD)
    fail("prefill_deltanet: a row stride is below its row length");
  const DnLayout L = dn_layout(a.T, a.nk, a.nv, kD, kD);
  if (!a.workspace || a.workspace_bytes < L.total)
    fail("prefill_deltanet: workspace of ", a.workspace_bytes, " bytes is below the ", L.total, " needed");
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  float* act = reinterpret_cast<float*>(ws + L.act);
  float* beta = reinterpret_cast<float*>(ws + L.beta);
  float* g = reinterpret_cast<float*>(ws + L.g);
  const int nchunks = (a.T + kChunk - 1) / kChunk;

  PrepParams pp{a.qkv, a.ld_qkv, a.a, a.b, a.ld_ab, a.conv_w, a.conv_ring, a.a_log, a.dt_bias,
                a.T, a.first_position, a.nk, a.nv, C, act, beta, g};
  const long long prep_threads =
      std::max<long long>(32LL * ((a.T + kPrepRows - 1) / kPrepRows) * (2 * a.nk + a.nv), 1LL * a.T * a.nv);
  mark(0);
  if (a.T <= prefill_skinny_rows()) {
    // A short run: the recurrent form (prefill_deltanet_run.cu), then the ring.
    launch_deltanet_run(a, stream);
    launch_kernel("dn_ring_kernel", dn_ring_kernel, dim3((C + 255) / 256), dim3(256), 0, stream, prefill_pdl(a.T),
                  a.qkv, a.ld_qkv, a.T, a.first_position, C, a.conv_ring, a.ring_backup, a.ring_src);
    for (int i = 1; i <= 4; ++i) mark(i);
    return;
  }
  dn_prep_kernel<D><<<static_cast<unsigned>((prep_threads + kDnThreads - 1) / kDnThreads), kDnThreads, 0, stream>>>(pp);
  check_launch("dn_prep_kernel");
  mark(1);
  dn_ring_kernel<<<(C + 255) / 256, 256, 0, stream>>>(a.qkv, a.ld_qkv, a.T, a.first_position, C, a.conv_ring);
  check_launch("dn_ring_kernel");
  mark(2);

  ChunkParams cp{act, beta, g, a.T, a.nk, a.nv, C, nchunks,
                 reinterpret_cast<float*>(ws + L.U), reinterpret_cast<float*>(ws + L.W),
                 reinterpret_cast<float*>(ws + L.Pm), reinterpret_cast<float*>(ws + L.c)};
  const size_t chunk_smem = Sh::kChunkSmemFloats * 4;
  static const bool chunk_ok = (set_smem(dn_chunk_kernel<D>, chunk_smem, "cudaFuncSetAttribute(dn_chunk_kernel)"), true);
  (void)chunk_ok;
  dn_chunk_kernel<D><<<dim3(nchunks, a.nv), kDnThreads, chunk_smem, stream>>>(cp);
  check_launch("dn_chunk_kernel");
  mark(3);

  StateParams sp{act, cp.U, cp.W, cp.Pm, cp.c, a.state, a.out, a.ld_out, a.T, a.nk, a.nv, C, nchunks};
  const size_t state_smem = Sh::kStateSmemFloats * 4;
  static const bool state_ok = (set_smem(dn_state_kernel<D>, state_smem, "cudaFuncSetAttribute(dn_state_kernel)"), true);
  (void)state_ok;
  dn_state_kernel<D><<<a.nv * (kD / kSlice), kDnThreads, state_smem, stream>>>(sp);
  check_launch("dn_state_kernel");
  mark(4);
}

void run_deltanet(const PrefillDeltaNetArgs& a, cudaStream_t stream, cudaEvent_t* ev) {
  if (a.dk != a.dv || (a.dk != 32 && a.dk != 64 && a.dk != 128))
    fail("prefill_deltanet: head dims must be equal and one of 32, 64, 128 (got dk ", a.dk, ", dv ", a.dv, ")");
  if (a.conv_kernel != kConvK) fail("prefill_deltanet: conv kernel must be 4 (got ", a.conv_kernel, ")");
  if (a.nk <= 0 || a.nv <= 0 || a.nv % a.nk != 0)
    fail("prefill_deltanet: value heads (", a.nv, ") must be a multiple of key heads (", a.nk, ")");
  if (a.T <= 0) return;
  if (a.first_position < 0) fail("prefill_deltanet: negative first position");
  if ((a.state_backup || a.ring_backup || a.state_src || a.ring_src) && a.T > prefill_skinny_rows())
    fail("prefill_deltanet: a backup or source of the state needs a run of at most ", prefill_skinny_rows(),
         " tokens (got ", a.T, ")");
  if (!a.qkv || !a.a || !a.b || !a.conv_w || !a.conv_ring || !a.a_log || !a.dt_bias || !a.state || !a.out)
    fail("prefill_deltanet: a required pointer is null");
  switch (a.dk) {
    case 32: run_deltanet_d<32>(a, stream, ev); break;
    case 64: run_deltanet_d<64>(a, stream, ev); break;
    default: run_deltanet_d<128>(a, stream, ev); break;
  }
}

}  // namespace

void prefill_deltanet(const PrefillDeltaNetArgs& a, cudaStream_t stream) { run_deltanet(a, stream, nullptr); }

void prefill_deltanet_timed(const PrefillDeltaNetArgs& a, cudaStream_t stream, float (&ms)[4]) {
  timed_stages(ms, [&](cudaEvent_t* ev) { run_deltanet(a, stream, ev); });
}

void prefill_gated_rmsnorm(const float* o, size_t ld_o, const float* z, size_t ld_z, const float* w,
                           int T, int heads, int dim, float eps, uint16_t* out, size_t ld_out,
                           cudaStream_t stream) {
  if (T <= 0) return;
  if (!o || !z || !w || !out) fail("prefill_gated_rmsnorm: a pointer is null");
  // A short run: one warp per head (more blocks, the same arithmetic per head).
  const int ys = T <= prefill_skinny_rows() ? std::max(1, std::min((heads + 7) / 8, 65535)) : 1;
  launch_kernel("gated_rmsnorm_kernel", gated_rmsnorm_kernel, dim3(T, ys), dim3(256), 0, stream, prefill_pdl(T), o,
                ld_o, z, ld_z, w, heads, dim, eps, out, ld_out);
}

void prefill_rmsnorm(const float* x, size_t ldx, const float* w, int T, int n, float eps,
                     uint16_t* out, size_t ldo, cudaStream_t stream) {
  if (T <= 0) return;
  if (!x || !w || !out) fail("prefill_rmsnorm: a pointer is null");
  // A short run: 1,024 threads a row (the loads of a row in flight at once).
  launch_kernel("rmsnorm_kernel", rmsnorm_kernel, dim3(T), dim3(T <= prefill_skinny_rows() ? 1024 : 256), 0, stream,
                prefill_pdl(T), x, ldx, w, n, eps, out, ldo);
}

}  // namespace lily::cuda

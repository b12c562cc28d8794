// Gated DeltaNet prefill: causal conv1d + SiLU with the carried ring, L2 norm
// of q/k, gates, then the chunked (64-token) delta rule in f32, matching the
// CPU deltanet_chunked (which equals the recurrent form).
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
//     chunks sequentially, each with its D x 32 slice of S in shared memory (f32).
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
constexpr int kSlice = 32;  // state columns per block in the sequential pass (one per lane)
constexpr int kDnThreads = 256;

// Compile-time sizes of one head-dim instantiation (dk = dv = D).
template <int D>
struct DnShape {
  static_assert(D == 32 || D == 64 || D == 128, "DeltaNet head dim 32, 64 or 128");
  static_assert(kSlice <= D && D % kSlice == 0, "state slices must tile the columns");
  // Row stride (floats) of D-wide tiles: D/4 + 1 16-byte units, odd, so the
  // float4s of 8 consecutive rows hit distinct bank groups.
  static constexpr int kPad = D + 4;
  // The chunk kernel's Q tile is reused for X (64 x 64, stride kPadA).
  static constexpr int kQRegion = kChunk * (kPad > kPadA ? kPad : kPadA);
  static constexpr int kLog2D = D == 128 ? 7 : D == 64 ? 6 : 5;
  static constexpr int kRowGroups = kDnThreads / D;  // U/W pass: threads per column
  static constexpr size_t kChunkSmemFloats =
      2 * kChunk * kPad + kQRegion + kChunk * kPadA + 3 * kChunk;
  static constexpr size_t kStateSmemFloats =
      3 * kChunk * kPad + kChunk * kPadA + 2 * kChunk * kSlice + D * kSlice + 3 * kChunk;
};

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

template <int D>
__global__ void __launch_bounds__(kDnThreads) dn_prep_kernel(const PrepParams p) {
  constexpr int kD = D;
  extern __shared__ float s_act[];  // C floats
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int ch = tid; ch < p.C; ch += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kConvK; ++j) {
      const int idx = t - (kConvK - 1) + j;
      float xv;
      if (idx >= 0) {
        xv = p.qkv[size_t(idx) * p.ld_qkv + ch];
      } else {
        const int pos = p.P + idx;
        xv = pos >= 0 ? p.ring[size_t(ch) * kConvK + pos % kConvK] : 0.f;
      }
      s = fmaf(p.conv_w[size_t(ch) * kConvK + j], xv, s);
    }
    s_act[ch] = s / (1.f + expf(-s));
  }
  __syncthreads();
  const float q_scale = 1.f / sqrtf(float(kD));
  float* out = p.act + size_t(t) * p.C;
  for (int hh = warp; hh < 2 * p.nk; hh += blockDim.x >> 5) {
    const float* src = s_act + hh * kD;
    float v[kD / 32], ss = 0.f;
#pragma unroll
    for (int i = 0; i < kD / 32; ++i) {
      v[i] = src[lane + 32 * i];
      ss = fmaf(v[i], v[i], ss);
    }
    ss = p_warp_sum(ss);
    float inv = 1.f / sqrtf(ss + 1e-6f);
    if (hh < p.nk) inv *= q_scale;
#pragma unroll
    for (int i = 0; i < kD / 32; ++i) out[hh * kD + lane + 32 * i] = v[i] * inv;
  }
  for (int ch = 2 * p.nk * kD + tid; ch < p.C; ch += blockDim.x) out[ch] = s_act[ch];
  for (int h = tid; h < p.nv; h += blockDim.x) {
    const float bb = p.b[size_t(t) * p.ld_ab + h];
    const float aa = p.a[size_t(t) * p.ld_ab + h] + p.dt_bias[h];
    const float sp = aa > 20.f ? aa : log1pf(expf(aa));
    p.beta[size_t(t) * p.nv + h] = 1.f / (1.f + expf(-bb));
    p.g[size_t(t) * p.nv + h] = -expf(p.a_log[h]) * sp;
  }
}

// The ring keeps the raw input of position p in slot p % K: write the last K.
__global__ void dn_ring_kernel(const float* qkv, size_t ld, int T, int P, int C, float* ring) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= C) return;
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

template <int D>
__global__ void __launch_bounds__(kDnThreads) dn_chunk_kernel(const ChunkParams p) {
  using Sh = DnShape<D>;
  constexpr int kD = D, kPad = Sh::kPad;
  extern __shared__ float sm[];
  float* Ks = sm;
  float* Qs = Ks + kChunk * kPad;  // kQRegion floats: Q, then X
  float* Vs = Qs + Sh::kQRegion;
  float* As = Vs + kChunk * kPad;
  float* cs = As + kChunk * kPadA;
  float* bs = cs + kChunk;
  float* ec = bs + kChunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ci = blockIdx.x, h = blockIdx.y;
  const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
  const int kh = h / (p.nv / p.nk);

  // All three 64 x D tiles in flight at once (rows past the end zero-filled).
  for (int idx = tid; idx < kChunk * (kD / 4); idx += blockDim.x) {
    const int i = idx / (kD / 4), x = (idx % (kD / 4)) * 4;
    const bool ok = i < L;
    const float* row = p.act + size_t(ok ? t0 + i : 0) * p.C;
    cp_async16(Qs + i * kPad + x, row + kh * kD + x, ok ? 16 : 0);
    cp_async16(Ks + i * kPad + x, row + p.nk * kD + kh * kD + x, ok ? 16 : 0);
    cp_async16(Vs + i * kPad + x, row + 2 * p.nk * kD + h * kD + x, ok ? 16 : 0);
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

  // A (strictly lower) and P (lower incl. diagonal): thread (ti, tj) owns
  // rows ti + 16 ii and columns tj + 16 jj.
  {
    const int ti = tid >> 4, tj = tid & 15;
    float dkk[4][4], dqk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) dkk[a][b] = dqk[a][b] = 0.f;
    for (int x = 0; x < kD; x += 4) {
      float4 ki[4], qi[4], kj[4];
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        ki[ii] = *reinterpret_cast<const float4*>(Ks + (ti + 16 * ii) * kPad + x);
        qi[ii] = *reinterpret_cast<const float4*>(Qs + (ti + 16 * ii) * kPad + x);
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) kj[jj] = *reinterpret_cast<const float4*>(Ks + (tj + 16 * jj) * kPad + x);
#pragma unroll
      for (int ii = 0; ii < 4; ++ii)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          dkk[ii][jj] = fmaf(ki[ii].x, kj[jj].x, dkk[ii][jj]);
          dkk[ii][jj] = fmaf(ki[ii].y, kj[jj].y, dkk[ii][jj]);
          dkk[ii][jj] = fmaf(ki[ii].z, kj[jj].z, dkk[ii][jj]);
          dkk[ii][jj] = fmaf(ki[ii].w, kj[jj].w, dkk[ii][jj]);
          dqk[ii][jj] = fmaf(qi[ii].x, kj[jj].x, dqk[ii][jj]);
          dqk[ii][jj] = fmaf(qi[ii].y, kj[jj].y, dqk[ii][jj]);
          dqk[ii][jj] = fmaf(qi[ii].z, kj[jj].z, dqk[ii][jj]);
          dqk[ii][jj] = fmaf(qi[ii].w, kj[jj].w, dqk[ii][jj]);
        }
    }
    float* Pout = p.Pm + (size_t(h) * p.nchunks + ci) * kChunk * kChunk;
#pragma unroll
    for (int ii = 0; ii < 4; ++ii)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int i = ti + 16 * ii, j = tj + 16 * jj;
        const float decay = j <= i ? expf(cs[i] - cs[j]) : 0.f;
        As[i * kPadA + j] = j < i ? -bs[i] * dkk[ii][jj] * decay : 0.f;
        Pout[i * kChunk + j] = j <= i ? dqk[ii][jj] * decay : 0.f;
      }
  }
  __syncthreads();

  // Forward substitution into X = (I - A)^-1 - I (strictly lower), in the Q
  // tile's storage (Q is no longer needed):
  //   X[i][j] = A[i][j] + sum_{j<m<i} A[i][m] X[m][j].
  // Columns are independent and each is sequential in i, so warp w owns
  // columns 8w .. 8w+7, four lanes per column splitting the sum over m; a
  // column's earlier rows were written by the same warp (__syncwarp orders them).
  float* X = Qs;
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

  // U = (I + A) (beta v), W = (I + A) (beta k e^c): thread owns column y and
  // the rows i = G r + par (G = 256 / D threads per column, par = tid / D,
  // warp-uniform).
  {
    constexpr int G = Sh::kRowGroups, R = kChunk / G;
    const int y = tid & (kD - 1), par = tid >> Sh::kLog2D;
    float au[R], aw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) au[r] = aw[r] = 0.f;
    for (int j = 0; j < kChunk; j += 4) {
      float bv[4], kb[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bv[e] = bs[j + e] * Vs[(j + e) * kPad + y];
        kb[e] = bs[j + e] * Ks[(j + e) * kPad + y] * ec[j + e];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float4 a4 = *reinterpret_cast<const float4*>(X + (G * r + par) * kPadA + j);
        au[r] = fmaf(a4.x, bv[0], au[r]);
        au[r] = fmaf(a4.y, bv[1], au[r]);
        au[r] = fmaf(a4.z, bv[2], au[r]);
        au[r] = fmaf(a4.w, bv[3], au[r]);
        aw[r] = fmaf(a4.x, kb[0], aw[r]);
        aw[r] = fmaf(a4.y, kb[1], aw[r]);
        aw[r] = fmaf(a4.z, kb[2], aw[r]);
        aw[r] = fmaf(a4.w, kb[3], aw[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = G * r + par;
      if (i < L) {
        const size_t o = (size_t(h) * p.T + t0 + i) * kD + y;
        p.U[o] = bs[i] * Vs[i * kPad + y] + au[r];
        p.W[o] = bs[i] * Ks[i * kPad + y] * ec[i] + aw[r];
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
template <int D>
__global__ void __launch_bounds__(kDnThreads, 1) dn_state_kernel(const StateParams p) {
  constexpr int kD = D, kPad = DnShape<D>::kPad;
  extern __shared__ __align__(16) float sm[];
  float* Wc = sm;
  float* Qc = Wc + kChunk * kPad;
  float* Kc = Qc + kChunk * kPad;
  float* Pc = Kc + kChunk * kPad;
  float* Uc = Pc + kChunk * kPadA;   // U slice
  float* VN = Uc + kChunk * kSlice;  // v_new slice
  float* S = VN + kChunk * kSlice;   // [D][32]
  float* cc = S + kD * kSlice;       // [2][64]
  float* fj = cc + 2 * kChunk;       // e^(c_L - c_j)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slices = kD / kSlice;
  const int h = blockIdx.x / slices, y0 = (blockIdx.x % slices) * kSlice;
  const int kh = h / (p.nv / p.nk);
  float* st = p.state + size_t(h) * kD * kD;
  for (int idx = tid; idx < kD * kSlice; idx += blockDim.x) {
    const int x = idx / kSlice, y = idx % kSlice;
    S[idx] = st[x * kD + y0 + y];
  }

  auto issue_a = [&](int ci) {
    const int t0 = ci * kChunk, L = min(kChunk, p.T - t0);
    float* cb = cc + (ci & 1) * kChunk;
    for (int idx = tid; idx < kChunk * (kD / 4); idx += blockDim.x) {
      const int i = idx / (kD / 4), x = (idx % (kD / 4)) * 4;
      const bool ok = i < L;
      const int t = ok ? t0 + i : 0;
      cp_async16(Wc + i * kPad + x, p.W + (size_t(h) * p.T + t) * kD + x, ok ? 16 : 0);
      cp_async16(Qc + i * kPad + x, p.act + size_t(t) * p.C + kh * kD + x, ok ? 16 : 0);
    }
    for (int idx = tid; idx < kChunk * (kSlice / 4); idx += blockDim.x) {
      const int i = idx / (kSlice / 4), y = (idx % (kSlice / 4)) * 4;
      const bool ok = i < L;
      const int t = ok ? t0 + i : 0;
      cp_async16(Uc + i * kSlice + y, p.U + (size_t(h) * p.T + t) * kD + y0 + y, ok ? 16 : 0);
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
      const int t = ok ? t0 + i : 0;
      cp_async16(Kc + i * kPad + x, p.act + size_t(t) * p.C + p.nk * kD + kh * kD + x, ok ? 16 : 0);
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

    // v_new = U - W S and q S for rows warp*8 .. +8, column `lane`.
    float vn[8], qs[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) vn[r] = qs[r] = 0.f;
    for (int x = 0; x < kD; x += 4) {
      const float s0 = S[(x + 0) * kSlice + lane], s1 = S[(x + 1) * kSlice + lane];
      const float s2 = S[(x + 2) * kSlice + lane], s3 = S[(x + 3) * kSlice + lane];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = warp * 8 + r;
        const float4 w4 = *reinterpret_cast<const float4*>(Wc + i * kPad + x);
        const float4 q4 = *reinterpret_cast<const float4*>(Qc + i * kPad + x);
        vn[r] = fmaf(w4.x, s0, vn[r]);
        vn[r] = fmaf(w4.y, s1, vn[r]);
        vn[r] = fmaf(w4.z, s2, vn[r]);
        vn[r] = fmaf(w4.w, s3, vn[r]);
        qs[r] = fmaf(q4.x, s0, qs[r]);
        qs[r] = fmaf(q4.y, s1, qs[r]);
        qs[r] = fmaf(q4.z, s2, qs[r]);
        qs[r] = fmaf(q4.w, s3, qs[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = warp * 8 + r;
      VN[i * kSlice + lane] = Uc[i * kSlice + lane] - vn[r];
      qs[r] *= expf(cb[i]);
    }
    __syncthreads();  // W, q, U consumed; v_new and fj visible
    if (ci + 1 < p.nchunks) issue_a(ci + 1);
    cp_async_commit();
    cp_async_wait<1>();  // group B of this chunk
    __syncthreads();

    // o = (q e^c) S + P v_new
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = warp * 8 + r;
      float o = qs[r];
      for (int j = 0; j < kChunk; j += 4) {
        const float4 p4 = *reinterpret_cast<const float4*>(Pc + i * kPadA + j);
        o = fmaf(p4.x, VN[(j + 0) * kSlice + lane], o);
        o = fmaf(p4.y, VN[(j + 1) * kSlice + lane], o);
        o = fmaf(p4.z, VN[(j + 2) * kSlice + lane], o);
        o = fmaf(p4.w, VN[(j + 3) * kSlice + lane], o);
      }
      if (i < L) p.out[size_t(t0 + i) * p.ld_out + h * kD + y0 + lane] = o;
    }
    // S = e^(c_L) S + sum_j k_j e^(c_L - c_j) v_new_j^T, rows warp*RW .. +RW
    // (RW = D / 8: the 8 warps split the D rows of the slice).
    {
      constexpr int RW = kD / 8;
      const float eL = expf(cL);
      float acc[RW];
#pragma unroll
      for (int xx = 0; xx < RW; ++xx) acc[xx] = S[(warp * RW + xx) * kSlice + lane] * eL;
      for (int j = 0; j < kChunk; ++j) {
        const float v = VN[j * kSlice + lane] * fj[j];
#pragma unroll
        for (int q = 0; q < RW / 4; ++q) {
          const float4 k4 = *reinterpret_cast<const float4*>(Kc + j * kPad + warp * RW + q * 4);
          acc[q * 4 + 0] = fmaf(k4.x, v, acc[q * 4 + 0]);
          acc[q * 4 + 1] = fmaf(k4.y, v, acc[q * 4 + 1]);
          acc[q * 4 + 2] = fmaf(k4.z, v, acc[q * 4 + 2]);
          acc[q * 4 + 3] = fmaf(k4.w, v, acc[q * 4 + 3]);
        }
      }
#pragma unroll
      for (int xx = 0; xx < RW; ++xx) S[(warp * RW + xx) * kSlice + lane] = acc[xx];
    }
    __syncthreads();  // P, k, v_new consumed
    if (ci + 1 < p.nchunks) issue_b(ci + 1);
    cp_async_commit();
  }
  cp_async_wait<0>();
  for (int idx = tid; idx < kD * kSlice; idx += blockDim.x) {
    const int x = idx / kSlice, y = idx % kSlice;
    st[x * kD + y0 + y] = S[idx];
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
  const int t = blockIdx.x, lane = threadIdx.x & 31;
  for (int hh = threadIdx.x >> 5; hh < heads; hh += blockDim.x >> 5) {
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

__global__ void rmsnorm_kernel(const float* x, size_t ldx, const float* w, int n, float eps,
                               uint16_t* out, size_t ldo) {
  __shared__ float red[32];
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* src = x + size_t(t) * ldx;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(src[i], src[i], ss);
  ss = p_warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float v = lane < int(blockDim.x >> 5) ? red[lane] : 0.f;
    v = p_warp_sum(v);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = 1.f / sqrtf(red[0] / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x)
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
  const size_t prep_smem = size_t(C) * 4;
  static const bool prep_ok = (set_smem(dn_prep_kernel<D>, 96 * 1024, "cudaFuncSetAttribute(dn_prep_kernel)"), true);
  (void)prep_ok;
  if (prep_smem > 96 * 1024) fail("prefill_deltanet: too many channels (", C, ")");
  mark(0);
  dn_prep_kernel<D><<<a.T, kDnThreads, prep_smem, stream>>>(pp);
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
  cudaEvent_t ev[5];
  for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
  run_deltanet(a, stream, ev);
  check(cudaEventSynchronize(ev[4]), "cudaEventSynchronize");
  for (int i = 0; i < 4; ++i) check(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]), "cudaEventElapsedTime");
  for (auto& e : ev) cudaEventDestroy(e);
}

void prefill_gated_rmsnorm(const float* o, size_t ld_o, const float* z, size_t ld_z, const float* w,
                           int T, int heads, int dim, float eps, uint16_t* out, size_t ld_out,
                           cudaStream_t stream) {
  if (T <= 0) return;
  if (!o || !z || !w || !out) fail("prefill_gated_rmsnorm: a pointer is null");
  gated_rmsnorm_kernel<<<T, 256, 0, stream>>>(o, ld_o, z, ld_z, w, heads, dim, eps, out, ld_out);
  check_launch("gated_rmsnorm_kernel");
}

void prefill_rmsnorm(const float* x, size_t ldx, const float* w, int T, int n, float eps,
                     uint16_t* out, size_t ldo, cudaStream_t stream) {
  if (T <= 0) return;
  if (!x || !w || !out) fail("prefill_rmsnorm: a pointer is null");
  rmsnorm_kernel<<<T, 256, 0, stream>>>(x, ldx, w, n, eps, out, ldo);
  check_launch("rmsnorm_kernel");
}

}  // namespace lily::cuda

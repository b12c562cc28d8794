// The Gated DeltaNet decode step's per-block work, shared by its own launch
// (deltanet.cu) and by the in_proj that runs it in its epilogue (matvec.cu,
// "The DeltaNet step in the in_proj").
//
// A step block is (value head h, 32-column slice cb of the value dim) with
// kDnThreads threads: thread tid owns column j = tid % 32 of the slice and
// state rows qg + 4 r (qg = tid / 32). It recomputes the conv of its key
// head's q/k channels (cheap) and owns the conv of its v channels. The conv
// state is a ring of the last K raw inputs indexed by position % K: the step
// writes slot pos % K while every reader reads the other K - 1 slots, so
// blocks never race on it.
#pragma once

#include "backend/cuda/device_common.cuh"

namespace lily::cuda {

constexpr int kDnThreads = 128;
constexpr int kDnCols = 32;
constexpr int kDnRowGroups = kDnThreads / kDnCols;  // 4
constexpr int kDnMaxRows = 32;                      // dk / 4 <= 32
constexpr int kDnMaxDk = kDnMaxRows * kDnRowGroups;
constexpr int kDnChPerThread = (2 * kDnMaxDk + kDnCols + kDnThreads - 1) / kDnThreads;  // 3

// Channel i (of 2 dk + 32) of block (h, cb): its q, k, then its v columns.
__device__ __forceinline__ int dn_channel(const DeltaNetParams& p, int h, int cb, int i) {
  const int kh = h / (p.nv / p.nk);
  if (i < p.dk) return kh * p.dk + i;
  if (i < 2 * p.dk) return p.nk * p.dk + kh * p.dk + (i - p.dk);
  return 2 * p.nk * p.dk + h * p.dv + cb * kDnCols + (i - 2 * p.dk);
}

// Thread tid's conv channels, the K - 1 previous inputs' part of their conv
// and the last tap (nothing the predecessor writes: before the wait).
// taps(i, ch) and ring(i, ch) give channel ch's K weights / ring slots
// (i: its index in the block's channel list).
struct DnConv {
  int chs[kDnChPerThread];
  float acc_prev[kDnChPerThread];
  float w_last[kDnChPerThread];
};
template <class Taps, class Ring>
__device__ __forceinline__ void dn_conv_pre(const DeltaNetParams& p, int h, int cb, int tid, int pos, Taps taps,
                                            Ring ring, DnConv& cv) {
  const int K = p.K, nch = 2 * p.dk + kDnCols;
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) {
    const int i = tid + u * kDnThreads;
    const int ch = i < nch ? dn_channel(p, h, cb, i) : 0;
    cv.chs[u] = ch;
    float s = 0.f;
    if (i < nch) {
      const float* w = taps(i, ch);
      const float* r = ring(i, ch);
      for (int t = 0; t < K - 1; ++t) s += w[t] * r[(pos + 1 + t) % K];
      cv.w_last[u] = w[K - 1];
    } else {
      cv.w_last[u] = 0.f;
    }
    cv.acc_prev[u] = s;
  }
}

// After the wait: the new inputs (Cg: read from L2, as a launch whose blocks
// wrote them reads them), the conv, SiLU, the ring slot; qs / ks / vs get the
// block's q, k and v columns. Returns b and a of head h. The caller
// synchronises the step's threads afterwards.
template <bool Cg>
__device__ __forceinline__ float2 dn_conv_finish(const DeltaNetParams& p, int h, int cb, int tid, int pos,
                                                 const DnConv& cv, float* qs, float* ks, float* vs) {
  const int dk = p.dk, nv = p.nv, K = p.K, ratio = nv / p.nk;
  const int C = 2 * p.nk * dk + nv * p.dv, nch = 2 * dk + kDnCols;
  const bool own_qk = (h % ratio) == 0 && cb == 0;
  auto ld = [](const float* q) { return Cg ? __ldcg(q) : *q; };
  float xt[kDnChPerThread];
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) xt[u] = tid + u * kDnThreads < nch ? ld(p.proj + cv.chs[u]) : 0.f;
  const float b = ld(p.proj + C + nv * p.dv + h), a = ld(p.proj + C + nv * p.dv + nv + h);
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) {
    const int i = tid + u * kDnThreads;
    if (i >= nch) continue;
    const float y = silu(cv.acc_prev[u] + cv.w_last[u] * xt[u]);
    if (i < dk) qs[i] = y;
    else if (i < 2 * dk) ks[i - dk] = y;
    else vs[i - 2 * dk] = y;
    if (i >= 2 * dk || own_qk) p.conv_ring[size_t(cv.chs[u]) * K + pos % K] = xt[u];
  }
  return make_float2(b, a);
}

// The state update with the state's two dot products taken in one pass
// before the norms are known (v12). With q and k normalised by scalars
// (qn = qinv q, kn = kinv k) and S' = decay S + kn delta^T:
//   kv_j = decay kinv sum_i S_ij k_i,
//   o_j  = sum_i S'_ij qn_i = decay qinv sum_i S_ij q_i + delta_j kinv qinv sum_i k_i q_i,
// so sum q^2, sum k^2, sum k q and both column sums of S meet at one barrier.
// sr: thread tid's state rows; sync() synchronises the step's kDnThreads
// threads (the whole block in the step's own launch). Writes the new state
// slice (Keep: into sr, for a run of several tokens) and the slice's outputs.
template <bool Keep = false, class Sync>
__device__ __forceinline__ void dn_update_fused(const DeltaNetParams& p, int h, int cb, int tid,
                                                float (&sr)[kDnMaxRows], const float* qs, const float* ks,
                                                const float* vs, float b, float a, float a_log, float dt_bias,
                                                Sync sync) {
  const int dk = p.dk, dv = p.dv, j = tid & (kDnCols - 1), qg = tid / kDnCols, nr = dk / kDnRowGroups;
  float* S = p.state + size_t(h) * dk * dv + cb * kDnCols;  // row i at S[i * dv + j]
  __shared__ float2 red2[kDnRowGroups][kDnCols];
  __shared__ float part[kDnThreads / 32][3];
  float sq = 0.f, sk = 0.f, sqk = 0.f;
  for (int i = tid; i < dk; i += kDnThreads) {
    sq = fmaf(qs[i], qs[i], sq);
    sk = fmaf(ks[i], ks[i], sk);
    sqk = fmaf(qs[i], ks[i], sqk);
  }
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  sqk = warp_sum(sqk);
  if ((tid & 31) == 0) {
    part[tid >> 5][0] = sq;
    part[tid >> 5][1] = sk;
    part[tid >> 5][2] = sqk;
  }
  float sa = 0.f, sb = 0.f;
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) {
      const int i = qg + kDnRowGroups * r;
      sa = fmaf(sr[r], ks[i], sa);
      sb = fmaf(sr[r], qs[i], sb);
    }
  red2[qg][j] = make_float2(sa, sb);
  const float beta = sigmoid(b);
  const float decay = expf(-expf(a_log) * softplus(a + dt_bias));
  sync();
  sq = sk = sqk = 0.f;
#pragma unroll
  for (int w = 0; w < kDnThreads / 32; ++w) {
    sq += part[w][0];
    sk += part[w][1];
    sqk += part[w][2];
  }
  const float qinv = (1.f / sqrtf(sq + 1e-6f)) * (1.f / sqrtf(static_cast<float>(dk)));
  const float kinv = 1.f / sqrtf(sk + 1e-6f);
  float ta = 0.f, tb = 0.f;
#pragma unroll
  for (int q = 0; q < kDnRowGroups; ++q) {
    ta += red2[q][j].x;
    tb += red2[q][j].y;
  }
  const float delta = (vs[j] - decay * kinv * ta) * beta;
  const float dk_delta = kinv * delta;
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) {
      const int i = qg + kDnRowGroups * r;
      const float v = fmaf(ks[i], dk_delta, sr[r] * decay);
      if constexpr (Keep) sr[r] = v;
      else S[size_t(i) * dv + j] = v;
    }
  if (qg == 0) p.out[size_t(h) * dv + cb * kDnCols + j] = fmaf(decay * qinv, tb, delta * (kinv * qinv * sqk));
}

}  // namespace lily::cuda

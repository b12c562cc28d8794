// Gated DeltaNet decode step: causal conv1d update + SiLU, L2 norms, gates and
// the f32 recurrent state update, for one token.
//
// Block (value head h, 32-column slice of the value dim): it reads and writes
// its [dk x 32] slice of the state once (coalesced 128-byte rows), recomputes
// the conv of its key head's q/k channels (cheap) and owns the conv of its v
// channels. The conv state is a ring of the last K raw inputs indexed by
// position % K: this step writes slot pos % K while every reader reads the
// other K - 1 slots, so blocks never race on it.
#include "backend/cuda/device_common.cuh"

namespace lily::cuda {

namespace {

constexpr int kDnThreads = 128;
constexpr int kDnCols = 32;
constexpr int kDnRowGroups = kDnThreads / kDnCols;  // 4
constexpr int kDnMaxRows = 32;                      // dk / 4 <= 32
constexpr int kDnMaxDk = kDnMaxRows * kDnRowGroups;
constexpr int kDnChPerThread = (2 * kDnMaxDk + kDnCols + kDnThreads - 1) / kDnThreads;  // 3

// Fused: the state's two dot products taken in one pass before the norms are
// known (v12). With q and k normalised by scalars (qn = qinv q, kn = kinv k)
// and S' = decay S + kn delta^T:
//   kv_j = decay kinv sum_i S_ij k_i,
//   o_j  = sum_i S'_ij qn_i = decay qinv sum_i S_ij q_i + delta_j kinv qinv sum_i k_i q_i,
// so sum q^2, sum k^2, sum k q and both column sums of S meet at one barrier
// (against five rounds of block reductions before).
template <bool Fused>
__global__ void __launch_bounds__(kDnThreads) deltanet_step_kernel(const __grid_constant__ DeltaNetParams p) {
  const int h = blockIdx.x, cb = blockIdx.y;
  const int tid = threadIdx.x, j = tid & (kDnCols - 1), qg = tid / kDnCols;
  const int dk = p.dk, dv = p.dv, nk = p.nk, nv = p.nv, K = p.K;
  const int ratio = nv / nk, kh = h / ratio;
  const int C = 2 * nk * dk + nv * dv;
  trace_mark(p.trace, 0);
  float* S = p.state + size_t(h) * dk * dv + cb * kDnCols;  // row i at S[i * dv + j]
  // The state slice only depends on this layer's previous step: load it
  // before the predecessor kernel (the in_proj) has finished.
  const int nr = dk / kDnRowGroups;
  float sr[kDnMaxRows];
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) sr[r] = S[size_t(qg + kDnRowGroups * r) * dv + j];
  // Conv taps, the ring's previous inputs and the gate constants do not
  // depend on the predecessor either: load them before the wait too.
  __shared__ float qs[kDnMaxDk], ks[kDnMaxDk], vs[kDnCols];
  __shared__ float red[kDnRowGroups][kDnCols];
  __shared__ float scratch[32];
  const int pos = p.ctrl->pos;  // written by the previous step only
  const bool own_qk = (h % ratio) == 0 && cb == 0;
  const int nch = 2 * dk + kDnCols;
  int chs[kDnChPerThread];
  float acc_prev[kDnChPerThread];
  float w_last[kDnChPerThread];
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) {
    const int i = tid + u * kDnThreads;
    int ch = 0;
    if (i < dk) ch = kh * dk + i;
    else if (i < 2 * dk) ch = nk * dk + kh * dk + (i - dk);
    else if (i < nch) ch = 2 * nk * dk + h * dv + cb * kDnCols + (i - 2 * dk);
    chs[u] = ch;
    float s = 0.f;
    if (i < nch) {
      const float* w = p.conv_w + size_t(ch) * K;
      const float* ring = p.conv_ring + size_t(ch) * K;
      for (int t = 0; t < K - 1; ++t) s += w[t] * ring[(pos + 1 + t) % K];
      w_last[u] = w[K - 1];
    } else {
      w_last[u] = 0.f;
    }
    acc_prev[u] = s;
  }
  const float a_log = p.a_log[h], dt_bias = p.dt_bias[h];
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);

  float xt[kDnChPerThread];
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) xt[u] = tid + u * kDnThreads < nch ? p.proj[chs[u]] : 0.f;
  const float b = p.proj[C + nv * dv + h], a = p.proj[C + nv * dv + nv + h];
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) {
    const int i = tid + u * kDnThreads;
    if (i >= nch) continue;
    const float y = silu(acc_prev[u] + w_last[u] * xt[u]);
    if (i < dk) qs[i] = y;
    else if (i < 2 * dk) ks[i - dk] = y;
    else vs[i - 2 * dk] = y;
    if (i >= 2 * dk || own_qk) p.conv_ring[size_t(chs[u]) * K + pos % K] = xt[u];
  }
  __syncthreads();
  trace_mark(p.trace, 2);
  if constexpr (Fused) {
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
    __syncthreads();
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
        S[size_t(i) * dv + j] = fmaf(ks[i], dk_delta, sr[r] * decay);
      }
    if (qg == 0) p.out[size_t(h) * dv + cb * kDnCols + j] = fmaf(decay * qinv, tb, delta * (kinv * qinv * sqk));
    trace_end(p.trace);
    return;
  }
  float sq = 0.f, sk = 0.f;
  for (int i = tid; i < dk; i += kDnThreads) {
    sq = fmaf(qs[i], qs[i], sq);
    sk = fmaf(ks[i], ks[i], sk);
  }
  sq = block_sum(sq, scratch);
  sk = block_sum(sk, scratch);
  const float qinv = (1.f / sqrtf(sq + 1e-6f)) * (1.f / sqrtf(static_cast<float>(dk)));
  const float kinv = 1.f / sqrtf(sk + 1e-6f);
  __syncthreads();
  for (int i = tid; i < dk; i += kDnThreads) {
    qs[i] *= qinv;
    ks[i] *= kinv;
  }
  const float beta = sigmoid(b);
  const float g = -expf(a_log) * softplus(a + dt_bias);
  const float decay = expf(g);
  __syncthreads();

  float kv = 0.f;
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) {
      sr[r] *= decay;
      kv = fmaf(sr[r], ks[qg + kDnRowGroups * r], kv);
    }
  red[qg][j] = kv;
  __syncthreads();
  float kvt = 0.f;
#pragma unroll
  for (int q = 0; q < kDnRowGroups; ++q) kvt += red[q][j];
  const float delta = (vs[j] - kvt) * beta;
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) {
      const int i = qg + kDnRowGroups * r;
      sr[r] = fmaf(ks[i], delta, sr[r]);
      S[size_t(i) * dv + j] = sr[r];
      o = fmaf(sr[r], qs[i], o);
    }
  __syncthreads();
  red[qg][j] = o;
  __syncthreads();
  if (qg == 0) {
    float ot = 0.f;
#pragma unroll
    for (int q = 0; q < kDnRowGroups; ++q) ot += red[q][j];
    p.out[size_t(h) * dv + cb * kDnCols + j] = ot;
  }
  trace_end(p.trace);
}

}  // namespace

void launch_deltanet_step(const DeltaNetParams& p, cudaStream_t s, bool pdl) {
  if (p.dv % kDnCols != 0) fail("deltanet: value head dim ", p.dv, " is not a multiple of ", kDnCols);
  if (p.dk % kDnRowGroups != 0 || p.dk > kDnMaxDk)
    fail("deltanet: key head dim ", p.dk, " must be a multiple of 4 and at most ", kDnMaxDk);
  if (p.nv % p.nk != 0) fail("deltanet: value heads not a multiple of key heads");
  DeltaNetParams q = p;
  q.trace = next_trace();
  // LILY_CUDA_DN_FUSED=0: the step with a reduction round per quantity (A/B).
  auto kernel = env_switch("LILY_CUDA_DN_FUSED", 1) ? deltanet_step_kernel<true> : deltanet_step_kernel<false>;
  launch_kernel("deltanet_step", kernel, dim3(p.nv, p.dv / kDnCols), dim3(kDnThreads), 0, s, pdl, q);
}

}  // namespace lily::cuda

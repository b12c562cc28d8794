// Gated DeltaNet decode step: causal conv1d update + SiLU, L2 norms, gates and
// the f32 recurrent state update, for one token (deltanet_step.cuh: the
// block's work, shared with the in_proj that runs the step itself).
//
// Block (value head h, 32-column slice of the value dim): it reads and writes
// its [dk x 32] slice of the state once (coalesced 128-byte rows).
#include "backend/cuda/deltanet_step.cuh"

namespace lily::cuda {

namespace {

// Fused: the state's two dot products in one pass (dn_update_fused, v12);
// otherwise a reduction round per quantity (the A/B switch).
template <bool Fused>
__global__ void __launch_bounds__(kDnThreads) deltanet_step_kernel(const __grid_constant__ DeltaNetParams params) {
  // A local copy: the helpers take the parameters by reference, and with the
  // kernel parameter's address passed down ptxas kept 93 registers (64 with
  // the copy, as before the helpers). The tree with 93 decoded 5.8% slower at
  // 4K than v18's; that this was the cause is not yet measured
  // (docs/cuda-decode.md, v22).
  const DeltaNetParams p = params;
  const int h = blockIdx.x, cb = blockIdx.y;
  const int tid = threadIdx.x, j = tid & (kDnCols - 1), qg = tid / kDnCols;
  const int dk = p.dk, dv = p.dv;
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
  DnConv cv;
  dn_conv_pre(
      p, h, cb, tid, pos, [&](int, int ch) { return p.conv_w + size_t(ch) * p.K; },
      [&](int, int ch) { return p.conv_ring + size_t(ch) * p.K; }, cv);
  const float a_log = p.a_log[h], dt_bias = p.dt_bias[h];
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);

  const float2 ba = dn_conv_finish<false>(p, h, cb, tid, pos, cv, qs, ks, vs);
  const float b = ba.x, a = ba.y;
  __syncthreads();
  trace_mark(p.trace, 2);
  if constexpr (Fused) {
    dn_update_fused(p, h, cb, tid, sr, qs, ks, vs, b, a, a_log, dt_bias, [] { __syncthreads(); });
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

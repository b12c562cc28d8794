// Gated DeltaNet over a run of a few tokens (a speculative draft run, its
// replay on accept, a short follow-up turn): the recurrent form, token by
// token, instead of the chunked kernels (prefill_deltanet.cu), whose 64-token
// chunk costs the same for 2 tokens as for 64 (~49 us a layer on the H200).
//
// One block per (value head h, 32-column slice cb), as the decode step
// (deltanet_step.cuh, whose state update it calls): the block keeps its
// dk x 32 slice of the state in registers through the run and, per token,
// computes the conv + SiLU of its q / k / v channels from the four taps,
// the ring's inputs before the run and the run's own raw inputs (all in
// `qkv`, none written here), then the fused update (L2 norms, gates,
// delta rule, the output). The ring gets the run's last inputs in a
// separate launch after this one (dn_ring_kernel), so that no block reads
// a slot another block has rewritten. With a.state_backup each block also
// writes its slice as it was before the run (a draft run's record); with
// a.state_src / ring_src it starts from those instead (the record's replay). Per token the arithmetic is the
// decode step's (the same conv sums, the same update), so a run's state
// equals the one its tokens leave as decode steps, up to the order of the
// conv sum.
#include "backend/cuda/deltanet_step.cuh"
#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

constexpr int kRunK = 4;  // conv taps (prefill_deltanet: 4 only)
constexpr int kRunMaxT = 16;  // tokens whose inputs are staged at once

__global__ void __launch_bounds__(kDnThreads) dn_run_kernel(const __grid_constant__ PrefillDeltaNetArgs a) {
  pdl_wait();
  pdl_launch_dependents();
  const int h = blockIdx.x, cb = blockIdx.y;
  const int tid = threadIdx.x, j = tid & (kDnCols - 1), qg = tid / kDnCols;
  const int dk = a.dk, dv = a.dv, nr = dk / kDnRowGroups, nch = 2 * dk + kDnCols;
  DeltaNetParams p{};
  p.nk = a.nk;
  p.nv = a.nv;
  p.dk = dk;
  p.dv = dv;
  p.K = kRunK;
  p.state = a.state;
  const size_t slice = size_t(h) * dk * dv + cb * kDnCols;
  float* S = a.state + slice;  // row i at S[i * dv + j]
  const float* S0 = a.state_src ? a.state_src + slice : S;
  const float* ring = a.ring_src ? a.ring_src : a.conv_ring;
  float sr[kDnMaxRows];
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) sr[r] = S0[size_t(qg + kDnRowGroups * r) * dv + j];
  if (a.state_backup) {
    float* B = a.state_backup + size_t(h) * dk * dv + cb * kDnCols;
#pragma unroll
    for (int r = 0; r < kDnMaxRows; ++r)
      if (r < nr) B[size_t(qg + kDnRowGroups * r) * dv + j] = sr[r];
  }
  __shared__ float qs[kDnMaxDk], ks[kDnMaxDk], vs[kDnCols];
  // The thread's channels: taps and the K - 1 inputs before the current
  // token (the ring's, positions P - 3 .. P - 1, then the run's).
  int chs[kDnChPerThread];
  float w[kDnChPerThread][kRunK], hist[kDnChPerThread][kRunK - 1];
  const int P = a.first_position;
#pragma unroll
  for (int u = 0; u < kDnChPerThread; ++u) {
    const int i = tid + u * kDnThreads;
    const int ch = i < nch ? dn_channel(p, h, cb, i) : 0;
    chs[u] = ch;
#pragma unroll
    for (int m = 0; m < kRunK; ++m) w[u][m] = i < nch ? a.conv_w[size_t(ch) * kRunK + m] : 0.f;
#pragma unroll
    for (int m = 0; m < kRunK - 1; ++m)
      hist[u][m] = i < nch ? ring[size_t(ch) * kRunK + (P + 1 + m) % kRunK] : 0.f;
  }
  const float a_log = a.a_log[h], dt_bias = a.dt_bias[h];
  // The run's raw inputs of the block's channels, and b / a, all loaded at
  // once (kRunMaxT tokens at a time) instead of one token's per step.
  __shared__ float xin[kRunMaxT][kDnChPerThread][kDnThreads];
  __shared__ float bain[kRunMaxT][2];
  for (int t = 0; t < a.T; ++t) {
    const int tt = t % kRunMaxT;
    if (tt == 0) {
      const int n = min(kRunMaxT, a.T - t);
      __syncthreads();  // the previous batch is used up
      for (int r = 0; r < n; ++r) {
        const float* row = a.qkv + size_t(t + r) * a.ld_qkv;
#pragma unroll
        for (int u = 0; u < kDnChPerThread; ++u)
          if (tid + u * kDnThreads < nch) xin[r][u][tid] = row[chs[u]];
      }
      if (tid < 2 * n) {
        const int r = tid >> 1;
        bain[r][tid & 1] = (tid & 1) ? a.a[size_t(t + r) * a.ld_ab + h] : a.b[size_t(t + r) * a.ld_ab + h];
      }
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < kDnChPerThread; ++u) {
      const int i = tid + u * kDnThreads;
      if (i >= nch) continue;
      const float x = xin[tt][u][tid];
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < kRunK - 1; ++m) s += w[u][m] * hist[u][m];
      const float y = silu(s + w[u][kRunK - 1] * x);
#pragma unroll
      for (int m = 0; m < kRunK - 2; ++m) hist[u][m] = hist[u][m + 1];
      hist[u][kRunK - 2] = x;
      if (i < dk) qs[i] = y;
      else if (i < 2 * dk) ks[i - dk] = y;
      else vs[i - 2 * dk] = y;
    }
    const float b = bain[tt][0], av = bain[tt][1];
    p.out = a.out + size_t(t) * a.ld_out;
    __syncthreads();
    dn_update_fused<true>(p, h, cb, tid, sr, qs, ks, vs, b, av, a_log, dt_bias, [] { __syncthreads(); });
    __syncthreads();  // qs / ks / vs are rewritten by the next token
  }
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) S[size_t(qg + kDnRowGroups * r) * dv + j] = sr[r];
}

}  // namespace

void prefill_detail::launch_deltanet_run(const PrefillDeltaNetArgs& a, cudaStream_t stream) {
  if (a.dk > kDnMaxDk || a.dk % kDnRowGroups != 0 || a.dv % kDnCols != 0)
    fail("prefill_deltanet (run form): head dims ", a.dk, " x ", a.dv, " are not supported");
  launch_kernel("dn_run_kernel", dn_run_kernel, dim3(a.nv, a.dv / kDnCols), dim3(kDnThreads), 0, stream,
                prefill_pdl(a.T), a);
}

}  // namespace lily::cuda

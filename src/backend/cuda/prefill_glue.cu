// Glue kernels of the prefill path (see prefill_glue.h).
// attn_prep: one block per token; a warp takes one head at a time (RMSNorm
// over the head, partial NeoX RoPE at the token's position, bf16 out), the
// same f32 arithmetic as the decode attention kernel's prologue.

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/prefill_glue.h"

namespace lily::cuda {

namespace {

constexpr int kPrepWarps = 8;
constexpr int kPrepMaxHd = 512;

__device__ __forceinline__ uint16_t bf16_of(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}

__global__ void __launch_bounds__(kPrepWarps * 32) attn_prep_kernel(const AttnPrepParams p) {
  __shared__ float buf[kPrepWarps][kPrepMaxHd];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pos = p.P + t, hd = p.hd, half = p.rotary_dim / 2;
  const float fpos = static_cast<float>(pos);
  const float* row = p.proj + size_t(t) * p.ld_proj;
  const float* kbase = row + size_t(p.nh) * p.q_head_stride;
  float* b = buf[warp];
  for (int h = warp; h < p.nh + p.nkv; h += kPrepWarps) {
    const bool isq = h < p.nh;
    const float* src = isq ? row + size_t(h) * p.q_head_stride : kbase + size_t(h - p.nh) * hd;
    const float* nw = isq ? p.q_norm : p.k_norm;
    float ss = 0.f;
    for (int d = lane; d < hd; d += 32) {
      const float v = src[d];
      b[d] = v;
      ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / static_cast<float>(hd) + p.eps);
    __syncwarp();
    for (int d = lane; d < hd; d += 32) b[d] = b[d] * inv * nw[d];
    __syncwarp();
    uint16_t* dst = isq ? p.qg + size_t(t) * p.nh * p.q_head_stride + size_t(h) * p.q_head_stride
                        : p.k_cache + (size_t(h - p.nh) * p.capacity + pos) * hd;
    for (int d = lane; d < hd; d += 32) {
      float v = b[d];
      if (d < 2 * half) {
        const int i = d < half ? d : d - half;
        const float angle = fpos * p.inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        const float x1 = b[i], x2 = b[i + half];
        v = d < half ? x1 * c - x2 * s : x2 * c + x1 * s;
      }
      dst[d] = bf16_of(v);
    }
    if (isq && p.gated)
      for (int d = lane; d < hd; d += 32) dst[hd + d] = bf16_of(src[hd + d]);
    __syncwarp();
  }
  const float* vsrc = kbase + size_t(p.nkv) * hd;
  for (int idx = threadIdx.x; idx < p.nkv * hd; idx += blockDim.x) {
    const int h = idx / hd, d = idx - h * hd;
    p.v_cache[(size_t(h) * p.capacity + pos) * hd + d] = bf16_of(vsrc[idx]);
  }
}

}  // namespace

void launch_attn_prep(const AttnPrepParams& p, cudaStream_t s) {
  if (p.T <= 0) return;
  if (p.hd <= 0 || p.hd > kPrepMaxHd) fail("attn_prep: head_dim ", p.hd, " is outside [1, ", kPrepMaxHd, "]");
  if (p.rotary_dim < 0 || p.rotary_dim > p.hd || p.rotary_dim % 2)
    fail("attn_prep: rotary_dim ", p.rotary_dim, " must be even and at most head_dim ", p.hd);
  if (p.P < 0 || p.P + p.T > p.capacity)
    fail("attn_prep: positions [", p.P, ", ", p.P + p.T, ") exceed the cache capacity ", p.capacity);
  launch_kernel("attn_prep", attn_prep_kernel, dim3(p.T), dim3(kPrepWarps * 32), 0, s, false, p);
}

}  // namespace lily::cuda

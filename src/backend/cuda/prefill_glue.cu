// Glue kernels of the prefill path (see prefill_glue.h).
// attn_prep: one block per token; a warp takes one head at a time (RMSNorm
// over the head, partial NeoX RoPE at the token's position, bf16 out), the
// same f32 arithmetic as the decode attention kernel's prologue.

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/prefill.h"
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
  pdl_wait();
  pdl_launch_dependents();
  __shared__ float buf[kPrepWarps][kPrepMaxHd];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pos = p.P + t, hd = p.hd, half = p.rotary_dim / 2;
  const float fpos = static_cast<float>(pos);
  const float* row = p.proj + size_t(t) * p.ld_proj;
  const float* kbase = row + size_t(p.nh) * p.q_head_stride;
  float* b = buf[warp];
  // Heads over the warps of the row's gridDim.y blocks (a short run: one
  // head a warp; the same arithmetic per head).
  for (int h = blockIdx.y * kPrepWarps + warp; h < p.nh + p.nkv; h += gridDim.y * kPrepWarps) {
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
  for (int idx = blockIdx.y * blockDim.x + threadIdx.x; idx < p.nkv * hd; idx += gridDim.y * blockDim.x) {
    const int h = idx / hd, d = idx - h * hd;
    p.v_cache[(size_t(h) * p.capacity + pos) * hd + d] = bf16_of(vsrc[idx]);
  }
}

// One warp per (head, row): rows [p0, p1) of every head.
__global__ void kv_q8_expand_kernel(const KvQ8Rows q, int nkv, int hd, int p0, int p1, uint16_t* dst,
                                    int dst_cap) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const int n = p1 - p0;
  if (warp >= nkv * n) return;
  const int h = warp / n, pos = p0 + warp % n;
  const uint8_t* src = q.rows + (size_t(h) * q.capacity + pos) * hd;
  const float sc = q.scales[size_t(h) * q.scale_stride + pos];
  uint16_t* out = dst + (size_t(h) * dst_cap + pos) * hd;
  for (int d = lane; d < hd; d += 32) out[d] = bf16_of((static_cast<float>(src[d]) - 128.f) * sc);
}

__global__ void kv_q8_store_kernel(uint16_t* src, int src_cap, int nkv, int hd, int p0, int p1, const KvQ8Rows q) {
  pdl_wait();
  pdl_launch_dependents();
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const int n = p1 - p0;
  if (warp >= nkv * n) return;
  const int h = warp / n, pos = p0 + warp % n;
  uint16_t* row = src + (size_t(h) * src_cap + pos) * hd;
  auto val = [&](int d) { return __uint_as_float(static_cast<uint32_t>(row[d]) << 16); };
  float m = 0.f;
  for (int d = lane; d < hd; d += 32) m = fmaxf(m, fabsf(val(d)));
  m = warp_max(m);
  const float inv = q8_inv(m), sc = q8_scale(m);
  uint8_t* dst = q.rows + (size_t(h) * q.capacity + pos) * hd;
  for (int d = lane; d < hd; d += 32) {
    const uint32_t u = q8_code(val(d), inv);
    dst[d] = static_cast<uint8_t>(u);
    row[d] = bf16_of((static_cast<float>(u) - 128.f) * sc);
  }
  if (lane == 0) q.scales[size_t(h) * q.scale_stride + pos] = sc;
}

void check_q8_rows(const char* what, const KvQ8Rows& q, int p0, int p1) {
  if (!q.rows || !q.scales || p0 < 0 || p1 > q.capacity || q.scale_stride < q8_scale_stride(q.capacity))
    fail(what, ": rows [", p0, ", ", p1, ") of a q8 cache of capacity ", q.capacity);
}

}  // namespace

void launch_kv_q8_expand(const KvQ8Rows& q, int nkv, int hd, int p0, int p1, uint16_t* dst, int dst_cap,
                         cudaStream_t s) {
  if (p1 <= p0) return;
  check_q8_rows("kv_q8_expand", q, p0, p1);
  if (p1 > dst_cap) fail("kv_q8_expand: rows up to ", p1, " into a buffer of ", dst_cap);
  const int warps = nkv * (p1 - p0);
  launch_kernel("kv_q8_expand", kv_q8_expand_kernel, dim3((warps + 7) / 8), dim3(256), 0, s, false, q, nkv, hd,
                p0, p1, dst, dst_cap);
}

void launch_kv_q8_store(uint16_t* src, int src_cap, int nkv, int hd, int p0, int p1, const KvQ8Rows& q,
                        cudaStream_t s) {
  if (p1 <= p0) return;
  check_q8_rows("kv_q8_store", q, p0, p1);
  if (p1 > src_cap) fail("kv_q8_store: rows up to ", p1, " of a buffer of ", src_cap);
  const int warps = nkv * (p1 - p0);
  launch_kernel("kv_q8_store", kv_q8_store_kernel, dim3((warps + 7) / 8), dim3(256), 0, s, prefill_pdl(p1 - p0), src, src_cap,
                nkv, hd, p0, p1, q);
}

void launch_attn_prep(const AttnPrepParams& p, cudaStream_t s) {
  if (p.T <= 0) return;
  if (p.hd <= 0 || p.hd > kPrepMaxHd) fail("attn_prep: head_dim ", p.hd, " is outside [1, ", kPrepMaxHd, "]");
  if (p.rotary_dim < 0 || p.rotary_dim > p.hd || p.rotary_dim % 2)
    fail("attn_prep: rotary_dim ", p.rotary_dim, " must be even and at most head_dim ", p.hd);
  if (p.P < 0 || p.P + p.T > p.capacity)
    fail("attn_prep: positions [", p.P, ", ", p.P + p.T, ") exceed the cache capacity ", p.capacity);
  // A short run (prefill_skinny_rows): one warp a head (more blocks a row
  // for the same work).
  const int ys = p.T <= prefill_skinny_rows() ? (p.nh + p.nkv + kPrepWarps - 1) / kPrepWarps : 1;
  launch_kernel("attn_prep", attn_prep_kernel, dim3(p.T, ys), dim3(kPrepWarps * 32), 0, s, prefill_pdl(p.T), p);
}

}  // namespace lily::cuda

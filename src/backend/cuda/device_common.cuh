// Device helpers shared by the decode kernels: programmatic-dependent-launch
// controls, streaming loads, dequantization of one 16-byte chunk against the
// staged input, and warp / block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.h"
#include "backend/cuda/cuda_util.h"

namespace lily::cuda {

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Step timeline marks (see TraceSpec): mark i of this block's record, by
// thread 0. trace_end orders it after every thread of the block.
__device__ __forceinline__ void trace_mark(const TraceSpec& t, int i) {
  if (!t.recs) return;
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != 0 || b >= static_cast<unsigned>(t.blocks_cap)) return;
  TraceRec& r = t.recs[size_t(t.launch) * t.blocks_cap + b];
  unsigned long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  r.t[i] = g;
  r.c[i] = static_cast<unsigned>(clock64());
  if (i == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r.sm = sm;
    r.blocks = gridDim.x * gridDim.y * gridDim.z;
  }
}
// A clock-only sub-step mark (i in 4..7).
__device__ __forceinline__ void trace_clock(const TraceSpec& t, int i) {
  if (!t.recs) return;
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != static_cast<unsigned>(t.clock_thread) || b >= static_cast<unsigned>(t.blocks_cap)) return;
  t.recs[size_t(t.launch) * t.blocks_cap + b].c[i] = static_cast<unsigned>(clock64());
}
__device__ __forceinline__ void trace_end(const TraceSpec& t) {
  if (!t.recs) return;
  __syncthreads();
  trace_mark(t, 3);
}

// Weights are read once per step: bypass L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ld_stream(const uint32_t* p) {
  uint32_t r;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
// x * sigmoid(x) with the fast exponential and division (a few ulp; no
// division subroutine): the gated norm's 16 per thread in the staging.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- q8 KV rows (KvType::Q8 in kernels.h) --------------------------------------
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// 127 / m (0 for an all-zero row) and the stored scale m / 127, IEEE-rounded.
__device__ __forceinline__ float q8_inv(float m) { return m > 0.f ? __fdiv_rn(127.f, m) : 0.f; }
__device__ __forceinline__ float q8_scale(float m) { return __fdiv_rn(m, 127.f); }
// The offset-binary code of a bf16-rounded value b.
__device__ __forceinline__ uint32_t q8_code(float b, float inv) {
  const int c = __float2int_rn(__fmul_rn(b, inv));
  return static_cast<uint32_t>(max(-127, min(127, c)) + 128);
}
// One warp quantizes a row of n values (src, any memory) into dst / *scale.
__device__ __forceinline__ void q8_store_row_warp(const float* src, int n, uint8_t* dst, float* scale, int lane) {
  float m = 0.f;
  for (int d = lane; d < n; d += 32) m = fmaxf(m, fabsf(bf16_round(src[d])));
  m = warp_max(m);
  const float inv = q8_inv(m);
  for (int d = lane; d < n; d += 32) dst[d] = static_cast<uint8_t>(q8_code(bf16_round(src[d]), inv));
  if (lane == 0) *scale = q8_scale(m);
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32
// floats. Deterministic.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nw ? scratch[lane] : 0.f;
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nw ? scratch[lane] : -INFINITY;
  return warp_max(t);
}

// ---- chunk formats ------------------------------------------------------------
// A 16-byte chunk covers FPC inputs = PPC float4 "pieces" of the staged input.
// The staged input lives in shared memory as float4 pieces, chunk-major, with
// the piece index XOR-swizzled by the chunk index so that the 8 lanes of a
// quarter-warp (consecutive chunks, same piece) hit 8 different bank groups.
template <QFmt F>
struct ChunkFmt {
  static constexpr int FPC = floats_per_chunk(F);
  static constexpr int PPC = FPC / 4;
  static constexpr bool affine = F == QFmt::Q4 || F == QFmt::Q8;
  __device__ static __forceinline__ int swz(int c) {
    if constexpr (PPC == 1) return 0;
    else return (c / (8 / PPC)) & (PPC - 1);
  }
  // The affine group term scale * sum(q x) + bias * sum(x) from chunk_dot's
  // d and the chunk's sum(x); q4's d is sum (1/2 + q/256) x, so
  // sum(q x) = 256 d - 128 sum(x).
  __device__ static __forceinline__ float affine_term(float2 sb, float d, float xsum) {
    if constexpr (F == QFmt::Q4) return fmaf(256.f * sb.x, d, (sb.y - 128.f * sb.x) * xsum);
    else return fmaf(sb.x, d, sb.y * xsum);
  }
  // Shared-memory float index of input element `i` of chunk-item `c`.
  __device__ static __forceinline__ int slot(int c, int within) {
    return (c * PPC + ((within >> 2) ^ swz(c))) * 4 + (within & 3);
  }
};

// 2^23 + byte as a float, minus 2^23: an exact small integer without I2F.
__device__ __forceinline__ float byte_f(uint32_t v, uint32_t sel) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, sel)) - 8388608.f;
}

// A 4-bit code q (one byte of v, 0..15) as the float 1/2 + q/256: its byte
// lands in the mantissa's top bits under the exponent byte of 0.5 (one PRMT,
// no conversion and no subtraction per weight).
__device__ __forceinline__ float q4_half(uint32_t v, uint32_t sel) {
  return __uint_as_float(__byte_perm(v, 0x3F000000u, sel));
}

// d[r] = sum over the chunk of code (affine; q4: see q4_half) or value
// (float) times x, for R rows that share the chunk index c (and so the staged
// input).
template <QFmt F, int R>
__device__ __forceinline__ void chunk_dot(const uint4 (&w)[R], const float4* xs, int c,
                                          float (&d)[R]) {
  using CF = ChunkFmt<F>;
  const float4* b = xs + c * CF::PPC;
  const int sw = CF::swz(c);
#pragma unroll
  for (int r = 0; r < R; ++r) d[r] = 0.f;
  if constexpr (F == QFmt::Q4) {
    // d = sum (1/2 + q/256) x (see q4_half); ChunkFmt::affine_term undoes it.
    float a0[R], a1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 xa = b[(2 * i) ^ sw], xb = b[(2 * i + 1) ^ sw];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t word = i == 0 ? w[r].x : i == 1 ? w[r].y : i == 2 ? w[r].z : w[r].w;
        const uint32_t lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
        a0[r] = fmaf(q4_half(lo, 0x7054), xa.x, a0[r]);
        a1[r] = fmaf(q4_half(hi, 0x7054), xa.y, a1[r]);
        a0[r] = fmaf(q4_half(lo, 0x7154), xa.z, a0[r]);
        a1[r] = fmaf(q4_half(hi, 0x7154), xa.w, a1[r]);
        a0[r] = fmaf(q4_half(lo, 0x7254), xb.x, a0[r]);
        a1[r] = fmaf(q4_half(hi, 0x7254), xb.y, a1[r]);
        a0[r] = fmaf(q4_half(lo, 0x7354), xb.z, a0[r]);
        a1[r] = fmaf(q4_half(hi, 0x7354), xb.w, a1[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) d[r] = a0[r] + a1[r];
  } else if constexpr (F == QFmt::Q8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 xa = b[i ^ sw];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t word = i == 0 ? w[r].x : i == 1 ? w[r].y : i == 2 ? w[r].z : w[r].w;
        float a0 = byte_f(word, 0x7650) * xa.x;
        float a1 = byte_f(word, 0x7651) * xa.y;
        a0 = fmaf(byte_f(word, 0x7652), xa.z, a0);
        a1 = fmaf(byte_f(word, 0x7653), xa.w, a1);
        d[r] += a0 + a1;
      }
    }
  } else if constexpr (F == QFmt::BF16) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float4 xa = b[i ^ sw];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t w0 = i == 0 ? w[r].x : w[r].z, w1 = i == 0 ? w[r].y : w[r].w;
        float a0 = __uint_as_float(w0 << 16) * xa.x;
        float a1 = __uint_as_float(w0 & 0xFFFF0000u) * xa.y;
        a0 = fmaf(__uint_as_float(w1 << 16), xa.z, a0);
        a1 = fmaf(__uint_as_float(w1 & 0xFFFF0000u), xa.w, a1);
        d[r] += a0 + a1;
      }
    }
  } else {
    const float4 xa = b[0];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a0 = __uint_as_float(w[r].x) * xa.x;
      float a1 = __uint_as_float(w[r].y) * xa.y;
      a0 = fmaf(__uint_as_float(w[r].z), xa.z, a0);
      a1 = fmaf(__uint_as_float(w[r].w), xa.w, a1);
      d[r] = a0 + a1;
    }
  }
}

// (scale, bias) of one affine group.
__device__ __forceinline__ float2 decode_sb(uint32_t v, int f16) {
  if (f16) {
    __half2 h;
    memcpy(&h, &v, 4);
    return __half22float2(h);
  }
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

// Orders floats as unsigned integers (larger float -> larger key).
__device__ __forceinline__ unsigned long long argmax_key(float v, int idx) {
  uint32_t b = __float_as_uint(v);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(b) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int argmax_key_index(unsigned long long k) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(k & 0xFFFFFFFFull));
}

// An A/B switch from the environment ("0" / "1"), read at each launch: the
// decode step is captured into a graph once, and the kernel tests flip the
// switches between launches.
inline int env_switch(const char* name, int dflt) {
  const char* e = std::getenv(name);
  if (!e || !*e) return dflt;
  return std::string(e) == "0" ? 0 : 1;
}

inline int device_sm_count() {
  static int n = [] {
    int dev = 0, v = 0;
    LILY_CUDA(cudaGetDevice(&dev));
    LILY_CUDA(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

}  // namespace lily::cuda

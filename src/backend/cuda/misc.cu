// Embedding lookup (first kernel of a decode step) and the random fills used
// for synthetic benchmark models and caches.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/prefill_glue.h"

namespace lily::cuda {

namespace {

// x[0..cols) = row `row` of m, dequantized; the block's threads split the
// row's 16-byte chunks.
template <QFmt F>
__device__ __forceinline__ void embed_row(const DevMatView& m, size_t row, float* x) {
  constexpr int FPC = ChunkFmt<F>::FPC;
  for (int c = threadIdx.x; c < m.chunks; c += blockDim.x) {
    const uint4 w = m.w[row * m.chunks + c];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    float v[FPC];
    if constexpr (F == QFmt::Q4) {
#pragma unroll
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>((words[i / 8] >> (4 * (i % 8))) & 15u);
    } else if constexpr (F == QFmt::Q8) {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = static_cast<float>((words[i / 4] >> (8 * (i % 4))) & 255u);
    } else if constexpr (F == QFmt::BF16) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = (i & 1) ? __uint_as_float(words[i / 2] & 0xFFFF0000u) : __uint_as_float(words[i / 2] << 16);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(words[i]);
    }
    if constexpr (F == QFmt::Q4 || F == QFmt::Q8) {
      const float2 sb = decode_sb(m.sb[row * m.groups + c / m.chunks_per_group], m.sb_f16);
#pragma unroll
      for (int i = 0; i < FPC; ++i) v[i] = sb.x * v[i] + sb.y;
    }
#pragma unroll
    for (int i = 0; i < FPC; ++i)
      if (c * FPC + i < m.cols) x[c * FPC + i] = v[i];
  }
}

template <QFmt F>
__global__ void __launch_bounds__(256) embed_kernel(const __grid_constant__ EmbedParams p) {
  trace_mark(p.trace, 0);
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);
  __shared__ int s_tok;
  if (threadIdx.x == 0) {
    DecodeCtrl* c = p.ctrl;
    int tok = (c->use_argmax && c->argmax_key) ? argmax_key_index(c->argmax_key) : c->token;
    tok = min(max(tok, 0), p.m.rows - 1);
    c->token = tok;
    c->argmax_key = 0;
    s_tok = tok;
  }
  __syncthreads();
  trace_mark(p.trace, 2);
  embed_row<F>(p.m, static_cast<size_t>(s_tok), p.x);
  trace_end(p.trace);
}

// One block per token.
template <QFmt F>
__global__ void __launch_bounds__(256) embed_rows_kernel(const DevMatView m, const int* tokens, float* x,
                                                         size_t ldx) {
  const int tok = min(max(tokens[blockIdx.x], 0), m.rows - 1);
  embed_row<F>(m, static_cast<size_t>(tok), x + blockIdx.x * ldx);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float unit_float(uint64_t h) {  // [0, 1)
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_u32_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint32_t>(mix64(seed * 0x9E3779B97F4A7C15ull + i));
}

__device__ __forceinline__ uint32_t bf16_bits(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}

__global__ void fill_sb_kernel(uint32_t* p, size_t n, float scale, float jitter, float bias_per_scale,
                               uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = unit_float(mix64(seed * 0x9E3779B97F4A7C15ull + i));
    const float s = scale * (1.f + jitter * (2.f * u - 1.f));
    p[i] = bf16_bits(s) | (bf16_bits(bias_per_scale * s) << 16);
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, float lo, float hi, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * unit_float(mix64(seed * 0x9E3779B97F4A7C15ull + i));
}

__global__ void fill_bf16_kernel(uint16_t* p, size_t n, float lo, float hi, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint16_t>(bf16_bits(lo + (hi - lo) * unit_float(mix64(seed * 0x9E3779B97F4A7C15ull + i))));
}

__global__ void empty_kernel(int* sink) {
  pdl_wait();
  pdl_launch_dependents();
  if (sink && threadIdx.x == 0 && blockIdx.x == 0) *sink = 0;
}

// The hand-over probe (launch_handover_probe): one dependent launch of a
// chain, built up from the empty kernel one ingredient of a matvec's setup
// at a time (the stages in kernels.h). Each block reads all of x (2048 floats, 8 per
// thread) after the wait, as every matvec block does, and writes 8 of the
// next launch's inputs, so each launch depends on the previous one through
// the L2.
constexpr int kProbeCols = 2048, kProbeThreads = 256;
__global__ void __launch_bounds__(kProbeThreads) handover_probe_kernel(const float* x, float* y, const uint4* w,
                                                                       int stage, int pre) {
  __shared__ float red[kProbeThreads / 32];
  __shared__ uint2 codes[kProbeThreads];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Weights requested before the wait (a matvec's first item): pre 16-byte
  // pieces per thread, a distinct slice per block.
  uint4 wr[4] = {};
  const uint4* wb = w + (size_t(blockIdx.x) * kProbeThreads + tid) * 4;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (k < pre) wr[k] = ld_stream(wb + k);
  pdl_wait();
  pdl_launch_dependents();
  if (stage == 0) {
    if (tid == 0 && blockIdx.x == 0) y[0] = x[0];
    return;
  }
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4 a = x4[2 * tid], b = x4[2 * tid + 1];
  float v = (a.x + a.y) + (a.z + a.w) + (b.x + b.y) + (b.z + b.w);
  float scale = 1.f;
  if (stage >= 2) {  // the input RMSNorm: warp sums, a block barrier, the total
    float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < kProbeThreads / 32; ++i) tot += red[i];
    scale = 1.f / sqrtf(tot / kProbeCols + 1e-6f);
  }
  if (stage >= 3) {  // integer codes of the 8 inputs into shared memory, then a block barrier
    float m = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                    fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float inv = m > 0.f ? 127.f / m : 0.f;
    const float e[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint32_t c[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = static_cast<uint32_t>(__float2int_rn(e[i] * scale * inv)) & 0xffu;
    codes[tid] = make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24, c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
    __syncthreads();
    // The pre-wait weights against the codes (what the first item computes).
    int d = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint2 q = codes[(tid + 37 * k) & (kProbeThreads - 1)];
      d = __dp4a(static_cast<int>(wr[k].x & 0x0f0f0f0fu), static_cast<int>(q.x), d);
      d = __dp4a(static_cast<int>(wr[k].y & 0x0f0f0f0fu), static_cast<int>(q.y), d);
    }
    v += static_cast<float>(d) * 1e-30f;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v += static_cast<float>(wr[k].x & 1u) * 1e-30f;
  }
  v = warp_sum(v) * scale;
  // 8 outputs per block (lane 0 of each warp), the next launch's input.
  const int o = blockIdx.x * (kProbeThreads / 32) + warp;
  if (lane == 0 && o < kProbeCols) y[o] = 0.5f * x[o] + 1e-3f * v;
}

__global__ void clock_probe_kernel(unsigned long long* out, long long cycles) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  long long c = c0;
  while (c - c0 < cycles) c = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = static_cast<unsigned long long>(c - c0);
  out[1] = t1 - t0;
}

dim3 fill_grid(size_t n) {
  const size_t blocks = (n + 255) / 256;
  return dim3(static_cast<unsigned>(std::min<size_t>(blocks, size_t(device_sm_count()) * 16)));
}

}  // namespace

namespace {
TraceSpec g_trace;  // armed by set_trace (host side, one stream at a time)
int g_trace_max = 0;
}  // namespace

void set_trace(TraceRec* recs, int max_launches, int blocks_cap) {
  g_trace = TraceSpec{};
  g_trace.recs = recs;
  g_trace.blocks_cap = blocks_cap;
  g_trace_max = recs ? max_launches : 0;
}

TraceSpec next_trace() {
  if (!g_trace.recs) return TraceSpec{};
  TraceSpec t = g_trace;
  ++g_trace.launch;
  if (t.launch >= g_trace_max) t.recs = nullptr;
  return t;
}

int traced_launches() { return g_trace.launch; }

void launch_embed(const EmbedParams& p, cudaStream_t s, bool pdl) {
  EmbedParams q = p;
  q.trace = next_trace();
  switch (p.m.fmt) {
    case QFmt::Q4: return launch_kernel("embed", embed_kernel<QFmt::Q4>, dim3(1), dim3(256), 0, s, pdl, q);
    case QFmt::Q8: return launch_kernel("embed", embed_kernel<QFmt::Q8>, dim3(1), dim3(256), 0, s, pdl, q);
    case QFmt::BF16: return launch_kernel("embed", embed_kernel<QFmt::BF16>, dim3(1), dim3(256), 0, s, pdl, q);
    case QFmt::F32: return launch_kernel("embed", embed_kernel<QFmt::F32>, dim3(1), dim3(256), 0, s, pdl, q);
  }
}

void launch_embed_rows(const DevMatView& m, const int* tokens, int T, float* x, size_t ldx,
                       cudaStream_t s) {
  if (T <= 0) return;
  if (ldx < size_t(m.cols)) fail("embed_rows: row stride ", ldx, " is below the width ", m.cols);
  switch (m.fmt) {
    case QFmt::Q4: return launch_kernel("embed_rows", embed_rows_kernel<QFmt::Q4>, dim3(T), dim3(256), 0, s, false, m, tokens, x, ldx);
    case QFmt::Q8: return launch_kernel("embed_rows", embed_rows_kernel<QFmt::Q8>, dim3(T), dim3(256), 0, s, false, m, tokens, x, ldx);
    case QFmt::BF16: return launch_kernel("embed_rows", embed_rows_kernel<QFmt::BF16>, dim3(T), dim3(256), 0, s, false, m, tokens, x, ldx);
    case QFmt::F32: return launch_kernel("embed_rows", embed_rows_kernel<QFmt::F32>, dim3(T), dim3(256), 0, s, false, m, tokens, x, ldx);
  }
}

void launch_handover_probe(const float* x, float* y, const uint4* w, int stage, int pre, int blocks,
                           cudaStream_t s, bool pdl) {
  if (stage < 0 || stage > 3 || pre < 0 || pre > 4 || blocks * (kProbeThreads / 32) < kProbeCols)
    fail("handover probe: stage ", stage, ", ", pre, " pieces, ", blocks, " blocks");
  launch_kernel("handover_probe", handover_probe_kernel, dim3(blocks), dim3(kProbeThreads), 0, s, pdl, x, y, w,
                stage, pre);
}

void launch_empty(int blocks, int threads, int* sink, cudaStream_t s, bool pdl) {
  launch_kernel("empty", empty_kernel, dim3(blocks), dim3(threads), 0, s, pdl, sink);
}

double measure_sm_clock_mhz(cudaStream_t s) {
  DeviceBuffer b(16);
  clock_probe_kernel<<<1, 1, 0, s>>>(b.as<unsigned long long>(), 20000000);
  check_launch("clock_probe");
  unsigned long long h[2] = {0, 0};
  LILY_CUDA(cudaStreamSynchronize(s));
  LILY_CUDA(cudaMemcpy(h, b.get(), 16, cudaMemcpyDeviceToHost));
  return h[1] ? double(h[0]) / double(h[1]) * 1e3 : 0.0;
}

void fill_random_u32(uint32_t* p, size_t n, uint64_t seed, cudaStream_t s) {
  if (!n) return;
  fill_u32_kernel<<<fill_grid(n), 256, 0, s>>>(p, n, seed);
  check_launch("fill_random_u32");
}
void fill_random_scale_bias(uint32_t* p, size_t n, float scale, float jitter, float bias_per_scale,
                            uint64_t seed, cudaStream_t s) {
  if (!n) return;
  fill_sb_kernel<<<fill_grid(n), 256, 0, s>>>(p, n, scale, jitter, bias_per_scale, seed);
  check_launch("fill_random_scale_bias");
}
void fill_random_f32(float* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t s) {
  if (!n) return;
  fill_f32_kernel<<<fill_grid(n), 256, 0, s>>>(p, n, lo, hi, seed);
  check_launch("fill_random_f32");
}
void fill_random_bf16(uint16_t* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t s) {
  if (!n) return;
  fill_bf16_kernel<<<fill_grid(n), 256, 0, s>>>(p, n, lo, hi, seed);
  check_launch("fill_random_bf16");
}

}  // namespace lily::cuda

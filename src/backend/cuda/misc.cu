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

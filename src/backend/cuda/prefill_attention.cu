// Causal flash attention for prefill: GQA, head_dim 32, 64, 128 or 256 (one
// kernel instantiation per head dim; 256 is the production model's, the
// smaller ones serve the test fixtures and other Qwen3-family sizes), queries
// appended after P cached positions, sigmoid output gate fused in the epilogue.
//
// One block = 128 query rows of one query head (8 warps x 16 rows). The Q
// tile stays in shared memory; K/V tiles of 64 positions stream through a
// two-stage cp.async double buffer. Per warp: S = Q K^T with m16n8k16 bf16
// MMAs (K read with ldmatrix as the "col" operand), online softmax in base 2
// on the f32 accumulators, P re-packed in registers as the A operand, and
// O += P V with V read through ldmatrix.trans. O (16 x HD per warp) lives in
// HD / 2 f32 registers per thread (128 at HD = 256). Query tiles are issued
// longest-first (the last tiles see the most keys) to shorten the tail.
//
// Shared tiles are rows of HD bf16 (HD / 8 16-byte chunks), chunk c of row r
// stored at chunk c ^ (r' & mask), mask = min(8, HD / 8) - 1 (the XOR stays
// inside the row), so the 8 rows an ldmatrix phase reads (8 consecutive rows,
// one chunk) hit 8 distinct 16-byte bank groups. r' = r for HD >= 64 (rows of
// >= 128 bytes); at HD = 32 two 64-byte rows share a 128-byte bank line, so
// r' = r >> 1 (rows 2i and 2i+1 sit in different halves of the line).
#include <cmath>

#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

using namespace prefill_detail;

constexpr int kBMq = 128;
constexpr int kBNk = 64;
constexpr int kAttnThreads = 256;

// Compile-time shape of one head-dim instantiation.
template <int HD>
struct AttnShape {
  static_assert(HD == 32 || HD == 64 || HD == 128 || HD == 256, "head_dim 32, 64, 128 or 256");
  static constexpr int kRowChunks = HD / 8;  // 16-byte chunks per row
  static constexpr int kSwzMask = (kRowChunks < 8 ? kRowChunks : 8) - 1;
  // log2 of the rows per 128-byte bank line: 0 for rows of >= 128 bytes, 1 at HD = 32.
  static constexpr int kLineShift = HD >= 64 ? 0 : 1;
  static constexpr size_t kSmem = size_t(kBMq) * HD * 2 + 2 * 2 * size_t(kBNk) * HD * 2;
};

struct AttnParams {
  const uint16_t* q;
  const uint16_t* gate;
  size_t q_row, q_head;
  const uint16_t* k;
  const uint16_t* v;
  int capacity;
  uint16_t* out;
  size_t out_row;
  int T, P, nh, nkv;
  float scale_log2;
};

// Element offset of 16-byte chunk c of row r in a swizzled [rows][HD] tile.
template <int HD>
__device__ __forceinline__ int swz(int r, int c) {
  using S = AttnShape<HD>;
  return r * HD + ((c ^ ((r >> S::kLineShift) & S::kSwzMask)) << 3);
}

template <int HD>
__global__ void __launch_bounds__(kAttnThreads, 1) attn_kernel(const AttnParams p) {
  constexpr int kHD = HD;
  constexpr int kRowChunks = AttnShape<HD>::kRowChunks;
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Ks = Qs + kBMq * kHD;         // [2][64][HD]
  uint16_t* Vs = Ks + 2 * kBNk * kHD;     // [2][64][HD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBMq;
  const int h = blockIdx.y, kvh = h / (p.nh / p.nkv);
  const int kv_len = p.P + p.T;
  const int kv_end = min(kv_len, p.P + q0 + kBMq);
  const int ntiles = (kv_end + kBNk - 1) / kBNk;
  const uint16_t* kbase = p.k + size_t(kvh) * p.capacity * kHD;
  const uint16_t* vbase = p.v + size_t(kvh) * p.capacity * kHD;

  for (int idx = tid; idx < kBMq * kRowChunks; idx += kAttnThreads) {
    const int r = idx / kRowChunks, c = idx % kRowChunks;
    const int t = q0 + r;
    const uint16_t* src = t < p.T ? p.q + size_t(t) * p.q_row + size_t(h) * p.q_head + c * 8 : p.q;
    cp_async16(Qs + swz<HD>(r, c), src, t < p.T ? 16 : 0);
  }
  auto load_kv = [&](int tile, int buf) {
    uint16_t* kd = Ks + buf * kBNk * kHD;
    uint16_t* vd = Vs + buf * kBNk * kHD;
    for (int idx = tid; idx < kBNk * kRowChunks; idx += kAttnThreads) {
      const int r = idx / kRowChunks, c = idx % kRowChunks;
      const int pos = tile * kBNk + r;
      const bool ok = pos < kv_len;
      const size_t off = ok ? size_t(pos) * kHD + c * 8 : 0;
      cp_async16(kd + swz<HD>(r, c), kbase + off, ok ? 16 : 0);
      cp_async16(vd + swz<HD>(r, c), vbase + off, ok ? 16 : 0);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  float o[kHD / 8][4];
#pragma unroll
  for (int a = 0; a < kHD / 8; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) o[a][b] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int qpos0 = p.P + q0 + warp * 16 + (lane >> 2);  // rows qpos0 and qpos0 + 8

  for (int j = 0; j < ntiles; ++j) {
    if (j + 1 < ntiles) load_kv(j + 1, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t* kt = Ks + (j & 1) * kBNk * kHD;
    const uint16_t* vt = Vs + (j & 1) * kBNk * kHD;

    float s[8][4];
#pragma unroll
    for (int a = 0; a < 8; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) s[a][b] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHD / 16; ++kk) {
      uint32_t a[4];
      {
        const int r = warp * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
        ldmatrix_x4(a, Qs + swz<HD>(r, c));
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        const int r = np * 16 + (lane & 7) + ((lane >> 4) << 3), c = kk * 2 + ((lane >> 3) & 1);
        uint32_t b[4];
        ldmatrix_x4(b, kt + swz<HD>(r, c));
        mma_bf16(s[2 * np], a, b[0], b[1]);
        mma_bf16(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    // Scale, causal mask, online softmax (base 2).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kpos = j * kBNk + nt * 8 + (lane & 3) * 2 + (e & 1);
        const int qpos = qpos0 + (e >> 1) * 8;
        float v = s[nt][e] * p.scale_log2;
        if (kpos > qpos) v = -INFINITY;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mn = fmaxf(m[r], mx[r]);
      corr[r] = exp2f(m[r] - mn);
      m[r] = mn;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = exp2f(s[nt][e] - m[e >> 1]);
        s[nt][e] = pv;
        l[e >> 1] += pv;
      }
#pragma unroll
    for (int nt = 0; nt < kHD / 8; ++nt) {
      o[nt][0] *= corr[0];
      o[nt][1] *= corr[0];
      o[nt][2] *= corr[1];
      o[nt][3] *= corr[1];
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < kBNk / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < kHD / 16; ++dn) {
        const int r = kk * 16 + (lane & 15), c = dn * 2 + (lane >> 4);
        uint32_t b[4];
        ldmatrix_x4_trans(b, vt + swz<HD>(r, c));
        mma_bf16(o[2 * dn], a, b[0], b[1]);
        mma_bf16(o[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }
  cp_async_wait<0>();

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float t = l[r];
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    inv[r] = 1.f / t;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = q0 + warp * 16 + (lane >> 2) + r * 8;
    if (t >= p.T) continue;
    uint16_t* dst = p.out + size_t(t) * p.out_row + size_t(h) * kHD;
    const uint16_t* gsrc = p.gate ? p.gate + size_t(t) * p.q_row + size_t(h) * p.q_head : nullptr;
#pragma unroll
    for (int nt = 0; nt < kHD / 8; ++nt) {
      const int d = nt * 8 + (lane & 3) * 2;
      float v0 = o[nt][2 * r] * inv[r], v1 = o[nt][2 * r + 1] * inv[r];
      if (gsrc) {
        const uint32_t g2 = *reinterpret_cast<const uint32_t*>(gsrc + d);
        v0 *= p_sigmoid(bf16_lo(g2));
        v1 *= p_sigmoid(bf16_hi(g2));
      }
      *reinterpret_cast<uint32_t*>(dst + d) = pack_bf16x2(v0, v1);
    }
  }
}

template <int HD>
void launch_attn(const AttnParams& p, int T, int nh, cudaStream_t stream) {
  constexpr size_t smem = AttnShape<HD>::kSmem;
  static const bool attr_ok = [] {
    check(cudaFuncSetAttribute(attn_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute(attn_kernel)");
    return true;
  }();
  (void)attr_ok;
  const dim3 grid((T + kBMq - 1) / kBMq, nh);
  attn_kernel<HD><<<grid, kAttnThreads, smem, stream>>>(p);
  check_launch("attn_kernel");
}

}  // namespace

void prefill_attention(const PrefillAttentionArgs& a, cudaStream_t stream) {
  const int hd = a.head_dim;
  if (hd != 32 && hd != 64 && hd != 128 && hd != 256)
    fail("prefill_attention: head_dim must be 32, 64, 128 or 256 (got ", hd, ")");
  if (a.nh <= 0 || a.nkv <= 0 || a.nh % a.nkv != 0)
    fail("prefill_attention: query heads (", a.nh, ") must be a multiple of KV heads (", a.nkv, ")");
  if (a.T <= 0) return;
  if (a.first_position < 0 || a.first_position + a.T > a.capacity)
    fail("prefill_attention: positions [", a.first_position, ", ", a.first_position + a.T,
         ") exceed the cache capacity ", a.capacity);
  if (!a.q || !a.k_cache || !a.v_cache || !a.out) fail("prefill_attention: a required pointer is null");
  auto misaligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(a.q) || misaligned(a.k_cache) || misaligned(a.v_cache) || a.q_row_stride % 8 ||
      a.q_head_stride % 8 || a.out_row_stride % 2 || (a.gate && reinterpret_cast<uintptr_t>(a.gate) % 4))
    fail("prefill_attention: q/k/v must be 16-byte aligned with strides that are multiples of 8");
  AttnParams p{a.q, a.gate, a.q_row_stride, a.q_head_stride, a.k_cache, a.v_cache, a.capacity,
               a.out, a.out_row_stride, a.T, a.first_position, a.nh, a.nkv,
               static_cast<float>(1.0 / std::sqrt(double(hd)) * 1.4426950408889634)};
  switch (hd) {
    case 32: launch_attn<32>(p, a.T, a.nh, stream); break;
    case 64: launch_attn<64>(p, a.T, a.nh, stream); break;
    case 128: launch_attn<128>(p, a.T, a.nh, stream); break;
    default: launch_attn<256>(p, a.T, a.nh, stream); break;
  }
}

}  // namespace lily::cuda

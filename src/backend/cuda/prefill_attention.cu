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
#include <algorithm>
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

// One K/V tile (positions kpos0 .. + kBNk in kt / vt) against a warp's 16
// query rows (rows warp * 16 .. + 15 of Qs; this thread's two rows at
// positions qpos[0] and qpos[1]): S = Q K^T, scale, causal mask, online
// softmax in base 2 (m: running max, l: this thread's partial row sums),
// O += P V. SAFE: a row may see no key in a tile before it has seen one
// (splits starting past it), and keeps m = -inf, l = 0, o = 0 meanwhile
// (without SAFE its first tile must hold a visible key: key 0).
template <int HD, bool SAFE>
__device__ __forceinline__ void attn_tile(const uint16_t* Qs, const uint16_t* kt, const uint16_t* vt, int warp,
                                          int lane, int kpos0, const int (&qpos)[2], float scale_log2,
                                          float (&o)[HD / 8][4], float (&m)[2], float (&l)[2]) {
  constexpr int kHD = HD;
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
      const int kpos = kpos0 + nt * 8 + (lane & 3) * 2 + (e & 1);
      float v = s[nt][e] * scale_log2;
      if (kpos > qpos[e >> 1]) v = -INFINITY;
      s[nt][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  float corr[2], mref[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r]);
    mref[r] = SAFE && mn == -INFINITY ? 0.f : mn;  // no key visible yet: every weight 0, not NaN
    corr[r] = exp2f(m[r] - mref[r]);
    m[r] = mn;
    l[r] *= corr[r];
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pv = exp2f(s[nt][e] - mref[e >> 1]);
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
}

// Streams K/V tile `tile` (kBNk positions, zeros past kv_len) of one KV
// head into buffer `buf` of the double buffer (all threads).
template <int HD>
__device__ __forceinline__ void attn_load_kv(uint16_t* Ks, uint16_t* Vs, const uint16_t* kbase,
                                             const uint16_t* vbase, int tile, int buf, int kv_len, int tid) {
  constexpr int kRowChunks = AttnShape<HD>::kRowChunks;
  uint16_t* kd = Ks + buf * kBNk * HD;
  uint16_t* vd = Vs + buf * kBNk * HD;
  for (int idx = tid; idx < kBNk * kRowChunks; idx += kAttnThreads) {
    const int r = idx / kRowChunks, c = idx % kRowChunks;
    const int pos = tile * kBNk + r;
    const bool ok = pos < kv_len;
    const size_t off = ok ? size_t(pos) * HD + c * 8 : 0;
    cp_async16(kd + swz<HD>(r, c), kbase + off, ok ? 16 : 0);
    cp_async16(vd + swz<HD>(r, c), vbase + off, ok ? 16 : 0);
  }
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
  attn_load_kv<HD>(Ks, Vs, kbase, vbase, 0, 0, kv_len, tid);
  cp_async_commit();

  float o[kHD / 8][4];
#pragma unroll
  for (int a = 0; a < kHD / 8; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) o[a][b] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int qpos0 = p.P + q0 + warp * 16 + (lane >> 2);  // rows qpos0 and qpos0 + 8
  const int qpos[2] = {qpos0, qpos0 + 8};

  for (int j = 0; j < ntiles; ++j) {
    if (j + 1 < ntiles) attn_load_kv<HD>(Ks, Vs, kbase, vbase, j + 1, (j + 1) & 1, kv_len, tid);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    attn_tile<HD, false>(Qs, Ks + (j & 1) * kBNk * kHD, Vs + (j & 1) * kBNk * kHD, warp, lane, j * kBNk, qpos,
                  p.scale_log2, o, m, l);
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }
  cp_async_wait<0>();

  float inv[2];
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

// The most key-range splits of a split-form launch (over all row blocks).
constexpr int kMaxSplits = 64;

// ---- Few queries over a long context: split over the keys ---------------------
// For T x G <= 512 query rows (G query heads per KV head), one block takes
// 128 of them for one KV head, rows R = t G + (head within the group), and
// one range of key tiles (a split): each K/V row is read once per KV head
// and row block instead of once per query head, and the context is spread
// over splits x nkv x row blocks instead of walked by nh blocks. Each block writes its
// rows' unnormalised o with their (max, sum) in base 2; the combine kernel
// merges the splits, divides, applies the gate and rounds to bf16.
struct AttnSplitParams {
  AttnParams a;
  float* part_o;   // [T nh][splits][HD]
  float* part_ml;  // [T nh][splits][2]
  int splits, tiles_per_split, group;
  // A q8 cache read in place (kv_type.h; a.k / a.v unused): codes [nkv][cap][HD], scales [nkv][scale_stride].
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int scale_stride = 0;
  // f32 rows at a.out's strides instead of bf16 (PrefillAttentionArgs::out_f32)
  float* out_f32 = nullptr;
};

// A q8 K/V tile into bf16 shared rows (synchronous: loads, (u - 128) s
// rounded to bf16 as kv_q8_expand does, 16-byte stores), zeros past kv_len.
template <int HD>
__device__ __forceinline__ void attn_load_kv_q8(uint16_t* kd, uint16_t* vd, const AttnSplitParams& sp, int kvh,
                                                int tile, int kv_len, int tid) {
  constexpr int kPieces = HD / 16;  // 16 codes a piece
  for (int idx = tid; idx < kBNk * kPieces; idx += kAttnThreads) {
    const int r = idx / kPieces, c = idx % kPieces;
    const int pos = tile * kBNk + r;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      uint4 out[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (pos < kv_len) {
        const size_t row = size_t(kvh) * sp.a.capacity + pos;
        const uint4 q = *reinterpret_cast<const uint4*>((kv ? sp.v8 : sp.k8) + row * HD + c * 16);
        const float sc = (kv ? sp.v_scale : sp.k_scale)[size_t(kvh) * sp.scale_stride + pos];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
        uint32_t* o32 = reinterpret_cast<uint32_t*>(out);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t word = w[i >> 1] >> (16 * (i & 1));
          o32[i] = pack_bf16x2((float(word & 0xFFu) - 128.f) * sc, (float((word >> 8) & 0xFFu) - 128.f) * sc);
        }
      }
      uint16_t* dst = kv ? vd : kd;
      *reinterpret_cast<uint4*>(dst + swz<HD>(r, 2 * c)) = out[0];
      *reinterpret_cast<uint4*>(dst + swz<HD>(r, 2 * c + 1)) = out[1];
    }
  }
}

template <int HD, bool Q8>
__global__ void __launch_bounds__(kAttnThreads, 1) attn_split_kernel(const AttnSplitParams sp) {
  pdl_wait();
  pdl_launch_dependents();
  constexpr int kHD = HD;
  constexpr int kRowChunks = AttnShape<HD>::kRowChunks;
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Ks = Qs + kBMq * kHD;
  uint16_t* Vs = Ks + 2 * kBNk * kHD;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, kvh = blockIdx.y, G = sp.group;
  const int T = sp.a.T, P = sp.a.P, nh = sp.a.nh;
  const int R0 = blockIdx.z * kBMq, rows = min(kBMq, T * G - R0);  // this block's rows R0 + r
  const int kv_len = P + T;
  const int j0 = split * sp.tiles_per_split;
  const int j1 = min(j0 + sp.tiles_per_split, (kv_len + kBNk - 1) / kBNk);
  const uint16_t* kbase = Q8 ? nullptr : sp.a.k + size_t(kvh) * sp.a.capacity * kHD;
  const uint16_t* vbase = Q8 ? nullptr : sp.a.v + size_t(kvh) * sp.a.capacity * kHD;

  for (int idx = tid; idx < kBMq * kRowChunks; idx += kAttnThreads) {
    const int r = idx / kRowChunks, c = idx % kRowChunks;
    const int t = (R0 + r) / G, h = kvh * G + (R0 + r) % G;
    const bool ok = r < rows;
    const uint16_t* src = ok ? sp.a.q + size_t(t) * sp.a.q_row + size_t(h) * sp.a.q_head + c * 8 : sp.a.q;
    cp_async16(Qs + swz<HD>(r, c), src, ok ? 16 : 0);
  }
  if (!Q8 && j0 < j1) attn_load_kv<HD>(Ks, Vs, kbase, vbase, j0, 0, kv_len, tid);
  cp_async_commit();

  float o[kHD / 8][4];
#pragma unroll
  for (int a = 0; a < kHD / 8; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) o[a][b] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int r0 = warp * 16 + (lane >> 2);
  // Rows past T G compute as the last query (finite, not stored).
  const int qpos[2] = {P + min((R0 + r0) / G, T - 1), P + min((R0 + r0 + 8) / G, T - 1)};
  const bool active = warp * 16 < rows;  // warp-uniform

  for (int j = j0; j < j1; ++j) {
    const int b = Q8 ? 0 : (j - j0) & 1;
    if constexpr (Q8) {
      attn_load_kv_q8<HD>(Ks, Vs, sp, kvh, j, kv_len, tid);
      if (j == j0) cp_async_wait<0>();  // the Q tile
    } else {
      if (j + 1 < j1) attn_load_kv<HD>(Ks, Vs, kbase, vbase, j + 1, b ^ 1, kv_len, tid);
      cp_async_commit();
      cp_async_wait<1>();
    }
    __syncthreads();
    if (active)
      attn_tile<HD, true>(Qs, Ks + b * kBNk * kHD, Vs + b * kBNk * kHD, warp, lane, j * kBNk, qpos, sp.a.scale_log2, o,
                    m, l);
    __syncthreads();
  }
  cp_async_wait<0>();
  if (!active) return;

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float t = l[r];
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    l[r] = t;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 8 * r;
    if (row >= rows) continue;
    const int R = R0 + row;
    const size_t q = (size_t(R / G) * nh + kvh * G + R % G) * sp.splits + split;  // (t nh + h) splits + split
    if ((lane & 3) == 0) *reinterpret_cast<float2*>(sp.part_ml + 2 * q) = make_float2(m[r], l[r]);
    float* dst = sp.part_o + q * kHD;
#pragma unroll
    for (int nt = 0; nt < kHD / 8; ++nt) {
      const int d = nt * 8 + (lane & 3) * 2;
      *reinterpret_cast<float2*>(dst + d) = make_float2(o[nt][2 * r], o[nt][2 * r + 1]);
    }
  }
}

// One block per (query, head), one thread per dim: the splits merged.
__global__ void attn_split_combine_kernel(const AttnSplitParams sp, int hd) {
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x, d = threadIdx.x;  // row = t nh + h
  const int t = row / sp.a.nh, h = row % sp.a.nh, S = sp.splits;
  // The splits' (max, sum) pairs through shared memory (one load each, not
  // two chains of S dependent loads per thread), then the o column in
  // batches of loads in flight; the sums in split order as before.
  __shared__ float ml[2 * kMaxSplits];
  const float* gml = sp.part_ml + size_t(row) * S * 2;
  for (int i = d; i < 2 * S; i += blockDim.x) ml[i] = gml[i];
  __syncthreads();
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
  float L = 0.f, O = 0.f;
  const float* po = sp.part_o + size_t(row) * S * hd + d;
#pragma unroll 8
  for (int s = 0; s < S; ++s) {
    const float w = ml[2 * s] == -INFINITY ? 0.f : exp2f(ml[2 * s] - M);
    L += w * ml[2 * s + 1];
    O += w * po[size_t(s) * hd];
  }
  float v = O / L;
  if (sp.a.gate) v *= p_sigmoid(__uint_as_float(uint32_t(sp.a.gate[size_t(t) * sp.a.q_row + size_t(h) * sp.a.q_head + d]) << 16));
  const size_t at = size_t(t) * sp.a.out_row + size_t(h) * hd + d;
  if (sp.out_f32) sp.out_f32[at] = v;
  else sp.a.out[at] = f32_to_bf16_bits(v);
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

template <int HD, bool Q8>
void launch_attn_split_t(const AttnSplitParams& sp, cudaStream_t stream) {
  constexpr size_t smem = AttnShape<HD>::kSmem;
  static const bool attr_ok = [] {
    check(cudaFuncSetAttribute(attn_split_kernel<HD, Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute(attn_split_kernel)");
    return true;
  }();
  (void)attr_ok;
  const int row_blocks = (sp.a.T * sp.group + kBMq - 1) / kBMq;
  const bool pdl = prefill_pdl(sp.a.T);
  launch_kernel("attn_split_kernel", attn_split_kernel<HD, Q8>, dim3(sp.splits, sp.a.nkv, row_blocks),
                dim3(kAttnThreads), smem, stream, pdl, sp);
  launch_kernel("attn_split_combine_kernel", attn_split_combine_kernel, dim3(sp.a.T * sp.a.nh), dim3(HD), 0, stream,
                pdl, sp, HD);
}
template <int HD>
void launch_attn_split(const AttnSplitParams& sp, cudaStream_t stream) {
  if (sp.k8) launch_attn_split_t<HD, true>(sp, stream);
  else launch_attn_split_t<HD, false>(sp, stream);
}

// Up to kMaxRowBlocks blocks of 128 query rows per KV head, each over up to
// kMaxSplits / row blocks key-tile ranges, about one block per SM.
constexpr int kMaxRowBlocks = 4;

struct SplitPlan {
  int splits = 0, tiles_per_split = 0;
};
SplitPlan split_plan(int T, int P, int nh, int nkv) {
  SplitPlan sp;
  if (T <= 0 || nkv <= 0 || nh % nkv != 0 || T * (nh / nkv) > kMaxRowBlocks * kBMq) return sp;
  const int row_blocks = (T * (nh / nkv) + kBMq - 1) / kBMq;
  const int tiles = (P + T + kBNk - 1) / kBNk;
  const int want = std::max(1, std::min({tiles, kMaxSplits / row_blocks, sm_count() / (nkv * row_blocks)}));
  sp.tiles_per_split = (tiles + want - 1) / want;
  sp.splits = (tiles + sp.tiles_per_split - 1) / sp.tiles_per_split;
  return sp;
}

}  // namespace

size_t prefill_attention_workspace_bytes(int nh, int nkv, int head_dim) {
  if (nkv <= 0 || nh % nkv != 0) return 0;
  // T nh <= row blocks x 128 nkv rows, each with its splits' o and (max,
  // sum), splits <= kMaxSplits / row blocks.
  return size_t(kBMq) * nkv * kMaxSplits * (size_t(head_dim) + 2) * sizeof(float);
}

namespace {
// The split form's plan for these arguments where their workspace holds it
// (else splits == 0: the whole-context kernel).
SplitPlan usable_plan(const PrefillAttentionArgs& a) {
  if (!a.workspace) return {};
  const SplitPlan plan = split_plan(a.T, a.first_position, a.nh, a.nkv);
  const size_t need = size_t(a.T) * a.nh * plan.splits * (size_t(a.head_dim) + 2) * sizeof(float);
  return need <= a.workspace_bytes ? plan : SplitPlan{};
}
}  // namespace

int prefill_attention_splits(const PrefillAttentionArgs& a) { return usable_plan(a).splits; }

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
  const bool q8 = a.k_q8 != nullptr;
  const bool kv_ok = q8 ? a.v_q8 && a.k_scale && a.v_scale && a.scale_stride >= a.capacity
                        : a.k_cache && a.v_cache;
  if (!a.q || (!a.out && !a.out_f32) || !kv_ok)
    fail("prefill_attention: a required pointer is null");
  const SplitPlan plan = usable_plan(a);
  if (a.out_f32 && plan.splits == 0)
    fail("prefill_attention: f32 output rows are written only by the split form (", a.T,
         " queries, workspace of ", a.workspace_bytes, " bytes)");
  if (q8 && plan.splits == 0)
    fail("prefill_attention: a q8 cache is read in place only by the split form (", a.T, " queries, workspace of ",
         a.workspace_bytes, " bytes)");
  auto misaligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(a.q) || misaligned(q8 ? static_cast<const void*>(a.k_q8) : a.k_cache) ||
      misaligned(q8 ? static_cast<const void*>(a.v_q8) : a.v_cache) || a.q_row_stride % 8 ||
      a.q_head_stride % 8 || a.out_row_stride % 2 || (a.gate && reinterpret_cast<uintptr_t>(a.gate) % 4))
    fail("prefill_attention: q/k/v must be 16-byte aligned with strides that are multiples of 8");
  AttnParams p{a.q, a.gate, a.q_row_stride, a.q_head_stride, a.k_cache, a.v_cache, a.capacity,
               a.out, a.out_row_stride, a.T, a.first_position, a.nh, a.nkv,
               static_cast<float>(1.0 / std::sqrt(double(hd)) * 1.4426950408889634)};
  if (plan.splits > 0) {
    AttnSplitParams sp{p, static_cast<float*>(a.workspace), nullptr, plan.splits, plan.tiles_per_split,
                       a.nh / a.nkv};
    sp.part_ml = sp.part_o + size_t(a.T) * a.nh * plan.splits * hd;
    sp.k8 = a.k_q8;
    sp.v8 = a.v_q8;
    sp.k_scale = a.k_scale;
    sp.v_scale = a.v_scale;
    sp.scale_stride = a.scale_stride;
    sp.out_f32 = a.out_f32;
    switch (hd) {
      case 32: launch_attn_split<32>(sp, stream); break;
      case 64: launch_attn_split<64>(sp, stream); break;
      case 128: launch_attn_split<128>(sp, stream); break;
      default: launch_attn_split<256>(sp, stream); break;
    }
    return;
  }
  switch (hd) {
    case 32: launch_attn<32>(p, a.T, a.nh, stream); break;
    case 64: launch_attn<64>(p, a.T, a.nh, stream); break;
    case 128: launch_attn<128>(p, a.T, a.nh, stream); break;
    default: launch_attn<256>(p, a.T, a.nh, stream); break;
  }
}

}  // namespace lily::cuda

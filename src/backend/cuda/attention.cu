// Gated full attention, decode: flash-decoding over the KV cache.
//
// Block (context split, KV head, group of <= 8 query heads): all query heads
// that share the KV head are handled together, so each cached K/V row is read
// once per step. A bf16 or q8 cache with head_dim 64 / 128 / 256 runs on
// tensor cores (attention_tc_loop below; bf16 at 128K 1.07x the step of the
// CUDA-core loop, which stays for f32 caches, head_dim 32 and
// LILY_CUDA_ATTN_TC=0; q8 scores on s8 x u8 mma, tc_step_q8).
// The CUDA-core loop: lanes split head_dim; a warp takes 4 positions at a time,
// reduces the 4 x 8 partial dot products with a reduce-scatter across the
// lanes (31 shuffles for 32 sums), keeps an online softmax per head and
// accumulates P V in registers. The 4 warps merge in shared memory and the
// block writes (max, sum, o) per head; the combine kernel merges the splits
// and applies the output gate. The split length is derived from the position
// in device memory, so one captured launch serves every context length.
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kAttnPos = 4;    // positions per warp step
constexpr int kAttnHeads = 8;  // query heads per block (kAttnPos * kAttnHeads == 32)
constexpr int kCombineThreads = 32;  // dims per combine block
constexpr int kCombineGroups = 8;    // split groups per combine block

__host__ __device__ inline int split_len(int n, int max_splits, int min_split) {
  int per = (n + max_splits - 1) / max_splits;
  per = (per + 31) / 32 * 32;
  return per < min_split ? min_split : per;
}

template <int DPL, KvType KT>
struct KvRow {
  static constexpr bool BF = KT == KvType::BF16, Q8 = KT == KvType::Q8;
  static constexpr int W = Q8 ? (DPL + 3) / 4 : BF ? (DPL >= 2 ? DPL / 2 : 1) : DPL;
  uint32_t r[W];
  float s;  // q8: the row's scale
  __device__ __forceinline__ void load(const void* base, size_t elem, const float* scale) {
    if constexpr (Q8) {
      const uint8_t* p = static_cast<const uint8_t*>(base) + elem;
      s = *scale;
      if constexpr (DPL == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        r[0] = v.x; r[1] = v.y;
      } else if constexpr (DPL == 4) {
        r[0] = *reinterpret_cast<const uint32_t*>(p);
      } else if constexpr (DPL == 2) {
        r[0] = *reinterpret_cast<const uint16_t*>(p);
      } else {
        r[0] = *p;
      }
    } else if constexpr (BF) {
      const uint16_t* p = static_cast<const uint16_t*>(base) + elem;
      if constexpr (DPL == 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
      } else if constexpr (DPL == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        r[0] = v.x; r[1] = v.y;
      } else if constexpr (DPL == 2) {
        r[0] = *reinterpret_cast<const uint32_t*>(p);
      } else {
        r[0] = *p;
      }
    } else {
      const uint32_t* p = static_cast<const uint32_t*>(base) + elem;
      if constexpr (DPL == 8) {
        const uint4 a = *reinterpret_cast<const uint4*>(p), b = *reinterpret_cast<const uint4*>(p + 4);
        r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w; r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
      } else if constexpr (DPL == 4) {
        const uint4 a = *reinterpret_cast<const uint4*>(p);
        r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
      } else if constexpr (DPL == 2) {
        const uint2 a = *reinterpret_cast<const uint2*>(p);
        r[0] = a.x; r[1] = a.y;
      } else {
        r[0] = *p;
      }
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < W; ++i) r[i] = Q8 ? 0x80808080u : 0u;
    s = 0.f;
  }
  __device__ __forceinline__ float get(int d) const {
    if constexpr (Q8) {
      return (static_cast<float>((r[d >> 2] >> (8 * (d & 3))) & 0xFFu) - 128.f) * s;
    } else if constexpr (BF) {
      if constexpr (DPL == 1) return __uint_as_float(r[0] << 16);
      else return (d & 1) ? __uint_as_float(r[d >> 1] & 0xFFFF0000u) : __uint_as_float(r[d >> 1] << 16);
    } else {
      return __uint_as_float(r[d]);
    }
  }
};

// One level of the reduce-scatter: lanes that differ in bit O swap halves.
template <int O>
__device__ __forceinline__ void reduce_scatter_step(float (&part)[32], int lane) {
  const bool up = (lane & O) != 0;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = up ? part[i] : part[i + O];
    const float keep = up ? part[i + O] : part[i];
    part[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}

__device__ __forceinline__ uint16_t to_bf16_bits(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}

// ---- Tensor-core main loop (bf16 cache, head_dim a multiple of 64) ----------
//
// A warp takes 8 positions per step. K and V rows reach shared memory through
// a per-warp ring of kTcStages steps (cp.async, 16-byte pieces XOR-swizzled
// by row so ldmatrix reads are conflict-free) and come out as mma operands
// through ldmatrix. Scores: one m16n8k16 mma per 16 dims, S = A K^T with A's
// rows 0-7 the 8 query heads rounded to bf16 and rows 8-15 their remainders
// (q - bf16(q), also bf16), so c0 + c2 is the score with ~16 bits of q and K
// exact. Then O^T = V^T P^T, one m16n8k16 per 16 dims whose k = 16 is the
// step's 8 positions twice, against bf16(p) and against p - bf16(p) (the same
// V operands), so P keeps ~16 bits too: f32-level agreement with the CPU. The
// score fragment (head g = lane / 4, positions 2t, 2t + 1 with t = lane % 4)
// is exactly P^T's operand; V^T's come from ldmatrix.trans.
constexpr int kTcStages = 3;
using prefill_detail::cp_async16;
using prefill_detail::cp_async_commit;
using prefill_detail::cp_async_wait;
using prefill_detail::ldmatrix_x4;
using prefill_detail::ldmatrix_x4_trans;
using prefill_detail::mma_bf16;
using prefill_detail::mma_f16;
using prefill_detail::mma_s8u8;
using prefill_detail::pack_bf16x2;

// Floats of shared memory per block: the K / V ring (whose first
// kAttnWarps * 8 * HD floats hold the merge after the loop), the staged
// queries (f32, then their fragments in place), the new K row, then the
// (max, sum) pairs and the merge's scratch. The ring does not overlap what
// the prologue uses: its first steps are requested before the wait.
// Bytes of one ring slot (8 positions): K and V in bf16, or q8 codes and
// their 8 + 8 scales.
template <int HD, KvType KT>
constexpr int tc_slot_bytes() { return KT == KvType::Q8 ? 16 * HD + 64 : 32 * HD; }
// The ring is as large for a q8 cache as for a bf16 one although its slots
// are half as big: with a smaller footprint the pre-launched blocks pile up
// three to an SM on the SMs that free up first (v17: -4% at 128K).
template <int HD, KvType KT>
struct TcSmem {
  static constexpr int ring = 0;                                   // [warp][stage] slots
  static constexpr int ring_floats = kAttnWarps * kTcStages * tc_slot_bytes<HD, KvType::BF16>() / 4;
  static constexpr int qbuf = ring + ring_floats;                  // qs [8][HD], then qf [HD / 16][32] uint4
  static constexpr int knorm = qbuf + 8 * HD;                      // [HD]
  static constexpr int rope = knorm + HD;                          // [HD]: cos, sin of the position
  static constexpr int qint = rope + HD;                           // q8: [8 heads][4] (build_q_codes)
  static constexpr int mml = qint + 32;                            // [warps][8][2], then pw and aw
  static constexpr int total = mml + kAttnWarps * kAttnHeads * 2 + kAttnWarps * 32 + kAttnWarps * kAttnHeads;
  static_assert(ring_floats >= kAttnWarps * kAttnHeads * HD, "the merge fits in the ring");
  static_assert(tc_slot_bytes<HD, KT>() <= tc_slot_bytes<HD, KvType::BF16>(), "the ring holds kTcStages slots");
};

// (hi, lo) of two floats: hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2(x0, x1);
  lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xFFFF0000u));
}

// (hi, lo) of two floats in f16 (the q8 loop's P operand).
__device__ __forceinline__ void split_f16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const __half2 l = __floats2half2_rn(x0 - __low2float(h), x1 - __high2float(h));
  memcpy(&hi, &h, 4);
  memcpy(&lo, &l, 4);
}
// Fragments qf[0 .. NF) made by make(idx) from the staged queries and
// written over them (every thread reads first, then a barrier).
template <int NF, int NT, typename Make>
__device__ __forceinline__ void build_frags(uint4* qf, int tid, Make make) {
  constexpr int NE = (NF + NT - 1) / NT;
  uint4 f[NE];
#pragma unroll
  for (int u = 0; u < NE; ++u)
    if (tid + u * NT < NF) f[u] = make(tid + u * NT);
  __syncthreads();
#pragma unroll
  for (int u = 0; u < NE; ++u)
    if (tid + u * NT < NF) qf[tid + u * NT] = f[u];
}
// The queries' A fragments of every k-step j (dims 16j ..), qf[j * 32 + lane] =
// {hi (dims 2t, 2t + 1), lo (same), hi (dims 2t + 8, 2t + 9), lo (same)} of
// head g, written over the staged queries qs.
template <int HD>
__device__ __forceinline__ void build_q_frags(const float* qs, uint4* qf, int tid) {
  build_frags<(HD / 16) * 32, kAttnThreads>(qf, tid, [&](int idx) {
    const int j = idx >> 5, lane = idx & 31, g = lane >> 2, t = lane & 3;
    const float* q = qs + g * HD + 16 * j + 2 * t;
    uint4 v;
    split_bf16(q[0], q[1], v.x, v.y);
    split_bf16(q[8], q[9], v.z, v.w);
    return v;
  });
}

// Rows b .. b + 7 of K and V into ring slot `dst` ([K, V][8][HD] bf16); rows
// at or past p1 are zero-filled. Piece c (16 bytes) of row r sits at c ^ r.
template <int HD>
__device__ __forceinline__ void tc_issue(uint16_t* dst, const uint16_t* kc, const uint16_t* vc, int b, int p1,
                                         int lane) {
  constexpr int PR = HD / 8;  // pieces per row
#pragma unroll
  for (int k = 0; k < HD / 32; ++k) {
    const int c = lane + 32 * k, r = c / PR, col = c % PR;
    const int row = b + r;
    const int ok = row < p1 ? 16 : 0;
    const size_t src = size_t(ok ? row : b) * HD + col * 8;
    const int off = r * HD + ((col ^ r) * 8);
    cp_async16(dst + off, kc + src, ok);
    cp_async16(dst + 8 * HD + off, vc + src, ok);
  }
}

template <int HD>
struct TcState {
  float acc[HD / 16][4];  // O^T tiles m: [dim 16m + g][head 2t, 2t + 1], [dim 16m + 8 + g][...]
  float m, l;             // head g: running max, this lane's share of the sum
};
// The online softmax of one step: the scores s0, s1 of positions 2t, 2t + 1
// for head g (lane = 4g + t) update the running max and sum, rescale the
// output tiles, and give the step's exp(s - max).
template <int HD>
__device__ __forceinline__ void tc_online_softmax(TcState<HD>& st, float s0, float s1, int t, float& e0, float& e1) {
  float mx = fmaxf(s0, s1);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // Every head has position b (t = 0), so mx and m_new are finite.
  const float m_new = fmaxf(st.m, mx);
  const float alpha = expf(st.m - m_new);  // 0 on the first step (m = -inf)
  e0 = expf(s0 - m_new);
  e1 = expf(s1 - m_new);
  st.l = fmaf(st.l, alpha, e0 + e1);
  st.m = m_new;
  if (__any_sync(0xffffffffu, alpha != 1.f)) {
    const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * t), a_hi = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
    for (int m = 0; m < HD / 16; ++m) {
      st.acc[m][0] *= a_lo;
      st.acc[m][1] *= a_hi;
      st.acc[m][2] *= a_lo;
      st.acc[m][3] *= a_hi;
    }
  }
}

template <int HD>
__device__ __forceinline__ void tc_step(TcState<HD>& st, const uint16_t* kt, const uint4* qf, int b, int p1,
                                        float scale, int lane) {
  const int t = lane & 3, q = lane >> 3, r = lane & 7;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < HD / 16; j += 2) {
    uint32_t kb[4];  // B operands of k-steps j and j + 1
    ldmatrix_x4(kb, kt + r * HD + (((2 * j + q) ^ r) * 8));
    const uint4 a0 = qf[j * 32 + lane], a1 = qf[(j + 1) * 32 + lane];
    const uint32_t fa0[4] = {a0.x, a0.y, a0.z, a0.w}, fa1[4] = {a1.x, a1.y, a1.z, a1.w};
    mma_bf16(c, fa0, kb[0], kb[1]);
    mma_bf16(c, fa1, kb[2], kb[3]);
  }
  const int pa = b + 2 * t;
  const float s0 = pa < p1 ? (c[0] + c[2]) * scale : -INFINITY;
  const float s1 = pa + 1 < p1 ? (c[1] + c[3]) * scale : -INFINITY;
  float e0, e1;
  tc_online_softmax(st, s0, s1, t, e0, e1);
  uint32_t phi, plo;
  split_bf16(e0, e1, phi, plo);
  const uint16_t* vt = kt + 8 * HD;
#pragma unroll
  for (int m = 0; m < HD / 16; m += 2) {
    uint32_t va[4];  // A operands (rows: dims) of m-tiles m and m + 1
    ldmatrix_x4_trans(va, vt + r * HD + (((2 * m + q) ^ r) * 8));
    const uint32_t f0[4] = {va[0], va[1], va[0], va[1]}, f1[4] = {va[2], va[3], va[2], va[3]};
    mma_bf16(st.acc[m], f0, phi, plo);
    mma_bf16(st.acc[m + 1], f1, phi, plo);
  }
}

// ---- the q8 cache on tensor cores ---------------------------------------------
// A slot holds [K 8][HD] code bytes, [V 8][HD], then the 8 K scales and the 8 V
// scales (f32). Rows are 16-byte pieces, piece c of row r at c ^ ((r >> LS) & M)
// (rows of HD bytes: at HD = 64 two rows share a 128-byte line, LS = 1), so the
// 8 rows an ldmatrix phase reads hit distinct bank groups.
template <int HD>
struct Q8Tile {
  static constexpr int PR = HD / 16;
  static constexpr int M = (PR < 8 ? PR : 8) - 1;
  static constexpr int LS = PR >= 8 ? 0 : (PR == 4 ? 1 : 2);
  static constexpr int kv = 8 * HD;      // bytes of one matrix
  static constexpr int scales = 16 * HD;  // byte offset of the K scales
  __device__ static __forceinline__ int off(int r, int c) { return r * HD + ((c ^ ((r >> LS) & M)) << 4); }
};

// Two offset-binary code bytes of w (selected by sel) as an f16x2 of the
// codes: bytes under 0x64 read 1024 + u, minus 1152 exactly.
__device__ __forceinline__ uint32_t q8_pair_f16(uint32_t w, uint32_t sel) {
  const uint32_t h = __byte_perm(w, 0x64646464u, sel);
  __half2 x;
  memcpy(&x, &h, 4);
  x = __hsub2(x, __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
  uint32_t r;
  memcpy(&r, &x, 4);
  return r;
}

// A query's 16-bit code under inv = 32512 / max |q| of its head.
__device__ __forceinline__ int q_code16(float x, float inv) {
  return max(-32512, min(32512, __float2int_rn(x * inv)));
}
// Four codes' s8 parts (code = 256 hi + lo), packed by k order.
__device__ __forceinline__ void pack_q_parts(const float* q, float inv, uint32_t& hi, uint32_t& lo) {
  hi = lo = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = q_code16(q[i], inv), h = (c + 128) >> 8, l = c - 256 * h;
    hi |= (static_cast<uint32_t>(h) & 0xFFu) << (8 * i);
    lo |= (static_cast<uint32_t>(l) & 0xFFu) << (8 * i);
  }
}
// For the q8 cache the scores run on s8 x u8 mma: the queries as 16-bit
// codes per head (rn(q * 32512 / max |q|), 15 bits under the head's largest,
// as v16's matvec inputs), in two s8 parts, the A operand of m16n8k32:
// qf[J * 32 + lane] = {hi (dims 32J + 4t .. + 3), lo (same), hi (dims 32J +
// 16 + 4t .. + 3), lo (same)} of head g; qi[4g ..] = {max / 32512, 32512 /
// max, 128 sum hi, 128 sum lo} (the K codes are offset binary: each product
// carries 128 q). Written over the staged queries (read first, then a barrier).
template <int HD, int NT>
__device__ __forceinline__ void build_q_codes(const float* qs, uint4* qf, float* qi, int tid) {
  constexpr int NW = NT / 32, DPL = HD / 32;
  const int lane = tid & 31, warp = tid >> 5;
  for (int g = warp; g < kAttnHeads; g += NW) {
    float m = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) m = fmaxf(m, fabsf(qs[g * HD + lane + 32 * d]));
    m = warp_max(m);
    const float inv = m > 0.f ? __fdiv_rn(32512.f, m) : 0.f;
    int shi = 0, slo = 0;
#pragma unroll
    for (int d = 0; d < DPL; ++d) {
      const int c = q_code16(qs[g * HD + lane + 32 * d], inv), h = (c + 128) >> 8;
      shi += h;
      slo += c - 256 * h;
    }
    shi = __reduce_add_sync(0xffffffffu, shi);
    slo = __reduce_add_sync(0xffffffffu, slo);
    if (lane == 0) {
      qi[4 * g] = m / 32512.f;
      qi[4 * g + 1] = inv;
      qi[4 * g + 2] = __int_as_float(128 * shi);
      qi[4 * g + 3] = __int_as_float(128 * slo);
    }
  }
  __syncthreads();
  build_frags<(HD / 32) * 32, NT>(qf, tid, [&](int idx) {
    const int J = idx >> 5, l = idx & 31, g = l >> 2, t = l & 3;
    const float inv = qi[4 * g + 1];
    const float* q = qs + g * HD + 32 * J + 4 * t;
    uint4 v;
    pack_q_parts(q, inv, v.x, v.y);
    pack_q_parts(q + 16, inv, v.z, v.w);
    return v;
  });
}
// Head g's query constants for the q8 scores (from build_q_codes).
struct QInt {
  float step;  // max |q| / 32512
  int hs, ls;  // 128 sum hi, 128 sum lo
};

// Rows b .. b + 7 of K and V and their scales into a slot; rows at or past p1
// are zero-filled (their scales: whole 4-row pieces past p1; the rest of a
// piece is masked by the step).
template <int HD>
__device__ __forceinline__ void tc_issue_q8(uint8_t* dst, const uint8_t* kc, const uint8_t* vc, const float* ks,
                                            const float* vs, int b, int p1, int lane) {
  using T = Q8Tile<HD>;
#pragma unroll
  for (int k = 0; k < HD / 64; ++k) {
    const int c = lane + 32 * k, r = c / T::PR, col = c % T::PR;
    const int row = b + r;
    const int ok = row < p1 ? 16 : 0;
    const size_t src = size_t(ok ? row : b) * HD + col * 16;
    const int off = T::off(r, col);
    cp_async16(dst + off, kc + src, ok);
    cp_async16(dst + T::kv + off, vc + src, ok);
  }
  if (lane < 4) {
    const int half = lane & 1, row = b + 4 * half;
    cp_async16(dst + T::scales + 16 * lane, ((lane & 2) ? vs : ks) + (row < p1 ? row : b), row < p1 ? 16 : 0);
  }
}

// One step of 8 positions from a q8 slot. Scores: s8 x u8 mma on the codes
// (below), exact in s32, then the query's and the row's scales. P V: one
// ldmatrix.trans 8x8 (b16) of V codes gives lane (g, t) dims 2g and 2g + 1
// of positions 2t, 2t + 1, taken to f16 (q8_pair_f16): the A operand of one
// f16 mma whose rows are dims 2g (rows 0-7) and 2g + 1 (rows 8-15); P
// carries the V scales.
template <int HD>
__device__ __forceinline__ void tc_step_q8(TcState<HD>& st, const uint8_t* slot, const uint4* qf, const QInt& qi,
                                           int b, int p1, float scale, int lane) {
  using T = Q8Tile<HD>;
  const int t = lane & 3, mi = lane >> 3, r = lane & 7;
  // Scores: an ldmatrix of the K codes gives lane (g, t) bytes 4t .. 4t + 3
  // of position g in each 16-dim piece, the u8 B operand of m16n8k32 as it
  // is (two pieces per mma); rows 0-7 of A are the queries' hi parts, 8-15
  // their lo parts.
  int c[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < HD / 16; j += 4) {
    uint32_t kb[4];
    ldmatrix_x4(kb, slot + T::off(r, j + mi));
    mma_s8u8(c, qf[(j / 2) * 32 + lane], kb[0], kb[1]);
    mma_s8u8(c, qf[(j / 2 + 1) * 32 + lane], kb[2], kb[3]);
  }
  const float* sc = reinterpret_cast<const float*>(slot + T::scales);
  const float2 sk = *reinterpret_cast<const float2*>(sc + 2 * t);
  const float2 sv = *reinterpret_cast<const float2*>(sc + 8 + 2 * t);
  const int pa = b + 2 * t;
  const float d0 = 256.f * static_cast<float>(c[0] - qi.hs) + static_cast<float>(c[2] - qi.ls);
  const float d1 = 256.f * static_cast<float>(c[1] - qi.hs) + static_cast<float>(c[3] - qi.ls);
  const float s0 = pa < p1 ? d0 * qi.step * sk.x * scale : -INFINITY;
  const float s1 = pa + 1 < p1 ? d1 * qi.step * sk.y * scale : -INFINITY;
  float e0, e1;
  tc_online_softmax(st, s0, s1, t, e0, e1);
  uint32_t phi, plo;
  split_f16(pa < p1 ? e0 * sv.x : 0.f, pa + 1 < p1 ? e1 * sv.y : 0.f, phi, plo);
#pragma unroll
  for (int m = 0; m < HD / 16; m += 4) {
    uint32_t va[4];
    ldmatrix_x4_trans(va, slot + T::kv + T::off(r, m + mi));
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t ev = q8_pair_f16(va[u], 0x4240), od = q8_pair_f16(va[u], 0x4341);
      const uint32_t f[4] = {ev, od, ev, od};
      mma_f16(st.acc[m + u], f, phi, plo);
    }
  }
}

// A head's cache as the tensor-core loop reads it.
struct TcSrc {
  const void* k;
  const void* v;
  const float* ks;  // q8 scales
  const float* vs;
};
template <int HD, KvType KT>
__device__ __forceinline__ void tc_issue_any(char* dst, const TcSrc& src, int b, int p1, int lane) {
  if constexpr (KT == KvType::Q8)
    tc_issue_q8<HD>(reinterpret_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src.k),
                    static_cast<const uint8_t*>(src.v), src.ks, src.vs, b, p1, lane);
  else
    tc_issue<HD>(reinterpret_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src.k),
                 static_cast<const uint16_t*>(src.v), b, p1, lane);
}

// The warp's first kTcStages - 1 steps, each its own cp.async group, as far
// as they end before `pos` (the new row, written after the wait): called
// before the wait, it returns how many went out.
constexpr int kTcStride = kAttnWarps * 8;  // positions between a warp's steps
template <int HD, KvType KT>
__device__ __forceinline__ int tc_prefetch(const TcSrc& src, char* ring, int p0, int p1, int pos, int warp,
                                           int lane) {
  constexpr int kSlot = tc_slot_bytes<HD, KT>();
  char* my = ring + size_t(warp) * kTcStages * kSlot;
  const int b0 = p0 + warp * 8;
  int k = 0;
  for (; k < kTcStages - 1; ++k) {
    const int b = b0 + k * kTcStride;
    if (b >= p1 || (b <= pos && pos < min(b + 8, p1))) break;
    tc_issue_any<HD, KT>(my + k * kSlot, src, b, p1, lane);
    cp_async_commit();
  }
  return k;
}

// The warp's positions [p0 + 8 warp, p1) in steps of 8, 32 apart (the first
// `issued` steps already requested); leaves (max, sum) per head and the
// unnormalised output in mml / macc as the CUDA-core loop does (after a block
// barrier: the ring overlaps macc).
template <int HD, KvType KT>
__device__ void attention_tc_loop(const TcSrc& src, const uint4* qf, const float* qint, char* ring, float* macc,
                                  float* mml, int p0, int p1, int issued, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  QInt qi{0.f, 0, 0};
  if constexpr (KT == KvType::Q8) qi = QInt{qint[4 * g], __float_as_int(qint[4 * g + 2]), __float_as_int(qint[4 * g + 3])};
  const float scale = 1.f / sqrtf(static_cast<float>(HD));
  TcState<HD> st;
#pragma unroll
  for (int m = 0; m < HD / 16; ++m) st.acc[m][0] = st.acc[m][1] = st.acc[m][2] = st.acc[m][3] = 0.f;
  st.m = -INFINITY;
  st.l = 0.f;
  constexpr int kStride = kTcStride, kSlot = tc_slot_bytes<HD, KT>();
  char* my = ring + size_t(warp) * kTcStages * kSlot;
  const int b0 = p0 + warp * 8;
  const int nt = b0 < p1 ? (p1 - b0 + kStride - 1) / kStride : 0;
  for (int k = issued; k < kTcStages - 1; ++k) {  // the first steps not requested before the wait
    if (k < nt) tc_issue_any<HD, KT>(my + k * kSlot, src, b0 + k * kStride, p1, lane);
    cp_async_commit();
  }
  for (int k = 0; k < nt; ++k) {
    const int kn = k + kTcStages - 1;
    if (kn < nt) tc_issue_any<HD, KT>(my + (kn % kTcStages) * kSlot, src, b0 + kn * kStride, p1, lane);
    cp_async_commit();
    cp_async_wait<kTcStages - 1>();
    __syncwarp();
    if constexpr (KT == KvType::Q8)
      tc_step_q8<HD>(st, reinterpret_cast<const uint8_t*>(my + (k % kTcStages) * kSlot), qf, qi, b0 + k * kStride,
                     p1, scale, lane);
    else
      tc_step<HD>(st, reinterpret_cast<const uint16_t*>(my + (k % kTcStages) * kSlot), qf, b0 + k * kStride, p1,
                  scale, lane);
    __syncwarp();  // the slot is refilled next step
  }
  cp_async_wait<0>();
  float l = st.l + __shfl_xor_sync(0xffffffffu, st.l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with its ring
  if (t == 0) {
    mml[(warp * kAttnHeads + g) * 2] = st.m;
    mml[(warp * kAttnHeads + g) * 2 + 1] = l;
  }
  // Tile m's rows: dims 16m + g and 16m + 8 + g (bf16), 16m + 2g and 16m + 2g + 1 (q8).
  constexpr int d0 = KT == KvType::Q8 ? 2 : 1, d1 = KT == KvType::Q8 ? 1 : 8;
#pragma unroll
  for (int m = 0; m < HD / 16; ++m) {
    float* o0 = macc + (warp * kAttnHeads + 2 * t) * HD + 16 * m + d0 * g;
    float* o1 = o0 + HD;
    o0[0] = st.acc[m][0];
    o1[0] = st.acc[m][1];
    o0[d1] = st.acc[m][2];
    o1[d1] = st.acc[m][3];
  }
}

template <int HD, KvType KT, bool TC>
__global__ void __launch_bounds__(kAttnThreads, 2) attention_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int DPL = HD / 32;
  trace_mark(p.trace, 0);
  const int split = blockIdx.x, kvh = blockIdx.y, hg0 = blockIdx.z * kAttnHeads;
  const int G = p.nh / p.nkv;
  const int gcount = min(kAttnHeads, G - hg0);
  // The position only changes between steps, so it is read before the wait
  // (as the DeltaNet step does), and so are the first cached K / V rows
  // (every row before pos was written by an earlier step) on tensor cores.
  const int pos = p.ctrl->pos, n = pos + 1;
  const int len = split_len(n, p.max_splits, p.min_split);
  const int p0 = split * len;
  if (p0 >= n) return;
  const int p1 = min(n, p0 + len);

  extern __shared__ __align__(16) float sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t head_base = size_t(kvh) * p.capacity * HD;
  constexpr bool BF = KT == KvType::BF16, Q8 = KT == KvType::Q8;
  constexpr int ES = Q8 ? 1 : BF ? 2 : 4;
  char* kc = static_cast<char*>(p.k_cache) + head_base * ES;
  char* vc = static_cast<char*>(p.v_cache) + head_base * ES;
  float* ksc = Q8 ? p.k_scale + size_t(kvh) * p.scale_stride : nullptr;
  float* vsc = Q8 ? p.v_scale + size_t(kvh) * p.scale_stride : nullptr;
  const TcSrc src{kc, vc, ksc, vsc};
  float* qs = sm;  // [8][HD]
  float* macc = qs + kAttnHeads * HD;                // [warps][8][HD]
  float* knorm = macc;                               // scratch until the merge
  float* mml = macc + kAttnWarps * kAttnHeads * HD;  // [warps][8][2]
  int issued = 0;
  if constexpr (TC) {
    qs = sm + TcSmem<HD, KT>::qbuf;
    macc = sm + TcSmem<HD, KT>::ring;
    knorm = sm + TcSmem<HD, KT>::knorm;
    mml = sm + TcSmem<HD, KT>::mml;
    if (p.prefetch)
      issued = tc_prefetch<HD, KT>(src, reinterpret_cast<char*>(sm + TcSmem<HD, KT>::ring), p0, p1, pos, warp, lane);
  }
  float* pw = mml + kAttnWarps * kAttnHeads * 2;   // [warps][32]
  float* aw = pw + kAttnWarps * 32;                // [warps][8]
  // RoPE's cosines and sines depend on the position only: before the wait.
  // The angle in f32 as the CPU forms it. cosf / sinf take a slow argument
  // reduction (local memory) past |x| ~ 1e5, i.e. for the low frequencies
  // at long contexts (2.4 us per launch at 128K): there the cosine and sine
  // come from f64, which stays fast and rounds to the same floats.
  float* rope = aw + kAttnWarps * kAttnHeads;  // [cos half | sin half]
  if constexpr (TC) rope = sm + TcSmem<HD, KT>::rope;
  const int half = p.rotary_dim / 2;
  for (int i = tid; i < half; i += kAttnThreads) {
    const float angle = static_cast<float>(pos) * p.inv_freq[i];
    float c, s;
    if (fabsf(angle) < 65536.f) {
      c = cosf(angle);
      s = sinf(angle);
    } else {
      double sd, cd;
      sincos(static_cast<double>(angle), &sd, &cd);
      c = static_cast<float>(cd);
      s = static_cast<float>(sd);
    }
    rope[i] = c;
    rope[half + i] = s;
  }
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);

  // Queries: per-head RMSNorm (then RoPE below).
  for (int hl = warp; hl < kAttnHeads; hl += kAttnWarps) {
    if (hl < gcount) {
      const float* q = p.qkv + size_t(kvh * G + hg0 + hl) * p.q_head_stride;
      float v[DPL];
      float ss = 0.f;
#pragma unroll
      for (int d = 0; d < DPL; ++d) {
        v[d] = q[lane + 32 * d];
        ss = fmaf(v[d], v[d], ss);
      }
      ss = warp_sum(ss);
      const float inv = 1.f / sqrtf(ss / HD + p.eps);
#pragma unroll
      for (int d = 0; d < DPL; ++d) qs[hl * HD + lane + 32 * d] = v[d] * inv * p.q_norm[lane + 32 * d];
    } else {
#pragma unroll
      for (int d = 0; d < DPL; ++d) qs[hl * HD + lane + 32 * d] = 0.f;
    }
  }
  // The new K/V row (position pos) is written by the block(s) whose split
  // holds it; with more than 8 query heads per KV head several blocks share
  // the split and each writes the same values before reading them back.
  const bool writer = p0 <= pos && pos < p1;
  const float* knew = p.qkv + size_t(p.nh) * p.q_head_stride + size_t(kvh) * HD;
  const float* vnew = p.qkv + size_t(p.nh) * p.q_head_stride + size_t(p.nkv) * HD + size_t(kvh) * HD;
  if (writer && warp == 0) {
    float v[DPL];
    float ss = 0.f;
#pragma unroll
    for (int d = 0; d < DPL; ++d) {
      v[d] = knew[lane + 32 * d];
      ss = fmaf(v[d], v[d], ss);
    }
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / HD + p.eps);
#pragma unroll
    for (int d = 0; d < DPL; ++d) knorm[lane + 32 * d] = v[d] * inv * p.k_norm[lane + 32 * d];
  }
  if (writer && warp == 1) {
    if constexpr (Q8) q8_store_row_warp(vnew, HD, reinterpret_cast<uint8_t*>(vc) + size_t(pos) * HD, vsc + pos, lane);
    else for (int e = lane; e < HD; e += 32) {
      const float v = vnew[e];
      if constexpr (BF) reinterpret_cast<uint16_t*>(vc)[size_t(pos) * HD + e] = to_bf16_bits(v);
      else reinterpret_cast<float*>(vc)[size_t(pos) * HD + e] = v;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < (kAttnHeads + 1) * half; idx += kAttnThreads) {
    const int hl = idx / half, i = idx - hl * half;
    float* x = hl < kAttnHeads ? qs + hl * HD : knorm;
    if (hl == kAttnHeads && !writer) continue;
    if (hl < kAttnHeads && hl >= gcount) continue;
    const float c = rope[i], s = rope[half + i];
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
  __syncthreads();
  if constexpr (TC && Q8) build_q_codes<HD, kAttnThreads>(qs, reinterpret_cast<uint4*>(qs), sm + TcSmem<HD, KT>::qint, tid);
  else if constexpr (TC) build_q_frags<HD>(qs, reinterpret_cast<uint4*>(qs), tid);
  if constexpr (Q8) {
    if (writer && warp == 0) q8_store_row_warp(knorm, HD, reinterpret_cast<uint8_t*>(kc) + size_t(pos) * HD, ksc + pos, lane);
  } else if (writer) {
    for (int e = tid; e < HD; e += kAttnThreads) {
      if constexpr (BF) reinterpret_cast<uint16_t*>(kc)[size_t(pos) * HD + e] = to_bf16_bits(knorm[e]);
      else reinterpret_cast<float*>(kc)[size_t(pos) * HD + e] = knorm[e];
    }
  }
  __syncthreads();
  trace_mark(p.trace, 2);

  if constexpr (TC) {
    attention_tc_loop<HD, KT>(src, reinterpret_cast<const uint4*>(qs), sm + TcSmem<HD, KT>::qint,
                              reinterpret_cast<char*>(sm + TcSmem<HD, KT>::ring), macc, mml, p0, p1, issued, warp, lane);
  } else {
    const float scale = 1.f / sqrtf(static_cast<float>(HD));
    float acc[kAttnHeads][DPL];
#pragma unroll
    for (int h = 0; h < kAttnHeads; ++h)
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[h][d] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;  // for head (lane & 7)
    const int my_j = lane >> 3, my_h = lane & 7;
    // K/V rows of the next step are loaded while this step computes.
    KvRow<DPL, KT> kr[kAttnPos], vr[kAttnPos], kn[kAttnPos], vn[kAttnPos];
    auto load_rows = [&](int b, KvRow<DPL, KT>(&k)[kAttnPos], KvRow<DPL, KT>(&v)[kAttnPos]) {
#pragma unroll
      for (int jp = 0; jp < kAttnPos; ++jp) {
        if (b + jp < p1) {
          k[jp].load(kc, size_t(b + jp) * HD + lane * DPL, Q8 ? ksc + b + jp : nullptr);
          v[jp].load(vc, size_t(b + jp) * HD + lane * DPL, Q8 ? vsc + b + jp : nullptr);
        } else {
          k[jp].zero();
          v[jp].zero();
        }
      }
    };
    constexpr int kStride = kAttnWarps * kAttnPos;
    load_rows(p0 + warp * kAttnPos, kr, vr);
    for (int base = p0 + warp * kAttnPos; base < p1; base += kStride) {
      if (base + kStride < p1) load_rows(base + kStride, kn, vn);
      float part[kAttnPos * kAttnHeads];
#pragma unroll
      for (int h = 0; h < kAttnHeads; ++h) {
        float qv[DPL];
#pragma unroll
        for (int d = 0; d < DPL; ++d) qv[d] = qs[h * HD + lane * DPL + d];
#pragma unroll
        for (int jp = 0; jp < kAttnPos; ++jp) {
          float s = 0.f;
#pragma unroll
          for (int d = 0; d < DPL; ++d) s = fmaf(qv[d], kr[jp].get(d), s);
          part[jp * kAttnHeads + h] = s;
        }
      }
      // Reduce-scatter: lane l ends with the full sum of part[l].
      reduce_scatter_step<16>(part, lane);
      reduce_scatter_step<8>(part, lane);
      reduce_scatter_step<4>(part, lane);
      reduce_scatter_step<2>(part, lane);
      reduce_scatter_step<1>(part, lane);
      float s = part[0] * scale;
      if (base + my_j >= p1 || my_h >= gcount) s = -INFINITY;
      float tmax = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, 8));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
      const float m_new = fmaxf(m_run, tmax);
      float pe = 0.f, alpha = 1.f;
      if (m_new != -INFINITY) {
        pe = expf(s - m_new);
        alpha = expf(m_run - m_new);
      }
      float ls = pe + __shfl_xor_sync(0xffffffffu, pe, 8);
      ls += __shfl_xor_sync(0xffffffffu, ls, 16);
      l_run = l_run * alpha + ls;
      m_run = m_new;
      pw[warp * 32 + lane] = pe;
      if (lane < kAttnHeads) aw[warp * kAttnHeads + lane] = alpha;
      __syncwarp();
#pragma unroll
      for (int h = 0; h < kAttnHeads; ++h) {
        const float a = aw[warp * kAttnHeads + h];
        float pj[kAttnPos];
#pragma unroll
        for (int jp = 0; jp < kAttnPos; ++jp) pj[jp] = pw[warp * 32 + jp * kAttnHeads + h];
#pragma unroll
        for (int d = 0; d < DPL; ++d) {
          float v = acc[h][d] * a;
#pragma unroll
          for (int jp = 0; jp < kAttnPos; ++jp) v = fmaf(pj[jp], vr[jp].get(d), v);
          acc[h][d] = v;
        }
      }
      __syncwarp();
#pragma unroll
      for (int jp = 0; jp < kAttnPos; ++jp) {
        kr[jp] = kn[jp];
        vr[jp] = vn[jp];
      }
    }
    __syncthreads();  // knorm (in macc) is no longer needed
    if (lane < kAttnHeads) {
      mml[(warp * kAttnHeads + lane) * 2] = m_run;
      mml[(warp * kAttnHeads + lane) * 2 + 1] = l_run;
    }
#pragma unroll
    for (int h = 0; h < kAttnHeads; ++h)
#pragma unroll
      for (int d = 0; d < DPL; ++d) macc[(warp * kAttnHeads + h) * HD + lane * DPL + d] = acc[h][d];
  }
  __syncthreads();
  // The warps' weights per head (exp(m_w - M), once per head and warp), then
  // the merged output: one FMA per warp and element.
  if (tid < kAttnHeads) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, mml[(w * kAttnHeads + tid) * 2]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float mw = mml[(w * kAttnHeads + tid) * 2];
      const float ww = mw == -INFINITY ? 0.f : expf(mw - M);
      aw[w * kAttnHeads + tid] = ww;
      L = fmaf(ww, mml[(w * kAttnHeads + tid) * 2 + 1], L);
    }
    if (tid < gcount) {
      const size_t hs = size_t(kvh * G + hg0 + tid) * p.max_splits + split;
      p.part_ml[hs * 2] = M;
      p.part_ml[hs * 2 + 1] = L;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < gcount * HD; idx += kAttnThreads) {
    const int h = idx / HD, e = idx - h * HD;
    float O = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) O = fmaf(aw[w * kAttnHeads + h], macc[(w * kAttnHeads + h) * HD + e], O);
    p.part_o[(size_t(kvh * G + hg0 + h) * p.max_splits + split) * HD + e] = O;
  }
  trace_end(p.trace);
}

// Block (head, 32 dims): 8 groups of 32 threads split the context splits,
// each keeping 8 loads in flight (two rounds for 128 splits; v13: 64 dims x
// 4 groups took four, 3.3 against 2.2 us per launch at 128K), then the
// groups are summed in shared memory.
__global__ void __launch_bounds__(kCombineThreads * kCombineGroups) attention_combine_kernel(const __grid_constant__ AttentionParams p) {
  trace_mark(p.trace, 0);
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);
  extern __shared__ float wsm[];  // [max_splits] weights
  __shared__ float scratch[32];
  __shared__ float part[kCombineGroups][kCombineThreads];
  const int h = blockIdx.x, tid = threadIdx.x, HD = p.hd;
  const int n = p.ctrl->pos + 1;
  const int len = split_len(n, p.max_splits, p.min_split);
  const int ns = (n + len - 1) / len;
  const float* ml = p.part_ml + size_t(h) * p.max_splits * 2;
  float M = -INFINITY;
  for (int s = tid; s < ns; s += blockDim.x) M = fmaxf(M, ml[2 * s]);
  M = block_max(M, scratch);
  float L = 0.f;
  for (int s = tid; s < ns; s += blockDim.x) {
    const float w = expf(ml[2 * s] - M);
    wsm[s] = w;
    L = fmaf(w, ml[2 * s + 1], L);
  }
  L = block_sum(L, scratch);  // also orders the wsm writes before the reads below
  trace_mark(p.trace, 2);
  const int lane_e = tid % kCombineThreads, g = tid / kCombineThreads;
  const int e = blockIdx.y * kCombineThreads + lane_e;
  float o = 0.f;
  if (e < HD) {
    const float* po = p.part_o + size_t(h) * p.max_splits * HD + e;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int s = g;
    constexpr int G = kCombineGroups;
    for (; s + 7 * G < ns; s += 8 * G) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = po[size_t(s + u * G) * HD];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = fmaf(wsm[s + u * G], v[u], acc[u]);
    }
    for (; s < ns; s += G) acc[0] = fmaf(wsm[s], po[size_t(s) * HD], acc[0]);
    o = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  part[g][lane_e] = o;
  __syncthreads();
  trace_mark(p.trace, 3);
  if (g != 0 || e >= HD) return;
  float t = 0.f;
#pragma unroll
  for (int q = 0; q < kCombineGroups; ++q) t += part[q][lane_e];
  t /= L;
  if (p.gated) t *= sigmoid(p.qkv[size_t(h) * p.q_head_stride + HD + e]);
  p.out[size_t(h) * HD + e] = t;
}

template <int HD, KvType KT>
void launch_attention_t(const AttentionParams& p, cudaStream_t s, bool pdl) {
  const size_t smem = (size_t(kAttnHeads) * HD + size_t(kAttnWarps) * kAttnHeads * HD +
                       kAttnWarps * kAttnHeads * 2 + kAttnWarps * 32 + kAttnWarps * kAttnHeads + HD) *
                      4;
  static bool init = [] {
    LILY_CUDA(cudaFuncSetAttribute(attention_kernel<HD, KT, false>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    if constexpr (KT != KvType::F32 && HD % 64 == 0)
      LILY_CUDA(cudaFuncSetAttribute(attention_kernel<HD, KT, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    return true;
  }();
  (void)init;
  const int G = p.nh / p.nkv;
  const dim3 grid(p.max_splits, p.nkv, (G + kAttnHeads - 1) / kAttnHeads);
  AttentionParams q = p;
  q.trace = next_trace();
  q.prefetch = env_switch("LILY_CUDA_ATTN_PREFETCH", 1);  // an A/B switch
  // Tensor cores for a bf16 or q8 cache (LILY_CUDA_ATTN_TC=0: the CUDA-core loop).
  if constexpr (KT != KvType::F32 && HD % 64 == 0) {
    if (env_switch("LILY_CUDA_ATTN_TC", 1)) {
      launch_kernel("attention", attention_kernel<HD, KT, true>, grid, dim3(kAttnThreads),
                    size_t(TcSmem<HD, KT>::total) * 4, s, pdl, q);
      return;
    }
  }
  launch_kernel("attention", attention_kernel<HD, KT, false>, grid, dim3(kAttnThreads), smem, s, pdl, q);
}

template <int HD>
void launch_attention_kv(const AttentionParams& p, cudaStream_t s, bool pdl) {
  switch (p.kv) {
    case KvType::F32: return launch_attention_t<HD, KvType::F32>(p, s, pdl);
    case KvType::BF16: return launch_attention_t<HD, KvType::BF16>(p, s, pdl);
    case KvType::Q8: return launch_attention_t<HD, KvType::Q8>(p, s, pdl);
  }
  fail("attention: unknown KV type");
}

}  // namespace

int attention_split_len_host(int n, int max_splits, int min_split) {
  return split_len(n, max_splits, min_split);
}

void launch_attention(const AttentionParams& p, cudaStream_t s, bool pdl) {
  if (p.nh % p.nkv != 0) fail("attention: ", p.nh, " query heads over ", p.nkv, " KV heads");
  if (p.min_split < 32 || p.min_split % 32) fail("attention: min_split ", p.min_split, " (a multiple of 32)");
  if (p.rotary_dim <= 0 || p.rotary_dim > p.hd || p.rotary_dim % 2)
    fail("attention: rotary dim ", p.rotary_dim, " for head dim ", p.hd);
  if (p.kv == KvType::Q8 && (!p.k_scale || !p.v_scale || p.scale_stride < q8_scale_stride(p.capacity)))
    fail("attention: a q8 cache needs its scales (stride >= ", q8_scale_stride(p.capacity), ")");
  switch (p.hd) {
    case 32: return launch_attention_kv<32>(p, s, pdl);
    case 64: return launch_attention_kv<64>(p, s, pdl);
    case 128: return launch_attention_kv<128>(p, s, pdl);
    case 256: return launch_attention_kv<256>(p, s, pdl);
    default: fail("attention: head_dim ", p.hd, " is not supported (32, 64, 128, 256)");
  }
}

void launch_attention_combine(const AttentionParams& p, cudaStream_t s, bool pdl) {
  const dim3 grid(p.nh, (p.hd + kCombineThreads - 1) / kCombineThreads);
  AttentionParams q = p;
  q.trace = next_trace();
  launch_kernel("attention_combine", attention_combine_kernel, grid, dim3(kCombineThreads * kCombineGroups),
                size_t(p.max_splits) * 4, s, pdl, q);
}

}  // namespace lily::cuda

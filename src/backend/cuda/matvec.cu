// Decode matvec (one input vector) over weights in their stored format, and
// the MoE down projection with its weighted sum over experts.
//
// One block stages the input once in shared memory (applying the fused
// RMSNorm / gated RMSNorm), then streams whole rows: each warp owns two rows
// at a time, each lane a 16-byte chunk of both rows per step, so every load is
// 16 bytes wide and a warp reads 512 contiguous bytes of a row per
// instruction. An affine group contributes scale * sum(q x) + bias * sum(x)
// with sum(x) of each chunk precomputed at staging. q4 launches (by default,
// MatvecParams::act_bits) stage the input as integer codes per chunk and take
// sum(q code) on IDP.4A ("Integer inputs" below); otherwise codes are turned
// into floats in registers (one byte_perm: q4 as 1/2 + q/256, q8 against
// 2^23).
#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/deltanet_step.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

const char* qfmt_name(QFmt f) {
  switch (f) {
    case QFmt::Q4: return "q4";
    case QFmt::Q8: return "q8";
    case QFmt::BF16: return "bf16";
    case QFmt::F32: return "f32";
  }
  return "?";
}

namespace {


// Shared memory of a matvec block (floats): staged x, per-chunk sums, the raw
// input (prologue scratch), per-segment inverse RMS and, with a norm
// prologue, the norm weights per input (copied before the PDL wait: they are
// constants, so their L2 round trip overlaps the previous kernel). The
// one-pass staging (stage_fast) keeps its norm weights in registers instead
// (StageRegs) and leaves that area and the raw scratch unused.
struct MatvecSmem {
  int xs, xsum, raw, seginv, nw, total;
};
__host__ __device__ inline MatvecSmem matvec_smem_layout(int chunks, int fpc, int cols, int nseg) {
  MatvecSmem l;
  l.xs = 0;
  l.xsum = chunks * fpc;
  l.raw = l.xsum + ((chunks + 3) & ~3);
  l.seginv = l.raw + ((cols + 3) & ~3);
  l.nw = l.seginv + ((nseg + 3) & ~3);
  l.total = l.nw + (nseg > 0 ? ((cols + 3) & ~3) : 0);
  return l;
}

__device__ __forceinline__ int job_tiles(int rows) { return (rows + kRowsPerTile - 1) / kRowsPerTile; }

// Staging, first half: threads t of n copy x into the raw buffer (no
// barrier; x is the predecessor's output) and return their share of sum(x^2).
__device__ float stage_load(const MatvecParams& p, float* raw, int t, int n) {
  const int cols = p.cols;
  float ss = 0.f;
  if ((cols & 3) == 0) {
    // All of a thread's loads go out before the first use (each staging
    // loop iteration would otherwise wait one L2 round trip).
    const float4* x4 = reinterpret_cast<const float4*>(p.x);
    const int n4 = cols / 4;
    for (int i0 = t; i0 < n4; i0 += n * 4) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (i0 + u * n < n4) v[u] = x4[i0 + u * n];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (i0 + u * n < n4) {
          reinterpret_cast<float4*>(raw)[i0 + u * n] = v[u];
          ss = fmaf(v[u].x, v[u].x, fmaf(v[u].y, v[u].y, fmaf(v[u].z, v[u].z, fmaf(v[u].w, v[u].w, ss))));
        }
    }
  } else {
    for (int i = t; i < cols; i += n) {
      const float v = p.x[i];
      raw[i] = v;
      ss = fmaf(v, v, ss);
    }
  }
  return ss;
}

// Staging, second half (all threads): the prologue's norms, the staged
// (swizzled) input and, for affine formats, the per-chunk sums.
template <QFmt F>
__device__ void stage_finish(const MatvecParams& p, float* smem, const MatvecSmem& L, float ss) {
  using CF = ChunkFmt<F>;
  __shared__ float scratch[32];
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int cols = p.cols;
  float* raw = smem + L.raw;
  float* seginv = smem + L.seginv;
  if (p.pro != Prologue::None) {
    const int seg = p.seg, nseg = cols / seg;
    if (nseg == 1) {
      // One segment (the input RMSNorm): every thread's partial, one block sum.
      ss = block_sum(ss, scratch);
      if (tid == 0) seginv[0] = 1.f / sqrtf(ss / static_cast<float>(seg) + p.eps);
    } else {
      __syncthreads();
      const int lane = tid & 31, warp = tid >> 5, nw = nthr >> 5;
      for (int s = warp; s < nseg; s += nw) {
        float q = 0.f;
        for (int i = lane; i < seg; i += 32) {
          const float v = raw[s * seg + i];
          q = fmaf(v, v, q);
        }
        q = warp_sum(q);
        if (lane == 0) seginv[s] = 1.f / sqrtf(q / static_cast<float>(seg) + p.eps);
      }
    }
  }
  __syncthreads();
  trace_clock(p.trace, 5);
  const int n = p.chunks * CF::FPC;
  constexpr int U = 8;
  for (int i0 = tid; i0 < n; i0 += nthr * U) {
    float w[U], z[U];
    if (p.pro != Prologue::None) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * nthr;
        w[u] = i < cols ? smem[L.nw + i] : 0.f;
        z[u] = (p.gate_z && i < cols) ? p.gate_z[i] : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * nthr;
      if (i >= n) break;
      float v = 0.f;
      if (i < cols) {
        v = raw[i];
        if (p.pro != Prologue::None) {
          v = v * seginv[i / p.seg] * w[u];
          if (p.gate_z) v *= silu(z[u]);
        }
      }
      const int c = i / CF::FPC;
      smem[L.xs + CF::slot(c, i - c * CF::FPC)] = v;
    }
  }
  __syncthreads();
  trace_clock(p.trace, 6);
  if constexpr (CF::affine) {
    const float4* xs = reinterpret_cast<const float4*>(smem + L.xs);
    for (int c = tid; c < p.chunks; c += nthr) {
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < CF::PPC; ++q) {
        const float4 v = xs[c * CF::PPC + q];
        s += (v.x + v.y) + (v.z + v.w);
      }
      smem[L.xsum + c] = s;
    }
    __syncthreads();
  }
}

// A named barrier (id 1..15) that n threads, whole warps, meet at (the
// staging warps while warp 0 routes).
__device__ __forceinline__ void named_bar(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// Staging in one pass (the fast path): staging thread t of n (n a multiple of
// 32, warp-aligned) owns the float4 pieces f = t + k n of the staged input.
// It loads its pieces of x (all loads in flight at once), reduces the norm
// (the whole input: warp sums + one barrier over the staging threads; per
// 128-wide segment: one warp sum, since a warp's 32 pieces at one k are
// exactly one segment), scales by the norm weights loaded before the wait
// (times silu(z); z too was loaded before the wait when it was already
// written then, gate_z_early), writes each piece
// to its swizzled slot and, for affine formats, sums a chunk's PPC pieces
// over the PPC adjacent lanes that hold them. kMaxPieces pieces per thread.
// The caller synchronises the block afterwards.
constexpr int kMaxPieces = 4;
constexpr int kDownPieces = 6;
inline bool fast_stage_ok(int cols, int pieces, int seg, Prologue pro, int nthr) {
  return cols % 4 == 0 && pieces <= kMaxPieces * nthr && (pro != Prologue::GatedNorm || seg == 128) &&
         (pro != Prologue::Norm || seg == cols);
}
// Writes staged piece f (of NP) to its swizzled slot and, for affine formats,
// its chunk's sum from the PPC adjacent lanes that hold the chunk's pieces
// (every lane of the warp calls it).
template <QFmt F>
__device__ __forceinline__ void put_piece(float* smem, float* xsum, int f, int NP, float4 a) {
  using CF = ChunkFmt<F>;
  const int c = f / CF::PPC, q = f - c * CF::PPC;
  if (f < NP) reinterpret_cast<float4*>(smem)[c * CF::PPC + (q ^ CF::swz(c))] = a;
  if constexpr (CF::affine) {
    float s = (a.x + a.y) + (a.z + a.w);
#pragma unroll
    for (int o = 1; o < CF::PPC; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (f < NP && q == 0) xsum[c] = s;
  }
}

// ---- Integer inputs (act_bits; q4 weights, one-pass staging) ----
// The staged input becomes integer codes per 32-input chunk (one q4 chunk)
// and the products run on IDP.4A, four per instruction and exact in int32.
// With m = max |x| over the chunk:
//   act_bits 16: code = rn(x * 32512 / m) (|code| <= 32512), x taken as
//     code * m / 32512 (error at most m / 65024: 15 bits under the chunk's
//     largest input, finer than a bf16 input's 8 bits under each value),
//     held as two int8 codes, hi = floor((code + 128) / 256) and
//     lo = code - 256 hi (both in [-128, 127]);
//   act_bits 8: code = rn(x * 127 / m), the hi codes alone (error up to
//     m / 254, 7 bits; llama.cpp's q8_1 class).
// A q4 word's low nibbles (inputs 0, 2, 4, 6 of its 8) are masked in place,
// its high ones too (16 q: no shift), each against a word of 4 codes laid out
// to match: a chunk's 8 code words per int8 part are lo0 hi0 lo1 hi1 | lo2 hi2
// lo3 hi3 (loN: the codes of inputs 8N + 0, 2, 4, 6; hiN: 8N + 1, 3, 5, 7),
// the high part's 2 16-byte quarters first, then the low part's. The Q
// quarters of chunk c sit at Q c + (j ^ ((c >> (3 - log2 Q)) & (Q - 1))), so
// the 8 lanes of a quarter-warp (8 consecutive chunks) read 8 distinct bank
// groups. Per chunk a float2: the step over 16, max(m, FLT_MIN) / (Cmax *
// 16), and sum(x) (exact: the bias term sees no rounding). Shared memory:
// the codes from byte 0 (16 Q bytes per chunk), the float2s from float 4 Q
// chunks (inside the f32 staging area of 32 floats per chunk).
template <int XB>
struct XCodes {
  static_assert(XB == 8 || XB == 16, "integer inputs: 8 or 16 bits");
  static constexpr int Q = XB == 16 ? 4 : 2;          // 16-byte quarters per chunk
  static constexpr int SH = XB == 16 ? 1 : 2;         // the swizzle's chunk shift
  static constexpr float kMax = XB == 16 ? 32512.f : 127.f;
  __device__ static __forceinline__ int quarter(int c, int j) { return Q * c + (j ^ ((c >> SH) & (Q - 1))); }
  __device__ static __forceinline__ float2* meta(float* smem, int chunks) {
    return reinterpret_cast<float2*>(smem + 4 * Q * chunks);
  }
  __device__ static __forceinline__ const float2* meta(const float* smem, int chunks) {
    return reinterpret_cast<const float2*>(smem + 4 * Q * chunks);
  }
};
// put_piece for integer inputs, all of a staging thread's pieces at once.
// The thread owns pairs of adjacent pieces (stage_piece): pair j is
// P = P0 + j * n, inputs 8 P .. + 7, word P % 4 of chunk P / 4, so a lane
// codes whole words itself (no exchange with a neighbour) and a chunk's
// reductions span 4 aligned lanes: 4 shuffles per 8 inputs (v16's first
// version, a piece per lane as the f32 staging, took 14, and each piece's
// chain ran after the previous one's: 0.6 us per launch more than the f32
// staging). The pairs' chains are independent and run as one straight-line
// sequence. Pairs past NPairs (zeros) are computed and not stored. The codes
// come from the float product through the f32 rounding add of 1.5 * 2^23
// (its low 16 bits are the code: byte 0 the low part, byte 1 of code + 128
// the high part) instead of F2I.
template <int XB, int J>
__device__ __forceinline__ void put_pairs_x(float* smem, int chunks, int P0, int n, int NPairs,
                                            const float4 (&a)[2 * J]) {
  using XC = XCodes<XB>;
  float s[J], m[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float4 u = a[2 * j], v = a[2 * j + 1];
    s[j] = ((u.x + u.y) + (u.z + u.w)) + ((v.x + v.y) + (v.z + v.w));
    m[j] = fmaxf(fmaxf(fmaxf(fabsf(u.x), fabsf(u.y)), fmaxf(fabsf(u.z), fabsf(u.w))),
                 fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      s[j] += __shfl_xor_sync(0xffffffffu, s[j], o);
      m[j] = fmaxf(m[j], __shfl_xor_sync(0xffffffffu, m[j], o));
    }
  uint32_t* w = reinterpret_cast<uint32_t*>(smem);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int P = P0 + j * n, c = P >> 2, i = P & 3;
    // The scale from max(m, FLT_MIN) (no reciprocal of 0 or of a subnormal,
    // which takes the slow path), the codes and the step alike.
    const float mm = m[j] > 0.f ? fmaxf(m[j], FLT_MIN) : 0.f;
    const float inv = mm > 0.f ? XC::kMax * __frcp_rn(mm) : 0.f;
    constexpr float kRound = 12582912.f;  // 1.5 * 2^23: its low 16 bits are the code
    const float e[8] = {a[2 * j].x, a[2 * j].y, a[2 * j].z, a[2 * j].w,
                        a[2 * j + 1].x, a[2 * j + 1].y, a[2 * j + 1].z, a[2 * j + 1].w};
    uint32_t b[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) b[t] = __float_as_uint(__fadd_rn(__fmul_rn(e[t], inv), kRound));
    // Byte 0 of each code: the words of the even inputs (0, 2, 4, 6) and the
    // odd ones; for 16 bits byte 1 of code + 128 is the high part.
    auto word = [](uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, uint32_t sel) {
      return __byte_perm(__byte_perm(x0, x1, sel), __byte_perm(x2, x3, sel), 0x5410);
    };
    uint2 hi, lo;
    if constexpr (XB == 16) {
      uint32_t h[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) h[t] = b[t] + 128u;
      hi = make_uint2(word(h[0], h[2], h[4], h[6], 0x0051), word(h[1], h[3], h[5], h[7], 0x0051));
      lo = make_uint2(word(b[0], b[2], b[4], b[6], 0x0040), word(b[1], b[3], b[5], b[7], 0x0040));
    } else {
      hi = make_uint2(word(b[0], b[2], b[4], b[6], 0x0040), word(b[1], b[3], b[5], b[7], 0x0040));
      lo = hi;
    }
    if (P < NPairs) {
      *reinterpret_cast<uint2*>(w + XC::quarter(c, i >> 1) * 4 + 2 * (i & 1)) = hi;
      if constexpr (XB == 16) *reinterpret_cast<uint2*>(w + XC::quarter(c, 2 + (i >> 1)) * 4 + 2 * (i & 1)) = lo;
      if (i == 0) XC::meta(smem, chunks)[c] = make_float2(mm / (XC::kMax * 16.f), s[j]);
    }
  }
}
// put_pairs_x over the pairs of staging thread t's warp that exist (one to
// JMax, warp-uniform; get(k) gives piece k of the thread, stage_piece order).
template <int XB, int JMax, typename Get>
__device__ __forceinline__ void put_pairs_n(float* smem, int chunks, int t, int n, int NP, Get get) {
  const int w = t >> 5, NPairs = NP / 2;
  const int jn = w * 32 < NPairs ? (NPairs - w * 32 + n - 1) / n : 0;
  auto put = [&](auto jc) {
    constexpr int J = decltype(jc)::value;
    float4 a[2 * J];
#pragma unroll
    for (int k = 0; k < 2 * J; ++k) a[k] = get(k);
    put_pairs_x<XB, J>(smem, chunks, t, n, NPairs, a);
  };
  static_assert(JMax == 2 || JMax == 3, "one to three pairs");
  if constexpr (JMax == 3) {
    if (jn > 2) return put(std::integral_constant<int, 3>{});
  }
  if (jn > 1) put(std::integral_constant<int, 2>{});
  else if (jn == 1) put(std::integral_constant<int, 1>{});
}
// d = a . b + c over 4 bytes, a unsigned, b signed.
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// sum over one int8 part of 16 q code for a q4 chunk w (the part's two
// quarters x0, x1): exact, |.| < 2^20.
__device__ __forceinline__ int q4_dot_s8(const uint4& v, const uint4& x0, const uint4& x1) {
  int lo = 0, hi = 0;
  lo = dp4a_us(v.x & 0x0F0F0F0Fu, x0.x, lo);
  hi = dp4a_us(v.x & 0xF0F0F0F0u, x0.y, hi);
  lo = dp4a_us(v.y & 0x0F0F0F0Fu, x0.z, lo);
  hi = dp4a_us(v.y & 0xF0F0F0F0u, x0.w, hi);
  lo = dp4a_us(v.z & 0x0F0F0F0Fu, x1.x, lo);
  hi = dp4a_us(v.z & 0xF0F0F0F0u, x1.y, hi);
  lo = dp4a_us(v.w & 0x0F0F0F0Fu, x1.z, lo);
  hi = dp4a_us(v.w & 0xF0F0F0F0u, x1.w, hi);
  return 16 * lo + hi;
}
// d[r] = sum over chunk c of 16 q code for R rows (16 bits: < 2^28, exact
// in int32; its float conversion rounds to 24 bits).
template <int XB, int R>
__device__ __forceinline__ void chunk_dot_x(const uint4 (&w)[R], const uint4* xq, int c, int (&d)[R]) {
  using XC = XCodes<XB>;
  const uint4 h0 = xq[XC::quarter(c, 0)], h1 = xq[XC::quarter(c, 1)];
  if constexpr (XB == 16) {
    const uint4 l0 = xq[XC::quarter(c, 2)], l1 = xq[XC::quarter(c, 3)];
#pragma unroll
    for (int r = 0; r < R; ++r) d[r] = 256 * q4_dot_s8(w[r], h0, h1) + q4_dot_s8(w[r], l0, l1);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) d[r] = q4_dot_s8(w[r], h0, h1);
  }
}
// A chunk's affine term from chunk_dot_x's d: scale * step * sum(q code)
// + bias * sum(x).
__device__ __forceinline__ float x_term(float2 sb, int d, float2 meta) {
  return fmaf(sb.x * meta.x, __int2float_rn(d), sb.y * meta.y);
}

// The norm weights (and the gate z, when known before the wait) of staging
// thread t's pieces, loaded into registers before the wait: nothing waits
// for them there, so the block reaches griddepcontrol.wait at once (stored
// to shared memory first, they held in_proj / out_proj blocks 2-3 us past
// their predecessor's end, behind the first item's weight loads: v11 trace).
// Norm: one weight piece per input piece (a); gated (128-wide segments): a
// thread's pieces all sit at one offset of their segments, so one weight
// piece (g), and a holds the thread's pieces of z.
// Pairs (the integer-input staging, put_pairs_x): thread t owns the adjacent
// pieces 2 (t + j n) and + 1 as its pieces 2 j and 2 j + 1; a gated segment
// then holds 16 lanes' pairs, and a thread's even and odd pieces sit at two
// offsets of their segments (g, g2).
struct StageRegs {
  float4 a[kMaxPieces], g, g2;
};
template <bool Pairs>
__device__ __forceinline__ int stage_piece(int t, int k, int n) {
  if constexpr (Pairs) return 2 * (t + (k >> 1) * n) + (k & 1);
  else return t + k * n;
}
template <bool Pairs = false>
__device__ __forceinline__ void stage_regs_load(const MatvecParams& p, int t, int n, StageRegs& r) {
  const int n4 = p.cols / 4;
  const float4* nw4 = reinterpret_cast<const float4*>(p.norm_w);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.pro == Prologue::Norm) {
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k) {
      const int f = stage_piece<Pairs>(t, k, n);
      r.a[k] = f < n4 ? __ldg(nw4 + f) : zero;
    }
  } else if (p.pro == Prologue::GatedNorm) {
    r.g = __ldg(nw4 + (stage_piece<Pairs>(t, 0, n) & 31));
    if constexpr (Pairs) r.g2 = __ldg(nw4 + (stage_piece<Pairs>(t, 1, n) & 31));
    if (p.gate_z_early) {
#pragma unroll
      for (int k = 0; k < kMaxPieces; ++k) {
        const int f = stage_piece<Pairs>(t, k, n);
        r.a[k] = f < n4 ? __ldcg(reinterpret_cast<const float4*>(p.gate_z) + f) : zero;
      }
    }
  }
}

// The named barrier where a route launch's staging hands its sums of x^2
// to the routing warp (route_warp).
constexpr int kRouteRmsBar = 2;
// The named barrier where the one-pass staging's warps wait for the
// routing warp's selection (route_warp's sel_bar): they issue their routed
// loads as soon as the experts are known, not after the routing warp has
// also worked out the weights and met the block.
constexpr int kRouteSelBar = 3;
// NR > 1 (integer inputs only): NR input rows at once, row r from p.x + r
// p.ldx (gate z at p.gate_z + r p.ldz, loaded here) into smem + r rstride
// floats, their sums of x^2 at red + r x (warps), one named barrier for all;
// each row's arithmetic is the one-row staging's.
template <QFmt F, int XB = 0, int NR = 1>
__device__ __forceinline__ void stage_fast(const MatvecParams& p, float* smem, const MatvecSmem& L, int t,
                                           int n, int bar_id, float* red, StageRegs& sr, bool arrive = false,
                                           int rstride = 0) {
  static_assert(NR == 1 || XB != 0, "several rows: integer inputs only");
  using CF = ChunkFmt<F>;
  constexpr bool Pairs = XB != 0;  // the integer staging owns pairs of pieces (put_pairs_x)
  constexpr int kRed = kMatvecThreads / 32;  // a row's sums in red
  const int lane = t & 31, w = t >> 5, nwarps = n >> 5;
  const int n4 = p.cols / 4, NP = p.chunks * CF::PPC;
  const bool late_z = p.pro == Prologue::GatedNorm && !p.gate_z_early;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 v[NR][kMaxPieces];
  // The rows' gate z when loaded here: sr.a for one row (as when loaded
  // before the wait), zx for several.
  float4 zx[NR][kMaxPieces];
  auto zref = [&](int r, int k) -> float4& {
    if constexpr (NR == 1) return sr.a[k];
    else return zx[r][k];
  };
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const float4* x4 = reinterpret_cast<const float4*>(p.x + r * p.ldx);
    const float4* z4 = reinterpret_cast<const float4*>(p.gate_z + r * p.ldz);
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k) {
      const int f = stage_piece<Pairs>(t, k, n);
      v[r][k] = f < n4 ? x4[f] : zero;
      if (late_z) zref(r, k) = f < n4 ? __ldcg(z4 + f) : zero;
    }
  }
  // Sub-steps (trace only; the empty asm orders the mark after the value):
  // 5, the first x piece arrived; 6, the norm scales known.
  if (p.trace.recs) {
    asm volatile("" ::"f"(v[0][0].x));
    trace_clock(p.trace, 5);
  }
  float scale[NR][kMaxPieces];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k) scale[r][k] = 1.f;
  if (p.pro == Prologue::Norm) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < kMaxPieces; ++k) {
        const float4 a = v[r][k];
        ss = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, fmaf(a.w, a.w, ss))));
      }
      ss = warp_sum(ss);
      if (lane == 0) red[r * kRed + w] = ss;
    }
    // The routing warp waits for these sums there (see route_warp).
    if (arrive) asm volatile("bar.arrive %0, %1;" ::"n"(kRouteRmsBar), "r"(n + 32) : "memory");
    named_bar(bar_id, n);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float tot = 0.f;
      for (int i = 0; i < nwarps; ++i) tot += red[r * kRed + i];
      const float rs = 1.f / sqrtf(tot / static_cast<float>(p.seg) + p.eps);
#pragma unroll
      for (int k = 0; k < kMaxPieces; ++k) scale[r][k] = rs;
    }
  } else if (p.pro == Prologue::GatedNorm) {
    // Every piece's segment sum at once (the same warp sums, their shuffle
    // rounds interleaved rather than one dependent chain per piece); pieces
    // past the input are zeros and unused.
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float ss[kMaxPieces];
#pragma unroll
      for (int k = 0; k < kMaxPieces; ++k) {
        const float4 a = v[r][k];
        ss[k] = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, a.w * a.w)));
      }
      if constexpr (Pairs) {
        // A segment: the pairs of 16 lanes.
#pragma unroll
        for (int k = 0; k < kMaxPieces; k += 2) ss[k] += ss[k + 1];
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
#pragma unroll
          for (int k = 0; k < kMaxPieces; k += 2) ss[k] += __shfl_xor_sync(0xffffffffu, ss[k], o);
#pragma unroll
        for (int k = 0; k < kMaxPieces; k += 2) scale[r][k] = scale[r][k + 1] = 1.f / sqrtf(ss[k] / 128.f + p.eps);
      } else {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
          for (int k = 0; k < kMaxPieces; ++k) ss[k] += __shfl_xor_sync(0xffffffffu, ss[k], o);
#pragma unroll
        for (int k = 0; k < kMaxPieces; ++k) scale[r][k] = 1.f / sqrtf(ss[k] / 128.f + p.eps);
      }
    }
  }
  if (p.trace.recs) {
    asm volatile("" ::"f"(scale[0][0]), "f"(scale[0][kMaxPieces - 1]));
    trace_clock(p.trace, 6);
  }
  auto scaled = [&](int r, int k) {
    const int f = stage_piece<Pairs>(t, k, n);
    float4 a = v[r][k];
    if (p.pro != Prologue::None && f < n4) {
      float4 g = p.pro == Prologue::GatedNorm ? zref(r, k) : sr.a[k];
      if (p.pro == Prologue::GatedNorm) {
        const float4 gw = (Pairs && (k & 1)) ? sr.g2 : sr.g;
        g = make_float4(gw.x * silu_fast(g.x), gw.y * silu_fast(g.y), gw.z * silu_fast(g.z), gw.w * silu_fast(g.w));
      }
      const float s = scale[r][k];
      a = make_float4(a.x * s * g.x, a.y * s * g.y, a.z * s * g.z, a.w * s * g.w);
    }
    return a;
  };
  if constexpr (XB != 0) {
    static_assert(kMaxPieces == 4, "two pairs");
#pragma unroll
    for (int r = 0; r < NR; ++r)
      put_pairs_n<XB, 2>(smem + L.xs + r * rstride, p.chunks, t, n, NP, [&](int k) { return scaled(r, k); });
  } else {
#pragma unroll
    for (int k = 0; k < kMaxPieces; ++k) {
      if (k * n + w * 32 >= NP) break;  // warp-uniform
      put_piece<F>(smem + L.xs, smem + L.xsum, t + k * n, NP, scaled(0, k));
    }
  }
}

// MoE routing by one warp (see RouteSpec). Lane l holds experts l V + i,
// i < V (contiguous, so a lower lane means a lower expert). The top k are
// chosen on the logits, keyed as order-preserving bits (softmax is
// monotonic: the probabilities' order, exact ties included; a pair of
// logits one ulp apart could round to one probability, where the CPU would
// take the lower index): each lane sorts its V keys, then k rounds of one
// max reduction and one ballot over the lanes' heads, the winning lane
// shifting its list (v11: 1.8 us of selection before). Then only the k chosen
// probabilities, as the CPU computes them: expf(l - max) / sum, the first
// round's key being the maximum (the exponential sum does not wait for the
// later rounds). Lane j < k ends with slot j. The expert ids go to shared
// memory (s_idx); block 0 writes ids and weights to global memory.
__device__ __forceinline__ unsigned order_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// red / nred (the one-pass staging, folded router): the staging warps'
// sums of x^2, ready at named barrier kRouteRmsBar (the staging threads
// arrive there, stage_fast); every block's routing warp meets it after its
// top k, block 0 takes 1 / rms(x) from them exactly as the staging does.
// Without them, block 0 reads x itself.
// issue(): called by the whole warp once the selection is in s_idx (the
// warp's own first routed loads go out before the weights are worked out).
// sel_bar: arrive at kRouteSelBar (blockDim.x threads) once s_idx holds the
// selection (the other warps wait there).
template <int V, typename Issue>
__device__ __forceinline__ void route_warp(const MatvecParams& p, int* s_idx, const float* red, int nred,
                                           Issue issue, bool sel_bar = false) {
  const RouteSpec& r = p.route;
  const TraceSpec& tr = p.trace;
  const int lane = threadIdx.x & 31, E = r.experts, k = r.k;
  // Only block 0 writes the weights (for the down projection); the others
  // need the selection alone.
  const bool weights = blockIdx.x == 0;
  float v[V], g = 0.f;
  if (r.acc) {
    // Folded router: fixed-point sums (unnormalised logits).
    constexpr float kInv = 1.f / kFoldUnit;
    if (E == 32 * V && reinterpret_cast<uintptr_t>(r.acc) % 16 == 0) {
      const ulonglong2* a2 = reinterpret_cast<const ulonglong2*>(r.acc) + lane * (V / 2);
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        const ulonglong2 t = __ldcg(a2 + i);
        v[2 * i] = __ll2float_rn(static_cast<long long>(t.x)) * kInv;
        v[2 * i + 1] = __ll2float_rn(static_cast<long long>(t.y)) * kInv;
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int e = lane * V + i;
        v[i] = e < E ? __ll2float_rn(static_cast<long long>(__ldcg(r.acc + e))) * kInv : -INFINITY;
      }
    }
    if (weights && r.acc_shared) g = __ll2float_rn(static_cast<long long>(__ldcg(r.acc + E))) * kInv;
  } else if (E == 32 * V && reinterpret_cast<uintptr_t>(r.logits) % 16 == 0) {
    const float4* l4 = reinterpret_cast<const float4*>(r.logits) + lane * (V / 4);
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      const float4 t = __ldcg(l4 + i);
      v[4 * i] = t.x;
      v[4 * i + 1] = t.y;
      v[4 * i + 2] = t.z;
      v[4 * i + 3] = t.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = lane * V + i;
      v[i] = e < E ? __ldcg(r.logits + e) : -INFINITY;
    }
  }
  if (!r.acc && r.shared_gate_logit && weights) g = __ldcg(r.shared_gate_logit);
  // Each lane sorts its V (key, slot) pairs, descending key and ascending
  // slot for equal keys (odd-even transposition: stable).
  unsigned key[V];
  int id[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    key[i] = lane * V + i < E ? order_key(v[i]) : 0u;
    id[i] = i;
  }
#pragma unroll
  for (int rr = 0; rr < V; ++rr)
#pragma unroll
    for (int i = rr & 1; i + 1 < V; i += 2) {
      const bool sw = key[i + 1] > key[i];
      const unsigned a = key[i], b = key[i + 1];
      const int ia = id[i], ib = id[i + 1];
      key[i] = sw ? b : a;
      key[i + 1] = sw ? a : b;
      id[i] = sw ? ib : ia;
      id[i + 1] = sw ? ia : ib;
    }
  if (tr.recs) {
    asm volatile("" ::"r"(key[0]));
    trace_clock(tr, 5);  // logits loaded and sorted per lane
  }
  // k rounds over the lanes' heads: the maximum, the lowest lane holding it
  // (the lowest expert), and that lane shifts its list by one (branchless).
  int my_e = 0;
  unsigned my_key = 0;
  float mx = 0.f, sum = 0.f;
  auto round = [&](int j) {
    const unsigned m = __reduce_max_sync(0xffffffffu, key[0]);
    const unsigned ball = __ballot_sync(0xffffffffu, key[0] == m);
    const int wl = __ffs(ball) - 1;
    const int wi = __shfl_sync(0xffffffffu, id[0], wl);
    if (lane == j) {
      my_e = wl * V + wi;
      my_key = m;
    }
    const bool win = lane == wl;
#pragma unroll
    for (int i = 0; i + 1 < V; ++i) {
      key[i] = win ? key[i + 1] : key[i];
      id[i] = win ? id[i + 1] : id[i];
    }
    key[V - 1] = win ? 0u : key[V - 1];
  };
  if (k == 8) {  // the model's k, unrolled (1,000 cycles against 1,600 in a probe)
#pragma unroll
    for (int j = 0; j < 8; ++j) round(j);
  } else {
    for (int j = 0; j < k; ++j) round(j);
  }
  if (lane < k) s_idx[lane] = my_e;
  if (tr.recs) {
    asm volatile("" ::"r"(my_e), "r"(my_key));
    trace_clock(tr, 6);  // top k chosen
  }
  __syncwarp();
  if (sel_bar) asm volatile("bar.arrive %0, %1;" ::"n"(kRouteSelBar), "r"(blockDim.x) : "memory");
  issue();
  float inv_r = 1.f;  // the folded logits' 1 / rms(h)
  if (r.acc && red) named_bar(kRouteRmsBar, blockDim.x);
  if (weights) {  // for the down projection
    if (r.acc) {
      float ss = 0.f;
      if (red) {
        for (int i = 0; i < nred; ++i) ss += red[i];
      } else {
        const int n4 = p.cols >> 2;
        for (int i = lane; i < n4; i += 32) {
          const float4 t = __ldcg(reinterpret_cast<const float4*>(p.x) + i);
          ss = fmaf(t.x, t.x, fmaf(t.y, t.y, fmaf(t.z, t.z, fmaf(t.w, t.w, ss))));
        }
        for (int i = 4 * n4 + lane; i < p.cols; i += 32) ss = fmaf(__ldcg(p.x + i), __ldcg(p.x + i), ss);
        ss = warp_sum(ss);
      }
      inv_r = 1.f / sqrtf(ss / static_cast<float>(p.cols) + p.eps);
      g *= inv_r;
    }
    mx = key_float(__shfl_sync(0xffffffffu, my_key, 0));  // slot 0 holds the maximum
#pragma unroll
    for (int i = 0; i < V; ++i) sum += lane * V + i < E ? expf((v[i] - mx) * inv_r) : 0.f;
    sum = warp_sum(sum);
    const float my_p = lane < k ? expf((key_float(my_key) - mx) * inv_r) / sum : 0.f;
    const float top = warp_sum(my_p);
    const float w = r.norm_topk ? my_p / top : my_p;
    if (lane < k) {
      r.sel_idx[lane] = my_e;
      r.sel_w[lane] = w;
    }
    if ((r.acc ? r.acc_shared : r.shared_gate_logit != nullptr) && lane == k) r.sel_w[k] = sigmoid(g);
  }
}

// The rows a warp owns in tile t (two rows; pointers valid even when the
// rows are past the job's end, where `valid` is false).
struct TileRows {
  const uint4* w0;
  const uint4* w1;
  const uint32_t* s0;
  const uint32_t* s1;
  float* out;
  int r0, valid, has_b;
  int job, slot;  // slot >= 0: the pointers still lack the routed expert's offset (tile_route)
  int job_end;    // the first tile past this job
};

__device__ __forceinline__ int tile_job(const MatvecParams& p, int t, int* base) {
  int j = 0, b = 0;
  while (j + 1 < p.njobs && t >= b + job_tiles(p.jobs[j].rows)) b += job_tiles(p.jobs[j++].rows);
  *base = b;
  return j;
}

// tr's row pointers (rows r0 and r0 + 1 of job J; row 0 where not valid).
template <bool kAffine>
__device__ __forceinline__ void tile_ptrs(const MatvecParams& p, const MatvecJob& J, TileRows& tr) {
  tr.out = J.out;
  const int r0 = tr.valid ? tr.r0 : 0, rb = tr.has_b ? tr.r0 + 1 : r0;
  tr.w0 = J.w + size_t(r0) * p.chunks;
  tr.w1 = J.w + size_t(rb) * p.chunks;
  tr.s0 = kAffine ? J.sb + size_t(r0) * p.groups : nullptr;
  tr.s1 = kAffine ? J.sb + size_t(rb) * p.groups : nullptr;
}

// Tile t's rows of a warp in two parts: everything the parameters give
// (tile_rows_pre; for the routed tile of a route launch before
// griddepcontrol.wait, so the job search is off the path after the routing),
// then the routed expert's offset (tile_route).
template <bool kAffine>
__device__ __forceinline__ TileRows tile_rows_pre(const MatvecParams& p, int t, int warp) {
  int base;
  const int j = tile_job(p, t, &base);
  const MatvecJob& J = p.jobs[j];
  TileRows tr;
  tr.job = j;
  tr.slot = J.slot;
  tr.job_end = base + job_tiles(J.rows);
  tr.r0 = (t - base) * kRowsPerTile + warp * 2;
  tr.valid = tr.r0 < J.rows;
  tr.has_b = tr.r0 + 1 < J.rows;
  tile_ptrs<kAffine>(p, J, tr);
  return tr;
}
template <bool kAffine>
__device__ __forceinline__ void tile_route(const MatvecParams& p, TileRows& tr, const int* sel) {
  if (tr.slot < 0) return;
  const long long e = sel[tr.slot];
  const long long dw = e * p.jobs[tr.job].w_expert_stride;
  tr.w0 += dw;
  tr.w1 += dw;
  if (kAffine) {
    const long long ds = e * p.jobs[tr.job].sb_expert_stride;
    tr.s0 += ds;
    tr.s1 += ds;
  }
  tr.slot = -1;
}
template <bool kAffine>
__device__ __forceinline__ TileRows tile_rows(const MatvecParams& p, int t, int warp, const int* sel) {
  TileRows tr = tile_rows_pre<kAffine>(p, t, warp);
  tile_route<kAffine>(p, tr, sel);
  return tr;
}
// The warp's rows of tile t = the tile after tr's: within the same job, the
// same rows 16 further on (no job search and no expert offset on the loop's
// path; one read of the job's row count, which the v12 A/B found free).
template <bool kAffine>
__device__ __forceinline__ TileRows tile_rows_next(const MatvecParams& p, const TileRows& tr, int t, int warp,
                                                   const int* sel) {
  if (t >= tr.job_end || !tr.has_b) return tile_rows<kAffine>(p, t, warp, sel);
  TileRows n = tr;
  const int rows = p.jobs[tr.job].rows;
  n.r0 = tr.r0 + kRowsPerTile;
  n.valid = n.r0 < rows;
  n.has_b = n.r0 + 1 < rows;
  if (!n.has_b) return tile_rows<kAffine>(p, t, warp, sel);
  const size_t dw = size_t(kRowsPerTile) * p.chunks;
  n.w0 += dw;
  n.w1 += dw;
  if (kAffine) {
    const size_t ds = size_t(kRowsPerTile) * p.groups;
    n.s0 += ds;
    n.s1 += ds;
  }
  return n;
}

// ---- The DeltaNet step in the in_proj (launch_matvec_dn) ----
// The in_proj (jobs 0-3: q|k|v, z, b, a) runs as clusters, one per key head
// g (dn_row_pair: which rows a cluster computes): the cluster computes the
// rows its key head's step needs, meets at the cluster barrier, and each
// block then runs one step block (value head, 32-column slice) on them, so
// the step is no launch of its own.
template <bool kAffine>
__device__ __forceinline__ TileRows dn_tile_rows(const MatvecParams& p, const DeltaNetParams& d, int g, int t,
                                                 int warp) {
  const DnRowPair rp = dn_row_pair(d, g, t * kRowsPerTile + warp * 2);
  const MatvecJob& J = p.jobs[rp.job];
  TileRows tr;
  tr.job = rp.job;
  tr.slot = -1;
  tr.job_end = 0;
  tr.valid = rp.n > 0;
  tr.has_b = rp.n > 1;
  tr.r0 = rp.row;
  tile_ptrs<kAffine>(p, J, tr);
  return tr;
}
// Shared memory past the matvec's (floats, from a 16-byte boundary): the
// step block's state slice [dk][32], its channels' conv taps and ring
// slots [2 dk + 32][K] each, then a_log and dt_bias of its head.
struct DnSmem {
  int state, taps, ring, consts, total;
};
__host__ __device__ inline DnSmem dn_smem_layout(const DeltaNetParams& d, int matvec_floats) {
  const int nch = 2 * d.dk + kDnCols;
  DnSmem l;
  l.state = (matvec_floats + 3) & ~3;
  l.taps = l.state + d.dk * kDnCols;
  l.ring = l.taps + nch * d.K;
  l.consts = l.ring + nch * d.K;
  l.total = l.consts + 2;
  return l;
}
// The step block's constants into shared memory by cp.async (nothing waits
// for them until the step: the block reaches griddepcontrol.wait at once).
__device__ __forceinline__ void dn_prefetch(const DeltaNetParams& d, float* smem, const DnSmem& l, int h, int cb,
                                            int pos) {
  using prefill_detail::cp_async16;
  using prefill_detail::cp_async4;
  const int nch = 2 * d.dk + kDnCols, K = d.K;
  const float* S = d.state + size_t(h) * d.dk * d.dv + cb * kDnCols;
  for (int i = threadIdx.x; i < d.dk * (kDnCols / 4); i += blockDim.x) {
    const int r = i / (kDnCols / 4), c = (i % (kDnCols / 4)) * 4;
    cp_async16(smem + l.state + r * kDnCols + c, S + size_t(r) * d.dv + c, 16);
  }
  for (int i = threadIdx.x; i < nch * K; i += blockDim.x) {
    const int ch = dn_channel(d, h, cb, i / K), t = i % K;
    cp_async4(smem + l.taps + i, d.conv_w + size_t(ch) * K + t, 4);
    // Not the slot this step writes (another block of the cluster may be
    // writing it while the copy is in flight; the conv does not read it).
    if (t != pos % K) cp_async4(smem + l.ring + i, d.conv_ring + size_t(ch) * K + t, 4);
  }
  if (threadIdx.x == 0) {
    cp_async4(smem + l.consts, d.a_log + h, 4);
    cp_async4(smem + l.consts + 1, d.dt_bias + h, 4);
  }
  prefill_detail::cp_async_commit();
}
// The step itself, after the cluster barrier (threads 0..kDnThreads-1; the
// same arithmetic as the step's own launch, deltanet_step_kernel<true>).
constexpr int kDnStepBar = 5;
__device__ __forceinline__ void dn_step_in_block(const DeltaNetParams& d, const float* smem, const DnSmem& l,
                                                 int h, int cb, int pos) {
  const int tid = threadIdx.x, j = tid & (kDnCols - 1), qg = tid / kDnCols, K = d.K;
  __shared__ float qs[kDnMaxDk], ks[kDnMaxDk], vs[kDnCols];
  DnConv cv;
  dn_conv_pre(
      d, h, cb, tid, pos, [&](int i, int) { return smem + l.taps + i * K; },
      [&](int i, int) { return smem + l.ring + i * K; }, cv);
  const float2 ba = dn_conv_finish<true>(d, h, cb, tid, pos, cv, qs, ks, vs);
  float sr[kDnMaxRows];
  const int nr = d.dk / kDnRowGroups;
#pragma unroll
  for (int r = 0; r < kDnMaxRows; ++r)
    if (r < nr) sr[r] = smem[l.state + (qg + kDnRowGroups * r) * kDnCols + j];
  named_bar(kDnStepBar, kDnThreads);
  dn_update_fused(d, h, cb, tid, sr, qs, ks, vs, ba.x, ba.y, smem[l.consts], smem[l.consts + 1],
                  [] { named_bar(kDnStepBar, kDnThreads); });
}

// One step of a warp: two rows x two chunks (c0 and c0 + 32) per lane.
struct ItemRegs {
  uint4 w[2][2];      // [chunk][row]
  uint32_t s[2][2];   // [chunk][row]
};

template <bool kAffine>
__device__ __forceinline__ void load_item(const TileRows& tr, int c0, int chunks, int cpg_sh, ItemRegs& it) {
  if (!tr.valid) return;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = c0 + 32 * u;
    if (c < chunks) {
      it.w[u][0] = ld_stream(tr.w0 + c);
      it.w[u][1] = ld_stream(tr.w1 + c);
      if (kAffine) {
        it.s[u][0] = ld_stream(tr.s0 + (c >> cpg_sh));
        it.s[u][1] = ld_stream(tr.s1 + (c >> cpg_sh));
      }
    }
  }
}

template <QFmt F>
__device__ __forceinline__ void compute_item(const ItemRegs& it, int c0, int chunks, int sb_f16,
                                             const float4* xs, const float* xsum, float (&acc)[2]) {
  using CF = ChunkFmt<F>;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = c0 + 32 * u;
    if (c < chunks) {
      float d[2];
      chunk_dot<F, 2>(it.w[u], xs, c, d);
      if constexpr (CF::affine) {
        const float xsc = xsum[c];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          acc[r] += CF::affine_term(decode_sb(it.s[u][r], sb_f16), d[r], xsc);
        }
      } else {
        acc[0] += d[0];
        acc[1] += d[1];
      }
    }
  }
}

// compute_item on integer inputs (XB bits, q4).
template <int XB>
__device__ __forceinline__ void compute_item_x(const ItemRegs& it, int c0, int chunks, int sb_f16, const uint4* xq,
                                               const float2* xm, float (&acc)[2]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = c0 + 32 * u;
    if (c < chunks) {
      int d[2];
      chunk_dot_x<XB, 2>(it.w[u], xq, c, d);
      const float2 meta = xm[c];
#pragma unroll
      for (int r = 0; r < 2; ++r) acc[r] += x_term(decode_sb(it.s[u][r], sb_f16), d[r], meta);
    }
  }
}

// The router fold (RouterFold). A fold launch runs one tile per block, so a
// block's 16 rows sit in one scale group g (groups are at least 16 wide):
// its part of output e is s[e][g] D_e + b[e][g] Y with D_e = sum q[e][r] y_r
// and Y = sum y_r over the rows, y_r = g_r h_r. Lane l of a warp holds the
// code words l + 32 i (outputs 4 (l + 32 i) .. + 3) of the warp's two rows,
// loaded before the wait, and takes the warp's D in the epilogue; thread t
// holds the scale/bias words of outputs t and t + 256 and finishes them.
constexpr int kFoldWords = kFoldMaxOut / 128;
constexpr int kFoldPerThread = (kFoldMaxOut + kMatvecThreads - 1) / kMatvecThreads;
struct FoldRegs {
  uint32_t q0[kFoldWords], q1[kFoldWords];
  uint32_t sb[kFoldPerThread];
  float g0, g1;
};
__device__ __forceinline__ void fold_load(const RouterFold& f, const TileRows& tr, int lane, int block_row0,
                                          FoldRegs& fr) {
  const int ldw = f.ld >> 2;
  const uint32_t* q0 = f.q + size_t(tr.valid ? tr.r0 : 0) * ldw;
  const uint32_t* q1 = tr.has_b ? q0 + ldw : q0;
#pragma unroll
  for (int i = 0; i < kFoldWords; ++i) {
    const int w = lane + 32 * i;
    const bool ok = tr.valid && w < ldw;
    fr.q0[i] = ok ? __ldg(q0 + w) : 0u;
    fr.q1[i] = ok ? __ldg(q1 + w) : 0u;
  }
  fr.g0 = tr.valid ? __ldg(f.g + tr.r0) : 0.f;
  fr.g1 = tr.has_b ? __ldg(f.g + tr.r0 + 1) : 0.f;
  const uint32_t* sb = f.sb + size_t(block_row0 >> f.gshift) * f.ld;
#pragma unroll
  for (int u = 0; u < kFoldPerThread; ++u) {
    const int e = threadIdx.x + kMatvecThreads * u;
    fr.sb[u] = e < f.n ? __ldg(sb + e) : 0u;
  }
}

// A warp's two row sums (a0: row 0, a1: row 1 of each lane's partials) by a
// reduce-scatter: one exchange at distance 16 (lanes 0-15 keep row 0, 16-31
// row 1), then four levels; lane 0 ends with row 0, lane 16 with row 1 (5
// shuffles instead of 2 x 5).
__device__ __forceinline__ float row_pair_sum(float a0, float a1, bool upper) {
  float v = (upper ? a1 : a0) + __shfl_xor_sync(0xffffffffu, upper ? a0 : a1, 16);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// compute_item_x over NR input rows (MatvecParams::nrows): the item's
// weights and scales decoded once, each row's sums as compute_item_x's.
template <int XB, int NR>
__device__ __forceinline__ void compute_item_xr(const ItemRegs& it, int c0, int chunks, int sb_f16,
                                                const float* xs0, int rstride, float (&acc)[NR][2]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = c0 + 32 * u;
    if (c < chunks) {
      const float2 sb0 = decode_sb(it.s[u][0], sb_f16), sb1 = decode_sb(it.s[u][1], sb_f16);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float* xr = xs0 + r * rstride;
        int d[2];
        chunk_dot_x<XB, 2>(it.w[u], reinterpret_cast<const uint4*>(xr), c, d);
        const float2 meta = XCodes<XB>::meta(xr, chunks)[c];
        acc[r][0] += x_term(sb0, d[0], meta);
        acc[r][1] += x_term(sb1, d[1], meta);
      }
    }
  }
}
// A row's staged integer input (floats; codes, then the chunks' float2s),
// 16-byte aligned: the shared memory of one row of a several-row launch.
__host__ __device__ inline int matvec_row_floats(int chunks, int xbits) {
  return ((xbits == 16 ? 16 : 8) * chunks + 2 * chunks + 3) & ~3;
}

// Route: the launch has a route prologue (a separate instantiation, so the
// other matvecs keep their registers).
// Dn: the in_proj with the DeltaNet step (dnp; see dn_tile_rows).
// NR > 1: NR input rows (MatvecParams::nrows), integer inputs only.
template <QFmt F, bool Route, bool Fast, bool Fold = false, int XB = 0, bool Dn = false, int NR = 1>
__device__ __forceinline__ void matvec_body(const MatvecParams& p, const MatvecDnParams* dnp = nullptr) {
  static_assert(XB == 0 || (F == QFmt::Q4 && Fast), "integer inputs: q4 with the one-pass staging");
  static_assert(NR == 1 || (XB != 0 && !Route && !Fold && !Dn), "several rows: plain integer-input launches");
  using CF = ChunkFmt<F>;
  extern __shared__ __align__(16) float smem[];
  const int nseg = p.pro == Prologue::None ? 0 : p.cols / p.seg;
  const MatvecSmem L = matvec_smem_layout(p.chunks, CF::FPC, p.cols, nseg);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = p.chunks;
  const int cpg_sh = __ffs(p.chunks_per_group) - 1;  // a power of two (weights_upload)
  trace_mark(p.trace, 0);

  int total = 0;
  for (int j = 0; j < p.njobs; ++j) total += job_tiles(p.jobs[j].rows);
  // Tiles per block: balanced (total / grid, the first total % grid blocks
  // one more: they are dispatched to distinct SMs first, so an SM's two
  // blocks differ by at most one tile) or, with p.balanced == 0, equal
  // runs of ceil(total / grid).
  int t_begin, t_end;
  // Dn: the block's key head g (its cluster), its tiles (DnBlockTiles: the
  // loop's tile i is layout tile dn_tile(i)), and the step block it runs
  // (value head dn_h, column slice dn_cb; dn_step false: none).
  const DeltaNetParams* dn = Dn ? &dnp->dn : nullptr;
  int dn_g = 0, dn_h = 0, dn_cb = 0;
  bool dn_step = false;
  DnBlockTiles dt{};
  auto dn_tile = [&](int i) { return i < dt.se - dt.sb ? dt.sb + i : dt.zb + i - (dt.se - dt.sb); };
  if constexpr (Dn) {
    const int cs = dnp->cluster, rank = blockIdx.x % cs;
    dn_g = blockIdx.x / cs;
    dn_step = rank < dn_step_blocks(*dn);
    dn_h = dn_g * (dn->nv / dn->nk) + rank / (dn->dv / kDnCols);
    dn_cb = rank % (dn->dv / kDnCols);
    dt = dn_block_tiles(*dn, cs, rank);
    t_begin = 0;
    t_end = (dt.se - dt.sb) + (dt.ze - dt.zb);
  } else if (p.balanced) {
    const int base = total / gridDim.x, extra = total % gridDim.x, b = blockIdx.x;
    t_begin = b * base + min(b, extra);
    t_end = t_begin + base + (b < extra ? 1 : 0);
  } else {
    const int per_block = (total + gridDim.x - 1) / gridDim.x;
    t_begin = blockIdx.x * per_block;
    t_end = min(total, t_begin + per_block);
  }
  // A warp walks (tile, chunk step) items; the next item's loads are issued
  // before the current one is computed, and the first item's before the
  // predecessor kernel has even finished (weights do not depend on it).
  const int niter = (chunks + 63) / 64;
  const int nq = t_end > t_begin ? (t_end - t_begin) * niter : 0;
  __shared__ int s_sel_idx[32];  // the route prologue's expert ids
  ItemRegs cur, nxt;
  TileRows tr_cur, tr_nxt;
  int base;
  const bool first_routed = !Dn && nq > 0 && p.jobs[tile_job(p, t_begin, &base)].slot >= 0;
  if (nq > 0) {
    if constexpr (Dn) tr_cur = dn_tile_rows<CF::affine>(p, *dn, dn_g, dn_tile(t_begin), warp);
    else tr_cur = tile_rows_pre<CF::affine>(p, t_begin, warp);
    if (!first_routed) load_item<CF::affine>(tr_cur, lane, chunks, cpg_sh, cur);
  }
  // The router fold's codes and scales (constants: before the wait).
  FoldRegs fr;
  float fy0 = 0.f, fy1 = 0.f;
  if constexpr (Fold) {
    if (nq > 0) fold_load(p.fold, tr_cur, lane, t_begin * kRowsPerTile, fr);
  }
  if (p.zero_acc && blockIdx.x == 0)
    for (int i = tid; i < p.zero_n; i += blockDim.x) p.zero_acc[i] = 0ull;
  // And the block's second tile into L2 (not a routed one: measured, that
  // costs more than it saves once the expert is known).
  if (!Dn && p.l2_prefetch && t_begin + 1 < t_end) {
    const MatvecJob& J = p.jobs[tile_job(p, t_begin + 1, &base)];
    if (J.slot < 0) {
      const int r0 = (t_begin + 1 - base) * kRowsPerTile;
      const int nrows = min(kRowsPerTile, J.rows - r0);
      const int lines_per_row = (chunks * 16 + 127) / 128;
      for (int i = tid; i < nrows * lines_per_row; i += blockDim.x) {
        const int r = r0 + i / lines_per_row, l = i % lines_per_row;
        prefetch_l2(reinterpret_cast<const char*>(J.w + size_t(r) * chunks) + l * 128);
      }
    }
  }
  StageRegs sr;
  const int st0 = Route ? 32 : 0;  // the staging threads: [st0, blockDim.x)
  if constexpr (Fast) {
    if (tid >= st0) stage_regs_load<XB != 0>(p, tid - st0, blockDim.x - st0, sr);
  } else if (p.pro != Prologue::None) {
    for (int i = tid; i < p.cols; i += blockDim.x) smem[L.nw + i] = __ldg(p.norm_w + i % p.seg);
  }
  DnSmem dl{};
  int dn_pos = 0;
  if constexpr (Dn) {
    dl = dn_smem_layout(*dn, L.total);
    dn_pos = dn->ctrl->pos;  // written by the previous token's lm_head only
    if (dn_step) dn_prefetch(*dn, smem, dl, dn_h, dn_cb, dn_pos);
  }
  __shared__ float s_red[NR * (kMatvecThreads / 32)];
  const int rstride = NR > 1 ? matvec_row_floats(chunks, XB) : 0;
  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);
  // x is loaded while warp 0 routes; the routed tiles' loads go out as soon
  // as the selection is in shared memory, before the rest of the staging
  // (warp 0's own straight after its selection, before block 0 works out
  // the weights).
  auto issue_first = [&]() {
    if (Route && first_routed) {
      tile_route<CF::affine>(p, tr_cur, s_sel_idx);
      load_item<CF::affine>(tr_cur, lane, chunks, cpg_sh, cur);
    }
  };
  float ss = 0.f;
  if constexpr (Fast) {
    // A folded router's RMS comes from the staging's sums (Norm prologue).
    const bool rms_red = Route && p.route.acc && p.pro == Prologue::Norm;
    if (Route && warp == 0) {
      const float* red = rms_red ? s_red : nullptr;
      const int nred = (blockDim.x - st0) >> 5;
      if (p.route.experts <= 256) route_warp<8>(p, s_sel_idx, red, nred, issue_first, true);
      else route_warp<kMaxRouteExperts / 32>(p, s_sel_idx, red, nred, issue_first, true);
    } else {
      stage_fast<F, XB, NR>(p, smem, L, tid - st0, blockDim.x - st0, 1, s_red, sr, rms_red, rstride);
      if constexpr (Route) {
        // Wait for the selection only, then issue the routed loads (the
        // routing warp still works out the weights; v18).
        named_bar(kRouteSelBar, blockDim.x);
        issue_first();
      }
    }
    trace_clock(p.trace, 4);
    __syncthreads();
  } else if constexpr (Route) {
    if (warp == 0) {
      if (p.route.experts <= 256) route_warp<8>(p, s_sel_idx, nullptr, 0, issue_first);
      else route_warp<kMaxRouteExperts / 32>(p, s_sel_idx, nullptr, 0, issue_first);
      trace_clock(p.trace, 4);
      ss = 0.f;
    } else {
      ss = stage_load(p, smem + L.raw, tid - 32, blockDim.x - 32);
    }
    __syncthreads();
    if (warp != 0) issue_first();
  } else {
    ss = stage_load(p, smem + L.raw, tid, blockDim.x);
    trace_clock(p.trace, 4);
  }
  if constexpr (!Fast) stage_finish<F>(p, smem, L, ss);
  trace_mark(p.trace, 2);
  const float4* xs = reinterpret_cast<const float4*>(smem + L.xs);
  const float* xsum = smem + L.xsum;
  const uint4* xq = reinterpret_cast<const uint4*>(smem + L.xs);
  const float2* xm = XCodes<XB == 0 ? 8 : XB>::meta(smem + L.xs, chunks);

  float best_v = -INFINITY;
  int best_i = 0x7fffffff;
  float acc[2] = {0.f, 0.f};
  float accr[NR][2];  // NR > 1: the rows' sums
#pragma unroll
  for (int r = 0; r < NR; ++r) accr[r][0] = accr[r][1] = 0.f;
  for (int q = 0, tl = 0, k = 0; q < nq; ++q) {
    // Item q is (tile tl, step k); q + 1 is (tl1, k1), without a division.
    const int tl1 = k + 1 == niter ? tl + 1 : tl, k1 = k + 1 == niter ? 0 : k + 1;
    if (q + 1 < nq) {
      if constexpr (Dn)
        tr_nxt = k1 == 0 ? dn_tile_rows<CF::affine>(p, *dn, dn_g, dn_tile(t_begin + tl1), warp) : tr_cur;
      else tr_nxt = k1 == 0 ? tile_rows_next<CF::affine>(p, tr_cur, t_begin + tl1, warp, s_sel_idx) : tr_cur;
      load_item<CF::affine>(tr_nxt, 64 * k1 + lane, chunks, cpg_sh, nxt);
    }
    if (tr_cur.valid) {
      if constexpr (NR > 1) compute_item_xr<XB, NR>(cur, 64 * k + lane, chunks, p.sb_f16, smem + L.xs, rstride, accr);
      else if constexpr (XB != 0) compute_item_x<XB>(cur, 64 * k + lane, chunks, p.sb_f16, xq, xm, acc);
      else compute_item<F>(cur, 64 * k + lane, chunks, p.sb_f16, xs, xsum, acc);
    }
    if (q == 0) trace_clock(p.trace, 7);
    if (NR > 1 && k == niter - 1 && tr_cur.valid) {
      // Each input row's two sums as below (Store, Add or SwiGLU), its
      // outputs at out + row * ldo.
      const bool upper = lane & 16;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const float v = row_pair_sum(accr[i][0], accr[i][1], upper);
        const int r = tr_cur.r0 + (upper ? 1 : 0);
        float* out = tr_cur.out + i * p.ldo;
        if (p.epi == Epilogue::SwiGLU) {
          const float up = __shfl_sync(0xffffffffu, v, 16);
          if (lane == 0) out[r >> 1] = silu(v) * up;
        } else if ((lane & 15) == 0 && (!upper || tr_cur.has_b)) {
          if (p.epi == Epilogue::Store) out[r] = v;
          else out[r] += v;
        }
      }
    } else if (k == niter - 1 && tr_cur.valid) {
      // The two rows' sums (lane 0: row 0, lane 16: row 1).
      const bool upper = lane & 16;
      const float v = row_pair_sum(acc[0], acc[1], upper);
      const int r = tr_cur.r0 + (upper ? 1 : 0);
      if (p.epi == Epilogue::SwiGLU) {
        const float up = __shfl_sync(0xffffffffu, v, 16);
        if (lane == 0) tr_cur.out[r >> 1] = silu(v) * up;
      } else {
        float hn = 0.f;  // the stored value (Fold: h after the residual add)
        if ((lane & 15) == 0 && (!upper || tr_cur.has_b)) {
          if (p.epi == Epilogue::Store) tr_cur.out[r] = v;
          else tr_cur.out[r] = hn = tr_cur.out[r] + v;
          if (p.argmax && (v > best_v || (v == best_v && r < best_i))) {
            best_v = v;
            best_i = r;
          }
        }
        if constexpr (Fold) {  // the warp's y (one tile per block: D after the loop)
          fy0 = __shfl_sync(0xffffffffu, hn, 0) * fr.g0;
          fy1 = __shfl_sync(0xffffffffu, hn, 16) * fr.g1;
        }
      }
    }
    if (k == niter - 1) {
      acc[0] = 0.f;
      acc[1] = 0.f;
#pragma unroll
      for (int r = 0; r < NR; ++r) accr[r][0] = accr[r][1] = 0.f;
      // Dn: the block's step tiles stored: arrive (its z tiles follow).
      if (Dn && tl == dt.se - dt.sb - 1) asm volatile("barrier.cluster.arrive.release;" ::: "memory");
    }
    cur = nxt;
    tr_cur = tr_nxt;
    tl = tl1;
    k = k1;
  }

  if constexpr (Fold) {
    // The warps' D and Y through the staging memory (free once every warp
    // has left the loop), summed in warp order; then one fixed-point atomic
    // add per output (integer adds: the result does not depend on the
    // blocks' order).
    if (nq > 0) {
      const int ld = p.fold.ld, nw = kMatvecThreads / 32;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kFoldWords; ++i) {
        const int e = 4 * (lane + 32 * i);
        float d[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) d[b] = fmaf(byte_f(fr.q0[i], 0x7650 + b), fy0, byte_f(fr.q1[i], 0x7650 + b) * fy1);
        if (e < ld) *reinterpret_cast<float4*>(smem + warp * ld + e) = make_float4(d[0], d[1], d[2], d[3]);
      }
      if (lane == 0) smem[nw * ld + warp] = fy0 + fy1;
      __syncthreads();
      float y = 0.f;
#pragma unroll
      for (int w = 0; w < nw; ++w) y += smem[nw * ld + w];
#pragma unroll
      for (int u = 0; u < kFoldPerThread; ++u) {
        const int e = tid + kMatvecThreads * u;
        if (e < p.fold.n) {
          float d = 0.f;
#pragma unroll
          for (int w = 0; w < nw; ++w) d += smem[w * ld + e];
          const float2 sc = decode_sb(fr.sb[u], p.fold.sb_f16);
          const long long q = __float2ll_rn(fmaf(sc.x, d, sc.y * y) * kFoldUnit);
          if (q) atomicAdd(p.fold.acc + e, static_cast<unsigned long long>(q));
        }
      }
    }
  }

  if constexpr (Dn) {
    // Every block of the cluster has stored its step tiles (the arrive
    // above, or here for a block without any; release / acquire at cluster
    // scope, so the rows' stores are seen by the cluster's blocks, which
    // read them from L2): the step block.
    if (dt.se == dt.sb) asm volatile("barrier.cluster.arrive.release;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
    if (dn_step) {
      prefill_detail::cp_async_wait<0>();
      __syncthreads();
      if (tid < kDnThreads) dn_step_in_block(*dn, smem, dl, dn_h, dn_cb, dn_pos);
    }
  }

  if (p.argmax) {
    __shared__ unsigned long long s_key[kMatvecThreads / 32];
    unsigned long long key = best_i == 0x7fffffff ? 0ull : argmax_key(best_v, best_i);  // lanes 0 and 16
    key = max(key, __shfl_xor_sync(0xffffffffu, key, 16));
    if (lane == 0) s_key[warp] = key;
    __syncthreads();
    if (tid == 0) {
      unsigned long long k = 0;
      for (int w = 0; w < (int)(blockDim.x >> 5); ++w) k = max(k, s_key[w]);
      if (k) atomicMax(&p.ctrl->argmax_key, k);
    }
  }
  if (p.fin != Finish::None) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (s_last) {
      __threadfence();
      if (tid == 0) {
        p.ctrl->pos += 1;
        *p.counter = 0;
      }
    }
  }
  trace_end(p.trace);
}

// No register cap (about 95 registers for q4: 2 blocks per SM); _3: capped
// at 85 registers for 3 blocks per SM (a few bytes of spills).
template <QFmt F, bool Route, bool Fast, int XB = 0>
__global__ void __launch_bounds__(kMatvecThreads) matvec_kernel(const __grid_constant__ MatvecParams p) {
  matvec_body<F, Route, Fast, false, XB>(p);
}
template <QFmt F, bool Route>
__global__ void __launch_bounds__(kMatvecThreads, 3) matvec_kernel_3(const __grid_constant__ MatvecParams p) {
  matvec_body<F, Route, false>(p);
}
// The in_proj with the DeltaNet step (launch_matvec_dn; cluster dims at launch).
template <QFmt F, bool Fast, int XB = 0>
__global__ void __launch_bounds__(kMatvecThreads) matvec_dn_kernel(const __grid_constant__ MatvecDnParams p) {
  matvec_body<F, false, Fast, false, XB, true>(p.mv, &p);
}
// Several input rows (MatvecParams::nrows; no route, fold or argmax).
template <int XB, int NR>
__global__ void __launch_bounds__(kMatvecThreads) matvec_rows_kernel(const __grid_constant__ MatvecParams p) {
  matvec_body<QFmt::Q4, false, true, false, XB, false, NR>(p);
}
// With the router fold (RouterFold) in the epilogue.
template <QFmt F, bool Fast, int XB = 0>
__global__ void __launch_bounds__(kMatvecThreads) matvec_fold_kernel(const __grid_constant__ MatvecParams p) {
  matvec_body<F, false, Fast, true, XB>(p);
}

// out[r] += sum_j coef_j * (W_j x_j)[r]. p.split warps (1, 2 or 4) own two
// output rows and split the (expert, chunk) items of both, U per lane and
// step, so all experts' rows for one output are summed in registers, the
// warps' partial sums added in shared memory in warp order: no atomics.
template <QFmt F, int U, int XB = 0>
__device__ __forceinline__ void moe_down_body(const MoeDownParams& p) {
  static_assert(XB == 0 || F == QFmt::Q4, "integer inputs: q4 only");
  using CF = ChunkFmt<F>;
  extern __shared__ __align__(16) float smem[];
  __shared__ const uint4* s_w[kMaxJobs];
  __shared__ const uint32_t* s_sb[kMaxJobs];
  __shared__ float s_coef[kMaxJobs];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = p.chunks, items = p.njobs * chunks;
  const int cpg_sh = __ffs(p.chunks_per_group) - 1;  // a power of two (weights_upload)
  // p.split warps share a row pair, each over its own range of items (see
  // launch_moe_down_t); a tile is the block's 8 / split row pairs.
  const int W = p.split, TR = 2 * (kMatvecThreads / 32 / W);
  const int pair = warp / W, sub = warp - pair * W;
  const int per = (items + W - 1) / W, ibeg = sub * per, iend = min(items, ibeg + per);
  const int tiles = (p.rows + TR - 1) / TR;
  const int per_block = (tiles + gridDim.x - 1) / gridDim.x;
  const int t_begin = blockIdx.x * per_block, t_end = min(tiles, t_begin + per_block);
  trace_mark(p.trace, 0);

  // Prefetch the rows of fixed (shared-expert) jobs of the first tile.
  if (t_begin < t_end) {
    const int r0 = t_begin * kRowsPerTile, nrows = min(kRowsPerTile, p.rows - r0);
    const int lpr = (chunks * 16 + 127) / 128;
    for (int j = 0; j < p.njobs; ++j) {
      if (p.jobs[j].expert) continue;
      for (int i = tid; i < nrows * lpr; i += blockDim.x)
        prefetch_l2(reinterpret_cast<const char*>(p.jobs[j].w + size_t(r0 + i / lpr) * chunks) +
                    (i % lpr) * 128);
    }
  }
  // The expert ids are written by the gate_up launch (the predecessor) as
  // soon as its routing is done, long before it ends: read them before the
  // wait, speculatively, and send the first step's weight loads out at once;
  // after the wait the ids are read again, and where one differs (a stale
  // read) the loads are issued again after the staging. The weights are
  // constants, so a matching id means the right data (v13). An id read out
  // of the stack's range counts as expert 0 (then it mismatches).
  __shared__ int s_e[kMaxJobs];
  __shared__ int s_redo;
  if (tid < p.njobs) {
    const MoeDownJob& J = p.jobs[tid];
    int e = 0;
    if (J.expert && p.spec_ids) {
      e = __ldcg(J.expert);
      if (p.spec_ids == 2) e = J.experts > 0 ? (e + 1) % J.experts : e + 1;  // the test of a stale read
      if (static_cast<unsigned>(e) >= static_cast<unsigned>(J.experts)) e = 0;
    }
    s_e[tid] = e;
    s_w[tid] = J.w + e * J.w_expert_stride;
    s_sb[tid] = CF::affine ? J.sb + e * J.sb_expert_stride : nullptr;
  }
  if (tid == 0) s_redo = 0;
  __syncthreads();
  // it / chunks as a multiply-high (exact: it and chunks below 2^16).
  const uint32_t cmag = static_cast<uint32_t>((0x100000000ull + chunks - 1) / chunks);
  auto job_of = [&](int it) { return static_cast<int>(__umulhi(static_cast<uint32_t>(it), cmag)); };
  auto load = [&](int tl, int k, uint4 (&w)[U][2], uint32_t (&sv)[U][2]) {
    const int r0 = (t_begin + tl) * TR + pair * 2;
    if (r0 >= p.rows) return;
    const int rb = r0 + 1 < p.rows ? r0 + 1 : r0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int it = ibeg + 32 * U * k + lane + 32 * u;
      if (it < iend) {
        const int jj = job_of(it), c = it - jj * chunks;
        const uint4* wj = s_w[jj];
        w[u][0] = ld_stream(wj + size_t(r0) * chunks + c);
        w[u][1] = ld_stream(wj + size_t(rb) * chunks + c);
        if constexpr (CF::affine) {
          const uint32_t* sj = s_sb[jj];
          sv[u][0] = ld_stream(sj + size_t(r0) * p.groups + (c >> cpg_sh));
          sv[u][1] = ld_stream(sj + size_t(rb) * p.groups + (c >> cpg_sh));
        }
      }
    }
  };
  const int niter = (per + 32 * U - 1) / (32 * U);
  const int nq = t_end > t_begin ? (t_end - t_begin) * niter : 0;
  uint4 wc[U][2], wn[U][2];
  uint32_t sc[U][2], sn[U][2];
#pragma unroll
  for (int u = 0; u < U; ++u) sc[u][0] = sc[u][1] = sn[u][0] = sn[u][1] = 0;
  if (nq > 0 && p.spec_ids) load(0, 0, wc, sc);

  pdl_wait();
  pdl_launch_dependents();
  trace_mark(p.trace, 1);

  if (tid < p.njobs) {
    const MoeDownJob& J = p.jobs[tid];
    const int e = J.expert ? __ldcg(J.expert) : 0;
    if (!p.spec_ids || e != s_e[tid]) {
      s_w[tid] = J.w + static_cast<long long>(e) * J.w_expert_stride;
      s_sb[tid] = CF::affine ? J.sb + static_cast<long long>(e) * J.sb_expert_stride : nullptr;
      s_redo = 1;
    }
    s_coef[tid] = J.coef ? *J.coef : 1.f;
  }
  // Stage every job's input, item = job * chunks + chunk.
  const int cols = p.cols, per_job = chunks * CF::FPC;
  const int total_in = p.njobs * per_job;
  float* xsum = smem + items * CF::FPC;
  const float4* xs = reinterpret_cast<const float4*>(smem);
  if (p.fast_stage) {
    // One pass: thread t owns the float4 pieces t + k * blockDim.x of the
    // (job, chunk) inputs, all loads in flight at once; a chunk's sum over
    // the PPC adjacent lanes that hold its pieces.
    constexpr int KP = kDownPieces;
    const int NP = items * CF::PPC, nthr = blockDim.x, w = tid >> 5;
    float4 v[KP];
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int f = stage_piece<XB != 0>(tid, k, nthr);
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (f < NP) {
        const int item = f / CF::PPC, jj = item / chunks, within = (item - jj * chunks) * CF::FPC + (f % CF::PPC) * 4;
        if (within < cols) v[k] = *reinterpret_cast<const float4*>(p.jobs[jj].x + within);
      }
    }
    if constexpr (XB != 0) {
      static_assert(KP == 6, "three pairs");
      put_pairs_n<XB, 3>(smem, items, tid, nthr, NP, [&](int k) { return v[k]; });
    } else {
#pragma unroll
      for (int k = 0; k < KP; ++k) {
        if (k * nthr + w * 32 >= NP) break;  // warp-uniform
        put_piece<F>(smem, xsum, tid + k * nthr, NP, v[k]);
      }
    }
    __syncthreads();
  }
  // (Integer inputs run only with the one-pass staging: launch_moe_down_t.)
  for (int i0 = p.fast_stage ? total_in : tid; i0 < total_in; i0 += blockDim.x * 8) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * blockDim.x;
      const int jj = i / per_job, within_job = i - jj * per_job;
      v[u] = (i < total_in && within_job < cols) ? p.jobs[jj].x[within_job] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i >= total_in) break;
      const int jj = i / per_job, within_job = i - jj * per_job;
      const int item = jj * chunks + within_job / CF::FPC;
      smem[CF::slot(item, within_job % CF::FPC)] = v[u];
    }
  }
  if (!p.fast_stage) __syncthreads();
  if (CF::affine && !p.fast_stage) {
    for (int c = tid; c < items; c += blockDim.x) {
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < CF::PPC; ++q) {
        const float4 v = xs[c * CF::PPC + q];
        s += (v.x + v.y) + (v.z + v.w);
      }
      xsum[c] = s;
    }
    __syncthreads();
  }
  trace_mark(p.trace, 2);

  __shared__ float s_part[kMatvecThreads / 32][2];
  // Items of a warp: (tile, step) with U (expert, chunk) items per lane per
  // step, from its range [ibeg, iend). The first step's loads, unless they
  // went out before the wait with the right experts.
  if (nq > 0 && s_redo) load(0, 0, wc, sc);
  float acc[2] = {0.f, 0.f};
  for (int q = 0, tl = 0, k = 0; q < nq; ++q) {
    const int tl1 = k + 1 == niter ? tl + 1 : tl, k1 = k + 1 == niter ? 0 : k + 1;
    const int r0 = (t_begin + tl) * TR + pair * 2;
    if (q + 1 < nq) load(tl1, k1, wn, sn);
    if (r0 < p.rows) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int it = ibeg + 32 * U * k + lane + 32 * u;
        if (it < iend) {
          const float coef = s_coef[job_of(it)];
          if constexpr (XB != 0) {
            int d[2];
            chunk_dot_x<XB, 2>(wc[u], reinterpret_cast<const uint4*>(smem), it, d);
            const float2 meta = XCodes<XB>::meta(smem, items)[it];
#pragma unroll
            for (int r = 0; r < 2; ++r) acc[r] = fmaf(coef, x_term(decode_sb(sc[u][r], p.sb_f16), d[r], meta), acc[r]);
          } else {
            float d[2];
            chunk_dot<F, 2>(wc[u], xs, it, d);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float v = d[r];
              if constexpr (CF::affine) {
                v = CF::affine_term(decode_sb(sc[u][r], p.sb_f16), d[r], xsum[it]);
              }
              acc[r] = fmaf(coef, v, acc[r]);
            }
          }
        }
      }
    }
    if (k == niter - 1) {  // the same step in every warp of the block
      acc[0] = warp_sum(acc[0]);
      acc[1] = warp_sum(acc[1]);
      if (W == 1) {
        if (lane == 0 && r0 < p.rows) {
          p.out[r0] += acc[0];
          if (r0 + 1 < p.rows) p.out[r0 + 1] += acc[1];
        }
      } else {
        // The row pair's W partial sums, added in sub order.
        if (lane == 0) {
          s_part[warp][0] = acc[0];
          s_part[warp][1] = acc[1];
        }
        __syncthreads();
        if (sub == 0 && lane == 0 && r0 < p.rows) {
          float t0 = 0.f, t1 = 0.f;
          for (int j = 0; j < W; ++j) {
            t0 += s_part[warp + j][0];
            t1 += s_part[warp + j][1];
          }
          p.out[r0] += t0;
          if (r0 + 1 < p.rows) p.out[r0 + 1] += t1;
        }
        __syncthreads();
      }
      acc[0] = acc[1] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        wc[u][r] = wn[u][r];
        sc[u][r] = sn[u][r];
      }
    tl = tl1;
    k = k1;
  }
  trace_end(p.trace);
}
template <QFmt F, int U, int XB = 0>
__global__ void __launch_bounds__(kMatvecThreads) moe_down_kernel(const __grid_constant__ MoeDownParams p) {
  moe_down_body<F, U, XB>(p);
}

// One launch over up to kMaxGridRows launches' parameters (MatvecGridParams,
// MoeDownGridParams): blockIdx.y picks the row's parameters, blockIdx.x the
// block within that row's grid, so each row's blocks compute what its own
// launch would (the same bits). q4 weights on integer inputs and q8 weights
// with the one-pass staging only (matvec_grid_ok, moe_down_grid_ok).
template <QFmt F, bool Route, int XB, bool Fold = false>
__global__ void __launch_bounds__(kMatvecThreads)
    matvec_grid_kernel(const __grid_constant__ MatvecGridParams g) {
  matvec_body<F, Route, true, Fold, XB>(g.p[blockIdx.y]);
}
template <int U, int XB>
__global__ void __launch_bounds__(kMatvecThreads)
    moe_down_grid_kernel(const __grid_constant__ MoeDownGridParams g) {
  moe_down_body<QFmt::Q4, U, XB>(g.p[blockIdx.y]);
}

template <typename Kernel>
int max_blocks_per_sm(Kernel k, size_t smem) {
  int n = 0;
  LILY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kMatvecThreads, smem));
  return n > 0 ? n : 1;
}

template <typename Kernel>
void allow_big_smem(Kernel k) {
  LILY_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
}

// LILY_CUDA_MV_MINBLOCKS=3 selects the register-capped matvec (A/B switch).
int matvec_min_blocks() {
  static int v = [] {
    const char* e = std::getenv("LILY_CUDA_MV_MINBLOCKS");
    return e && std::string(e) == "3" ? 3 : 0;
  }();
  return v;
}

// A launch of p: its grid (0: no tiles, nothing to launch), shared memory
// and the parameters with the launch's own settings.
struct MatvecLaunch {
  int grid = 0;
  size_t smem = 0;
  MatvecParams q;
};
template <typename Kernel>
MatvecLaunch plan_matvec(Kernel kernel, QFmt fmt, const MatvecParams& p) {
  const int nseg = p.pro == Prologue::None ? 0 : p.cols / p.seg;
  const MatvecSmem L = matvec_smem_layout(p.chunks, floats_per_chunk(fmt), p.cols, nseg);
  // A fold launch reuses the staging memory for its block sums (8 warps x
  // ld, + 8); a several-row launch holds its rows' integer codes only.
  const int fold_floats = p.fold.acc ? (kMatvecThreads / 32) * (p.fold.ld + 1) : 0;
  const size_t smem = p.nrows > 1 ? size_t(p.nrows) * matvec_row_floats(p.chunks, p.act_bits) * 4
                                  : size_t(std::max(L.total, fold_floats)) * 4;
  int tiles = 0;
  for (int j = 0; j < p.njobs; ++j) tiles += (p.jobs[j].rows + kRowsPerTile - 1) / kRowsPerTile;
  if (tiles == 0) return {};
  const int max_grid = std::max(1, device_sm_count() * max_blocks_per_sm(kernel, smem) / std::max(1, p.grid_div));
  static const bool balanced = [] {
    const char* e = std::getenv("LILY_CUDA_BALANCE");
    return !(e && std::string(e) == "0");
  }();
  MatvecParams q = p;
  q.balanced = balanced ? 1 : 0;
  q.l2_prefetch = env_switch("LILY_CUDA_L2PF", 0);
  q.trace = next_trace();
  // LILY_TRACE_STAGING=1: a route launch's sub-steps from a staging warp
  // (the first x piece, the norm scales, the staging done) instead of the
  // routing warp (a trace diagnostic).
  if (p.route.on() && env_switch("LILY_TRACE_STAGING", 0)) q.trace.clock_thread = 32;
  int grid = std::min(tiles, max_grid);
  if (p.fold.acc) {
    grid = tiles;  // one tile per block (the fold's scale group per block)
    q.balanced = 1;
  } else if (!balanced) {
    const int per_block = (tiles + max_grid - 1) / max_grid;
    grid = (tiles + per_block - 1) / per_block;
  }
  return {grid, smem, q};
}
template <typename Kernel>
void launch_matvec_k(Kernel kernel, QFmt fmt, const MatvecParams& p, cudaStream_t s, bool pdl) {
  const MatvecLaunch l = plan_matvec(kernel, fmt, p);
  if (l.grid > 0) launch_kernel("matvec", kernel, dim3(l.grid), dim3(kMatvecThreads), l.smem, s, pdl, l.q);
}

// Whether a launch stages its input in one pass (stage_fast): where the
// shape and alignment allow it, unless LILY_CUDA_FAST_STAGE=0 (an A/B
// switch); nthr staging threads.
template <QFmt F>
bool use_fast_stage(const MatvecParams& p, int nthr) {
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       (!p.gate_z || reinterpret_cast<uintptr_t>(p.gate_z) % 16 == 0) &&
                       (p.pro == Prologue::None || reinterpret_cast<uintptr_t>(p.norm_w) % 16 == 0);
  return env_switch("LILY_CUDA_FAST_STAGE", 1) && aligned &&
         fast_stage_ok(p.cols, p.chunks * (floats_per_chunk(F) / 4), p.seg, p.pro, nthr);
}
// One kernel family's instantiation for a launch: K::get<F, Fast, XB>() the
// kernel; integer inputs (act_bits) for q4 with the one-pass staging only.
// Big shared memory is allowed on all of the family's instantiations once.
template <QFmt F, class K>
auto pick_kernel(bool fast, int act_bits) {
  static bool init = [] {
    allow_big_smem(K::template get<F, false, 0>());
    allow_big_smem(K::template get<F, true, 0>());
    if constexpr (F == QFmt::Q4) {
      allow_big_smem(K::template get<F, true, 8>());
      allow_big_smem(K::template get<F, true, 16>());
    }
    return true;
  }();
  (void)init;
  if constexpr (F == QFmt::Q4) {
    if (fast && act_bits == 8) return K::template get<F, true, 8>();
    if (fast && act_bits == 16) return K::template get<F, true, 16>();
  }
  return fast ? K::template get<F, true, 0>() : K::template get<F, false, 0>();
}
template <bool Route>
struct PlainKernels {
  template <QFmt F, bool Fast, int XB>
  static auto get() { return matvec_kernel<F, Route, Fast, XB>; }
};
struct FoldKernels {
  template <QFmt F, bool Fast, int XB>
  static auto get() { return matvec_fold_kernel<F, Fast, XB>; }
};
struct DnKernels {
  template <QFmt F, bool Fast, int XB>
  static auto get() { return matvec_dn_kernel<F, Fast, XB>; }
};

template <int XB>
void launch_matvec_rows(const MatvecParams& p, cudaStream_t s, bool pdl) {
  static bool init = [] {
    allow_big_smem(matvec_rows_kernel<XB, 2>);
    allow_big_smem(matvec_rows_kernel<XB, 3>);
    allow_big_smem(matvec_rows_kernel<XB, 4>);
    return true;
  }();
  (void)init;
  static_assert(kMaxMatvecRows == 4, "instantiations for 2..4 rows");
  switch (p.nrows) {
    case 2: return launch_matvec_k(matvec_rows_kernel<XB, 2>, QFmt::Q4, p, s, pdl);
    case 3: return launch_matvec_k(matvec_rows_kernel<XB, 3>, QFmt::Q4, p, s, pdl);
    default: return launch_matvec_k(matvec_rows_kernel<XB, 4>, QFmt::Q4, p, s, pdl);
  }
}

template <QFmt F, bool Route>
void launch_matvec_r(const MatvecParams& p, cudaStream_t s, bool pdl) {
  const bool fast = use_fast_stage<F>(p, Route ? kMatvecThreads - 32 : kMatvecThreads);
  if constexpr (!Route) {
    if (p.fold.acc) return launch_matvec_k(pick_kernel<F, FoldKernels>(fast, p.act_bits), F, p, s, pdl);
  }
  // (So LILY_CUDA_MV_MINBLOCKS=3 applies to f32 inputs only.)
  if (matvec_min_blocks() == 3 && !(F == QFmt::Q4 && fast && p.act_bits != 0)) {
    static bool init3 = [] {
      allow_big_smem(matvec_kernel_3<F, Route>);
      return true;
    }();
    (void)init3;
    return launch_matvec_k(matvec_kernel_3<F, Route>, F, p, s, pdl);
  }
  launch_matvec_k(pick_kernel<F, PlainKernels<Route>>(fast, p.act_bits), F, p, s, pdl);
}
template <QFmt F>
void launch_matvec_t(const MatvecParams& p, cudaStream_t s, bool pdl) {
  if (p.route.on()) launch_matvec_r<F, true>(p, s, pdl);
  else launch_matvec_r<F, false>(p, s, pdl);
}

// A moe_down launch of p: the settings launch_moe_down_t and the row grid
// share (items per lane U, the integer input width XB taken: 0 unless q4
// with the one-pass staging; q with its split, fast_stage and spec_ids;
// shared memory, tiles).
struct DownPlan {
  int U = 2, xb = 0, tiles = 0;
  size_t smem = 0;
  MoeDownParams q;
};
template <QFmt F>
DownPlan plan_moe_down(const MoeDownParams& p) {
  const int items = p.njobs * p.chunks;
  if (items >= 65536) fail("moe_down: ", items, " (expert, chunk) items (below 65536)");  // job_of's range
  DownPlan d;
  MoeDownParams& q = d.q;
  q = p;
  // Expert ids read before the wait (LILY_CUDA_SPEC_IDS=0: after it only; 2:
  // the speculative read made wrong, so the tests cover the reissue).
  if (const char* e = std::getenv("LILY_CUDA_SPEC_IDS"); e && *e) q.spec_ids = std::atoi(e);
  // Warps per row pair and items per lane per step: one step per warp where
  // it fits (up to 96 items per warp), so a warp's loads all go out at once;
  // LILY_CUDA_DOWN_SPLIT=0 keeps one warp per row pair, two items per lane.
  q.split = 1;
  if (env_switch("LILY_CUDA_DOWN_SPLIT", 1) && items > 64) {
    d.U = 3;
    q.split = items <= 2 * 96 ? 2 : 4;
  }
  {
    bool ok = p.cols % 4 == 0 && items * (floats_per_chunk(F) / 4) <= kDownPieces * kMatvecThreads;
    for (int j = 0; j < p.njobs; ++j) ok = ok && reinterpret_cast<uintptr_t>(p.jobs[j].x) % 16 == 0;
    q.fast_stage = env_switch("LILY_CUDA_FAST_STAGE", 1) && ok;
  }
  // Integer inputs (act_bits): q4 with the one-pass staging only.
  if (F == QFmt::Q4 && q.fast_stage && (p.act_bits == 8 || p.act_bits == 16)) d.xb = p.act_bits;
  d.smem = (size_t(items) * floats_per_chunk(F) + items) * 4;
  const int rows_per_tile = 2 * (kMatvecThreads / 32 / q.split);
  d.tiles = (p.rows + rows_per_tile - 1) / rows_per_tile;
  return d;
}
// The grid of a launch of `tiles` tiles (at most what the SMs hold / grid_div).
template <typename Kernel>
int moe_down_grid(Kernel kernel, size_t smem, int tiles, int grid_div) {
  const int max_grid = std::max(1, device_sm_count() * max_blocks_per_sm(kernel, smem) / std::max(1, grid_div));
  const int per_block = (tiles + max_grid - 1) / max_grid;
  return (tiles + per_block - 1) / per_block;
}

template <QFmt F>
void launch_moe_down_t(const MoeDownParams& p, cudaStream_t s, bool pdl) {
  static bool init = [] {
    allow_big_smem(moe_down_kernel<F, 2>);
    allow_big_smem(moe_down_kernel<F, 3>);
    if constexpr (F == QFmt::Q4) {
      allow_big_smem(moe_down_kernel<F, 2, 8>);
      allow_big_smem(moe_down_kernel<F, 3, 8>);
      allow_big_smem(moe_down_kernel<F, 2, 16>);
      allow_big_smem(moe_down_kernel<F, 3, 16>);
    }
    return true;
  }();
  (void)init;
  DownPlan d = plan_moe_down<F>(p);
  auto kernel = d.U == 3 ? moe_down_kernel<F, 3> : moe_down_kernel<F, 2>;
  if constexpr (F == QFmt::Q4) {
    if (d.xb == 8) kernel = d.U == 3 ? moe_down_kernel<F, 3, 8> : moe_down_kernel<F, 2, 8>;
    if (d.xb == 16) kernel = d.U == 3 ? moe_down_kernel<F, 3, 16> : moe_down_kernel<F, 2, 16>;
  }
  if (d.tiles == 0) return;
  const int grid = moe_down_grid(kernel, d.smem, d.tiles, p.grid_div);
  d.q.trace = next_trace();
  launch_kernel("moe_down", kernel, dim3(grid), dim3(kMatvecThreads), d.smem, s, pdl, d.q);
}

// The row grid's matvec kernel for ps[0]'s format, route and input width
// (matvec_grid_ok has checked they are q4 with 8 / 16-bit inputs or q8).
template <bool Route>
void (*matvec_grid_kernel_for(const MatvecParams& p))(const MatvecGridParams) {
  static bool init = [] {
    allow_big_smem(matvec_grid_kernel<QFmt::Q4, Route, 8>);
    allow_big_smem(matvec_grid_kernel<QFmt::Q4, Route, 16>);
    allow_big_smem(matvec_grid_kernel<QFmt::Q8, Route, 0>);
    return true;
  }();
  (void)init;
  if (p.fmt == QFmt::Q8) return matvec_grid_kernel<QFmt::Q8, Route, 0>;
  return p.act_bits == 8 ? matvec_grid_kernel<QFmt::Q4, Route, 8> : matvec_grid_kernel<QFmt::Q4, Route, 16>;
}
// With the router fold (q4 on integer inputs only: matvec_grid_ok).
void (*matvec_grid_fold_kernel_for(const MatvecParams& p))(const MatvecGridParams) {
  static bool init = [] {
    allow_big_smem(matvec_grid_kernel<QFmt::Q4, false, 8, true>);
    allow_big_smem(matvec_grid_kernel<QFmt::Q4, false, 16, true>);
    return true;
  }();
  (void)init;
  return p.act_bits == 8 ? matvec_grid_kernel<QFmt::Q4, false, 8, true>
                         : matvec_grid_kernel<QFmt::Q4, false, 16, true>;
}
}  // namespace

namespace {
int fold_group_size(const DevMatView& m) { return m.chunks_per_group * floats_per_chunk(m.fmt); }

__global__ void build_router_fold_kernel(DevMatView r, DevMatView sg, int has_sg, int n, int ld, int gshift,
                                         uint8_t* q, uint32_t* sb) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(r.cols) * ld) return;
  const int j = static_cast<int>(i / ld), e = static_cast<int>(i % ld);
  uint32_t code = 0, sbw = 0;
  if (e < n) {
    const bool shared = has_sg && e == n - 1;
    const DevMatView& m = shared ? sg : r;
    const int row = shared ? 0 : e;
    const uint32_t* w32 = reinterpret_cast<const uint32_t*>(m.w) + size_t(row) * m.chunks * 4;
    code = m.fmt == QFmt::Q4 ? (w32[j >> 3] >> (4 * (j & 7))) & 15u : (w32[j >> 2] >> (8 * (j & 3))) & 255u;
    sbw = m.sb[size_t(row) * m.groups + (j >> gshift)];
  }
  q[i] = static_cast<uint8_t>(code);
  if ((j & ((1 << gshift) - 1)) == 0) sb[size_t(j >> gshift) * ld + e] = sbw;
}
}  // namespace

bool router_fold_ok(const DevMatView& router, const DevMatView* sg, int h) {
  auto affine = [](const DevMatView& m) { return m.fmt == QFmt::Q4 || m.fmt == QFmt::Q8; };
  const int gs = fold_group_size(router);
  if (!affine(router) || router.cols != h || router.rows < 1 || gs < kRowsPerTile || (gs & (gs - 1)) != 0 ||
      router.groups != (h + gs - 1) / gs)
    return false;
  if (sg && (!affine(*sg) || sg->cols != h || sg->rows != 1 || fold_group_size(*sg) != gs ||
             sg->groups != router.groups || sg->sb_f16 != router.sb_f16))
    return false;
  return router.rows + (sg ? 1 : 0) <= kFoldMaxOut;
}

RouterFold router_fold_shape(const DevMatView& router, const DevMatView* sg) {
  if (!router_fold_ok(router, sg, router.cols)) fail("router fold: this router's layout cannot be folded");
  RouterFold f;
  f.n = router.rows + (sg ? 1 : 0);
  f.ld = (f.n + 15) & ~15;
  f.gshift = __builtin_ctz(static_cast<unsigned>(fold_group_size(router)));
  f.sb_f16 = router.sb_f16;
  return f;
}

void build_router_fold(const DevMatView& router, const DevMatView* sg, uint32_t* q, uint32_t* sb,
                       cudaStream_t s) {
  const RouterFold f = router_fold_shape(router, sg);
  const long long total = static_cast<long long>(router.cols) * f.ld;
  build_router_fold_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, s>>>(
      router, sg ? *sg : DevMatView{}, sg ? 1 : 0, f.n, f.ld, f.gshift, reinterpret_cast<uint8_t*>(q), sb);
  LILY_CUDA(cudaGetLastError());
}

bool matvec_rows_ok(const MatvecParams& p) {
  if (p.nrows == 1) return true;
  if (p.nrows < 1 || p.nrows > kMaxMatvecRows || p.fmt != QFmt::Q4 || (p.act_bits != 8 && p.act_bits != 16))
    return false;
  if (p.route.on() || p.fold.acc || p.argmax || p.fin != Finish::None || p.gate_z_early) return false;
  if (p.ldx % 4 != 0 || (p.gate_z && p.ldz % 4 != 0)) return false;  // every row 16-byte aligned
  for (int j = 0; j < p.njobs; ++j)
    if (p.jobs[j].slot >= 0) return false;
  return use_fast_stage<QFmt::Q4>(p, kMatvecThreads);
}

namespace {
// What launch_matvec refuses (fail) before it picks a kernel.
void check_matvec(const MatvecParams& p) {
  if (p.njobs <= 0 || p.njobs > kMaxJobs) fail("matvec: ", p.njobs, " jobs (1..", kMaxJobs, ")");
  if (p.pro != Prologue::None && (p.seg <= 0 || p.cols % p.seg != 0))
    fail("matvec: norm segment ", p.seg, " does not divide ", p.cols, " inputs");
  if (p.fin != Finish::None && !p.counter) fail("matvec: a finishing launch needs a counter");
  if (!chunks_per_group_ok(p.fmt, p.chunks_per_group))
    fail("matvec: ", p.chunks_per_group, " chunks per group (a power of two)");
  const RouteSpec& r = p.route;
  if (r.on() &&
      (r.k < 1 || r.k > 31 || r.experts < r.k || r.experts > kMaxRouteExperts || !r.sel_idx || !r.sel_w))
    fail("matvec: route over ", r.experts, " experts, top ", r.k, " (1 <= k < 32, k <= experts <= ",
         kMaxRouteExperts, ", outputs set)");
  if (r.logits && r.acc) fail("matvec: route from both logits and a folded router");
  if (r.acc && reinterpret_cast<uintptr_t>(p.x) % 16 != 0) fail("matvec: a folded route needs a 16-byte aligned x");
  for (int j = 0; j < p.njobs; ++j)
    if (p.jobs[j].slot >= 0 && (!r.on() || p.jobs[j].slot >= r.k))
      fail("matvec: job ", j, " takes routed slot ", p.jobs[j].slot, " of ", r.on() ? r.k : 0);
  const RouterFold& f = p.fold;
  if (f.acc) {
    if (r.on() || p.epi != Epilogue::Add || p.njobs != 1 || p.jobs[0].slot >= 0)
      fail("matvec: the router fold needs one unrouted job with the residual add");
    if (!f.q || !f.sb || !f.g || f.n < 1 || f.n > f.ld || f.ld % 16 != 0 || f.ld > kFoldMaxOut ||
        (1 << f.gshift) < kRowsPerTile || reinterpret_cast<uintptr_t>(f.q) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(f.sb) % 16 != 0)
      fail("matvec: router fold over ", f.n, " outputs (stride ", f.ld, ", at most ", kFoldMaxOut,
           ", group shift ", f.gshift, ") malformed");
  }
  if (p.zero_n < 0 || (p.zero_n > 0 && !p.zero_acc)) fail("matvec: ", p.zero_n, " words to zero without a buffer");
  if (!act_bits_ok(p.act_bits)) fail("matvec: ", p.act_bits, "-bit inputs (0, 8 or 16)");
}
}  // namespace

void launch_matvec(const MatvecParams& p, cudaStream_t s, bool pdl) {
  check_matvec(p);
  if (p.nrows != 1) {
    if (!matvec_rows_ok(p))
      fail("matvec: ", p.nrows, " input rows need q4 weights on integer inputs, the one-pass staging, aligned "
           "rows and no route, fold, argmax, finish or early gate (1..", kMaxMatvecRows, " rows)");
    return p.act_bits == 8 ? launch_matvec_rows<8>(p, s, pdl) : launch_matvec_rows<16>(p, s, pdl);
  }
  switch (p.fmt) {
    case QFmt::Q4: return launch_matvec_t<QFmt::Q4>(p, s, pdl);
    case QFmt::Q8: return launch_matvec_t<QFmt::Q8>(p, s, pdl);
    case QFmt::BF16: return launch_matvec_t<QFmt::BF16>(p, s, pdl);
    case QFmt::F32: return launch_matvec_t<QFmt::F32>(p, s, pdl);
  }
}

namespace {
template <QFmt F>
void launch_matvec_dn_t(const MatvecDnParams& p, cudaStream_t s, bool pdl) {
  const MatvecParams& m = p.mv;
  const auto kernel = pick_kernel<F, DnKernels>(use_fast_stage<F>(m, kMatvecThreads), m.act_bits);
  const int nseg = m.pro == Prologue::None ? 0 : m.cols / m.seg;
  const DnSmem l = dn_smem_layout(p.dn, matvec_smem_layout(m.chunks, floats_per_chunk(F), m.cols, nseg).total);
  // Blocks per cluster: the step blocks, or twice as many (up to 16, a
  // non-portable cluster size) so that two blocks share an SM, as the
  // plain in_proj's do (LILY_CUDA_DN_CLUSTER=1|2, default 2).
  const int sb = dn_step_blocks(p.dn);
  int cs = sb;
  if (const char* e = std::getenv("LILY_CUDA_DN_CLUSTER"); !(e && std::string(e) == "1") && 2 * sb <= 16) cs = 2 * sb;
  if (cs > 8) LILY_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  MatvecDnParams q = p;
  q.cluster = cs;  // (the tile split is the row map's: mv.balanced and mv.l2_prefetch are not read)
  q.mv.trace = next_trace();
  launch_kernel_ex("matvec_dn", kernel, dim3(p.dn.nk * cs), dim3(kMatvecThreads), size_t(l.total) * 4, s, pdl, cs, q);
}
}  // namespace

bool matvec_dn_ok(const MatvecParams& in, const DeltaNetParams& d) {
  if (d.nk <= 0 || d.nv % d.nk != 0 || d.dv % kDnCols != 0 || d.K < 1) return false;
  const int ratio = d.nv / d.nk, C = 2 * d.nk * d.dk + d.nv * d.dv;
  bool ok = in.njobs == 4 && ratio <= 8 && dn_step_blocks(d) <= 8 && d.dk % kRowsPerTile == 0 &&
            d.dk <= kDnMaxDk && (ratio * d.dv) % kRowsPerTile == 0 && !in.route.on() && !in.fold.acc &&
            in.fin == Finish::None && !in.argmax && in.epi == Epilogue::Store && in.jobs[0].rows == C &&
            in.jobs[1].rows == d.nv * d.dv && in.jobs[2].rows == d.nv && in.jobs[3].rows == d.nv;
  for (int j = 0; j < 4 && ok; ++j) ok = in.jobs[j].slot < 0;
  // The outputs where the step reads them: q|k|v, z, b, a back to back.
  return ok && in.jobs[0].out == d.proj && in.jobs[1].out == d.proj + C && in.jobs[2].out == d.proj + C + d.nv * d.dv &&
         in.jobs[3].out == d.proj + C + d.nv * d.dv + d.nv;
}

void launch_matvec_dn(const MatvecParams& in, const DeltaNetParams& d, cudaStream_t s, bool pdl) {
  if (!matvec_dn_ok(in, d)) fail("matvec_dn: the in_proj and DeltaNet step shapes are not supported together");
  if (!chunks_per_group_ok(in.fmt, in.chunks_per_group))
    fail("matvec: ", in.chunks_per_group, " chunks per group (a power of two)");
  if (in.pro != Prologue::None && (in.seg <= 0 || in.cols % in.seg != 0))
    fail("matvec: norm segment ", in.seg, " does not divide ", in.cols, " inputs");
  if (!act_bits_ok(in.act_bits)) fail("matvec: ", in.act_bits, "-bit inputs (0, 8 or 16)");
  MatvecDnParams p;
  p.mv = in;
  p.dn = d;
  switch (in.fmt) {
    case QFmt::Q4: return launch_matvec_dn_t<QFmt::Q4>(p, s, pdl);
    case QFmt::Q8: return launch_matvec_dn_t<QFmt::Q8>(p, s, pdl);
    case QFmt::BF16: return launch_matvec_dn_t<QFmt::BF16>(p, s, pdl);
    case QFmt::F32: return launch_matvec_dn_t<QFmt::F32>(p, s, pdl);
  }
}

namespace {
void check_moe_down(const MoeDownParams& p) {
  if (p.njobs <= 0 || p.njobs > kMaxJobs) fail("moe_down: ", p.njobs, " jobs (1..", kMaxJobs, ")");
  if (!chunks_per_group_ok(p.fmt, p.chunks_per_group))
    fail("moe_down: ", p.chunks_per_group, " chunks per group (a power of two)");
  if (!act_bits_ok(p.act_bits)) fail("moe_down: ", p.act_bits, "-bit inputs (0, 8 or 16)");
}

// Two launches' parameters alike but for their pointers (the row grid's
// condition): every shape, format and option field, and which of the
// optional pointers are set.
bool same_but_pointers(const MatvecParams& a, const MatvecParams& b) {
  bool ok = a.fmt == b.fmt && a.cols == b.cols && a.chunks == b.chunks && a.groups == b.groups &&
            a.chunks_per_group == b.chunks_per_group && a.sb_f16 == b.sb_f16 && a.njobs == b.njobs &&
            a.pro == b.pro && a.seg == b.seg && a.eps == b.eps && a.epi == b.epi && a.argmax == b.argmax &&
            a.fin == b.fin && a.gate_z_early == b.gate_z_early && a.zero_n == b.zero_n &&
            a.act_bits == b.act_bits && a.nrows == b.nrows && a.grid_div == b.grid_div &&
            !a.gate_z == !b.gate_z && !a.norm_w == !b.norm_w && !a.fold.acc == !b.fold.acc &&
            a.fold.n == b.fold.n && a.fold.ld == b.fold.ld && a.fold.gshift == b.fold.gshift &&
            a.fold.sb_f16 == b.fold.sb_f16;
  const RouteSpec &ra = a.route, &rb = b.route;
  ok = ok && ra.on() == rb.on() && ra.experts == rb.experts && ra.k == rb.k && ra.norm_topk == rb.norm_topk &&
       !ra.logits == !rb.logits && !ra.acc == !rb.acc && ra.acc_shared == rb.acc_shared &&
       !ra.shared_gate_logit == !rb.shared_gate_logit;
  for (int j = 0; ok && j < a.njobs && j < kMaxJobs; ++j) {
    const MatvecJob &x = a.jobs[j], &y = b.jobs[j];
    ok = x.rows == y.rows && x.slot == y.slot && x.w_expert_stride == y.w_expert_stride &&
         x.sb_expert_stride == y.sb_expert_stride;
  }
  return ok;
}
bool same_but_pointers(const MoeDownParams& a, const MoeDownParams& b) {
  bool ok = a.fmt == b.fmt && a.cols == b.cols && a.chunks == b.chunks && a.groups == b.groups &&
            a.chunks_per_group == b.chunks_per_group && a.sb_f16 == b.sb_f16 && a.rows == b.rows &&
            a.njobs == b.njobs && a.act_bits == b.act_bits && a.grid_div == b.grid_div;
  for (int j = 0; ok && j < a.njobs && j < kMaxJobs; ++j) {
    const MoeDownJob &x = a.jobs[j], &y = b.jobs[j];
    ok = !x.expert == !y.expert && x.experts == y.experts && x.w_expert_stride == y.w_expert_stride &&
         x.sb_expert_stride == y.sb_expert_stride && !x.coef == !y.coef;
  }
  return ok;
}
}  // namespace

bool matvec_grid_ok(const MatvecParams* ps, int n) {
  if (n < 1 || n > kMaxGridRows) return false;
  const MatvecParams& p0 = ps[0];
  const bool q4 = p0.fmt == QFmt::Q4 && (p0.act_bits == 8 || p0.act_bits == 16);
  // (A fold's kernel has no routing: a launch takes one or the other.)
  if (!(q4 || p0.fmt == QFmt::Q8) || p0.nrows != 1 || (p0.fold.acc && (!q4 || p0.route.on())) ||
      p0.argmax || p0.fin != Finish::None || p0.gate_z_early || p0.zero_n > 0)
    return false;
  const int nthr = p0.route.on() ? kMatvecThreads - 32 : kMatvecThreads;
  for (int i = 0; i < n; ++i) {
    const MatvecParams& p = ps[i];
    if (!same_but_pointers(p0, p)) return false;
    if (!(q4 ? use_fast_stage<QFmt::Q4>(p, nthr) : use_fast_stage<QFmt::Q8>(p, nthr))) return false;
  }
  return true;
}

void launch_matvec_grid(const MatvecParams* ps, int n, cudaStream_t s, bool pdl) {
  if (!matvec_grid_ok(ps, n))
    fail("matvec grid: ", n, " launches (1..", kMaxGridRows, ") need the same shapes and options, q4 "
         "weights on integer inputs (a router fold: only these) or q8, the one-pass staging, and no "
         "argmax, finish, early gate, zeroing or fold with routing");
  for (int i = 0; i < n; ++i) check_matvec(ps[i]);
  const MatvecParams& p0 = ps[0];
  auto kernel = p0.fold.acc      ? matvec_grid_fold_kernel_for(p0)
                : p0.route.on() ? matvec_grid_kernel_for<true>(p0)
                                : matvec_grid_kernel_for<false>(p0);
  const MatvecLaunch l = plan_matvec(kernel, p0.fmt, p0);
  if (l.grid == 0) return;
  MatvecGridParams g;
  g.n = n;
  for (int i = 0; i < n; ++i) {
    g.p[i] = ps[i];
    g.p[i].balanced = l.q.balanced;
    g.p[i].l2_prefetch = l.q.l2_prefetch;
    g.p[i].trace = TraceSpec{};
  }
  launch_kernel("matvec_grid", kernel, dim3(l.grid, g.n), dim3(kMatvecThreads), l.smem, s, pdl, g);
}

bool moe_down_grid_ok(const MoeDownParams* ps, int n) {
  if (n < 1 || n > kMaxGridRows) return false;
  const MoeDownParams& p0 = ps[0];
  if (p0.fmt != QFmt::Q4 || (p0.act_bits != 8 && p0.act_bits != 16) || p0.njobs <= 0 || p0.njobs > kMaxJobs ||
      p0.njobs * p0.chunks >= 65536)
    return false;
  for (int i = 0; i < n; ++i)
    if (!same_but_pointers(p0, ps[i]) || plan_moe_down<QFmt::Q4>(ps[i]).xb == 0) return false;
  return true;
}

void launch_moe_down_grid(const MoeDownParams* ps, int n, cudaStream_t s, bool pdl) {
  if (!moe_down_grid_ok(ps, n))
    fail("moe_down grid: ", n, " launches (1..", kMaxGridRows, ") need the same shapes, q4 weights on "
         "integer inputs and the one-pass staging");
  static bool init = [] {
    allow_big_smem(moe_down_grid_kernel<2, 8>);
    allow_big_smem(moe_down_grid_kernel<3, 8>);
    allow_big_smem(moe_down_grid_kernel<2, 16>);
    allow_big_smem(moe_down_grid_kernel<3, 16>);
    return true;
  }();
  (void)init;
  MoeDownGridParams g;
  g.n = n;
  DownPlan d0;
  for (int i = 0; i < g.n; ++i) {
    check_moe_down(ps[i]);
    const DownPlan d = plan_moe_down<QFmt::Q4>(ps[i]);
    if (i == 0) d0 = d;
    g.p[i] = d.q;
    g.p[i].trace = TraceSpec{};
  }
  if (d0.tiles == 0) return;
  auto kernel = d0.xb == 8 ? (d0.U == 3 ? moe_down_grid_kernel<3, 8> : moe_down_grid_kernel<2, 8>)
                           : (d0.U == 3 ? moe_down_grid_kernel<3, 16> : moe_down_grid_kernel<2, 16>);
  const int grid = moe_down_grid(kernel, d0.smem, d0.tiles, ps[0].grid_div);
  launch_kernel("moe_down_grid", kernel, dim3(grid, g.n), dim3(kMatvecThreads), d0.smem, s, pdl, g);
}

void launch_moe_down(const MoeDownParams& p, cudaStream_t s, bool pdl) {
  check_moe_down(p);
  switch (p.fmt) {
    case QFmt::Q4: return launch_moe_down_t<QFmt::Q4>(p, s, pdl);
    case QFmt::Q8: return launch_moe_down_t<QFmt::Q8>(p, s, pdl);
    case QFmt::BF16: return launch_moe_down_t<QFmt::BF16>(p, s, pdl);
    case QFmt::F32: return launch_moe_down_t<QFmt::F32>(p, s, pdl);
  }
}

}  // namespace lily::cuda

// Prefill GEMM on tensor cores with on-the-fly dequantization, and the routed
// MoE block built on it (device routing, grouped launches, gather-sum).
//
// y[T][N] = x[T][K] . W^T with x bf16 and W bf16 or MLX affine 4/8-bit.
// One block computes a BM x 128 tile of y (BM = 128: two warpgroups of wgmma
// m64n128k16; BM = 64: 8 warps of mma.sync m16n8k16, each 32 x 32; f32
// accumulators). K advances 64 at a time (one quantization group): a 3-stage
// cp.async pipeline brings the x tile and the raw weight tile (codes + scale /
// bias words) into shared memory; for quantized weights all 256 threads then
// expand the 128 x 64 weight tile once into a bf16 tile (with 128-row tiles
// while the MMAs of the previous k-step run), which the MMAs read. Shared tiles
// are 128-byte rows with the 16-byte chunk index XOR-swizzled by (row & 7),
// so ldmatrix and the 16-byte stores are free of bank conflicts.
//
// Grouped mode (MoE): blockIdx.x indexes a device-built tile list (expert,
// first permuted row, row count); the x rows of a tile are gathered through a
// permutation index while loading, and the expert's weights are found by
// stride. SwiGLU mode: the block's 128 weight rows are 64 gate rows and the 64
// matching up rows, and the epilogue writes silu(gate) * up as bf16. Experts
// with under 32 rows on average take the skinny kernel instead (16-row tiles,
// weights as the MMA's A operand, expanded in registers; see
// moe_skinny_kernel).
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>

#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

using namespace prefill_detail;

// ---- Dequantization of MLX affine weights (group 64) -------------------------
__device__ __forceinline__ float code_f(uint32_t v, uint32_t sel) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, sel)) - 8388608.f;
}

__device__ __forceinline__ float2 scale_bias(uint32_t sb, int f16) {
  if (f16) {
    const __half2 h = *reinterpret_cast<const __half2*>(&sb);
    return __half22float2(h);
  }
  return make_float2(bf16_lo(sb), bf16_hi(sb));
}

// 32 consecutive 4-bit weights (one 16-byte chunk of codes, low nibble first)
// -> 4 chunks of 8 bf16: scale * code + bias in f32, rounded to bf16.
__device__ __forceinline__ void dequant_q4x32(uint4 c, float2 s, uint4 (&o)[4]) {
  const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = words[i] & 0x0F0F0F0Fu, hi = (words[i] >> 4) & 0x0F0F0F0Fu;
    o[i].x = pack_bf16x2(fmaf(code_f(lo, 0x7650), s.x, s.y), fmaf(code_f(hi, 0x7650), s.x, s.y));
    o[i].y = pack_bf16x2(fmaf(code_f(lo, 0x7651), s.x, s.y), fmaf(code_f(hi, 0x7651), s.x, s.y));
    o[i].z = pack_bf16x2(fmaf(code_f(lo, 0x7652), s.x, s.y), fmaf(code_f(hi, 0x7652), s.x, s.y));
    o[i].w = pack_bf16x2(fmaf(code_f(lo, 0x7653), s.x, s.y), fmaf(code_f(hi, 0x7653), s.x, s.y));
  }
}
__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }
__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
// The same 32 weights with bf16x2 arithmetic, for bf16 scales and biases
// (sb = scale | bias << 16). Byte j of a code word w holds weights 2j (low
// nibble) and 2j + 1 (high nibble); byte j of w >> 4 has weight 2j + 1 in its
// low nibble. One byte_perm takes byte j of w into the low half and byte j of
// w >> 4 into the high half; masking to the low nibbles and OR-ing in the bits
// of bf16 128.0 (whose ulp is 1) makes them exactly 128 + n. Subtracting 128
// (exact) and one fma with (s, s) and (b, b) round once to bf16: the f32
// path's value except where its double rounding (f32, then bf16) differs.
// ~2 instructions per weight instead of ~4, and no selector constants held
// in registers beside 128 accumulators. q4_pair_bf16: the weight pair of
// byte BYTE of code word w; scale_bias_bf162: the (s, s) / (b, b) pairs of a
// scale/bias word.
template <int BYTE>
__device__ __forceinline__ uint32_t q4_pair_bf16(uint32_t w, __nv_bfloat162 S, __nv_bfloat162 B) {
  const uint32_t t = __byte_perm(w, w >> 4, 0x0400 + 0x0101 * BYTE);
  return bf162_bits(__hfma2(__hsub2(as_bf162((t & 0x000F000Fu) | 0x43004300u), as_bf162(0x43004300u)), S, B));
}
__device__ __forceinline__ void scale_bias_bf162(uint32_t sb, __nv_bfloat162& S, __nv_bfloat162& B) {
  S = as_bf162(__byte_perm(sb, 0, 0x1010));
  B = as_bf162(__byte_perm(sb, 0, 0x3232));
}
__device__ __forceinline__ void dequant_q4x32_bf16(uint4 c, uint32_t sb, uint4 (&o)[4]) {
  __nv_bfloat162 S, B;
  scale_bias_bf162(sb, S, B);
  const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words[i];
    o[i] = make_uint4(q4_pair_bf16<0>(w, S, B), q4_pair_bf16<1>(w, S, B), q4_pair_bf16<2>(w, S, B),
                      q4_pair_bf16<3>(w, S, B));
  }
}
// 32 consecutive 8-bit weights (two 16-byte chunks) -> 4 chunks of 8 bf16.
__device__ __forceinline__ void dequant_q8x32(uint4 c0, uint4 c1, float2 s, uint4 (&o)[4]) {
  const uint32_t words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a = words[2 * j], b = words[2 * j + 1];
    o[j].x = pack_bf16x2(fmaf(code_f(a, 0x7650), s.x, s.y), fmaf(code_f(a, 0x7651), s.x, s.y));
    o[j].y = pack_bf16x2(fmaf(code_f(a, 0x7652), s.x, s.y), fmaf(code_f(a, 0x7653), s.x, s.y));
    o[j].z = pack_bf16x2(fmaf(code_f(b, 0x7650), s.x, s.y), fmaf(code_f(b, 0x7651), s.x, s.y));
    o[j].w = pack_bf16x2(fmaf(code_f(b, 0x7652), s.x, s.y), fmaf(code_f(b, 0x7653), s.x, s.y));
  }
}

enum Fmt : int { kBF16 = 0, kQ4 = 1, kQ8 = 2 };

// A fused projection's further matrices (GemmParams::part[1..]): several
// matrices of one input in one launch, each into its own output columns
// (the DeltaNet's qkv / z / b / a, the router and the shared expert's gate,
// attention's q / k / v): blockIdx.y from tile0 on is the part's tile
// y - tile0. Part 0 is GemmParams' own matrix.
constexpr int kGemmMaxParts = 4;
// An out_kind past PrefillOut's (GemmParams, SkinnyParams): the matrix is
// gate / up rows interleaved (gate i at row 2i, up i at 2i + 1, as the
// decode upload stores them) and output i (bf16) is silu(row 2i) * row 2i +
// 1, so SwiGLU runs as a plain launch (the skinny kernel: 2 rows a lane
// instead of 4, half the registers; the tiled one: split K as any plain
// GEMM, where the SwiGLU form's 64-output tiles gave a few hundred tokens 8
// blocks).
constexpr int kOutSwigluPairs = 3;
struct GemmPart {
  const uint8_t* w;
  const uint32_t* sb;
  size_t w_row_stride, sb_row_stride;
  int N, tile0, col0;
};

struct GemmParams {
  const uint16_t* x;
  size_t ldx;
  const int* a_rows;  // grouped: permuted position -> x row (null: identity)
  int M;              // dense: number of rows
  const uint8_t* w;
  const uint32_t* sb;
  const uint8_t* w2;  // SwiGLU: the up matrix
  const uint32_t* sb2;
  int sb_f16;
  int N, K;
  size_t w_row_stride, sb_row_stride;  // bytes, u32 words
  size_t expert_w_bytes, expert_sb_words;
  const int* tile_expert;
  const int* tile_row0;
  const int* tile_rows;
  const int* num_tiles;
  void* y;
  size_t ldy;
  int out_kind;      // PrefillOut
  int kt_per_split;  // split-K (plain GEMMs, no bf16 output): k-tiles per blockIdx.z
  float* split_part;  // split-K: the blocks' partial sums (SplitSpace)
  int* split_count;   // split-K: blocks arrived per output tile (0 between GEMMs)
  int nparts;         // plain GEMMs: matrices in this launch (0 or 1: p's own only)
  GemmPart part[kGemmMaxParts];
  int sk_wave = 0;    // the skinny MoE (KS = 1): the blocks of one wave
  int l2_fetch = 0;   // the skinny MoE's weight loads (ld_weights)
};

constexpr int kBN = 128;  // weight rows per block tile
constexpr int kBK = 64;   // = quantization group
constexpr int kThreads = 256;
constexpr int kStages = 3;

template <int F>
struct WTile {
  // Bytes of one pipeline stage of the raw weight tile.
  static constexpr int code_bytes_per_row = F == kBF16 ? 128 : F == kQ4 ? 32 : 64;
  static constexpr int codes = kBN * code_bytes_per_row;
  // Quantized: room for one scale/bias word per (row, half row): with 128-row
  // tiles each thread copies exactly the codes and the word it expands (no
  // barrier between its cp.async wait and the expansion).
  static constexpr int stage_bytes = codes + (F == kBF16 ? 0 : kBN * 2 * 4);
};

// Quantized weights expand into one bf16 tile, or two with 128-row tiles
// (the expansion of k-step kt + 1 overlaps the wgmma of kt).
template <int F, int BM>
constexpr size_t gemm_smem_bytes() {
  return size_t(kStages) * BM * 128 + size_t(kStages) * WTile<F>::stage_bytes +
         (F == kBF16 ? 0 : (BM == 128 ? 2 : 1) * kBN * 128) + BM * sizeof(int);
}

// Expand one stage of raw codes into the bf16 tile Wd (swizzled rows of 64).
// PER_HALF: the scale/bias words are stored per (row, half row) (128-row
// tiles), else per row.
template <int F, bool PER_HALF>
__device__ __forceinline__ void dequant_tile(const uint8_t* stage, uint16_t* Wd, int sb_f16) {
  const int tid = threadIdx.x;
  const int r = tid >> 1, h = tid & 1;  // row, half of the 64 inputs
  const uint32_t sbw = reinterpret_cast<const uint32_t*>(stage + WTile<F>::codes)[PER_HALF ? tid : r];
  const float2 s = scale_bias(sbw, sb_f16);
  uint16_t* row = Wd + r * 64;
  if constexpr (F == kQ4) {
    uint4 o[4];
    const uint4 c = *reinterpret_cast<const uint4*>(stage + r * 32 + h * 16);
    if (sb_f16)
      dequant_q4x32(c, s, o);
    else
      dequant_q4x32_bf16(c, sbw, o);
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(row + (((h * 4 + i) ^ (r & 7)) << 3)) = o[i];
  } else {  // Q8
    const uint4* src = reinterpret_cast<const uint4*>(stage + r * 64 + h * 32);
    uint4 o[4];
    dequant_q8x32(src[0], src[1], s, o);
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(row + (((h * 4 + i) ^ (r & 7)) << 3)) = o[i];
  }
}

// Split-K in a fixed order: each block of an output tile (blockIdx.z over
// its k range) stores its partial sums to its own slot of a workspace; the
// last of the tile's blocks to arrive (a counter per tile, put back to 0 by
// that block) adds the slots in z order and stores y as an unsplit block
// does, so y is the same bits from one run to the next (float atomics added
// the partials in arrival order: two prefills of one prompt then differed
// in the last bits). No block waits for another. One split GEMM at a time
// per workspace (the backend's stream runs them in order).
constexpr int kMaxSplitTiles = 4096;

template <int F, int BM, bool SWIGLU, bool GROUPED>
__global__ void __launch_bounds__(kThreads, 2) gemm_kernel(const GemmParams p) {
  constexpr int WM = BM / 2;   // rows per warp
  constexpr int MT = WM / 16;  // m16 tiles per warp
  constexpr bool QUANT = F != kBF16;
  // 128-row tiles: two warpgroups (64 rows x 128 columns each) on wgmma;
  // 64-row tiles: 8 warps (32 x 32 each) on mma.sync.
  constexpr bool kWG = BM == 128;
  // Xs stages, Wd and the bf16 weight stages start at multiples of 1024 bytes
  // (the wgmma descriptors' swizzle atom).
  extern __shared__ __align__(1024) uint8_t smem[];
  uint16_t* Xs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Wd = reinterpret_cast<uint16_t*>(smem + size_t(kStages) * BM * 128);
  uint8_t* Wst = reinterpret_cast<uint8_t*>(Wd) + (QUANT ? (kWG ? 2 : 1) * kBN * 128 : 0);
  int* s_arow = reinterpret_cast<int*>(Wst + size_t(kStages) * WTile<F>::stage_bytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;

  int m0, rows_valid, expert = 0;
  if constexpr (GROUPED) {
    const int tile = blockIdx.x;
    if (tile >= *p.num_tiles) return;
    expert = p.tile_expert[tile];
    m0 = p.tile_row0[tile];
    rows_valid = p.tile_rows[tile];
  } else {
    m0 = blockIdx.x * BM;
    rows_valid = min(BM, p.M - m0);
  }
  for (int r = tid; r < BM; r += kThreads)
    s_arow[r] = r < rows_valid ? (p.a_rows ? p.a_rows[m0 + r] : m0 + r) : -1;

  // The block's matrix (a fused launch's part) and its output columns.
  const uint8_t* pw = p.w;
  const uint32_t* psb = p.sb;
  size_t row_bytes = p.w_row_stride, sb_rs = p.sb_row_stride;
  int N = p.N, ty = blockIdx.y, ycol = 0;
  if constexpr (!SWIGLU && !GROUPED) {
#pragma unroll
    for (int i = 1; i < kGemmMaxParts; ++i)
      if (i < p.nparts && int(blockIdx.y) >= p.part[i].tile0) {
        pw = p.part[i].w;
        psb = p.part[i].sb;
        row_bytes = p.part[i].w_row_stride;
        sb_rs = p.part[i].sb_row_stride;
        N = p.part[i].N;
        ty = blockIdx.y - p.part[i].tile0;
        ycol = p.part[i].col0;
      }
  }
  // Weight rows of this block: SwiGLU covers 64 outputs (gate rows then up rows).
  const int nb0 = SWIGLU ? blockIdx.y * 64 : ty * kBN;
  const uint8_t* wb = pw + size_t(expert) * p.expert_w_bytes;
  const uint32_t* sbb = psb ? psb + size_t(expert) * p.expert_sb_words : nullptr;
  const uint8_t* wb2 = SWIGLU ? p.w2 + size_t(expert) * p.expert_w_bytes : nullptr;
  const uint32_t* sbb2 = (SWIGLU && p.sb2) ? p.sb2 + size_t(expert) * p.expert_sb_words : nullptr;
  // Tile row r -> matrix row (or -1), and which matrix.
  auto wrow = [&](int r, const uint8_t*& base, const uint32_t*& sbase) -> int {
    int n;
    if (SWIGLU) {
      const bool up = r >= 64;
      n = nb0 + (up ? r - 64 : r);
      base = up ? wb2 : wb;
      sbase = up ? sbb2 : sbb;
    } else {
      n = nb0 + r;
      base = wb;
      sbase = sbb;
    }
    return n < N ? n : -1;
  };
  __syncthreads();

  // Split-K: this block's k-tiles [kt0, kt0 + KT); the partial sums are
  // added in the order of blockIdx.z by the tile's last block.
  const int kt0 = blockIdx.z * p.kt_per_split;
  const int KT = min(p.K / kBK - kt0, p.kt_per_split);
  const bool split = gridDim.z > 1;
  auto load_stage = [&](int stage, int kt_local) {
    const int kt = kt0 + kt_local;
    const int k0 = kt * kBK;
    uint16_t* xs = Xs + size_t(stage) * BM * 64;
#pragma unroll
    for (int i = 0; i < BM / 32; ++i) {
      const int r = (tid >> 3) + 32 * i, c = tid & 7;
      const int src_row = s_arow[r];
      const uint16_t* src = p.x + (src_row >= 0 ? size_t(src_row) * p.ldx + k0 + c * 8 : 0);
      cp_async16(xs + r * 64 + ((c ^ (r & 7)) << 3), src, src_row >= 0 ? 16 : 0);
    }
    uint8_t* ws = Wst + size_t(stage) * WTile<F>::stage_bytes;
    if constexpr (F == kBF16) {
      uint16_t* wt = reinterpret_cast<uint16_t*>(ws);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = (tid >> 3) + 32 * i, c = tid & 7;
        const uint8_t* base;
        const uint32_t* sbase;
        const int n = wrow(r, base, sbase);
        const uint8_t* src = n >= 0 ? base + size_t(n) * row_bytes + size_t(k0 + c * 8) * 2 : p.w;
        cp_async16(wt + r * 64 + ((c ^ (r & 7)) << 3), src, n >= 0 ? 16 : 0);
      }
    } else if constexpr (kWG) {
      // Thread tid: row tid / 2, half tid % 2 (what dequant_tile expands).
      constexpr int CPH = WTile<F>::code_bytes_per_row / 32;  // 16-byte chunks per half row
      const int r = tid >> 1, h = tid & 1;
      const uint8_t* base;
      const uint32_t* sbase;
      const int n = wrow(r, base, sbase);
#pragma unroll
      for (int c = 0; c < CPH; ++c) {
        const uint8_t* src = n >= 0 ? base + size_t(n) * row_bytes + size_t(k0) * (F == kQ4 ? 1 : 2) / 2 +
                                          (h * CPH + c) * 16
                                    : p.w;
        cp_async16(ws + r * WTile<F>::code_bytes_per_row + (h * CPH + c) * 16, src, n >= 0 ? 16 : 0);
      }
      const uint32_t* src = n >= 0 ? sbase + size_t(n) * sb_rs + kt : p.sb;
      cp_async4(ws + WTile<F>::codes + tid * 4, src, n >= 0 ? 4 : 0);
    } else {
      constexpr int CPR = WTile<F>::code_bytes_per_row / 16;  // 16-byte chunks per row
#pragma unroll
      for (int i = 0; i < (kBN * CPR) / kThreads; ++i) {
        const int idx = tid + kThreads * i;
        const int r = idx / CPR, c = idx % CPR;
        const uint8_t* base;
        const uint32_t* sbase;
        const int n = wrow(r, base, sbase);
        const uint8_t* src =
            n >= 0 ? base + size_t(n) * row_bytes + size_t(k0) * (F == kQ4 ? 1 : 2) / 2 + c * 16
                   : p.w;
        cp_async16(ws + r * WTile<F>::code_bytes_per_row + c * 16, src, n >= 0 ? 16 : 0);
      }
      if (tid < kBN) {
        const uint8_t* base;
        const uint32_t* sbase;
        const int n = wrow(tid, base, sbase);
        const uint32_t* src = n >= 0 ? sbase + size_t(n) * sb_rs + kt : p.sb;
        cp_async4(ws + WTile<F>::codes + tid * 4, src, n >= 0 ? 4 : 0);
      }
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
  // The wgmma path's 64 accumulators (BM = 128: MT = 4, the same registers).
  float (&wacc)[64] = reinterpret_cast<float (&)[64]>(acc);
  const int wg = warp >> 2;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }

  if constexpr (kWG && QUANT) {
    // 128-row tiles of quantized weights: the wgmma of k-step kt runs while
    // every thread expands its own half row of kt + 1 into the other bf16
    // tile (each thread copied exactly those codes and that scale word, so
    // its own cp.async wait suffices); one barrier per k-step publishes the
    // expansion and frees the stage the MMAs of kt - 1 read. A warpgroup with
    // no valid row runs the same loop without MMAs (the branch is taken once,
    // outside the loop, so no wgmma sits in a divergent path: ptxas would
    // serialise them); both arrive at the same named barrier.
    cp_async_wait<kStages - 2>();
    dequant_tile<F, true>(Wst, Wd, p.sb_f16);
    auto main_loop = [&](auto with_mma) {
      for (int kt = 0; kt < KT; ++kt) {
        fence_proxy_async();
        asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
        const int nk = kt + kStages - 1;
        if (nk < KT) load_stage(nk % kStages, nk);
        cp_async_commit();
        if constexpr (decltype(with_mma)::value) {
          const uint16_t* xt = Xs + size_t(kt % kStages) * BM * 64 + 64 * wg * 64;
          const uint16_t* wt = Wd + size_t(kt & 1) * kBN * 64;
          wg_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) wgmma_n128(wacc, wg_desc(xt + kk * 16), wg_desc(wt + kk * 16));
          wg_commit();
        }
        if (kt + 1 < KT) {
          cp_async_wait<kStages - 2>();
          dequant_tile<F, true>(Wst + size_t((kt + 1) % kStages) * WTile<F>::stage_bytes, Wd + size_t((kt + 1) & 1) * kBN * 64,
                          p.sb_f16);
        }
        if constexpr (decltype(with_mma)::value) wg_wait<0>();
      }
    };
    if (64 * wg < rows_valid)
      main_loop(std::true_type{});
    else
      main_loop(std::false_type{});
  } else {
  // bf16 weights, and quantized ones on 64-row tiles: one expansion tile, two
  // barriers per k-step.
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    if constexpr (kWG) fence_proxy_async();
    __syncthreads();
    {
      const int nk = kt + kStages - 1;
      if (nk < KT) load_stage(nk % kStages, nk);
      cp_async_commit();
    }
    const int stage = kt % kStages;
    const uint16_t* xt = Xs + size_t(stage) * BM * 64;
    const uint16_t* wt;
    if constexpr (QUANT) {
      dequant_tile<F, false>(Wst + size_t(stage) * WTile<F>::stage_bytes, Wd, p.sb_f16);
      __syncthreads();
      wt = Wd;
    } else {
      wt = reinterpret_cast<const uint16_t*>(Wst + size_t(stage) * WTile<F>::stage_bytes);
    }
    // A warp(group) with no valid row (the second half of a partial MoE
    // expert tile or of the last tile) skips the MMAs (one uniform test per
    // k-step: a test per 16-row slice inside the loop cost ~20% of the rate).
    if constexpr (kWG) {
      if (64 * wg < rows_valid) {
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_n128(wacc, wg_desc(xt + 64 * wg * 64 + kk * 16), wg_desc(wt + kk * 16));
        wg_commit();
        wg_wait_all();
      }
    } else if (wm * WM < rows_valid) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int r = wm * WM + mt * 16 + (lane & 15);
          const int ch = kk * 2 + (lane >> 4);
          ldmatrix_x4(a[mt], xt + r * 64 + ((ch ^ (r & 7)) << 3));
        }
        uint32_t b[4][2];
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          const int nbase = SWIGLU ? (np == 0 ? wn * 16 : 64 + wn * 16) : wn * 32 + np * 16;
          const int n = nbase + (lane & 7) + ((lane >> 4) << 3);
          const int ch = kk * 2 + ((lane >> 3) & 1);
          uint32_t t[4];
          ldmatrix_x4(t, wt + n * 64 + ((ch ^ (n & 7)) << 3));
          b[2 * np][0] = t[0];
          b[2 * np][1] = t[1];
          b[2 * np + 1][0] = t[2];
          b[2 * np + 1][1] = t[3];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
      }
    }
  }
  }
  cp_async_wait<0>();

  if (split) {
    constexpr int kRegs = MT * 16;  // the accumulators (the wgmma path's 64 too)
    float (&flat)[kRegs] = reinterpret_cast<float (&)[kRegs]>(acc);
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* slots = p.split_part + size_t(tile) * gridDim.z * (kRegs * kThreads);
    float* mine = slots + size_t(blockIdx.z) * (kRegs * kThreads);
    // Accumulator i's output row (the epilogue's mapping): only rows below
    // rows_valid are stored to the slots (a short tile moves only its rows).
    const int row0 = kWG ? 64 * wg + 16 * (warp & 3) + (lane >> 2) : wm * WM + (lane >> 2);
    auto valid = [&](int i) { return row0 + (kWG ? 0 : (i >> 4) * 16) + 8 * ((i >> 1) & 1) < rows_valid; };
#pragma unroll
    for (int i = 0; i < kRegs; ++i)
      if (valid(i)) __stcg(mine + i * kThreads + tid, flat[i]);
    __threadfence();
    __syncthreads();
    __shared__ int s_last;
    if (tid == 0) {
      s_last = atomicAdd(p.split_count + tile, 1) == int(gridDim.z) - 1;
      if (s_last) p.split_count[tile] = 0;  // for the next split GEMM
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Every entry of every slot is loaded, the rows past rows_valid too
    // (stale values from earlier GEMMs, never stored by the epilogue): with
    // the row test between them the loads went out one at a time (a split
    // of 8 took ~58 us for 4 k-tiles a block; ~19 us so, H100).
#pragma unroll
    for (int i = 0; i < kRegs; ++i) flat[i] = __ldcg(slots + i * kThreads + tid);
    for (int z = 1; z < int(gridDim.z); ++z) {
      const float* part = slots + size_t(z) * (kRegs * kThreads);
      float v[kRegs];
#pragma unroll
      for (int i = 0; i < kRegs; ++i) v[i] = __ldcg(part + i * kThreads + tid);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) flat[i] += v[i];
    }
  }
  // Epilogue straight from the accumulators.
  auto store = [&](int r, int col, float v) {
    const size_t o = size_t(m0 + r) * p.ldy + ycol + col;
    if (p.out_kind == int(PrefillOut::F32)) {
      static_cast<float*>(p.y)[o] = v;
    } else if (p.out_kind == int(PrefillOut::F32Add)) {
      static_cast<float*>(p.y)[o] += v;
    } else {
      static_cast<uint16_t*>(p.y)[o] = f32_to_bf16_bits(v);
    }
  };
  auto store_swiglu = [&](int r, int col, float g, float u) {
    static_cast<uint16_t*>(p.y)[size_t(m0 + r) * p.ldy + col] = f32_to_bf16_bits(p_silu(g) * u);
  };
  // Two adjacent columns per store where the output allows it (even row
  // stride, 8-byte aligned base).
  auto store_pair = [&](int r, int col, float v0, float v1) {
    if (p.out_kind == kOutSwigluPairs) {  // (gate, up) of output (ycol + col) / 2
      static_cast<uint16_t*>(p.y)[size_t(m0 + r) * p.ldy + (ycol + col) / 2] = f32_to_bf16_bits(p_silu(v0) * v1);
      return;
    }
    const size_t o = size_t(m0 + r) * p.ldy + ycol + col;
    if (p.out_kind == int(PrefillOut::BF16)) {
      *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.y) + o) = pack_bf16x2(v0, v1);
    } else {
      float2* d = reinterpret_cast<float2*>(static_cast<float*>(p.y) + o);
      if (p.out_kind == int(PrefillOut::F32Add)) {
        const float2 c = *d;
        v0 += c.x;
        v1 += c.y;
      }
      *d = make_float2(v0, v1);
    }
  };
  if constexpr (kWG) {
    const bool paired = p.out_kind == kOutSwigluPairs ||
                        (p.ldy % 2 == 0 && ycol % 2 == 0 && (reinterpret_cast<uintptr_t>(p.y) & 7) == 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 64 * wg + 16 * (warp & 3) + (lane >> 2) + half * 8;
      if (r >= rows_valid) continue;
#pragma unroll
      for (int j = 0; j < (SWIGLU ? 8 : 16); ++j) {
        const int col0 = nb0 + 8 * j + (lane & 3) * 2;
        if (paired && col0 + 1 < N) {
          const float* v = wacc + 4 * j + 2 * half;
          if constexpr (SWIGLU) {
            const float* u = wacc + 4 * (j + 8) + 2 * half;
            *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.y) + size_t(m0 + r) * p.ldy + col0) =
                pack_bf16x2(p_silu(v[0]) * u[0], p_silu(v[1]) * u[1]);
          } else {
            store_pair(r, col0, v[0], v[1]);
          }
          continue;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = col0 + e;
          if (col >= N) continue;
          if constexpr (SWIGLU)
            store_swiglu(r, col, wacc[4 * j + 2 * half + e], wacc[4 * (j + 8) + 2 * half + e]);
          else
            store(r, col, wacc[4 * j + 2 * half + e]);
        }
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * WM + mt * 16 + (lane >> 2) + half * 8;
        if (r >= rows_valid) continue;
        if constexpr (SWIGLU) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nb0 + wn * 16 + nt * 8 + (lane & 3) * 2 + e;
              if (col < N) store_swiglu(r, col, acc[mt][nt][half * 2 + e], acc[mt][nt + 2][half * 2 + e]);
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int col0 = nb0 + wn * 32 + nt * 8 + (lane & 3) * 2;
            if (p.out_kind == kOutSwigluPairs) {
              if (col0 + 1 < N) store_pair(r, col0, acc[mt][nt][half * 2], acc[mt][nt][half * 2 + 1]);
              continue;
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = col0 + e;
              if (col < N) store(r, col, acc[mt][nt][half * 2 + e]);
            }
          }
        }
      }
  }
}

template <int F, int BM, bool SWIGLU, bool GROUPED>
void launch_gemm_t(const GemmParams& p, dim3 grid, cudaStream_t s) {
  auto kernel = gemm_kernel<F, BM, SWIGLU, GROUPED>;
  constexpr size_t smem = gemm_smem_bytes<F, BM>();
  static const bool attr_ok = [&] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute(prefill gemm kernel)");
    return true;
  }();
  (void)attr_ok;
  kernel<<<grid, kThreads, smem, s>>>(p);
  check_launch("prefill gemm kernel");
}

template <int F>
void launch_gemm_fmt(const GemmParams& p, int bm, bool swiglu, bool grouped, dim3 grid,
                     cudaStream_t s) {
  if (bm == 64) {
    if (swiglu) grouped ? launch_gemm_t<F, 64, true, true>(p, grid, s) : launch_gemm_t<F, 64, true, false>(p, grid, s);
    else grouped ? launch_gemm_t<F, 64, false, true>(p, grid, s) : launch_gemm_t<F, 64, false, false>(p, grid, s);
  } else {
    if (swiglu) grouped ? launch_gemm_t<F, 128, true, true>(p, grid, s) : launch_gemm_t<F, 128, true, false>(p, grid, s);
    else grouped ? launch_gemm_t<F, 128, false, true>(p, grid, s) : launch_gemm_t<F, 128, false, false>(p, grid, s);
  }
}

void launch_gemm(PrefillWeightFormat fmt, const GemmParams& p, int bm, bool swiglu, bool grouped,
                 dim3 grid, cudaStream_t s) {
  switch (fmt) {
    case PrefillWeightFormat::BF16: launch_gemm_fmt<kBF16>(p, bm, swiglu, grouped, grid, s); break;
    case PrefillWeightFormat::Q4: launch_gemm_fmt<kQ4>(p, bm, swiglu, grouped, grid, s); break;
    case PrefillWeightFormat::Q8: launch_gemm_fmt<kQ8>(p, bm, swiglu, grouped, grid, s); break;
  }
}

// ---- Skinny grouped MoE GEMM (q4 experts, few rows per expert) -------------
// For prompts whose experts get ~16 rows or fewer (T <= ~512 with 256 experts,
// top-8), 64-row tiles waste most of their MMAs and expand every weight tile
// in shared memory for a handful of rows. Here the roles swap: out^T = W x^T
// with the weights as the A operand of m16n8k16 (16 weight rows) and a tile's
// <= 16 token rows as N (two n8 halves). Lane t of a quad loads the 8 bytes
// of words 2t and 2t + 1 of its row's group (k = 16t .. 16t + 15) straight
// into registers, 3 groups ahead, and takes the raw codes as its A fragments
// over the group's 4 k16 steps (raw_pair below: the scale and bias are
// applied to each group's f32 sums); since the MMA sums over k, the k order
// inside a group is permuted to match, and the staged x rows are permuted the
// same way, so the B fragment is one 8-byte load. Only the tile's x rows go
// through shared memory (loaded once, rows 2K + 8 bytes apart: the 8-byte
// fragment loads are conflict-free), with each group's sum of x. Weights
// stream once per tile, like the decode matvecs. A block takes a run of
// column chunks of one tile (or two) with the tile's x rows staged once a
// run (a block a chunk restaged them for every 128 / 256 output columns:
// 0.311 ms for the MoE at T = 256 against 0.262 with 4 chunks a block;
// H100); which runs, see the kernel. Needs K % 256 == 0 (4 groups per turn
// of the register ring).
constexpr int kSkRows = 16;  // token rows per tile
constexpr int kSkWarps = 8;
constexpr int kSkRing = 4;   // groups in flight per thread (3 ahead)
int g_moe_skinny_blocks = 0;  // blocks of a KS = 1 launch (0: two per SM)
constexpr int kSkTileRun = 4;  // at most this many column chunks a block where blocks take parts of a tile
constexpr int kSkMaxSmem = 100 * 1024;  // the x tile (16 rows of 2K + 8 bytes) and its group sums

template <int BYTE>
__device__ __forceinline__ uint32_t skinny_pair_f32(uint32_t w, float2 s) {
  const uint32_t b = (w >> (8 * BYTE)) & 0xFFu;
  return pack_bf16x2(fmaf(float(b & 15u), s.x, s.y), fmaf(float(b >> 4), s.x, s.y));
}

// 8-bit codes (the dense skinny kernel below) as one weight row's part of
// the A fragments of a group's 4 k16 steps: the lane's 16 code bytes of the
// group (k = 16t .. 16t + 15), word j holding k = 16t + 4j .. + 3.
__device__ __forceinline__ void skinny_frags(uint4 c, uint32_t sb, bool f16, int hh, uint32_t (&a)[4][4]) {
  const float2 sc = scale_bias(sb, f16 ? 1 : 0);
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a[j][hh] = pack_bf16x2(fmaf(code_f(w[j], 0x7650), sc.x, sc.y), fmaf(code_f(w[j], 0x7651), sc.x, sc.y));
    a[j][2 + hh] = pack_bf16x2(fmaf(code_f(w[j], 0x7652), sc.x, sc.y), fmaf(code_f(w[j], 0x7653), sc.x, sc.y));
  }
}

// KS > 1 (a short run's few tiles): KS warps share each warp tile, each
// over 1 / KS of K, and the first adds the others' sums in warp order (KS
// times the blocks).
// 32 q4 weights of one row (a lane's 16 bytes of a 64-byte unit, k = 32 t
// .. 32 t + 31 of the unit's 128) as the A fragments of the unit's 8 k16
// steps: step j takes k = 32 t + 4 j .. + 3, i.e. bytes 2 (j & 1) and + 1 of
// word j / 2; sb is the lane's group's scale/bias word.
__device__ __forceinline__ void skinny_frags_q4x2(uint4 c, uint32_t sb, bool f16, int hh, uint32_t (&a)[8][4]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  if (!f16) {
    __nv_bfloat162 S, B;
    scale_bias_bf162(sb, S, B);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[2 * i][hh] = q4_pair_bf16<0>(w[i], S, B);
      a[2 * i][2 + hh] = q4_pair_bf16<1>(w[i], S, B);
      a[2 * i + 1][hh] = q4_pair_bf16<2>(w[i], S, B);
      a[2 * i + 1][2 + hh] = q4_pair_bf16<3>(w[i], S, B);
    }
  } else {
    const float2 sc = scale_bias(sb, 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[2 * i][hh] = skinny_pair_f32<0>(w[i], sc);
      a[2 * i][2 + hh] = skinny_pair_f32<1>(w[i], sc);
      a[2 * i + 1][hh] = skinny_pair_f32<2>(w[i], sc);
      a[2 * i + 1][2 + hh] = skinny_pair_f32<3>(w[i], sc);
    }
  }
}

// Raw codes as the A fragments: the pair (nibble s, nibble s + 4) of a
// code word as bf16 128 + q (one LOP3: exact), so a lane's 16 weights of a
// group cost 6 shifts and 8 LOP3s instead of a PRMT, LOP3, HSUB2 and HFMA2
// per pair; scale and bias are applied to the group's f32 sums instead:
// sum_k (s q_k + b) x_k = s sum_k (128 + q_k) x_k + (b - 128 s) sum_k x_k.
// Word w of the lane's 8 code bytes holds k = 8w .. 8w + 7 (nibble i is k =
// 8w + i); step 2w + (s >> 1) takes pair s as its register s & 1, so the B
// fragment needs x at (k, k + 4) and (k + 1, k + 5) (s even) or (k + 2, k +
// 6) and (k + 3, k + 7): the staged x rows hold each 8 inputs as x0 x4 x1 x5
// x2 x6 x3 x7, and the 8-byte load at 4 j is again the step's B fragment.
// Against expanding each weight to bf16 first: the down projection ~6%
// faster at 256-512 tokens, the gate/up the same at 512, and the weights
// exact (the relative error of the MoE test cases 3.8e-3 -> 1.6e-3; H100).
__device__ __forceinline__ uint32_t raw_pair(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(r) : "r"(w));  // (w & m) | c
  return r;
}
// A weight load with an L2 prefetch size (l2_fetch: 0 none, 1 128 bytes, 2
// 256 bytes). The skinny kernels' quads read a part of a row's L2 line a
// step (the dense skinny GEMM 64 bytes a unit, the skinny MoE 32 bytes a
// group) and the rest a DRAM round trip later; the hint has the L2 fetch
// the whole line (or two) from DRAM at the first touch.
__device__ __forceinline__ uint4 ld_weights(const uint4* p, int l2_fetch) {
  uint4 r;
  if (l2_fetch == 2)
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else if (l2_fetch == 1)
    asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    r = __ldg(p);
  return r;
}
__device__ __forceinline__ uint2 ld_weights(const uint2* p, int l2_fetch) {
  uint2 r;
  if (l2_fetch == 2) asm("ld.global.nc.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  else if (l2_fetch == 1) asm("ld.global.nc.L2::128B.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  else r = __ldg(p);
  return r;
}
__device__ __forceinline__ uint32_t ld_weights(const uint32_t* p, int l2_fetch) {
  uint32_t r;
  if (l2_fetch == 2) asm("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(r) : "l"(p));
  else if (l2_fetch == 1) asm("ld.global.nc.L2::128B.u32 %0, [%1];" : "=r"(r) : "l"(p));
  else r = __ldg(p);
  return r;
}

template <bool SWIGLU, int KS>
__global__ void __launch_bounds__(kSkWarps * 32, KS > 1 ? 1 : 2) moe_skinny_kernel(const GemmParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int K = p.K, ldxs = K + 4, KG = K / 64;
  const int wt = warp / KS, kbeg = (warp % KS) * (KG / KS), kend = kbeg + KG / KS;
  const int cols = (SWIGLU ? 16 : 32) * (kSkWarps / KS);  // outputs of a column chunk
  const int chunks = (p.N + cols - 1) / cols;
  const int KGs = KG / KS;

  // The block's units of work, (tile, column chunk) numbered tile by tile,
  // in runs of consecutive chunks of one tile: the x rows are staged once a
  // run and the register ring runs on across its chunks (group q of the
  // warp's slice of a run is group kbeg + q % KGs of its chunk q / KGs).
  // With KS > 1 a block takes one unit, (blockIdx.x, blockIdx.y).
  int u, u_end;
  if constexpr (KS > 1) {
    if (int(blockIdx.x) >= *p.num_tiles) return;
    u = int(blockIdx.x) * chunks + int(blockIdx.y);
    u_end = u + 1;
  } else {
    // KS = 1, over the plan's tiles (known only here) and the blocks of one
    // wave P (two an SM): where the tiles fit the wave, a block takes a
    // whole tile or an equal part of one (at most 4 chunks); from 1.3 waves
    // of tiles on, the same in several waves: the blocks of an expert's
    // tiles then run side by side, so its weights come from DRAM about once
    // (43% of the experts take two tiles at 512 tokens); between the two
    // (~300-450 tokens), where a second wave would run a few blocks alone,
    // the wave's blocks take equal shares of all the units, most staging
    // two tiles (H100, prefill 320 / 384 tokens +6.5%; at 512 the shares
    // lost 2.6% to the waves).
    const int tiles = *p.num_tiles, P = p.sk_wave, b = int(blockIdx.x);
    const bool aligned = tiles <= P || 10 * tiles > 13 * P;
    if (aligned) {
      const int parts = max((chunks + kSkTileRun - 1) / kSkTileRun, min(chunks, P / max(tiles, 1)));
      const int tile = b / parts, j = b - tile * parts;
      if (tile >= tiles) return;
      u = tile * chunks + chunks * j / parts;
      u_end = tile * chunks + chunks * (j + 1) / parts;
    } else {
      if (b >= P) return;
      const long long units = static_cast<long long>(tiles) * chunks;
      u = static_cast<int>(units * b / P);
      u_end = static_cast<int>(units * (b + 1) / P);
    }
  }
  // The group sums of x, [group][token], after the x rows.
  float* xsum = reinterpret_cast<float*>(smem + size_t(kSkRows) * (K * 2 + 8));
  const bool f16 = p.sb_f16 != 0;
  uint16_t* y = static_cast<uint16_t*>(p.y);
  uint2 cw[kSkRing][4];
  uint32_t cs[kSkRing][4];
  for (bool first = true; u < u_end; first = false) {
    const int tile = u / chunks, c0 = u - tile * chunks, nch = min(chunks - c0, u_end - u);
    u += nch;
    const int expert = p.tile_expert[tile], m0 = p.tile_row0[tile], rows_valid = p.tile_rows[tile];
    const int Q = nch * KGs;

    // This thread's 4 weight rows: fragment rows g and g + 8 of two m16
    // tiles (SwiGLU: the same 16 gate rows and up rows, so gate and up of an
    // output meet in one thread), at column (c0 + c) * cols + col_in[i] in
    // the run's chunk c.
    int col_in[4];
    const uint8_t* wbase[4];
    const uint32_t* sbase[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int mt = i >> 1, hh = i & 1;
      if (SWIGLU) {
        col_in[i] = 16 * wt + g + 8 * hh;
        wbase[i] = (mt ? p.w2 : p.w) + size_t(expert) * p.expert_w_bytes + 8 * t;
        sbase[i] = (mt ? p.sb2 : p.sb) + size_t(expert) * p.expert_sb_words;
      } else {
        col_in[i] = 32 * wt + 16 * mt + g + 8 * hh;
        wbase[i] = p.w + size_t(expert) * p.expert_w_bytes + 8 * t;
        sbase[i] = p.sb + size_t(expert) * p.expert_sb_words;
      }
    }
    // (Rows past N read row 0 and groups past the run's last chunk its
    // last one: their sums are never stored.)
    auto load_group = [&](int q, uint2 (&c)[4], uint32_t (&sb)[4]) {
      q = min(q, Q - 1);
      const int ch = q / KGs, kg = kbeg + q - ch * KGs;
      const int n0 = (c0 + ch) * cols;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = n0 + col_in[i] < p.N ? n0 + col_in[i] : 0;
        c[i] = ld_weights(reinterpret_cast<const uint2*>(wbase[i] + size_t(n) * p.w_row_stride + kg * 32), p.l2_fetch);
        sb[i] = ld_weights(sbase[i] + size_t(n) * p.sb_row_stride + kg, p.l2_fetch);
      }
    };
#pragma unroll
    for (int d = 0; d < kSkRing - 1; ++d) load_group(d, cw[d], cs[d]);

    if (!first) __syncthreads();  // every warp is done with the previous run's x rows
    // The tile's x rows in the permuted order above (rows past rows_valid
    // zeros), 8 inputs a piece, and each group's sum (8 lanes: one group of
    // one row, K / 8 a multiple of 8); four pieces in flight a thread (16 K
    // / 8 pieces: K % 256 == 0 makes them a multiple of 2 x 256, so a
    // warp's lanes all take a piece or none).
    const int cpr = K / 8;
    for (int i0 = tid; i0 < kSkRows * cpr; i0 += 4 * kSkWarps * 32) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = i0 + j * kSkWarps * 32, r = i / cpr, c = i - r * cpr;
        v[j] = make_uint4(0, 0, 0, 0);
        if (r < rows_valid) {  // (r < 16 too: rows_valid <= 16)
          const int src_row = p.a_rows ? p.a_rows[m0 + r] : m0 + r;
          v[j] = *reinterpret_cast<const uint4*>(p.x + size_t(src_row) * p.ldx + c * 8);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = i0 + j * kSkWarps * 32, r = i / cpr, c = i - r * cpr;
        if (r >= kSkRows) break;  // K = 256 (mod 512): the last round's second half
        float sum = 0.f;
        const uint32_t vw[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) sum += bf16_lo(vw[q]) + bf16_hi(vw[q]);
        uint2* dst = reinterpret_cast<uint2*>(xs + r * ldxs + c * 8);
        dst[0] = make_uint2(__byte_perm(v[j].x, v[j].z, 0x5410), __byte_perm(v[j].x, v[j].z, 0x7632));
        dst[1] = make_uint2(__byte_perm(v[j].y, v[j].w, 0x5410), __byte_perm(v[j].y, v[j].w, 0x7632));
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if ((c & 7) == 0) xsum[(c >> 3) * kSkRows + r] = sum;
      }
    }
    __syncthreads();

    float acc[2][2][4] = {};
    for (int q0 = 0; q0 < Q; q0 += kSkRing) {
      const int kg0 = kbeg + q0 % KGs;  // KGs a multiple of kSkRing: one chunk a turn
#pragma unroll
      for (int d = 0; d < kSkRing; ++d) {
        const int kg = kg0 + d;
        load_group(q0 + d + kSkRing - 1, cw[(d + kSkRing - 1) % kSkRing], cs[(d + kSkRing - 1) % kSkRing]);
        // The group's sums of (128 + q) x: gs[mt][nt] as acc below.
        float gs[2][2][4] = {};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // Step j's fragments (word j / 2, pairs 2 (j & 1) and + 1) of the 4
          // rows: aj[mt] rows g (regs 0, 2) and g + 8 (regs 1, 3) of m-tile mt.
          uint32_t aj[2][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t w = ((j >> 1) ? cw[d][i].y : cw[d][i].x) >> (8 * (j & 1));
            aj[i >> 1][i & 1] = raw_pair(w);
            aj[i >> 1][2 + (i & 1)] = raw_pair(w >> 4);
          }
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint2 b = *reinterpret_cast<const uint2*>(xs + (8 * nt + g) * ldxs + kg * 64 + 16 * t + 4 * j);
            mma_bf16(gs[0][nt], aj[0], b.x, b.y);
            mma_bf16(gs[1][nt], aj[1], b.x, b.y);
          }
        }
        // Token 8 nt + 2 t + (e & 1)'s group sum; row i = 2 mt + (e >> 1)'s scale and bias.
        const float2 x0 = *reinterpret_cast<const float2*>(xsum + kg * kSkRows + 2 * t);
        const float2 x1 = *reinterpret_cast<const float2*>(xsum + kg * kSkRows + 8 + 2 * t);
        float S[4], Bq[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 sc = scale_bias(cs[d][i], f16 ? 1 : 0);
          S[i] = sc.x;
          Bq[i] = fmaf(-128.f, sc.x, sc.y);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = 2 * mt + (e >> 1);
              const float xg = nt ? (e & 1 ? x1.y : x1.x) : (e & 1 ? x0.y : x0.x);
              acc[mt][nt][e] = fmaf(S[i], gs[mt][nt][e], fmaf(Bq[i], xg, acc[mt][nt][e]));
            }
      }
      if (kg0 + kSkRing < kend) continue;

      if constexpr (KS > 1) {  // the slices' sums, in warp order, through the x tile's memory (one unit)
        float* red = reinterpret_cast<float*>(smem);  // [warp][16][32]
        __syncthreads();
        if (warp % KS != 0) {
#pragma unroll
          for (int i = 0; i < 16; ++i) red[(warp * 16 + i) * 32 + lane] = acc[i >> 3][(i >> 2) & 1][i & 3];
        }
        __syncthreads();
        if (warp % KS != 0) return;
#pragma unroll
        for (int w = 1; w < KS; ++w)
#pragma unroll
          for (int i = 0; i < 16; ++i) acc[i >> 3][(i >> 2) & 1][i & 3] += red[((warp + w) * 16 + i) * 32 + lane];
      }

      // The chunk's outputs. acc[mt][nt][e]: weight row g + 8 (e >> 1) of
      // m-tile mt, token 8 nt + 2t + (e & 1).
      const int nb0 = (c0 + q0 / KGs) * cols;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 8 * nt + 2 * t + (e & 1);
          const float v0 = acc[0][nt][e], v1 = acc[1][nt][e];
          acc[0][nt][e] = 0.f;
          acc[1][nt][e] = 0.f;
          if (tok >= rows_valid) continue;
          uint16_t* yr = y + size_t(m0 + tok) * p.ldy;
          if constexpr (SWIGLU) {
            const int col = nb0 + 16 * wt + g + 8 * (e >> 1);
            if (col < p.N) yr[col] = f32_to_bf16_bits(p_silu(v0) * v1);
          } else {
            const int col = nb0 + 32 * wt + g + 8 * (e >> 1);
            if (col < p.N) yr[col] = f32_to_bf16_bits(v0);
            if (col + 16 < p.N) yr[col + 16] = f32_to_bf16_bits(v1);
          }
        }
    }
  }
}

// Grouped q4 experts with tiles of <= 16 rows (bf16 output).
bool moe_skinny_fits(const PrefillMoeArgs& a) {
  return a.gate.fmt == PrefillWeightFormat::Q4 && a.down.fmt == PrefillWeightFormat::Q4 && a.hidden % 256 == 0 &&
         a.inter % 256 == 0 &&
         size_t(kSkRows) * (std::max(a.hidden, a.inter) * 2 + 8 + std::max(a.hidden, a.inter) / 64 * 4) <=
             size_t(kSkMaxSmem);
}

// An L2 fetch size for ld_weights (0, 1: 128 bytes, 2: 256 bytes) from an
// experiment's environment variable, `fallback` where it is unset.
int l2_fetch_env(const char* name, int fallback) {
  const char* e = std::getenv(name);
  const int f = e ? std::atoi(e) : fallback;
  return f == 1 || f == 2 ? f : 0;
}

// GemmParams::l2_fetch of the skinny MoE: 128 bytes (LILY_CUDA_SKINNY_MOE_L2
// = 0|1|2 for experiments). In one binary (H100) the MoE at T = 256 / 512
// took 0.301 / 0.433 ms without, 0.275 / 0.393 with 128 bytes, 0.279 /
// 0.395 with 256; the prefill 3-6% longer without at 97-640 tokens.
int moe_skinny_l2_fetch() {
  static const int v = l2_fetch_env("LILY_CUDA_SKINNY_MOE_L2", 1);
  return v;
}

template <bool SWIGLU, int KS>
void launch_moe_skinny_t(const GemmParams& p, dim3 grid, size_t smem, cudaStream_t s) {
  static const bool attr_ok = [] {  // once per kernel
    check(cudaFuncSetAttribute(moe_skinny_kernel<SWIGLU, KS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kSkMaxSmem),
          "cudaFuncSetAttribute(prefill MoE skinny kernel)");
    return true;
  }();
  (void)attr_ok;
  moe_skinny_kernel<SWIGLU, KS><<<grid, kSkWarps * 32, smem, s>>>(p);
  check_launch("prefill MoE skinny kernel");
}

// KS = 1: the tiles' column chunks over the blocks of one wave (two an SM,
// or prefill_set_moe_skinny_blocks) or in whole-tile runs (the kernel
// decides, from the plan's tile count). A launch with fewer units than the
// wave: K over 4 or 2 warps, where a warp's share keeps a whole turn of
// the register ring, a unit a block.
void launch_moe_skinny(const GemmParams& p, bool swiglu, int max_tiles, cudaStream_t s) {
  const int KG = p.K / 64;
  const int cols1 = (swiglu ? 16 : 32) * kSkWarps;
  const size_t wave = g_moe_skinny_blocks > 0 ? size_t(g_moe_skinny_blocks) : size_t(2 * sm_count());
  const size_t units1 = size_t(max_tiles) * ((p.N + cols1 - 1) / cols1);
  const int ks = units1 >= wave ? 1 : (KG / 4) % kSkRing == 0 ? 4 : (KG / 2) % kSkRing == 0 ? 2 : 1;
  // The x rows and their group sums (the K split's sums reuse the rows' room).
  const size_t smem = std::max(size_t(kSkRows) * (p.K * 2 + 8), ks > 1 ? size_t(kSkWarps) * 16 * 32 * 4 : 0) +
                      size_t(p.K / 64) * kSkRows * 4;
  const int chunks = (p.N + cols1 / ks - 1) / (cols1 / ks);
  // (KS = 1: enough blocks for either form of the schedule; the extra ones return at once.)
  const size_t tile_parts = size_t(max_tiles) * ((chunks + kSkTileRun - 1) / kSkTileRun);
  const dim3 grid = ks > 1 ? dim3(max_tiles, chunks) : dim3(unsigned(std::max(std::min(units1, wave), tile_parts)));
  GemmParams q = p;
  q.sk_wave = int(std::min(wave, size_t(grid.x)));
  q.l2_fetch = moe_skinny_l2_fetch();
  if (swiglu)
    ks == 4 ? launch_moe_skinny_t<true, 4>(q, grid, smem, s)
    : ks == 2 ? launch_moe_skinny_t<true, 2>(q, grid, smem, s)
              : launch_moe_skinny_t<true, 1>(q, grid, smem, s);
  else
    ks == 4 ? launch_moe_skinny_t<false, 4>(q, grid, smem, s)
    : ks == 2 ? launch_moe_skinny_t<false, 2>(q, grid, smem, s)
              : launch_moe_skinny_t<false, 1>(q, grid, smem, s);
}

// ---- Skinny dense GEMM (q4 / q8 weights, runs of <= 16 rows) -------------------
// A run of a few tokens (a speculative draft run, a short follow-up turn)
// through the tiled GEMMs pays for 64- or 128-row tiles and a weight tile
// expanded in shared memory per block: the DeltaNet in_proj took ~46 us at
// T = 2 on the H200 against ~10-13 us for the decode matvec over the same
// bytes. Here, as in the skinny MoE kernel above, the weights are the A
// operand of m16n8k16 (16 rows per warp; per 64-byte unit of a row, lane t
// of a quad takes bytes 16 t .. + 15 straight into registers, so a quad
// reads 64 contiguous bytes, RING - 1 units ahead; the k order inside a
// unit is permuted to match, as in the MoE kernel) and the run's rows are N
// (NT n8 halves; the rows past T are zeros, not loaded). A block is 4 warps:
// with KS = 1 each takes 16 weight rows over all of K (64 rows a block, so
// Qwen3.6's in_proj takes 193 blocks); a matrix that would give fewer than
// two blocks per SM that way (out_proj, o_proj, the shared expert, the
// router: 5 to 32 blocks) takes KS = 4: the 4 warps take one 16-row tile
// over a quarter of K each and add their sums through shared memory in warp
// order, 4x the blocks; KS = 2 where those would not all be resident at
// once for a run of 16 (the in_proj's 772: a second, partial wave).
// SwiGLU: 16 outputs a warp tile (their gate and up rows). Several
// matrices of the same input (a DeltaNet layer's qkv / z / b / a) run as
// parts of one launch, each into its own output columns. KS follows from
// the shapes alone and every output is summed in a fixed
// order and written once, so a row's result does not depend on T.
constexpr int kSdWarps = 4;
constexpr int kSdMaxRows = 16;
// A grouped (short-run MoE) tile's most rows: 8, so that one n8 half of the
// MMA takes a tile and the staged rows of a block need half the shared
// memory of 16 (a run of 9..16 tokens: 3 -> 4 blocks an SM); an expert
// with more rows takes several tiles, the shared expert ceil(T / 8).
constexpr int kSdGroupedRows = 8;
// Experiments: LILY_CUDA_GROUPED_ROWS=16 (the tiles of before, <= T rows).
int grouped_rows() {
  static const int rows = [] {
    const char* v = std::getenv("LILY_CUDA_GROUPED_ROWS");
    return v && std::atoi(v) == 16 ? 16 : kSdGroupedRows;
  }();
  return rows;
}
constexpr int kSdMaxParts = 4;
constexpr int kSdMaxSmem = 200 * 1024;

struct SkinnyPart {
  const uint8_t* w;
  const uint32_t* sb;
  size_t w_row_stride, sb_row_stride;  // bytes, u32 words
  int rows, col0, sb_f16, block0;      // block0: the part's first block
};
struct SkinnyParams {
  SkinnyPart part[kSdMaxParts];
  int nparts;
  const uint8_t* w2;  // SwiGLU: the up matrix (part 0 is the gate, same strides)
  const uint32_t* sb2;
  int K, M;
  const uint16_t* x;
  size_t ldx;
  void* y;
  size_t ldy;
  int out_kind;  // PrefillOut (SwiGLU: bf16)
  // Grouped (a short run's MoE, GROUPED): blockIdx.y is tile y of the plan
  // (expert, first row, rows; tiles past *num_tiles exit). Part 0 (and w2 /
  // sb2) hold expert 0's matrix, expert e's lies e expert strides further;
  // the tile's x rows are x_rows[row0 + r] (null: row0 + r) and its outputs
  // go to rows row0 + r of y. Expert E is the shared expert (sh_*, the
  // same strides), whose non-SwiGLU outputs go as f32 to row (row0 + r -
  // sh_row0), the token's, of y_shared.
  const int *tile_expert, *tile_row0, *tile_rows, *num_tiles, *x_rows;
  size_t expert_w_bytes, expert_sb_words;
  int E;
  const uint8_t *sh_w, *sh_w2;
  const uint32_t *sh_sb, *sh_sb2;
  float* y_shared;
  size_t ld_shared;
  int sh_row0;  // the shared expert's first row (token 0) in the plan's rows
  int l2_fetch;  // the weight loads' L2 prefetch size: 0 the default, 1 128 bytes, 2 256 bytes
};


GemmParams base_params(const PrefillWeight& w);

size_t skinny_smem_bytes(int T, int K) { return size_t(T) * (size_t(K) * 2 + 8); }

template <int NT, int RING, bool SWIGLU, int BITS, int KS, bool GROUPED>
__global__ void __launch_bounds__(kSdWarps * 32) gemm_skinny_kernel(const __grid_constant__ SkinnyParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  constexpr int R = SWIGLU ? 4 : 2;  // weight rows per lane: g and g + 8 (of gate and up)
  constexpr int MT = SWIGLU ? 2 : 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // A unit: 64 code bytes of a row (q4: 128 inputs, two scale groups; q8:
  // 64 inputs), lane t's 16 of them at 16 t, so a quad reads its row's unit
  // in one contiguous 64-byte piece.
  constexpr int kPerUnit = BITS == 4 ? 128 : 64, kSteps = kPerUnit / 16;
  const int K = p.K, ldxs = K + 4, KU = K / kPerUnit;
  // The block's part (unrolled selects: no dynamic index into the parameters).
  SkinnyPart P = p.part[0];
#pragma unroll
  for (int i = 1; i < kSdMaxParts; ++i)
    if (i < p.nparts && int(blockIdx.x) >= p.part[i].block0) P = p.part[i];
  constexpr int kRowsPerBlock = 16 * (kSdWarps / KS);
  const int n0 = (int(blockIdx.x) - P.block0) * kRowsPerBlock + 16 * (warp / KS);
  // The warp's units of K: [kbeg, kend).
  const int kbeg = (warp % KS) * (KU / KS), kend = kbeg + KU / KS;
  const int sb_lane = BITS == 4 ? t >> 1 : 0;  // the lane's scale group within a unit
  // The rows of x this block multiplies: M rows from row m0 (grouped: the tile's).
  int m0 = 0, M = p.M;
  const uint8_t* w2 = p.w2;
  const uint32_t* sb2 = p.sb2;
  bool shared_tile = false;
  if constexpr (GROUPED) {
    pdl_wait();  // the plan's tiles
    pdl_launch_dependents();
    const int tile = blockIdx.y;
    if (tile >= *p.num_tiles) return;
    const int e = p.tile_expert[tile];
    m0 = p.tile_row0[tile];
    M = p.tile_rows[tile];
    if (e >= p.E) {
      shared_tile = true;
      P.w = p.sh_w;
      P.sb = p.sh_sb;
      w2 = p.sh_w2;
      sb2 = p.sh_sb2;
    } else {
      P.w += size_t(e) * p.expert_w_bytes;
      P.sb += size_t(e) * p.expert_sb_words;
      if constexpr (SWIGLU) {
        w2 += size_t(e) * p.expert_w_bytes;
        sb2 += size_t(e) * p.expert_sb_words;
      }
    }
  }

  const uint8_t* wrow[R];
  const uint32_t* srow[R];
  bool rok[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int n = n0 + g + 8 * (i & 1);
    const uint8_t* base = SWIGLU && i >= 2 ? w2 : P.w;
    const uint32_t* sbase = SWIGLU && i >= 2 ? sb2 : P.sb;
    rok[i] = n < P.rows;
    wrow[i] = base + size_t(rok[i] ? n : 0) * P.w_row_stride + 16 * t;
    srow[i] = sbase + size_t(rok[i] ? n : 0) * P.sb_row_stride + sb_lane;
  }
  uint4 cw[RING][R];
  uint32_t cs[RING][R];
  auto load_group = [&](int u, uint4 (&c)[R], uint32_t (&sb)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      c[i] = rok[i] && u < kend ? ld_weights(reinterpret_cast<const uint4*>(wrow[i] + size_t(u) * 64), p.l2_fetch)
                                : uint4{};
      sb[i] = rok[i] && u < kend ? ld_weights(srow[i] + u * (BITS == 4 ? 2 : 1), p.l2_fetch) : 0u;
    }
  };
#pragma unroll
  for (int d = 0; d < RING - 1; ++d) load_group(kbeg + d, cw[d], cs[d]);
  if constexpr (!GROUPED) {  // the first weights requested (constants), now x
    pdl_wait();
    pdl_launch_dependents();
  }

  // The block's M rows, 8-byte copies (the MMAs take zeros for rows past M).
  const int cpr = K / 4;
  for (int i = tid; i < M * cpr; i += kSdWarps * 32) {
    const int r = i / cpr, c = i % cpr;
    const int xr = GROUPED ? (p.x_rows ? p.x_rows[m0 + r] : m0 + r) : r;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(xs + r * ldxs + c * 4)),
                 "l"(p.x + size_t(xr) * p.ldx + c * 4));
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  float acc[MT][NT][4] = {};
  const bool f16 = P.sb_f16 != 0;
  for (int kg0 = kbeg; kg0 < kend; kg0 += RING) {
#pragma unroll
    for (int d = 0; d < RING; ++d) {
      const int kg = kg0 + d;
      load_group(kg + RING - 1, cw[(d + RING - 1) % RING], cs[(d + RING - 1) % RING]);
      uint32_t a[MT][kSteps][4];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if constexpr (BITS == 4) skinny_frags_q4x2(cw[d][i], cs[d][i], f16, i & 1, a[i >> 1]);
        else skinny_frags(cw[d][i], cs[d][i], f16, i & 1, a[i >> 1]);
      }
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          // Step j takes k = unit + (kPerUnit / 4) t + 4 j .. + 3 from every lane t.
          const uint2 b =
              8 * nt + g < M
                  ? *reinterpret_cast<const uint2*>(xs + (8 * nt + g) * ldxs + kg * kPerUnit + (kPerUnit / 4) * t + 4 * j)
                  : make_uint2(0, 0);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_bf16(acc[mt][nt], a[mt][j], b.x, b.y);
        }
      }
    }
  }

  if constexpr (KS > 1) {  // the tile's K quarters summed by its first warp, in warp order
    __shared__ float red[kSdWarps][MT * NT * 4][32];
    if (warp % KS != 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) red[warp][(mt * NT + nt) * 4 + e][lane] = acc[mt][nt][e];
    }
    __syncthreads();
    if (warp % KS != 0) return;
#pragma unroll
    for (int w = 1; w < KS; ++w)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += red[warp + w][(mt * NT + nt) * 4 + e][lane];
  }

  // acc[mt][nt][e]: weight row n0 + g + 8 (e >> 1) (of the gate / up for
  // SwiGLU), token 8 nt + 2t + (e & 1).
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 8 * nt + 2 * t + (e & 1);
      const int n = n0 + g + 8 * (e >> 1);
      float v = acc[0][nt][e];
      if (!SWIGLU && p.out_kind == kOutSwigluPairs)  // row n + 1 (up) sits in lane + 4 (g + 1); all lanes here
        v = p_silu(v) * __shfl_xor_sync(0xffffffffu, v, 4);
      if (tok >= M || n >= P.rows) continue;
      const size_t at = size_t(m0 + tok) * p.ldy + P.col0 + n;
      if constexpr (SWIGLU) {
        static_cast<uint16_t*>(p.y)[at] = f32_to_bf16_bits(p_silu(acc[0][nt][e]) * acc[1][nt][e]);
      } else {
        if (p.out_kind == kOutSwigluPairs) {
          if ((g & 1) == 0) static_cast<uint16_t*>(p.y)[size_t(m0 + tok) * p.ldy + P.col0 + n / 2] = f32_to_bf16_bits(v);
        } else if (GROUPED && shared_tile) p.y_shared[size_t(m0 - p.sh_row0 + tok) * p.ld_shared + n] = v;
        else if (p.out_kind == int(PrefillOut::BF16)) static_cast<uint16_t*>(p.y)[at] = f32_to_bf16_bits(v);
        else if (p.out_kind == int(PrefillOut::F32Add)) static_cast<float*>(p.y)[at] += v;
        else static_cast<float*>(p.y)[at] = v;
      }
    }
}

int g_skinny_max_rows = kSdMaxRows;
bool g_moe_grouped = true;
bool g_prefill_pdl = true;

// q4 (K a multiple of 128: whole units) or q8, T <= the skinny GEMM limit
// (prefill_skinny_gemm_rows), the run's rows fit in shared memory.
bool skinny_fits(const PrefillWeight& w, int T) {
  return T >= 1 && T <= prefill_skinny_gemm_rows() && w.fmt != PrefillWeightFormat::BF16 &&
         (w.fmt != PrefillWeightFormat::Q4 || w.cols % 128 == 0) &&
         skinny_smem_bytes(T, w.cols) <= size_t(kSdMaxSmem);
}

SkinnyPart skinny_part(const PrefillWeight& w, int col0, int block0) {
  const GemmParams b = base_params(w);
  return SkinnyPart{b.w, b.sb, b.w_row_stride, b.sb_row_stride, w.rows, col0, b.sb_f16, block0};
}

// SkinnyParams::l2_fetch: 256 bytes (LILY_CUDA_SKINNY_L2=0|1|2 for
// experiments). Runs of 2..16 tokens 3-8% shorter with one wave below
// (H100, docs/cuda-prefill.md "Short runs, round 3").
int skinny_l2_fetch() {
  static const int v = l2_fetch_env("LILY_CUDA_SKINNY_L2", 2);
  return v;
}

// occ: instead of launching, the blocks of this launch one SM holds.
template <int NT, int RING, bool SWIGLU, int BITS, int KS, bool GROUPED>
void launch_skinny_t(const SkinnyParams& p0, dim3 blocks, cudaStream_t s, int* occ) {
  SkinnyParams p = p0;
  p.l2_fetch = skinny_l2_fetch();
  auto kernel = gemm_skinny_kernel<NT, RING, SWIGLU, BITS, KS, GROUPED>;
  static const bool attr_ok = [&] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSdMaxSmem),
          "cudaFuncSetAttribute(prefill skinny GEMM)");
    return true;
  }();
  (void)attr_ok;
  const size_t smem = skinny_smem_bytes(p.M, p.K);
  if (occ) {
    static std::mutex mu;
    static std::map<size_t, int> cache;  // by shared memory bytes
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(smem);
    if (it == cache.end()) {
      int n = 0;
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kSdWarps * 32, smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor(prefill skinny GEMM)");
      it = cache.emplace(smem, n).first;
    }
    *occ = it->second;
    return;
  }
  launch_kernel("prefill skinny GEMM", kernel, blocks, dim3(kSdWarps * 32), smem, s, prefill_pdl(p.M), p);
}

template <bool SWIGLU, int BITS, int KS, bool GROUPED = false>
void launch_skinny(const SkinnyParams& p, dim3 blocks, cudaStream_t s, int* occ = nullptr) {
  if (blocks.x > 2147483647u / 2) fail("prefill skinny GEMM: too many output rows");
  // The ring: the most units (64 code bytes a row; up to 8, 4 for SwiGLU
  // (4 rows of 16 bytes a lane) and for q4 (two groups a unit)) that divide
  // a warp's share of K. (8 for q4 measured slower: the MoE gate/up at
  // T = 2 18.3 -> 28.0 us, out_proj 9.4 -> 12.2, H100.)
  const int KG = p.K / (BITS == 4 ? 128 : 64) / KS;
  constexpr int kMaxRing = SWIGLU || BITS == 4 ? 4 : 8;
  auto go = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    if (KG % 8 == 0 && kMaxRing == 8) launch_skinny_t<NT, kMaxRing, SWIGLU, BITS, KS, GROUPED>(p, blocks, s, occ);
    else if (KG % 4 == 0) launch_skinny_t<NT, 4, SWIGLU, BITS, KS, GROUPED>(p, blocks, s, occ);
    else if (KG % 2 == 0) launch_skinny_t<NT, 2, SWIGLU, BITS, KS, GROUPED>(p, blocks, s, occ);
    else launch_skinny_t<NT, 1, SWIGLU, BITS, KS, GROUPED>(p, blocks, s, occ);
  };
  if (p.M <= 8) go(std::integral_constant<int, 1>{});
  else if (p.M <= 16) go(std::integral_constant<int, 2>{});
  else go(std::integral_constant<int, 4>{});
}

// Experiments: LILY_CUDA_SKINNY_KS (dense) / LILY_CUDA_GROUPED_KS (the
// short MoE) = 1, 2 or 4 warps over K instead of the shapes' choice.
int skinny_ks_override(bool grouped) {
  static const int dense = [] {
    const char* v = std::getenv("LILY_CUDA_SKINNY_KS");
    return v ? std::atoi(v) : 0;
  }();
  static const int grp = [] {
    const char* v = std::getenv("LILY_CUDA_GROUPED_KS");
    return v ? std::atoi(v) : 0;
  }();
  const int f = grouped ? grp : dense;
  return f == 1 || f == 2 || f == 4 ? f : 0;
}

// Lays the parts out over blocks (SkinnyPart::block0) for the split of K
// the shapes call for, and launches.
template <bool SWIGLU>
void plan_and_launch_skinny(SkinnyParams& p, PrefillWeightFormat fmt, cudaStream_t s) {
  auto blocks_for = [&](int rows_per_block) {
    int b = 0;
    for (int i = 0; i < p.nparts; ++i) {
      p.part[i].block0 = b;
      b += (p.part[i].rows + rows_per_block - 1) / rows_per_block;
    }
    return b;
  };
  const bool q4 = fmt == PrefillWeightFormat::Q4;
  // K over the block's 4 warps where whole-K blocks would be under two per
  // SM (4x the blocks, a quarter of the units in each warp's chain). Not
  // for large grids: the lm_head's 3,880 blocks split so took 140 us at
  // T = 2 against 121 (H100, ncu).
  const int KU = p.K / (q4 ? 128 : 64);
  int ks = blocks_for(16 * kSdWarps) < 2 * sm_count() && KU % kSdWarps == 0 ? kSdWarps : 1;
  static const bool one_wave = [] {  // LILY_CUDA_SKINNY_WAVE=0: KS = 4 whatever the waves (experiments)
    const char* v = std::getenv("LILY_CUDA_SKINNY_WAVE");
    return !v || std::atoi(v) != 0;
  }();
  if (one_wave && ks == kSdWarps) {
    // The most warps over K whose grid is one wave of resident blocks (a
    // second, partial wave costs a whole block's time), judged for a run of
    // the most rows (the fewest blocks an SM holds) so that the split, and
    // with it a row's sums, does not depend on the run's length.
    SkinnyParams q = p;
    q.M = kSdMaxRows;
    auto resident = [&](int f) {
      int occ = 0;
      const dim3 g(blocks_for(16 * (kSdWarps / f)));
      if (f == 4) q4 ? launch_skinny<SWIGLU, 4, 4>(q, g, s, &occ) : launch_skinny<SWIGLU, 8, 4>(q, g, s, &occ);
      else q4 ? launch_skinny<SWIGLU, 4, 2>(q, g, s, &occ) : launch_skinny<SWIGLU, 8, 2>(q, g, s, &occ);
      return size_t(g.x) <= size_t(occ) * sm_count();
    };
    if (!resident(4)) ks = KU % 2 == 0 && resident(2) ? 2 : 1;
  }
  if (const int f = skinny_ks_override(false); f && KU % f == 0) ks = f;
  const dim3 grid(blocks_for(16 * (kSdWarps / ks)));
  if (ks == 4) q4 ? launch_skinny<SWIGLU, 4, 4>(p, grid, s) : launch_skinny<SWIGLU, 8, 4>(p, grid, s);
  else if (ks == 2) q4 ? launch_skinny<SWIGLU, 4, 2>(p, grid, s) : launch_skinny<SWIGLU, 8, 2>(p, grid, s);
  else q4 ? launch_skinny<SWIGLU, 4, 1>(p, grid, s) : launch_skinny<SWIGLU, 8, 1>(p, grid, s);
}

// A short run's MoE matrix (q4, grouped; p's part 0 and tile fields set):
// one row of blocks per tile of the plan (max_tiles rows of the grid, the
// unused ones exit), K split over the warps where the grid would give
// under two blocks per SM. p.M: the most rows a tile can have.
template <bool SWIGLU>
void launch_skinny_grouped(const SkinnyParams& p, int max_tiles, cudaStream_t s) {
  // K over two warps where the grid of whole-K blocks would be under four
  // blocks per SM (runs of 2-5 tokens, few tiles): at T = 2 and 5 the run
  // measured faster than with four (4x the blocks, SwiGLU's at 168
  // registers 3 per SM: 1.5 waves) or none (H100, docs/cuda-prefill.md
  // "Short runs").
  const int rows = p.part[0].rows, KU = p.K / 128;
  const int row_blocks = (rows + 16 * kSdWarps - 1) / (16 * kSdWarps);
  int ks = size_t(row_blocks) * max_tiles < size_t(4 * sm_count()) && KU % 2 == 0 ? 2 : 1;
  if (const int f = skinny_ks_override(true); f && KU % f == 0) ks = f;
  const int rpb = 16 * (kSdWarps / ks);
  const dim3 grid((rows + rpb - 1) / rpb, max_tiles);
  if (ks == 4) launch_skinny<SWIGLU, 4, 4, true>(p, grid, s);
  else if (ks == 2) launch_skinny<SWIGLU, 4, 2, true>(p, grid, s);
  else launch_skinny<SWIGLU, 4, 1, true>(p, grid, s);
}

// y (columns [0, sum of rows)) = x . [parts]^T: one launch. With `up`
// (one part, the gate): y (bf16) = silu(x . gate^T) * (x . up^T).
void skinny_gemm(const PrefillWeight* parts, int n, const uint16_t* x, int T, size_t ldx, void* y, size_t ldy,
                 PrefillOut out, cudaStream_t stream, const PrefillWeight* up = nullptr) {
  SkinnyParams p{};
  int col = 0;
  for (int i = 0; i < n; ++i) {
    p.part[i] = skinny_part(parts[i], col, 0);
    col += parts[i].rows;
  }
  p.nparts = n;
  p.K = parts[0].cols;
  p.M = T;
  p.x = x;
  p.ldx = ldx;
  p.y = y;
  p.ldy = ldy;
  p.out_kind = int(out);
  if (!up) return plan_and_launch_skinny<false>(p, parts[0].fmt, stream);
  const GemmParams u = base_params(*up);
  p.w2 = u.w;
  p.sb2 = u.sb;
  plan_and_launch_skinny<true>(p, parts[0].fmt, stream);
}

// w (q4 / q8, any row strides) -> bf16 [rows][cols], 8 weights per thread,
// the same FMA as dequant_tile.
template <int F>
__global__ void expand_kernel(const uint8_t* w, size_t row_stride, const uint32_t* sb, size_t sb_row_stride,
                              int sb_f16, int rows, int cols, uint16_t* out) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int gpr = cols / 8;
  if (i >= static_cast<long long>(rows) * gpr) return;
  const int n = static_cast<int>(i / gpr), k = static_cast<int>(i % gpr) * 8;
  const float2 s = scale_bias(sb[size_t(n) * sb_row_stride + k / 64], sb_f16);
  float v[8];
  if constexpr (F == kQ4) {
    const uint32_t c = *reinterpret_cast<const uint32_t*>(w + size_t(n) * row_stride + k / 2);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = float((c >> (4 * j)) & 15u);
  } else {
    const uint2 c = *reinterpret_cast<const uint2*>(w + size_t(n) * row_stride + k);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = float(((j < 4 ? c.x : c.y) >> (8 * (j & 3))) & 255u);
  }
  uint4 o;
  o.x = pack_bf16x2(fmaf(v[0], s.x, s.y), fmaf(v[1], s.x, s.y));
  o.y = pack_bf16x2(fmaf(v[2], s.x, s.y), fmaf(v[3], s.x, s.y));
  o.z = pack_bf16x2(fmaf(v[4], s.x, s.y), fmaf(v[5], s.x, s.y));
  o.w = pack_bf16x2(fmaf(v[6], s.x, s.y), fmaf(v[7], s.x, s.y));
  *reinterpret_cast<uint4*>(out + size_t(n) * cols + k) = o;
}

// A bf16 view of `w` expanded into dst (rows x cols x 2 bytes).
PrefillWeight expand_bf16(const PrefillWeight& w, uint16_t* dst, cudaStream_t stream) {
  const int bits = w.fmt == PrefillWeightFormat::Q4 ? 4 : 8;
  const size_t rs = w.row_stride_bytes ? w.row_stride_bytes : size_t(w.cols) * bits / 8;
  const size_t ss = w.sb_row_stride_words ? w.sb_row_stride_words : size_t(w.cols) / 64;
  const long long n = static_cast<long long>(w.rows) * (w.cols / 8);
  const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  if (w.fmt == PrefillWeightFormat::Q4)
    expand_kernel<kQ4><<<blocks, 256, 0, stream>>>(static_cast<const uint8_t*>(w.w), rs, w.sb, ss, w.sb_f16 ? 1 : 0,
                                                  w.rows, w.cols, dst);
  else
    expand_kernel<kQ8><<<blocks, 256, 0, stream>>>(static_cast<const uint8_t*>(w.w), rs, w.sb, ss, w.sb_f16 ? 1 : 0,
                                                  w.rows, w.cols, dst);
  check_launch("expand_kernel");
  PrefillWeight b;
  b.fmt = PrefillWeightFormat::BF16;
  b.rows = w.rows;
  b.cols = w.cols;
  b.w = dst;
  return b;
}
bool expand_pays(const PrefillWeight& w, int T, const PrefillScratch& sc, int matrices) {
  return w.fmt != PrefillWeightFormat::BF16 && sc.p && T >= sc.min_rows &&
         sc.bytes >= size_t(matrices) * w.rows * w.cols * 2;
}

const char* fmt_name(PrefillWeightFormat f) {
  return f == PrefillWeightFormat::BF16 ? "bf16" : f == PrefillWeightFormat::Q4 ? "q4" : "q8";
}

void validate_weight(const PrefillWeight& w, const char* what) {
  if (w.rows <= 0 || w.cols <= 0) fail(what, ": weight has no rows or columns (", w.rows, " x ", w.cols, ")");
  if (w.cols % 64 != 0)
    fail(what, ": weight columns (", w.cols, ") must be a multiple of 64 (format ", fmt_name(w.fmt), ")");
  if (!w.w) fail(what, ": weight data pointer is null");
  if (reinterpret_cast<uintptr_t>(w.w) % 16 != 0) fail(what, ": weight data must be 16-byte aligned");
  if (w.fmt != PrefillWeightFormat::BF16 && !w.sb)
    fail(what, ": quantized weight (", fmt_name(w.fmt), ") has no scale/bias array");
  if (w.row_stride_bytes % 16 != 0) fail(what, ": row stride must be a multiple of 16 bytes");
}

void validate_x(const uint16_t* x, size_t ldx, int K, const char* what) {
  if (!x) fail(what, ": input pointer is null");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || ldx % 8 != 0)
    fail(what, ": input must be 16-byte aligned with a row stride that is a multiple of 8 (got ", ldx, ")");
  if (ldx < size_t(K)) fail(what, ": input row stride ", ldx, " is below K = ", K);
}

GemmParams base_params(const PrefillWeight& w) {
  GemmParams p{};
  p.w = static_cast<const uint8_t*>(w.w);
  p.sb = w.sb;
  p.sb_f16 = w.sb_f16 ? 1 : 0;
  p.N = w.rows;
  p.K = w.cols;
  const int bits = w.fmt == PrefillWeightFormat::BF16 ? 16 : w.fmt == PrefillWeightFormat::Q4 ? 4 : 8;
  p.w_row_stride = w.row_stride_bytes ? w.row_stride_bytes : size_t(w.cols) * bits / 8;
  p.sb_row_stride = w.sb_row_stride_words ? w.sb_row_stride_words : size_t(w.cols) / 64;
  p.expert_w_bytes = w.expert_w_bytes;
  p.expert_sb_words = w.expert_sb_words;
  p.kt_per_split = w.cols / kBK;
  return p;
}

// ---- MoE routing kernels ------------------------------------------------------

constexpr int kRouteMaxPerLane = 16;  // E <= 512

// One token's routing by one warp: softmax over the E logits l, top k (ties
// to the lower index); lane s < k gets the s-th expert and its probability.
__device__ __forceinline__ void route_token(const float* l, int E, int k, int lane, int& my_id, float& my_p) {
  float v[kRouteMaxPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? l[e] : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = p_warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? expf(v[i] - mx) : 0.f;
    sum += v[i];
  }
  sum = p_warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kRouteMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? v[i] / sum : -1.f;  // -1: never selected
  }
  my_id = 0;
  my_p = 0.f;
  for (int s = 0; s < k; ++s) {
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kRouteMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      if (v[i] > bv) {  // ascending e: ties keep the lower index
        bv = v[i];
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) {
#pragma unroll
      for (int i = 0; i < kRouteMaxPerLane; ++i)
        if (i == (bi >> 5)) v[i] = -1.f;
    }
    if (lane == s) {
      my_id = bi;
      my_p = bv;
    }
  }
}

__global__ void moe_route_kernel(const float* logits, size_t ld, int T, int E, int k, int norm,
                                 int* ids, float* weights, int* counts) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  int my_id;
  float my_p;
  route_token(logits + size_t(t) * ld, E, k, lane, my_id, my_p);
  const float top = p_warp_sum(lane < k ? my_p : 0.f);
  if (lane < k) {
    ids[size_t(t) * k + lane] = my_id;
    weights[size_t(t) * k + lane] = norm ? my_p / top : my_p;
    if (counts) atomicAdd(&counts[my_id], 1);
  }
}

// Thread e of a block of >= E threads holds expert e's count c (0 past E):
// inclusive sums of the counts (s_c) and of the BM-row tiles (s_t) over the
// block, then expert e's tiles written; returns e's first row.
__device__ __forceinline__ int moe_scan_tiles(int* s_c, int* s_t, int e, int c, int E, int bm, int* tile_expert,
                                              int* tile_row0, int* tile_rows, int* num_tiles) {
  const int nt = (c + bm - 1) / bm;
  s_c[e] = c;
  s_t[e] = nt;
  __syncthreads();
  for (int d = 1; d < blockDim.x; d <<= 1) {
    const int a = e >= d ? s_c[e - d] : 0, b = e >= d ? s_t[e - d] : 0;
    __syncthreads();
    s_c[e] += a;
    s_t[e] += b;
    __syncthreads();
  }
  const int off = s_c[e] - c;
  if (e < E) {
    const int toff = s_t[e] - nt;
    for (int i = 0; i < nt; ++i) {
      tile_expert[toff + i] = e;
      tile_row0[toff + i] = off + i * bm;
      tile_rows[toff + i] = min(bm, c - i * bm);
    }
  }
  if (e == blockDim.x - 1) *num_tiles = s_t[e];
  return off;
}

// A short run's whole plan in one block (blockDim >= 32 min(T, 32) and >= E,
// at most 1024; at most 1024 pairs): the routing (a warp a token), the
// counts, the offsets and the BM-row tiles as moe_scan_kernel makes them,
// and the permutation, with the pairs of one expert in (token, slot) order
// (deterministic; the launches for long prompts place them by atomics).
// Replaces the memset, route, scan and scatter launches. shared: ceil(T /
// bm) more tiles, expert E (the shared expert) over every token, its rows
// after the routed pairs'.
__global__ void moe_plan_kernel(const float* logits, size_t ld, int T, int E, int k, int norm, int bm, int* ids,
                                float* weights, int* tile_expert, int* tile_row0, int* tile_rows, int* num_tiles,
                                int* perm_row, int* slot_pos, int shared) {
  pdl_wait();
  pdl_launch_dependents();
  __shared__ int s_c[1024], s_t[1024], s_ids[1024], s_cur[1024];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = T * k;
  s_c[tid] = 0;
  __syncthreads();
  for (int tok = warp; tok < T; tok += blockDim.x / 32) {
    int my_id;
    float my_p;
    route_token(logits + size_t(tok) * ld, E, k, lane, my_id, my_p);
    const float top = p_warp_sum(lane < k ? my_p : 0.f);
    if (lane < k) {
      ids[size_t(tok) * k + lane] = my_id;
      s_ids[tok * k + lane] = my_id;
      weights[size_t(tok) * k + lane] = norm ? my_p / top : my_p;
      atomicAdd(&s_c[my_id], 1);
    }
  }
  __syncthreads();
  s_cur[tid] = moe_scan_tiles(s_c, s_t, tid, tid < E ? s_c[tid] : 0, E, bm, tile_expert, tile_row0, tile_rows,
                              num_tiles);
  __syncthreads();
  if (shared) {  // the shared expert's tiles of at most bm rows
    const int nt = s_t[blockDim.x - 1], ns = (T + bm - 1) / bm;
    if (tid < ns) {
      tile_expert[nt + tid] = E;
      tile_row0[nt + tid] = n + tid * bm;
      tile_rows[nt + tid] = min(bm, T - tid * bm);
    }
    if (tid == 0) *num_tiles = nt + ns;
    if (tid < T) perm_row[n + tid] = tid;
  }
  // Pair i after the earlier pairs of its expert: one warp takes the pairs
  // 32 at a time in index order, each expert's cursor (from its offset)
  // advanced by the pairs of the 32 that it got.
  if (warp == 0) {
    for (int i0 = 0; i0 < n; i0 += 32) {
      const int i = i0 + lane;
      const bool valid = i < n;
      const int e = valid ? s_ids[i] : -1 - lane;
      const unsigned same = __match_any_sync(0xffffffffu, e);
      const int rank = __popc(same & ((1u << lane) - 1u));
      const int base = valid ? s_cur[e] : 0;
      if (valid) {
        perm_row[base + rank] = i / k;
        slot_pos[i] = base + rank;
      }
      __syncwarp();
      if (valid && rank == 0) s_cur[e] = base + __popc(same);
      __syncwarp();
    }
  }
}

// One block of E threads (E <= 1024): per-expert offsets (exclusive prefix sum
// of counts), the scatter cursors, and the list of BM-row tiles.
__global__ void moe_scan_kernel(const int* counts, int E, int bm, int* offsets, int* cursor,
                                int* tile_expert, int* tile_row0, int* tile_rows, int* num_tiles) {
  __shared__ int s_c[1024], s_t[1024];
  const int e = threadIdx.x;
  const int off =
      moe_scan_tiles(s_c, s_t, e, e < E ? counts[e] : 0, E, bm, tile_expert, tile_row0, tile_rows, num_tiles);
  if (e < E) {
    offsets[e] = off;
    cursor[e] = off;
  }
}

__global__ void moe_scatter_kernel(const int* ids, int n, int k, int* cursor, int* perm_row,
                                   int* slot_pos) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int pos = atomicAdd(&cursor[ids[i]], 1);
  perm_row[pos] = i / k;
  slot_pos[i] = pos;
}

// out[t] (+)= sum_s w[t][s] * yp[slot_pos[t][s]] (+ sigmoid(sg[t]) * shared[t]).
// yp holds the experts' output rows in bf16 (half the bytes of f32 through
// HBM twice: written by the down GEMM, read here); the sum is f32 in slot
// order (deterministic). VEC: 8 columns per thread and step (hidden % 8 == 0,
// 16-byte aligned rows).
template <bool VEC>
__global__ void moe_combine_kernel(const uint16_t* yp, int hidden, const int* slot_pos,
                                   const float* weights, int k, const float* shared, size_t ld_shared,
                                   const float* sg, size_t ld_sg, float* out, size_t ldo, int accumulate,
                                   const float* norm_w, float norm_eps, uint16_t* norm_out, size_t ld_norm_out) {
  pdl_wait();
  pdl_launch_dependents();
  const int t = blockIdx.x;
  __shared__ int s_pos[32];
  __shared__ float s_w[32];
  if (threadIdx.x < k) {
    s_pos[threadIdx.x] = slot_pos[size_t(t) * k + threadIdx.x];
    s_w[threadIdx.x] = weights[size_t(t) * k + threadIdx.x];
  }
  __syncthreads();
  const float gs = shared ? p_sigmoid(sg[size_t(t) * ld_sg]) : 0.f;
  float* o = out + size_t(t) * ldo;
  float ss = 0.f;  // the finished row's sum of squares (norm_out)
  const float* sh = shared ? shared + size_t(t) * ld_shared : nullptr;
  if constexpr (VEC) {
    for (int j = threadIdx.x * 8; j < hidden; j += blockDim.x * 8) {
      float m[8] = {};
      for (int s = 0; s < k; ++s) {
        const uint4 v = *reinterpret_cast<const uint4*>(yp + size_t(s_pos[s]) * hidden + j);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          m[2 * i] = fmaf(s_w[s], bf16_lo(w[i]), m[2 * i]);
          m[2 * i + 1] = fmaf(s_w[s], bf16_hi(w[i]), m[2 * i + 1]);
        }
      }
      float4* o4 = reinterpret_cast<float4*>(o + j);
      float4 a0 = make_float4(0.f, 0.f, 0.f, 0.f), a1 = a0;
      if (accumulate) {
        a0 = o4[0];
        a1 = o4[1];
      }
      float r[8] = {a0.x + m[0], a0.y + m[1], a0.z + m[2], a0.w + m[3],
                    a1.x + m[4], a1.y + m[5], a1.z + m[6], a1.w + m[7]};
      if (sh) {
        const float4 s0 = reinterpret_cast<const float4*>(sh + j)[0], s1 = reinterpret_cast<const float4*>(sh + j)[1];
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = fmaf(gs, sv[i], r[i]);
      }
      o4[0] = make_float4(r[0], r[1], r[2], r[3]);
      o4[1] = make_float4(r[4], r[5], r[6], r[7]);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(r[i], r[i], ss);
    }
  } else {
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
      float acc = accumulate ? o[j] : 0.f;
      float m = 0.f;
      for (int s = 0; s < k; ++s)
        m = fmaf(s_w[s], __uint_as_float(uint32_t(yp[size_t(s_pos[s]) * hidden + j]) << 16), m);
      acc += m;
      if (sh) acc = fmaf(gs, sh[j], acc);
      o[j] = acc;
      ss = fmaf(acc, acc, ss);
    }
  }
  if (!norm_out) return;
  // The finished row's RMSNorm (the next layer's input norm): the block's sum
  // of squares in a fixed order, then the row again (this thread's own
  // stores) scaled.
  __shared__ float red[32];
  const float inv = 1.f / sqrtf(p_block_sum(ss, red) / float(hidden) + norm_eps);
  uint16_t* d = norm_out + size_t(t) * ld_norm_out;
  if constexpr (VEC) {
    for (int j = threadIdx.x * 8; j < hidden; j += blockDim.x * 8) {
      const float4 a0 = reinterpret_cast<const float4*>(o + j)[0], a1 = reinterpret_cast<const float4*>(o + j)[1];
      const float v[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) d[j + i] = f32_to_bf16_bits(v[i] * inv * norm_w[j + i]);
    }
  } else {
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) d[j] = f32_to_bf16_bits(o[j] * inv * norm_w[j]);
  }
}

struct MoeLayout {
  size_t ids, weights, counts, offsets, cursor, perm_row, slot_pos, tile_expert, tile_row0,
      tile_rows, num_tiles, h, yp, total;
  int max_tiles;
};

MoeLayout moe_layout(int T, int E, int k, int hidden, int inter) {
  MoeLayout L{};
  const size_t n = size_t(T) * k;
  // Worst case over BM in {8, 16, 64, 128}, and the shared expert's tiles.
  L.max_tiles = int(n / kSdGroupedRows + std::min<size_t>(E, n) + 1 + (T + kSdGroupedRows - 1) / kSdGroupedRows);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) & ~size_t(255);
    return at;
  };
  L.ids = take(n * 4);
  L.weights = take(n * 4);
  L.counts = take(size_t(E) * 4);
  L.offsets = take(size_t(E) * 4);
  L.cursor = take(size_t(E) * 4);
  L.perm_row = take((n + T) * 4);  // the routed pairs', then the shared expert's rows
  L.slot_pos = take(n * 4);
  L.tile_expert = take(size_t(L.max_tiles) * 4);
  L.tile_row0 = take(size_t(L.max_tiles) * 4);
  L.tile_rows = take(size_t(L.max_tiles) * 4);
  L.num_tiles = take(4);
  L.h = take((n + T) * inter * 2);  // the routed pairs' rows, then the shared expert's
  L.yp = take(n * hidden * 2);
  L.total = off;
  return L;
}

}  // namespace

int prefill_skinny_rows() { return g_skinny_max_rows; }
int prefill_skinny_gemm_rows() { return 2 * g_skinny_max_rows; }
// 96 (H100): against the 16-row tiles and the shared expert's own GEMMs, 65
// tokens +4%, 100 the same, 128 -3%.
int prefill_moe_plan_rows() { return 6 * g_skinny_max_rows; }

void prefill_set_skinny_rows(int rows) {
  if (rows < 0 || rows > kSdMaxRows) fail("prefill_set_skinny_rows: rows (", rows, ") must be in [0, ", kSdMaxRows, "]");
  g_skinny_max_rows = rows;
}

void prefill_set_moe_grouped(bool on) { g_moe_grouped = on; }

void prefill_set_moe_skinny_blocks(int blocks) {
  if (blocks < 0) fail("prefill_set_moe_skinny_blocks: blocks (", blocks, ") must be >= 0");
  g_moe_skinny_blocks = blocks;
}

void prefill_set_pdl(bool on) { g_prefill_pdl = on; }

bool prefill_pdl(int T) { return g_prefill_pdl && T <= g_skinny_max_rows; }

int prefill_detail::sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    return v;
  }();
  return n;
}

namespace {

// The split-K workspace, process-wide (one split GEMM at a time): a GEMM
// splits only with fewer tiles than 2 blocks per multiprocessor, into at
// most ceil(that / tiles) parts, so at most 4 x multiprocessors blocks of
// up to 128 x kBN sums each; allocated whole on first use (or by
// prefill_reserve_split_space, outside any graph capture) and never moved.
struct SplitSpace {
  float* part = nullptr;
  int* count = nullptr;
};
size_t split_space_floats() { return size_t(4) * sm_count() * 128 * kBN; }
const SplitSpace& split_space(cudaStream_t stream) {
  static SplitSpace sp;
  if (!sp.part) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &cap), "cudaStreamIsCapturing");
    if (cap != cudaStreamCaptureStatusNone)
      fail("prefill_gemm: the split-K workspace must be reserved before a graph capture (prefill_reserve_split_space)");
    check(cudaMalloc(&sp.count, kMaxSplitTiles * sizeof(int)), "cudaMalloc(split-K counters)");
    check(cudaMemset(sp.count, 0, kMaxSplitTiles * sizeof(int)), "cudaMemset(split-K counters)");
    check(cudaMalloc(&sp.part, split_space_floats() * sizeof(float)), "cudaMalloc(split-K workspace)");
    // The last block reads whole slots, rows a short tile never wrote too:
    // those hold zeros or an earlier GEMM's sums, never uninitialised memory.
    check(cudaMemset(sp.part, 0, split_space_floats() * sizeof(float)), "cudaMemset(split-K workspace)");
  }
  return sp;
}

// The generic kernel's split of K for T rows of w: few output tiles leave
// most multiprocessors idle, so K is split for about two blocks per
// multiprocessor, each streaming at least 4 k-tiles (not for bf16 outputs;
// the SwiGLU pairs output splits). Returns the k-tiles per split, or 0 for
// none. n_tiles: the launch's weight-row tiles (a fused launch's parts
// together).
int gemm_k_split(const PrefillWeight& w, int T, PrefillOut out, int n_tiles = 0) {
  const int bm = T <= 64 ? 64 : 128;
  const int KT = w.cols / kBK;
  if (!n_tiles) n_tiles = (w.rows + kBN - 1) / kBN;
  const int blocks = ((T + bm - 1) / bm) * n_tiles, target = 2 * sm_count();
  if (out == PrefillOut::BF16 || blocks >= target || KT < 8 || blocks > kMaxSplitTiles) return 0;
  const int per = std::max(4, (KT * blocks + target - 1) / target);
  return (KT + per - 1) / per > 1 ? per : 0;
}

void generic_gemm(const PrefillWeight* parts, int n, const uint16_t* x, int T, size_t ldx, void* y, size_t ldy,
                  PrefillOut out, cudaStream_t stream);
bool interleaved_pair(const PrefillWeight& gate, const PrefillWeight& up);

}  // namespace

void prefill_reserve_split_space() { split_space(nullptr); }

int prefill_gemm_k_splits(const PrefillWeight& w, int T, PrefillOut out, const PrefillScratch& scratch) {
  if (T <= 0 || skinny_fits(w, T)) return 1;
  if (expand_pays(w, T, scratch, 1)) {
    PrefillWeight e = w;
    e.fmt = PrefillWeightFormat::BF16;
    return prefill_gemm_k_splits(e, T, out, {});
  }
  if (tma_gemm_fits(w, T)) return 1;
  const int per = gemm_k_split(w, T, out);
  return per ? (w.cols / kBK + per - 1) / per : 1;
}

void prefill_gemm(const PrefillWeight& w, const uint16_t* x, int T, size_t ldx, void* y,
                  size_t ldy, PrefillOut out, cudaStream_t stream, const PrefillScratch& scratch) {
  validate_weight(w, "prefill_gemm");
  validate_x(x, ldx, w.cols, "prefill_gemm");
  if (T <= 0) return;
  if (!y) fail("prefill_gemm: output pointer is null");
  if (ldy < size_t(w.rows)) fail("prefill_gemm: output row stride ", ldy, " is below N = ", w.rows);
  if (skinny_fits(w, T)) return skinny_gemm(&w, 1, x, T, ldx, y, ldy, out, stream);
  if (expand_pays(w, T, scratch, 1))
    return prefill_gemm(expand_bf16(w, static_cast<uint16_t*>(scratch.p), stream), x, T, ldx, y, ldy, out, stream);
  if (tma_gemm_fits(w, T)) return tma_gemm(w, nullptr, x, T, ldx, y, ldy, out, stream);
  generic_gemm(&w, 1, x, T, ldx, y, ldy, out, stream);
}

namespace {

// The generic kernel over n matrices of one input (n <= kGemmMaxParts, one
// format, the same columns), matrix i into the output columns after those
// of 0..i - 1: one launch.
void generic_gemm(const PrefillWeight* parts, int n, const uint16_t* x, int T, size_t ldx, void* y, size_t ldy,
                  PrefillOut out, cudaStream_t stream) {
  const PrefillWeight& w = parts[0];
  GemmParams p = base_params(w);
  p.x = x;
  p.ldx = ldx;
  p.M = T;
  p.y = y;
  p.ldy = ldy;
  p.out_kind = int(out);
  p.nparts = n;
  int tiles = (w.rows + kBN - 1) / kBN, col = w.rows;
  for (int i = 1; i < n; ++i) {
    const GemmParams b = base_params(parts[i]);
    p.part[i] = GemmPart{b.w, b.sb, b.w_row_stride, b.sb_row_stride, parts[i].rows, tiles, col};
    tiles += (parts[i].rows + kBN - 1) / kBN;
    col += parts[i].rows;
  }
  const int bm = T <= 64 ? 64 : 128;
  dim3 grid((T + bm - 1) / bm, tiles);
  if (grid.y > 65535) fail("prefill_gemm: too many output rows (", col, ")");
  if (const int per = gemm_k_split(w, T, out, tiles)) {  // partial sums added in z order by each tile's last block
    p.kt_per_split = per;
    grid.z = (w.cols / kBK + per - 1) / per;
    const size_t need = size_t(grid.x) * grid.y * grid.z * bm * kBN;
    if (need > split_space_floats() || grid.x * grid.y > unsigned(kMaxSplitTiles))
      fail("internal: prefill_gemm split of ", grid.x * grid.y, " tiles into ", grid.z, " exceeds its workspace");
    const SplitSpace& sp = split_space(stream);
    p.split_part = sp.part;
    p.split_count = sp.count;
  }
  launch_gemm(w.fmt, p, bm, false, false, grid, stream);
}

}  // namespace

void prefill_gemm_fused(const PrefillWeight* parts, int n, const uint16_t* x, int T, size_t ldx, void* y,
                        size_t ldy, PrefillOut out, cudaStream_t stream, const PrefillScratch& scratch) {
  if (n <= 0 || !parts) fail("prefill_gemm_fused: no weights");
  size_t rows = 0;
  bool quant = true;
  for (int i = 0; i < n; ++i) {
    validate_weight(parts[i], "prefill_gemm_fused");
    if (parts[i].cols != parts[0].cols) fail("prefill_gemm_fused: parts have different columns");
    rows += size_t(parts[i].rows);
    quant = quant && parts[i].fmt != PrefillWeightFormat::BF16;
  }
  const size_t cols = size_t(parts[0].cols);
  // The one-launch forms check the input and output here (prefill_gemm does per part).
  auto check_io = [&] {
    validate_x(x, ldx, int(cols), "prefill_gemm_fused");
    if (!y) fail("prefill_gemm_fused: output pointer is null");
    if (ldy < rows) fail("prefill_gemm_fused: output row stride ", ldy, " is below the parts' ", rows, " rows");
  };
  if (T > 0 && n <= kSdMaxParts && std::all_of(parts, parts + n, [&](const PrefillWeight& w) {
        return skinny_fits(w, T) && w.fmt == parts[0].fmt;
      })) {
    check_io();
    return skinny_gemm(parts, n, x, T, ldx, y, ldy, out, stream);
  }
  if (n > 1 && quant && scratch.p && T >= scratch.min_rows && scratch.bytes >= rows * cols * 2 && rows <= (1u << 30)) {
    uint16_t* d = static_cast<uint16_t*>(scratch.p);
    size_t off = 0;
    for (int i = 0; i < n; ++i) {
      expand_bf16(parts[i], d + off * cols, stream);
      off += size_t(parts[i].rows);
    }
    PrefillWeight all;
    all.fmt = PrefillWeightFormat::BF16;
    all.rows = int(rows);
    all.cols = int(cols);
    all.w = d;
    return prefill_gemm(all, x, T, ldx, y, ldy, out, stream);
  }
  // The generic kernel for each: one launch over all of them.
  if (n > 1 && n <= kGemmMaxParts && T > 0 && std::all_of(parts, parts + n, [&](const PrefillWeight& w) {
        return w.fmt == parts[0].fmt && w.sb_f16 == parts[0].sb_f16 && !skinny_fits(w, T) &&
               !expand_pays(w, T, scratch, 1) && !tma_gemm_fits(w, T);
      })) {
    check_io();
    return generic_gemm(parts, n, x, T, ldx, y, ldy, out, stream);
  }
  const size_t esize = out == PrefillOut::BF16 ? 2 : 4;
  size_t col = 0;
  for (int i = 0; i < n; ++i) {
    prefill_gemm(parts[i], x, T, ldx, static_cast<char*>(y) + col * esize, ldy, out, stream, scratch);
    col += size_t(parts[i].rows);
  }
}

void prefill_gemm_swiglu(const PrefillWeight& gate, const PrefillWeight& up, const uint16_t* x,
                         int T, size_t ldx, uint16_t* h, size_t ldh, cudaStream_t stream,
                         const PrefillScratch& scratch) {
  validate_weight(gate, "prefill_gemm_swiglu (gate)");
  validate_weight(up, "prefill_gemm_swiglu (up)");
  if (gate.rows != up.rows || gate.cols != up.cols || gate.fmt != up.fmt || gate.sb_f16 != up.sb_f16 ||
      gate.row_stride_bytes != up.row_stride_bytes || gate.sb_row_stride_words != up.sb_row_stride_words)
    fail("prefill_gemm_swiglu: gate and up must have the same shape and format");
  validate_x(x, ldx, gate.cols, "prefill_gemm_swiglu");
  if (T <= 0) return;
  if (!h) fail("prefill_gemm_swiglu: output pointer is null");
  // Gate / up rows interleaved (the backend's layout): one matrix of both,
  // run as a plain GEMM with the pairs output.
  const bool pairs = interleaved_pair(gate, up);
  PrefillWeight both = gate;
  both.rows = 2 * gate.rows;
  both.row_stride_bytes = base_params(gate).w_row_stride / 2;
  both.sb_row_stride_words = base_params(gate).sb_row_stride / 2;
  if (skinny_fits(gate, T)) {
    if (pairs) return skinny_gemm(&both, 1, x, T, ldx, h, ldh, PrefillOut(kOutSwigluPairs), stream);  // 2 rows a lane, not 4
    return skinny_gemm(&gate, 1, x, T, ldx, h, ldh, PrefillOut::BF16, stream, &up);
  }
  if (expand_pays(gate, T, scratch, 2)) {
    uint16_t* d = static_cast<uint16_t*>(scratch.p);
    const PrefillWeight g = expand_bf16(gate, d, stream);
    const PrefillWeight u = expand_bf16(up, d + size_t(gate.rows) * gate.cols, stream);
    return prefill_gemm_swiglu(g, u, x, T, ldx, h, ldh, stream);
  }
  if (tma_gemm_fits(gate, T)) return tma_gemm(gate, &up, x, T, ldx, h, ldh, PrefillOut::BF16, stream);
  if (pairs) return generic_gemm(&both, 1, x, T, ldx, h, ldh, PrefillOut(kOutSwigluPairs), stream);  // K split where few tiles
  GemmParams p = base_params(gate);
  p.w2 = static_cast<const uint8_t*>(up.w);
  p.sb2 = up.sb;
  p.x = x;
  p.ldx = ldx;
  p.M = T;
  p.y = h;
  p.ldy = ldh;
  p.out_kind = int(PrefillOut::BF16);
  const int bm = T <= 64 ? 64 : 128;
  const dim3 grid((T + bm - 1) / bm, (gate.rows + 63) / 64);
  launch_gemm(gate.fmt, p, bm, true, false, grid, stream);
}

void prefill_moe_route(const float* logits, size_t ld_logits, int T, int E, int k, bool norm_topk,
                       int* ids, float* weights, cudaStream_t stream) {
  if (E <= 0 || E > 32 * kRouteMaxPerLane) fail("prefill_moe_route: experts (", E, ") must be in [1, 512]");
  if (k <= 0 || k > 32 || k > E) fail("prefill_moe_route: top-k (", k, ") must be in [1, min(32, experts)]");
  if (T <= 0) return;
  moe_route_kernel<<<(T + 7) / 8, 256, 0, stream>>>(logits, ld_logits, T, E, k, norm_topk ? 1 : 0,
                                                     ids, weights, nullptr);
  check_launch("moe_route_kernel");
}

size_t prefill_moe_workspace_bytes(int T, int E, int k, int hidden, int inter) {
  return moe_layout(T, E, k, hidden, inter).total;
}

namespace {

// up == gate one row further, both at twice the packed row strides (q4).
bool interleaved_pair(const PrefillWeight& gate, const PrefillWeight& up) {
  const GemmParams x = base_params(gate), y = base_params(up);
  const size_t row = size_t(gate.cols) / 2, sbw = size_t(gate.cols) / 64;
  return gate.fmt == PrefillWeightFormat::Q4 && up.fmt == gate.fmt && up.rows == gate.rows &&
         x.w_row_stride == 2 * row && x.sb_row_stride == 2 * sbw && y.w_row_stride == x.w_row_stride &&
         y.sb_row_stride == x.sb_row_stride && y.w == x.w + row && y.sb == x.sb + sbw && x.sb_f16 == y.sb_f16;
}

// A short run's gate/up and down as grouped skinny launches over the plan's
// tiles (one per expert, the shared expert's last when fuse_sh).
void run_moe_grouped(const PrefillMoeArgs& a, bool fuse_sh, int max_tiles, const int* perm_row,
                     const int* tile_expert, const int* tile_row0, const int* tile_rows, const int* num_tiles,
                     uint16_t* h, uint16_t* yp, cudaStream_t stream) {
  const GemmParams gb = base_params(a.gate), ub = base_params(a.up), db = base_params(a.down);
  SkinnyParams g{};
  // Gate / up rows interleaved in one matrix (the backend's layout; the
  // shared expert's too if it comes along): one plain launch over both.
  static const bool pairs_on = [] {  // LILY_CUDA_MOE_PAIRS=0: the SwiGLU form (experiments)
    const char* v = std::getenv("LILY_CUDA_MOE_PAIRS");
    return !v || std::atoi(v) != 0;
  }();
  const bool pairs =
      pairs_on && interleaved_pair(a.gate, a.up) && (!fuse_sh || interleaved_pair(a.sh_gate, a.sh_up));
  if (pairs) {
    g.part[0] = SkinnyPart{gb.w, gb.sb, gb.w_row_stride / 2, gb.sb_row_stride / 2, 2 * a.inter, 0, gb.sb_f16, 0};
    g.out_kind = kOutSwigluPairs;
  } else {
    g.part[0] = SkinnyPart{gb.w, gb.sb, gb.w_row_stride, gb.sb_row_stride, a.inter, 0, gb.sb_f16, 0};
    g.w2 = ub.w;
    g.sb2 = ub.sb;
    g.out_kind = int(PrefillOut::BF16);
  }
  g.nparts = 1;
  g.K = a.hidden;
  g.M = std::min(a.T, grouped_rows());  // a tile's most rows
  g.x = a.x;
  g.ldx = a.ldx;
  g.y = h;
  g.ldy = a.inter;
  g.tile_expert = tile_expert;
  g.tile_row0 = tile_row0;
  g.tile_rows = tile_rows;
  g.num_tiles = num_tiles;
  g.x_rows = perm_row;
  g.expert_w_bytes = gb.expert_w_bytes;
  g.expert_sb_words = gb.expert_sb_words;
  g.E = a.E;
  if (fuse_sh) {
    g.sh_w = base_params(a.sh_gate).w;
    g.sh_sb = base_params(a.sh_gate).sb;
    g.sh_w2 = base_params(a.sh_up).w;
    g.sh_sb2 = base_params(a.sh_up).sb;
  }
  if (pairs) launch_skinny_grouped<false>(g, max_tiles, stream);
  else launch_skinny_grouped<true>(g, max_tiles, stream);
  SkinnyParams d = g;
  d.out_kind = int(PrefillOut::BF16);
  d.part[0] = SkinnyPart{db.w, db.sb, db.w_row_stride, db.sb_row_stride, a.hidden, 0, db.sb_f16, 0};
  d.w2 = nullptr;
  d.sb2 = nullptr;
  d.K = a.inter;
  d.x = h;
  d.ldx = a.inter;
  d.x_rows = nullptr;
  d.y = yp;
  d.ldy = a.hidden;
  d.expert_w_bytes = db.expert_w_bytes;
  d.expert_sb_words = db.expert_sb_words;
  if (fuse_sh) {
    d.sh_w = base_params(a.sh_down).w;
    d.sh_sb = base_params(a.sh_down).sb;
    d.y_shared = const_cast<float*>(a.shared_out);
    d.ld_shared = a.ld_shared;
    d.sh_row0 = a.T * a.k;
  }
  launch_skinny_grouped<false>(d, max_tiles, stream);
}

// ev (optional): 5 events recorded around routing, gate/up, down, combine.
void run_moe(const PrefillMoeArgs& a, cudaStream_t stream, cudaEvent_t* ev) {
  auto mark = [&](int i) {
    if (ev) check(cudaEventRecord(ev[i], stream), "cudaEventRecord");
  };
  if (a.T <= 0) return;
  if (a.E <= 0 || a.E > 1024 || a.E > 32 * kRouteMaxPerLane) fail("prefill_moe: experts (", a.E, ") must be in [1, 512]");
  if (a.k <= 0 || a.k > 32 || a.k > a.E) fail("prefill_moe: top-k (", a.k, ") must be in [1, min(32, experts)]");
  validate_weight(a.gate, "prefill_moe (gate)");
  validate_weight(a.up, "prefill_moe (up)");
  validate_weight(a.down, "prefill_moe (down)");
  if (a.gate.rows != a.inter || a.gate.cols != a.hidden || a.up.rows != a.inter ||
      a.up.cols != a.hidden || a.down.rows != a.hidden || a.down.cols != a.inter)
    fail("prefill_moe: expert shapes must be gate/up [", a.inter, " x ", a.hidden, "], down [",
         a.hidden, " x ", a.inter, "]");
  if (a.gate.fmt != a.up.fmt || a.gate.expert_w_bytes != a.up.expert_w_bytes ||
      a.gate.row_stride_bytes != a.up.row_stride_bytes || a.gate.sb_row_stride_words != a.up.sb_row_stride_words)
    fail("prefill_moe: gate and up stacks must share format and expert stride");
  if (a.inter % 8 != 0) fail("prefill_moe: intermediate size must be a multiple of 8");
  validate_x(a.x, a.ldx, a.hidden, "prefill_moe");
  if (!a.router_logits || !a.out) fail("prefill_moe: router logits or output pointer is null");
  if (a.norm_out && (!a.norm_w || a.ld_norm_out < size_t(a.hidden)))
    fail("prefill_moe: the output norm needs its weights and a row stride of at least ", a.hidden);
  const MoeLayout L = moe_layout(a.T, a.E, a.k, a.hidden, a.inter);
  if (!a.workspace || a.workspace_bytes < L.total)
    fail("prefill_moe: workspace of ", a.workspace_bytes, " bytes is below the ", L.total, " needed");
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  int* ids = reinterpret_cast<int*>(ws + L.ids);
  float* weights = reinterpret_cast<float*>(ws + L.weights);
  int* counts = reinterpret_cast<int*>(ws + L.counts);
  int* offsets = reinterpret_cast<int*>(ws + L.offsets);
  int* cursor = reinterpret_cast<int*>(ws + L.cursor);
  int* perm_row = reinterpret_cast<int*>(ws + L.perm_row);
  int* slot_pos = reinterpret_cast<int*>(ws + L.slot_pos);
  int* tile_expert = reinterpret_cast<int*>(ws + L.tile_expert);
  int* tile_row0 = reinterpret_cast<int*>(ws + L.tile_row0);
  int* tile_rows = reinterpret_cast<int*>(ws + L.tile_rows);
  int* num_tiles = reinterpret_cast<int*>(ws + L.num_tiles);
  uint16_t* h = reinterpret_cast<uint16_t*>(ws + L.h);
  uint16_t* yp = reinterpret_cast<uint16_t*>(ws + L.yp);

  const int n = a.T * a.k;
  // Rows per expert on average decide the tile height.
  if (a.tile_rows != 0 && a.tile_rows != 16 && a.tile_rows != 64 && a.tile_rows != 128)
    fail("prefill_moe: tile_rows must be 0, 16, 64 or 128 (got ", a.tile_rows, ")");
  const bool skinny_ok = moe_skinny_fits(a);
  if (a.tile_rows == 16 && !skinny_ok)
    fail("prefill_moe: 16-row tiles need q4 experts with hidden and intermediate sizes multiples of 256");
  // (H200, 256 experts, top-8, q4: at T = 256 / 512 / 1024 the 16-row
  // tiles take 0.28 / 0.37 / 0.60 ms, 64-row tiles 0.50 / 0.52 / 0.59,
  // 128-row tiles 0.57 / 0.59 / 0.59; at T = 2048, 64-row tiles 0.93 and
  // 128-row tiles 0.68.)
  // One plan block: a warp routes a token at a time (up to 32 warps).
  const int plan_threads = std::max((a.E + 31) / 32 * 32, 32 * std::min(a.T, 32));
  const bool plan1 = a.T <= prefill_moe_plan_rows() && n <= 1024 && plan_threads <= 1024;
  // A short run (one plan block) with q4 experts takes the skinny dense
  // kernel in grouped form: one tile per expert (<= T rows), and the
  // shared expert, when its weights come along in the stacks' layout, as
  // one more tile of the same launches.
  const bool grouped = g_moe_grouped && plan1 && a.tile_rows == 0 && a.gate.fmt == PrefillWeightFormat::Q4 &&
                       a.down.fmt == PrefillWeightFormat::Q4 && a.hidden % 128 == 0 && a.inter % 128 == 0 &&
                       skinny_smem_bytes(std::min(a.T, grouped_rows()), std::max(a.hidden, a.inter)) <=
                           size_t(kSdMaxSmem);
  const bool has_sh = a.sh_gate.w != nullptr;
  auto same_layout = [](const PrefillWeight& s, const PrefillWeight& w) {
    const GemmParams x = base_params(s), y = base_params(w);
    return s.fmt == w.fmt && s.rows == w.rows && s.cols == w.cols && x.w_row_stride == y.w_row_stride &&
           x.sb_row_stride == y.sb_row_stride && x.sb_f16 == y.sb_f16;
  };
  if (has_sh) {
    validate_weight(a.sh_gate, "prefill_moe (shared gate)");
    validate_weight(a.sh_up, "prefill_moe (shared up)");
    validate_weight(a.sh_down, "prefill_moe (shared down)");
    const int si = a.sh_gate.rows;
    if (a.sh_up.rows != si || a.sh_gate.cols != a.hidden || a.sh_up.cols != a.hidden || a.sh_down.rows != a.hidden ||
        a.sh_down.cols != si)
      fail("prefill_moe: shared expert shapes must be gate/up [I x ", a.hidden, "], down [", a.hidden, " x I]");
    if (si > a.inter) fail("prefill_moe: a shared expert wider than the routed ones is the caller's to compute");
    if (!a.shared_out || !a.shared_gate_logit) fail("prefill_moe: the shared expert needs shared_out and its gate");
  }
  const bool fuse_sh = grouped && has_sh && same_layout(a.sh_gate, a.gate) && same_layout(a.sh_up, a.up) &&
                       same_layout(a.sh_down, a.down);
  const int rows_per_expert = n / a.E;
  const int bm = a.tile_rows                                  ? a.tile_rows
                 : grouped                                   ? grouped_rows()
                 : skinny_ok && rows_per_expert < 32         ? kSkRows
                 : rows_per_expert >= 32                     ? 128
                                                             : 64;
  const int max_tiles = n / bm + std::min(a.E, n) + (fuse_sh ? 1 + (a.T + bm - 1) / bm : 1);

  mark(0);
  if (has_sh && !fuse_sh) {  // the shared expert on its own launches, into shared_out
    uint16_t* hs = h + size_t(n) * a.inter;
    prefill_gemm_swiglu(a.sh_gate, a.sh_up, a.x, a.T, a.ldx, hs, a.inter, stream);
    prefill_gemm(a.sh_down, hs, a.T, a.inter, const_cast<float*>(a.shared_out), a.ld_shared, PrefillOut::F32,
                 stream);
  }
  if (plan1) {
    launch_kernel("moe_plan_kernel", moe_plan_kernel, dim3(1), dim3(plan_threads), 0, stream, prefill_pdl(a.T),
                  a.router_logits, a.ld_logits, a.T, a.E, a.k, a.norm_topk ? 1 : 0, bm, ids, weights, tile_expert,
                  tile_row0, tile_rows, num_tiles, perm_row, slot_pos, fuse_sh ? 1 : 0);
  } else {
    check(cudaMemsetAsync(counts, 0, size_t(a.E) * 4, stream), "cudaMemsetAsync(moe counts)");
    moe_route_kernel<<<(a.T + 7) / 8, 256, 0, stream>>>(a.router_logits, a.ld_logits, a.T, a.E, a.k,
                                                         a.norm_topk ? 1 : 0, ids, weights, counts);
    check_launch("moe_route_kernel");
    const int scan_threads = (a.E + 31) / 32 * 32;
    moe_scan_kernel<<<1, scan_threads, 0, stream>>>(counts, a.E, bm, offsets, cursor, tile_expert,
                                                    tile_row0, tile_rows, num_tiles);
    check_launch("moe_scan_kernel");
    moe_scatter_kernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, n, a.k, cursor, perm_row, slot_pos);
    check_launch("moe_scatter_kernel");
  }

  if (grouped) {
    mark(1);
    run_moe_grouped(a, fuse_sh, max_tiles, perm_row, tile_expert, tile_row0, tile_rows, num_tiles, h, yp, stream);
    mark(2);
  } else {
    // A grouped launch's parameters over the plan's tiles (bf16 output).
    auto tiled = [&](const PrefillWeight& w, const uint16_t* x, size_t ldx, const int* a_rows, uint16_t* y,
                     size_t ldy) {
      GemmParams q = base_params(w);
      q.x = x;
      q.ldx = ldx;
      q.a_rows = a_rows;
      q.tile_expert = tile_expert;
      q.tile_row0 = tile_row0;
      q.tile_rows = tile_rows;
      q.num_tiles = num_tiles;
      q.y = y;
      q.ldy = ldy;
      q.out_kind = int(PrefillOut::BF16);
      return q;
    };
    GemmParams p = tiled(a.gate, a.x, a.ldx, perm_row, h, a.inter);
    p.w2 = static_cast<const uint8_t*>(a.up.w);
    p.sb2 = a.up.sb;
    mark(1);
    if (bm == kSkRows)
      launch_moe_skinny(p, true, max_tiles, stream);
    else
      launch_gemm(a.gate.fmt, p, bm, true, true, dim3(max_tiles, (a.inter + 63) / 64), stream);
    mark(2);

    const GemmParams q = tiled(a.down, h, a.inter, nullptr, yp, a.hidden);
    if (bm == kSkRows)
      launch_moe_skinny(q, false, max_tiles, stream);
    else
      launch_gemm(a.down.fmt, q, bm, false, true, dim3(max_tiles, (a.hidden + kBN - 1) / kBN), stream);
  }
  mark(3);

  auto aligned16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  const bool vec = a.hidden % 8 == 0 && a.ldo % 4 == 0 && aligned16(a.out) &&
                   (!a.shared_out || (a.ld_shared % 4 == 0 && aligned16(a.shared_out)));
  launch_kernel("moe_combine_kernel", vec ? moe_combine_kernel<true> : moe_combine_kernel<false>, dim3(a.T), dim3(256),
                0, stream, prefill_pdl(a.T), static_cast<const uint16_t*>(yp), a.hidden,
                static_cast<const int*>(slot_pos), static_cast<const float*>(weights), a.k, a.shared_out, a.ld_shared,
                a.shared_gate_logit, a.ld_shared_gate, a.out, a.ldo, a.accumulate ? 1 : 0, a.norm_w, a.norm_eps,
                a.norm_out, a.ld_norm_out);
  mark(4);
}

}  // namespace

void prefill_moe(const PrefillMoeArgs& a, cudaStream_t stream) { run_moe(a, stream, nullptr); }

void prefill_moe_timed(const PrefillMoeArgs& a, cudaStream_t stream, float (&ms)[4]) {
  timed_stages(ms, [&](cudaEvent_t* ev) { run_moe(a, stream, ev); });
}

}  // namespace lily::cuda

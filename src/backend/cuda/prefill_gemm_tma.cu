// Prefill GEMM for bf16 weights and many rows, warp-specialized on Hopper:
// one warpgroup produces shared-memory stages with the bulk tensor copy engine
// (TMA), two consume them with wgmma, mbarriers between them.
//
// y[T][N] = x[T][K] . W^T, x and W bf16 (plain bf16 checkpoints, or q4/q8
// weights expanded once per projection into the prefill scratch). One block
// (384 threads, one per SM) computes a 128 x BN tile of y (BN = 256, or 128
// when 256-wide tiles would leave SMs idle):
//  - producer: one thread issues, per 64-wide k-step, TMA copies of the x tile
//    (128 x 64) and the weight tile (BN x 64) into a ring of stages, both in
//    the 128-byte swizzle that wgmma reads; a stage's "full" mbarrier
//    completes when its bytes land;
//  - consumers: warpgroups 1 and 2 each own 64 rows; they wait for a stage,
//    issue four wgmma m64nBNk16 on it, keep one k-step of MMAs in flight and
//    release the previous stage through its "empty" mbarrier, so loads,
//    barriers and MMAs overlap with no block-wide barrier in the main loop.
// The epilogue writes from the accumulators (f32, f32 +=, bf16, or SwiGLU: the
// tile's first BN/2 weight rows are gate rows, the rest the matching up rows,
// and the output is silu(gate) * up in bf16). Rows past T and weight rows past
// N come in as zeros (TMA out-of-bounds fill) and are not stored.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <type_traits>

#include "backend/cuda/prefill_common.cuh"

namespace lily::cuda {

namespace {

using namespace prefill_detail;

constexpr int kBM = 128;  // rows of x per tile (two consumer warpgroups of 64)
constexpr int kBK = 64;   // k per stage: one 128-byte swizzled row
constexpr int kThreads = 384;

// Shared memory: S stages of [x tile | weight tile], then the mbarriers; the
// stages start at a multiple of 1024 bytes (the swizzle atom).
template <int BN, int S>
struct TmaCfg {
  static constexpr int kStages = S;
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = BN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBarOffset = S * kStageBytes;
  static constexpr size_t kSmem = size_t(kBarOffset) + 16 * S + 1024;
};
template <int BN>
using TmaCfgFor = std::conditional_t<BN == 256, TmaCfg<256, 4>, TmaCfg<128, 6>>;

struct TmaParams {
  int M, N, K;  // N: outputs (SwiGLU: gate rows)
  void* y;
  size_t ldy;
  int out_kind;  // PrefillOut
  int paired;    // two adjacent outputs per store (even ldy and N, aligned y)
};

// One 2-D box (c0 = k element, c1 = row) of `map` into shared memory at dst,
// completing on the mbarrier bar.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

template <int BN>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], uint64_t a, uint64_t b) {
  if constexpr (BN == 256)
    wgmma_n256(d, a, b);
  else
    wgmma_n128(d, a, b);
}

// Barriers: full[s] at bars + 8 s, empty[s] at bars + 8 (S + s).
template <int S>
__device__ __forceinline__ void init_barriers(uint32_t bars, int full_count) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bars + 8 * s, full_count);
      mbar_init(bars + 8 * (S + s), 8);  // one arrival per consumer warp
    }
    mbar_init_fence();
  }
}

// The consumer warpgroups' main loop and epilogue. Rows of the tile at or past
// rows_valid are not stored; row r of the tile goes to output row m0 + r.
template <int BN, int S, bool SWIGLU>
__device__ __forceinline__ void consume(uint32_t base, uint32_t bars, int KT, int m0, int rows_valid, int n0,
                                       const TmaParams& p) {
  constexpr int kStageBytes = TmaCfg<BN, S>::kStageBytes, kABytes = TmaCfg<BN, S>::kABytes;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cw = (warp >> 2) - 1;
  if (64 * cw >= rows_valid) {  // no valid row: only pass the stages on
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(bars + 8 * (kt % S), (kt / S) & 1);
      if (lane == 0) mbar_arrive(bars + 8 * (S + kt % S));
    }
    return;
  }
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  for (int kt = 0; kt < KT; ++kt) {
    const int s = kt % S;
    mbar_wait(bars + 8 * s, (kt / S) & 1);
    const uint32_t a = base + s * kStageBytes + cw * 64 * 128, b = base + s * kStageBytes + kABytes;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_tile<BN>(acc, wg_desc(a + kk * 32), wg_desc(b + kk * 32));
    wg_commit();
    // The MMAs of k-step kt - 1 are done: their stage may be refilled.
    wg_wait<1>();
    if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (S + (kt - 1) % S));
  }
  wg_wait<0>();

  // acc[4j + 2h + e] is row 16 * (warp % 4) + lane / 4 + 8h of this
  // warpgroup, column 8j + 2 (lane % 4) + e of the tile.
  const int t2 = 2 * (lane & 3);
  auto store = [&](int r, int col, float v0, float v1) {
    if (p.out_kind == int(PrefillOut::BF16)) {
      uint16_t* o = static_cast<uint16_t*>(p.y) + size_t(r) * p.ldy + col;
      if (p.paired) {
        *reinterpret_cast<uint32_t*>(o) = pack_bf16x2(v0, v1);
      } else {
        o[0] = f32_to_bf16_bits(v0);
        if (col + 1 < p.N) o[1] = f32_to_bf16_bits(v1);
      }
    } else {
      float* o = static_cast<float*>(p.y) + size_t(r) * p.ldy + col;
      const bool add = p.out_kind == int(PrefillOut::F32Add);
      if (p.paired) {
        float2* o2 = reinterpret_cast<float2*>(o);
        const float2 old = add ? *o2 : make_float2(0.f, 0.f);
        *o2 = make_float2(old.x + v0, old.y + v1);
      } else {
        o[0] = add ? o[0] + v0 : v0;
        if (col + 1 < p.N) o[1] = add ? o[1] + v1 : v1;
      }
    }
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 64 * cw + 16 * (warp & 3) + (lane >> 2) + 8 * h;
    if (r >= rows_valid) continue;
#pragma unroll
    for (int j = 0; j < (SWIGLU ? BN / 16 : BN / 8); ++j) {
      const int col = (SWIGLU ? n0 / 2 : n0) + 8 * j + t2;
      if (col >= p.N) continue;
      float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      if constexpr (SWIGLU) {
        v0 = p_silu(v0) * acc[4 * (j + BN / 16) + 2 * h];
        v1 = p_silu(v1) * acc[4 * (j + BN / 16) + 2 * h + 1];
      }
      store(m0 + r, col, v0, v1);
    }
  }
}

template <int BN, bool SWIGLU>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_tma_kernel(const __grid_constant__ CUtensorMap xmap, const __grid_constant__ CUtensorMap wmap,
                    const __grid_constant__ CUtensorMap umap, const TmaParams p) {
  using C = TmaCfgFor<BN>;
  constexpr int S = C::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u, bars = base + C::kBarOffset;
  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * BN;
  const int KT = p.K / kBK;
  init_barriers<S>(bars, 1);
  __syncthreads();

  if (tid < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        // A fresh barrier counts as having completed the phase before its
        // first: the first round of waits (parity 1) passes at once.
        mbar_wait(bars + 8 * (S + s), ((kt / S) & 1) ^ 1);
        const uint32_t a = base + s * C::kStageBytes, b = a + C::kABytes, full = bars + 8 * s;
        mbar_expect_tx(full, C::kStageBytes);
        tma_load(a, &xmap, kt * kBK, m0, full);
        if constexpr (SWIGLU) {
          tma_load(b, &wmap, kt * kBK, n0 / 2, full);
          tma_load(b + C::kBBytes / 2, &umap, kt * kBK, n0 / 2, full);
        } else {
          tma_load(b, &wmap, kt * kBK, n0, full);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    consume<BN, S, SWIGLU>(base, bars, KT, m0, min(kBM, p.M - m0), n0, p);
  }
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q),
          "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (q != cudaDriverEntryPointSuccess || !f) fail("prefill_gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A bf16 matrix [rows][cols] with rows `row_bytes` apart, read in boxes of
// 64 columns x box_rows rows with the 128-byte swizzle.
CUtensorMap bf16_map(const void* p, int rows, int cols, size_t row_bytes, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(kBK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(p), dims, strides,
                                          box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail("prefill_gemm: cuTensorMapEncodeTiled failed (", int(r), ") for a ", rows, " x ", cols, " matrix");
  return m;
}

// Raises each kernel's dynamic shared-memory limit once, then launches it.
template <int BN, bool SWIGLU>
void launch_tma(const CUtensorMap& xm, const CUtensorMap& wm, const CUtensorMap& um, const TmaParams& p, dim3 grid,
                cudaStream_t s) {
  auto kernel = gemm_tma_kernel<BN, SWIGLU>;
  constexpr size_t smem = TmaCfgFor<BN>::kSmem;
  static const bool attr_ok = [&] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
          "cudaFuncSetAttribute(prefill TMA gemm kernel)");
    return true;
  }();
  (void)attr_ok;
  kernel<<<grid, kThreads, smem, s>>>(xm, wm, um, p);
  check_launch("prefill TMA gemm kernel");
}

size_t row_bytes(const PrefillWeight& w) { return w.row_stride_bytes ? w.row_stride_bytes : size_t(w.cols) * 2; }

}  // namespace

namespace prefill_detail {

bool tma_gemm_fits(const PrefillWeight& w, int T, int min_rows) {
  return w.fmt == PrefillWeightFormat::BF16 && T >= min_rows;
}

void tma_gemm(const PrefillWeight& w, const PrefillWeight* up, const uint16_t* x, int T, size_t ldx, void* y,
              size_t ldy, PrefillOut out, cudaStream_t stream) {
  TmaParams p;
  p.M = T;
  p.N = w.rows;
  p.K = w.cols;
  p.y = y;
  p.ldy = ldy;
  p.out_kind = int(up ? PrefillOut::BF16 : out);
  const size_t out_bytes = p.out_kind == int(PrefillOut::BF16) ? 2 : 4;
  p.paired = ldy % 2 == 0 && w.rows % 2 == 0 && reinterpret_cast<uintptr_t>(y) % (2 * out_bytes) == 0;
  const CUtensorMap xm = bf16_map(x, T, w.cols, ldx * 2, kBM);
  const int m_tiles = (T + kBM - 1) / kBM;
  // 256-wide tiles when they still give every SM at least ~1.5 waves of work,
  // else 128 (k / v projections, the shared expert).
  const int outs = up ? 2 * w.rows : w.rows;
  const bool wide = size_t(m_tiles) * ((outs + 255) / 256) >= size_t(3 * sm_count()) / 2;
  const int bn = wide ? 256 : 128;
  const int box = up ? bn / 2 : bn;
  const CUtensorMap wm = bf16_map(w.w, w.rows, w.cols, row_bytes(w), box);
  const CUtensorMap um = up ? bf16_map(up->w, up->rows, up->cols, row_bytes(*up), box) : wm;
  const dim3 grid(m_tiles, (outs + bn - 1) / bn);
  if (grid.y > 65535) fail("prefill_gemm: too many output rows (", w.rows, ")");
  if (wide)
    up ? launch_tma<256, true>(xm, wm, um, p, grid, stream) : launch_tma<256, false>(xm, wm, um, p, grid, stream);
  else
    up ? launch_tma<128, true>(xm, wm, um, p, grid, stream) : launch_tma<128, false>(xm, wm, um, p, grid, stream);
}

}  // namespace prefill_detail

}  // namespace lily::cuda

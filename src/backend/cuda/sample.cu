// On-device sampling (Backend::forward_sample; the pipeline is described in
// backend/sampling.h). Two launches after the decode step:
//   1. sample_block_kernel: 2,048 logits a block (NaN as -inf, the listed
//      adjustments applied in the Sampler's order) as 64-bit keys (the
//      value's order-preserving bits, then the complement of the id, so
//      that a descending sort puts the lower id first on ties), sorted in
//      the block; its first kc keys (kc = top_k, or 1 when greedy) go to
//      the candidates.
//   2. sample_pick_kernel (one block): the candidates merged to the global
//      top kc (4,096 keys a round, the best kc so far carried along), then
//      the Sampler's listed path: weights in double, top_p, min_p and the
//      draw walked sequentially in order, as the CPU walks them.
// A block's sort and the merge see the same keys whatever the block split,
// so the result is the top kc of the whole row. Several rows (a draft run's)
// go in one launch of each: blockIdx.y / blockIdx.x is the row.

#include <cub/block/block_radix_sort.cuh>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace lily::cuda {

namespace {

constexpr int kSbThreads = 256, kSbItems = 8, kSbPerBlock = kSbThreads * kSbItems;
constexpr int kSpThreads = 1024, kSpItems = 4, kSpKeys = kSpThreads * kSpItems;

// Order-preserving bits of a float (larger float, larger key); -0 as +0 so
// that the two zeros tie, as they compare on the CPU.
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t b = v == 0.f ? 0u : __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_ordered(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ uint64_t make_key(float v, int id) {
  return (uint64_t(ordered_bits(v)) << 32) | uint64_t(0xffffffffu - uint32_t(id));
}
__device__ __forceinline__ int key_id(uint64_t k) { return int(0xffffffffu - uint32_t(k)); }
__device__ __forceinline__ float key_value(uint64_t k) { return from_ordered(uint32_t(k >> 32)); }

// A row's adjustments: [*lo, *hi) of a.adjust.
__device__ __forceinline__ void row_adjust(const SampleArgs& a, int row, int* lo, int* hi) {
  *lo = a.adjust_off ? a.adjust_off[row] : 0;
  *hi = a.adjust_off ? a.adjust_off[row + 1] : 0;
}

__global__ void __launch_bounds__(kSbThreads) sample_block_kernel(const SampleArgs a) {
  using Sort = cub::BlockRadixSort<uint64_t, kSbThreads, kSbItems>;
  __shared__ typename Sort::TempStorage sort_tmp;
  __shared__ float vals[kSbPerBlock];
  __shared__ int first_adjust;
  const int tid = threadIdx.x, base = blockIdx.x * kSbPerBlock, row = blockIdx.y;
  const float* logits = a.logits + size_t(row) * a.row_stride;
  int adj_lo, adj_hi;
  row_adjust(a, row, &adj_lo, &adj_hi);
  for (int i = tid; i < kSbPerBlock; i += kSbThreads) {
    const int id = base + i;
    float v = -INFINITY;
    if (id < a.V) {
      v = logits[id];
      if (v != v) v = -INFINITY;
    }
    vals[i] = v;
  }
  if (tid == 0) {  // the first adjustment at or past this block's ids
    int lo = adj_lo, hi = adj_hi;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (a.adjust[mid].id < base) lo = mid + 1;
      else hi = mid;
    }
    first_adjust = lo;
  }
  __syncthreads();
  for (int e = first_adjust + tid; e < adj_hi && a.adjust[e].id < base + kSbPerBlock; e += kSbThreads) {
    const LogitAdjust j = a.adjust[e];
    if (j.id >= a.V) continue;
    float v = vals[j.id - base];
    if (j.ops & LogitAdjust::kBias) v += j.bias;
    if (j.ops & LogitAdjust::kRep) v = v > 0.f ? v / a.rep_penalty : v * a.rep_penalty;
    if (j.ops & LogitAdjust::kSub) v -= j.sub;
    vals[j.id - base] = v;
  }
  __syncthreads();
  uint64_t keys[kSbItems];
#pragma unroll
  for (int i = 0; i < kSbItems; ++i) {
    const int at = tid * kSbItems + i, id = base + at;
    keys[i] = id < a.V ? make_key(vals[at], id) : 0ull;  // past the row: below every real key (-inf included)
  }
  Sort(sort_tmp).SortDescending(keys);
#pragma unroll
  for (int i = 0; i < kSbItems; ++i) {
    const int r = tid * kSbItems + i;
    if (r < a.kc) a.cand[(size_t(row) * gridDim.x + blockIdx.x) * a.kc + r] = keys[i];
  }
}

__global__ void __launch_bounds__(kSpThreads) sample_pick_kernel(const SampleArgs a, int n_cand) {
  using Sort = cub::BlockRadixSort<uint64_t, kSpThreads, kSpItems>;
  __shared__ typename Sort::TempStorage sort_tmp;
  __shared__ uint64_t best[kMaxBackendTopK];
  __shared__ double w[kMaxBackendTopK];
  __shared__ int ids[kMaxBackendTopK];
  const int tid = threadIdx.x, kc = a.kc, row = blockIdx.x;
  const uint64_t* cand = a.cand + size_t(row) * n_cand;
  int* out = a.out + 2 * row;
  if (tid < kc) best[tid] = 0ull;
  __syncthreads();
  // Rounds of kSpKeys keys: the best kc so far, then the next candidates.
  for (int c0 = 0; c0 < n_cand; c0 += kSpKeys - kc) {
    uint64_t keys[kSpItems];
#pragma unroll
    for (int i = 0; i < kSpItems; ++i) {
      const int s = tid * kSpItems + i;
      keys[i] = s < kc ? best[s] : (c0 + s - kc < n_cand ? cand[c0 + s - kc] : 0ull);
    }
    __syncthreads();  // every thread has read best[]
    Sort(sort_tmp).SortDescending(keys);
#pragma unroll
    for (int i = 0; i < kSpItems; ++i) {
      const int r = tid * kSpItems + i;
      if (r < kc) best[r] = keys[i];
    }
    __syncthreads();
  }
  const float top = key_value(best[0]);
  if (tid == 0) {
    out[0] = key_id(best[0]);
    out[1] = top > -INFINITY ? 0 : 2;  // 2: no finite logit
  }
  if (a.temperature == 0.f || !(top > -INFINITY) || isinf(top)) return;
  const double inv_t = 1.0 / double(a.temperature);
  if (!isfinite(inv_t)) return;
  if (tid < kc) {
    ids[tid] = key_id(best[tid]);
    w[tid] = exp((double(key_value(best[tid])) - double(top)) * inv_t);
  }
  __syncthreads();
  if (tid != 0) return;
  // The Sampler's listed path, in its order of operations.
  int n = kc;
  if (a.top_p < 1.f) {
    double total = 0.0;
    for (int i = 0; i < n; ++i) total += w[i];
    const double target = double(a.top_p) * total;
    double mass = 0.0;
    int i = 0;
    for (; i < n && mass < target; ++i) mass += w[i];
    n = i;
  }
  if (a.min_p > 0.f) {
    const double threshold = a.min_p;
    int kept = 0;
    for (int i = 0; i < n; ++i)
      if (w[i] >= threshold) {
        ids[kept] = ids[i];
        w[kept++] = w[i];
      }
    n = kept;
  }
  double total = 0.0;
  for (int i = 0; i < n; ++i) total += w[i];
  const double u = a.u[row] * total;
  double mass = 0.0;
  int last = key_id(best[0]);
  for (int i = 0; i < n; ++i) {
    if (w[i] <= 0.0) continue;
    mass += w[i];
    last = ids[i];
    if (u < mass) break;
  }
  out[0] = last;
  out[1] = 1;  // the draw was used
}

}  // namespace

size_t sample_workspace_bytes(int V, int kc, int rows) {
  return size_t((V + kSbPerBlock - 1) / kSbPerBlock) * size_t(kc) * size_t(rows) * sizeof(uint64_t);
}

void launch_sample(const SampleArgs& a, cudaStream_t s) {
  if (a.V <= 0 || !a.logits || !a.cand || !a.out) fail("launch_sample: empty row or null buffers");
  if (a.kc < 1 || a.kc > kMaxBackendTopK || a.kc > kSpKeys / 2)
    fail("launch_sample: top_k of ", a.kc, " (1..", kMaxBackendTopK, ")");
  if (a.temperature != 0.f && a.kc >= a.V) fail("launch_sample: top_k of ", a.kc, " is not below the vocabulary");
  if (a.rows < 1 || a.rows > kMaxSampleRows) fail("launch_sample: ", a.rows, " rows (1..", kMaxSampleRows, ")");
  if (a.rows > 1 && a.row_stride < size_t(a.V)) fail("launch_sample: rows closer than V logits apart");
  if (a.adjust_off && !a.adjust) fail("launch_sample: adjustment offsets without adjustments");
  const int blocks = (a.V + kSbPerBlock - 1) / kSbPerBlock;
  sample_block_kernel<<<dim3(blocks, a.rows), kSbThreads, 0, s>>>(a);
  check_launch("sample_block_kernel");
  sample_pick_kernel<<<a.rows, kSpThreads, 0, s>>>(a, blocks * a.kc);
  check_launch("sample_pick_kernel");
}

}  // namespace lily::cuda

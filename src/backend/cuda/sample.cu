// On-device sampling (Backend::forward_sample; the pipeline is described in
// backend/sampling.h). Two launches after the decode step:
//   1. sample_block_kernel: 2,048 logits a block (NaN as -inf, the listed
//      adjustments applied in the Sampler's order) as 64-bit keys (the
//      value's order-preserving bits, then the complement of the id, so
//      that the larger key is the larger value, the lower id on ties); the
//      block's kc largest keys (kc = top_k, or 1 when greedy), found by a
//      radix select, go to the candidates in no particular order.
//   2. sample_pick_kernel (one block): the candidates' kc largest by the
//      same select, ranked, then the Sampler's listed path: weights in
//      double, top_p, min_p and the draw walked sequentially in order, as
//      the CPU walks them.
// Keys are unique, so each block's set and the final set are the top kc of
// the whole row whatever the block split or the order of the candidates.
// Several rows (a draft run's) go in one launch of each: blockIdx.y /
// blockIdx.x is the row.

#include <climits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace lily::cuda {

namespace {

constexpr int kSbThreads = 256, kSbItems = 8, kSbPerBlock = kSbThreads * kSbItems;
constexpr int kSpThreads = 1024;

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

// A warp's inclusive running sum of v in lane order (every lane calls it).
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// A row's adjustments: [*lo, *hi) of a.adjust.
__device__ __forceinline__ void row_adjust(const SampleArgs& a, int row, int* lo, int* hi) {
  *lo = a.adjust_off ? a.adjust_off[row] : 0;
  *hi = a.adjust_off ? a.adjust_off[row + 1] : 0;
}

// The block's kPerBlock logits of `row` from `base` into vals: NaN and the
// ids the allow mask leaves out as -inf, the row's listed adjustments
// applied in the Sampler's order (which keep -inf), -inf past the row.
// Ends with a barrier.
template <int kPerBlock>
__device__ void load_adjusted(const SampleArgs& a, int row, int base, float* vals, int* first_adjust) {
  const int tid = threadIdx.x;
  const float* logits = a.logits + size_t(row) * a.row_stride;
  const uint32_t* allow = a.allow ? a.allow + size_t(row) * a.allow_words : nullptr;
  int adj_lo, adj_hi;
  row_adjust(a, row, &adj_lo, &adj_hi);
  for (int i = tid; i < kPerBlock; i += blockDim.x) {
    const int id = base + i;
    float v = -INFINITY;
    if (id < a.V && (!allow || (allow[id >> 5] >> (id & 31) & 1u))) {
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
    *first_adjust = lo;
  }
  __syncthreads();
  for (int e = *first_adjust + tid; e < adj_hi && a.adjust[e].id < base + kPerBlock; e += blockDim.x) {
    const LogitAdjust j = a.adjust[e];
    if (j.id >= a.V) continue;
    float v = vals[j.id - base];
    if (j.ops & LogitAdjust::kBias) v += j.bias;
    if (j.ops & LogitAdjust::kRep) v = v > 0.f ? v / a.rep_penalty : v * a.rep_penalty;
    if (j.ops & LogitAdjust::kSub) v -= j.sub;
    vals[j.id - base] = v;
  }
  __syncthreads();
}

// ---- Top kc by radix select -------------------------------------------------
// Keys are unique but for 0 (padding past the row, below every real key: a
// -inf logit still has nonzero bits), so the kc largest nonzero keys are one
// set whatever the order they are listed in.
struct SelectSpace {
  int hist[256];
  uint64_t prefix;
  int need, done, count;
};

// The set of the k largest nonzero keys among key_at(0..n-1), as a threshold:
// it is {nonzero keys >= the return value}, of min(k, nonzero keys) members.
// 8 bits a pass from the top; a pass that leaves exactly the keys still
// needed under the prefix ends it (random keys: 2-4 passes, not 8). Every
// thread of the block calls it; ends with a barrier.
template <class KeyAt>
__device__ uint64_t block_select_kth(KeyAt key_at, int n, int k, SelectSpace& sp) {
  const int tid = threadIdx.x, lane = tid & 31, nt = blockDim.x;
  if (tid == 0) {
    sp.prefix = 0;
    sp.need = k;
    sp.done = 0;
  }
  uint64_t mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += nt) sp.hist[d] = 0;
    __syncthreads();
    const uint64_t prefix = sp.prefix;
    for (int i0 = 0; i0 < n; i0 += nt) {  // every lane of a warp takes each step
      const int i = i0 + tid;
      const uint64_t key = i < n ? key_at(i) : 0ull;
      const bool valid = key != 0ull && (key & mask) == prefix;
      const int d = valid ? int((key >> shift) & 255) : 256;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (valid && lane == __ffs(peers) - 1) atomicAdd(&sp.hist[d], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {  // lane l holds digits 255 - 8l down to 248 - 8l
      int c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = sp.hist[255 - 8 * lane - j];
        sum += c[j];
      }
      const int incl = warp_inclusive_sum(sum, lane);
      const int need = sp.need, total = __shfl_sync(0xffffffffu, incl, 31);
      const int excl = incl - sum;
      __syncwarp();
      if (total < need) {  // fewer nonzero keys than needed under the prefix: only on the first pass
        if (lane == 0) sp.done = 2;
      } else if (excl < need && need <= incl) {
        int acc = excl;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (acc + c[j] >= need) {
            const int dig = 255 - 8 * lane - j;
            sp.prefix = prefix | (uint64_t(dig) << shift);
            sp.need = need - acc;
            sp.done = c[j] == need - acc;
            break;
          }
          acc += c[j];
        }
      }
    }
    __syncthreads();
    if (sp.done) break;
    mask |= uint64_t(255) << shift;
  }
  const uint64_t t = sp.done == 2 ? 1ull : sp.prefix;
  __syncthreads();  // every thread has read sp before it is reused
  return t;
}

// out[0..k) = the k largest nonzero keys of key_at(0..n-1) in no particular
// order, 0 in the slots past the nonzero keys. Ends with a barrier.
template <class KeyAt>
__device__ void block_top_k(KeyAt key_at, int n, int k, uint64_t* out, SelectSpace& sp) {
  const uint64_t t = block_select_kth(key_at, n, k, sp);
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) sp.count = 0;
  __syncthreads();
  for (int i0 = 0; i0 < n; i0 += blockDim.x) {
    const int i = i0 + tid;
    const uint64_t key = i < n ? key_at(i) : 0ull;
    const bool in = key != 0ull && key >= t;
    const unsigned m = __ballot_sync(0xffffffffu, in);
    if (!m) continue;
    int at = 0;
    if (lane == __ffs(m) - 1) at = atomicAdd(&sp.count, __popc(m));
    at = __shfl_sync(0xffffffffu, at, __ffs(m) - 1) + __popc(m & ((1u << lane) - 1));
    if (in && at < k) out[at] = key;  // at < k always: a guard against a broken count
  }
  __syncthreads();
  for (int r = sp.count + tid; r < k; r += blockDim.x) out[r] = 0ull;
  __syncthreads();
}

// The rank of sel[t] among sel[0..k) in descending order (equal keys, the
// zeros of a short row, by slot).
__device__ __forceinline__ int rank_desc(const uint64_t* sel, int k, int t) {
  const uint64_t key = sel[t];
  int r = 0;
  for (int j = 0; j < k; ++j) r += sel[j] > key || (sel[j] == key && j < t);
  return r;
}

__global__ void __launch_bounds__(kSbThreads) sample_block_kernel(const SampleArgs a) {
  __shared__ float vals[kSbPerBlock];
  __shared__ SelectSpace sp;
  __shared__ int first_adjust;
  const int base = blockIdx.x * kSbPerBlock, row = blockIdx.y;
  load_adjusted<kSbPerBlock>(a, row, base, vals, &first_adjust);
  const int n = min(kSbPerBlock, a.V - base);
  block_top_k([&](int i) { return make_key(vals[i], base + i); }, n, a.kc,
              a.cand + (size_t(row) * gridDim.x + blockIdx.x) * a.kc, sp);
}

__global__ void __launch_bounds__(kSpThreads) sample_pick_kernel(const SampleArgs a, int n_cand) {
  __shared__ SelectSpace sp;
  __shared__ uint64_t sel[kMaxBackendTopK];
  __shared__ uint64_t best[kMaxBackendTopK];
  __shared__ double w[kMaxBackendTopK];
  __shared__ int ids[kMaxBackendTopK];
  const int tid = threadIdx.x, kc = a.kc, row = blockIdx.x;
  const uint64_t* cand = a.cand + size_t(row) * n_cand;
  int* out = a.out + 2 * row;
  block_top_k([&](int i) { return cand[i]; }, n_cand, kc, sel, sp);
  if (tid < kc) best[rank_desc(sel, kc, tid)] = sel[tid];
  __syncthreads();
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


// ---- The whole vocabulary (kc 0: sampling without top_k) -------------------
// The Sampler's unlisted path (engine/sampler.cpp), on every id of the row:
//   weights w = exp((work - max) / T) in double; with top_p, the ids bucketed
//   by (max - work) / T in eighths of a nat (512 buckets, the last one open),
//   the bucket where the mass reaches top_p x total is the crossing one:
//   every id of an earlier bucket is kept, and of the crossing bucket the
//   best ones (by value, lower id first) while the mass before them is below
//   the target; min_p then drops the kept ids with w < min_p; the draw walks
//   the earlier buckets' ids in id order, then the crossing ones best first.
// Five launches:
//   wv_max    (grid blocks x rows): the adjusted row to the workspace, each
//             block's best key;
//   wv_weigh  (same grid): each block's total weight and bucket masses;
//   wv_cross  (a block a row): the crossing bucket and the mass before it;
//   wv_split  (same grid as wv_max): each block's kept weight outside the
//             crossing bucket, the crossing ids listed with their weights;
//   wv_pick   (a block a row): the last crossing id top_p keeps and the draw,
//             both by a weighted radix select over the list (most valuable
//             digit first), or by a scan of one block's ids in id order.
// Without top_p and min_p (temperature alone) every id is kept: there is no
// crossing bucket and a block's kept weight is its total, so wv_cross and
// wv_split are left out (wv_weigh writes the row's state, wv_pick takes the
// blocks' totals): three launches.
// The sums run in other orders than the CPU's (blocks, then the blocks'
// totals): the same draw picks the same token up to last-bit differences of
// the double sums and of the two exp implementations.
constexpr int kWvBuckets = 512;
constexpr double kWvPerNat = 8.0;
constexpr int kWvThreads = 1024, kWvItems = 8, kWvPerBlock = kWvThreads * kWvItems;  // wv_max, wv_weigh, wv_split
constexpr int kWpThreads = kWvThreads;

struct WvRow {
  uint64_t best;  // the largest key: the max value, its lowest id
  int cross;      // the crossing bucket (kWvBuckets: none, every id outside it)
  int n;          // crossing ids listed
  double before;  // the mass of the buckets before `cross`
  double target;  // top_p x the row's total weight
};
struct WvItem {
  uint64_t key;
  double w;
};
struct WvSpace {
  float* adj;      // rows x V adjusted logits
  uint64_t* bkey;  // rows x blocks
  double* btot;    // rows x blocks
  double* bhist;   // rows x blocks x kWvBuckets
  double* bkept;   // rows x blocks
  WvRow* rows;     // rows
  WvItem* items;   // rows x V
};

struct WvLayout {
  size_t adj, bkey, btot, bhist, bkept, rows, items, bytes;
};
WvLayout wv_layout(int V, int R) {
  const size_t nb = size_t((V + kWvPerBlock - 1) / kWvPerBlock), r = size_t(R), v = size_t(V);
  WvLayout L{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t o = at;
    at = (at + bytes + 255) / 256 * 256;
    return o;
  };
  L.adj = take(r * v * sizeof(float));
  L.bkey = take(r * nb * sizeof(uint64_t));
  L.btot = take(r * nb * sizeof(double));
  L.bhist = take(r * nb * kWvBuckets * sizeof(double));
  L.bkept = take(r * nb * sizeof(double));
  L.rows = take(r * sizeof(WvRow));
  L.items = take(r * v * sizeof(WvItem));
  L.bytes = at;
  return L;
}
WvSpace wv_space(void* ws, int V, int R) {
  const WvLayout L = wv_layout(V, R);
  char* b = static_cast<char*>(ws);
  return {reinterpret_cast<float*>(b + L.adj),     reinterpret_cast<uint64_t*>(b + L.bkey),
          reinterpret_cast<double*>(b + L.btot),   reinterpret_cast<double*>(b + L.bhist),
          reinterpret_cast<double*>(b + L.bkept),  reinterpret_cast<WvRow*>(b + L.rows),
          reinterpret_cast<WvItem*>(b + L.items)};
}

struct KeyMax {
  __device__ uint64_t operator()(uint64_t x, uint64_t y) const { return x > y ? x : y; }
};

__device__ __forceinline__ double wv_weight(float l, float top, double inv_t) {
  return exp((double(l) - double(top)) * inv_t);
}
// The Sampler's bucket_of, in its arithmetic.
__device__ __forceinline__ int wv_bucket(float l, float top, double inv_t) {
  const double d = (double(top) - double(l)) * inv_t * kWvPerNat;
  return d < kWvBuckets - 1 ? int(d) : kWvBuckets - 1;
}
// An id outside the crossing bucket that top_p and min_p keep.
__device__ __forceinline__ bool wv_lower_kept(float l, double w, const WvRow& st, float top, double inv_t,
                                              float min_p) {
  if (st.cross < kWvBuckets && wv_bucket(l, top, inv_t) >= st.cross) return false;
  return !(min_p > 0.f) || w >= double(min_p);
}
// The row's best key, reduced from the blocks' (every thread gets it).
template <int kThreads>
__device__ uint64_t wv_row_best(const uint64_t* bkey, int nb) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ uint64_t best;
  uint64_t k = 0;
  for (int i = threadIdx.x; i < nb; i += kThreads) k = bkey[i] > k ? bkey[i] : k;
  k = Reduce(tmp).Reduce(k, KeyMax());
  if (threadIdx.x == 0) best = k;
  __syncthreads();
  return best;
}
// hist[d] += w (and cnt[d] += 1 where cnt is given) for the lanes with
// `valid`: one atomic a warp where the valid lanes share d (the common case
// when most ids fall in a few bins), one a lane otherwise.
__device__ __forceinline__ void hist_add(double* hist, int* cnt, bool valid, int d, double w) {
  const unsigned vmask = __ballot_sync(0xffffffffu, valid);
  if (!vmask) return;
  const int lane = threadIdx.x & 31;
  const int d0 = __shfl_sync(0xffffffffu, d, __ffs(vmask) - 1);
  if (__all_sync(0xffffffffu, !valid || d == d0)) {
    double s = valid ? w : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
      atomicAdd(&hist[d0], s);
      if (cnt) atomicAdd(&cnt[d0], __popc(vmask));
    }
  } else if (valid) {
    atomicAdd(&hist[d], w);
    if (cnt) atomicAdd(&cnt[d], 1);
  }
}

__global__ void __launch_bounds__(kWvThreads) wv_max_kernel(const SampleArgs a, const WvSpace p) {
  using Reduce = cub::BlockReduce<uint64_t, kWvThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float vals[kWvPerBlock];
  __shared__ int first_adjust;
  const int tid = threadIdx.x, base = blockIdx.x * kWvPerBlock, row = blockIdx.y;
  load_adjusted<kWvPerBlock>(a, row, base, vals, &first_adjust);
  float* adj = p.adj + size_t(row) * a.V;
  uint64_t best = 0;
  for (int i = tid; i < kWvPerBlock && base + i < a.V; i += kWvThreads) {
    adj[base + i] = vals[i];
    const uint64_t k = make_key(vals[i], base + i);
    best = k > best ? k : best;
  }
  best = Reduce(tmp).Reduce(best, KeyMax());
  if (tid == 0) p.bkey[size_t(row) * gridDim.x + blockIdx.x] = best;
}

// Every id kept (no top_p, no min_p): wv_cross and wv_split are not run.
__host__ __device__ __forceinline__ bool wv_keeps_all(const SampleArgs& a) {
  return !(a.top_p < 1.f) && !(a.min_p > 0.f);
}

__global__ void __launch_bounds__(kWvThreads) wv_weigh_kernel(const SampleArgs a, const WvSpace p) {
  using Reduce = cub::BlockReduce<double, kWvThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ double hist[kWvBuckets];
  const int tid = threadIdx.x, nb = gridDim.x, base = blockIdx.x * kWvPerBlock, row = blockIdx.y;
  const uint64_t best = wv_row_best<kWvThreads>(p.bkey + size_t(row) * nb, nb);
  const float top = key_value(best);
  if (wv_keeps_all(a) && blockIdx.x == 0 && tid == 0) p.rows[row] = {best, kWvBuckets, 0, 0.0, 0.0};  // wv_cross's
  const double inv_t = 1.0 / double(a.temperature);
  if (!(top > -INFINITY) || isinf(top) || !isfinite(inv_t)) return;  // wv_pick takes the best id
  const bool buckets = a.top_p < 1.f;
  for (int b = tid; b < kWvBuckets; b += kWvThreads) hist[b] = 0.0;
  __syncthreads();
  const float* adj = p.adj + size_t(row) * a.V;
  double total = 0.0;
  for (int i = tid; i < kWvPerBlock; i += kWvThreads) {  // every lane of a warp takes each step
    const int id = base + i;
    const bool in = id < a.V;
    const float l = in ? adj[id] : -INFINITY;
    const double w = in ? wv_weight(l, top, inv_t) : 0.0;
    total += w;
    if (buckets) hist_add(hist, nullptr, in, in ? wv_bucket(l, top, inv_t) : 0, w);
  }
  total = Reduce(tmp).Sum(total);
  __syncthreads();
  const size_t blk = size_t(row) * nb + blockIdx.x;
  if (tid == 0) p.btot[blk] = total;
  if (buckets)
    for (int b = tid; b < kWvBuckets; b += kWvThreads) p.bhist[blk * kWvBuckets + b] = hist[b];
}

__global__ void __launch_bounds__(kWvBuckets) wv_cross_kernel(const SampleArgs a, const WvSpace p, int nb) {
  __shared__ double mass[kWvBuckets];
  const int tid = threadIdx.x, row = blockIdx.x;
  const uint64_t best = wv_row_best<kWvBuckets>(p.bkey + size_t(row) * nb, nb);
  const float top = key_value(best);
  const double inv_t = 1.0 / double(a.temperature);
  WvRow& st = p.rows[row];
  if (tid == 0) {
    st.best = best;
    st.cross = kWvBuckets;
    st.n = 0;
    st.before = st.target = 0.0;
  }
  if (!(a.top_p < 1.f) || !(top > -INFINITY) || isinf(top) || !isfinite(inv_t)) return;
  double m = 0.0;  // the blocks in order: the same sum every run
  const double* h = p.bhist + size_t(row) * nb * kWvBuckets + tid;
  int b = 0;
  for (; b + 4 <= nb; b += 4) {  // four loads in flight
    const double h0 = h[size_t(b) * kWvBuckets], h1 = h[size_t(b + 1) * kWvBuckets];
    const double h2 = h[size_t(b + 2) * kWvBuckets], h3 = h[size_t(b + 3) * kWvBuckets];
    m += h0;
    m += h1;
    m += h2;
    m += h3;
  }
  for (; b < nb; ++b) m += h[size_t(b) * kWvBuckets];
  mass[tid] = m;
  __syncthreads();
  if (tid >= 32) return;
  // One warp: the row's total (lane-strided, then a fixed tree: the same sum
  // every run), then the buckets walked from the first, 16 a lane.
  const int lane = tid;
  double total = 0.0;
  for (int k = lane; k < nb; k += 32) total += p.btot[size_t(row) * nb + k];
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  const double target = double(a.top_p) * total;
  constexpr int kPer = kWvBuckets / 32;
  double mm[kPer], sum = 0.0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    mm[j] = mass[kPer * lane + j];
    sum += mm[j];
  }
  const double incl = warp_inclusive_sum(sum, lane);
  double before = incl - sum;
  int cross = -1;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {  // the first bucket whose mass reaches the target; the last one at most
    if (cross >= 0) continue;
    if (kPer * lane + j == kWvBuckets - 1 || before + mm[j] >= target) cross = kPer * lane + j;
    else before += mm[j];
  }
  const unsigned found = __ballot_sync(0xffffffffu, cross >= 0);  // lane 31 always finds
  if (lane == __ffs(found) - 1) {
    st.cross = cross;
    st.before = before;
    st.target = target;
  }
}

__global__ void __launch_bounds__(kWvThreads) wv_split_kernel(const SampleArgs a, const WvSpace p) {
  using Reduce = cub::BlockReduce<double, kWvThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int tid = threadIdx.x, base = blockIdx.x * kWvPerBlock, row = blockIdx.y, lane = tid & 31;
  const WvRow st = p.rows[row];
  const float top = key_value(st.best);
  const double inv_t = 1.0 / double(a.temperature);
  if (!(top > -INFINITY) || isinf(top) || !isfinite(inv_t)) return;
  const float* adj = p.adj + size_t(row) * a.V;
  WvItem* items = p.items + size_t(row) * a.V;
  double kept = 0.0;
  for (int i = tid; i < kWvPerBlock; i += kWvThreads) {  // every lane of a warp takes each step
    const int id = base + i;
    const bool in = id < a.V;
    const float l = in ? adj[id] : -INFINITY;
    const double w = in ? wv_weight(l, top, inv_t) : 0.0;
    const bool crossing = in && st.cross < kWvBuckets && wv_bucket(l, top, inv_t) == st.cross;
    if (in && !crossing && wv_lower_kept(l, w, st, top, inv_t, a.min_p)) kept += w;
    const unsigned cm = __ballot_sync(0xffffffffu, crossing);
    if (cm) {
      int at = 0;
      if (lane == __ffs(cm) - 1) at = atomicAdd(&p.rows[row].n, __popc(cm));
      at = __shfl_sync(0xffffffffu, at, __ffs(cm) - 1) + __popc(cm & ((1u << lane) - 1));
      if (crossing) items[at] = {make_key(l, id), w};
    }
  }
  kept = Reduce(tmp).Sum(kept);
  if (tid == 0) p.bkept[size_t(row) * gridDim.x + blockIdx.x] = kept;
}

// Of the listed items with key >= lo (and w >= min_p where min_p > 0), in
// descending key order, the first whose running weight (itself included)
// reaches t (strict: exceeds t): its key, or 0 when the weights fall short.
// Weighted radix select, 8 bits a pass from the top; a pass ends it early
// once one item is left.
__device__ uint64_t wv_select(const WvItem* items, int n, uint64_t lo, float min_p, double t, bool strict) {
  __shared__ double hm[256];
  __shared__ int hc[256];
  __shared__ uint64_t s_prefix, s_key;
  __shared__ double s_t;
  __shared__ int s_state;  // 0 going on, 1 one item left, 2 none reaches t
  const int tid = threadIdx.x;
  if (tid == 0) {
    s_prefix = 0;
    s_t = t;
    s_state = 0;
  }
  uint64_t mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += blockDim.x) {
      hm[d] = 0.0;
      hc[d] = 0;
    }
    __syncthreads();
    const uint64_t prefix = s_prefix;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {  // every lane of a warp takes each step
      const int i = i0 + tid;
      WvItem e{0, 0.0};
      if (i < n) e = items[i];
      const bool valid = i < n && e.key >= lo && (!(min_p > 0.f) || e.w >= double(min_p)) &&
                         (e.key & mask) == prefix;
      hist_add(hm, hc, valid, int((e.key >> shift) & 255), e.w);
    }
    __syncthreads();
    if (tid < 32) {  // lane l holds digits 255 - 8l down to 248 - 8l, walked from the top
      const int lane = tid;
      double m[8], sum = 0.0;
      int c[8], last = -1;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = 255 - 8 * lane - j;
        c[j] = hc[d];
        m[j] = hm[d];
        sum += m[j];
        if (c[j]) last = d;
      }
      const double incl = warp_inclusive_sum(sum, lane);
      const double tt = s_t;
      double acc = incl - sum;
      int chosen = -1;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (chosen >= 0 || c[j] == 0) continue;
        const double mm = acc + m[j];
        if (strict ? mm > tt : mm >= tt) chosen = j;
        else acc = mm;
      }
      const unsigned found = __ballot_sync(0xffffffffu, chosen >= 0);
      const unsigned any = __ballot_sync(0xffffffffu, last >= 0);
      __syncwarp();
      if (found) {  // the first lane where the running mass reaches t
        if (lane == __ffs(found) - 1) {
          const int d = 255 - 8 * lane - chosen;
          s_t = tt - acc;
          s_prefix = prefix | (uint64_t(d) << shift);
          if (c[chosen] == 1) s_state = 1;
        }
      } else if (shift == 56 || !any) {
        if (lane == 0) s_state = 2;
      } else if (lane == 31 - __clz(any)) {  // the digits' sums fell short of their bin's in the last bits: its last item
        s_t = INFINITY;
        s_prefix = prefix | (uint64_t(last) << shift);
        int cl = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (255 - 8 * lane - j == last) cl = c[j];
        if (cl == 1) s_state = 1;
      }
    }
    __syncthreads();
    if (s_state == 2) return 0;
    mask |= uint64_t(255) << shift;
    if (s_state == 1 && shift > 0) {  // the one item under the prefix
      const uint64_t pf = s_prefix;
      for (int i = tid; i < n; i += blockDim.x) {
        const WvItem e = items[i];
        if (e.key >= lo && (!(min_p > 0.f) || e.w >= double(min_p)) && (e.key & mask) == pf) s_key = e.key;
      }
      __syncthreads();
      return s_key;
    }
  }
  return s_prefix;
}

__global__ void __launch_bounds__(kWpThreads) wv_pick_kernel(const SampleArgs a, const WvSpace p, int nb) {
  // Each block's kept weight outside the crossing bucket: wv_split's, or
  // its total where every id is kept (the same sum, in the same order).
  const double* const kept_by_block = wv_keeps_all(a) ? p.btot : p.bkept;
  using Reduce = cub::BlockReduce<double, kWpThreads>;
  using KeyReduce = cub::BlockReduce<uint64_t, kWpThreads>;
  using Scan = cub::BlockScan<double, kWpThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename KeyReduce::TempStorage keys;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ double s_mass;
  __shared__ int s_block, s_first, s_last;
  const int tid = threadIdx.x, row = blockIdx.x;
  const WvRow st = p.rows[row];
  const float top = key_value(st.best);
  int* out = a.out + 2 * row;
  if (tid == 0) {
    out[0] = key_id(st.best);
    out[1] = top > -INFINITY ? 0 : 2;  // 2: no finite logit
  }
  const double inv_t = 1.0 / double(a.temperature);
  if (!(top > -INFINITY) || isinf(top) || !isfinite(inv_t)) return;
  const WvItem* items = p.items + size_t(row) * a.V;
  const int n = st.n;
  // The last crossing item top_p keeps (every one when their mass falls short).
  const uint64_t theta = n > 0 ? wv_select(items, n, 0, 0.f, st.target - st.before, false) : 0;
  double c = 0.0;
  for (int i = tid; i < n; i += kWpThreads) {
    const WvItem e = items[i];
    if (e.key >= theta && (!(a.min_p > 0.f) || e.w >= double(a.min_p))) c += e.w;
  }
  c = Reduce(tmp.reduce).Sum(c);
  if (tid < 32) {  // one warp: the kept mass outside the crossing bucket, and where the draw falls
    const int lane = tid, per = (nb + 31) / 32, b0 = lane * per, b1 = min(nb, b0 + per);
    const double* bkept = kept_by_block + size_t(row) * nb;
    double lower = 0.0;  // lane-strided, then a fixed tree: the same sum every run
    for (int k = lane; k < nb; k += 32) lower += bkept[k];
    for (int o = 16; o > 0; o >>= 1) lower += __shfl_xor_sync(0xffffffffu, lower, o);
    c = __shfl_sync(0xffffffffu, c, 0);  // the block sum is thread 0's
    const double r = a.u[row] * (lower + c);
    if (lane == 0) {
      s_block = -1;
      s_mass = r - lower;
    }
    if (r < lower || !(c > 0.0)) {  // in the ids outside the crossing bucket: which block
      double sum = 0.0;
      for (int b = b0; b < b1; ++b) sum += bkept[b] > 0.0 ? bkept[b] : 0.0;
      const double incl = warp_inclusive_sum(sum, lane);
      double acc = incl - sum;
      int hit = -1, last = -1;
      for (int b = b0; b < b1; ++b) {
        const double k = bkept[b];
        if (!(k > 0.0)) continue;
        last = b;
        if (r < acc + k) {
          hit = b;
          break;
        }
        acc += k;
      }
      const unsigned found = __ballot_sync(0xffffffffu, hit >= 0), any = __ballot_sync(0xffffffffu, last >= 0);
      __syncwarp();
      if (found) {
        if (lane == __ffs(found) - 1) {
          s_block = hit;
          s_mass = r - acc;
        }
      } else if (lane == (any ? 31 - __clz(any) : 0)) {  // past the end: the last block with kept ids
        s_block = last;
        s_mass = r < lower ? r - acc : INFINITY;
      }
    }
  }
  __syncthreads();
  int pick = -1;
  if (s_block < 0) {  // among the crossing items kept, best first
    const uint64_t k = wv_select(items, n, theta, a.min_p, s_mass, true);
    if (k) {
      pick = key_id(k);
    } else {  // the draw rounded past the end: the last item with weight
      uint64_t least = ~0ull;
      for (int i = tid; i < n; i += kWpThreads) {
        const WvItem e = items[i];
        if (e.key >= theta && e.w > 0.0 && (!(a.min_p > 0.f) || e.w >= double(a.min_p)) && e.key < least)
          least = e.key;
      }
      least = ~KeyReduce(tmp.keys).Reduce(~least, KeyMax());
      pick = key_id(least);
    }
  } else {  // block s_block's ids in id order
    const int base = s_block * kWvPerBlock;
    const float* adj = p.adj + size_t(row) * a.V;
    if (tid == 0) {
      s_first = INT_MAX;
      s_last = -1;
    }
    double w[kWvItems], run[kWvItems];
    bool kept[kWvItems];
#pragma unroll
    for (int j = 0; j < kWvItems; ++j) {
      const int id = base + kWvItems * tid + j;
      const float l = id < a.V ? adj[id] : -INFINITY;
      w[j] = id < a.V ? wv_weight(l, top, inv_t) : 0.0;
      kept[j] = id < a.V && w[j] > 0.0 && wv_lower_kept(l, w[j], st, top, inv_t, a.min_p);
      if (!kept[j]) w[j] = 0.0;
    }
    Scan(tmp.scan).InclusiveSum(w, run);
    __syncthreads();
    const double r = s_mass;
#pragma unroll
    for (int j = 0; j < kWvItems; ++j) {
      if (!kept[j]) continue;
      const int id = base + kWvItems * tid + j;
      atomicMax(&s_last, id);
      if (r < run[j]) atomicMin(&s_first, id);
    }
    __syncthreads();
    pick = s_first != INT_MAX ? s_first : s_last;
  }
  if (tid == 0) {
    out[0] = pick;
    out[1] = 1;  // the draw was used
  }
}

// ---- Log-probabilities under the raw rows (launch_logprobs) -----------------
// lp_block_kernel (blocks x rows, kSbPerBlock logits a block): the block's
// max m, sum of exp(x - m) in double, and (top > 0) its top ids as keys;
// lp_pick_kernel (a block a row): max M over the blocks, the log-sum-exp
// M + log(sum of sum_b exp(m_b - M)) (M itself when infinite, as
// engine::log_sum_exp), the chosen id's x - lse and the top ids' in order.
struct FloatMax {
  __device__ __forceinline__ float operator()(float x, float y) const { return fmaxf(x, y); }
};
// The block's max of m, to every thread; its sum of v, to thread 0
// (kSbThreads threads, every one calls them).
__device__ float lp_block_max(float m) {
  using Red = cub::BlockReduce<float, kSbThreads>;
  __shared__ typename Red::TempStorage tmp;
  __shared__ float s_max;
  m = Red(tmp).Reduce(m, FloatMax());
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  return s_max;
}
__device__ double lp_block_sum(double v) {
  using Red = cub::BlockReduce<double, kSbThreads>;
  __shared__ typename Red::TempStorage tmp;
  return Red(tmp).Sum(v);
}

struct LpSpace {
  uint64_t* cand;  // (row, block) slot at slot * kMaxBackendLogprobs, `top` keys
  double* sum;
  float* max;
};

// A (row, block) slot: kMaxBackendLogprobs keys, a sum and a max.
size_t lp_slots(int V, int rows) { return size_t((V + kSbPerBlock - 1) / kSbPerBlock) * size_t(rows); }
constexpr size_t kLpSlotBytes = kMaxBackendLogprobs * sizeof(uint64_t) + sizeof(double) + sizeof(float);

LpSpace lp_space(void* work, int V, int rows, int* blocks_out = nullptr) {
  const size_t slots = lp_slots(V, rows);
  if (blocks_out) *blocks_out = (V + kSbPerBlock - 1) / kSbPerBlock;
  auto* cand = static_cast<uint64_t*>(work);
  auto* sum = reinterpret_cast<double*>(cand + slots * kMaxBackendLogprobs);
  return {cand, sum, reinterpret_cast<float*>(sum + slots)};
}

__global__ void __launch_bounds__(kSbThreads) lp_block_kernel(const LogprobArgs a, const LpSpace p) {
  __shared__ float vals[kSbPerBlock];
  __shared__ SelectSpace sp;
  const int base = blockIdx.x * kSbPerBlock, row = blockIdx.y, tid = threadIdx.x;
  const float* logits = a.logits + size_t(row) * a.row_stride;
  float m = -INFINITY;
  for (int i = tid; i < kSbPerBlock; i += kSbThreads) {
    const int id = base + i;
    float v = id < a.V ? logits[id] : -INFINITY;
    if (v != v) v = -INFINITY;
    vals[i] = v;
    m = fmaxf(m, v);
  }
  m = lp_block_max(m);
  double sum = 0.0;
  if (isfinite(m))  // else the merge needs only m (all -inf here, or M infinite)
    for (int i = tid; i < kSbPerBlock; i += kSbThreads) sum += exp(double(vals[i]) - double(m));
  sum = lp_block_sum(sum);
  const size_t slot = size_t(row) * gridDim.x + blockIdx.x;
  if (tid == 0) {
    p.sum[slot] = sum;
    p.max[slot] = m;
  }
  if (a.top > 0)
    block_top_k([&](int i) { return make_key(vals[i], base + i); }, min(kSbPerBlock, a.V - base), a.top,
                p.cand + slot * kMaxBackendLogprobs, sp);
}

__global__ void __launch_bounds__(kSbThreads) lp_pick_kernel(const LogprobArgs a, const LpSpace p, int blocks) {
  __shared__ SelectSpace sp;
  __shared__ uint64_t sel[kMaxBackendLogprobs];
  __shared__ double s_lse;
  const int row = blockIdx.x, tid = threadIdx.x;
  const size_t first = size_t(row) * blocks;
  float m = -INFINITY;
  for (int b = tid; b < blocks; b += kSbThreads) m = fmaxf(m, p.max[first + b]);
  m = lp_block_max(m);
  double sum = 0.0;
  if (isfinite(m))
    for (int b = tid; b < blocks; b += kSbThreads) {
      const float mb = p.max[first + b];
      if (mb > -INFINITY) sum += p.sum[first + b] * exp(double(mb) - double(m));
    }
  sum = lp_block_sum(sum);
  if (tid == 0) s_lse = isfinite(m) ? double(m) + log(sum) : double(m);
  __syncthreads();
  const double lse = s_lse;
  RowLogprobs& out = a.out[row];
  const float* logits = a.logits + size_t(row) * a.row_stride;
  auto lp = [&](float x) { return x == -INFINITY ? -INFINITY : float(double(x) - lse); };
  if (tid == 0) {
    const int id = a.argmax_key ? int(0xffffffffu - uint32_t(*a.argmax_key)) : a.ids[2 * row];
    float x = id >= 0 && id < a.V ? logits[id] : -INFINITY;
    if (x != x) x = -INFINITY;
    out.logprob = lp(x);
  }
  if (a.top <= 0) {
    if (tid == 0) out.n = 0;
    return;
  }
  const int top = a.top;
  block_top_k([&](int i) { return p.cand[(first + i / top) * kMaxBackendLogprobs + i % top]; }, blocks * top, top,
              sel, sp);
  if (tid < top) {  // in rank order; the zeros (a row shorter than top) last
    const uint64_t key = sel[tid];
    const int r = rank_desc(sel, top, tid);
    if (key != 0ull) {
      out.ids[r] = key_id(key);
      out.lp[r] = lp(key_value(key));
    }
    const unsigned nz = __ballot_sync(__activemask(), key != 0ull);
    if (tid == 0) out.n = __popc(nz);
  }
}

}  // namespace

size_t sample_workspace_bytes(int V, int kc, int rows) {
  if (kc == 0) return wv_layout(V, rows).bytes;
  return size_t((V + kSbPerBlock - 1) / kSbPerBlock) * size_t(kc) * size_t(rows) * sizeof(uint64_t);
}

size_t logprob_workspace_bytes(int V, int rows) { return lp_slots(V, rows) * kLpSlotBytes; }

void launch_logprobs(const LogprobArgs& a, cudaStream_t s) {
  if (a.V <= 0 || !a.logits || !(a.ids || a.argmax_key) || !a.work || !a.out)
    fail("launch_logprobs: empty row or null buffers");
  if (a.argmax_key && a.rows != 1) fail("launch_logprobs: the argmax key gives one row's id");
  if (a.top < 0 || a.top > kMaxBackendLogprobs)
    fail("launch_logprobs: ", a.top, " alternatives (0..", kMaxBackendLogprobs, ")");
  if (a.rows < 1 || a.rows > kMaxSampleRows) fail("launch_logprobs: ", a.rows, " rows (1..", kMaxSampleRows, ")");
  if (a.rows > 1 && a.row_stride < size_t(a.V)) fail("launch_logprobs: rows closer than V logits apart");
  int blocks = 0;
  const LpSpace p = lp_space(a.work, a.V, a.rows, &blocks);
  lp_block_kernel<<<dim3(blocks, a.rows), kSbThreads, 0, s>>>(a, p);
  check_launch("lp_block_kernel");
  lp_pick_kernel<<<a.rows, kSbThreads, 0, s>>>(a, p, blocks);
  check_launch("lp_pick_kernel");
}

int launch_sample(const SampleArgs& a, cudaStream_t s, cudaEvent_t* marks) {
  if (a.V <= 0 || !a.logits || !a.cand || !a.out) fail("launch_sample: empty row or null buffers");
  const bool whole = a.kc == 0 && a.temperature != 0.f;
  if (!whole && (a.kc < 1 || a.kc > kMaxBackendTopK))
    fail("launch_sample: top_k of ", a.kc, " (0: the whole vocabulary, or 1..", kMaxBackendTopK, ")");
  if (a.temperature != 0.f && a.kc >= a.V) fail("launch_sample: top_k of ", a.kc, " is not below the vocabulary");
  if (a.rows < 1 || a.rows > kMaxSampleRows) fail("launch_sample: ", a.rows, " rows (1..", kMaxSampleRows, ")");
  if (a.rows > 1 && a.row_stride < size_t(a.V)) fail("launch_sample: rows closer than V logits apart");
  if (a.adjust_off && !a.adjust) fail("launch_sample: adjustment offsets without adjustments");
  if (a.allow && a.allow_words < allow_words(size_t(a.V))) fail("launch_sample: an allow mask shorter than the row");
  const int blocks = (a.V + kSbPerBlock - 1) / kSbPerBlock;
  int made = 0;
  auto mark = [&] {
    if (marks) LILY_CUDA(cudaEventRecord(marks[made], s));
  };
  auto launched = [&](const char* what) {  // the launch's end mark is the next one's start
    check_launch(what);
    ++made;
    mark();
  };
  mark();
  if (whole) {
    const WvSpace p = wv_space(a.cand, a.V, a.rows);
    const int wblocks = (a.V + kWvPerBlock - 1) / kWvPerBlock;
    wv_max_kernel<<<dim3(wblocks, a.rows), kWvThreads, 0, s>>>(a, p);
    launched("wv_max_kernel");
    wv_weigh_kernel<<<dim3(wblocks, a.rows), kWvThreads, 0, s>>>(a, p);
    launched("wv_weigh_kernel");
    if (!wv_keeps_all(a)) {
      wv_cross_kernel<<<a.rows, kWvBuckets, 0, s>>>(a, p, wblocks);
      launched("wv_cross_kernel");
      wv_split_kernel<<<dim3(wblocks, a.rows), kWvThreads, 0, s>>>(a, p);
      launched("wv_split_kernel");
    }
    wv_pick_kernel<<<a.rows, kWpThreads, 0, s>>>(a, p, wblocks);
    launched("wv_pick_kernel");
    return made;
  }
  sample_block_kernel<<<dim3(blocks, a.rows), kSbThreads, 0, s>>>(a);
  launched("sample_block_kernel");
  sample_pick_kernel<<<a.rows, kSpThreads, 0, s>>>(a, blocks * a.kc);
  launched("sample_pick_kernel");
  return made;
}

}  // namespace lily::cuda

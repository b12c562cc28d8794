// Causal attention over the KV cache for a run of query tokens. A task is
// one query token, one KV head and one slice of the positions it attends
// to: all query heads of the KV head are handled together, so each cached
// K/V row is loaded once per task for the whole group. A single decode
// token's positions are split into slices so that every thread has work;
// each slice keeps its running max, sum and weighted V sum (the softmax of
// a split), and the slices are merged afterwards.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/kernels.h"

namespace lily::cpu {

void attention(ThreadPool& pool, const AttentionIO& io) {
  const int group = io.num_heads / io.num_kv_heads;
  const int hd = io.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const size_t kv_row = io.kv_pos_stride;
  const size_t rows = static_cast<size_t>(io.num_kv_heads) * io.T;
  // Slices per (token, KV head): enough tasks for the threads (four each),
  // at least kMinSlice positions a slice.
  constexpr int kMinSlice = 256;
  const int max_ctx = io.first_position + io.T;
  const size_t want = pool.size() * 4;
  const int splits = rows >= want ? 1
                                  : static_cast<int>(std::clamp<size_t>((want + rows - 1) / rows, 1,
                                                                        std::max(1, max_ctx / kMinSlice)));
  // A slice's partial result per query head: max, sum, then hd weighted V.
  const size_t part = 2 + hd;
  std::vector<float> parts(splits > 1 ? rows * splits * group * part : 0);
  pool.parallel_for(rows * splits, 1, [&](size_t b, size_t e) {
    std::vector<float> scores, mx(group), sum(group);
    for (size_t task = b; task < e; ++task) {
      const int s = static_cast<int>(task % splits);
      const size_t row = task / splits;
      const int kvh = static_cast<int>(row % io.num_kv_heads);
      const int t = static_cast<int>(row / io.num_kv_heads);
      const int n_ctx = io.first_position + t + 1;  // causal: positions [0, pos]
      const int p0 = static_cast<int>(static_cast<long long>(n_ctx) * s / splits);
      const int p1 = static_cast<int>(static_cast<long long>(n_ctx) * (s + 1) / splits);
      const int n = p1 - p0;
      scores.resize(static_cast<size_t>(group) * std::max(n, 1));
      const float* q0 = io.q + t * io.q_stride + static_cast<size_t>(kvh) * group * io.q_head_stride;
      const size_t head = static_cast<size_t>(kvh) * io.kv_head_stride;
      attention_scores(q0, io.q_head_stride, group, io.k_cache + head + p0 * kv_row, kv_row, n, hd, scale,
                       scores.data());
      for (int g = 0; g < group; ++g) {
        float* sg = &scores[static_cast<size_t>(g) * n];
        float m = -INFINITY;
        for (int p = 0; p < n; ++p) m = std::max(m, sg[p]);
        mx[g] = m;
        sum[g] = exp_shift_sum(sg, n, m);
      }
      // Weighted V: into the output (one slice: normalised at once) or the
      // slice's partial.
      auto out_of = [&](int g) {
        const int h = kvh * group + g;
        return splits == 1 ? io.out + t * io.out_stride + h * hd
                           : &parts[((row * splits + s) * group + g) * part + 2];
      };
      for (int g = 0; g < group; ++g) std::fill_n(out_of(g), hd, 0.f);
      // (The heads' outputs are evenly spaced: hd apart in the output row,
      // part apart in the slices' partials.)
      attention_values(scores.data(), group, n, io.v_cache + head + p0 * kv_row, kv_row, hd, out_of(0),
                       group > 1 ? static_cast<size_t>(out_of(1) - out_of(0)) : 0);
      for (int g = 0; g < group; ++g) {
        if (splits == 1) {
          const float inv = 1.f / sum[g];
          float* o = out_of(g);
          for (int x = 0; x < hd; ++x) o[x] *= inv;
        } else {
          float* pr = &parts[((row * splits + s) * group + g) * part];
          pr[0] = mx[g];
          pr[1] = sum[g];
        }
      }
    }
  });
  if (splits == 1) return;
  // Merge the slices of each (token, query head): weights exp(m_s - M).
  for (size_t row = 0; row < rows; ++row) {
    const int kvh = static_cast<int>(row % io.num_kv_heads);
    const int t = static_cast<int>(row / io.num_kv_heads);
    for (int g = 0; g < group; ++g) {
      float M = -INFINITY;
      for (int s = 0; s < splits; ++s) M = std::max(M, parts[((row * splits + s) * group + g) * part]);
      float L = 0;
      float* o = io.out + t * io.out_stride + (kvh * group + g) * hd;
      std::fill_n(o, hd, 0.f);
      for (int s = 0; s < splits; ++s) {
        const float* pr = &parts[((row * splits + s) * group + g) * part];
        if (pr[1] == 0.f) continue;  // an empty slice
        const float w = std::exp(pr[0] - M);
        L += w * pr[1];
        for (int x = 0; x < hd; ++x) o[x] += w * pr[2 + x];
      }
      const float inv = 1.f / L;
      for (int x = 0; x < hd; ++x) o[x] *= inv;
    }
  }
}

}  // namespace lily::cpu

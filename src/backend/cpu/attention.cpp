// Causal attention over the KV cache for a run of query tokens. All query
// heads of one KV head are handled by one task, so each cached K/V row is
// loaded once per query token for the whole group.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/attention.h"

namespace lily::cpu {

void attention(ThreadPool& pool, const AttentionIO& io) {
  const int group = io.num_heads / io.num_kv_heads;
  const int hd = io.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const size_t kv_row = static_cast<size_t>(io.num_kv_heads) * hd;
  pool.parallel_for(static_cast<size_t>(io.num_kv_heads) * io.T, 1, [&](size_t b, size_t e) {
    std::vector<float> scores;
    for (size_t task = b; task < e; ++task) {
      const int kvh = static_cast<int>(task % io.num_kv_heads);
      const int t = static_cast<int>(task / io.num_kv_heads);
      const int n_ctx = io.first_position + t + 1;  // causal: positions [0, pos]
      scores.resize(n_ctx);
      for (int g = 0; g < group; ++g) {
        const int h = kvh * group + g;
        const float* q = io.q + t * io.q_stride + h * io.q_head_stride;
        float mx = -INFINITY;
        for (int p = 0; p < n_ctx; ++p) {
          const float* k = io.k_cache + p * kv_row + kvh * hd;
          float d = 0;
          for (int x = 0; x < hd; ++x) d += q[x] * k[x];
          scores[p] = d * scale;
          mx = std::max(mx, scores[p]);
        }
        float sum = 0;
        for (int p = 0; p < n_ctx; ++p) {
          scores[p] = std::exp(scores[p] - mx);
          sum += scores[p];
        }
        const float inv = 1.f / sum;
        float* o = io.out + t * io.out_stride + h * hd;
        for (int x = 0; x < hd; ++x) o[x] = 0;
        for (int p = 0; p < n_ctx; ++p) {
          const float w = scores[p] * inv;
          const float* v = io.v_cache + p * kv_row + kvh * hd;
          for (int x = 0; x < hd; ++x) o[x] += w * v[x];
        }
      }
    }
  });
}

}  // namespace lily::cpu

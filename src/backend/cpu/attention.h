#pragma once

#include <cstddef>

#include "core/thread_pool.h"

namespace lily::cpu {

// q: T query tokens, head h at q + t*q_stride + h*q_head_stride (head_dim
// values). k_cache / v_cache: position p of KV head h at
// cache + h*kv_head_stride + p*kv_pos_stride (head_dim values), holding
// positions [0, first_position + T). out: [T][num_heads * head_dim] with
// row stride out_stride.
struct AttentionIO {
  const float* q;
  size_t q_stride, q_head_stride;
  const float* k_cache;
  const float* v_cache;
  size_t kv_head_stride, kv_pos_stride;
  float* out;
  size_t out_stride;
  int T, first_position, num_heads, num_kv_heads, head_dim;
};

void attention(ThreadPool& pool, const AttentionIO& io);

}  // namespace lily::cpu

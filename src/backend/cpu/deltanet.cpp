// Gated DeltaNet for one value head: the recurrent form (decode) and the
// chunked form (prefill). State S is [dk][dv] f32:
//   S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S += k_t delta^T;
//   o_t = S^T q_t
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/kernels.h"

namespace lily::cpu {

void deltanet_recurrent(const DeltaNetHeadIO& io, float* S) {
  const int dk = io.dk, dv = io.dv;
  std::vector<float> delta(dv);
  for (int t = 0; t < io.T; ++t) {
    const float* q = io.q + t * io.q_stride;
    const float* k = io.k + t * io.k_stride;
    const float* v = io.v + t * io.v_stride;
    const float decay = std::exp(io.g[t * io.gb_stride]);
    const float beta = io.beta[t * io.gb_stride];
    for (int i = 0; i < dk * dv; ++i) S[i] *= decay;
    for (int j = 0; j < dv; ++j) delta[j] = 0;
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) delta[j] += S[i * dv + j] * k[i];
    for (int j = 0; j < dv; ++j) delta[j] = (v[j] - delta[j]) * beta;
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) S[i * dv + j] += k[i] * delta[j];
    if (!io.out) continue;
    float* o = io.out + t * io.out_stride;
    for (int j = 0; j < dv; ++j) o[j] = 0;
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) o[j] += S[i * dv + j] * q[i];
  }
}

// Per chunk of L tokens with in-chunk cumulative log-decay c_i:
//   A_ij = -(beta_i k_i . k_j) exp(c_i - c_j) for j < i; T = (I - A')^-1 by
//   forward substitution (T is unit lower triangular);
//   U = T (beta v);  W = T (beta k exp(c));
//   v_new = U - W S;  o_i = exp(c_i) q_i S + sum_{j<=i} (q_i . k_j) exp(c_i - c_j) v_new_j;
//   S = exp(c_L) S + sum_j exp(c_L - c_j) k_j v_new_j^T.
void deltanet_chunked(const DeltaNetHeadIO& io, float* S, int chunk_size) {
  const int dk = io.dk, dv = io.dv;
  std::vector<float> c(chunk_size), A(chunk_size * chunk_size), U(chunk_size * dv),
      W(chunk_size * dk), KB(chunk_size * dk), WS(chunk_size * dv);
  for (int t0 = 0; t0 < io.T; t0 += chunk_size) {
    const int L = std::min(chunk_size, io.T - t0);
    auto q = [&](int i) { return io.q + (t0 + i) * io.q_stride; };
    auto k = [&](int i) { return io.k + (t0 + i) * io.k_stride; };
    auto v = [&](int i) { return io.v + (t0 + i) * io.v_stride; };
    auto beta = [&](int i) { return io.beta[(t0 + i) * io.gb_stride]; };
    float acc = 0;
    for (int i = 0; i < L; ++i) {
      acc += io.g[(t0 + i) * io.gb_stride];
      c[i] = acc;
    }
    // Strictly lower A, then the substitution row by row: rows above i are
    // already final when row i is updated.
    for (int i = 0; i < L; ++i) {
      for (int j = 0; j < L; ++j) A[i * L + j] = 0;
      for (int j = 0; j < i; ++j) {
        float d = 0;
        for (int x = 0; x < dk; ++x) d += k(i)[x] * k(j)[x];
        A[i * L + j] = -beta(i) * d * std::exp(c[i] - c[j]);
      }
    }
    for (int i = 1; i < L; ++i) {
      // new_row[j] = row[j] + sum_{j<m<i} row[m] * A[m][j], with row the
      // original row i.
      std::vector<float> row(A.begin() + i * L, A.begin() + i * L + i);
      for (int j = 0; j < i; ++j) {
        float s = row[j];
        for (int m = j + 1; m < i; ++m) s += row[m] * A[m * L + j];
        A[i * L + j] = s;
      }
    }
    // U = T (beta v), W = T (beta k exp(c)); T = A + I.
    for (int i = 0; i < L; ++i) {
      for (int x = 0; x < dk; ++x) KB[i * dk + x] = beta(i) * k(i)[x] * std::exp(c[i]);
      for (int y = 0; y < dv; ++y) U[i * dv + y] = beta(i) * v(i)[y];
      for (int x = 0; x < dk; ++x) W[i * dk + x] = KB[i * dk + x];
    }
    for (int i = L - 1; i >= 1; --i) {  // in place from the bottom: rows j < i unchanged yet
      for (int j = 0; j < i; ++j) {
        const float a = A[i * L + j];
        if (a == 0) continue;
        for (int y = 0; y < dv; ++y) U[i * dv + y] += a * beta(j) * v(j)[y];
        for (int x = 0; x < dk; ++x) W[i * dk + x] += a * KB[j * dk + x];
      }
    }
    // v_new = U - W S
    for (int i = 0; i < L; ++i) {
      for (int y = 0; y < dv; ++y) WS[i * dv + y] = 0;
      for (int x = 0; x < dk; ++x) {
        const float w = W[i * dk + x];
        for (int y = 0; y < dv; ++y) WS[i * dv + y] += w * S[x * dv + y];
      }
      for (int y = 0; y < dv; ++y) U[i * dv + y] -= WS[i * dv + y];
    }
    // Outputs.
    for (int i = 0; i < L; ++i) {
      float* o = io.out + (t0 + i) * io.out_stride;
      const float ei = std::exp(c[i]);
      for (int y = 0; y < dv; ++y) o[y] = 0;
      for (int x = 0; x < dk; ++x) {
        const float qx = q(i)[x] * ei;
        for (int y = 0; y < dv; ++y) o[y] += qx * S[x * dv + y];
      }
      for (int j = 0; j <= i; ++j) {
        float d = 0;
        for (int x = 0; x < dk; ++x) d += q(i)[x] * k(j)[x];
        d *= std::exp(c[i] - c[j]);
        for (int y = 0; y < dv; ++y) o[y] += d * U[j * dv + y];
      }
    }
    // Carry the state.
    const float eL = std::exp(c[L - 1]);
    for (int i = 0; i < dk * dv; ++i) S[i] *= eL;
    for (int j = 0; j < L; ++j) {
      const float f = std::exp(c[L - 1] - c[j]);
      for (int x = 0; x < dk; ++x) {
        const float kx = k(j)[x] * f;
        for (int y = 0; y < dv; ++y) S[x * dv + y] += kx * U[j * dv + y];
      }
    }
  }
}

namespace {

// The delta rule of every value head over T tokens of conv outputs (q, k
// normalised) with their g and beta; out null: state only.
void deltanet_heads(ThreadPool& pool, int T, int nk, int nv, int dk, int dv, const float* conv, const float* g,
                    const float* beta, float* state, float* out, bool recurrent) {
  const int C = 2 * nk * dk + nv * dv;
  const int ratio = nv / nk;
  pool.parallel_for(nv, 1, [&](size_t h0, size_t h1) {
    for (size_t h = h0; h < h1; ++h) {
      const int kh = static_cast<int>(h) / ratio;
      DeltaNetHeadIO head{&conv[kh * dk], static_cast<size_t>(C),
                          &conv[nk * dk + kh * dk], static_cast<size_t>(C),
                          &conv[2 * nk * dk + h * dv], static_cast<size_t>(C),
                          &g[h], &beta[h], static_cast<size_t>(nv),
                          out ? &out[h * dv] : nullptr, static_cast<size_t>(nv * dv),
                          T, dk, dv};
      float* S = &state[h * dk * dv];
      if (T == 1 || recurrent) deltanet_recurrent(head, S);
      else deltanet_chunked(head, S, 64);
    }
  });
}

}  // namespace

void deltanet_layer(ThreadPool& pool, const DeltaNetLayerIO& io) {
  const int T = io.T, nk = io.nk, nv = io.nv, dk = io.dk, dv = io.dv, K = io.K;
  const int C = 2 * nk * dk + nv * dv, keep = K - 1;
  std::vector<float> conv(static_cast<size_t>(T) * C), beta(static_cast<size_t>(T) * nv), g(beta.size());
  pool.parallel_for(C, 64, [&](size_t c0, size_t c1) {
    std::vector<float> window(keep + T);
    for (size_t ch = c0; ch < c1; ++ch) {
      float* st = &io.conv_state[ch * keep];
      for (int j = 0; j < keep; ++j) window[j] = st[j];
      for (int t = 0; t < T; ++t) window[keep + t] = io.qkv[static_cast<size_t>(t) * C + ch];
      const float* w = &io.conv_w[ch * K];
      for (int t = 0; t < T; ++t) {
        float s = 0;
        for (int j = 0; j < K; ++j) s += w[j] * window[t + j];
        conv[static_cast<size_t>(t) * C + ch] = silu(s);
      }
      for (int j = 0; j < keep; ++j) st[j] = window[T + j];
    }
  });
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < 2 * nk; ++h) {
      float* p = &conv[static_cast<size_t>(t) * C + h * dk];
      float ss = 0;
      for (int i = 0; i < dk; ++i) ss += p[i] * p[i];
      float inv = 1.f / std::sqrt(ss + 1e-6f);
      if (h < nk) inv *= q_scale;
      for (int i = 0; i < dk; ++i) p[i] *= inv;
    }
    for (int h = 0; h < nv; ++h) {
      const size_t i = static_cast<size_t>(t) * nv + h;
      beta[i] = sigmoid(io.b[i]);
      g[i] = -std::exp(io.a_log[h]) * softplus(io.a[i] + io.dt_bias[h]);
    }
  }
  const bool record = io.rec_qkv != nullptr;
  if (record) {
    std::copy(conv.begin(), conv.end(), io.rec_qkv);
    std::copy(g.begin(), g.end(), io.rec_g);
    std::copy(beta.begin(), beta.end(), io.rec_beta);
  }
  deltanet_heads(pool, T, nk, nv, dk, dv, conv.data(), g.data(), beta.data(), io.state, io.out, record);
}

void deltanet_replay(ThreadPool& pool, const DeltaNetReplayIO& io) {
  const int n = io.n, keep = io.K - 1;
  const int C = 2 * io.nk * io.dk + io.nv * io.dv;
  if (n <= 0) return;
  // The carried conv inputs: the last K-1 of [carried | the n inputs].
  std::vector<float> window(static_cast<size_t>(keep + n));
  for (int ch = 0; ch < C; ++ch) {
    float* st = &io.conv_state[static_cast<size_t>(ch) * keep];
    for (int j = 0; j < keep; ++j) window[j] = st[j];
    for (int t = 0; t < n; ++t) window[keep + t] = io.qkv_in[static_cast<size_t>(t) * C + ch];
    for (int j = 0; j < keep; ++j) st[j] = window[n + j];
  }
  deltanet_heads(pool, n, io.nk, io.nv, io.dk, io.dv, io.rec_qkv, io.rec_g, io.rec_beta, io.state, nullptr,
                 true);
}

}  // namespace lily::cpu

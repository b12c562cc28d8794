// The CPU forward pass for Qwen3, Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE. One
// decoder layer is
//   x += mixer(norm(x))   mixer: gated full attention or Gated DeltaNet
//   x += ffn(norm(x))     ffn:   SwiGLU MLP or routed MoE (+ shared expert)
// f32 activations throughout; weights stay as stored (see kernels.h).
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace lily {

namespace {

using cpu::matmul;

// One attention layer's cached K or V rows, head-major: KV head h's
// position p at at(h, p) = data + (h * cap + p) * hd, so that a decode task
// (one KV head) streams its rows contiguously. Allocated uninitialised (the
// pages are committed as rows are written) with room for `cap` positions;
// grows by doubling, each head's rows moved to its new place.
struct KvRows {
  std::unique_ptr<float[]> data;
  int cap = 0, heads = 0, hd = 0;

  void init(int num_heads, int head_dim) {
    heads = num_heads;
    hd = head_dim;
  }
  // Room for `positions`, keeping the first `used`.
  void ensure(int positions, int used) {
    if (positions <= cap) return;
    const int grown = std::max(positions, 2 * cap);
    std::unique_ptr<float[]> d(new float[size_t(heads) * grown * hd]);
    for (int h = 0; h < heads; ++h) std::copy_n(at(h, 0), size_t(used) * hd, d.get() + size_t(h) * grown * hd);
    data = std::move(d);
    cap = grown;
  }
  float* at(int h, int p) const { return data.get() + (size_t(h) * cap + p) * hd; }
  // Positions [0, n) of `src` (same shape) into this, growing if needed.
  void copy_from(const KvRows& src, int n) {
    ensure(n, 0);
    for (int h = 0; h < heads; ++h) std::copy_n(src.at(h, 0), size_t(n) * hd, at(h, 0));
  }
};

class CpuCache final : public SequenceCache {
 public:
  struct Layer {
    KvRows k, v;                      // attention (heads == 0 for DeltaNet layers)
    std::vector<float> state, conv;   // DeltaNet: [v_heads][dk][dv], [channels][kernel - 1]
    bool attention() const { return k.heads > 0; }
  };
  std::vector<Layer> layers;
  // A speculative run's record per DeltaNet layer (forward_draft): the
  // state before it and what deltanet_replay needs. Scratch: not cloned.
  struct DraftLayer {
    std::vector<float> state, conv;            // before the run
    std::vector<float> qkv_in, qkv, g, beta;   // per token of the run
  };
  std::vector<DraftLayer> draft;

  // Compact: KV room for the positions held, no draft record.
  std::unique_ptr<SequenceCache> clone() const override {
    auto c = std::make_unique<CpuCache>();
    c->layers.resize(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      Layer& D = c->layers[i];
      D.state = L.state;
      D.conv = L.conv;
      if (!L.attention()) continue;
      D.k.init(L.k.heads, L.k.hd);
      D.v.init(L.v.heads, L.v.hd);
      D.k.copy_from(L.k, n_past());
      D.v.copy_from(L.v, n_past());
    }
    c->set_n_past(n_past());
    return c;
  }
  // The KV rows held (not the room reserved) and the recurrent states.
  size_t bytes() const override {
    size_t n = 0;
    for (const auto& l : layers)
      n += 4 * (size_t(2) * l.k.heads * l.k.hd * n_past() + l.state.size() + l.conv.size());
    for (const auto& d : draft)
      n += 4 * (d.state.size() + d.conv.size() + d.qkv_in.size() + d.qkv.size() + d.g.size() + d.beta.size());
    return n;
  }
  void advance(int n) { n_past_ += n; }
  void set_n_past(int n) { n_past_ = n; }
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<ModelWeights> w, int threads, cpu::ActPrecision act)
      : w_(std::move(w)), c_(w_->config), pool_(threads > 0 ? threads : 0), act_(act) {}

  std::string name() const override { return "cpu"; }
  cpu::ActPrecision act() const { return act_; }
  const ModelConfig& config() const override { return c_; }

  std::unique_ptr<SequenceCache> new_cache(int max_positions) override {
    auto cache = std::make_unique<CpuCache>();
    cache->layers.resize(c_.num_layers);
    for (int i = 0; i < c_.num_layers; ++i) {
      auto& L = cache->layers[i];
      if (c_.layer_kinds[i] == LayerKind::FullAttention) {
        L.k.init(c_.num_kv_heads, c_.head_dim);
        L.v.init(c_.num_kv_heads, c_.head_dim);
        L.k.ensure(std::max(1, max_positions), 0);
        L.v.ensure(std::max(1, max_positions), 0);
      } else {
        L.state.assign(static_cast<size_t>(c_.linear_num_value_heads) * c_.linear_key_head_dim *
                           c_.linear_value_head_dim, 0.f);
        L.conv.assign(static_cast<size_t>(c_.deltanet_qkv_dim()) * (c_.linear_conv_kernel - 1), 0.f);
      }
    }
    return cache;
  }

  void copy_cache(const SequenceCache& src_base, SequenceCache& dst_base) override {
    const auto& src = dynamic_cast<const CpuCache&>(src_base);
    auto& dst = dynamic_cast<CpuCache&>(dst_base);
    if (&src == &dst) return;
    if (dst.layers.size() != src.layers.size()) fail("copy_cache: caches of different models");
    for (size_t i = 0; i < src.layers.size(); ++i) {
      // Into dst's memory where it has the room.
      if (src.layers[i].attention()) {
        dst.layers[i].k.copy_from(src.layers[i].k, src.n_past());
        dst.layers[i].v.copy_from(src.layers[i].v, src.n_past());
      }
      dst.layers[i].state.assign(src.layers[i].state.begin(), src.layers[i].state.end());
      dst.layers[i].conv.assign(src.layers[i].conv.begin(), src.layers[i].conv.end());
    }
    dst.set_n_past(src.n_past());
  }

  void truncate(SequenceCache& base, int n) override {
    auto& cache = dynamic_cast<CpuCache&>(base);
    if (n < 0 || n > cache.n_past())
      fail("truncate: position ", n, " is outside [0, ", cache.n_past(), "]");
    if (n > 0 && n == cache.n_past()) return;
    if (n > 0 && !can_truncate())
      fail("truncate: a DeltaNet state cannot be rolled back to position ", n);
    for (auto& L : cache.layers) {  // KV rows past n are simply not read again
      std::fill(L.state.begin(), L.state.end(), 0.f);
      std::fill(L.conv.begin(), L.conv.end(), 0.f);
    }
    cache.set_n_past(n);
  }

  void forward(SequenceCache& base, std::span<const int> tokens, LogitsMode mode,
               float* logits) override {
    run(dynamic_cast<CpuCache&>(base), tokens, mode, logits, false);
  }

  // A draft run as T decode steps would compute it (the DeltaNet layers
  // step by step), recording each DeltaNet layer's state before the run and
  // its per-token values; accept_draft cuts the KV rows back and replays
  // the kept tokens' state updates from the record.
  void forward_draft(SequenceCache& base, std::span<const int> tokens, float* logits) override {
    auto& cache = dynamic_cast<CpuCache&>(base);
    if (cache.draft_pending()) fail("internal: forward_draft while a draft run is not yet settled");
    cache.draft.resize(cache.layers.size());
    for (size_t i = 0; i < cache.layers.size(); ++i) {
      if (cache.layers[i].attention()) continue;
      cache.draft[i].state.assign(cache.layers[i].state.begin(), cache.layers[i].state.end());
      cache.draft[i].conv.assign(cache.layers[i].conv.begin(), cache.layers[i].conv.end());
    }
    run(cache, tokens, LogitsMode::All, logits, true);
    draft_begin(cache, static_cast<int>(tokens.size()));
  }

  void accept_draft(SequenceCache& base, int n) override {
    auto& cache = dynamic_cast<CpuCache&>(base);
    const int T = draft_end(cache, n);
    if (n == T) return;
    const int keep_positions = cache.n_past() - (T - n);
    for (size_t i = 0; i < cache.layers.size(); ++i) {
      auto& L = cache.layers[i];
      if (L.attention()) continue;  // the rows past keep_positions are overwritten later
      const auto& D = cache.draft[i];
      L.state.assign(D.state.begin(), D.state.end());
      L.conv.assign(D.conv.begin(), D.conv.end());
      cpu::deltanet_replay(pool_, {n, c_.linear_num_key_heads, c_.linear_num_value_heads, c_.linear_key_head_dim,
                                   c_.linear_value_head_dim, c_.linear_conv_kernel, D.qkv_in.data(), D.qkv.data(),
                                   D.g.data(), D.beta.data(), L.conv.data(), L.state.data()});
    }
    cache.set_n_past(keep_positions);
  }

  // A few tokens cost about one decode step here (the weights are read
  // once for up to 4 input rows).
  int max_draft_run() const override { return 8; }

 private:
  void run(CpuCache& cache, std::span<const int> tokens, LogitsMode mode, float* logits, bool draft) {
    const int T = static_cast<int>(tokens.size());
    if (T == 0) fail("forward: no tokens");
    const int H = c_.hidden_size;
    for (int t = 0; t < T; ++t)
      if (tokens[t] < 0 || tokens[t] >= c_.vocab_size)
        fail("token id ", tokens[t], " is outside the vocabulary [0, ", c_.vocab_size, ")");

    std::vector<float> x(static_cast<size_t>(T) * H), xn(x.size()), y(x.size());
    for (int t = 0; t < T; ++t) cpu::dequantize_row(w_->embed, tokens[t], &x[t * H]);

    for (int l = 0; l < c_.num_layers; ++l) {
      const LayerWeights& L = w_->layers[l];
      norm_rows(x.data(), L.input_norm.data(), T, xn.data());
      if (L.kind == LayerKind::FullAttention)
        attention_block(L.attn, cache.layers[l], cache.n_past(), xn.data(), T, y.data());
      else
        deltanet_block(L.deltanet, cache.layers[l], xn.data(), T, y.data(),
                       draft ? &cache.draft[l] : nullptr);
      for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
      norm_rows(x.data(), L.post_norm.data(), T, xn.data());
      if (L.is_moe) moe_block(L.moe, xn.data(), T, y.data());
      else mlp_block(L.mlp, xn.data(), T, y.data());
      for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    }
    cache.advance(T);

    const int first = mode == LogitsMode::All ? 0 : T - 1;
    const int rows = T - first;
    norm_rows(&x[static_cast<size_t>(first) * H], w_->final_norm.data(), rows, xn.data());
    matmul(pool_, w_->lm_head, xn.data(), rows, H, logits, c_.vocab_size, act_);
  }

  void norm_rows(const float* x, const float* w, int T, float* out) {
    const int H = c_.hidden_size;
    for (int t = 0; t < T; ++t) cpu::rms_norm(x + t * H, w, H, c_.rms_norm_eps, out + t * H);
  }

  void attention_block(const AttentionWeights& A, CpuCache::Layer& cache, int n_past,
                       const float* xn, int T, float* out) {
    const int H = c_.hidden_size, hd = c_.head_dim, nh = c_.num_heads, nkv = c_.num_kv_heads;
    const int q_head = hd * (c_.attn_output_gate ? 2 : 1);  // query (+ gate) per head
    const int q_dim = nh * q_head, kv_dim = nkv * hd;
    std::vector<float> q(static_cast<size_t>(T) * q_dim), k(static_cast<size_t>(T) * kv_dim),
        v(k.size()), o(static_cast<size_t>(T) * nh * hd);
    const cpu::MatmulJob qkv[] = {{&A.q, xn, T, size_t(H), q.data(), size_t(q_dim)},
                                  {&A.k, xn, T, size_t(H), k.data(), size_t(kv_dim)},
                                  {&A.v, xn, T, size_t(H), v.data(), size_t(kv_dim)}};
    cpu::matmul_many(pool_, qkv, act_);
    // One cos / sin table per token for all its heads (the trigonometry
    // costs more than the rotation).
    std::vector<float> rc(c_.rotary_dim / 2), rs(rc.size());
    for (int t = 0; t < T; ++t) {
      cpu::rope_table(c_.rotary_dim, n_past + t, c_.rope_theta, rc.data(), rs.data());
      for (int h = 0; h < nh; ++h) {
        float* qh = &q[t * q_dim + h * q_head];
        cpu::rms_norm(qh, A.q_norm.data(), hd, c_.rms_norm_eps, qh);
        cpu::rope_apply(qh, c_.rotary_dim, rc.data(), rs.data());
      }
      for (int h = 0; h < nkv; ++h) {
        float* kh = &k[t * kv_dim + h * hd];
        cpu::rms_norm(kh, A.k_norm.data(), hd, c_.rms_norm_eps, kh);
        cpu::rope_apply(kh, c_.rotary_dim, rc.data(), rs.data());
      }
    }
    cache.k.ensure(n_past + T, n_past);
    cache.v.ensure(n_past + T, n_past);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nkv; ++h) {
        std::copy_n(&k[t * kv_dim + h * hd], hd, cache.k.at(h, n_past + t));
        std::copy_n(&v[t * kv_dim + h * hd], hd, cache.v.at(h, n_past + t));
      }
    cpu::AttentionIO io{q.data(), static_cast<size_t>(q_dim), static_cast<size_t>(q_head),
                        cache.k.at(0, 0), cache.v.at(0, 0), size_t(cache.k.cap) * hd, size_t(hd),
                        o.data(), static_cast<size_t>(nh * hd), T, n_past, nh, nkv, hd};
    cpu::attention(pool_, io);
    if (c_.attn_output_gate) {
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < nh; ++h)
          for (int i = 0; i < hd; ++i)
            o[(t * nh + h) * hd + i] *= cpu::sigmoid(q[t * q_dim + h * q_head + hd + i]);
    }
    matmul(pool_, A.o, o.data(), T, nh * hd, out, H, act_);
  }

  void deltanet_block(const DeltaNetWeights& D, CpuCache::Layer& cache, const float* xn, int T,
                      float* out, CpuCache::DraftLayer* draft) {
    const int H = c_.hidden_size, C = c_.deltanet_qkv_dim(), K = c_.linear_conv_kernel;
    const int nk = c_.linear_num_key_heads, nv = c_.linear_num_value_heads;
    const int dk = c_.linear_key_head_dim, dv = c_.linear_value_head_dim;
    const int vdim = nv * dv;
    std::vector<float> qkv(static_cast<size_t>(T) * C), z(static_cast<size_t>(T) * vdim),
        b(static_cast<size_t>(T) * nv), a(b.size()), o(z.size());
    const cpu::MatmulJob in[] = {{&D.in_qkv, xn, T, size_t(H), qkv.data(), size_t(C)},
                                 {&D.in_z, xn, T, size_t(H), z.data(), size_t(vdim)},
                                 {&D.in_b, xn, T, size_t(H), b.data(), size_t(nv)},
                                 {&D.in_a, xn, T, size_t(H), a.data(), size_t(nv)}};
    cpu::matmul_many(pool_, in, act_);

    cpu::DeltaNetLayerIO io{T, nk, nv, dk, dv, K, qkv.data(), a.data(), b.data(), D.conv.data(),
                            D.a_log.data(), D.dt_bias.data(), cache.conv.data(), cache.state.data(),
                            o.data()};
    if (draft) {
      draft->qkv_in.assign(qkv.begin(), qkv.end());
      draft->qkv.resize(qkv.size());
      draft->g.resize(b.size());
      draft->beta.resize(b.size());
      io.rec_qkv = draft->qkv.data();
      io.rec_g = draft->g.data();
      io.rec_beta = draft->beta.data();
    }
    cpu::deltanet_layer(pool_, io);

    // Gated RMSNorm per head: norm(o) * w * silu(z).
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nv; ++h) {
        float* oh = &o[t * vdim + h * dv];
        const float* zh = &z[t * vdim + h * dv];
        cpu::rms_norm(oh, D.norm.data(), dv, c_.rms_norm_eps, oh);
        for (int i = 0; i < dv; ++i) oh[i] *= cpu::silu(zh[i]);
      }
    matmul(pool_, D.out, o.data(), T, vdim, out, H, act_);
  }

  // down(silu(gate(x)) * up(x)) for T rows.
  void swiglu(const MlpWeights& m, const float* x, int T, float* out) {
    const MlpWeights* mlp[] = {&m};
    const float* xs[] = {x};
    const int Ts[] = {T};
    float* outs[] = {out};
    swiglu_many(mlp, xs, Ts, outs);
  }

  // Several SwiGLU MLPs (the routed experts of a layer, the shared one) with
  // their gate and up projections in one parallel loop and their down
  // projections in another; mlp i maps Ts[i] rows of xs[i] to outs[i].
  void swiglu_many(std::span<const MlpWeights* const> mlp, std::span<const float* const> xs,
                   std::span<const int> Ts, std::span<float* const> outs) {
    const int H = c_.hidden_size;
    const size_t n = mlp.size();
    std::vector<std::vector<float>> g(n), u(n);
    std::vector<cpu::MatmulJob> jobs;
    jobs.reserve(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const int I = mlp[i]->gate.rows;
      g[i].resize(static_cast<size_t>(Ts[i]) * I);
      u[i].resize(g[i].size());
      jobs.push_back({&mlp[i]->gate, xs[i], Ts[i], size_t(H), g[i].data(), size_t(I)});
      jobs.push_back({&mlp[i]->up, xs[i], Ts[i], size_t(H), u[i].data(), size_t(I)});
    }
    cpu::matmul_many(pool_, jobs, act_);
    jobs.clear();
    for (size_t i = 0; i < n; ++i) {
      for (size_t k = 0; k < g[i].size(); ++k) g[i][k] = cpu::silu(g[i][k]) * u[i][k];
      jobs.push_back({&mlp[i]->down, g[i].data(), Ts[i], size_t(mlp[i]->gate.rows), outs[i], size_t(H)});
    }
    cpu::matmul_many(pool_, jobs, act_);
  }

  void mlp_block(const MlpWeights& m, const float* xn, int T, float* out) { swiglu(m, xn, T, out); }

  void moe_block(const MoeWeights& M, const float* xn, int T, float* out) {
    const int H = c_.hidden_size, E = c_.num_experts, k = c_.num_experts_per_tok;
    std::vector<float> logits(static_cast<size_t>(T) * E);
    // The router (and the shared expert's gate) keep f32 inputs: tiny, and
    // the expert choice should not move with the inputs' rounding.
    matmul(pool_, M.router, xn, T, H, logits.data(), E);
    // Route: softmax over all experts, top-k, optional renormalisation.
    std::vector<std::vector<std::pair<int, float>>> by_expert(E);  // (token, weight)
    std::vector<int> idx(E);
    for (int t = 0; t < T; ++t) {
      float* p = &logits[t * E];
      const float mx = *std::max_element(p, p + E);
      float sum = 0;
      for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
      for (int e = 0; e < E; ++e) p[e] /= sum;
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      float top = 0;
      for (int j = 0; j < k; ++j) top += p[idx[j]];
      for (int j = 0; j < k; ++j)
        by_expert[idx[j]].push_back({t, c_.norm_topk_prob ? p[idx[j]] / top : p[idx[j]]});
    }
    // Every expert with tokens (in expert order) and the shared expert, as
    // one batch of MLPs; the shared expert's gate logit with them.
    std::vector<const MlpWeights*> mlp;
    std::vector<int> experts, Ts;
    std::vector<std::vector<float>> xe, ye;
    std::vector<const float*> xs;
    for (int e = 0; e < E; ++e) {
      const auto& routed = by_expert[e];
      if (routed.empty()) continue;
      const int n = static_cast<int>(routed.size());
      experts.push_back(e);
      mlp.push_back(&M.experts[e]);
      Ts.push_back(n);
      ye.emplace_back(static_cast<size_t>(n) * H);
      // An expert that every token chose (a decode step's experts) reads xn
      // itself: the matmuls then see one input (and quantize it once).
      if (n == T) {
        xs.push_back(xn);
        continue;
      }
      xe.emplace_back(static_cast<size_t>(n) * H);
      for (int i = 0; i < n; ++i) std::copy_n(xn + routed[i].first * H, H, &xe.back()[i * H]);
      xs.push_back(xe.back().data());
    }
    std::vector<float> gate(T);
    if (M.has_shared) {
      mlp.push_back(&M.shared);
      Ts.push_back(T);
      ye.emplace_back(static_cast<size_t>(T) * H);
      matmul(pool_, M.shared_gate, xn, T, H, gate.data(), 1);
    }
    if (M.has_shared) xs.push_back(xn);
    std::vector<float*> outs;
    for (size_t i = 0; i < mlp.size(); ++i) outs.push_back(ye[i].data());
    swiglu_many(mlp, xs, Ts, outs);
    std::fill(out, out + static_cast<size_t>(T) * H, 0.f);
    for (size_t i = 0; i < experts.size(); ++i) {
      const auto& routed = by_expert[experts[i]];
      for (size_t r = 0; r < routed.size(); ++r) {
        float* o = out + routed[r].first * H;
        const float w = routed[r].second;
        for (int j = 0; j < H; ++j) o[j] += w * ye[i][r * H + j];
      }
    }
    if (M.has_shared) {
      const std::vector<float>& ys = ye.back();
      for (int t = 0; t < T; ++t) {
        const float s = cpu::sigmoid(gate[t]);
        for (int j = 0; j < H; ++j) out[t * H + j] += s * ys[t * H + j];
      }
    }
  }

  std::unique_ptr<ModelWeights> w_;
  const ModelConfig& c_;
  ThreadPool pool_;
  cpu::ActPrecision act_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(std::unique_ptr<ModelWeights> weights, int threads,
                                          const std::string& act) {
  cpu::ActPrecision a = cpu::ActPrecision::F32;
  if (act == "q8" || act == "q16") {
    if (!cpu::integer_inputs_supported())
      fail("--cpu-act ", act, ": needs AVX2 or AVX-512 VNNI, which this CPU lacks (or LILY_CPU_SIMD caps the kernels)");
    a = act == "q8" ? cpu::ActPrecision::Q8 : cpu::ActPrecision::Q16;
  } else if (act.empty() || act == "auto") {
    a = cpu::integer_inputs_supported() ? cpu::ActPrecision::Q16 : cpu::ActPrecision::F32;
  } else if (act != "f32") {
    fail("--cpu-act '", act, "': expected auto, f32, q16 or q8");
  }
  return std::make_unique<CpuBackend>(std::move(weights), threads, a);
}

}  // namespace lily

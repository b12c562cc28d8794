// The CUDA decode forward pass. One decoder layer is
//   x += mixer(norm(x))   Gated DeltaNet: in_proj | deltanet_step | out_proj
//                         full attention: qkv_proj | attention | combine | o_proj
//   x += ffn(norm(x))     MoE: router (+top-k) | gate_up (+SiLU) | down (+sum)
//                         dense: gate_up (+SiLU) | down
// every norm fused into the matvec that reads it, every residual add into the
// matvec that writes it. A step is a fixed list of launches ("Step"s) that
// read the position and token from the cache's control block, captured once
// per cache into a CUDA graph.
#ifdef LILY_HAVE_CUDA

#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weights_upload.h"
#include "core/error.h"

namespace lily {

bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

namespace cuda {

CudaOptions options_from_env() {
  CudaOptions o;
  if (const char* kv = std::getenv("LILY_CUDA_KV")) {
    const std::string s = kv;
    if (s == "f32") o.kv_bf16 = false;
    else if (s == "bf16") o.kv_bf16 = true;
    else fail("LILY_CUDA_KV='", s, "': expected f32 or bf16");
  }
  if (const char* v = std::getenv("LILY_CUDA_PDL")) o.pdl = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_GRAPHS")) o.graphs = std::string(v) != "0";
  return o;
}

namespace {

struct LayerDev {
  LayerKind kind = LayerKind::FullAttention;
  bool is_moe = false;
  DeviceBuffer input_norm, post_norm;
  DevMat q, k, v, o;
  DeviceBuffer q_norm, k_norm;
  DevMat in_qkv, in_z, in_b, in_a, out;
  DeviceBuffer conv_w, a_log, dt_bias, dn_norm;
  DevMat mlp_gate_up, mlp_down;
  DevMat router, shared_gate, experts_gate_up, experts_down, shared_gate_up, shared_down;
  bool has_shared = false;
};

DeviceBuffer upload_vec(const std::vector<float>& v) {
  DeviceBuffer b;
  upload(b, v.data(), v.size());
  return b;
}

class GraphExec {
 public:
  GraphExec() = default;
  ~GraphExec() { reset(); }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  void reset() {
    if (exec_) cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
  }
  void set(cudaGraphExec_t e) {
    reset();
    exec_ = e;
  }
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// One launch of a decode step, with the bytes it must move at least.
struct Step {
  std::string name;
  double bytes_fixed = 0;
  double bytes_per_ctx = 0;  // attention: KV bytes per context position
  std::function<void(cudaStream_t, bool)> run;
};

}  // namespace

class CudaCache final : public SequenceCache {
 public:
  int capacity = 0;
  bool kv_bf16 = true;
  std::vector<DeviceBuffer> k, v, state, conv;  // per layer; empty where unused
  DeviceBuffer ctrl;                            // DecodeCtrl
  GraphExec graph;
  bool graph_pdl = false;
  std::vector<int> layer_kv_heads;  // per layer: KV heads x head_dim (0 for DeltaNet)

  DecodeCtrl* dctrl() const { return ctrl.as<DecodeCtrl>(); }
  void set_n_past(int n) { n_past_ = n; }
  void advance(int n) { n_past_ += n; }

  std::unique_ptr<SequenceCache> clone() const override {
    LILY_CUDA(cudaDeviceSynchronize());
    auto c = std::make_unique<CudaCache>();
    c->capacity = capacity;
    c->kv_bf16 = kv_bf16;
    c->layer_kv_heads = layer_kv_heads;
    auto copy = [](const std::vector<DeviceBuffer>& src, std::vector<DeviceBuffer>& dst) {
      dst.resize(src.size());
      for (size_t i = 0; i < src.size(); ++i) {
        if (!src[i]) continue;
        dst[i].alloc(src[i].bytes());
        LILY_CUDA(cudaMemcpy(dst[i].get(), src[i].get(), src[i].bytes(), cudaMemcpyDeviceToDevice));
      }
    };
    copy(k, c->k);
    copy(v, c->v);
    copy(state, c->state);
    copy(conv, c->conv);
    c->ctrl.alloc(ctrl.bytes());
    LILY_CUDA(cudaMemcpy(c->ctrl.get(), ctrl.get(), ctrl.bytes(), cudaMemcpyDeviceToDevice));
    c->n_past_ = n_past_;
    return c;
  }
  size_t bytes() const override {
    size_t n = ctrl.bytes();
    for (const auto* vec : {&k, &v, &state, &conv})
      for (const auto& b : *vec) n += b.bytes();
    return n;
  }
};

struct CudaBackend::Impl {
  ModelConfig c;
  CudaOptions opt;
  cudaStream_t stream = nullptr;
  std::vector<LayerDev> layers;
  DevMat embed, lm_head_own;
  const DevMat* lm_head = nullptr;
  DeviceBuffer final_norm, inv_freq;
  // Workspace shared by all caches (one step runs at a time).
  DeviceBuffer x, proj, dn_out, attn_out, rlog, sel_idx, sel_w, moe_h, mlp_h, logits, part_o,
      part_ml, counters;
  int num_counters = 0;
  PinnedBuffer pinned;
  size_t weight_bytes = 0;

  ~Impl() {
    if (stream) cudaStreamDestroy(stream);
  }

  // ---------------------------------------------------------------- upload --
  void upload_weights(ModelWeights& w) {
    uint64_t seed = opt.seed * 1000003u;
    auto next_seed = [&] { return ++seed; };
    auto mat = [&](const Matrix& m) {
      DevMat d = upload_matrix(m, next_seed());
      weight_bytes += d.v.bytes();
      return d;
    };
    auto interleaved = [&](const Matrix& a, const Matrix& b) {
      DevMat d = upload_interleaved(a, b, next_seed());
      weight_bytes += d.v.bytes();
      return d;
    };
    const bool tied = w.lm_head.data == w.embed.data && w.embed.data != nullptr;
    embed = mat(w.embed);
    if (c.tie_word_embeddings || tied) {
      lm_head = &embed;
    } else {
      lm_head_own = mat(w.lm_head);
      lm_head = &lm_head_own;
    }
    final_norm = upload_vec(w.final_norm);
    layers.resize(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerWeights& L = w.layers[l];
      LayerDev& D = layers[l];
      D.kind = L.kind;
      D.is_moe = L.is_moe;
      D.input_norm = upload_vec(L.input_norm);
      D.post_norm = upload_vec(L.post_norm);
      if (L.kind == LayerKind::FullAttention) {
        D.q = mat(L.attn.q);
        D.k = mat(L.attn.k);
        D.v = mat(L.attn.v);
        D.o = mat(L.attn.o);
        D.q_norm = upload_vec(L.attn.q_norm);
        D.k_norm = upload_vec(L.attn.k_norm);
      } else {
        const DeltaNetWeights& N = L.deltanet;
        D.in_qkv = mat(N.in_qkv);
        D.in_z = mat(N.in_z);
        D.in_b = mat(N.in_b);
        D.in_a = mat(N.in_a);
        D.out = mat(N.out);
        D.conv_w = upload_vec(N.conv);
        D.a_log = upload_vec(N.a_log);
        D.dt_bias = upload_vec(N.dt_bias);
        D.dn_norm = upload_vec(N.norm);
      }
      if (!L.is_moe) {
        D.mlp_gate_up = interleaved(L.mlp.gate, L.mlp.up);
        D.mlp_down = mat(L.mlp.down);
      } else {
        const MoeWeights& M = L.moe;
        D.router = mat(M.router);
        const int E = static_cast<int>(M.experts.size());
        const int I = M.experts[0].gate.rows;
        MatPacker gu(M.experts[0].gate, 2 * I * E), dn(M.experts[0].down, c.hidden_size * E);
        for (int e = 0; e < E; ++e) {
          gu.add_interleaved(M.experts[e].gate, M.experts[e].up);
          dn.add_all(M.experts[e].down);
        }
        D.experts_gate_up = gu.finish(next_seed());
        D.experts_down = dn.finish(next_seed());
        weight_bytes += D.experts_gate_up.v.bytes() + D.experts_down.v.bytes();
        if (M.has_shared) {
          D.has_shared = true;
          D.shared_gate_up = interleaved(M.shared.gate, M.shared.up);
          D.shared_down = mat(M.shared.down);
          D.shared_gate = mat(M.shared_gate);
        }
      }
    }
    LILY_CUDA(cudaDeviceSynchronize());
  }

  void alloc_workspace() {
    const int H = c.hidden_size;
    const int qdim = c.num_heads * c.head_dim * (c.attn_output_gate ? 2 : 1);
    const int kvdim = c.num_kv_heads * c.head_dim;
    size_t proj_n = size_t(qdim) + 2 * kvdim;
    if (c.is_hybrid())
      proj_n = std::max(proj_n, size_t(c.deltanet_qkv_dim()) + c.deltanet_value_dim() +
                                    2 * size_t(c.linear_num_value_heads));
    auto fbuf = [](DeviceBuffer& b, size_t n) {
      b.alloc(std::max<size_t>(n, 1) * 4);
      LILY_CUDA(cudaMemset(b.get(), 0, b.bytes()));
    };
    fbuf(x, H);
    fbuf(proj, proj_n);
    fbuf(dn_out, c.is_hybrid() ? c.deltanet_value_dim() : 1);
    fbuf(attn_out, size_t(c.num_heads) * c.head_dim);
    const int E = std::max(c.num_experts, 1), k = std::max(c.num_experts_per_tok, 1);
    fbuf(rlog, E + 1);
    fbuf(sel_idx, k);
    fbuf(sel_w, k + 1);
    fbuf(moe_h, size_t(k) * std::max(c.moe_intermediate_size, 1) +
                    std::max(c.shared_expert_intermediate_size, 1));
    fbuf(mlp_h, std::max(c.intermediate_size, 1));
    fbuf(logits, c.vocab_size);
    fbuf(part_o, size_t(c.num_heads) * opt.max_splits * c.head_dim);
    fbuf(part_ml, size_t(c.num_heads) * opt.max_splits * 2);
    num_counters = 2 * c.num_layers + 8;
    fbuf(counters, num_counters);
    std::vector<float> f(c.rotary_dim / 2);
    for (int i = 0; i < c.rotary_dim / 2; ++i)
      f[i] = static_cast<float>(1.0 / std::pow(static_cast<double>(c.rope_theta),
                                               (2.0 * i) / c.rotary_dim));
    inv_freq = upload_vec(f);
  }

  // ----------------------------------------------------------------- cache --
  void alloc_cache_buffers(CudaCache& cache, int capacity) {
    cache.capacity = capacity;
    cache.kv_bf16 = opt.kv_bf16;
    cache.k.resize(c.num_layers);
    cache.v.resize(c.num_layers);
    cache.state.resize(c.num_layers);
    cache.conv.resize(c.num_layers);
    cache.layer_kv_heads.assign(c.num_layers, 0);
    const size_t es = opt.kv_bf16 ? 2 : 4;
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.layer_kinds[l] == LayerKind::FullAttention) {
        const size_t n = size_t(c.num_kv_heads) * capacity * c.head_dim * es;
        cache.k[l].alloc(n);
        cache.v[l].alloc(n);
        LILY_CUDA(cudaMemset(cache.k[l].get(), 0, n));
        LILY_CUDA(cudaMemset(cache.v[l].get(), 0, n));
        cache.layer_kv_heads[l] = c.num_kv_heads * c.head_dim;
      } else {
        const size_t s = size_t(c.linear_num_value_heads) * c.linear_key_head_dim *
                         c.linear_value_head_dim * 4;
        const size_t cv = size_t(c.deltanet_qkv_dim()) * c.linear_conv_kernel * 4;
        cache.state[l].alloc(s);
        cache.conv[l].alloc(cv);
        LILY_CUDA(cudaMemset(cache.state[l].get(), 0, s));
        LILY_CUDA(cudaMemset(cache.conv[l].get(), 0, cv));
      }
    }
    cache.ctrl.alloc(sizeof(DecodeCtrl));
    LILY_CUDA(cudaMemset(cache.ctrl.get(), 0, sizeof(DecodeCtrl)));
  }

  // Grows the KV capacity, keeping rows [0, n_past).
  void ensure_capacity(CudaCache& cache, int needed) {
    if (needed <= cache.capacity) return;
    const int cap = std::max(needed, cache.capacity * 2);
    const size_t es = cache.kv_bf16 ? 2 : 4;
    LILY_CUDA(cudaStreamSynchronize(stream));
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.layer_kinds[l] != LayerKind::FullAttention) continue;
      const size_t row = size_t(c.head_dim) * es;
      for (DeviceBuffer* b : {&cache.k[l], &cache.v[l]}) {
        DeviceBuffer nb(size_t(c.num_kv_heads) * cap * row);
        LILY_CUDA(cudaMemset(nb.get(), 0, nb.bytes()));
        if (cache.n_past() > 0)
          LILY_CUDA(cudaMemcpy2D(nb.get(), cap * row, b->get(), cache.capacity * row,
                                 size_t(cache.n_past()) * row, c.num_kv_heads,
                                 cudaMemcpyDeviceToDevice));
        *b = std::move(nb);
      }
    }
    cache.capacity = cap;
    cache.graph.reset();
  }

  // ----------------------------------------------------------------- steps --
  struct JobSpec {
    const DevMat* m;
    float* out;
    const int* expert = nullptr;
    int experts = 0;  // > 0: m is a stack of this many experts
  };

  static bool same_layout(const DevMatView& a, const DevMatView& b) {
    return a.fmt == b.fmt && a.cols == b.cols && a.chunks == b.chunks && a.groups == b.groups &&
           a.chunks_per_group == b.chunks_per_group && a.sb_f16 == b.sb_f16;
  }

  // Adds matvec launches for jobs sharing one input, one launch per weight
  // layout; the finish (if any) goes with the last launch.
  void add_matvec(std::vector<Step>& steps, const std::string& name, const std::vector<JobSpec>& jobs,
                  MatvecParams proto) {
    std::vector<std::vector<JobSpec>> groups;
    for (const JobSpec& j : jobs) {
      bool placed = false;
      for (auto& g : groups)
        if (same_layout(g[0].m->v, j.m->v) && g.size() < size_t(kMaxJobs)) {
          g.push_back(j);
          placed = true;
          break;
        }
      if (!placed) groups.push_back({j});
    }
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto& g = groups[gi];
      MatvecParams p = proto;
      const DevMatView& v0 = g[0].m->v;
      p.fmt = v0.fmt;
      p.cols = v0.cols;
      p.chunks = v0.chunks;
      p.groups = v0.groups;
      p.chunks_per_group = v0.chunks_per_group;
      p.sb_f16 = v0.sb_f16;
      p.njobs = static_cast<int>(g.size());
      double bytes = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        const JobSpec& j = g[i];
        MatvecJob& J = p.jobs[i];
        J.w = j.m->v.w;
        J.sb = j.m->v.sb;
        J.out = j.out;
        if (j.experts > 0) {
          J.rows = j.m->v.rows / j.experts;
          J.expert = j.expert;
          J.w_expert_stride = static_cast<long long>(J.rows) * v0.chunks;
          J.sb_expert_stride = static_cast<long long>(J.rows) * v0.groups;
          bytes += double(j.m->v.bytes()) / j.experts;
        } else {
          J.rows = j.m->v.rows;
          bytes += double(j.m->v.bytes());
        }
      }
      bytes += double(p.cols) * 4;
      if (gi + 1 < groups.size()) {
        p.fin = Finish::None;
        p.argmax = 0;
      }
      if (p.fin != Finish::None) p.counter = next_counter();
      steps.push_back({name, bytes, 0, [p](cudaStream_t s, bool pdl) { launch_matvec(p, s, pdl); }});
    }
  }

  unsigned* next_counter() {
    if (counter_used_ >= num_counters) fail("cuda backend: out of launch counters");
    return counters.as<unsigned>() + counter_used_++;
  }
  int counter_used_ = 0;

  std::vector<Step> build_steps(CudaCache& cache) {
    counter_used_ = 0;
    std::vector<Step> steps;
    const int H = c.hidden_size;
    float* X = x.as<float>();
    float* P = proj.as<float>();
    DecodeCtrl* ctrl = cache.dctrl();
    {
      EmbedParams e;
      e.m = embed.v;
      e.ctrl = ctrl;
      e.x = X;
      steps.push_back({"embed", double(embed.v.bytes()) / embed.v.rows + H * 4.0, 0,
                       [e](cudaStream_t s, bool pdl) { launch_embed(e, s, pdl); }});
    }
    MatvecParams norm_in;
    norm_in.x = X;
    norm_in.pro = Prologue::Norm;
    norm_in.seg = H;
    norm_in.eps = c.rms_norm_eps;
    norm_in.epi = Epilogue::Store;

    for (int l = 0; l < c.num_layers; ++l) {
      LayerDev& L = layers[l];
      MatvecParams in = norm_in;
      in.norm_w = L.input_norm.as<float>();
      if (L.kind == LayerKind::DeltaNet) {
        const int C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim(), nv = c.linear_num_value_heads;
        add_matvec(steps, "deltanet.in_proj",
                   {{&L.in_qkv, P}, {&L.in_z, P + C}, {&L.in_b, P + C + V}, {&L.in_a, P + C + V + nv}}, in);
        DeltaNetParams d;
        d.proj = P;
        d.conv_ring = cache.conv[l].as<float>();
        d.conv_w = L.conv_w.as<float>();
        d.state = cache.state[l].as<float>();
        d.a_log = L.a_log.as<float>();
        d.dt_bias = L.dt_bias.as<float>();
        d.out = dn_out.as<float>();
        d.ctrl = ctrl;
        d.nk = c.linear_num_key_heads;
        d.nv = nv;
        d.dk = c.linear_key_head_dim;
        d.dv = c.linear_value_head_dim;
        d.K = c.linear_conv_kernel;
        const double state_bytes = 2.0 * cache.state[l].bytes() + cache.conv[l].bytes() * 1.0;
        steps.push_back({"deltanet.step", state_bytes, 0,
                         [d](cudaStream_t s, bool pdl) { launch_deltanet_step(d, s, pdl); }});
        MatvecParams o;
        o.x = dn_out.as<float>();
        o.pro = Prologue::GatedNorm;
        o.norm_w = L.dn_norm.as<float>();
        o.seg = c.linear_value_head_dim;
        o.gate_z = P + C;
        o.eps = c.rms_norm_eps;
        o.epi = Epilogue::Add;
        add_matvec(steps, "deltanet.out_proj", {{&L.out, X}}, o);
      } else {
        const int qdim = c.num_heads * c.head_dim * (c.attn_output_gate ? 2 : 1);
        const int kvdim = c.num_kv_heads * c.head_dim;
        add_matvec(steps, "attn.qkv_proj", {{&L.q, P}, {&L.k, P + qdim}, {&L.v, P + qdim + kvdim}}, in);
        AttentionParams a;
        a.qkv = P;
        a.q_norm = L.q_norm.as<float>();
        a.k_norm = L.k_norm.as<float>();
        a.eps = c.rms_norm_eps;
        a.inv_freq = inv_freq.as<float>();
        a.rotary_dim = c.rotary_dim;
        a.k_cache = cache.k[l].get();
        a.v_cache = cache.v[l].get();
        a.kv_bf16 = cache.kv_bf16 ? 1 : 0;
        a.capacity = cache.capacity;
        a.part_o = part_o.as<float>();
        a.part_ml = part_ml.as<float>();
        a.max_splits = opt.max_splits;
        a.ctrl = ctrl;
        a.nh = c.num_heads;
        a.nkv = c.num_kv_heads;
        a.hd = c.head_dim;
        a.q_head_stride = c.head_dim * (c.attn_output_gate ? 2 : 1);
        a.gated = c.attn_output_gate ? 1 : 0;
        a.out = attn_out.as<float>();
        const double kv_per_pos = 2.0 * kvdim * (cache.kv_bf16 ? 2 : 4);
        steps.push_back({"attn.attention", 0, kv_per_pos,
                         [a](cudaStream_t s, bool pdl) { launch_attention(a, s, pdl); }});
        steps.push_back({"attn.combine", 0, 0,
                         [a](cudaStream_t s, bool pdl) { launch_attention_combine(a, s, pdl); }});
        MatvecParams o;
        o.x = attn_out.as<float>();
        o.epi = Epilogue::Add;
        add_matvec(steps, "attn.o_proj", {{&L.o, X}}, o);
      }

      MatvecParams post = norm_in;
      post.norm_w = L.post_norm.as<float>();
      if (!L.is_moe) {
        MatvecParams gu = post;
        gu.epi = Epilogue::SwiGLU;
        add_matvec(steps, "mlp.gate_up", {{&L.mlp_gate_up, mlp_h.as<float>()}}, gu);
        MatvecParams dn;
        dn.x = mlp_h.as<float>();
        dn.epi = Epilogue::Add;
        add_matvec(steps, "mlp.down", {{&L.mlp_down, X}}, dn);
        continue;
      }
      const int E = c.num_experts, k = c.num_experts_per_tok, I = c.moe_intermediate_size;
      float* R = rlog.as<float>();
      int* sidx = sel_idx.as<int>();
      float* sw = sel_w.as<float>();
      float* Hb = moe_h.as<float>();
      MatvecParams rp = post;
      rp.fin = Finish::RouterTopK;
      rp.router.logits = R;
      rp.router.experts = E;
      rp.router.k = k;
      rp.router.norm_topk = c.norm_topk_prob ? 1 : 0;
      rp.router.shared_gate_logit = L.has_shared ? R + E : nullptr;
      rp.router.sel_idx = sidx;
      rp.router.sel_w = sw;
      std::vector<JobSpec> rj = {{&L.router, R}};
      if (L.has_shared) rj.push_back({&L.shared_gate, R + E});
      add_matvec(steps, "moe.router", rj, rp);

      MatvecParams gu = post;
      gu.epi = Epilogue::SwiGLU;
      std::vector<JobSpec> gj;
      for (int j = 0; j < k; ++j) gj.push_back({&L.experts_gate_up, Hb + size_t(j) * I, sidx + j, E});
      if (L.has_shared) gj.push_back({&L.shared_gate_up, Hb + size_t(k) * I});
      add_matvec(steps, "moe.gate_up", gj, gu);

      // Down projections, summed with their weights into x.
      std::vector<std::pair<const DevMat*, MoeDownJob>> dj;
      for (int j = 0; j < k; ++j) {
        MoeDownJob J;
        J.w = L.experts_down.v.w;
        J.sb = L.experts_down.v.sb;
        J.expert = sidx + j;
        J.w_expert_stride = static_cast<long long>(H) * L.experts_down.v.chunks;
        J.sb_expert_stride = static_cast<long long>(H) * L.experts_down.v.groups;
        J.x = Hb + size_t(j) * I;
        J.coef = sw + j;
        dj.push_back({&L.experts_down, J});
      }
      if (L.has_shared) {
        MoeDownJob J;
        J.w = L.shared_down.v.w;
        J.sb = L.shared_down.v.sb;
        J.x = Hb + size_t(k) * I;
        J.coef = sw + k;
        dj.push_back({&L.shared_down, J});
      }
      std::vector<std::vector<std::pair<const DevMat*, MoeDownJob>>> dgroups;
      for (auto& j : dj) {
        bool placed = false;
        for (auto& g : dgroups)
          if (same_layout(g[0].first->v, j.first->v) && g.size() < size_t(kMaxJobs)) {
            g.push_back(j);
            placed = true;
            break;
          }
        if (!placed) dgroups.push_back({j});
      }
      for (auto& g : dgroups) {
        MoeDownParams p;
        const DevMatView& v0 = g[0].first->v;
        p.fmt = v0.fmt;
        p.cols = v0.cols;
        p.chunks = v0.chunks;
        p.groups = v0.groups;
        p.chunks_per_group = v0.chunks_per_group;
        p.sb_f16 = v0.sb_f16;
        p.rows = H;
        p.njobs = static_cast<int>(g.size());
        p.out = X;
        double bytes = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          p.jobs[i] = g[i].second;
          bytes += g[i].second.expert ? double(g[i].first->v.bytes()) / E : double(g[i].first->v.bytes());
        }
        steps.push_back({"moe.down", bytes, 0, [p](cudaStream_t s, bool pdl) { launch_moe_down(p, s, pdl); }});
      }
    }
    MatvecParams lm = norm_in;
    lm.norm_w = final_norm.as<float>();
    lm.argmax = 1;
    lm.fin = Finish::LmHead;
    lm.ctrl = ctrl;
    add_matvec(steps, "lm_head", {{lm_head, logits.as<float>()}}, lm);
    return steps;
  }

  void ensure_graph(CudaCache& cache) {
    if (!opt.graphs || cache.graph.get()) return;
    std::vector<Step> steps = build_steps(cache);
    for (bool pdl : {opt.pdl, false}) {
      cudaGraph_t g = nullptr;
      LILY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      bool ok = true;
      std::string why;
      try {
        for (const Step& s : steps) s.run(stream, pdl);
      } catch (const Error& e) {
        ok = false;
        why = e.what();
      }
      const cudaError_t end = cudaStreamEndCapture(stream, &g);
      cudaGetLastError();
      cudaGraphExec_t exec = nullptr;
      if (ok && end == cudaSuccess && g) ok = cudaGraphInstantiate(&exec, g, 0) == cudaSuccess;
      else ok = false;
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      if (ok) {
        cache.graph.set(exec);
        cache.graph_pdl = pdl;
        return;
      }
      if (!pdl) fail("cuda backend: could not capture the decode step in a graph", why.empty() ? "" : ": ", why);
    }
  }

  void run_step(CudaCache& cache) {
    if (opt.graphs) {
      LILY_CUDA(cudaGraphLaunch(cache.graph.get(), stream));
    } else {
      for (const Step& s : build_steps(cache)) s.run(stream, opt.pdl);
    }
  }
};

CudaBackend::CudaBackend(std::unique_ptr<ModelWeights> weights, const CudaOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (!cuda_device_available()) fail("cuda backend: no CUDA device is available");
  Impl& m = *impl_;
  m.c = weights->config;
  m.opt = options;
  if (m.opt.max_splits < 1 || m.opt.max_splits > 1024) fail("cuda backend: max_splits must be in [1, 1024]");
  const ModelConfig& c = m.c;
  if (c.num_experts_per_tok + 1 > kMaxJobs)
    fail("cuda backend: top-", c.num_experts_per_tok, " routing is not supported (at most ", kMaxJobs - 1, ")");
  LILY_CUDA(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  m.upload_weights(*weights);
  m.alloc_workspace();
  weights.reset();  // the device holds everything now
}

CudaBackend::~CudaBackend() = default;

const ModelConfig& CudaBackend::config() const { return impl_->c; }

std::unique_ptr<SequenceCache> CudaBackend::new_cache(int max_positions) {
  auto cache = std::make_unique<CudaCache>();
  impl_->alloc_cache_buffers(*cache, std::max(max_positions, 16));
  return cache;
}

void CudaBackend::forward(SequenceCache& base, std::span<const int> tokens, LogitsMode mode,
                          float* logits) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  const int T = static_cast<int>(tokens.size());
  if (T == 0) fail("forward: no tokens");
  const int V = m.c.vocab_size;
  for (int t : tokens)
    if (t < 0 || t >= V) fail("token id ", t, " is outside the vocabulary [0, ", V, ")");
  LILY_CUDA(cudaStreamSynchronize(m.stream));  // earlier copies may still read the pinned staging
  m.ensure_capacity(cache, cache.n_past() + T);
  m.ensure_graph(cache);
  m.pinned.ensure(size_t(T) * sizeof(int) + 16);
  int* host_tokens = m.pinned.as<int>();
  std::memcpy(host_tokens, tokens.data(), size_t(T) * sizeof(int));
  DecodeCtrl* ctrl = cache.dctrl();
  LILY_CUDA(cudaMemsetAsync(&ctrl->use_argmax, 0, sizeof(int), m.stream));
  for (int t = 0; t < T; ++t) {
    LILY_CUDA(cudaMemcpyAsync(&ctrl->token, host_tokens + t, sizeof(int), cudaMemcpyHostToDevice, m.stream));
    m.run_step(cache);
    if (mode == LogitsMode::All || t == T - 1) {
      const size_t row = mode == LogitsMode::All ? size_t(t) : 0;
      LILY_CUDA(cudaMemcpyAsync(logits + row * V, m.logits.get(), size_t(V) * 4, cudaMemcpyDeviceToHost,
                                m.stream));
    }
  }
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  cache.advance(T);
}

void CudaBackend::bench_fill(SequenceCache& base, int ctx, uint64_t seed) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  m.ensure_capacity(cache, ctx + 1);
  const ModelConfig& c = m.c;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_kinds[l] == LayerKind::FullAttention) {
      for (DeviceBuffer* b : {&cache.k[l], &cache.v[l]}) {
        if (cache.kv_bf16) fill_random_bf16(b->as<uint16_t>(), b->bytes() / 2, -1.f, 1.f, ++seed, m.stream);
        else fill_random_f32(b->as<float>(), b->bytes() / 4, -1.f, 1.f, ++seed, m.stream);
      }
    } else {
      fill_random_f32(cache.state[l].as<float>(), cache.state[l].bytes() / 4, -0.05f, 0.05f, ++seed, m.stream);
      fill_random_f32(cache.conv[l].as<float>(), cache.conv[l].bytes() / 4, -1.f, 1.f, ++seed, m.stream);
    }
  }
  DecodeCtrl h = {};
  h.pos = ctx;
  LILY_CUDA(cudaMemcpyAsync(cache.dctrl(), &h, sizeof h, cudaMemcpyHostToDevice, m.stream));
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  cache.set_n_past(ctx);
}

void CudaBackend::decode_steps(SequenceCache& base, int n, int first_token) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  if (n <= 0) return;
  m.ensure_capacity(cache, cache.n_past() + n);
  m.ensure_graph(cache);
  m.pinned.ensure(64);
  int* h = m.pinned.as<int>();
  LILY_CUDA(cudaStreamSynchronize(m.stream));  // the pinned staging may still be in use
  h[0] = first_token;  // token
  h[1] = 1;            // use_argmax
  h[2] = 0;
  h[3] = 0;
  h[4] = 0;  // argmax_key (two words)
  h[5] = 0;
  DecodeCtrl* ctrl = cache.dctrl();
  LILY_CUDA(cudaMemcpyAsync(&ctrl->token, h, 3 * sizeof(int), cudaMemcpyHostToDevice, m.stream));
  LILY_CUDA(cudaMemcpyAsync(&ctrl->argmax_key, h + 4, 8, cudaMemcpyHostToDevice, m.stream));
  for (int i = 0; i < n; ++i) m.run_step(cache);
  cache.advance(n);
}

void CudaBackend::synchronize() { LILY_CUDA(cudaStreamSynchronize(impl_->stream)); }

double CudaBackend::time_decode_ms(SequenceCache& cache, int n, int first_token) {
  Impl& m = *impl_;
  auto& cc = dynamic_cast<CudaCache&>(cache);
  m.ensure_capacity(cc, cc.n_past() + n);
  m.ensure_graph(cc);
  cudaEvent_t a, b;
  LILY_CUDA(cudaEventCreate(&a));
  LILY_CUDA(cudaEventCreate(&b));
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  decode_steps(cache, 0, first_token);
  LILY_CUDA(cudaEventRecord(a, m.stream));
  decode_steps(cache, n, first_token);
  LILY_CUDA(cudaEventRecord(b, m.stream));
  LILY_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  LILY_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

std::vector<KernelTiming> CudaBackend::profile_step(SequenceCache& base) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  m.ensure_capacity(cache, cache.n_past() + 1);
  std::vector<Step> steps = m.build_steps(cache);
  std::vector<cudaEvent_t> ev(steps.size() + 1);
  for (auto& e : ev) LILY_CUDA(cudaEventCreate(&e));
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  LILY_CUDA(cudaEventRecord(ev[0], m.stream));
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].run(m.stream, false);
    LILY_CUDA(cudaEventRecord(ev[i + 1], m.stream));
  }
  LILY_CUDA(cudaEventSynchronize(ev.back()));
  const int ctx = cache.n_past() + 1;
  std::vector<KernelTiming> out;
  std::map<std::string, size_t> at;
  for (size_t i = 0; i < steps.size(); ++i) {
    float ms = 0;
    LILY_CUDA(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    auto it = at.find(steps[i].name);
    if (it == at.end()) {
      at[steps[i].name] = out.size();
      out.push_back({steps[i].name, 0, 0, 0});
      it = at.find(steps[i].name);
    }
    KernelTiming& k = out[it->second];
    k.launches += 1;
    k.ms += ms;
    k.bytes += steps[i].bytes_fixed + steps[i].bytes_per_ctx * ctx;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cache.advance(1);
  return out;
}

namespace {

cudaGraphExec_t capture(cudaStream_t stream, const std::function<void()>& body) {
  cudaGraph_t g = nullptr;
  LILY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(stream, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  LILY_CUDA(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t exec = nullptr;
  LILY_CUDA(cudaGraphInstantiate(&exec, g, 0));
  cudaGraphDestroy(g);
  return exec;
}

double time_graph_ms(cudaStream_t stream, cudaGraphExec_t exec, int replays) {
  cudaEvent_t a, b;
  LILY_CUDA(cudaEventCreate(&a));
  LILY_CUDA(cudaEventCreate(&b));
  LILY_CUDA(cudaGraphLaunch(exec, stream));  // warm
  LILY_CUDA(cudaEventRecord(a, stream));
  for (int r = 0; r < replays; ++r) LILY_CUDA(cudaGraphLaunch(exec, stream));
  LILY_CUDA(cudaEventRecord(b, stream));
  LILY_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  LILY_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / replays;
}

}  // namespace

std::vector<KernelTiming> CudaBackend::profile_step_graphs(SequenceCache& base, int replays) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  DecodeCtrl saved;
  LILY_CUDA(cudaMemcpy(&saved, cache.dctrl(), sizeof saved, cudaMemcpyDeviceToHost));
  std::vector<Step> steps = m.build_steps(cache);
  std::vector<std::string> names;
  for (const Step& st : steps)
    if (std::find(names.begin(), names.end(), st.name) == names.end()) names.push_back(st.name);
  const int ctx = cache.n_past() + 1;
  std::vector<KernelTiming> out;
  for (const std::string& name : names) {
    KernelTiming k;
    k.name = name;
    for (const Step& st : steps)
      if (st.name == name) {
        k.launches++;
        k.bytes += st.bytes_fixed + st.bytes_per_ctx * ctx;
      }
    cudaGraphExec_t exec = capture(m.stream, [&] {
      for (const Step& st : steps)
        if (st.name == name) st.run(m.stream, m.opt.pdl);
    });
    k.ms = time_graph_ms(m.stream, exec, replays);
    cudaGraphExecDestroy(exec);
    // The lm_head advances the position: put it back.
    LILY_CUDA(cudaMemcpy(cache.dctrl(), &saved, sizeof saved, cudaMemcpyHostToDevice));
    out.push_back(k);
  }
  return out;
}

double CudaBackend::empty_graph_us(int launches, int blocks, bool pdl) {
  Impl& m = *impl_;
  cudaGraphExec_t exec = capture(m.stream, [&] {
    for (int i = 0; i < launches; ++i) launch_empty(blocks, 256, nullptr, m.stream, pdl);
  });
  const double ms = time_graph_ms(m.stream, exec, 20);
  cudaGraphExecDestroy(exec);
  return ms * 1e3 / launches;
}

bool CudaBackend::graph_uses_pdl(SequenceCache& base) {
  auto& cache = dynamic_cast<CudaCache&>(base);
  impl_->ensure_graph(cache);
  return cache.graph_pdl;
}

double CudaBackend::step_bytes(int ctx) const {
  // Build against a throwaway view of the steps: sizes only depend on the
  // model and the KV dtype.
  Impl& m = *impl_;
  CudaCache tmp;
  m.alloc_cache_buffers(tmp, 16);
  double b = 0;
  for (const Step& s : m.build_steps(tmp)) b += s.bytes_fixed + s.bytes_per_ctx * (ctx + 1);
  return b;
}

int CudaBackend::step_launches() const {
  Impl& m = *impl_;
  CudaCache tmp;
  m.alloc_cache_buffers(tmp, 16);
  return static_cast<int>(m.build_steps(tmp).size());
}

size_t CudaBackend::weight_bytes() const { return impl_->weight_bytes; }

int CudaBackend::last_token(SequenceCache& base) {
  auto& cache = dynamic_cast<CudaCache&>(base);
  synchronize();
  DecodeCtrl h;
  LILY_CUDA(cudaMemcpy(&h, cache.dctrl(), sizeof h, cudaMemcpyDeviceToHost));
  return h.argmax_key ? static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(h.argmax_key & 0xFFFFFFFFull))
                      : h.token;
}

std::unique_ptr<CudaBackend> make_cuda_backend(std::unique_ptr<ModelWeights> weights,
                                               const CudaOptions& options) {
  return std::make_unique<CudaBackend>(std::move(weights), options);
}

double measure_copy_bandwidth_gbs(size_t bytes, int iters) {
  DeviceBuffer a(bytes), b(bytes);
  LILY_CUDA(cudaMemset(a.get(), 1, bytes));
  LILY_CUDA(cudaMemset(b.get(), 2, bytes));
  cudaEvent_t e0, e1;
  LILY_CUDA(cudaEventCreate(&e0));
  LILY_CUDA(cudaEventCreate(&e1));
  LILY_CUDA(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));  // warm-up
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    LILY_CUDA(cudaEventRecord(e0));
    LILY_CUDA(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    LILY_CUDA(cudaEventRecord(e1));
    LILY_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    LILY_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  const double ms = t[t.size() / 2];
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

size_t device_memory_used() {
  size_t free_b = 0, total = 0;
  LILY_CUDA(cudaMemGetInfo(&free_b, &total));
  return total - free_b;
}

double sm_clock_mhz() { return measure_sm_clock_mhz(nullptr); }

std::string device_name() {
  int dev = 0;
  LILY_CUDA(cudaGetDevice(&dev));
  cudaDeviceProp p;
  LILY_CUDA(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

}  // namespace cuda
}  // namespace lily

#endif  // LILY_HAVE_CUDA

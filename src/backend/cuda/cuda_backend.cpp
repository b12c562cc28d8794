// The CUDA decode forward pass. One decoder layer is
//   x += mixer(norm(x))   Gated DeltaNet: in_proj | deltanet_step | out_proj
//                         full attention: qkv_proj | attention | combine | o_proj
//   x += ffn(norm(x))     MoE: router | gate_up (+softmax/top-k, SiLU) | down (+sum)
//                         dense: gate_up (+SiLU) | down
// every norm fused into the matvec that reads it, every residual add into the
// matvec that writes it. A step is a fixed list of launches ("Step"s) that
// read the position and token from the cache's control block, captured once
// per cache into a CUDA graph.
#ifdef LILY_HAVE_CUDA

#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>

#include <cuda_profiler_api.h>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/prefill.h"
#include "backend/cuda/prefill_glue.h"
#include "backend/cuda/weights_upload.h"
#include "core/error.h"

namespace lily {

std::string cuda_unavailable_reason() {
  // Asked once: the answer does not change while the process runs, and the
  // runtime's first call (driver initialisation) is slow.
  static const std::string reason = [] {
    int n = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
      cudaGetLastError();
      // (Also what a machine without any NVIDIA driver reports.)
      if (e == cudaErrorInsufficientDriver)
        return "no CUDA device is available (no NVIDIA driver, or one older than this build's CUDA " +
               std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10) + " runtime)";
      return std::string("no CUDA device is available (") + cudaGetErrorString(e) + ")";
    }
    if (n <= 0) return std::string("no CUDA device is available");
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
      cudaGetLastError();
      return std::string("the CUDA device's properties cannot be read");
    }
    if (const cudaError_t e = cuda::kernel_image_status(); e != cudaSuccess) {
      return "GPU " + std::to_string(dev) + " (" + prop.name + ", compute capability " +
             std::to_string(prop.major) + "." + std::to_string(prop.minor) +
             ") cannot run this build's kernels, which are compiled for Hopper (sm_90a, compute capability 9.0) (" +
             cudaGetErrorString(e) + ")";
    }
    return std::string();
  }();
  return reason;
}

bool cuda_device_available() { return cuda_unavailable_reason().empty(); }

bool cuda_device_present() {
  static const bool present = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    cudaGetLastError();
    return ok;
  }();
  return present;
}

namespace cuda {

int auto_moe_rows(int experts, int k) {
  if (experts <= 0 || k <= 0) return 0;
  return std::clamp(experts / (4 * k), 1, kMaxMoeRows);
}

CudaOptions options_from_env() {
  CudaOptions o;
  if (const char* kv = std::getenv("LILY_CUDA_KV")) {
    const std::string s = kv;
    if (!parse_kv_type(s, o.kv)) fail("LILY_CUDA_KV='", s, "': expected bf16, q8 or f32");
  }
  if (const char* v = std::getenv("LILY_CUDA_PDL")) o.pdl = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_ATTN_SPLITS")) o.max_splits = std::atoi(v);
  if (const char* v = std::getenv("LILY_CUDA_ATTN_MIN_SPLIT")) o.attn_min_split = std::max(32, std::atoi(v) / 32 * 32);
  if (const char* v = std::getenv("LILY_CUDA_GRAPHS")) o.graphs = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_PREFILL")) o.prefill = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_ROUTER_FOLD")) o.router_fold = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_ROWS_FOLD"))
    o.rows_fold = std::clamp(std::atoi(v), 0, 2);
  if (const char* v = std::getenv("LILY_CUDA_DN_IN")) o.dn_in_step = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_ATTN_SPLIT")) o.attn_split = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_DRAFT")) o.draft_runs = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_SKINNY")) o.skinny_rows = std::atoi(v);
  if (const char* v = std::getenv("LILY_CUDA_MOE_GROUPED")) o.moe_grouped = std::atoi(v) != 0;
  if (const char* v = std::getenv("LILY_CUDA_SHORT_PDL")) o.short_pdl = std::atoi(v) != 0;
  if (const char* v = std::getenv("LILY_CUDA_FOLD_NORMS")) o.fold_norms = std::atoi(v) != 0;
  if (const char* v = std::getenv("LILY_CUDA_MV_ROWS")) {
    o.mv_rows = std::atoi(v);
    if (o.mv_rows < 0 || o.mv_rows > kMaxMatvecRows)
      fail("LILY_CUDA_MV_ROWS='", v, "': expected 0..", kMaxMatvecRows);
  }
  if (const char* v = std::getenv("LILY_CUDA_MOE_ROWS")) {
    o.moe_rows = std::atoi(v);
    if (o.moe_rows < 0 || o.moe_rows > kMaxMoeRows) fail("LILY_CUDA_MOE_ROWS='", v, "': expected 0..", kMaxMoeRows);
  }
  if (const char* v = std::getenv("LILY_CUDA_MOE_ROW_STREAMS")) {
    o.moe_row_streams = std::atoi(v);
    if (o.moe_row_streams < 0 || o.moe_row_streams > 3) fail("LILY_CUDA_MOE_ROW_STREAMS='", v, "': expected 0..3");
  }
  if (const char* v = std::getenv("LILY_CUDA_DRAFT_GRAPH")) o.draft_graph = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_DRAFT_GRAPH_PARTS")) {
    o.draft_graph_parts = std::atoi(v);
    if (o.draft_graph_parts < 1 || o.draft_graph_parts > 64)
      fail("LILY_CUDA_DRAFT_GRAPH_PARTS='", v, "': expected 1..64 (at most one piece a layer)");
  }
  if (const char* v = std::getenv("LILY_CUDA_DRAFT_SAMPLE")) o.draft_sample = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_SAMPLE_WHOLE")) o.sample_whole = std::string(v) != "0";
  if (const char* v = std::getenv("LILY_CUDA_ACT")) {
    const std::string a = v;
    if (a == "f32") o.act_bits = 0;
    else if (a == "q8") o.act_bits = 8;
    else if (a == "q16") o.act_bits = 16;
    else fail("LILY_CUDA_ACT='", a, "': expected q16, q8 or f32");
  }
  if (const char* v = std::getenv("LILY_CUDA_PREFILL_CHUNK")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (!end || *end || n < 1 || n > (1 << 20)) fail("LILY_CUDA_PREFILL_CHUNK='", v, "': expected a token count in [1, 1048576]");
    o.prefill_chunk = static_cast<int>(n);
  }
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
  // The router folded into the out_proj / o_proj epilogue (kernels.h,
  // RouterFold); empty when the router's layout does not allow it.
  DeviceBuffer fold_q, fold_sb, fold_acc;
  RouterFold fold;
  // The fold's sums of a short run's rows, ld apart (kMaxMatvecRows rows).
  DeviceBuffer fold_rows_acc;
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
  // The launch's parameters where it is one matvec or moe_down launch (so a
  // short run's rows can go as one launch: launch_matvec_grid); else null.
  std::shared_ptr<const MatvecParams> mv = nullptr;
  std::shared_ptr<const MoeDownParams> down = nullptr;
};

// The rows s with each allow mask that waits for its allow_fill (sampling.h)
// filled: s itself where none waits, else copies in storage.
std::span<const TokenSampling> with_allow(std::span<const TokenSampling> s, std::vector<TokenSampling>& storage) {
  auto waits = [](const TokenSampling& r) { return r.allow_fill && r.allow.empty(); };
  if (std::none_of(s.begin(), s.end(), waits)) return s;
  storage.assign(s.begin(), s.end());
  for (TokenSampling& r : storage) {
    if (waits(r)) r.allow_fill(r.allow);
    r.allow_fill = nullptr;
  }
  return storage;
}

}  // namespace

class CudaCache final : public SequenceCache {
 public:
  int capacity = 0;
  KvType kv = KvType::BF16;
  int nkv = 0, hd = 0;
  // Per layer, empty where unused. k / v: rows [nkv][capacity][hd], then for
  // q8 the scales [nkv][q8_scale_stride(capacity)] f32.
  std::vector<DeviceBuffer> k, v, state, conv;
  DeviceBuffer ctrl;                            // DecodeCtrl
  GraphExec graph;
  bool graph_pdl = false;
  std::vector<int> layer_kv_heads;  // per layer: KV heads x head_dim (0 for DeltaNet)

  DecodeCtrl* dctrl() const { return ctrl.as<DecodeCtrl>(); }
  size_t row_bytes() const { return size_t(hd) * kv_elem_bytes(kv); }
  size_t rows_bytes(int cap) const { return size_t(nkv) * cap * row_bytes(); }
  size_t kv_buffer_bytes(int cap) const {
    return rows_bytes(cap) + (kv == KvType::Q8 ? size_t(nkv) * q8_scale_stride(cap) * 4 : 0);
  }
  // The q8 scales of a K or V buffer.
  float* scales(const DeviceBuffer& b) const {
    return kv == KvType::Q8 ? reinterpret_cast<float*>(static_cast<char*>(b.get()) + rows_bytes(capacity)) : nullptr;
  }
  void set_n_past(int n) { n_past_ = n; }
  void advance(int n) { n_past_ += n; }

  // A pending draft run (CudaBackend::forward_draft): its first position and
  // tokens, and per DeltaNet layer the state and conv ring before it and the
  // run's in_proj rows ([kMaxDraftRun][ld_proj] floats), allocated on the
  // first run. Not part of the sequence: clones and copies leave them out.
  struct DraftRecord {
    bool active = false;  // the pending run is this record's (else the Backend default's)
    int p0 = 0;
    std::vector<int> tokens;
    std::vector<DeviceBuffer> state, conv, proj;
  } draft;

  // Buffers of the same layout as this cache's, with room for `cap` positions
  // (KV rows zeroed: the attention reads whole tiles, masked, so rows past
  // the end must hold finite values).
  void alloc_like(const CudaCache& o, int cap, cudaStream_t s) {
    capacity = cap;
    kv = o.kv;
    nkv = o.nkv;
    hd = o.hd;
    layer_kv_heads = o.layer_kv_heads;
    k.resize(o.k.size());
    v.resize(o.v.size());
    state.resize(o.state.size());
    conv.resize(o.conv.size());
    for (size_t l = 0; l < o.k.size(); ++l) {
      for (auto [src, dst] : {std::pair{&o.k[l], &k[l]}, std::pair{&o.v[l], &v[l]}}) {
        if (!*src) continue;
        dst->alloc(kv_buffer_bytes(cap));
        LILY_CUDA(cudaMemsetAsync(dst->get(), 0, dst->bytes(), s));
      }
      if (o.state[l]) state[l].alloc(o.state[l].bytes());
      if (o.conv[l]) conv[l].alloc(o.conv[l].bytes());
    }
    ctrl.alloc(o.ctrl.bytes());
  }

  // Copies o's state into this cache (same layout, capacity >= o.n_past()):
  // KV rows [0, n_past), recurrent and conv state, the control block
  // (whose position is the next token's), all on stream `s`.
  void copy_from(const CudaCache& o, cudaStream_t s) {
    if (kv != o.kv || nkv != o.nkv || hd != o.hd || k.size() != o.k.size() || capacity < o.n_past())
      fail("cuda backend: copy between caches of different layouts");
    const int n = o.n_past();
    const size_t row = row_bytes();
    for (size_t l = 0; l < o.k.size(); ++l) {
      for (auto [src, dst] : {std::pair{&o.k[l], &k[l]}, std::pair{&o.v[l], &v[l]}}) {
        if (!*src || n == 0) continue;
        LILY_CUDA(cudaMemcpy2DAsync(dst->get(), size_t(capacity) * row, src->get(), size_t(o.capacity) * row,
                                    size_t(n) * row, nkv, cudaMemcpyDeviceToDevice, s));
        if (kv == KvType::Q8)
          LILY_CUDA(cudaMemcpy2DAsync(scales(*dst), size_t(q8_scale_stride(capacity)) * 4, o.scales(*src),
                                      size_t(q8_scale_stride(o.capacity)) * 4, size_t(n) * 4, nkv,
                                      cudaMemcpyDeviceToDevice, s));
      }
      if (o.state[l])
        LILY_CUDA(cudaMemcpyAsync(state[l].get(), o.state[l].get(), o.state[l].bytes(), cudaMemcpyDeviceToDevice, s));
      if (o.conv[l])
        LILY_CUDA(cudaMemcpyAsync(conv[l].get(), o.conv[l].get(), o.conv[l].bytes(), cudaMemcpyDeviceToDevice, s));
    }
    LILY_CUDA(cudaMemcpyAsync(ctrl.get(), o.ctrl.get(), ctrl.bytes(), cudaMemcpyDeviceToDevice, s));
    n_past_ = n;
  }

  // Compact: room for the positions it holds (at least 16); grows on demand.
  std::unique_ptr<SequenceCache> clone() const override {
    LILY_CUDA(cudaDeviceSynchronize());  // the backend's stream is done with this cache
    auto c = std::make_unique<CudaCache>();
    c->alloc_like(*this, std::max(n_past_, 16), nullptr);
    c->copy_from(*this, nullptr);
    LILY_CUDA(cudaDeviceSynchronize());
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
  // forward_sample: the adjustments' device copy, the candidates, the
  // result, and their pinned staging (adjustments up, 2 ints back).
  DeviceBuffer s_adjust, s_cand, s_out, s_lp_work, s_lp_out;
  PinnedBuffer s_pinned;
  size_t weight_bytes = 0;

  // Prefill: the prefill kernels' views of the uploaded weights (no copies).
  struct PrefillLayer {
    PrefillWeight in_qkv, in_z, in_b, in_a, out;          // Gated DeltaNet
    PrefillWeight q, k, v, o;                             // full attention
    PrefillWeight mlp_gate, mlp_up, mlp_down;             // dense MLP
    PrefillWeight router, shared_gate, sh_gate, sh_up, sh_down, ex_gate, ex_up, ex_down;  // MoE
  };
  std::vector<PrefillLayer> pl;
  PrefillWeight pw_lm;
  bool prefill_ok = false, lm_gemm_ok = false;
  std::string prefill_why;  // why runs of tokens take the decode path (empty: they don't)
  // Prefill workspace for chunks of up to p_rows tokens (grown on demand);
  // pTok holds a whole forward's token ids.
  DeviceBuffer pX, pXn, pAct, pProj, pDn, pQg, pRl, pSo, pMoeWs, pDnWs, pTok, pLogits;
  // A short run's MoE as decode MoEs (CudaOptions::moe_rows): per row, the
  // activations [k + 1][I], then the selection's ids [k] and weights [k + 1].
  DeviceBuffer pMoeRows;
  // The prefill attention's split form (few queries over a long context);
  // the f32 output rows of a run whose o_proj takes the fold (rows_out_fold).
  DeviceBuffer pAttnWs, pAttnRows;
  // The layers whose out projection took the rows' fold in the last pass
  // (CudaBackend::last_run_folds).
  CudaBackend::RunFolds run_folds;
  // q8 KV: one layer's K and V rows in bf16 for the prefill attention,
  // [K, V][nkv][pKvCap][head_dim], grown to the cache's capacity.
  DeviceBuffer pKv;
  int pKvCap = 0;
  // Quantized dense weights expanded to bf16 for chunks of >= 1024 tokens
  // (PrefillScratch): room for the largest one (a SwiGLU pair counts twice).
  DeviceBuffer pWx;
  size_t p_wx_bytes = 0;
  int p_rows = 0, auto_chunk = 0;
  size_t p_ld_act = 0, p_ld_proj = 0, p_ld_qg = 0;
  static constexpr int kLogitRows = 256;  // LogitsMode::All: rows of logits per lm_head GEMM
  // LILY_CUDA_PREFILL_MARKS=1 (benchmarks): events between the prefill's
  // stages, their times summed over the layers and printed to stderr per
  // forward (where the time of a short run goes), with the host's time to
  // enqueue the pass (a pass whose enqueue takes as long as its GPU time is
  // bound by the host's launches). LILY_CUDA_PROFILE_RUN=T: the first pass
  // of exactly T rows is bracketed by cudaProfilerStart / Stop (for
  // `ncu --profile-from-start off`: that pass's kernels alone).
  struct StageMarks {
    bool on = false;
    int profile_rows = 0;  // LILY_CUDA_PROFILE_RUN
    bool profiling = false;
    std::vector<cudaEvent_t> ev;
    std::vector<const char*> name;  // the stage that ends at ev[i]
    size_t n = 0;
    std::chrono::steady_clock::time_point host0, host1;  // the layers' enqueue
    void begin(int T) {
      if (profile_rows == T) {
        LILY_CUDA(cudaProfilerStart());
        profiling = true;
        profile_rows = 0;
      }
      if (on) host0 = std::chrono::steady_clock::now();
    }
    void enqueued() {
      if (on) host1 = std::chrono::steady_clock::now();
    }
    void mark(const char* stage, cudaStream_t s) {
      if (!on) return;
      if (n == ev.size()) {
        ev.emplace_back();
        LILY_CUDA(cudaEventCreate(&ev.back()));
        name.push_back(nullptr);
      }
      name[n] = stage;
      LILY_CUDA(cudaEventRecord(ev[n++], s));
    }
    void report(int T, cudaStream_t s) {
      if (profiling) {
        LILY_CUDA(cudaStreamSynchronize(s));
        LILY_CUDA(cudaProfilerStop());
        profiling = false;
      }
      if (!on || n < 2) return;
      const double host_ms =
          std::chrono::duration<double, std::milli>(host1 - host0).count();
      LILY_CUDA(cudaStreamSynchronize(s));
      std::vector<std::pair<std::string, double>> sum;
      double total = 0;
      for (size_t i = 1; i < n; ++i) {
        float ms = 0;
        LILY_CUDA(cudaEventElapsedTime(&ms, ev[i - 1], ev[i]));
        total += ms;
        auto it = std::find_if(sum.begin(), sum.end(), [&](const auto& e) { return e.first == name[i]; });
        if (it == sum.end()) sum.emplace_back(name[i], ms);
        else it->second += ms;
      }
      std::string line = str_cat("prefill marks T=", T, ": total ", total, " ms, host enqueue of the layers ", host_ms, " ms");
      for (const auto& [k, v] : sum) line += str_cat(" | ", k, " ", v);
      std::fprintf(stderr, "%s\n", line.c_str());
      n = 0;
    }
  } marks;

  // A draft run's pass as CUDA graphs (CudaOptions::draft_graph): one
  // executable graph per run length and piece (draft_graph_parts), its
  // parameters replaced by each run's capture (cudaGraphExecUpdate), so the
  // GPU takes the pass's launches back to back instead of at the host's
  // launch rate.
  std::map<std::pair<int, int>, cudaGraphExec_t> draft_exec;
  // LILY_CUDA_DRAFT_TIMING=1: the host's time in draft_pass_graph per run
  // length (the capture, and all of it up to the last launch), printed to
  // stderr when the backend goes.
  struct DraftHost {
    int runs = 0;
    double capture_us = 0, host_us = 0;
  };
  const bool draft_timing = [] {
    const char* v = std::getenv("LILY_CUDA_DRAFT_TIMING");
    return v && std::string(v) == "1";
  }();
  std::map<int, DraftHost> draft_host;
  // The pieces a draft pass is captured in: draft_graph_parts, at most one
  // a layer.
  int draft_pieces() const { return std::clamp(opt.draft_graph_parts, 1, c.num_layers); }

  // A short run's rows 1.. of the MoE (CudaOptions::moe_row_streams): their
  // streams, the fork from the pass's stream and the joins back.
  cudaStream_t row_stream[kMaxMoeRows - 1] = {};
  cudaEvent_t row_fork = nullptr, row_join[kMaxMoeRows - 1] = {};

  ~Impl() {
    for (const auto& [T, h] : draft_host)
      std::fprintf(stderr,
                   "draft graph host time T=%d: %d runs, capture %.1f us, "
                   "to the last launch %.1f us (%d pieces)\n",
                   T, h.runs, h.capture_us / h.runs, h.host_us / h.runs, draft_pieces());
    for (auto& [t, e] : draft_exec)
      if (e) cudaGraphExecDestroy(e);
    for (cudaStream_t& r : row_stream)
      if (r) cudaStreamDestroy(r);
    for (cudaEvent_t& e : row_join)
      if (e) cudaEventDestroy(e);
    if (row_fork) cudaEventDestroy(row_fork);
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
        const DevMatView* sg = D.has_shared ? &D.shared_gate.v : nullptr;
        if (router_fold_ok(D.router.v, sg, c.hidden_size)) {
          RouterFold& f = D.fold;
          f = router_fold_shape(D.router.v, sg);
          D.fold_q.alloc(size_t(c.hidden_size) * f.ld);
          D.fold_sb.alloc(size_t(D.router.v.groups) * f.ld * 4);
          D.fold_acc.alloc(size_t(f.ld) * 8);
          LILY_CUDA(cudaMemset(D.fold_acc.get(), 0, D.fold_acc.bytes()));
          D.fold_rows_acc.alloc(size_t(kMaxMatvecRows) * f.ld * 8);
          LILY_CUDA(cudaMemset(D.fold_rows_acc.get(), 0, D.fold_rows_acc.bytes()));
          build_router_fold(D.router.v, sg, D.fold_q.as<uint32_t>(), D.fold_sb.as<uint32_t>(), nullptr);
          f.q = D.fold_q.as<uint32_t>();
          f.sb = D.fold_sb.as<uint32_t>();
          f.g = D.post_norm.as<float>();
          f.acc = D.fold_acc.as<unsigned long long>();
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
    num_counters = 4;  // launches with a last-block finish (lm_head)
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
    cache.kv = opt.kv;
    cache.nkv = c.num_kv_heads;
    cache.hd = c.head_dim;
    cache.k.resize(c.num_layers);
    cache.v.resize(c.num_layers);
    cache.state.resize(c.num_layers);
    cache.conv.resize(c.num_layers);
    cache.layer_kv_heads.assign(c.num_layers, 0);
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.layer_kinds[l] == LayerKind::FullAttention) {
        const size_t n = cache.kv_buffer_bytes(capacity);
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
    // The memsets ran on the legacy stream, which the backend's non-blocking
    // stream does not wait for.
    LILY_CUDA(cudaDeviceSynchronize());
  }

  // Grows the KV capacity, keeping rows [0, n_past).
  void ensure_capacity(CudaCache& cache, int needed) {
    if (needed <= cache.capacity) return;
    const int cap = std::max(needed, cache.capacity * 2);
    LILY_CUDA(cudaStreamSynchronize(stream));
    const size_t row = cache.row_bytes();
    const size_t s_old = size_t(q8_scale_stride(cache.capacity)) * 4, s_new = size_t(q8_scale_stride(cap)) * 4;
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.layer_kinds[l] != LayerKind::FullAttention) continue;
      for (DeviceBuffer* b : {&cache.k[l], &cache.v[l]}) {
        DeviceBuffer nb(cache.kv_buffer_bytes(cap));
        LILY_CUDA(cudaMemsetAsync(nb.get(), 0, nb.bytes(), stream));
        if (cache.n_past() > 0) {
          LILY_CUDA(cudaMemcpy2DAsync(nb.get(), cap * row, b->get(), cache.capacity * row,
                                      size_t(cache.n_past()) * row, c.num_kv_heads,
                                      cudaMemcpyDeviceToDevice, stream));
          if (cache.kv == KvType::Q8)
            LILY_CUDA(cudaMemcpy2DAsync(static_cast<char*>(nb.get()) + cache.rows_bytes(cap), s_new,
                                        cache.scales(*b), s_old, size_t(cache.n_past()) * 4, c.num_kv_heads,
                                        cudaMemcpyDeviceToDevice, stream));
        }
        LILY_CUDA(cudaStreamSynchronize(stream));  // before the old buffer is freed
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
    int slot = -1;    // >= 0: the routed expert of this selection slot (route prologue)
    int experts = 0;  // > 0: m is a stack of this many experts
  };

  // Splits items (in order) into groups of at most kMaxJobs that share one
  // weight layout: one launch per group.
  template <typename T, typename ViewOf>
  static std::vector<std::vector<T>> group_by_layout(const std::vector<T>& items, ViewOf view_of) {
    std::vector<std::vector<T>> groups;
    for (const T& item : items) {
      auto g = std::find_if(groups.begin(), groups.end(), [&](const std::vector<T>& grp) {
        return grp.size() < size_t(kMaxJobs) && same_layout(view_of(grp[0]), view_of(item));
      });
      if (g == groups.end()) groups.push_back({item});
      else g->push_back(item);
    }
    return groups;
  }

  // Adds matvec launches for jobs sharing one input, one launch per weight
  // layout; the finish (if any) goes with the last launch.
  void add_matvec(std::vector<Step>& steps, const std::string& name, const std::vector<JobSpec>& jobs,
                  MatvecParams proto) {
    const auto groups = layout_groups(jobs);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto& g = groups[gi];
      MatvecParams p = proto;
      double bytes = group_params(p, g);
      if (gi + 1 < groups.size()) {
        p.fin = Finish::None;
        p.argmax = 0;
      }
      if (p.fin != Finish::None) p.counter = next_counter();
      steps.push_back({name, bytes, 0, [p](cudaStream_t s, bool pdl) { launch_matvec(p, s, pdl); },
                       std::make_shared<const MatvecParams>(p), nullptr});
    }
  }
  // The decode step's MoE of one token (post: the RMSNorm prologue on its
  // residual row, which the down projections add to): the router matvec
  // writes the logits to R ([E], the shared expert's gate logit at R + E),
  // or, where R is null, the layer's folded router sums stand in for them;
  // gate_up routes in its prologue (softmax, top k, the selection to sidx /
  // sw: [k], sw [k + 1] with the shared gate) and writes each expert's
  // SwiGLU activations to Hb ([k + 1][I]); the down projections add their
  // weighted sum into X. grid_div: see MatvecParams::grid_div; acc (R null):
  // the folded sums to route from instead of the layer's own (a run's row).
  void add_moe(std::vector<Step>& steps, const LayerDev& L, const MatvecParams& post, float* R, int* sidx,
               float* sw, float* Hb, float* X, int grid_div = 1,
               const unsigned long long* acc = nullptr) {
    const int E = c.num_experts, k = c.num_experts_per_tok, I = c.moe_intermediate_size, H = c.hidden_size;
    if (R) {
      MatvecParams rp = post;
      rp.grid_div = grid_div;
      std::vector<JobSpec> rj = {{&L.router, R}};
      if (L.has_shared) rj.push_back({&L.shared_gate, R + E});
      add_matvec(steps, "moe.router", rj, rp);
    }
    MatvecParams gu = post;
    gu.grid_div = grid_div;
    gu.epi = Epilogue::SwiGLU;
    if (!R) {
      gu.route.acc = acc ? acc : L.fold.acc;
      gu.route.acc_shared = L.has_shared ? 1 : 0;
    } else {
      gu.route.logits = R;
      gu.route.shared_gate_logit = L.has_shared ? R + E : nullptr;
    }
    gu.route.experts = E;
    gu.route.k = k;
    gu.route.norm_topk = c.norm_topk_prob ? 1 : 0;
    gu.route.sel_idx = sidx;
    gu.route.sel_w = sw;
    std::vector<JobSpec> gj;
    for (int j = 0; j < k; ++j) gj.push_back({&L.experts_gate_up, Hb + size_t(j) * I, j, E});
    if (L.has_shared) gj.push_back({&L.shared_gate_up, Hb + size_t(k) * I});
    add_matvec(steps, "moe.gate_up", gj, gu);

    // Down projections, summed with their weights into x.
    std::vector<std::pair<const DevMat*, MoeDownJob>> dj;
    for (int j = 0; j < k; ++j) {
      MoeDownJob J;
      J.w = L.experts_down.v.w;
      J.sb = L.experts_down.v.sb;
      J.expert = sidx + j;
      J.experts = E;
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
    const auto dgroups = group_by_layout(
        dj, [](const std::pair<const DevMat*, MoeDownJob>& j) -> const DevMatView& { return j.first->v; });
    for (const auto& g : dgroups) {
      MoeDownParams p;
      set_layout(p, g[0].first->v);
      p.act_bits = opt.act_bits;
      p.rows = H;
      p.njobs = static_cast<int>(g.size());
      p.out = X;
      p.grid_div = grid_div;
      double bytes = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        p.jobs[i] = g[i].second;
        bytes += g[i].second.expert ? double(g[i].first->v.bytes()) / E : double(g[i].first->v.bytes());
      }
      steps.push_back({"moe.down", bytes, 0,
                       [p](cudaStream_t s, bool pdl) { launch_moe_down(p, s, pdl); }, nullptr,
                       std::make_shared<const MoeDownParams>(p)});
    }
  }
  // A short run's projection as the decode matvec over its T rows
  // (CudaOptions::mv_rows; MatvecParams::nrows): x's rows at ldx, each job's
  // row i at its out + i * ldo. false, with nothing launched, where the run
  // is not that short or a launch would not take the layout.
  bool matvec_rows(const std::vector<JobSpec>& jobs, const MatvecParams& proto, int T, long long ldx,
                   long long ldo, cudaStream_t s) {
    if (T < 2 || T > opt.mv_rows) return false;
    std::vector<MatvecParams> ps;
    for (const auto& g : layout_groups(jobs)) {
      MatvecParams p = proto;
      group_params(p, g);
      p.nrows = T;
      p.ldx = ldx;
      p.ldo = ldo;
      if (!matvec_rows_ok(p)) return false;
      ps.push_back(p);
    }
    for (const MatvecParams& p : ps) launch_matvec(p, s, prefill_pdl(T));
    return true;
  }
  // The RMSNorm matvec prologue (norm_w) on the residual rows: the input norm
  // of matvec_rows, the post-attention norm of moe_rows_pass (x set per row).
  MatvecParams norm_rows(const DeviceBuffer& norm_w) const {
    MatvecParams p;
    p.x = pX.as<float>();
    p.pro = Prologue::Norm;
    p.seg = c.hidden_size;
    p.eps = c.rms_norm_eps;
    p.norm_w = norm_w.as<float>();
    p.epi = Epilogue::Store;
    return p;
  }
  static std::vector<std::vector<JobSpec>> layout_groups(const std::vector<JobSpec>& jobs) {
    return group_by_layout(jobs, [](const JobSpec& j) -> const DevMatView& { return j.m->v; });
  }
  // One launch's jobs (one layout) into p; returns the bytes it reads.
  double group_params(MatvecParams& p, const std::vector<JobSpec>& g) const {
    const DevMatView& v0 = g[0].m->v;
    set_layout(p, v0);
    p.act_bits = opt.act_bits;
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
        J.slot = j.slot;
        J.w_expert_stride = static_cast<long long>(J.rows) * v0.chunks;
        J.sb_expert_stride = static_cast<long long>(J.rows) * v0.groups;
        bytes += double(j.m->v.bytes()) / j.experts;
      } else {
        J.rows = j.m->v.rows;
        bytes += double(j.m->v.bytes());
      }
    }
    bytes += double(p.cols) * 4;
    if (std::none_of(g.begin(), g.end(), [](const JobSpec& j) { return j.slot >= 0; }))
      p.route = RouteSpec{};  // no routed job in this launch
    return bytes;
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
      // The router folded into the out_proj (LILY_CUDA_ROUTER_FOLD=0: its
      // own launch, an A/B switch): the layer's first launch zeroes the
      // accumulator, the out_proj adds to it, gate_up routes from it.
      const bool fold = L.is_moe && L.fold.acc && opt.router_fold;
      const double fold_bytes = fold ? double(L.fold_q.bytes() + L.fold_sb.bytes()) : 0.0;
      MatvecParams in = norm_in;
      in.norm_w = L.input_norm.as<float>();
      if (fold) {
        in.zero_acc = L.fold.acc;
        in.zero_n = L.fold.n;
      }
      if (L.kind == LayerKind::DeltaNet) {
        const int C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim(), nv = c.linear_num_value_heads;
        const std::vector<JobSpec> in_jobs = {
            {&L.in_qkv, P}, {&L.in_z, P + C}, {&L.in_b, P + C + V}, {&L.in_a, P + C + V + nv}};
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
        // The step in the in_proj's launch where the jobs share one layout
        // and the shapes fit (launch_matvec_dn); else two launches.
        MatvecParams in_one = in;
        double in_bytes = 0;
        bool dn_in = false;
        if (const auto in_groups = layout_groups(in_jobs); opt.dn_in_step && in_groups.size() == 1) {
          in_bytes = group_params(in_one, in_groups[0]);
          dn_in = matvec_dn_ok(in_one, d);
        }
        if (dn_in) {
          steps.push_back({"deltanet.in_proj+step", in_bytes + state_bytes, 0,
                           [in_one, d](cudaStream_t s, bool pdl) { launch_matvec_dn(in_one, d, s, pdl); }});
        } else {
          add_matvec(steps, "deltanet.in_proj", in_jobs, in);
          steps.push_back({"deltanet.step", state_bytes, 0,
                           [d](cudaStream_t s, bool pdl) { launch_deltanet_step(d, s, pdl); }});
        }
        MatvecParams o;
        o.x = dn_out.as<float>();
        o.pro = Prologue::GatedNorm;
        o.norm_w = L.dn_norm.as<float>();
        o.seg = c.linear_value_head_dim;
        o.gate_z = P + C;
        o.gate_z_early = dn_in ? 0 : 1;  // z comes from the in_proj, two launches back (or the previous one)
        o.eps = c.rms_norm_eps;
        o.epi = Epilogue::Add;
        if (fold) o.fold = L.fold;
        add_matvec(steps, "deltanet.out_proj", {{&L.out, X}}, o);
        steps.back().bytes_fixed += fold_bytes;
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
        a.kv = cache.kv;
        a.capacity = cache.capacity;
        a.k_scale = cache.scales(cache.k[l]);
        a.v_scale = cache.scales(cache.v[l]);
        a.scale_stride = q8_scale_stride(cache.capacity);
        a.part_o = part_o.as<float>();
        a.part_ml = part_ml.as<float>();
        a.max_splits = opt.max_splits;
        a.min_split = opt.attn_min_split;
        a.ctrl = ctrl;
        a.nh = c.num_heads;
        a.nkv = c.num_kv_heads;
        a.hd = c.head_dim;
        a.q_head_stride = c.head_dim * (c.attn_output_gate ? 2 : 1);
        a.gated = c.attn_output_gate ? 1 : 0;
        a.out = attn_out.as<float>();
        const double kv_per_pos =
            2.0 * kvdim * kv_elem_bytes(cache.kv) + (cache.kv == KvType::Q8 ? 2.0 * c.num_kv_heads * 4 : 0.0);
        steps.push_back({"attn.attention", 0, kv_per_pos,
                         [a](cudaStream_t s, bool pdl) { launch_attention(a, s, pdl); }});
        steps.push_back({"attn.combine", 0, 0,
                         [a](cudaStream_t s, bool pdl) { launch_attention_combine(a, s, pdl); }});
        MatvecParams o;
        o.x = attn_out.as<float>();
        o.epi = Epilogue::Add;
        if (fold) o.fold = L.fold;
        add_matvec(steps, "attn.o_proj", {{&L.o, X}}, o);
        steps.back().bytes_fixed += fold_bytes;
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
      float* R = rlog.as<float>();
      int* sidx = sel_idx.as<int>();
      float* sw = sel_w.as<float>();
      float* Hb = moe_h.as<float>();
      add_moe(steps, L, post, fold ? nullptr : R, sidx, sw, Hb, X);
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

  // ---------------------------------------------------------------- prefill --
  // The prefill kernels' view of an uploaded matrix (no copy): part 0 is the
  // whole matrix or expert stack, 1 / 2 the gate / up rows of a gate-up
  // matrix interleaved by rows (upload_interleaved).
  static bool prefill_view(const DevMatView& v, int experts, int part, const std::string& name,
                           PrefillWeight& pw, std::string& why) {
    if (v.rows <= 0 || experts <= 0 || v.rows % (experts * (part ? 2 : 1)) != 0) {
      why = str_cat(name, ": ", v.rows, " rows do not split into ", experts, " experts");
      return false;
    }
    int bits = 16;
    switch (v.fmt) {
      case QFmt::Q4: pw.fmt = PrefillWeightFormat::Q4; bits = 4; break;
      case QFmt::Q8: pw.fmt = PrefillWeightFormat::Q8; bits = 8; break;
      case QFmt::BF16: pw.fmt = PrefillWeightFormat::BF16; break;
      default:
        why = str_cat(name, ": ", qfmt_name(v.fmt), " weights (the prefill GEMM reads q4, q8 and bf16)");
        return false;
    }
    if (v.cols % 64 != 0) {
      why = str_cat(name, ": ", v.cols, " columns (the prefill GEMM needs a multiple of 64)");
      return false;
    }
    const bool affine = bits < 16;
    if (affine && v.groups * 64 != v.cols) {
      why = str_cat(name, ": quantization group of ", v.cols / std::max(v.groups, 1), " (the prefill GEMM needs 64)");
      return false;
    }
    const size_t row_bytes = size_t(v.chunks) * 16;
    if (row_bytes * 8 != size_t(v.cols) * bits) {
      why = str_cat(name, ": padded rows");
      return false;
    }
    const int per_expert = v.rows / experts;
    pw.rows = part ? per_expert / 2 : per_expert;
    pw.cols = v.cols;
    pw.w = v.w;
    pw.sb = affine ? v.sb : nullptr;
    pw.sb_f16 = v.sb_f16 != 0;
    if (experts > 1) {
      pw.expert_w_bytes = size_t(per_expert) * row_bytes;
      pw.expert_sb_words = affine ? size_t(per_expert) * v.groups : 0;
    }
    if (part) {
      pw.row_stride_bytes = 2 * row_bytes;
      pw.sb_row_stride_words = affine ? 2 * size_t(v.groups) : 0;
      if (part == 2) {
        pw.w = reinterpret_cast<const char*>(v.w) + row_bytes;
        if (affine) pw.sb = v.sb + v.groups;
      }
    }
    return true;
  }

  // Decides once whether runs of tokens take the prefill kernels, and builds
  // their weight views.
  void setup_prefill() {
    prefill_ok = false;
    pl.clear();
    auto no = [&](std::string why) { prefill_why = std::move(why); };
    if (!opt.prefill) return no("turned off (LILY_CUDA_PREFILL=0)");
    if (opt.kv == KvType::F32) return no("the prefill attention reads a bf16 or q8 KV cache (this backend keeps f32 KV)");
    auto one_of = [](int v, std::initializer_list<int> set) {
      return std::find(set.begin(), set.end(), v) != set.end();
    };
    bool any_attn = false, any_dn = false;
    for (LayerKind k : c.layer_kinds) (k == LayerKind::FullAttention ? any_attn : any_dn) = true;
    if (any_attn && !one_of(c.head_dim, {32, 64, 128, 256}))
      return no(str_cat("attention head_dim ", c.head_dim, " (prefill supports 32, 64, 128, 256)"));
    if (any_dn) {
      if (c.linear_key_head_dim != c.linear_value_head_dim || !one_of(c.linear_key_head_dim, {32, 64, 128}))
        return no(str_cat("DeltaNet head dims ", c.linear_key_head_dim, " / ", c.linear_value_head_dim,
                          " (prefill supports equal dims of 32, 64, 128)"));
      if (c.linear_conv_kernel != 4) return no(str_cat("DeltaNet conv kernel ", c.linear_conv_kernel, " (prefill: 4)"));
      if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
        return no("DeltaNet value heads are not a multiple of key heads");
    }
    if (c.hidden_size % 64 != 0) return no(str_cat("hidden size ", c.hidden_size, " (not a multiple of 64)"));
    const int E = c.num_experts;
    bool any_moe = false;
    for (const LayerDev& D : layers) any_moe = any_moe || D.is_moe;
    if (any_moe && (E > 512 || c.num_experts_per_tok > 32 || c.moe_intermediate_size % 8 != 0))
      return no(str_cat("MoE shape (", E, " experts, top-", c.num_experts_per_tok, ", intermediate ",
                        c.moe_intermediate_size, ")"));
    std::string why;
    std::vector<PrefillLayer> views(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerDev& D = layers[l];
      PrefillLayer& W = views[l];
      bool ok = true;
      auto view = [&](const DevMat& m, PrefillWeight& pw, const char* name, int experts = 1, int part = 0) {
        if (ok) ok = prefill_view(m.v, experts, part, str_cat("layer ", l, " ", name), pw, why);
      };
      if (D.kind == LayerKind::FullAttention) {
        view(D.q, W.q, "q_proj");
        view(D.k, W.k, "k_proj");
        view(D.v, W.v, "v_proj");
        view(D.o, W.o, "o_proj");
      } else {
        view(D.in_qkv, W.in_qkv, "in_proj_qkv");
        view(D.in_z, W.in_z, "in_proj_z");
        view(D.in_b, W.in_b, "in_proj_b");
        view(D.in_a, W.in_a, "in_proj_a");
        view(D.out, W.out, "out_proj");
      }
      if (!D.is_moe) {
        view(D.mlp_gate_up, W.mlp_gate, "mlp.gate_proj", 1, 1);
        view(D.mlp_gate_up, W.mlp_up, "mlp.up_proj", 1, 2);
        view(D.mlp_down, W.mlp_down, "mlp.down_proj");
      } else {
        view(D.router, W.router, "mlp.gate (router)");
        view(D.experts_gate_up, W.ex_gate, "experts.gate_proj", E, 1);
        view(D.experts_gate_up, W.ex_up, "experts.up_proj", E, 2);
        view(D.experts_down, W.ex_down, "experts.down_proj", E);
        if (D.has_shared) {
          view(D.shared_gate, W.shared_gate, "shared_expert_gate");
          view(D.shared_gate_up, W.sh_gate, "shared_expert.gate_proj", 1, 1);
          view(D.shared_gate_up, W.sh_up, "shared_expert.up_proj", 1, 2);
          view(D.shared_down, W.sh_down, "shared_expert.down_proj");
        }
      }
      if (!ok) return no(why);
    }
    pl = std::move(views);
    p_wx_bytes = 0;
    // The scratch holds the largest expansion: one matrix, a SwiGLU pair, or
    // a fused group (prefill_gemm_fused: together only when all are quantized).
    auto need = [&](std::initializer_list<const PrefillWeight*> group, size_t copies = 1) {
      size_t rows = 0;
      for (const PrefillWeight* w : group)
        if (w->w && w->fmt != PrefillWeightFormat::BF16) rows += size_t(w->rows);
      if (rows) p_wx_bytes = std::max(p_wx_bytes, copies * rows * size_t((*group.begin())->cols) * 2);
    };
    for (const PrefillLayer& W : pl) {
      need({&W.q, &W.k, &W.v});
      need({&W.in_qkv, &W.in_z, &W.in_b, &W.in_a});
      need({&W.router, &W.shared_gate});
      for (const PrefillWeight* w : {&W.o, &W.out, &W.mlp_down, &W.sh_down}) need({w});
      need({&W.mlp_gate}, 2);
      need({&W.sh_gate}, 2);
    }
    std::string lm_why;
    lm_gemm_ok = prefill_view(lm_head->v, 1, 0, "lm_head", pw_lm, lm_why);
    prefill_ok = true;
    prefill_why.clear();
  }

  // Floats of one row's area in pMoeRows: activations, ids, weights (each
  // row's area on a 256-byte boundary).
  size_t moe_row_floats() const {
    const size_t k = size_t(c.num_experts_per_tok);
    return ((k + 1) * size_t(c.moe_intermediate_size) + k + (k + 1) + 63) / 64 * 64;
  }

  // Row strides and buffer sizes of the prefill workspace for chunks of up
  // to `rows` tokens.
  struct PrefillSizes {
    size_t ld_act = 0, ld_proj = 0, ld_qg = 0;
    size_t x = 0, xn = 0, act = 0, proj = 0, qg = 0, dn = 0, dn_ws = 0, rl = 0, so = 0, moe_ws = 0, logits = 0,
           wx = 0;
    size_t total() const { return x + xn + act + proj + qg + dn + dn_ws + rl + so + moe_ws + logits + wx; }
  };
  PrefillSizes prefill_sizes(int rows) const {
    PrefillSizes z;
    const size_t r = size_t(rows), H = size_t(c.hidden_size);
    const size_t qhs = size_t(c.head_dim) * (c.attn_output_gate ? 2 : 1);
    const size_t qdim = size_t(c.num_heads) * qhs, kvdim = size_t(c.num_kv_heads) * c.head_dim;
    size_t proj = qdim + 2 * kvdim;
    size_t act = std::max({H, size_t(c.num_heads) * c.head_dim, size_t(c.intermediate_size),
                           size_t(c.shared_expert_intermediate_size)});
    if (c.is_hybrid()) {
      proj = std::max(proj, size_t(c.deltanet_qkv_dim()) + c.deltanet_value_dim() + 2 * size_t(c.linear_num_value_heads));
      act = std::max(act, size_t(c.deltanet_value_dim()));
    }
    auto round_up = [](size_t v, size_t m) { return (v + m - 1) / m * m; };
    z.ld_act = round_up(act, 64);
    z.ld_proj = round_up(proj, 8);
    z.ld_qg = round_up(qdim, 8);
    z.x = r * H * 4;
    z.xn = r * H * 2;
    z.act = r * z.ld_act * 2;
    z.proj = r * z.ld_proj * 4;
    z.qg = r * z.ld_qg * 2;
    if (c.is_hybrid()) {
      z.dn = r * c.deltanet_value_dim() * 4;
      z.dn_ws = prefill_deltanet_workspace_bytes(rows, c.linear_num_key_heads, c.linear_num_value_heads,
                                                 c.linear_key_head_dim, c.linear_value_head_dim);
    }
    if (c.num_experts > 0) {
      z.rl = r * (c.num_experts + 1) * 4;  // router logits and the shared gate's
      z.so = r * H * 4;
      z.moe_ws = prefill_moe_workspace_bytes(rows, c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                             c.moe_intermediate_size);
    }
    z.logits = size_t(std::min(rows, int(kLogitRows))) * c.vocab_size * 4;
    z.wx = rows >= PrefillScratch{}.min_rows ? p_wx_bytes : 0;
    return z;
  }

  // Workspace for prefill chunks of up to `rows` tokens.
  void ensure_prefill_rows(int rows) {
    if (rows <= p_rows) return;
    LILY_CUDA(cudaStreamSynchronize(stream));
    const PrefillSizes z = prefill_sizes(rows);
    p_ld_act = z.ld_act;
    p_ld_proj = z.ld_proj;
    p_ld_qg = z.ld_qg;
    pX.alloc(z.x);
    pXn.alloc(z.xn);
    pAct.alloc(z.act);
    pProj.alloc(z.proj);
    pQg.alloc(z.qg);
    if (c.is_hybrid()) {
      pDn.alloc(z.dn);
      pDnWs.alloc(z.dn_ws);
    }
    if (c.num_experts > 0) {
      pRl.alloc(z.rl);
      pSo.alloc(z.so);
      pMoeWs.alloc(z.moe_ws);
      if (!pMoeRows) {  // zeroed: the down launch may read a row's ids before its gate_up has written them
        pMoeRows.alloc(size_t(kMaxMoeRows) * moe_row_floats() * 4);
        LILY_CUDA(cudaMemset(pMoeRows.get(), 0, pMoeRows.bytes()));
      }
    }
    pLogits.alloc(z.logits);
    if (z.wx > pWx.bytes()) pWx.alloc(z.wx);
    if (!pAttnWs && opt.attn_split) {
      bool attn = false;
      for (LayerKind k : c.layer_kinds) attn = attn || k == LayerKind::FullAttention;
      if (attn) {
        pAttnWs.alloc(prefill_attention_workspace_bytes(c.num_heads, c.num_kv_heads, c.head_dim));
        pAttnRows.alloc(size_t(kMaxMatvecRows) * c.num_heads * c.head_dim * 4);
      }
    }
    p_rows = rows;
  }

  // Tokens per prefill pass: opt.prefill_chunk, or when that is 0 the
  // largest of 16384 / 8192 / 4096 / 2048 / 1024 whose workspace takes at
  // most a quarter of the device memory free at the first prefill (bigger
  // chunks fill the grouped MoE tiles better: 128K prompts 13.9k -> 15.0k
  // tok/s on an H200 from 4096 to 16384; the KV cache and the other
  // sequences keep the rest).
  int prefill_chunk() {
    if (opt.prefill_chunk > 0) return opt.prefill_chunk;
    if (auto_chunk == 0) {
      size_t free_b = 0, total = 0;
      LILY_CUDA(cudaMemGetInfo(&free_b, &total));
      auto_chunk = 1024;
      for (int rows : {16384, 8192, 4096, 2048})
        if (prefill_sizes(rows).total() <= free_b / 4) {
          auto_chunk = rows;
          break;
        }
    }
    return auto_chunk;
  }

  // Tokens (device ids) at positions [P, P + T) through every layer; the
  // residual stream ends in pX. Enqueue only.
  // The prefill DeltaNet of layer l over T in_proj rows at Pj (row stride
  // p_ld_proj: qkv | z | b | a) at positions [P, P + T), into pDn.
  PrefillDeltaNetArgs deltanet_args(CudaCache& cache, int l, const float* Pj, int T, int P) {
    const LayerDev& D = layers[l];
    const int C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim(), nv = c.linear_num_value_heads;
    PrefillDeltaNetArgs a;
    a.T = T;
    a.first_position = P;
    a.nk = c.linear_num_key_heads;
    a.nv = nv;
    a.dk = c.linear_key_head_dim;
    a.dv = c.linear_value_head_dim;
    a.conv_kernel = c.linear_conv_kernel;
    a.qkv = Pj;
    a.ld_qkv = p_ld_proj;
    a.b = Pj + C + V;
    a.a = Pj + C + V + nv;
    a.ld_ab = p_ld_proj;
    a.conv_w = D.conv_w.as<float>();
    a.conv_ring = cache.conv[l].as<float>();
    a.a_log = D.a_log.as<float>();
    a.dt_bias = D.dt_bias.as<float>();
    a.state = cache.state[l].as<float>();
    a.out = pDn.as<float>();
    a.ld_out = V;
    a.workspace = pDnWs.get();
    a.workspace_bytes = pDnWs.bytes();
    return a;
  }

  // Writes the control block: the next step is at position pos after `token`.
  void set_ctrl(CudaCache& cache, int pos, int token) {
    LILY_CUDA(cudaStreamSynchronize(stream));  // nothing queued still reads the pinned staging
    pinned.ensure(sizeof(DecodeCtrl));
    write_ctrl(cache, 0, pos, token);
  }

  // The same through the pinned staging at byte ctrl_off (room for it
  // ensured, nothing queued reading it there); waits for the copy, since
  // the staging is reused.
  void write_ctrl(CudaCache& cache, size_t ctrl_off, int pos, int token) {
    DecodeCtrl* h = reinterpret_cast<DecodeCtrl*>(pinned.as<char>() + ctrl_off);
    *h = DecodeCtrl{};
    h->pos = pos;
    h->token = token;
    LILY_CUDA(cudaMemcpyAsync(cache.dctrl(), h, sizeof(DecodeCtrl), cudaMemcpyHostToDevice, stream));
    LILY_CUDA(cudaStreamSynchronize(stream));
  }

  // record: the DeltaNet layers' in_proj rows go to cache.draft.proj[l]
  // instead of the shared workspace (a draft run's replay input), and for
  // runs of at most prefill_skinny_rows() tokens the DeltaNet writes the
  // state and ring as they were to cache.draft.state / conv (longer runs:
  // forward_draft copies them first). Layers [l0, l1) only (l1 < 0: to
  // the last; the embedding with l0 == 0); normed_io carries whether Xn
  // already holds layer l0's input norm in and layer l1's out (a pass in
  // pieces: draft_pass_graph).
  void prefill_layers(CudaCache& cache, const int* tokens, int T, int P, bool record = false, int l0 = 0,
                      int l1 = -1, bool* normed_io = nullptr) {
    cudaStream_t s = stream;
    if (l1 < 0) l1 = c.num_layers;
    const int H = c.hidden_size;
    const float eps = c.rms_norm_eps;
    float* X = pX.as<float>();
    uint16_t* Xn = pXn.as<uint16_t>();
    uint16_t* A = pAct.as<uint16_t>();
    const size_t lda = p_ld_act, ldp = p_ld_proj;
    const PrefillScratch p_scr{pWx.get(), pWx.bytes()};  // empty below 1024-token chunks
    if (l0 == 0) {
      run_folds = {};
      marks.mark("start", s);
      launch_embed_rows(embed.v, tokens, T, X, H, s);
      marks.mark("embed", s);
    }
    // Xn already holds this layer's input norm (the previous MoE's combine wrote it).
    bool normed = l0 > 0 && normed_io && *normed_io;
    for (int l = l0; l < l1; ++l) {
      const LayerDev& D = layers[l];
      const PrefillLayer& W = pl[l];
      // The layer's input norm: by the MoE combine before (normed), in the
      // projection's prologue (a run of at most opt.mv_rows rows through
      // matvec_rows), or its own launch.
      auto input_norm = [&] {
        if (!normed) prefill_rmsnorm(X, H, D.input_norm.as<float>(), T, H, eps, Xn, H, s);
        marks.mark("norms", s);
      };
      // The out projection with the rows' fold (rows_out_fold's launches, one
      // grid), then the MoE rows routed from the folded sums (no router).
      auto folded_out_and_moe = [&](const std::vector<MatvecParams>& out_fold, const char* what,
                                    int& count) {
        launch_matvec_grid(out_fold.data(), T, s, prefill_pdl(T));
        ++count;
        marks.mark(what, s);
        moe_rows_pass(D, T, s, D.fold_rows_acc.as<unsigned long long>());
        normed = false;
        marks.mark("routed experts", s);
      };
      if (D.kind == LayerKind::DeltaNet) {
        const int C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim(), nv = c.linear_num_value_heads;
        float* Pj = record ? cache.draft.proj[l].as<float>() : pProj.as<float>();
        MatvecParams o;  // the out_proj: the gated RMSNorm in its prologue, rows ldz / V apart
        o.x = pDn.as<float>();
        o.pro = Prologue::GatedNorm;
        o.norm_w = D.dn_norm.as<float>();
        o.seg = c.linear_value_head_dim;
        o.gate_z = Pj + C;
        o.ldz = static_cast<long long>(ldp);
        o.eps = eps;
        o.epi = Epilogue::Add;
        // A run whose in_proj and MoE take their decode forms (matvec_rows,
        // the rows' grid): the router folded into the out_proj as in the
        // decode step, each row's out_proj launch with the fold as one launch
        // over the rows, and no router launch; the in_proj zeroes the sums.
        std::vector<MatvecParams> out_fold = rows_out_fold(D, T, o, V);
        const MatvecParams in_p = input_rows(D, T, !out_fold.empty());
        // qkv | z | b | a side by side in Pj.
        if (!matvec_rows({{&D.in_qkv, Pj}, {&D.in_z, Pj + C}, {&D.in_b, Pj + C + V}, {&D.in_a, Pj + C + V + nv}},
                         in_p, T, H, ldp, s)) {
          out_fold.clear();
          input_norm();
          const PrefillWeight in[4] = {W.in_qkv, W.in_z, W.in_b, W.in_a};
          prefill_gemm_fused(in, 4, Xn, T, H, Pj, ldp, PrefillOut::F32, s, p_scr);
        }
        normed = false;
        marks.mark("dn in_proj", s);
        PrefillDeltaNetArgs da = deltanet_args(cache, l, Pj, T, P);
        if (record && T <= prefill_skinny_rows()) {  // the run form records the state as it reads it
          da.state_backup = cache.draft.state[l].as<float>();
          da.ring_backup = cache.draft.conv[l].as<float>();
        }
        prefill_deltanet(da, s);
        marks.mark("dn core", s);
        if (!out_fold.empty()) {
          folded_out_and_moe(out_fold, "dn out_proj", run_folds.deltanet);
          continue;
        }
        if (!matvec_rows({{&D.out, X}}, o, T, V, H, s)) {
          prefill_gated_rmsnorm(pDn.as<float>(), V, Pj + C, ldp, D.dn_norm.as<float>(), T, nv,
                                c.linear_value_head_dim, eps, A, lda, s);
          marks.mark("dn gated norm", s);
          prefill_gemm(W.out, A, T, lda, X, H, PrefillOut::F32Add, s, p_scr);
        }
        marks.mark("dn out_proj", s);
      } else {
        float* Pj = pProj.as<float>();
        const int hd = c.head_dim, qhs = hd * (c.attn_output_gate ? 2 : 1);
        const int qdim = c.num_heads * qhs;
        const int kvdim = c.num_kv_heads * hd;
        // As the DeltaNet's out_proj above: the o_proj with the router
        // folded in where the run takes it (and the attention its split form).
        MatvecParams o;  // the o_proj on the attention's f32 rows, added to X's rows
        o.x = pAttnRows.as<float>();
        o.epi = Epilogue::Add;
        std::vector<MatvecParams> out_fold = rows_out_fold(D, T, o, c.num_heads * hd);
        const MatvecParams in_p = input_rows(D, T, !out_fold.empty());
        // q | k | v side by side in Pj.
        if (!matvec_rows({{&D.q, Pj}, {&D.k, Pj + qdim}, {&D.v, Pj + qdim + kvdim}}, in_p, T, H,
                         ldp, s)) {
          out_fold.clear();
          input_norm();
          const PrefillWeight qkv[3] = {W.q, W.k, W.v};
          prefill_gemm_fused(qkv, 3, Xn, T, H, Pj, ldp, PrefillOut::F32, s, p_scr);
        }
        normed = false;
        marks.mark("attn qkv", s);
        AttnPrepParams ap;
        ap.proj = Pj;
        ap.ld_proj = ldp;
        ap.T = T;
        ap.P = P;
        ap.nh = c.num_heads;
        ap.nkv = c.num_kv_heads;
        ap.hd = hd;
        ap.q_head_stride = qhs;
        ap.gated = c.attn_output_gate ? 1 : 0;
        ap.q_norm = D.q_norm.as<float>();
        ap.k_norm = D.k_norm.as<float>();
        ap.eps = eps;
        ap.inv_freq = inv_freq.as<float>();
        ap.rotary_dim = c.rotary_dim;
        ap.qg = pQg.as<uint16_t>();
        // A q8 cache: the attention reads bf16 rows [0, P + T) of a scratch
        // (the cache's rows before P expanded, the new ones rounded through q8
        // as the decode step reads them), or, for a short run, the q8 rows
        // in place (no expansion).
        const bool q8 = cache.kv == KvType::Q8;
        uint16_t* kb = q8 ? pKv.as<uint16_t>() : cache.k[l].as<uint16_t>();
        uint16_t* vb = q8 ? kb + size_t(c.num_kv_heads) * pKvCap * hd : cache.v[l].as<uint16_t>();
        const int bcap = q8 ? pKvCap : cache.capacity;
        const KvQ8Rows qk{cache.k[l].as<uint8_t>(), cache.scales(cache.k[l]), cache.capacity,
                          q8_scale_stride(cache.capacity)};
        const KvQ8Rows qv{cache.v[l].as<uint8_t>(), cache.scales(cache.v[l]), cache.capacity,
                          q8_scale_stride(cache.capacity)};
        PrefillAttentionArgs aa;
        aa.T = T;
        aa.first_position = P;
        aa.nh = c.num_heads;
        aa.nkv = c.num_kv_heads;
        aa.head_dim = hd;
        aa.workspace = pAttnWs.get();
        aa.workspace_bytes = pAttnWs.bytes();
        // A short run (the split form) reads the q8 rows in place instead.
        const bool q8_direct = q8 && prefill_attention_splits(aa) > 0;
        if (q8 && P > 0 && !q8_direct) {
          launch_kv_q8_expand(qk, c.num_kv_heads, hd, 0, P, kb, bcap, s);
          launch_kv_q8_expand(qv, c.num_kv_heads, hd, 0, P, vb, bcap, s);
        }
        ap.k_cache = kb;
        ap.v_cache = vb;
        ap.capacity = bcap;
        launch_attn_prep(ap, s);
        if (q8) {
          launch_kv_q8_store(kb, bcap, c.num_kv_heads, hd, P, P + T, qk, s);
          launch_kv_q8_store(vb, bcap, c.num_kv_heads, hd, P, P + T, qv, s);
        }
        aa.q = pQg.as<uint16_t>();
        aa.gate = c.attn_output_gate ? pQg.as<uint16_t>() + hd : nullptr;
        aa.q_row_stride = size_t(qdim);
        aa.q_head_stride = size_t(qhs);
        if (q8_direct) {
          aa.k_q8 = qk.rows;
          aa.v_q8 = qv.rows;
          aa.k_scale = qk.scales;
          aa.v_scale = qv.scales;
          aa.scale_stride = qk.scale_stride;
          aa.capacity = cache.capacity;
        } else {
          aa.k_cache = kb;
          aa.v_cache = vb;
          aa.capacity = bcap;
        }
        aa.out = A;
        aa.out_row_stride = lda;
        if (!out_fold.empty() && prefill_attention_splits(aa) > 0) {
          aa.out = nullptr;
          aa.out_f32 = pAttnRows.as<float>();
          aa.out_row_stride = size_t(c.num_heads) * hd;
          marks.mark("attn prep+kv", s);
          prefill_attention(aa, s);
          marks.mark("attention", s);
          folded_out_and_moe(out_fold, "attn o_proj", run_folds.attention);
          continue;
        }
        marks.mark("attn prep+kv", s);
        prefill_attention(aa, s);
        marks.mark("attention", s);
        prefill_gemm(W.o, A, T, lda, X, H, PrefillOut::F32Add, s, p_scr);
        marks.mark("attn o_proj", s);
      }
      if (D.is_moe && T <= opt.moe_rows) {  // the decode MoE per row
        moe_rows_pass(D, T, s);
        normed = false;
        marks.mark("routed experts", s);
        continue;
      }
      prefill_rmsnorm(X, H, D.post_norm.as<float>(), T, H, eps, Xn, H, s);
      marks.mark("norms", s);
      if (!D.is_moe) {
        prefill_gemm_swiglu(W.mlp_gate, W.mlp_up, Xn, T, H, A, lda, s, p_scr);
        prefill_gemm(W.mlp_down, A, T, lda, X, H, PrefillOut::F32Add, s, p_scr);
        marks.mark("dense mlp", s);
        continue;
      }
      // Router logits [T][E] and the shared expert's gate logit beside them
      // (column E): one GEMM.
      const int E = c.num_experts;
      const size_t ldr = size_t(E) + 1;
      const PrefillWeight rg[2] = {W.router, W.shared_gate};
      prefill_gemm_fused(rg, D.has_shared ? 2 : 1, Xn, T, H, pRl.as<float>(), ldr, PrefillOut::F32, s, p_scr);
      marks.mark("router", s);
      PrefillMoeArgs m;
      m.T = T;
      m.E = E;
      m.k = c.num_experts_per_tok;
      m.hidden = H;
      m.inter = c.moe_intermediate_size;
      m.x = Xn;
      m.ldx = H;
      m.router_logits = pRl.as<float>();
      m.ld_logits = ldr;
      m.norm_topk = c.norm_topk_prob;
      m.gate = W.ex_gate;
      m.up = W.ex_up;
      m.down = W.ex_down;
      if (D.has_shared) {
        // A short run hands the shared expert to prefill_moe (one more tile
        // of its launches, where the layouts allow).
        if (T <= prefill_moe_plan_rows() && W.sh_gate.rows <= m.inter) {
          m.sh_gate = W.sh_gate;
          m.sh_up = W.sh_up;
          m.sh_down = W.sh_down;
        } else {
          prefill_gemm_swiglu(W.sh_gate, W.sh_up, Xn, T, H, A, lda, s, p_scr);
          prefill_gemm(W.sh_down, A, T, lda, pSo.as<float>(), H, PrefillOut::F32, s, p_scr);
          marks.mark("shared expert", s);
        }
        m.shared_out = pSo.as<float>();
        m.ld_shared = H;
        m.shared_gate_logit = pRl.as<float>() + E;
        m.ld_shared_gate = ldr;
      }
      m.out = X;
      m.ldo = H;
      m.accumulate = true;
      if (opt.fold_norms && l + 1 < c.num_layers) {  // the next layer's input norm, by the combine
        m.norm_w = layers[l + 1].input_norm.as<float>();
        m.norm_eps = eps;
        m.norm_out = Xn;
        m.ld_norm_out = H;
        normed = true;
      }
      m.workspace = pMoeWs.get();
      m.workspace_bytes = pMoeWs.bytes();
      prefill_moe(m, s);
      marks.mark("routed experts", s);
    }
    if (normed_io) *normed_io = normed;
  }

  // A run of at most opt.moe_rows rows: the MoE as the decode step's
  // (router, gate_up routing in its prologue, down) once per residual row,
  // each row's launches the same bits as a decode step's on that row; rows
  // 1.. on streams of their own (moe_row_streams), forked from s and joined
  // back into it.
  void moe_rows_pass(const LayerDev& D, int T, cudaStream_t s,
                     const unsigned long long* fold_acc = nullptr) {
    const int H = c.hidden_size, k = c.num_experts_per_tok;
    float* X = pX.as<float>();
    // Each row's launches, a 1 / T share of the SMs where they run together;
    // fold_acc: the rows' folded router sums (rows_out_fold), ld apart, in
    // place of the router launch.
    auto row_steps = [&](int i, int grid_div) {
      float* area = pMoeRows.as<float>() + size_t(i) * moe_row_floats();
      float* Hb = area;
      int* sidx = reinterpret_cast<int*>(area + size_t(k + 1) * c.moe_intermediate_size);
      float* sw = reinterpret_cast<float*>(sidx + k);
      float* Xi = X + size_t(i) * H;
      MatvecParams post = norm_rows(D.post_norm);
      post.x = Xi;
      std::vector<Step> st;
      if (fold_acc)
        add_moe(st, D, post, nullptr, sidx, sw, Hb, Xi, grid_div, fold_acc + size_t(i) * D.fold.ld);
      else
        add_moe(st, D, post, pRl.as<float>() + size_t(i) * (c.num_experts + 1), sidx, sw, Hb, Xi,
                grid_div);
      return st;
    };
    if (T > 1 && opt.moe_row_streams == 3 && moe_rows_grid(T, s, row_steps)) return;
    const int mode = T > 1 ? std::min(opt.moe_row_streams, 2) : 0;
    if (mode) {
      LILY_CUDA(cudaEventRecord(row_fork, s));
      for (int i = 1; i < T; ++i) LILY_CUDA(cudaStreamWaitEvent(row_stream[i - 1], row_fork, 0));
    }
    // The rows' streams join s again (checked) after the rows; where an
    // error is thrown between the fork and that join, the guard joins them
    // on the way out without throwing, so they are neither left forked nor,
    // during a graph capture, unjoined in it.
    struct Join {
      Impl& m;
      int rows;
      cudaStream_t s;
      bool done = false;
      ~Join() {
        for (int i = 1; !done && i < rows; ++i)
          if (cudaEventRecord(m.row_join[i - 1], m.row_stream[i - 1]) == cudaSuccess)
            cudaStreamWaitEvent(s, m.row_join[i - 1], 0);
      }
    } join{*this, mode ? T : 0, s};
    for (int i = 0; i < T; ++i) {
      cudaStream_t si = mode && i > 0 ? row_stream[i - 1] : s;
      const std::vector<Step> st = row_steps(i, mode == 2 ? T : 1);
      // A side stream's first launch follows the fork's event: no PDL.
      for (size_t j = 0; j < st.size(); ++j) st[j].run(si, prefill_pdl(T) && !(si != s && j == 0));
    }
    join.done = true;
    for (int i = 1; mode && i < T; ++i) {
      LILY_CUDA(cudaEventRecord(row_join[i - 1], row_stream[i - 1]));
      LILY_CUDA(cudaStreamWaitEvent(s, row_join[i - 1], 0));
    }
  }

  // A run's first projection over its rows (matvec_rows) with the input
  // norm in its prologue; fold: it also zeroes the rows' folded router sums
  // (rows_out_fold's launches add into them later in the layer).
  MatvecParams input_rows(const LayerDev& D, int T, bool fold) const {
    MatvecParams p = norm_rows(D.input_norm);
    if (fold) {
      p.zero_acc = D.fold_rows_acc.as<unsigned long long>();
      p.zero_n = T * D.fold.ld;
    }
    return p;
  }

  // A layer's out projection for a run of T rows with the router folded
  // in, one launch's parameters a row: proto (the run's out_proj over all
  // rows: x rows ldx apart, gate z rows proto.ldz apart, added to X's rows)
  // as row i's own launch, the decode step's out_proj, with the fold's sums
  // at fold_rows_acc + i * ld; where the run takes it: T rows through the
  // in_proj's matvec_rows (which zeroes the sums) and the MoE's row grid,
  // the router foldable and the launches a grid (matvec_grid_ok); else
  // empty. An attention layer's o_proj the same way: proto's x the
  // attention's f32 rows (pAttnRows, which its split form writes).
  std::vector<MatvecParams> rows_out_fold(const LayerDev& D, int T, const MatvecParams& proto,
                                          int ldx) {
    if (!opt.router_fold || !opt.rows_fold || !D.is_moe || !D.fold.acc || opt.moe_row_streams != 3)
      return {};
    if (T < 2 || T > opt.mv_rows || T > kMaxMatvecRows || T > opt.moe_rows) return {};
    const bool dn = D.kind == LayerKind::DeltaNet;
    if (!dn && (opt.rows_fold < 2 || !pAttnRows)) return {};
    const int H = c.hidden_size;
    std::vector<MatvecParams> ps(T, proto);
    for (int i = 0; i < T; ++i) {
      MatvecParams& o = ps[i];
      o.x += size_t(i) * ldx;
      if (o.gate_z) o.gate_z += size_t(i) * proto.ldz;
      o.ldz = 0;  // one row a launch
      o.fold = D.fold;
      o.fold.acc = D.fold_rows_acc.as<unsigned long long>() + size_t(i) * D.fold.ld;
      const auto groups = layout_groups({{dn ? &D.out : &D.o, pX.as<float>() + size_t(i) * H}});
      if (groups.size() != 1) return {};
      group_params(o, groups[0]);
    }
    if (!matvec_grid_ok(ps.data(), T)) return {};
    return ps;
  }

  // moe_rows_pass's rows as one launch per kernel (moe_row_streams 3):
  // step j of every row's launches (row_steps(i, T)) as one launch over a
  // grid of rows; false, with nothing launched, where a step's layout does
  // not take it (launch_matvec_grid, launch_moe_down_grid).
  template <typename RowSteps>
  bool moe_rows_grid(int T, cudaStream_t s, RowSteps&& row_steps) {
    static_assert(kMaxMoeRows <= kMaxGridRows, "a run's MoE rows in one grid");
    std::vector<std::vector<Step>> rows;
    for (int i = 0; i < T; ++i) rows.push_back(row_steps(i, T));
    const size_t n = rows[0].size();
    std::vector<std::vector<MatvecParams>> mv(n);
    std::vector<std::vector<MoeDownParams>> down(n);
    for (size_t j = 0; j < n; ++j) {
      for (const auto& r : rows) {
        if (r.size() != n) return false;
        if (r[j].mv) mv[j].push_back(*r[j].mv);
        else if (r[j].down) down[j].push_back(*r[j].down);
        else return false;
      }
      const bool ok = mv[j].size() == size_t(T)
                          ? matvec_grid_ok(mv[j].data(), T)
                          : down[j].size() == size_t(T) && moe_down_grid_ok(down[j].data(), T);
      if (!ok) return false;
    }
    for (size_t j = 0; j < n; ++j) {
      if (!mv[j].empty()) launch_matvec_grid(mv[j].data(), T, s, prefill_pdl(T));
      else launch_moe_down_grid(down[j].data(), T, s, prefill_pdl(T));
    }
    return true;
  }

  // Logits of residual row r of the chunk: the decode lm_head matvec (final
  // RMSNorm fused, f32 input) into the host row `dst`.
  void row_logits(int r, float* dst) {
    const int H = c.hidden_size, V = c.vocab_size;
    LILY_CUDA(cudaMemcpyAsync(x.get(), pX.as<float>() + size_t(r) * H, size_t(H) * 4, cudaMemcpyDeviceToDevice,
                              stream));
    MatvecParams lm;
    lm.x = x.as<float>();
    lm.pro = Prologue::Norm;
    lm.seg = H;
    lm.eps = c.rms_norm_eps;
    lm.norm_w = final_norm.as<float>();
    lm.epi = Epilogue::Store;
    std::vector<Step> st;
    add_matvec(st, "lm_head", {{lm_head, logits.as<float>()}}, lm);
    for (const Step& step : st) step.run(stream, false);
    LILY_CUDA(cudaMemcpyAsync(dst, logits.get(), size_t(V) * 4, cudaMemcpyDeviceToHost, stream));
  }

  // Logits of every row of a chunk of T tokens into host rows dst[0, T)
  // (null: left in pLogits, T <= kLogitRows).
  void all_logits(int T, float* dst) {
    const int H = c.hidden_size, V = c.vocab_size;
    if (lm_rows(T)) {  // a run of at most opt.mv_rows rows
      if (dst) {
        LILY_CUDA(cudaMemcpyAsync(dst, pLogits.get(), size_t(T) * V * 4, cudaMemcpyDeviceToHost, stream));
        LILY_CUDA(cudaStreamSynchronize(stream));
      }
      return;
    }
    if (!dst && (T > kLogitRows || !lm_gemm_ok)) fail("internal: logits kept on the device need the lm_head GEMM");
    if (!lm_gemm_ok) {
      for (int r = 0; r < T; ++r) row_logits(r, dst + size_t(r) * V);
      return;
    }
    prefill_rmsnorm(pX.as<float>(), H, final_norm.as<float>(), T, H, c.rms_norm_eps, pXn.as<uint16_t>(), H, stream);
    for (int r0 = 0; r0 < T; r0 += kLogitRows) {
      const int n = std::min(int(kLogitRows), T - r0);
      prefill_gemm(pw_lm, pXn.as<uint16_t>() + size_t(r0) * H, n, H, pLogits.get(), V, PrefillOut::F32, stream);
      if (!dst) break;
      LILY_CUDA(cudaMemcpyAsync(dst + size_t(r0) * V, pLogits.get(), size_t(n) * V * 4, cudaMemcpyDeviceToHost,
                                stream));
      LILY_CUDA(cudaStreamSynchronize(stream));  // pLogits is reused by the next rows
    }
  }

  // A short run's final norm and lm_head as the decode matvec over its rows
  // into pLogits (matvec_rows); false (nothing run) where it does not take them.
  bool lm_rows(int T) {
    return matvec_rows({{lm_head, pLogits.as<float>()}}, norm_rows(final_norm), T, c.hidden_size, c.vocab_size,
                       stream);
  }

  // Appends `tokens` (>= 2) with the prefill kernels, in chunks of at most
  // opt.prefill_chunk tokens; leaves the control block at the next position.
  // record: a draft run (one chunk; see prefill_layers).
  void prefill(CudaCache& cache, std::span<const int> tokens, LogitsMode mode, float* out_logits,
               bool record = false) {
    const int T = static_cast<int>(tokens.size()), V = c.vocab_size;
    const int chunk = prefill_chunk();
    const int P0 = cache.n_past();
    ensure_prefill_rows(std::min(T, chunk));
    if (cache.kv == KvType::Q8 && pKvCap < cache.capacity) {
      bool attn = false;
      for (LayerKind k : c.layer_kinds) attn = attn || k == LayerKind::FullAttention;
      if (attn) {
        LILY_CUDA(cudaStreamSynchronize(stream));
        pKv.alloc(2 * size_t(c.num_kv_heads) * cache.capacity * c.head_dim * 2);
        pKvCap = cache.capacity;
      }
    }
    // All token ids go up once (4 bytes a token); chunks index into them.
    const size_t ctrl_off = (size_t(T) * sizeof(int) + 63) / 64 * 64;
    pinned.ensure(ctrl_off + sizeof(DecodeCtrl));
    int* host_tokens = pinned.as<int>();
    std::memcpy(host_tokens, tokens.data(), size_t(T) * sizeof(int));
    if (pTok.bytes() < size_t(T) * sizeof(int)) pTok.alloc(size_t(T) * sizeof(int));
    LILY_CUDA(cudaMemcpyAsync(pTok.get(), host_tokens, size_t(T) * sizeof(int), cudaMemcpyHostToDevice, stream));
    if (record && opt.draft_graph && !marks.on && T <= chunk && T <= kLogitRows && mode == LogitsMode::All &&
        lm_gemm_ok && draft_pass_graph(cache, T, P0, out_logits)) {
      write_ctrl(cache, ctrl_off, P0 + T, tokens.back());
      return;
    }
    for (int t0 = 0; t0 < T; t0 += chunk) {
      const int n = std::min(chunk, T - t0);
      marks.begin(n);
      prefill_layers(cache, pTok.as<int>() + t0, n, P0 + t0, record);
      marks.enqueued();
      if (mode == LogitsMode::All) all_logits(n, out_logits ? out_logits + size_t(t0) * V : nullptr);
      else if (t0 + n == T) row_logits(n - 1, out_logits);
      marks.mark("logits", stream);
      marks.report(n, stream);
    }
    write_ctrl(cache, ctrl_off, P0 + T, tokens.back());
  }

  // One draft run of T (<= kLogitRows) tokens already on the device (pTok)
  // as graphs: the layers with the record, the final norm and the lm_head
  // GEMM; then the logits to the host. The pass is captured in
  // opt.draft_graph_parts pieces of consecutive layers, each updated into
  // its executable graph and launched before the next is captured, so the
  // host's capture of a piece overlaps the GPU's run of the one before.
  // false (nothing run) when the first piece's capture or graph fails: the
  // caller runs the pass eagerly; a later piece's failure runs the rest of
  // the pass eagerly here.
  bool draft_pass_graph(CudaCache& cache, int T, int P, float* out_logits) {
    const int H = c.hidden_size, V = c.vocab_size, L = c.num_layers;
    const int parts = draft_pieces();
    const auto t_start = std::chrono::steady_clock::now();
    double capture_us = 0;
    auto logits_tail = [&] {
      if (!lm_rows(T)) {
        prefill_rmsnorm(pX.as<float>(), H, final_norm.as<float>(), T, H, c.rms_norm_eps, pXn.as<uint16_t>(), H,
                        stream);
        prefill_gemm(pw_lm, pXn.as<uint16_t>(), T, H, pLogits.get(), V, PrefillOut::F32, stream);
      }
    };
    bool normed = false;  // across the pieces: see prefill_layers
    for (int k = 0; k < parts; ++k) {
      const int l0 = k * L / parts, l1 = (k + 1) * L / parts;
      const bool normed_in = normed;
      const auto t0 = std::chrono::steady_clock::now();
      cudaGraph_t g = nullptr;
      LILY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      bool ok = true;
      try {
        prefill_layers(cache, pTok.as<int>(), T, P, /*record=*/true, l0, l1, &normed);
        if (k + 1 == parts) logits_tail();
      } catch (const Error&) {
        ok = false;
      }
      ok = cudaStreamEndCapture(stream, &g) == cudaSuccess && ok && g;
      cudaGetLastError();
      capture_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      cudaGraphExec_t& ex = draft_exec[{T, k}];
      if (ok && ex) {
        cudaGraphExecUpdateResultInfo info{};
        if (cudaGraphExecUpdate(ex, g, &info) != cudaSuccess) {
          cudaGetLastError();
          cudaGraphExecDestroy(ex);
          ex = nullptr;
        }
      }
      if (ok && !ex) ok = cudaGraphInstantiate(&ex, g, 0) == cudaSuccess;
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      if (!ok) {
        if (ex) cudaGraphExecDestroy(ex);
        ex = nullptr;
        if (k == 0) return false;
        normed = normed_in;  // the rest eagerly, from this piece on
        prefill_layers(cache, pTok.as<int>(), T, P, /*record=*/true, l0, L, &normed);
        logits_tail();
        break;
      }
      LILY_CUDA(cudaGraphLaunch(ex, stream));
    }
    if (draft_timing) {
      auto& t = draft_host[T];
      t.runs += 1;
      t.capture_us += capture_us;
      t.host_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_start).count();
    }
    if (out_logits)
      LILY_CUDA(cudaMemcpyAsync(out_logits, pLogits.get(), size_t(T) * V * 4, cudaMemcpyDeviceToHost, stream));
    return true;
  }

  // A draft run of T tokens (2..kMaxDraftRun) with the record accept_draft
  // needs: the states the run reads are kept, the pass runs. logits: the
  // run's rows to the host, or null to leave them in pLogits.
  void draft_pass(CudaCache& cache, std::span<const int> tokens, float* logits) {
    const int T = static_cast<int>(tokens.size());
    const int V = c.vocab_size;
    for (int t : tokens)
      if (t < 0 || t >= V) fail("token id ", t, " is outside the vocabulary [0, ", V, ")");
    LILY_CUDA(cudaStreamSynchronize(stream));
    ensure_capacity(cache, cache.n_past() + T);
    ensure_prefill_rows(T);
    auto& d = cache.draft;
    const size_t L = cache.state.size();
    d.state.resize(L);
    d.conv.resize(L);
    d.proj.resize(L);
    for (size_t l = 0; l < L; ++l) {
      if (!cache.state[l]) continue;
      if (!d.state[l]) d.state[l].alloc(cache.state[l].bytes());
      if (!d.conv[l]) d.conv[l].alloc(cache.conv[l].bytes());
      const size_t pb = size_t(kMaxDraftRun) * p_ld_proj * sizeof(float);
      if (d.proj[l].bytes() < pb) d.proj[l].alloc(pb);
      if (T <= prefill_skinny_rows()) continue;  // the run's DeltaNet writes the copies (prefill_layers)
      LILY_CUDA(cudaMemcpyAsync(d.state[l].get(), cache.state[l].get(), cache.state[l].bytes(),
                                cudaMemcpyDeviceToDevice, stream));
      LILY_CUDA(cudaMemcpyAsync(d.conv[l].get(), cache.conv[l].get(), cache.conv[l].bytes(),
                                cudaMemcpyDeviceToDevice, stream));
    }
    d.p0 = cache.n_past();
    d.tokens.assign(tokens.begin(), tokens.end());
    prefill(cache, tokens, LogitsMode::All, logits, /*record=*/true);
  }

  // The next token of each of s.size() rows of logits (row r at r * V),
  // chosen on the device with s[r] (sample.cu), queued after what the
  // stream holds; ids / drew back on the host. Fails as the Sampler does on
  // a row with no finite logit. Returns the launches made (marks: as
  // launch_sample's).
  int sample_rows(std::span<const TokenSampling> s, const float* rows, int* ids, int* drew,
                  cudaEvent_t* marks = nullptr) {
    const int R = static_cast<int>(s.size()), V = c.vocab_size;
    const TokenSampling& s0 = s.front();
    const int kc = s0.temperature == 0.f ? 1 : s0.top_k;
    // Pinned: [R + 1 offsets | the rows' adjustments | (16-byte aligned,
    // when a row has one) R allow masks], then 2 R results.
    const size_t W = allow_words(static_cast<size_t>(V));
    size_t na = 0;
    bool masked = false;
    for (const TokenSampling& r : s) {
      if (!r.allow.empty() && r.allow.size() != W)
        fail("internal: an allow mask of ", r.allow.size(), " words for a vocabulary of ", V);
      masked = masked || !r.allow.empty();
      if (r.temperature != s0.temperature || r.top_k != s0.top_k || r.top_p != s0.top_p || r.min_p != s0.min_p ||
          r.rep_penalty != s0.rep_penalty || r.logprobs != s0.logprobs)
        fail("internal: the rows of one sampling launch differ in their parameters");
      if (r.logprobs > kMaxBackendLogprobs || (r.logprobs >= 0 && !r.logprobs_out))
        fail("internal: ", r.logprobs, " log-probabilities asked for (at most ", kMaxBackendLogprobs,
             ", with somewhere to put them)");
      for (size_t i = 0; i < r.adjust.size(); ++i)
        if (r.adjust[i].id < 0 || r.adjust[i].id >= V || (i > 0 && r.adjust[i].id <= r.adjust[i - 1].id))
          fail("internal: sampling adjustments must be distinct ascending ids inside the vocabulary");
      na += r.adjust.size();
    }
    constexpr size_t kOffBytes = (cuda::kMaxSampleRows + 1) * sizeof(int);
    const size_t mask_at = (kOffBytes + na * sizeof(LogitAdjust) + 15) / 16 * 16;
    const size_t up = masked ? mask_at + R * W * sizeof(uint32_t) : kOffBytes + na * sizeof(LogitAdjust);
    const size_t res_at = (up + 15) / 16 * 16;
    const size_t lp_at = res_at + 2 * sizeof(int) * cuda::kMaxSampleRows;
    const bool logprobs = s0.logprobs >= 0;
    s_pinned.ensure(lp_at + (logprobs ? sizeof(cuda::RowLogprobs) * R : 0));
    int* off = s_pinned.as<int>();
    auto* adj = reinterpret_cast<LogitAdjust*>(s_pinned.as<char>() + kOffBytes);
    off[0] = 0;
    for (int r = 0; r < R; ++r) {
      std::memcpy(adj + off[r], s[r].adjust.data(), s[r].adjust.size() * sizeof(LogitAdjust));
      off[r + 1] = off[r] + static_cast<int>(s[r].adjust.size());
    }
    if (masked) {  // a row without a mask allows every id
      auto* bits = reinterpret_cast<uint32_t*>(s_pinned.as<char>() + mask_at);
      for (int r = 0; r < R; ++r) {
        if (s[r].allow.empty()) std::fill_n(bits + r * W, W, ~0u);
        else std::memcpy(bits + r * W, s[r].allow.data(), W * sizeof(uint32_t));
      }
    }
    if (na > 0 || masked) {  // else nothing goes up (the kernels take null offsets and masks as none)
      if (s_adjust.bytes() < up) s_adjust.alloc(up);
      LILY_CUDA(cudaMemcpyAsync(s_adjust.get(), s_pinned.as<void>(), up, cudaMemcpyHostToDevice, stream));
    }
    const size_t ws = cuda::sample_workspace_bytes(V, kc, R);
    if (s_cand.bytes() < ws) s_cand.alloc(ws);
    if (s_out.bytes() < 2 * sizeof(int) * cuda::kMaxSampleRows) s_out.alloc(2 * sizeof(int) * cuda::kMaxSampleRows);
    cuda::SampleArgs a;
    a.logits = rows;
    a.V = V;
    a.rows = R;
    a.row_stride = static_cast<size_t>(V);
    a.adjust = na > 0 ? reinterpret_cast<const LogitAdjust*>(s_adjust.as<char>() + kOffBytes) : nullptr;
    a.adjust_off = na > 0 ? s_adjust.as<int>() : nullptr;
    a.allow = masked ? reinterpret_cast<const uint32_t*>(s_adjust.as<char>() + mask_at) : nullptr;
    a.allow_words = W;
    a.rep_penalty = s0.rep_penalty;
    a.kc = kc;
    a.temperature = s0.temperature;
    a.top_p = s0.top_p;
    a.min_p = s0.min_p;
    for (int r = 0; r < R; ++r) a.u[r] = s[r].u;
    a.cand = s_cand.as<uint64_t>();
    a.out = s_out.as<int>();
    const int launches = cuda::launch_sample(a, stream, marks);
    auto* lp = reinterpret_cast<cuda::RowLogprobs*>(s_pinned.as<char>() + lp_at);
    if (logprobs) queue_logprobs(rows, R, s0.logprobs, s_out.as<int>(), nullptr, lp);  // for the ids just chosen
    int* res = reinterpret_cast<int*>(s_pinned.as<char>() + res_at);
    LILY_CUDA(cudaMemcpyAsync(res, s_out.get(), 2 * sizeof(int) * R, cudaMemcpyDeviceToHost, stream));
    LILY_CUDA(cudaStreamSynchronize(stream));
    for (int r = 0; r < R; ++r) {
      if (res[2 * r + 1] & 2) fail("Sampler: no token has a finite logit");
      ids[r] = res[2 * r];
      drew[r] = res[2 * r + 1] & 1;
      if (logprobs) give_logprobs(lp[r], s[r]);
    }
    return launches;
  }

  // Queues the log-probabilities of R rows of logits (row r at r * V) for
  // the ids the sampling kernels chose (ids, SampleArgs::out's layout) or,
  // for one row, the lm_head's argmax (key), and their copy to `host`
  // (pinned; valid once the stream is synchronised).
  void queue_logprobs(const float* rows, int R, int top, const int* ids, const unsigned long long* key,
                      cuda::RowLogprobs* host) {
    const int V = c.vocab_size;
    const size_t lw = cuda::logprob_workspace_bytes(V, R);
    if (s_lp_work.bytes() < lw) s_lp_work.alloc(lw);
    if (s_lp_out.bytes() < sizeof(cuda::RowLogprobs) * cuda::kMaxSampleRows)
      s_lp_out.alloc(sizeof(cuda::RowLogprobs) * cuda::kMaxSampleRows);
    cuda::LogprobArgs la;
    la.logits = rows;
    la.V = V;
    la.rows = R;
    la.row_stride = static_cast<size_t>(V);
    la.ids = ids;
    la.argmax_key = key;
    la.top = top;
    la.work = s_lp_work.get();
    la.out = s_lp_out.as<cuda::RowLogprobs>();
    cuda::launch_logprobs(la, stream);
    LILY_CUDA(cudaMemcpyAsync(host, s_lp_out.get(), sizeof(cuda::RowLogprobs) * R, cudaMemcpyDeviceToHost, stream));
  }
  static void give_logprobs(const cuda::RowLogprobs& lp, const TokenSampling& s) {
    TokenLogprobs& o = *s.logprobs_out;
    o.logprob = lp.logprob;
    o.top.clear();
    for (int i = 0; i < std::min(lp.n, s.logprobs); ++i) o.top.emplace_back(lp.ids[i], lp.lp[i]);
  }
};

CudaBackend::CudaBackend(std::unique_ptr<ModelWeights> weights, const CudaOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (const std::string why = cuda_unavailable_reason(); !why.empty()) fail("cuda backend: ", why);
  Impl& m = *impl_;
  m.c = weights->config;
  m.opt = options;
  if (m.opt.max_splits < 1 || m.opt.max_splits > 1024) fail("cuda backend: max_splits must be in [1, 1024]");
  const ModelConfig& c = m.c;
  if (m.opt.moe_rows < 0) m.opt.moe_rows = auto_moe_rows(c.num_experts, c.num_experts_per_tok);
  if (m.opt.moe_rows > kMaxMoeRows) fail("cuda backend: moe_rows must be at most ", kMaxMoeRows);
  if (c.num_experts_per_tok + 1 > kMaxJobs)
    fail("cuda backend: top-", c.num_experts_per_tok, " routing is not supported (at most ", kMaxJobs - 1, ")");
  LILY_CUDA(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  if (c.num_experts > 0) {
    for (int i = 0; i + 1 < kMaxMoeRows; ++i) {
      LILY_CUDA(cudaStreamCreateWithFlags(&m.row_stream[i], cudaStreamNonBlocking));
      LILY_CUDA(cudaEventCreateWithFlags(&m.row_join[i], cudaEventDisableTiming));
    }
    LILY_CUDA(cudaEventCreateWithFlags(&m.row_fork, cudaEventDisableTiming));
  }
  m.upload_weights(*weights);
  m.alloc_workspace();
  prefill_set_skinny_rows(m.opt.skinny_rows);  // refuses values outside [0, 16]
  prefill_set_moe_grouped(m.opt.moe_grouped);
  prefill_set_pdl(m.opt.short_pdl);
  m.setup_prefill();
  if (m.prefill_ok) prefill_reserve_split_space();  // before any graph capture
  if (const char* v = std::getenv("LILY_CUDA_PREFILL_MARKS")) m.marks.on = std::string(v) == "1";
  if (const char* v = std::getenv("LILY_CUDA_PROFILE_RUN")) m.marks.profile_rows = std::atoi(v);
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
  if (T >= 2 && m.prefill_ok) {
    m.prefill(cache, tokens, mode, logits);
    cache.advance(T);
    return;
  }
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

bool CudaBackend::can_sample(const TokenSampling& s) const {
  const int V = impl_->c.vocab_size;
  if (!s.allow.empty() && s.allow.size() != allow_words(static_cast<size_t>(V))) return false;
  if (s.logprobs > kMaxBackendLogprobs) return false;
  if (s.temperature == 0.f) return true;
  // top_k 0: the whole vocabulary (sample.cu's second path).
  if (s.top_k == 0) return s.temperature > 0.f && impl_->opt.sample_whole;
  return s.temperature > 0.f && s.top_k >= 1 && s.top_k <= kMaxBackendTopK && s.top_k < V;
}

int CudaBackend::forward_sample(SequenceCache& base, int token, const TokenSampling& s, bool& drew) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  const int V = m.c.vocab_size;
  if (!can_sample(s)) fail("internal: forward_sample with sampling the cuda backend does not take");
  if (token < 0 || token >= V) fail("token id ", token, " is outside the vocabulary [0, ", V, ")");
  LILY_CUDA(cudaStreamSynchronize(m.stream));  // earlier copies may still read the pinned staging
  m.ensure_capacity(cache, cache.n_past() + 1);
  m.ensure_graph(cache);
  m.pinned.ensure(16);
  m.pinned.as<int>()[0] = token;
  DecodeCtrl* ctrl = cache.dctrl();
  LILY_CUDA(cudaMemsetAsync(&ctrl->use_argmax, 0, sizeof(int), m.stream));
  LILY_CUDA(cudaMemcpyAsync(&ctrl->token, m.pinned.as<int>(), sizeof(int), cudaMemcpyHostToDevice, m.stream));
  m.run_step(cache);
  // The mask the caller computes while the step runs.
  std::vector<TokenSampling> filled;
  const TokenSampling& r = with_allow(std::span<const TokenSampling>(&s, 1), filled).front();
  if (r.temperature == 0.f && r.adjust.empty() && r.allow.empty()) {
    // Plain greedy: the lm_head's own argmax (DecodeCtrl::argmax_key, the
    // same order: NaN never taken, lower id on ties), 8 bytes back (and
    // the logprobs for it). Its order tells -0 from +0, the Sampler's does
    // not, and a row with no finite logit is the Sampler's error: a best
    // logit of zero or -inf (or none) goes through the sampling kernels
    // instead.
    m.s_pinned.ensure(16 + sizeof(cuda::RowLogprobs));
    auto* key = m.s_pinned.as<unsigned long long>();
    auto* lp = reinterpret_cast<cuda::RowLogprobs*>(m.s_pinned.as<char>() + 16);
    if (r.logprobs >= 0) m.queue_logprobs(m.logits.as<float>(), 1, r.logprobs, nullptr, &ctrl->argmax_key, lp);
    LILY_CUDA(cudaMemcpyAsync(key, &ctrl->argmax_key, sizeof *key, cudaMemcpyDeviceToHost, m.stream));
    LILY_CUDA(cudaStreamSynchronize(m.stream));
    const uint32_t hi = static_cast<uint32_t>(*key >> 32);
    if (*key != 0 && hi != 0x80000000u && hi != 0x7fffffffu && hi != 0x007fffffu) {
      if (r.logprobs >= 0) m.give_logprobs(*lp, r);
      cache.advance(1);
      drew = false;
      return static_cast<int>(0xffffffffu - static_cast<uint32_t>(*key));
    }
  }
  int id = 0, d = 0;
  m.sample_rows(std::span<const TokenSampling>(&r, 1), m.logits.as<float>(), &id, &d);
  cache.advance(1);
  drew = d != 0;
  return id;
}

bool CudaBackend::can_sample_draft(const TokenSampling& s) const {
  const Impl& m = *impl_;
  return m.opt.draft_sample && m.prefill_ok && m.opt.draft_runs && m.lm_gemm_ok && can_sample(s);
}

void CudaBackend::forward_draft_sample(SequenceCache& base, std::span<const int> tokens,
                                       std::span<const TokenSampling> s, int* ids, int* drew) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  const int T = static_cast<int>(tokens.size());
  if (cache.draft_pending()) fail("internal: forward_draft_sample while a draft run is not yet settled");
  if (T < 1 || static_cast<size_t>(T) != s.size() || T > kMaxDraftRun || T > cuda::kMaxSampleRows ||
      T > m.prefill_chunk())
    fail("internal: forward_draft_sample of ", T, " tokens with ", s.size(), " samplings");
  for (const TokenSampling& r : s)
    if (!can_sample_draft(r)) fail("internal: forward_draft_sample with sampling the cuda backend does not take");
  cache.draft.active = false;
  if (T == 1) {  // nothing to return to: a decode step
    bool d = false;
    ids[0] = forward_sample(cache, tokens[0], s[0], d);
    drew[0] = d ? 1 : 0;
    draft_begin(cache, 1);
    return;
  }
  m.draft_pass(cache, tokens, nullptr);  // the rows stay in pLogits
  std::vector<TokenSampling> filled;  // the masks the caller computes while the run's forward runs
  m.sample_rows(with_allow(s, filled), m.pLogits.as<float>(), ids, drew);
  cache.advance(T);
  draft_begin(cache, T);
  cache.draft.active = true;
}

void CudaBackend::copy_cache(const SequenceCache& src_base, SequenceCache& dst_base) {
  Impl& m = *impl_;
  const auto& src = dynamic_cast<const CudaCache&>(src_base);
  auto& dst = dynamic_cast<CudaCache&>(dst_base);
  if (&src == &dst) return;
  LILY_CUDA(cudaDeviceSynchronize());  // nothing in flight reads or writes either cache
  dst.set_n_past(0);                   // grows without copying rows about to be overwritten
  m.ensure_capacity(dst, src.n_past());
  dst.copy_from(src, m.stream);
  LILY_CUDA(cudaStreamSynchronize(m.stream));
}

void CudaBackend::truncate(SequenceCache& base, int n) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  if (n < 0 || n > cache.n_past()) fail("truncate: position ", n, " is outside [0, ", cache.n_past(), "]");
  if (n > 0 && n == cache.n_past()) return;
  if (n > 0 && !can_truncate()) fail("truncate: a DeltaNet state cannot be rolled back to position ", n);
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  for (const auto* vec : {&cache.state, &cache.conv})
    for (const auto& b : *vec)
      if (b) LILY_CUDA(cudaMemsetAsync(b.get(), 0, b.bytes(), m.stream));
  // The control block at the next position (the KV rows past it are
  // overwritten before they are read).
  DecodeCtrl ctrl{};
  ctrl.pos = n;
  LILY_CUDA(cudaMemcpyAsync(cache.dctrl(), &ctrl, sizeof ctrl, cudaMemcpyHostToDevice, m.stream));
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  cache.set_n_past(n);
}

int CudaBackend::max_draft_run() const { return impl_->prefill_ok && impl_->opt.draft_runs ? kMaxDraftRun : 1; }

void CudaBackend::forward_draft(SequenceCache& base, std::span<const int> tokens, float* logits) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  const int T = static_cast<int>(tokens.size());
  if (cache.draft_pending()) fail("internal: forward_draft while a draft run is not yet settled");
  cache.draft.active = false;
  if (T == 1) {  // nothing to return to: a decode step
    forward(cache, tokens, LogitsMode::All, logits);
    draft_begin(cache, 1);
    return;
  }
  if (!m.prefill_ok || !m.opt.draft_runs || T < 1 || T > kMaxDraftRun || T > m.prefill_chunk()) {
    Backend::forward_draft(base, tokens, logits);
    return;
  }
  m.draft_pass(cache, tokens, logits);
  cache.advance(T);
  draft_begin(cache, T);
  cache.draft.active = true;
}

void CudaBackend::accept_draft(SequenceCache& base, int n) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  auto& d = cache.draft;
  if (cache.draft_pending() >= 2 && !d.active) {
    Backend::accept_draft(base, n);  // the run took the default path
    return;
  }
  const int T = draft_end(cache, n);
  d.active = false;
  if (n == T) return;
  // Back to the run's first n tokens: the DeltaNet layers' state and conv
  // ring as before the run, then the kept tokens' updates from their
  // recorded in_proj rows (outputs unused); the KV rows past them are
  // overwritten before they are read.
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  for (size_t l = 0; l < cache.state.size(); ++l) {
    if (!cache.state[l]) continue;
    PrefillDeltaNetArgs a = m.deltanet_args(cache, static_cast<int>(l), d.proj[l].as<float>(), n, d.p0);
    if (n <= prefill_skinny_rows()) {  // the run form reads the record in place
      a.state_src = d.state[l].as<float>();
      a.ring_src = d.conv[l].as<float>();
    } else {
      LILY_CUDA(cudaMemcpyAsync(cache.state[l].get(), d.state[l].get(), cache.state[l].bytes(),
                                cudaMemcpyDeviceToDevice, m.stream));
      LILY_CUDA(cudaMemcpyAsync(cache.conv[l].get(), d.conv[l].get(), cache.conv[l].bytes(),
                                cudaMemcpyDeviceToDevice, m.stream));
    }
    prefill_deltanet(a, m.stream);
  }
  cache.set_n_past(d.p0 + n);
  m.set_ctrl(cache, d.p0 + n, d.tokens[n - 1]);
  d.tokens.clear();
}

void CudaBackend::bench_fill(SequenceCache& base, int ctx, uint64_t seed) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  m.ensure_capacity(cache, ctx + 1);
  const ModelConfig& c = m.c;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_kinds[l] == LayerKind::FullAttention) {
      for (DeviceBuffer* b : {&cache.k[l], &cache.v[l]}) {
        switch (cache.kv) {
          case KvType::BF16: fill_random_bf16(b->as<uint16_t>(), b->bytes() / 2, -1.f, 1.f, ++seed, m.stream); break;
          case KvType::F32: fill_random_f32(b->as<float>(), b->bytes() / 4, -1.f, 1.f, ++seed, m.stream); break;
          case KvType::Q8:  // codes anywhere, scales for values in about [-1, 1]
            fill_random_u32(b->as<uint32_t>(), cache.rows_bytes(cache.capacity) / 4, ++seed, m.stream);
            fill_random_f32(cache.scales(*b), (b->bytes() - cache.rows_bytes(cache.capacity)) / 4, 0.5f / 127,
                            1.f / 127, ++seed, m.stream);
            break;
        }
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

bool CudaBackend::prefill_enabled() const { return impl_->prefill_ok; }
CudaBackend::RunFolds CudaBackend::last_run_folds() const { return impl_->run_folds; }
std::string CudaBackend::prefill_disabled_reason() const { return impl_->prefill_why; }
int CudaBackend::prefill_chunk() const { return impl_->prefill_chunk(); }

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

std::vector<TracedLaunch> CudaBackend::trace_step(SequenceCache& base, double sm_mhz, double* timer_ns,
                                                  const std::string& only) {
  Impl& m = *impl_;
  auto& cache = dynamic_cast<CudaCache&>(base);
  m.ensure_capacity(cache, cache.n_past() + 8);
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  DecodeCtrl saved;
  LILY_CUDA(cudaMemcpy(&saved, cache.dctrl(), sizeof saved, cudaMemcpyDeviceToHost));
  std::vector<Step> steps = m.build_steps(cache);
  constexpr int kBlocksCap = 2048;
  const int max_launches = static_cast<int>(steps.size()) * 4;
  DeviceBuffer recs(size_t(max_launches) * kBlocksCap * sizeof(TraceRec));
  std::vector<std::string> launch_name;
  set_trace(recs.as<TraceRec>(), max_launches, kBlocksCap);
  cudaGraphExec_t exec = nullptr;
  try {
    exec = capture(m.stream, [&] {
      for (const Step& st : steps) {
        if (!only.empty() && st.name != only) continue;
        const int before = traced_launches();
        st.run(m.stream, m.opt.pdl);
        for (int i = before; i < traced_launches(); ++i) launch_name.push_back(st.name);
      }
    });
  } catch (...) {
    set_trace(nullptr, 0, 0);
    throw;
  }
  set_trace(nullptr, 0, 0);
  for (int r = 0; r < 3; ++r) {
    if (r == 2) LILY_CUDA(cudaMemsetAsync(recs.get(), 0, recs.bytes(), m.stream));
    LILY_CUDA(cudaMemcpyAsync(cache.dctrl(), &saved, sizeof saved, cudaMemcpyHostToDevice, m.stream));
    LILY_CUDA(cudaGraphLaunch(exec, m.stream));
  }
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  cudaGraphExecDestroy(exec);
  const int n = std::min<int>(static_cast<int>(launch_name.size()), max_launches);
  std::vector<TraceRec> h(size_t(n) * kBlocksCap);
  LILY_CUDA(cudaMemcpy(h.data(), recs.get(), h.size() * sizeof(TraceRec), cudaMemcpyDeviceToHost));
  LILY_CUDA(cudaMemcpy(cache.dctrl(), &saved, sizeof saved, cudaMemcpyHostToDevice));

  unsigned long long t0 = ~0ull;
  for (const TraceRec& r : h)
    if (r.t[0]) t0 = std::min(t0, r.t[0]);
  // LILY_TRACE_RAW=FILE: every block's record as text (analysis off line).
  if (const char* raw = std::getenv("LILY_TRACE_RAW"); raw && *raw) {
    if (FILE* f = std::fopen(raw, "a")) {
      for (int l = 0; l < n; ++l)
        for (int b = 0; b < kBlocksCap; ++b) {
          const TraceRec& r = h[size_t(l) * kBlocksCap + b];
          if (!r.t[0]) continue;
          std::fprintf(f, "%d %s %d/%u %u %llu %llu %llu %llu", l, launch_name[l].c_str(), b, r.blocks, r.sm,
                       r.t[0] - t0, r.t[1] ? r.t[1] - t0 : 0ull, r.t[2] ? r.t[2] - t0 : 0ull,
                       r.t[3] ? r.t[3] - t0 : 0ull);
          for (int i = 0; i < 8; ++i) std::fprintf(f, " %u", r.c[i]);
          std::fprintf(f, "\n");
        }
      std::fclose(f);
    }
  }
  // The timer's granularity: the smallest positive gap between marks.
  std::vector<unsigned long long> all;
  for (const TraceRec& r : h)
    for (int i = 0; i < 4; ++i)
      if (r.t[i]) all.push_back(r.t[i]);
  std::sort(all.begin(), all.end());
  unsigned long long gran = ~0ull;
  for (size_t i = 1; i < all.size(); ++i)
    if (all[i] > all[i - 1]) gran = std::min(gran, all[i] - all[i - 1]);
  if (timer_ns) *timer_ns = gran == ~0ull ? 0 : double(gran);
  auto us = [&](unsigned long long t) { return (double(t) - double(t0)) * 1e-3; };
  auto med = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<TracedLaunch> out;
  double prev_end = 0;
  for (int l = 0; l < n; ++l) {
    TracedLaunch L;
    L.name = launch_name[l];
    std::vector<double> entry, wait, end, setup, body, sub[4];
    for (int b = 0; b < kBlocksCap; ++b) {
      const TraceRec& r = h[size_t(l) * kBlocksCap + b];
      if (!r.t[0]) continue;
      entry.push_back(us(r.t[0]));
      if (r.t[1]) wait.push_back(us(r.t[1]));
      if (r.t[3]) end.push_back(us(r.t[3]));
      if (r.t[1] && r.t[2]) setup.push_back(double(r.c[2] - r.c[1]) / sm_mhz);
      if (r.t[2] && r.t[3]) body.push_back(double(r.c[3] - r.c[2]) / sm_mhz);
      for (int i = 0; i < 4; ++i) {
        const unsigned from = i < 3 ? r.c[1] : r.c[2];
        if (r.c[4 + i] && r.t[i < 3 ? 1 : 2]) sub[i].push_back(double(r.c[4 + i] - from) / sm_mhz);
      }
      if (l > 0 && us(r.t[0]) < prev_end) L.pre_launched++;
    }
    L.blocks = static_cast<int>(entry.size());
    if (!entry.empty()) L.entry_first = *std::min_element(entry.begin(), entry.end());
    if (!wait.empty()) L.wait_first = *std::min_element(wait.begin(), wait.end());
    L.wait_med = med(wait);
    L.end_med = med(end);
    L.end_last = end.empty() ? L.wait_first : *std::max_element(end.begin(), end.end());
    L.setup_us = med(setup);
    L.body_us = med(body);
    for (int i = 0; i < 4; ++i) L.sub_us[i] = med(sub[i]);
    prev_end = L.end_last;
    out.push_back(L);
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

double CudaBackend::handover_probe_us(int launches, int blocks, int stage, int pre, bool pdl) {
  Impl& m = *impl_;
  DeviceBuffer x(2048 * 4), y(2048 * 4);
  LILY_CUDA(cudaMemset(x.get(), 0, x.bytes()));
  LILY_CUDA(cudaMemset(y.get(), 0, y.bytes()));
  // A distinct 16 KB per block and launch (no launch's weights in the L2
  // from an earlier one: 4.3 MB per launch at 264 blocks).
  const size_t per_launch = size_t(blocks) * 1024;  // uint4 pieces
  DeviceBuffer w(pre > 0 ? per_launch * launches * 16 : 16);
  if (pre > 0) LILY_CUDA(cudaMemset(w.get(), 0x11, w.bytes()));
  cudaGraphExec_t exec = capture(m.stream, [&] {
    for (int i = 0; i < launches; ++i) {
      const float* in = (i & 1) ? y.as<float>() : x.as<float>();
      float* out = (i & 1) ? x.as<float>() : y.as<float>();
      const uint4* wi = w.as<uint4>() + (pre > 0 ? per_launch * i : 0);
      launch_handover_probe(in, out, wi, stage, pre, blocks, m.stream, pdl);
    }
  });
  const double ms = time_graph_ms(m.stream, exec, 20);
  cudaGraphExecDestroy(exec);
  return ms * 1e3 / launches;
}

namespace {

// The resident probe's chain (launch_resident_probe): `pattern` repeated
// `repeat` times, every launch with its own weights (none in the L2 from an
// earlier one), captured in one graph; milliseconds per replay. marks: when
// set, room for 5 per block of every launch in order.
double resident_graph_ms(cudaStream_t stream, const std::vector<CudaBackend::ResidentLaunch>& pattern, int repeat,
                         int threads, int xbits, bool pdl, unsigned long long* marks, int replays) {
  int dev = 0, sms = 0;
  LILY_CUDA(cudaGetDevice(&dev));
  LILY_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DeviceBuffer x(2048 * 4), y(2048 * 4);
  LILY_CUDA(cudaMemset(x.get(), 0, x.bytes()));
  LILY_CUDA(cudaMemset(y.get(), 0, y.bytes()));
  size_t wtot = 0, stot = 0;  // uint4 pieces, row scales
  for (const auto& l : pattern) {
    wtot += size_t(sms) * l.per_sm * l.rows * 64;
    stot += size_t(sms) * l.per_sm * ((l.rows + 3) & ~3);
  }
  DeviceBuffer w(wtot * repeat * 16), rs(stot * repeat * 4);
  LILY_CUDA(cudaMemset(w.get(), 0x11, w.bytes()));
  cuda::fill_random_f32(rs.as<float>(), stot * repeat, 0.5f, 1.5f, 9, stream);
  cudaGraphExec_t exec = capture(stream, [&] {
    size_t wo = 0, so = 0, mo = 0;
    int i = 0;
    for (int r = 0; r < repeat; ++r)
      for (const auto& l : pattern) {
        const int blocks = sms * l.per_sm;
        const bool dep = !(l.mode & 4);  // without the wait x stays constant
        const float* in = (dep && (i & 1)) ? y.as<float>() : x.as<float>();
        float* out = (dep && (i & 1)) ? x.as<float>() : y.as<float>();
        cuda::launch_resident_probe(in, out, w.as<uint4>() + wo, rs.as<float>() + so, l.rows, blocks, threads, xbits,
                                    l.mode, marks ? marks + mo : nullptr, stream, pdl);
        wo += size_t(blocks) * l.rows * 64;
        so += size_t(blocks) * ((l.rows + 3) & ~3);
        mo += size_t(blocks) * 5;
        ++i;
      }
  });
  const double ms = time_graph_ms(stream, exec, replays);
  cudaGraphExecDestroy(exec);
  return ms;
}

}  // namespace

CudaBackend::ResidentProbe CudaBackend::resident_probe(int launches, int rows, int threads, int xbits, int mode,
                                                      bool pdl, int per_sm) {
  Impl& m = *impl_;
  int dev = 0, blocks = 0;
  LILY_CUDA(cudaGetDevice(&dev));
  LILY_CUDA(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev));
  blocks *= per_sm;
  ResidentProbe r;
  r.mb = double(blocks) * rows * 1024 / 1e6;
  const std::vector<ResidentLaunch> one = {{rows, per_sm, mode}};
  r.us = resident_graph_ms(m.stream, one, launches, threads, xbits, pdl, nullptr, 20) * 1e3 / launches;
  // One more replay with the per-block marks.
  DeviceBuffer marks(size_t(launches) * blocks * 5 * 8);
  resident_graph_ms(m.stream, one, launches, threads, xbits, pdl, marks.as<unsigned long long>(), 1);
  std::vector<unsigned long long> h(size_t(launches) * blocks * 5);
  LILY_CUDA(cudaMemcpy(h.data(), marks.get(), h.size() * 8, cudaMemcpyDeviceToHost));
  const double mhz = cuda::measure_sm_clock_mhz(m.stream);
  std::vector<double> d[4];
  for (int i = launches / 4; i < launches; ++i)
    for (int k = 0; k < blocks; ++k) {
      const unsigned long long* t = h.data() + (size_t(i) * blocks + k) * 5;
      for (int q = 0; q < 4; ++q) d[q].push_back(double(t[q + 1] - t[q]) / mhz);
    }
  auto med = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  r.before_wait_us = med(d[0]);
  r.staging_us = med(d[1]);
  r.weights_wait_us = med(d[2]);
  r.compute_us = med(d[3]);
  return r;
}

CudaBackend::PersistentProbe CudaBackend::persistent_probe(const std::vector<PersistentStage>& chain, int slots,
                                                            int mode) {
  Impl& m = *impl_;
  int dev = 0, sms = 0;
  LILY_CUDA(cudaGetDevice(&dev));
  LILY_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::vector<int2> st;
  size_t rows = 0;
  for (const PersistentStage& c : chain) {
    st.push_back(make_int2(c.rows, c.routed ? 1 : 0));
    rows += size_t(c.rows) * sms;
  }
  PersistentProbe r;
  r.mb = double(rows) * 1024 / 1e6;
  DeviceBuffer stages(st.size() * sizeof(int2)), x0(2048 * 4), buf(2 * 2048 * 4), counter(16), w(rows * 1024),
      marks(size_t(sms) * 4 * 8);
  LILY_CUDA(cudaMemcpy(stages.get(), st.data(), stages.bytes(), cudaMemcpyHostToDevice));
  cuda::fill_random_f32(x0.as<float>(), 2048, -1.f, 1.f, 5, m.stream);
  cuda::fill_random_u32(w.as<uint32_t>(), rows * 256, 11, m.stream);
  auto launch = [&](unsigned long long* mk) {
    cuda::launch_persistent_probe(x0.as<float>(), buf.as<float>(), w.as<uint4>(), stages.as<int2>(), st.data(),
                                  static_cast<int>(st.size()), slots, mode, counter.as<unsigned>(), mk, m.stream);
  };
  cudaGraphExec_t exec = capture(m.stream, [&] { launch(nullptr); });
  r.us = time_graph_ms(m.stream, exec, 10) * 1e3;
  cudaGraphExecDestroy(exec);
  launch(marks.as<unsigned long long>());
  std::vector<unsigned long long> h(size_t(sms) * 4);
  LILY_CUDA(cudaStreamSynchronize(m.stream));
  LILY_CUDA(cudaMemcpy(h.data(), marks.get(), h.size() * 8, cudaMemcpyDeviceToHost));
  const double mhz = cuda::measure_sm_clock_mhz(m.stream);
  auto med = [&](int k) {
    std::vector<double> v;
    for (int b = 0; b < sms; ++b) v.push_back(double(h[size_t(b) * 4 + k]) / mhz);
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  r.dep_wait_us = med(0);
  r.weight_wait_us = med(1);
  r.block_us = med(2);
  r.ring_wait_us = med(3);
  return r;
}

CudaBackend::SampleTiming CudaBackend::sample_timing(const TokenSampling& s, int rows, int iters, uint64_t seed) {
  Impl& m = *impl_;
  const int V = m.c.vocab_size;
  if (rows < 1 || rows > cuda::kMaxSampleRows) fail("sample_timing: ", rows, " rows (1..", cuda::kMaxSampleRows, ")");
  if (!can_sample(s)) fail("sample_timing: these parameters are not sampled on the device");
  // Logits shaped like a language model's: normal, sd 2.5 (a few dozen ids
  // within two nats of the best of 248K), each row its own.
  std::vector<float> h(size_t(rows) * V);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.5f);
  for (float& v : h) v = nd(rng);
  DeviceBuffer logits(h.size() * sizeof(float));
  LILY_CUDA(cudaMemcpy(logits.get(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<TokenSampling> rs(static_cast<size_t>(rows), s);
  std::vector<int> ids(static_cast<size_t>(rows)), drew(static_cast<size_t>(rows));
  cudaEvent_t ev[cuda::kSampleLaunches + 1];
  for (cudaEvent_t& e : ev) LILY_CUDA(cudaEventCreate(&e));
  std::vector<double> call;
  std::vector<std::vector<double>> per;
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  for (int it = 0; it < iters + 3; ++it) {
    for (TokenSampling& r : rs) r.u = ud(rng);
    const auto t0 = std::chrono::steady_clock::now();
    m.sample_rows(rs, logits.as<float>(), ids.data(), drew.data());
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    cuda::spin_device(400000, m.stream);  // ~0.2 ms: the launches behind it are queued when it ends
    const int launches = m.sample_rows(rs, logits.as<float>(), ids.data(), drew.data(), ev);
    if (it < 3) continue;  // warm-up
    call.push_back(us);
    per.resize(static_cast<size_t>(launches));
    for (int k = 0; k < launches; ++k) {
      float ms = 0.f;
      LILY_CUDA(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
      per[size_t(k)].push_back(ms * 1e3);
    }
  }
  for (cudaEvent_t& e : ev) LILY_CUDA(cudaEventDestroy(e));
  auto med = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  SampleTiming t;
  t.call_us = med(call);
  for (auto& v : per) t.kernel_us.push_back(med(v));
  return t;
}

double CudaBackend::resident_chain_us(const std::vector<ResidentLaunch>& chain, int threads) {
  return resident_graph_ms(impl_->stream, chain, 1, threads, 16, true, nullptr, 10) * 1e3;
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

// lily bench: prefill and decode throughput on a real checkpoint or a
// synthetic model of the exact shape and MLX 4-bit layout.
// Decode: the cache is put at the context length directly (random KV rows and
// DeltaNet state), each repeat decodes --tokens greedy tokens from that
// position with the argmax fed back on the device, timed with device events
// after --warmup untimed repeats; the median repeat is reported.
// Prefill (cuda): a prompt of random tokens of each --prefill length into an
// empty cache, wall time of the whole forward up to the last position's
// logits on the host (= time to first token), median of repeats; FLOPs count
// every projection the tokens pass through (the routed experts they select),
// causal attention and the DeltaNet recurrence.
// Bytes per token are the minimum a step must move (weights read once, the
// DeltaNet state read and written, the KV rows read); the fraction is against
// a device-to-device copy measured in the same run.
// Prefix reuse (--reuse P,...; any backend): requests made of one shared
// P-token preamble + --reuse-suffix unique tokens, one token generated each,
// through the engine's generator (the server's code path) with its prefix
// cache on, and with no reuse at all; time to first token per request.
// Generation (--generate N; any backend): N tokens generated after a prompt
// of ctx random tokens through the engine's generator (the server's code
// path: forward, logits on the host, engine::Sampler with the --temperature /
// --top-k / --top-p / --min-p / --seed given, token events), no stop tokens;
// decode rate = tokens after the first over the time from the first token to
// the last (GenerationResult::decode_seconds), median of repeats; the prompt
// is prefilled once, later repeats start from the state the generator keeps
// after it. Next to it the backend's own decode loop over as many steps (N -
// 1) from the same position, timed as the default mode times it (cuda: the
// device loop; cpu: forward per token, argmax fed back on the host).
// --json-object constrains the output to a JSON object (the server's
// response_format json_object: the grammar's token mask at every token) with
// a tokenizer's vocabulary (the model's, or --tokenizer DIR), <|im_end|> /
// <|endoftext|> as stop tokens: a run ends where the object does, so the
// rate is over the tokens each repeat made (the same tokens both ways).
// --logprobs K asks for every token's log-probability and K alternatives
// (the server's logprobs / top_logprobs).
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/generator.h"
#include "model/synthetic.h"
#include "text/json_constraint.h"
#include "text/tokenizer.h"

namespace lily::cli {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::vector<int> random_prompt(std::mt19937& rng, int n, int vocab) {
  std::vector<int> p(static_cast<size_t>(std::max(n, 1)));
  for (int& t : p) t = static_cast<int>(rng() % static_cast<uint32_t>(vocab));
  return p;
}

// Wall time of one forward up to its logits on the host (a backend's forward
// returns once they are there), in ms.
double forward_ms(Backend& b, SequenceCache& cache, std::span<const int> tokens, float* logits) {
  const auto t0 = std::chrono::steady_clock::now();
  b.forward(cache, tokens, LogitsMode::LastOnly, logits);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// n greedy decode steps from the cache's position, each a one-token forward
// fed the argmax of the previous logits (`logits` holds the row to start
// from, and the last row after); wall time in ms.
double host_decode_ms(Backend& b, SequenceCache& cache, std::vector<float>& logits, int n) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    int next = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    b.forward(cache, std::span<const int>(&next, 1), LogitsMode::LastOnly, logits.data());
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Setup {
  std::string model_desc, backend;
  std::vector<int> ctxs, prefill;
  std::string cpu_act = "auto";  // --cpu-act
  int tokens = 64, warmup = 1, repeats = 5;
  uint64_t seed = 1;
  bool profile = false;
  bool trace = false;
  bool handover = false;  // --handover: the hand-over probe (cuda)
  bool persistent = false;  // --persistent: the persistent probe (cuda)
};

#ifdef LILY_HAVE_CUDA
// FLOPs of a prefill of n tokens from an empty cache (multiply-adds x 2).
double prefill_flops(const ModelConfig& c, double n) {
  const double H = c.hidden_size;
  double per_token = 0, attn_pairs = 0, dn = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_kinds[l] == LayerKind::FullAttention) {
      const double q = double(c.num_heads) * c.head_dim * (c.attn_output_gate ? 2 : 1);
      const double kv = double(c.num_kv_heads) * c.head_dim;
      per_token += H * (q + 2 * kv) + double(c.num_heads) * c.head_dim * H;
      attn_pairs += double(c.num_heads) * c.head_dim;  // x 4 x causal pairs below
    } else {
      const double C = c.deltanet_qkv_dim(), V = c.deltanet_value_dim();
      per_token += H * (C + V + 2.0 * c.linear_num_value_heads) + V * H;
      dn += 3.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    }
    const bool moe = l < static_cast<int>(c.layer_is_moe.size()) && c.layer_is_moe[l];
    if (moe) {
      per_token += H * c.num_experts + 3.0 * H * c.moe_intermediate_size * c.num_experts_per_tok;
      if (c.shared_expert_intermediate_size > 0) per_token += 3.0 * H * c.shared_expert_intermediate_size + H;
    } else {
      per_token += 3.0 * H * c.intermediate_size;
    }
  }
  return 2.0 * (per_token + dn) * n + 4.0 * attn_pairs * n * (n + 1) / 2 + 2.0 * H * c.vocab_size;
}

// A traced step (CudaBackend::trace_step) summed per kernel kind. Per launch:
// span = its last block's end minus the previous launch's (the launch's share
// of the step); gap = its first block past the wait minus the previous
// launch's last end (the dependency hand-over); spread = median minus first
// release; setup / body = median block intervals; tail = last end minus
// median end.
nlohmann::ordered_json report_trace(const std::vector<cuda::TracedLaunch>& t, int ctx, double timer_ns,
                                   const std::string& title = "") {
  struct Kind {
    std::string name;
    int launches = 0, blocks = 0, pre = 0;
    double span = 0, gap = 0, spread = 0, setup = 0, body = 0, tail = 0;
    double sub[4] = {0, 0, 0, 0};
  };
  std::vector<Kind> kinds;
  nlohmann::ordered_json per = nlohmann::ordered_json::array();
  double prev_end = t.empty() ? 0 : t.front().entry_first;
  for (const auto& L : t) {
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) { return k.name == L.name; });
    if (it == kinds.end()) {
      kinds.push_back({L.name});
      it = kinds.end() - 1;
    }
    const double span = L.end_last - prev_end, gap = L.wait_first - prev_end;
    it->launches++;
    it->blocks += L.blocks;
    it->pre += L.pre_launched;
    it->span += span;
    it->gap += gap;
    it->spread += L.wait_med - L.wait_first;
    it->setup += L.setup_us;
    it->body += L.body_us;
    it->tail += L.end_last - L.end_med;
    for (int i = 0; i < 4; ++i) it->sub[i] += L.sub_us[i];
    per.push_back({{"kernel", L.name}, {"blocks", L.blocks}, {"pre_launched", L.pre_launched},
                   {"entry_first_us", L.entry_first}, {"wait_first_us", L.wait_first},
                   {"wait_med_us", L.wait_med}, {"setup_us", L.setup_us}, {"body_us", L.body_us},
                   {"end_med_us", L.end_med}, {"end_last_us", L.end_last},
                   {"sub_us", {L.sub_us[0], L.sub_us[1], L.sub_us[2], L.sub_us[3]}}});
    prev_end = L.end_last;
  }
  const double step = t.empty() ? 0 : t.back().end_last - t.front().entry_first;
  std::printf("\ntraced %s, ctx %d: %.1f us from the first block's entry to the last block's end "
              "(global timer granularity %.0f ns); us per step, summed over a kind's launches:\n",
              title.empty() ? "step" : title.c_str(), ctx, step, timer_ns);
  std::printf("  %-20s %8s %9s %8s %8s %8s %8s %8s %6s\n", "kernel", "launches", "span", "gap", "spread",
              "setup", "body", "tail", "%pre");
  Kind tot{"total"};
  for (const Kind& k : kinds) {
    std::printf("  %-20s %8d %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f %5.0f%%\n", k.name.c_str(), k.launches, k.span,
                k.gap, k.spread, k.setup, k.body, k.tail, k.blocks ? 100.0 * k.pre / k.blocks : 0.0);
    tot.launches += k.launches;
    tot.blocks += k.blocks;
    tot.pre += k.pre;
    tot.span += k.span;
    tot.gap += k.gap;
    tot.spread += k.spread;
    tot.setup += k.setup;
    tot.body += k.body;
    tot.tail += k.tail;
  }
  std::printf("  %-20s %8d %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f %5.0f%%\n", "total", tot.launches, tot.span,
              tot.gap, tot.spread, tot.setup, tot.body, tot.tail, tot.blocks ? 100.0 * tot.pre / tot.blocks : 0.0);
  std::printf("  per launch (us, medians over blocks, averaged over launches): setup sub-steps from the wait "
              "(matvec: staged or routed / first x piece or logits in / norm scales or top-k known / setup) and body "
              "(first item / body):\n");
  for (const Kind& k : kinds) {
    const double n = k.launches;
    std::printf("  %-20s %7.2f %7.2f %7.2f %7.2f | %7.2f %7.2f\n", k.name.c_str(), k.sub[0] / n, k.sub[1] / n,
                k.sub[2] / n, k.setup / n, k.sub[3] / n, k.body / n);
  }
  nlohmann::ordered_json j;
  j["ctx"] = ctx;
  j["step_us"] = step;
  j["timer_granularity_ns"] = timer_ns;
  nlohmann::ordered_json kj = nlohmann::ordered_json::array();
  for (const Kind& k : kinds)
    kj.push_back({{"kernel", k.name}, {"launches", k.launches}, {"span_us", k.span}, {"gap_us", k.gap},
                  {"spread_us", k.spread}, {"setup_us", k.setup}, {"body_us", k.body}, {"tail_us", k.tail},
                  {"blocks", k.blocks}, {"pre_launched_blocks", k.pre}});
  j["kinds"] = kj;
  j["launches"] = per;
  return j;
}

nlohmann::ordered_json bench_cuda(std::unique_ptr<ModelWeights> w, const Setup& s,
                                  const std::string& kv) {
  cuda::CudaOptions opt = cuda::options_from_env();
  if (!kv.empty()) {
    if (!cuda::parse_kv_type(kv, opt.kv)) fail("--kv '", kv, "': expected bf16, q8 or f32");
  }
  opt.seed = s.seed;
  const auto t0 = std::chrono::steady_clock::now();
  auto b = cuda::make_cuda_backend(std::move(w), opt);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double copy_gbs = cuda::measure_copy_bandwidth_gbs(size_t(1) << 30, 10);
  const ModelConfig& c = b->config();
  nlohmann::ordered_json j;
  j["device"] = cuda::device_name();
  j["model"] = s.model_desc;
  j["backend"] = "cuda";
  j["kv_dtype"] = cuda::kv_type_name(opt.kv);
  j["q4_matvec_inputs"] = opt.act_bits ? "int" + std::to_string(opt.act_bits) : std::string("f32");
  j["pdl"] = opt.pdl;
  j["graphs"] = opt.graphs;
  j["weight_bytes"] = b->weight_bytes();
  j["launches_per_step"] = b->step_launches();
  j["load_seconds"] = load_s;
  j["copy_bandwidth_gbs"] = copy_gbs;
  j["tokens_per_repeat"] = s.tokens;
  j["warmup"] = s.warmup;
  j["repeats"] = s.repeats;
  j["method"] =
      "KV cache and DeltaNet state filled with random values to the context length (no prefill); "
      "greedy decode with on-device argmax feedback, CUDA graph per step, device-event timing, "
      "median of repeats";
  {
    auto probe = b->new_cache(64);
    j["graph_pdl"] = b->graph_uses_pdl(*probe);
  }
  const double empty_pdl = b->empty_graph_us(252, 264, true), empty_nopdl = b->empty_graph_us(252, 264, false);
  j["empty_kernel_us_pdl"] = empty_pdl;
  j["empty_kernel_us_no_pdl"] = empty_nopdl;
  std::printf("graph captured with PDL: %s   empty-kernel graph: %.2f us/launch with PDL, %.2f without\n",
              j["graph_pdl"].get<bool>() ? "yes" : "no", empty_pdl, empty_nopdl);
  if (s.handover) {
    // The hand-over probe: as many dependent launches as a decode step has,
    // of 264 blocks (the step's matvec grid on an H200), the ingredients of a
    // matvec's setup added one at a time (docs/cuda-decode.md, "v19").
    const int launches = b->step_launches();
    struct Rung {
      const char* name;
      int stage, pre;
    };
    const Rung rungs[] = {{"empty", 0, 0},           {"x read", 1, 0},
                          {"x + norm", 2, 0},        {"x + norm + codes", 3, 0},
                          {"x + 16 KB pre-wait", 1, 4}, {"x + norm + codes + 16 KB pre-wait", 3, 4},
                          {"x + norm + codes + 8 KB pre-wait", 3, 2}};
    nlohmann::ordered_json hj = nlohmann::ordered_json::array();
    std::printf("hand-over probe (%d dependent launches x 264 blocks, us per launch, PDL / no PDL):\n", launches);
    for (const Rung& r : rungs) {
      const double a = b->handover_probe_us(launches, 264, r.stage, r.pre, true);
      const double c = b->handover_probe_us(launches, 264, r.stage, r.pre, false);
      std::printf("  %-36s %6.2f %6.2f\n", r.name, a, c);
      hj.push_back({{"rung", r.name}, {"us_pdl", a}, {"us_no_pdl", c}});
    }
    j["handover_probe"] = hj;
    // The resident probe: each launch's whole weight slice copied into
    // shared memory before the wait (one or two blocks per SM, two or four
    // launches side by side), 2.2-12.6 MB per launch (docs/cuda-decode.md,
    // "v20").
    nlohmann::ordered_json rj = nlohmann::ordered_json::array();
    std::printf("resident probe (%d dependent q4 matvecs of 2048 inputs, weights copied into shared memory; us per "
                "launch, TB/s, and per block (medians): resident before the wait, staging, wait for the weights, "
                "compute):\n",
                launches);
    std::printf("  %-6s %-7s %-5s %-48s %7s %6s %7s %7s %7s %7s\n", "MB", "threads", "codes", "mode", "us", "TB/s",
                "before", "staging", "weights", "compute");
    auto mode_name = [](int mode) {
      std::string n = (mode & 4) ? "no wait" : (mode & 2) ? "copies after wait" : "copies before wait";
      n += (mode & 1) ? ", trigger first" : ", trigger after";
      const int pc = (mode >> 3) & 3;
      if (pc) n += pc == 1 ? ", 1 KB copies" : pc == 2 ? ", 4 KB copies" : ", 64 KB copies";
      if (mode & 32) n += ", cp.async";
      if (mode & 64) n += ", 4 rows";
      return n;
    };
    struct RRung {
      int rows, threads, xbits, mode, per_sm;
    };
    // threads -256: 256 threads at most 64 registers (four blocks resident
    // per SM); per_sm: blocks of one launch per SM.
    const RRung rr[] = {{93, 512, 16, 1, 1},      {93, 512, 16, 5, 1},      {47, -256, 16, 1, 1},
                        {47, -256, 16, 5, 1},     {47, -256, 16, 1 | 64, 1}, {31, -256, 16, 1, 1},
                        {31, 512, 16, 1, 1},      {16, -256, 16, 1, 1},     {16, -256, 16, 5, 1},
                        {47, -256, 8, 1, 1},      {47, -256, 16, 1, 2},     {8, -256, 16, 1, 2},
                        {16, -256, 16, 0, 1},     {16, -256, 16, 2, 1}};
    for (const RRung& q : rr) {
      const auto r = b->resident_probe(launches, q.rows, q.threads, q.xbits, q.mode, true, q.per_sm);
      const std::string mn = mode_name(q.mode);
      std::printf("  %-6.1f %-4d x%d  %-5d %-48s %7.2f %6.2f %7.2f %7.2f %7.2f %7.2f\n", r.mb, q.threads, q.per_sm,
                  q.xbits, mn.c_str(), r.us, r.mb / r.us, r.before_wait_us, r.staging_us, r.weights_wait_us,
                  r.compute_us);
      rj.push_back({{"mb", r.mb}, {"threads", q.threads}, {"blocks_per_sm", q.per_sm}, {"xbits", q.xbits}, {"mode", mn},
                    {"us", r.us}, {"before_wait_us", r.before_wait_us}, {"staging_us", r.staging_us},
                    {"weights_wait_us", r.weights_wait_us}, {"compute_us", r.compute_us}});
    }
    j["resident_probe"] = rj;
    // The resident chain: a model step's sizes as resident-probe launches
    // (Qwen3.6-35B-A3B at 4K: per DeltaNet layer in_proj 12.6 MB, the step's
    // state 2 MB, out_proj 4.2, gate_up 10.6 with its copies after the wait
    // (routed), down 4.7; per attention layer qkv 10.6, the KV 8.4, a
    // combine, o_proj 4.7, gate_up, down; 30 + 10 layers, no lm_head).
    {
      using RL = cuda::CudaBackend::ResidentLaunch;
      // The routed launch (gate_up) has its copies after the wait (mode 3).
      const std::vector<RL> dn2 = {{93, 1, 1}, {16, 1, 1}, {31, 1, 1}, {80, 1, 3}, {35, 1, 1}};
      const std::vector<RL> at2 = {{78, 1, 1}, {62, 1, 1}, {16, 1, 1}, {35, 1, 1}, {80, 1, 3}, {35, 1, 1}};
      const std::vector<RL> dn4 = {{47, 2, 1}, {16, 1, 1}, {31, 1, 1}, {40, 2, 3}, {35, 1, 1}};
      const std::vector<RL> at4 = {{39, 2, 1}, {31, 2, 1}, {16, 1, 1}, {35, 1, 1}, {40, 2, 3}, {35, 1, 1}};
      // routed: 0, as in the patterns; 1, every copy before the wait; 2,
      // 1.5 us of one warp's work (the selection) before the routed copies.
      auto step = [](const std::vector<RL>& dn, const std::vector<RL>& at, int routed) {
        std::vector<RL> s;
        for (int l = 0; l < 40; ++l)
          for (RL r : (l % 4 == 3 ? at : dn)) {
            if ((r.mode & 2) && routed == 1) r.mode &= ~2;
            if ((r.mode & 2) && routed == 2) r.mode |= 128;
            s.push_back(r);
          }
        return s;
      };
      nlohmann::ordered_json cj = nlohmann::ordered_json::array();
      std::printf("resident chain (a 4K step's 210 launches as resident-probe launches, no lm_head; us per step):\n");
      struct CRung {
        const char* name;
        int threads;  // 512 / 256: two launches per SM; -256: four
        int routed;
      };
      const CRung cr[] = {{"2 resident / SM, routed copies after the wait", 512, 0},
                          {"2 resident / SM, every copy before the wait", 512, 1},
                          {"2 resident / SM, routed after a 1.5 us selection", 512, 2},
                          {"2 resident / SM, 256 threads, selection", 256, 2},
                          {"4 resident / SM, routed copies after the wait", -256, 0},
                          {"4 resident / SM, every copy before the wait", -256, 1}};
      for (const CRung& c : cr) {
        const auto pat = c.threads == -256 ? step(dn4, at4, c.routed) : step(dn2, at2, c.routed);
        const double us = b->resident_chain_us(pat, c.threads);
        std::printf("  %-48s %8.1f\n", c.name, us);
        cj.push_back({{"chain", c.name}, {"us_per_step", us}});
      }
      j["resident_chain"] = cj;
    }
  }
  if (s.persistent) {
    // The persistent probe: a 4K step's 210 dependent matvec-shaped stages
    // (the resident chain's rows of 1 KB per SM) in one launch of one block
    // per SM, the weights streamed through a shared-memory ring
    // ahead of the chain, the stages ordered by a global counter
    // (docs/cuda-decode.md, "v28").
    using PS = cuda::CudaBackend::PersistentStage;
    const std::vector<PS> dn = {{93, false}, {16, false}, {31, false}, {80, true}, {35, false}};
    const std::vector<PS> at = {{78, false}, {62, false}, {16, false}, {35, false}, {80, true}, {35, false}};
    std::vector<PS> step, flat16, flat32;
    for (int l = 0; l < 40; ++l)
      for (const PS& p : (l % 4 == 3 ? at : dn)) step.push_back(p);
    for (size_t i = 0; i < step.size(); ++i) {
      flat16.push_back({16, false});
      flat32.push_back({32, false});
    }
    struct PRung {
      const char* name;
      const std::vector<PS>* chain;
      int slots, mode;
    };
    const PRung pr[] = {{"step, 13 slots, routed after the stage + selection", &step, 13, 3},
                        {"step, 13 slots, routed after the stage", &step, 13, 1},
                        {"step, 13 slots, every copy ahead", &step, 13, 0},
                        {"step, 8 slots, routed after the stage + selection", &step, 8, 3},
                        {"step, 4 slots, routed after the stage + selection", &step, 4, 3},
                        {"step, 13 slots, no dependency", &step, 13, 4},
                        {"210 x 16 rows, 13 slots", &flat16, 13, 0},
                        {"210 x 16 rows, no dependency", &flat16, 13, 4},
                        {"210 x 32 rows, 13 slots", &flat32, 13, 0}};
    nlohmann::ordered_json pj = nlohmann::ordered_json::array();
    std::printf("persistent probe (one launch, one block per SM, 210 dependent stages; us per chain, and per block "
                "(medians, us per chain): waiting for the previous stage, for weights, the producer for a free "
                "slot, the block's span):\n");
    std::printf("  %-52s %7s %8s %7s %6s %8s %8s %8s %8s\n", "chain", "MB", "us", "us/stg", "TB/s", "dep", "weights",
                "ring", "span");
    for (const PRung& q : pr) {
      const auto r = b->persistent_probe(*q.chain, q.slots, q.mode);
      const double per = r.us / double(q.chain->size());
      std::printf("  %-52s %7.1f %8.1f %7.2f %6.2f %8.1f %8.1f %8.1f %8.1f\n", q.name, r.mb, r.us, per,
                  r.mb / r.us, r.dep_wait_us, r.weight_wait_us, r.ring_wait_us, r.block_us);
      pj.push_back({{"chain", q.name}, {"mb", r.mb}, {"us", r.us}, {"us_per_stage", per},
                    {"dep_wait_us", r.dep_wait_us}, {"weight_wait_us", r.weight_wait_us},
                    {"ring_wait_us", r.ring_wait_us}, {"block_us", r.block_us}});
    }
    // The same step as resident launches (v20's best routed rung) beside it.
    using RL = cuda::CudaBackend::ResidentLaunch;
    std::vector<RL> res;
    for (const PS& p : step) res.push_back({p.rows, 1, p.routed ? (3 | 128) : 1});
    const double rus = b->resident_chain_us(res, 512);
    std::printf("  %-52s %7s %8.1f %7.2f\n", "resident launches, routed after a selection (v20)", "", rus,
                rus / double(res.size()));
    pj.push_back({{"chain", "resident launches, routed after a selection (v20)"}, {"us", rus}});
    j["persistent_probe"] = pj;
  }
  std::printf("device: %s   model: %s   weights on device: %.2f GB   launches/step: %d\n",
              j["device"].get<std::string>().c_str(), s.model_desc.c_str(), b->weight_bytes() / 1e9,
              b->step_launches());
  std::printf("device-to-device copy: %.0f GB/s (read + write)   kv cache: %s   q4 matvec inputs: %s   load: %.1f s\n\n",
              copy_gbs, cuda::kv_type_name(opt.kv), j["q4_matvec_inputs"].get<std::string>().c_str(), load_s);
  std::printf("%8s %9s %9s %9s %9s %7s %9s %8s\n", "ctx", "tok/s", "ms/tok", "GB/tok", "GB/s", "%copy",
              "peak GiB", "SM MHz");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::vector<std::vector<cuda::KernelTiming>> profiles;
  std::vector<std::pair<int, std::vector<cuda::TracedLaunch>>> traces;
  std::vector<double> trace_timer;
  for (int ctx : s.ctxs) {
    if (ctx + s.tokens + 1 > c.max_position_embeddings && c.max_position_embeddings > 0 && ctx > 0)
      std::fprintf(stderr, "note: ctx %d exceeds the model's max_position_embeddings %d\n", ctx,
                   c.max_position_embeddings);
    auto cache = b->new_cache(ctx + s.tokens + 16);
    std::vector<double> per_tok, prefill_tok_s;
    size_t peak = 0;
    for (int r = 0; r < s.warmup + s.repeats; ++r) {
      b->bench_fill(*cache, ctx, s.seed + 17 * r);
      const double ms = b->time_decode_ms(*cache, s.tokens, 1);
      peak = std::max(peak, cuda::device_memory_used());
      if (r >= s.warmup) per_tok.push_back(ms / s.tokens);
    }
    const double ms_tok = median(per_tok);
    const double clock = cuda::sm_clock_mhz();  // right after the timed repeats
    const double bytes = b->step_bytes(ctx + s.tokens / 2);
    const double gbs = bytes / (ms_tok * 1e-3) / 1e9;
    std::printf("%8d %9.1f %9.3f %9.3f %9.0f %6.1f%% %9.2f %8.0f\n", ctx, 1000.0 / ms_tok, ms_tok,
                bytes / 1e9, gbs, 100.0 * gbs / copy_gbs, peak / double(1ull << 30), clock);
    nlohmann::ordered_json row;
    row["ctx"] = ctx;
    row["decode_tok_s"] = 1000.0 / ms_tok;
    row["ms_per_token"] = ms_tok;
    row["ms_per_token_repeats"] = per_tok;
    row["bytes_per_token"] = bytes;
    row["achieved_gbs"] = gbs;
    row["fraction_of_copy"] = gbs / copy_gbs;
    row["peak_device_bytes"] = peak;
    row["sm_clock_mhz_after"] = clock;
    if (s.profile) {
      b->bench_fill(*cache, ctx, s.seed);
      auto prof = b->profile_step_graphs(*cache, 5);
      nlohmann::ordered_json k = nlohmann::ordered_json::array();
      for (const auto& p : prof)
        k.push_back({{"kernel", p.name}, {"launches", p.launches}, {"ms", p.ms}, {"bytes", p.bytes}});
      row["kernels"] = k;
      profiles.push_back(prof);
    }
    if (s.trace) {
      b->bench_fill(*cache, ctx, s.seed);
      double gran = 0;
      traces.push_back({ctx, b->trace_step(*cache, clock, &gran)});
      trace_timer.push_back(gran);
      // LILY_TRACE_ALONE=kind,kind: those kinds' launches alone as well
      // (the same kernel back to back), to compare with their share above.
      if (const char* al = std::getenv("LILY_TRACE_ALONE"); al && *al) {
        std::string list = al;
        size_t p0 = 0;
        while (p0 <= list.size()) {
          size_t p1 = list.find(',', p0);
          if (p1 == std::string::npos) p1 = list.size();
          const std::string kind = list.substr(p0, p1 - p0);
          if (!kind.empty()) {
            b->bench_fill(*cache, ctx, s.seed);
            report_trace(b->trace_step(*cache, clock, &gran, kind), ctx, gran, kind + " alone");
          }
          p0 = p1 + 1;
        }
      }
    }
    rows.push_back(row);
    cache.reset();
  }
  j["results"] = rows;

  // Prefill: time to first token from an empty cache.
  if (!s.prefill.empty()) {
    constexpr double kFlopCeiling = 790e12;  // dense bf16 matrix product measured on an H200 (KINDS.md)
    j["prefill_path"] = b->prefill_enabled() ? "tensor-core prefill kernels"
                                              : "decode steps (" + b->prefill_disabled_reason() + ")";
    j["prefill_chunk"] = b->prefill_chunk();
    j["flop_ceiling"] = kFlopCeiling;
    std::printf("\nprefill (%s, chunks of %d tokens), random prompt into an empty cache:\n",
                j["prefill_path"].get<std::string>().c_str(), b->prefill_chunk());
    std::printf("%8s %12s %10s %9s %8s %9s\n", "prompt", "prefill t/s", "TTFT ms", "TFLOP/s", "%floor", "peak GiB");
    std::mt19937 rng(static_cast<uint32_t>(s.seed));
    std::vector<float> logits(c.vocab_size);
    {
      auto warm = b->new_cache(4096 + 16);
      forward_ms(*b, *warm, random_prompt(rng, std::min(4096, std::max(s.prefill.front(), 2)), c.vocab_size),
                 logits.data());
    }
    nlohmann::ordered_json prow = nlohmann::ordered_json::array();
    for (int n : s.prefill) {
      const int reps = n >= 65536 ? 1 : n >= 16384 ? 2 : 3;
      std::vector<double> ms;
      size_t peak = 0;
      for (int r = 0; r < reps; ++r) {
        auto cache = b->new_cache(n + 16);
        ms.push_back(forward_ms(*b, *cache, random_prompt(rng, n, c.vocab_size), logits.data()));
        peak = std::max(peak, cuda::device_memory_used());
      }
      const double t = median(ms), flops = prefill_flops(c, n);
      const double tflops = flops / (t * 1e-3) / 1e12;
      std::printf("%8d %12.0f %10.1f %9.1f %7.1f%% %9.2f\n", n, n / (t * 1e-3), t, tflops,
                  100 * tflops * 1e12 / kFlopCeiling, peak / double(1ull << 30));
      prow.push_back({{"prompt_tokens", n}, {"prefill_tok_s", n / (t * 1e-3)}, {"ttft_ms", t},
                      {"ttft_ms_repeats", ms}, {"flops", flops}, {"tflop_s", tflops},
                      {"fraction_of_flop_ceiling", tflops * 1e12 / kFlopCeiling}, {"peak_device_bytes", peak}});
    }
    j["prefill"] = prow;
  }
  if (s.profile) {
    for (size_t i = 0; i < profiles.size(); ++i) {
      std::printf("\nper kernel kind: that kind's launches of one step replayed alone in a graph, ctx %d:\n",
                  s.ctxs[i]);
      std::printf("  %-20s %8s %10s %10s %9s %7s %7s\n", "kernel", "launches", "us", "MB", "GB/s",
                  "%copy", "share");
      double total = 0;
      for (const auto& p : profiles[i]) total += p.ms;
      for (const auto& p : profiles[i]) {
        const double gbs = p.ms > 0 ? p.bytes / (p.ms * 1e-3) / 1e9 : 0;
        std::printf("  %-20s %8d %10.1f %10.2f %9.0f %6.1f%% %6.1f%%\n", p.name.c_str(), p.launches,
                    p.ms * 1e3, p.bytes / 1e6, gbs, 100 * gbs / copy_gbs, 100 * p.ms / total);
      }
      std::printf("  %-20s %8s %10.1f\n", "total", "", total * 1e3);
    }
  }
  if (s.trace) {
    nlohmann::ordered_json tj = nlohmann::ordered_json::array();
    for (size_t i = 0; i < traces.size(); ++i) tj.push_back(report_trace(traces[i].second, traces[i].first, trace_timer[i]));
    j["traces"] = tj;
  }
  return j;
}

// On-device sampling alone (--sampling; cuda): each parameter set on rows of
// random normal logits of the model's vocabulary, 1 row (a decode step) and
// 9 (a draft run's), host time per call and device time per launch.
nlohmann::ordered_json bench_sampling(std::unique_ptr<ModelWeights> w, const Setup& s) {
  cuda::CudaOptions opt = cuda::options_from_env();
  opt.seed = s.seed;
  auto b = cuda::make_cuda_backend(std::move(w), opt);
  const int V = b->config().vocab_size;
  struct Set {
    const char* name;
    TokenSampling t;
  };
  auto make = [](float temp, int k, float top_p, float min_p) {
    TokenSampling t;
    t.temperature = temp;
    t.top_k = k;
    t.top_p = top_p;
    t.min_p = min_p;
    return t;
  };
  TokenSampling pen = make(0.7f, 20, 0.8f, 0.f);
  pen.rep_penalty = 1.1f;
  for (int id = 7; id < V && pen.adjust.size() < 2000; id += 97) {
    LogitAdjust a;
    a.id = id;
    a.ops = LogitAdjust::kRep | LogitAdjust::kSub;
    a.sub = 1.5f;
    pen.adjust.push_back(a);
  }
  const Set sets[] = {{"greedy through the kernels (kc 1)", make(0.f, 1, 1.f, 0.f)},
                      {"T0.7 top_k20 top_p0.8", make(0.7f, 20, 0.8f, 0.f)},
                      {"  + rep 1.1, presence 1.5 on 2000 ids", pen},
                      {"T1.0 top_k128", make(1.f, 128, 1.f, 0.f)},
                      {"T1.0 (whole vocabulary)", make(1.f, 0, 1.f, 0.f)},
                      {"T0.7 top_p0.8 (whole)", make(0.7f, 0, 0.8f, 0.f)},
                      {"T0.7 top_p0.95 min_p0.05 (whole)", make(0.7f, 0, 0.95f, 0.05f)}};
  nlohmann::ordered_json j, rj = nlohmann::ordered_json::array();
  j["device"] = cuda::device_name();
  j["model"] = s.model_desc;
  j["vocab"] = V;
  j["method"] = "rows of normal(0, 2.5) logits; host time of one sampling call (adjustments up, launches, result "
                "back, synchronised) and device time of each launch (events), medians of 200";
  std::printf("on-device sampling, vocabulary %d (%s): us per call (host) | per launch (device)\n", V,
              cuda::device_name().c_str());
  for (const Set& set : sets)
    for (int rows : {1, 9}) {
      if (!b->can_sample(set.t)) {
        std::printf("  %-40s rows %2d: not sampled on the device with these options\n", set.name, rows);
        continue;
      }
      const auto t = b->sample_timing(set.t, rows, 200, s.seed);
      std::printf("  %-40s rows %2d: %7.1f |", set.name, rows, t.call_us);
      double sum = 0;
      for (double k : t.kernel_us) {
        std::printf(" %6.1f", k);
        sum += k;
      }
      std::printf("  (sum %.1f)\n", sum);
      rj.push_back({{"set", set.name}, {"rows", rows}, {"call_us", t.call_us}, {"kernel_us", t.kernel_us}});
    }
  j["results"] = rj;
  return j;
}

#endif

// Bytes one decode step of the CPU backend reads at context ctx: every
// matrix but the embedding (one row) and the routed experts (top-k of them
// per MoE layer, at the first expert's size), the f32 KV rows of the
// attention layers, and each DeltaNet state read and written.
double cpu_decode_bytes(const ModelWeights& w, int ctx) {
  const ModelConfig& c = w.config;
  double b = w.lm_head.storage_bytes() + double(w.embed.storage_bytes()) / std::max(1, w.embed.rows);
  auto mlp = [](const MlpWeights& m) {
    return double(m.gate.storage_bytes() + m.up.storage_bytes() + m.down.storage_bytes());
  };
  for (const LayerWeights& L : w.layers) {
    if (L.kind == LayerKind::FullAttention) {
      const AttentionWeights& A = L.attn;
      b += A.q.storage_bytes() + A.k.storage_bytes() + A.v.storage_bytes() + A.o.storage_bytes();
      b += 2.0 * 4 * c.num_kv_heads * c.head_dim * (ctx + 1);
    } else {
      const DeltaNetWeights& D = L.deltanet;
      b += D.in_qkv.storage_bytes() + D.in_z.storage_bytes() + D.in_b.storage_bytes() + D.in_a.storage_bytes() +
           D.out.storage_bytes();
      b += 2.0 * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    }
    if (L.is_moe) {
      b += L.moe.router.storage_bytes();
      if (!L.moe.experts.empty()) b += c.num_experts_per_tok * mlp(L.moe.experts[0]);
      if (L.moe.has_shared) b += mlp(L.moe.shared) + L.moe.shared_gate.storage_bytes();
    } else {
      b += mlp(L.mlp);
    }
  }
  return b;
}

// The host's read bandwidth with `threads` threads (0: all): sums over a
// 512 MiB buffer (well past any cache), best of 5 passes.
double host_read_gbs(int threads) {
  const size_t n = (size_t(512) << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  ThreadPool pool(threads > 0 ? threads : 0);
  std::vector<uint64_t> sums(pool.size() * 64);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, n / pool.size(), [&](size_t b, size_t e) {
      uint64_t acc[8] = {};
      for (size_t i = b; i + 8 <= e; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += buf[i + k];
      sums[(b * pool.size() / n) * 8] += acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    });
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n * sizeof(uint64_t) / sec / 1e9);
  }
  static volatile uint64_t sink = 0;
  for (uint64_t v : sums) sink = sink + v;
  return best;
}

nlohmann::ordered_json bench_cpu(std::unique_ptr<ModelWeights> w, const Setup& s, int threads) {
  std::vector<double> bytes;
  for (int ctx : s.ctxs) bytes.push_back(cpu_decode_bytes(*w, ctx + s.tokens / 2));
  const double read_gbs = host_read_gbs(threads);
  BackendOptions opt;
  opt.kind = "cpu";
  opt.cpu_act = s.cpu_act;
  opt.threads = threads;
  auto b = make_backend(std::move(w), opt);
  const ModelConfig& c = b->config();
  nlohmann::ordered_json j;
  j["device"] = "cpu";
  j["model"] = s.model_desc;
  j["backend"] = "cpu";
  j["threads"] = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  j["matmul_path"] = cpu::matmul_isa_name(cpu::matmul_isa());
  const bool autoq = (s.cpu_act.empty() || s.cpu_act == "auto") && cpu::integer_inputs_supported();
  const std::string ik = std::string(" (") + cpu::integer_kernel_name(cpu::integer_kernel()) + ")";
  j["quantized_inputs"] = s.cpu_act == "q8" ? "q8" + ik : s.cpu_act == "q16" || autoq ? "q16" + ik : "f32";
  j["host_read_gbs"] = read_gbs;
  j["method"] = "prompt of random tokens prefilled to the context length, then timed greedy decode";
  std::printf("cpu: %d threads   matmul: %s, inputs of quantized weights %s   host read bandwidth: %.1f GB/s   "
              "model: %s\n\n",
              j["threads"].get<int>(), j["matmul_path"].get<std::string>().c_str(),
              j["quantized_inputs"].get<std::string>().c_str(), read_gbs, s.model_desc.c_str());
  std::printf("%8s %12s %9s %9s %9s %9s %7s\n", "ctx", "prefill t/s", "tok/s", "ms/tok", "GB/tok", "GB/s",
              "%read");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::mt19937 rng(static_cast<uint32_t>(s.seed));
  for (size_t ci = 0; ci < s.ctxs.size(); ++ci) {
    const int ctx = s.ctxs[ci];
    std::vector<double> per_tok, prefill_tok_s;
    for (int r = 0; r < s.warmup + s.repeats; ++r) {
      auto cache = b->new_cache(ctx + s.tokens + 1);
      std::vector<float> logits(c.vocab_size);
      const std::vector<int> prompt = random_prompt(rng, ctx, c.vocab_size);
      const double prefill_ms = forward_ms(*b, *cache, prompt, logits.data());
      if (r >= s.warmup) prefill_tok_s.push_back(prompt.size() / (prefill_ms * 1e-3));
      const double ms = host_decode_ms(*b, *cache, logits, s.tokens);
      if (r >= s.warmup) per_tok.push_back(ms / s.tokens);
    }
    const double ms_tok = median(per_tok);
    const double pf = median(prefill_tok_s);
    const double gbs = bytes[ci] / (ms_tok * 1e-3) / 1e9;
    std::printf("%8d %12.1f %9.2f %9.2f %9.3f %9.1f %6.1f%%\n", ctx, pf, 1000.0 / ms_tok, ms_tok, bytes[ci] / 1e9,
                gbs, 100 * gbs / read_gbs);
    rows.push_back({{"ctx", ctx},
                    {"prefill_tok_s", pf},
                    {"decode_tok_s", 1000.0 / ms_tok},
                    {"ms_per_token", ms_tok},
                    {"bytes_per_token", bytes[ci]},
                    {"achieved_gbs", gbs},
                    {"fraction_of_read", gbs / read_gbs}});
  }
  j["results"] = rows;
  return j;
}

// The backend a benchmark asked for (--backend, --threads, --kv, --cpu-act).
std::unique_ptr<Backend> bench_backend(std::unique_ptr<ModelWeights> w, const Setup& s, int threads,
                                       const std::string& kv) {
  BackendOptions opt;
  opt.kind = s.backend;
  opt.cpu_act = s.cpu_act;
  opt.threads = threads;
  opt.kv_cache = kv;
  return make_backend(std::move(w), opt);
}

// What a speculative draft run costs against a decode step, per context:
// forward_draft of T tokens (the token fed and T - 1 drafts) settled by
// accept_draft keeping all of them, and keeping only the first (the cost of
// a rejected draft: the DeltaNet state replayed or recomputed). A run that
// yields 1 + a tokens (a drafts matched) pays when 1 + a exceeds its cost
// in decode steps. Runs and steps alternate; medians.
nlohmann::ordered_json bench_draft(std::unique_ptr<ModelWeights> w, const Setup& s, const std::vector<int>& runs,
                                   int threads, const std::string& kv) {
  auto b = bench_backend(std::move(w), s, threads, kv);
  const int V = b->config().vocab_size;
  nlohmann::ordered_json j;
  j["model"] = s.model_desc;
  j["backend"] = b->name();
  j["method"] = "forward_draft of T random tokens + accept_draft(T) or (1), against a 1-token forward; medians of "
                "alternating repeats after a prefill of ctx random tokens; picked_*: the same with the rows' (and "
                "the step's) greedy tokens chosen by the backend (forward_draft_sample, forward_sample)";
  j["max_draft_run"] = b->max_draft_run();
  // Where the backend samples a run's rows itself (greedy here), the same
  // runs that way too, against a step that samples itself: only ids come
  // back instead of rows of logits.
  TokenSampling greedy;
  const bool sampled = b->can_sample(greedy) && b->can_sample_draft(greedy);
  j["rows_sampled_on_backend"] = sampled;
  std::printf("draft runs: backend %s (max run %d), %s\n\n", b->name().c_str(), b->max_draft_run(),
              s.model_desc.c_str());
  std::printf("%8s %4s %10s %12s %8s %12s %8s", "ctx", "T", "step ms", "run+keep all", "x step", "run+keep 1",
              "x step");
  if (sampled) std::printf(" %12s %12s %8s", "step+pick ms", "run+pick all", "x step");
  std::printf("\n");
  std::mt19937 rng(static_cast<uint32_t>(s.seed));
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  int max_run = 1;
  for (int T : runs) max_run = std::max(max_run, T);
  for (int ctx : s.ctxs) {
    auto cache = b->new_cache(ctx + (s.warmup + s.repeats) * (3 * max_run + 3) * static_cast<int>(runs.size()) + 8);
    std::vector<float> logits(static_cast<size_t>(max_run) * V);
    forward_ms(*b, *cache, random_prompt(rng, std::max(ctx, 1), V), logits.data());
    for (int T : runs) {
      std::vector<double> step, all, one, pstep, pall;
      for (int r = 0; r < s.warmup + s.repeats; ++r) {
        const std::vector<int> t1 = random_prompt(rng, 1, V), run = random_prompt(rng, T, V);
        const double st = forward_ms(*b, *cache, t1, logits.data());
        auto since = [](std::chrono::steady_clock::time_point t0) {
          return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        };
        auto timed = [&](int keep) {
          const auto t0 = std::chrono::steady_clock::now();
          b->forward_draft(*cache, run, logits.data());
          b->accept_draft(*cache, keep);
          return since(t0);
        };
        const double a = timed(T), o = timed(1);
        double ps = 0, pa = 0;
        if (sampled) {
          bool drew = false;
          auto t0 = std::chrono::steady_clock::now();
          b->forward_sample(*cache, t1[0], greedy, drew);
          ps = since(t0);
          const std::vector<TokenSampling> each(static_cast<size_t>(T), greedy);
          std::vector<int> ids(static_cast<size_t>(T)), drews(static_cast<size_t>(T));
          t0 = std::chrono::steady_clock::now();
          b->forward_draft_sample(*cache, run, each, ids.data(), drews.data());
          b->accept_draft(*cache, T);
          pa = since(t0);
        }
        if (r < s.warmup) continue;
        step.push_back(st);
        all.push_back(a);
        one.push_back(o);
        pstep.push_back(ps);
        pall.push_back(pa);
      }
      const double ms = median(step), ma = median(all), mo = median(one);
      std::printf("%8d %4d %10.3f %12.3f %8.2f %12.3f %8.2f", ctx, T, ms, ma, ma / ms, mo, mo / ms);
      nlohmann::ordered_json row = {{"ctx", ctx},
                                    {"run_tokens", T},
                                    {"step_ms", ms},
                                    {"run_keep_all_ms", ma},
                                    {"run_keep_one_ms", mo},
                                    {"keep_all_steps", ma / ms},
                                    {"keep_one_steps", mo / ms}};
      if (sampled) {
        const double mps = median(pstep), mpa = median(pall);
        std::printf(" %12.3f %12.3f %8.2f", mps, mpa, mpa / mps);
        row["picked_step_ms"] = mps;
        row["picked_run_keep_all_ms"] = mpa;
        row["picked_keep_all_steps"] = mpa / mps;
      }
      std::printf("\n");
      rows.push_back(std::move(row));
    }
  }
  j["results"] = rows;
  return j;
}

nlohmann::ordered_json bench_reuse(std::unique_ptr<ModelWeights> w, const Setup& s, const std::vector<int>& preambles,
                                   int suffix, int requests, int threads, const std::string& kv) {
  auto b = bench_backend(std::move(w), s, threads, kv);
  const int V = b->config().vocab_size;
  nlohmann::ordered_json j;
  j["model"] = s.model_desc;
  j["backend"] = b->name();
  j["method"] = "requests of one shared preamble + unique tokens, 1 token generated, generator with prefix cache on / off";
  j["suffix_tokens"] = suffix;
  j["requests"] = requests;
  std::printf("prefix reuse: %d requests of a shared preamble + %d unique tokens, 1 token generated; backend %s; "
              "model: %s\n\n",
              requests, suffix, b->name().c_str(), s.model_desc.c_str());
  std::printf("%9s %6s %10s %12s   %s\n", "preamble", "cache", "TTFT (ms)", "speed-up", "per request: TTFT ms / cached tokens");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int P : preambles) {
    std::mt19937 rng(static_cast<uint32_t>(s.seed));
    const std::vector<int> pre = random_prompt(rng, P, V);
    std::vector<std::vector<int>> prompts;
    for (int r = 0; r < requests; ++r) {
      std::vector<int> p = pre;
      const std::vector<int> own = random_prompt(rng, suffix, V);
      p.insert(p.end(), own.begin(), own.end());
      prompts.push_back(std::move(p));
    }
    double off_ms = 0;
    for (bool on : {false, true}) {
      engine::Generator g(*b, nullptr, P + suffix + 8);
      g.prefill_chunk = 4096;
      if (!on) g.set_prefix_cache(0, 0);
      std::vector<double> ms;
      std::vector<int> cached;
      for (const auto& p : prompts) {
        engine::GenerationParams gp;
        gp.prompt = p;
        gp.sampling.temperature = 0;
        gp.max_tokens = 1;
        gp.reuse_prefix = on;  // off: every prompt prefilled whole
        const auto res = g.generate(gp, [](engine::GenerationEvent&&) { return true; });
        ms.push_back(res.prefill_seconds * 1e3);
        cached.push_back(res.cached_tokens);
      }
      // Steady state: from the third request on (the second keeps the branch point).
      const double steady = median(std::vector<double>(ms.begin() + std::min<size_t>(2, ms.size() - 1), ms.end()));
      if (!on) off_ms = steady;
      std::string per;
      for (size_t i = 0; i < ms.size(); ++i) per += str_cat(i ? "  " : "", static_cast<long long>(ms[i] + 0.5), "/", cached[i]);
      std::printf("%9d %6s %10.1f %11.2fx   %s\n", P, on ? "on" : "off", steady, on ? off_ms / steady : 1.0, per.c_str());
      rows.push_back({{"preamble", P},
                      {"cache", on},
                      {"ttft_ms_steady", steady},
                      {"ttft_ms", ms},
                      {"cached_tokens", cached},
                      {"prefix_cache_bytes", g.prefix_cache().bytes()}});
    }
  }
  j["results"] = rows;
  return j;
}

// The backend's own decode loop, timed as the default mode times it: ms per
// step of each of --repeats runs of `steps` greedy steps from position ctx,
// after --warmup untimed ones. cuda: random KV rows and DeltaNet state put
// at ctx, the argmax fed back on the device, device events; other backends:
// a prefill of ctx random tokens (once, copied into the cache each repeat),
// then host_decode_ms.
std::vector<double> backend_decode_ms(Backend& b, const Setup& s, int ctx, int steps, std::mt19937& rng) {
  auto cache = b.new_cache(ctx + steps + 16);
  std::unique_ptr<SequenceCache> base;
  std::vector<float> prefilled, logits;
  std::function<double(int)> once;  // one run (repeat r), its ms
#ifdef LILY_HAVE_CUDA
  if (auto* cb = dynamic_cast<cuda::CudaBackend*>(&b))
    once = [&, cb](int r) {
      cb->bench_fill(*cache, ctx, s.seed + 17 * r);
      return cb->time_decode_ms(*cache, steps, 1);
    };
#endif
  if (!once) {
    base = b.new_cache(ctx + 1);
    prefilled.resize(b.config().vocab_size);
    forward_ms(b, *base, random_prompt(rng, ctx, b.config().vocab_size), prefilled.data());
    once = [&](int) {
      b.copy_cache(*base, *cache);
      logits = prefilled;
      return host_decode_ms(b, *cache, logits, steps);
    };
  }
  std::vector<double> per_tok;
  for (int r = 0; r < s.warmup + s.repeats; ++r) {
    const double ms = once(r);
    if (r >= s.warmup) per_tok.push_back(ms / steps);
  }
  return per_tok;
}

// Generation as a client of the server sees it (the file's header).
nlohmann::ordered_json bench_generate(std::unique_ptr<ModelWeights> w, const Setup& s, int tokens,
                                      const engine::SamplingParams& sampling, int threads, const std::string& kv,
                                      const text::Tokenizer* constrain, int logprobs) {
  auto b = bench_backend(std::move(w), s, threads, kv);
  const int V = b->config().vocab_size;
  const int steps = tokens - 1;  // forwards between the first token and the last
  std::vector<int> stop_ids;
  if (constrain) {
    if (constrain->vocab_size() > V)
      fail("bench --json-object: the tokenizer's ", constrain->vocab_size(), " tokens exceed the model's vocabulary of ",
           V);
    for (const char* t : {"<|im_end|>", "<|endoftext|>"})
      if (const std::optional<int> id = constrain->token_to_id(t)) stop_ids.push_back(*id);
    if (stop_ids.empty()) fail("bench --json-object: the tokenizer has neither <|im_end|> nor <|endoftext|>");
  }
  const std::string how =
      sampling.greedy() ? std::string("greedy")
                        : str_cat("temperature ", sampling.temperature, ", top-k ", sampling.top_k, ", top-p ",
                                  sampling.top_p, ", min-p ", sampling.min_p, ", seed ", sampling.seed);
  nlohmann::ordered_json j;
  j["model"] = s.model_desc;
  j["backend"] = b->name();
  j["method"] = "N tokens generated through the engine's generator after a prompt of ctx random tokens (prefilled "
                "once), no stop tokens; decode = tokens after the first over the time from the first token to the "
                "last, median of repeats; against the backend's decode loop over N - 1 steps from ctx, timed as "
                "the default mode times it";
  j["backend_loop"] = b->name() == "cuda" ? "device loop: random KV and DeltaNet state at ctx, argmax fed back on "
                                            "the device, device-event timing"
                                          : "forward per token after a prefill of ctx random tokens, argmax fed "
                                            "back on the host, wall time";
  j["generate_tokens"] = tokens;
  j["sampling"] = {{"temperature", sampling.temperature}, {"top_k", sampling.top_k}, {"top_p", sampling.top_p},
                   {"min_p", sampling.min_p}, {"seed", sampling.seed}};
  j["constrained"] = constrain ? "json_object" : "none";
  j["top_logprobs"] = logprobs;  // -1: none
  j["warmup"] = s.warmup;
  j["repeats"] = s.repeats;
  // Where the backend takes the request (Backend::can_sample), the
  // generator runs it both ways, alternating repeats: the token chosen by
  // the backend (its default) and on the host (backend_sampling off).
  engine::Sampler probe(sampling);
  std::optional<TokenSampling> request = probe.backend_request({}, 0, static_cast<size_t>(V));
  if (request && constrain) request->allow.assign(allow_words(static_cast<size_t>(V)), ~0u);
  TokenLogprobs probe_lp;
  if (request && logprobs >= 0) {
    request->logprobs = logprobs;
    request->logprobs_out = &probe_lp;
  }
  const bool both = request && b->can_sample(*request);
  j["backend_picks"] = both;
  const std::string lp_how = logprobs >= 0 ? str_cat(", logprobs with ", logprobs, " alternatives") : std::string();
  std::printf("generation: %s%d token%s through the generator (%s%s%s; chosen %s) against the backend's decode "
              "loop; backend %s; model: %s\n",
              constrain ? "up to " : "", tokens, tokens == 1 ? "" : "s", how.c_str(),
              constrain ? ", a JSON object by the grammar's mask" : "", lp_how.c_str(),
              both ? "by the backend, and on the host for comparison" : "on the host", b->name().c_str(),
              s.model_desc.c_str());
  if (steps == 0) std::printf("(one token: only the prefill's, no decode to time)\n");
  std::printf("\n%8s %10s %11s %10s %11s %10s %11s %9s\n", "ctx", "gen tok/s", "gen ms/tok", "host tok/s",
              "host ms/tok", "loop tok/s", "loop ms/tok", "gen/loop");
  std::mt19937 rng(static_cast<uint32_t>(s.seed));
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (int ctx : s.ctxs) {
    const int P = std::max(ctx, 1);
    std::vector<double> gen, host;
    std::vector<int> made;  // tokens of each generation (all of N unless constrained)
    bool same_tokens = true;  // the first repeat's, host against backend
    bool same_fresh = true;   // the first repeat's against a second generator's (a new prefill)
    int generated = 0, cached = 0;
    double first_ttft_ms = 0;
    {
      engine::GenerationParams gp;
      gp.prompt = random_prompt(rng, P, V);
      gp.sampling = sampling;
      gp.max_tokens = tokens;
      gp.reuse_prefix = true;
      gp.speculative_tokens = 0;
      gp.top_logprobs = logprobs;
      if (constrain) {
        gp.json_grammar = text::JsonGrammar::any_object();
        gp.stop_token_ids = stop_ids;
      }
      // The generator keeps only the state after the prompt (no parked live
      // sequence, no branch point): every repeat, on the host or not, starts
      // from it, no new prefill.
      engine::Generator g(*b, constrain, P + tokens);
      g.keep_min_tokens = INT_MAX;
      // One generation: ms per decode step (NaN without steps).
      std::vector<int> ids;  // this generation's tokens
      auto once = [&](bool on_backend, int r) {
        g.backend_sampling = on_backend;
        ids.clear();
        const auto res = g.generate(gp, [&](engine::GenerationEvent&& e) {
          if (e.token) ids.push_back(e.token->id);
          return true;
        });
        generated = static_cast<int>(ids.size());
        const bool early = constrain && res.finish == engine::FinishReason::Stop && generated >= 2;
        if (res.completion_tokens != generated || (generated != tokens && !early))
          fail("bench --generate: the generator stopped after ", generated, " of ", tokens, " tokens (",
               engine::finish_reason_name(res.finish), ")");
        if (r == 0) first_ttft_ms = res.prefill_seconds * 1e3;
        cached = res.cached_tokens;
        made.push_back(generated);
        return steps > 0 ? res.decode_seconds * 1e3 / (generated - 1) : std::nan("");
      };
      std::vector<int> first_ids;
      for (int r = 0; r < s.warmup + s.repeats; ++r) {
        const double h = once(false, r);
        const std::vector<int> host_ids = ids;
        const double d = both ? once(true, r) : h;
        if (r == 0) first_ids = ids;
        // The same tokens both ways (sampling.h: up to last-bit differences
        // of the sums, which a seeded bench run does not meet in practice).
        if (both && r == 0 && ids != host_ids) {
          size_t at = 0;
          while (at < ids.size() && at < host_ids.size() && ids[at] == host_ids[at]) ++at;
          std::printf("note: the backend's tokens differ from the host's at token %zu of %zu / %zu (%d / %d)\n", at,
                      ids.size(), host_ids.size(), at < ids.size() ? ids[at] : -1,
                      at < host_ids.size() ? host_ids[at] : -1);
          same_tokens = false;
        }
        if (r < s.warmup) continue;
        host.push_back(h);
        gen.push_back(d);
      }
      // A second generator prefills the prompt anew: the prefill's sums are
      // added in a fixed order, so its first token, and the rest, are the
      // first generator's.
      engine::Generator g2(*b, constrain, P + tokens);
      g2.keep_min_tokens = INT_MAX;
      g2.backend_sampling = both;
      std::vector<int> fresh;
      g2.generate(gp, [&](engine::GenerationEvent&& e) {
        if (e.token) fresh.push_back(e.token->id);
        return true;
      });
      if (fresh != first_ids) {
        std::printf("note: a second prefill of the prompt gave other tokens (%zu / %zu, first %d / %d)\n",
                    fresh.size(), first_ids.size(), fresh.empty() ? -1 : fresh[0],
                    first_ids.empty() ? -1 : first_ids[0]);
        same_fresh = false;
      }
    }
    const std::vector<double> loop = steps > 0 ? backend_decode_ms(*b, s, P, steps, rng) : std::vector<double>{};
    // NaN (null in the JSON) without decode steps.
    const double nan = std::nan("");
    const double gen_ms = steps > 0 ? median(gen) : nan, host_ms = steps > 0 ? median(host) : nan,
                 loop_ms = steps > 0 ? median(loop) : nan;
    std::printf("%8d %10.1f %11.3f %10.1f %11.3f %10.1f %11.3f %8.1f%%\n", ctx, 1000.0 / gen_ms, gen_ms,
                1000.0 / host_ms, host_ms, 1000.0 / loop_ms, loop_ms, 100.0 * loop_ms / gen_ms);
    rows.push_back({{"ctx", ctx},
                    {"prompt_tokens", P},
                    {"generated_tokens", generated},
                    {"generated_tokens_each", made},
                    {"same_tokens", same_tokens},
                    {"same_tokens_after_a_new_prefill", same_fresh},
                    {"cached_tokens", cached},
                    {"first_ttft_ms", first_ttft_ms},
                    {"decode_tok_s", 1000.0 / gen_ms},
                    {"ms_per_token", gen_ms},
                    {"ms_per_token_repeats", gen},
                    {"host_sampling_decode_tok_s", 1000.0 / host_ms},
                    {"host_sampling_ms_per_token", host_ms},
                    {"host_sampling_ms_per_token_repeats", host},
                    {"backend_decode_tok_s", 1000.0 / loop_ms},
                    {"backend_ms_per_token", loop_ms},
                    {"backend_ms_per_token_repeats", loop},
                    {"overhead_ms_per_token", gen_ms - loop_ms}});
  }
  j["results"] = rows;
  return j;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  Args a(argc, argv,
         {"--model", "--synthetic", "--ctx", "--backend", "--tokens", "--warmup", "--repeats", "--kv",
          "--json", "--seed", "--threads", "--prefill", "--reuse", "--reuse-suffix", "--reuse-requests", "--draft",
          "--cpu-act", "--generate", "--temperature", "--top-k", "--top-p", "--min-p", "--tokenizer", "--logprobs"},
         {"--profile", "--trace", "--handover", "--persistent", "--sampling", "--json-object"});
  Setup s;
  s.backend = resolve_backend_kind(a.str("--backend", "auto"));  // as make_backend settles `auto`
  s.cpu_act = a.str("--cpu-act", "auto");
  s.ctxs = parse_int_list(a.str("--ctx", "256,4096"), "--ctx");
  if (a.has("--prefill") && a.str("--prefill") != "none") s.prefill = parse_int_list(a.str("--prefill"), "--prefill");
  s.tokens = static_cast<int>(a.integer("--tokens", 64, 1, 1 << 16));
  s.warmup = static_cast<int>(a.integer("--warmup", 1, 0, 1000));
  s.repeats = static_cast<int>(a.integer("--repeats", 5, 1, 1000));
  s.seed = static_cast<uint64_t>(a.integer("--seed", 1, 0, 1ll << 62));
  s.profile = a.has("--profile");
  s.trace = a.has("--trace");
  s.handover = a.has("--handover");
  s.persistent = a.has("--persistent");
  if (a.has("--model") == a.has("--synthetic")) fail("bench: give exactly one of --model DIR, --synthetic NAME");
  if (a.has("--draft") + a.has("--reuse") + a.has("--generate") + a.has("--sampling") > 1)
    fail("bench: give at most one of --draft, --reuse, --generate, --sampling");
  if (a.has("--sampling") && s.backend != "cuda") fail("bench --sampling: on-device sampling is the cuda backend's");
  for (const char* f : {"--handover", "--persistent", "--profile", "--trace"})
    if (a.has(f) && s.backend != "cuda") fail("bench ", f, ": a probe of the cuda backend (give --backend cuda)");
  // --generate: checked before the model loads.
  for (const char* f : {"--temperature", "--top-k", "--top-p", "--min-p", "--json-object", "--tokenizer", "--logprobs"})
    if (a.has(f) && !a.has("--generate")) fail("bench: ", f, " is for --generate");
  const int generate = static_cast<int>(a.integer("--generate", 0, 1, 100000));
  engine::SamplingParams sampling;
  sampling.temperature = static_cast<float>(a.number("--temperature", 0, 0, 100));
  sampling.top_k = static_cast<int>(a.integer("--top-k", 0, 0, 1 << 20));
  sampling.top_p = static_cast<float>(a.number("--top-p", 1, 0, 1));
  sampling.min_p = static_cast<float>(a.number("--min-p", 0, 0, 1));
  sampling.seed = s.seed;
  sampling.has_seed = true;
  sampling.validate();  // what the flags' ranges leave (top-p 0)
  std::unique_ptr<ModelWeights> w;
  if (a.has("--synthetic")) {
    const std::string name = a.str("--synthetic");
    // The cuda backend generates synthetic weights on the device.
    w = make_synthetic_model(name, s.seed, s.backend != "cuda");
    s.model_desc = name + " (synthetic: random weights, exact shapes, MLX affine 4-bit g64, 8-bit router)";
  } else {
    w = load_model(a.str("--model"));
    s.model_desc = a.str("--model");
  }
  nlohmann::ordered_json j;
  if (a.has("--sampling")) {
#ifdef LILY_HAVE_CUDA
    j = bench_sampling(std::move(w), s);
#else
    fail("bench --sampling: lily was built without CUDA");
#endif
  } else if (a.has("--generate")) {
    std::optional<text::Tokenizer> tok;
    if (a.has("--json-object")) {
      if (!a.has("--tokenizer") && !a.has("--model"))
        fail("bench --json-object: a synthetic model needs --tokenizer DIR (the grammar masks by token bytes)");
      tok.emplace(text::Tokenizer::from_dir(a.str("--tokenizer", a.str("--model", ""))));
    }
    j = bench_generate(std::move(w), s, generate, sampling, static_cast<int>(a.integer("--threads", 0, 0, 1024)),
                       a.str("--kv"), tok ? &*tok : nullptr,
                       a.has("--logprobs") ? static_cast<int>(a.integer("--logprobs", 0, 0, kMaxBackendLogprobs)) : -1);
  } else if (a.has("--draft")) {
    std::vector<int> runs = parse_int_list(a.str("--draft"), "--draft");
    for (int T : runs)
      if (T < 1 || T > 64) fail("--draft: run lengths are 1..64 (got ", T, ")");
    j = bench_draft(std::move(w), s, runs, static_cast<int>(a.integer("--threads", 0, 0, 1024)), a.str("--kv"));
  } else if (a.has("--reuse")) {
    j = bench_reuse(std::move(w), s, parse_int_list(a.str("--reuse"), "--reuse"),
                    static_cast<int>(a.integer("--reuse-suffix", 32, 1, 1 << 20)),
                    static_cast<int>(a.integer("--reuse-requests", 5, 2, 1000)),
                    static_cast<int>(a.integer("--threads", 0, 0, 1024)), a.str("--kv"));
  } else if (s.backend == "cuda") {
#ifdef LILY_HAVE_CUDA
    j = bench_cuda(std::move(w), s, a.str("--kv"));
#else
    fail("bench: lily was built without CUDA");
#endif
  } else if (s.backend == "cpu") {
    j = bench_cpu(std::move(w), s, static_cast<int>(a.integer("--threads", 0, 0, 1024)));
  } else {
    fail("bench: unknown backend '", s.backend, "' (cpu, cuda, auto)");
  }
  if (a.has("--json")) {
    std::ofstream f(a.str("--json"));
    if (!f) fail("bench: cannot write ", a.str("--json"));
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace lily::cli

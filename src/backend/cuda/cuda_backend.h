// The CUDA backend: the forward pass of every supported architecture on one
// GPU. One token (decode) replays the cache's CUDA graph of matvec kernels;
// more tokens (prefill) run the tensor-core kernels of prefill.h in chunks.
//
// This header compiles without CUDA (the implementation is only built when
// CMake finds nvcc and defines LILY_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/kv_type.h"

namespace lily {

// True when lily was built with CUDA and the current CUDA device can run its
// kernels (a GPU of another generation than the build's is not available).
bool cuda_device_available();
// Why not (empty when it is): no CUDA in the build, no device, or a device
// the kernels were not compiled for, named with its compute capability.
std::string cuda_unavailable_reason();
// Whether a CUDA device is there at all, usable or not.
bool cuda_device_present();
// "cuda" when a GPU lily can run on is present, else "cpu" (make_backend
// accepts "auto").
// Defined in backend.cpp; belongs in backend.h once that header takes it.
std::string default_backend_kind();
// `kind` with "auto" settled as make_backend settles it (default_backend_kind,
// with one line on stderr when a GPU is there but unusable); other kinds as given.
std::string resolve_backend_kind(const std::string& kind);

namespace cuda {

// The most rows CudaOptions::moe_rows takes.
constexpr int kMaxMoeRows = 8;

struct CudaOptions {
  // KV cache rows: bf16; q8 (8-bit codes with one f32 scale per row, half the
  // bytes: the attention reads at long contexts halve); f32 (tight comparisons).
  KvType kv = KvType::BF16;
  bool pdl = true;       // programmatic dependent launch between kernels
  bool graphs = true;    // replay each decode step from a CUDA graph
  int max_splits = 128;  // context splits of the attention kernel
  int attn_min_split = 32;  // positions per split at least (LILY_CUDA_ATTN_MIN_SPLIT)
  uint64_t seed = 1;     // synthetic weights
  bool prefill = true;   // tensor-core prefill for runs of >= 2 tokens (else decode steps)
  int prefill_chunk = 0;  // tokens per prefill pass (bounds the workspace); 0: by free memory, <= 16384
  bool router_fold = true;  // MoE router logits summed in the out_proj epilogue (no router launch)
  // The same for a short run's layers where their projections and MoE take
  // the decode forms (runs of 2..mv_rows with moe_row_streams 3): the
  // out_proj / o_proj with the fold once per row as one launch over the rows
  // (a run of 2 1.54 decode steps against 1.64 with the DeltaNet layers'
  // alone; docs/cuda-prefill.md "Short runs, round 7" and "round 8"). 2: both
  // kinds of layer (an attention layer's where its attention takes the split
  // form, which writes f32 rows for it), 1: the DeltaNet layers only, 0: off.
  int rows_fold = 2;
  // The DeltaNet step run inside the in_proj's launch (launch_matvec_dn,
  // clusters per key head) where the shapes fit, one launch fewer per
  // DeltaNet layer. Off until measured on a GPU (docs/cuda-decode.md, "v21").
  bool dn_in_step = false;
  // Decode matvecs over q4 weights take their input as integer codes per
  // 32-input chunk and multiply on IDP.4A: 16 bits (15 under the chunk's
  // largest input, the default), 8 (faster, coarser), or 0 (f32 inputs;
  // docs/cuda-decode.md, "v16").
  int act_bits = 16;
  // The prefill attention's split form for runs of few tokens over a long
  // context (prefill.h; q8 rows read in place), and speculative draft runs
  // through the prefill kernels with the DeltaNet state restored and
  // replayed on accept (forward_draft; max_draft_run() 16, else 1). Drafts
  // run only with --speculative N (docs/speculative.md, "On the GPU").
  bool attn_split = true;
  bool draft_runs = true;
  // Prefill runs of at most this many tokens (0..16) take the skinny q4 / q8
  // GEMMs, the recurrent DeltaNet and the one-block MoE plan (prefill.h,
  // prefill_set_skinny_rows; process-wide).
  int skinny_rows = 16;
  // Such runs' routed MoE as the skinny kernel in grouped form with the
  // shared expert as one more tile (prefill_set_moe_grouped; process-wide).
  bool moe_grouped = true;
  // Such runs' launches with programmatic dependent launch (prefill_set_pdl).
  bool short_pdl = true;
  // Runs of 2 up to this many tokens (0, 2..kMaxMatvecRows) take their q4
  // projections (in_proj, qkv, out_proj with its gated RMSNorm, lm_head) as
  // the decode matvec over the run's rows (MatvecParams::nrows: the input
  // norms fused, the weights read once), where the layouts allow it; 0 or 1:
  // the skinny GEMMs. 2 by default: a run of 2 gains ~4%, runs of 3 and 4
  // lose 5% and 13% (H100; docs/cuda-prefill.md, "Short runs, round 4").
  int mv_rows = 2;
  // Runs of up to this many tokens (0..kMaxMoeRows) take their MoE as the
  // decode step's MoE once per row (the router matvec, gate_up routing in
  // its prologue, the weighted down projections added to the row), instead
  // of the planned prefill MoE; 0: the prefill MoE always; -1 (the
  // default): by the model's shape, auto_moe_rows. The per-row MoE reads
  // each row's experts, the prefill MoE each expert once for the run, so
  // the rows pay while the run's picks rarely share experts: Qwen3.6-35B-A3B
  // (256 experts, top 8) up to 8 (runs of 2, 3, 5, 8 at 1.6, 2.0, 2.5, 3.5
  // decode steps against 2.15, 2.55, 2.9, 3.7), Qwen3-30B-A3B (128, top 8)
  // up to 4 (runs of 2 / 3 1.41 / 1.69 against 1.82 / 1.88; 4 even; 6 / 8
  // 2.5 / 3.1 against 2.1 / 2.25) (H100, 4K; docs/cuda-prefill.md "Short
  // runs, round 5" and "round 6").
  int moe_rows = -1;
  // Those rows' MoEs: 0 one after another on the pass's stream; 1 each row
  // on its own stream (the GPU runs them side by side); 2 the same with
  // each launch's grid a 1 / T share of the SMs; 3 (the default) each of
  // the MoE's launches once for all rows, a 1 / T share of the SMs a row
  // (launch_matvec_grid, launch_moe_down_grid; 2 where their layout does not
  // take them).
  int moe_row_streams = 3;
  // The next layer's input RMSNorm written by the MoE's combine (every
  // prefill pass) instead of a launch of its own.
  bool fold_norms = true;
  // A draft run's pass captured and replayed as one CUDA graph (updated per
  // run), instead of ~600 launches from the host.
  bool draft_graph = true;
  // That pass captured in this many pieces of consecutive layers (1..64, at
  // most one a layer), each launched before the next is captured, so the
  // host's capture (0.34-1.36 ms a pass on the H100 machines) overlaps the
  // GPU's run of the piece before: a run of 2 1.61 decode steps against
  // ~2.0-2.3 in one piece and 1.80 without a graph (docs/cuda-prefill.md
  // "Short runs, round 6").
  int draft_graph_parts = 16;
  // A draft run's rows sampled on the device (forward_draft_sample) rather
  // than copied to the host (LILY_CUDA_DRAFT_SAMPLE=0 turns it off;
  // docs/cuda-decode.md "v23").
  bool draft_sample = true;
  // Sampling without top_k (the whole vocabulary) on the device too
  // (sample.cu's wv_* kernels), rather than the row copied to the host
  // (LILY_CUDA_SAMPLE_WHOLE=0 turns it off; docs/cuda-decode.md "v24").
  bool sample_whole = true;
};
// CudaOptions::moe_rows by the model's shape: experts / (4 k) runs of rows,
// 1..kMaxMoeRows (0 without experts).
int auto_moe_rows(int experts, int k);
// Defaults overridden by LILY_CUDA_KV=f32|bf16|q8, LILY_CUDA_PDL=0|1,
// LILY_CUDA_GRAPHS=0|1, LILY_CUDA_PREFILL=0|1, LILY_CUDA_PREFILL_CHUNK=n,
// LILY_CUDA_ROUTER_FOLD=0|1, LILY_CUDA_DN_IN=0|1, LILY_CUDA_ACT=q16|q8|f32,
// LILY_CUDA_ATTN_SPLIT=0|1, LILY_CUDA_DRAFT=0|1, LILY_CUDA_SKINNY=0..16,
// LILY_CUDA_DRAFT_GRAPH=0|1, LILY_CUDA_DRAFT_GRAPH_PARTS=1..64,
// LILY_CUDA_MOE_GROUPED=0|1,
// LILY_CUDA_SHORT_PDL=0|1, LILY_CUDA_FOLD_NORMS=0|1, LILY_CUDA_MV_ROWS=0..4,
// LILY_CUDA_MOE_ROWS=0..8, LILY_CUDA_MOE_ROW_STREAMS=0..3, LILY_CUDA_ROWS_FOLD=0..2.
CudaOptions options_from_env();

struct KernelTiming {
  std::string name;
  int launches = 0;
  double ms = 0;     // summed over launches
  double bytes = 0;  // summed minimum traffic over launches
};

// One launch of a traced decode step (see TraceSpec in kernels.h). Times are
// in microseconds from the first block entry of the step's first launch;
// setup and body are medians over the launch's blocks of the SM-clock
// intervals wait -> end of setup (input staging, routing) -> block end.
struct TracedLaunch {
  std::string name;
  int blocks = 0;         // blocks with a record
  int pre_launched = 0;   // blocks that entered before the previous launch's last block ended
  double entry_first = 0, wait_first = 0, wait_med = 0, end_med = 0, end_last = 0;
  double setup_us = 0, body_us = 0;
  // Kernel-specific sub-steps (medians; 0 when not marked), matvec: input
  // staged (or routed), first x piece (or the router logits) in, norm scales
  // (or the top k) known (from the wait), first item computed (from the end
  // of the setup).
  double sub_us[4] = {0, 0, 0, 0};
};

class CudaBackend : public Backend {
 public:
  CudaBackend(std::unique_ptr<ModelWeights> weights, const CudaOptions& options);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  const ModelConfig& config() const override;
  std::unique_ptr<SequenceCache> new_cache(int max_positions) override;
  void forward(SequenceCache& cache, std::span<const int> tokens, LogitsMode mode,
               float* logits) override;
  void copy_cache(const SequenceCache& src, SequenceCache& dst) override;
  void truncate(SequenceCache& cache, int n) override;
  // With CudaOptions::draft_runs, draft runs of 2..kMaxDraftRun tokens take
  // the prefill kernels and keep, per DeltaNet layer, the state and conv
  // ring before the run and the run's in_proj rows; accept_draft replays the
  // kept tokens' DeltaNet updates from those (the KV rows are cut back).
  // Without the prefill kernels: the Backend default.
  void forward_draft(SequenceCache& cache, std::span<const int> tokens, float* logits) override;
  void accept_draft(SequenceCache& cache, int n) override;
  int max_draft_run() const override;
  // Greedy or top-k (<= kMaxBackendTopK) sampling after the step's graph:
  // two launches (sample.cu), 8 bytes back.
  bool can_sample(const TokenSampling& s) const override;
  int forward_sample(SequenceCache& cache, int token, const TokenSampling& s, bool& drew) override;
  // A draft run's rows sampled where they are (the run's lm_head rows stay
  // on the device; CudaOptions::draft_sample).
  bool can_sample_draft(const TokenSampling& s) const override;
  void forward_draft_sample(SequenceCache& cache, std::span<const int> tokens, std::span<const TokenSampling> s,
                            int* ids, int* drew) override;
  static constexpr int kMaxDraftRun = 16;

  // ---- benchmark hooks ----
  // Puts the cache at position `ctx` as if a prompt of that length had been
  // prefilled: random KV rows [0, ctx) and random DeltaNet / conv state.
  void bench_fill(SequenceCache& cache, int ctx, uint64_t seed);
  // n greedy decode steps, each fed the previous step's argmax on the device,
  // queued without any host synchronisation (first input: first_token).
  void decode_steps(SequenceCache& cache, int n, int first_token);
  void synchronize();
  // Whether runs of several tokens use the prefill kernels, and if not why.
  bool prefill_enabled() const;
  std::string prefill_disabled_reason() const;
  // The layers of the last pass of several tokens (a prefill chunk, a draft
  // run) whose out projection took the router fold over the run's rows
  // (CudaOptions::rows_fold), by kind.
  struct RunFolds {
    int deltanet = 0, attention = 0;
  };
  RunFolds last_run_folds() const;
  // Tokens per prefill pass (CudaOptions::prefill_chunk, or the size chosen
  // from the free device memory when that is 0).
  int prefill_chunk() const;
  // Elapsed device time of `n` decode_steps, measured with events.
  double time_decode_ms(SequenceCache& cache, int n, int first_token);
  // One decode step launch by launch (no graph), timed per kernel with events.
  std::vector<KernelTiming> profile_step(SequenceCache& cache);
  // Each kernel kind's launches of one step captured alone in a graph and
  // replayed (PDL as configured): device time per step without host gaps.
  std::vector<KernelTiming> profile_step_graphs(SequenceCache& cache, int replays);
  // Device time of a graph of `launches` empty kernels (launch overhead floor).
  double empty_graph_us(int launches, int blocks, bool pdl);
  // Device time per launch of a graph of `launches` hand-over probe launches
  // (launch_handover_probe: the ingredients of a matvec's setup added one at
  // a time, each launch reading the previous one's output; PDL as given).
  double handover_probe_us(int launches, int blocks, int stage, int pre, bool pdl);
  // The resident probe (launch_resident_probe): a chain of q4 matvecs whose
  // blocks, one per SM, copy their whole weight slice (rows x 1 KB) into
  // shared memory. us per launch, and from one more traced replay the
  // medians over blocks of the time a block spent resident before its wait,
  // its staging after the wait, its wait for the weights after that, and
  // its compute.
  struct ResidentProbe {
    double mb = 0, us = 0, before_wait_us = 0, staging_us = 0, weights_wait_us = 0, compute_us = 0;
  };
  ResidentProbe resident_probe(int launches, int rows, int threads, int xbits, int mode, bool pdl, int per_sm = 1);
  // A chain of resident-probe launches of mixed shapes (a model step's
  // sizes), 16-bit codes; us per chain.
  struct ResidentLaunch {
    int rows, per_sm, mode;
  };
  double resident_chain_us(const std::vector<ResidentLaunch>& chain, int threads);
  // The persistent probe (launch_persistent_probe): a chain of stages (rows
  // of 1 KB per block, routed or not) in one launch of one block per SM, the
  // weights streamed through `slots` 16 KB ring slots ahead of the chain.
  // us per chain, and from one more run the medians over the blocks of the
  // time spent waiting for the previous stage, for weights, and the
  // producer's wait for a free slot (us per chain).
  struct PersistentStage {
    int rows;
    bool routed;
  };
  struct PersistentProbe {
    double mb = 0, us = 0, dep_wait_us = 0, weight_wait_us = 0, ring_wait_us = 0, block_us = 0;
  };
  PersistentProbe persistent_probe(const std::vector<PersistentStage>& chain, int slots, int mode);
  // On-device sampling alone (bench): `rows` rows of random logits of the
  // model's vocabulary sampled with s, `iters` times; the median host time
  // of one call (upload of the adjustments, the launches, the result back)
  // and the median device time of each launch (events between them, the
  // launches queued behind a spinning kernel, as behind a decode step).
  struct SampleTiming {
    double call_us = 0;
    std::vector<double> kernel_us;
  };
  SampleTiming sample_timing(const TokenSampling& s, int rows, int iters, uint64_t seed);
  // The whole decode step captured once with per-block timeline records
  // (TraceSpec) and replayed; returns the last replay's launches in step
  // order. sm_mhz converts the SM-clock intervals. The cache's position is
  // restored afterwards.
  // With `only` set, just that kind's launches are captured (as
  // profile_step_graphs does).
  std::vector<TracedLaunch> trace_step(SequenceCache& cache, double sm_mhz, double* timer_ns = nullptr,
                                       const std::string& only = "");
  bool graph_uses_pdl(SequenceCache& cache);
  // Minimum bytes one decode step moves at context length ctx (weights read,
  // DeltaNet state read + written, KV read).
  double step_bytes(int ctx) const;
  int step_launches() const;
  size_t weight_bytes() const;
  // The last greedy token chosen on the device.
  int last_token(SequenceCache& cache);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<CudaBackend> make_cuda_backend(std::unique_ptr<ModelWeights> weights,
                                               const CudaOptions& options = options_from_env());

// Device-to-device copy bandwidth in GB/s, counting bytes read plus written.
double measure_copy_bandwidth_gbs(size_t bytes, int iters);
// Device memory in use (total - free) and the device's name.
size_t device_memory_used();
// SM clock (MHz) seen by a short spinning kernel right now.
double sm_clock_mhz();
std::string device_name();

}  // namespace cuda
}  // namespace lily

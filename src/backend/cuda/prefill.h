// Prefill (many-token) CUDA kernels: host-callable launchers over device
// pointers. Plain C++: no CUDA headers needed to include this file.
//
// Conventions shared by every launcher:
//  - bf16 tensors are passed as uint16_t* (raw bf16 bits), f32 as float*.
//  - "ld" arguments are row strides in elements of the pointed-to type.
//  - Every launcher only enqueues work on `stream` (no host synchronisation,
//    no device-to-host reads), so a whole prefill step can be captured in a
//    CUDA graph. Errors (bad sizes, launch failures) throw lily::Error naming
//    the launcher or CUDA call.
//
// See docs/cuda-prefill.md for the kernels' design, measured speed and the
// dispatch table (which kernel for how many rows).
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace lily::cuda {

// ---- weights -----------------------------------------------------------------
enum class PrefillWeightFormat : int { BF16 = 0, Q4 = 1, Q8 = 2 };

// A [rows x cols] matrix (rows = outputs N, cols = inputs K) in device memory,
// or a stack of such matrices (MoE experts, [E][rows][cols]).
//  BF16: w is bf16 [rows][cols], row-major.
//  Q4/Q8 (MLX affine, group 64): w holds the MLX codes unchanged,
//    [rows][cols * bits / 32] u32, codes low-bits-first; sb is [rows][cols / 64]
//    u32 with the group's scale in the low 16 bits and its bias in the high 16
//    bits (bf16, or f16 when sb_f16). This is the decode backend's upload
//    layout for K % 64 == 0, so both paths share one copy of the weights.
// cols must be a multiple of 64 for every format.
struct PrefillWeight {
  PrefillWeightFormat fmt = PrefillWeightFormat::BF16;
  int rows = 0, cols = 0;
  const void* w = nullptr;
  const uint32_t* sb = nullptr;
  bool sb_f16 = false;
  // Stacks only: distance between consecutive experts' w (bytes) and sb (u32).
  size_t expert_w_bytes = 0, expert_sb_words = 0;
  // Distance between consecutive rows, 0 = packed (cols*bits/8 bytes, cols/64
  // words). Gate/up interleaved by rows (the decode upload's fused SwiGLU,
  // gate i at row 2i, up i at 2i+1) is two views: gate {w, sb}, up {w + one
  // row, sb + cols/64}, both with twice the packed strides.
  size_t row_stride_bytes = 0, sb_row_stride_words = 0;
};

// ---- dense GEMM: y[T][N] = x[T][K] . W^T --------------------------------------
enum class PrefillOut : int {
  F32 = 0,     // y (float) = result
  F32Add = 1,  // y (float) += result (residual add)
  BF16 = 2,    // y (bf16) = result
};
// Optional scratch for quantized weights: with T >= min_rows and room for the
// weight in bf16 (rows x cols x 2 bytes; SwiGLU: both matrices), the weight is
// first expanded to bf16 in one pass and the bf16 GEMM runs on it, instead of
// every 128-row tile expanding the same weight tiles again (T / 128 times).
// The values are the same (the same f32 FMA, rounded to bf16).
struct PrefillScratch {
  void* p = nullptr;
  size_t bytes = 0;
  int min_rows = 1024;
};
// x: bf16 [T][ldx]. Tensor cores (wgmma for 128-row tiles, mma.sync for 64,
// bf16 in, f32 accumulation); quantized weight tiles are dequantized into
// shared memory once per block and reused across up to 128 token rows; bf16
// weights (or expanded ones) with >= 128 rows take the TMA-fed
// warp-specialized kernel.
void prefill_gemm(const PrefillWeight& w, const uint16_t* x, int T, size_t ldx, void* y,
                  size_t ldy, PrefillOut out, cudaStream_t stream, const PrefillScratch& scratch = {});
// How many blocks share each output tile's K in prefill_gemm(w, T rows, out,
// scratch): 1 where it does not split (skinny, TMA-fed or BF16 outputs, or
// enough tiles). Split sums are added in a fixed order: a GEMM's output is
// the same bits from one run to the next. For tests.
int prefill_gemm_k_splits(const PrefillWeight& w, int T, PrefillOut out, const PrefillScratch& scratch = {});
// Allocates the split-K workspace (4 x multiprocessors x 128 x 128 floats,
// ~35 MB on an H100) now: a backend calls it at setup, so that a split GEMM
// inside a graph capture finds it (else the first split allocates it).
void prefill_reserve_split_space();
// Projections of the same x whose outputs are adjacent column ranges of y
// (part i starts at the sum of the rows of the parts before it), e.g. a
// DeltaNet layer's qkv, z, b and a: when every part is quantized and the
// scratch takes them all, they are expanded into one bf16 matrix and run as
// one GEMM (small projections then cost no launch and no idle SMs of their
// own); otherwise one prefill_gemm per part. All parts have the same columns.
void prefill_gemm_fused(const PrefillWeight* parts, int n, const uint16_t* x, int T, size_t ldx, void* y,
                        size_t ldy, PrefillOut out, cudaStream_t stream, const PrefillScratch& scratch = {});
// h[T][N] (bf16) = silu(x . gate^T) * (x . up^T); gate and up both [N][K].
void prefill_gemm_swiglu(const PrefillWeight& gate, const PrefillWeight& up, const uint16_t* x,
                         int T, size_t ldx, uint16_t* h, size_t ldh, cudaStream_t stream,
                         const PrefillScratch& scratch = {});

// Runs of at most `rows` tokens (default 16, the most; 0: never) take the
// skinny kernels for q4 / q8 weights in the three calls above (the weights as
// the MMA's A operand, read once for the run; prefill_gemm.cu; up to twice
// `rows`, prefill_skinny_gemm_rows below) and the
// recurrent DeltaNet in prefill_deltanet (token by token, as the decode
// step; prefill_deltanet_run.cu), and prefill_moe plans the routing in one
// block (moe_plan_kernel). Process-wide; for benchmarks and tests.
void prefill_set_skinny_rows(int rows);
int prefill_skinny_rows();
// The GEMMs and the routed MoE take their skinny forms up to twice that
// (32 rows: four n8 halves of the MMA; the MoE's tiles stay at 8 rows),
// where the tiled kernels' 64-row tiles would leave most SMs idle.
int prefill_skinny_gemm_rows();
// The routed MoE plans in one block and runs the grouped skinny form (with
// the shared expert as more tiles) up to six times `rows` (96; at most 1024
// routed pairs).
int prefill_moe_plan_rows();
// Such runs' routed MoE (q4 experts) runs as the skinny kernel in grouped
// form, one tile per expert, with the shared expert as one more tile where
// PrefillMoeArgs carries its weights (default on; off: the 16-row MoE tiles).
void prefill_set_moe_grouped(bool on);
// The 16-row skinny MoE kernel (under 32 routed rows an expert: 97..1,023
// prompt tokens of Qwen3.6) spreads the plan's tiles over a wave of blocks;
// blocks > 0 sets the wave (tests: blocks that take several tiles), 0
// restores the default (two blocks an SM).
void prefill_set_moe_skinny_blocks(int blocks);
// Launches over such runs go with the programmatic-dependent-launch
// attribute (each kernel waits for its predecessor before touching its
// data; weights are requested before): prefill_pdl(T) says whether a
// launch over T rows does. Default on.
void prefill_set_pdl(bool on);
bool prefill_pdl(int T);

// ---- routed MoE ----------------------------------------------------------------
// Routing: softmax over E expert logits (f32), top-k (ties to the lower index),
// optionally renormalised to sum 1. ids/weights: [T][k].
void prefill_moe_route(const float* logits, size_t ld_logits, int T, int E, int k,
                       bool norm_topk, int* ids, float* weights, cudaStream_t stream);

struct PrefillMoeArgs {
  int T = 0, E = 0, k = 0, hidden = 0, inter = 0;
  const uint16_t* x = nullptr;  // bf16 [T][ldx] normed input
  size_t ldx = 0;
  const float* router_logits = nullptr;  // f32 [T][ld_logits], E per row
  size_t ld_logits = 0;
  bool norm_topk = true;
  // Stacked experts: gate/up [E][inter][hidden], down [E][hidden][inter].
  PrefillWeight gate, up, down;
  // Optional shared expert: out += sigmoid(gate_logit[t]) * shared_out[t].
  // Computed by the caller, or here from sh_gate / sh_up / sh_down (one
  // expert, intermediate size <= inter) into shared_out, then scratch: a
  // short run with the stacks' layout runs it as one more tile of the
  // routed launches.
  const float* shared_out = nullptr;  // f32 [T][ld_shared]
  size_t ld_shared = 0;
  const float* shared_gate_logit = nullptr;  // f32, element t at [t * ld_shared_gate]
  size_t ld_shared_gate = 1;
  PrefillWeight sh_gate, sh_up, sh_down;  // sh_gate.w null: none here
  float* out = nullptr;  // f32 [T][ldo]
  size_t ldo = 0;
  bool accumulate = false;  // out += moe(x) (else out = moe(x))
  // Optional: each finished out row's RMSNorm (weights norm_w [hidden],
  // norm_eps) as bf16 into norm_out [T][ld_norm_out] by the launch that
  // writes the row (the next layer's input norm without a launch of its
  // own). norm_out may be x: it is written after every read of x.
  const float* norm_w = nullptr;
  float norm_eps = 0.f;
  uint16_t* norm_out = nullptr;
  size_t ld_norm_out = 0;
  int tile_rows = 0;        // rows per grouped-GEMM tile: 64 or 128; 0 = by rows per expert
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
size_t prefill_moe_workspace_bytes(int T, int E, int k, int hidden, int inter);
// Whole routed block on the device: route, count per expert, prefix sums and
// permutation, one grouped launch for gate/up (+SiLU*up), one for down, then a
// per-token weighted gather-sum (deterministic). No host readback.
void prefill_moe(const PrefillMoeArgs& a, cudaStream_t stream);
// Benchmarks only: the same, synchronising, with the time of each stage in ms
// (0 routing + scan + scatter, 1 gate/up, 2 down, 3 combine).
void prefill_moe_timed(const PrefillMoeArgs& a, cudaStream_t stream, float (&ms)[4]);

// ---- Gated DeltaNet ------------------------------------------------------------
struct PrefillDeltaNetArgs {
  int T = 0;
  int first_position = 0;  // tokens already in the sequence (P)
  // dk = dv, one of 32, 64, 128 (128: the production model; 32: the test
  // fixtures); conv kernel 4 only.
  int nk = 16, nv = 32, dk = 128, dv = 128, conv_kernel = 4;
  // Raw projections (f32): qkv [T][ld_qkv] with C = 2*nk*dk + nv*dv channels
  // [all q | all k | all v]; a, b [T][ld_ab] with nv values each.
  const float* qkv = nullptr;
  size_t ld_qkv = 0;
  const float* a = nullptr;
  const float* b = nullptr;
  size_t ld_ab = 0;
  const float* conv_w = nullptr;  // [C][K]
  float* conv_ring = nullptr;     // [C][K]: raw input of position p in slot p % K (updated)
  const float* a_log = nullptr;   // [nv]
  const float* dt_bias = nullptr; // [nv]
  float* state = nullptr;         // [nv][dk][dv] f32 (updated)
  float* out = nullptr;           // [T][ld_out]: nv*dv core outputs, before the gated norm
  size_t ld_out = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Optional, for runs of at most prefill_skinny_rows() tokens (an error
  // otherwise): the state and the ring as they were before this call are
  // also written here (a speculative draft run's record, without copies of
  // its own).
  float* state_backup = nullptr;  // [nv][dk][dv]
  float* ring_backup = nullptr;   // [C][K]
  // Optional, the same runs: the state and ring are read from here instead
  // (state and conv_ring are only written: a draft run's replay from its
  // record, with no copy back first).
  const float* state_src = nullptr;
  const float* ring_src = nullptr;
};
size_t prefill_deltanet_workspace_bytes(int T, int nk, int nv, int dk, int dv);
// Throws lily::Error for head dims outside {32, 64, 128} or dk != dv.
// conv1d + SiLU with the carried ring, L2 norm of q/k (q also / sqrt(dk)),
// beta/g gates, then the chunked (64) delta rule: a parallel pass per
// (head, chunk) for the WY factors and a sequential pass per (head, 32-column
// slice of the state) that carries S in f32.
void prefill_deltanet(const PrefillDeltaNetArgs& a, cudaStream_t stream);
// Benchmarks only: the same, synchronising, with the time of each launch in ms
// (0 conv/norm/gates, 1 conv ring update, 2 per-chunk pass, 3 state pass).
void prefill_deltanet_timed(const PrefillDeltaNetArgs& a, cudaStream_t stream, float (&ms)[4]);

// out (bf16) = rmsnorm(o_head) * w * silu(z) per head of `dim` values.
void prefill_gated_rmsnorm(const float* o, size_t ld_o, const float* z, size_t ld_z,
                           const float* w, int T, int heads, int dim, float eps, uint16_t* out,
                           size_t ld_out, cudaStream_t stream);
// out (bf16) = x / rms(x) * w over rows of n values (the projections' input).
void prefill_rmsnorm(const float* x, size_t ldx, const float* w, int T, int n, float eps,
                     uint16_t* out, size_t ldo, cudaStream_t stream);

// ---- causal flash attention (GQA, head_dim 32/64/128/256, sigmoid output gate) --
struct PrefillAttentionArgs {
  int T = 0, first_position = 0;  // queries are positions [P, P + T)
  // head_dim 32, 64, 128 or 256 (256: the production model; 32: the test
  // fixtures); other values throw lily::Error.
  int nh = 16, nkv = 2, head_dim = 256;
  // bf16, already normed and roped: element (t, h, d) at
  // q[t * q_row_stride + h * q_head_stride + d]; gate (nullable) the same way.
  const uint16_t* q = nullptr;
  const uint16_t* gate = nullptr;
  size_t q_row_stride = 0, q_head_stride = 0;
  // bf16 caches [nkv][capacity][head_dim] holding positions [0, P + T).
  const uint16_t* k_cache = nullptr;
  const uint16_t* v_cache = nullptr;
  int capacity = 0;
  // Or a q8 cache read in place (kv_type.h: codes [nkv][capacity][head_dim],
  // scales [nkv][scale_stride]), k_cache / v_cache unused: the split form
  // only (prefill_attention_splits > 0; otherwise an error).
  const uint8_t* k_q8 = nullptr;
  const uint8_t* v_q8 = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int scale_stride = 0;
  uint16_t* out = nullptr;  // bf16 [T][out_row_stride], head h at h * head_dim
  size_t out_row_stride = 0;
  // Or f32 rows there instead (out unused; the split form only, otherwise
  // an error): a short run whose o_proj takes the decode matvec.
  float* out_f32 = nullptr;
  // Optional (prefill_attention_workspace_bytes): with T x (nh / nkv) <= 512
  // query rows (a short run after a long context: a draft run, a follow-up
  // turn's few tokens), one block per (key range, KV head, 128 of the
  // group's query rows) and a second launch merges the key ranges; without
  // it (or with more rows) one block per (128 queries, query head) walks
  // all keys.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
void prefill_attention(const PrefillAttentionArgs& a, cudaStream_t stream);
// Workspace for the split form at any T it takes.
size_t prefill_attention_workspace_bytes(int nh, int nkv, int head_dim);
// Key ranges the split form uses for these arguments (0: the whole-context
// kernel runs).
int prefill_attention_splits(const PrefillAttentionArgs& a);

}  // namespace lily::cuda

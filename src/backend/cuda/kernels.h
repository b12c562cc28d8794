// The CUDA decode kernels' host interface: plain parameter structs and one
// launch function per kernel family. The kernels live in the .cu files next
// to this header; the backend (cuda_backend.cpp) and the tests
// (tests/cuda_kernels_test.cpp) call them through these functions.
//
// Weight layout on the device (see weights_upload.h): every matrix row is a
// run of 16-byte chunks (codes for affine formats, values for float formats),
// padded with zeros to a whole chunk; affine scale and bias of one group are
// interleaved in one u32 (scale in the low half, bias in the high half, both
// bf16 or both f16), [rows][groups].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/kv_type.h"
#include "backend/sampling.h"

namespace lily::cuda {

enum class QFmt : int { Q4 = 0, Q8 = 1, BF16 = 2, F32 = 3 };

// Inputs (floats) covered by one 16-byte chunk of a row.
constexpr int floats_per_chunk(QFmt f) {
  return f == QFmt::Q4 ? 32 : f == QFmt::Q8 ? 16 : f == QFmt::BF16 ? 8 : 4;
}
const char* qfmt_name(QFmt f);
// The kernels find a chunk's scale group with a shift: an affine format's
// chunks per group must be a power of two (float formats have none).
constexpr bool chunks_per_group_ok(QFmt f, int cpg) {
  return (f != QFmt::Q4 && f != QFmt::Q8) || (cpg > 0 && (cpg & (cpg - 1)) == 0);
}
// The integer-input widths the matvec kernels take (MatvecParams::act_bits).
constexpr bool act_bits_ok(int bits) { return bits == 0 || bits == 8 || bits == 16; }

// A matrix as the kernels read it (non-owning).
struct DevMatView {
  QFmt fmt = QFmt::F32;
  int rows = 0, cols = 0;
  int chunks = 0;            // 16-byte chunks per row
  int groups = 0;            // affine groups per row (0 for float formats)
  int chunks_per_group = 0;  // affine only
  int sb_f16 = 0;            // scale/bias halves are f16 (else bf16)
  const uint4* w = nullptr;
  const uint32_t* sb = nullptr;
  size_t bytes() const { return size_t(rows) * chunks * 16 + size_t(rows) * groups * 4; }
};

// Copies a matrix's layout (format, width, chunking, scale dtype) into the
// launch parameters of a kernel that reads matrices of that layout.
template <typename Params>
void set_layout(Params& p, const DevMatView& v) {
  p.fmt = v.fmt;
  p.cols = v.cols;
  p.chunks = v.chunks;
  p.groups = v.groups;
  p.chunks_per_group = v.chunks_per_group;
  p.sb_f16 = v.sb_f16;
}
inline bool same_layout(const DevMatView& a, const DevMatView& b) {
  return a.fmt == b.fmt && a.cols == b.cols && a.chunks == b.chunks && a.groups == b.groups &&
         a.chunks_per_group == b.chunks_per_group && a.sb_f16 == b.sb_f16;
}

// Per-sequence control block in device memory. The decode graph reads the
// position and the input token from here, so one captured graph serves every
// step.
struct DecodeCtrl {
  int pos;         // position of the token this step processes
  int token;       // input token (host-written, or taken from argmax_key)
  int use_argmax;  // 1: the input token is the previous step's greedy argmax
  int pad;
  unsigned long long argmax_key;  // (ordered logit bits << 32) | ~index; 0 = none
};

// ---- step timeline (lily bench --trace) ---------------------------------------
// When a trace is armed (set_trace), every decode launch takes the next launch
// number and thread 0 of each block writes its record
// recs[launch * blocks_cap + block]: the global timer (ns) and the SM's clock
// at entry, after griddepcontrol.wait, after the setup (input staging,
// routing) and at the block's end. Off (recs == nullptr) by default: one
// uniform branch per mark.
struct TraceRec {
  unsigned long long t[4];  // %globaltimer, ns
  unsigned c[8];            // clock64() low 32 bits: c[0..3] with t[0..3]; c[4..7] kernel-specific sub-steps
  unsigned sm, blocks;
  unsigned pad[6];
};
struct TraceSpec {
  TraceRec* recs = nullptr;
  int launch = 0;
  int blocks_cap = 0;
  int clock_thread = 0;  // the thread that takes the sub-step marks c[4..7]
};
// Arms (recs non-null) or disarms the trace; launches beyond max_launches
// are not traced.
void set_trace(TraceRec* recs, int max_launches, int blocks_cap);
// The spec for the next launch (and advances the launch number).
TraceSpec next_trace();
int traced_launches();

// ---- matvec: y = W x for a few matrices that share the input ------------------
constexpr int kMaxJobs = 12;
constexpr int kMatvecThreads = 256;
constexpr int kRowsPerTile = 16;  // 8 warps x 2 rows

enum class Prologue : int {
  None = 0,       // x as given
  Norm = 1,       // x / rms(x) * norm_w          (one segment: seg = cols)
  GatedNorm = 2,  // per segment of seg: x / rms(x_seg) * norm_w[i % seg] * silu(gate_z[i])
};
enum class Epilogue : int {
  Store = 0,   // out[r] = y
  Add = 1,     // out[r] += y   (residual)
  SwiGLU = 2,  // rows interleaved gate/up: out[r / 2] = silu(y[r]) * y[r + 1]
};
enum class Finish : int { None = 0, LmHead = 1 };

// A job's expert id: `slot` >= 0 takes expert sel_idx[slot] of the launch's
// route prologue (see RouteSpec) from a stack of experts.
struct MatvecJob {
  const uint4* w = nullptr;
  const uint32_t* sb = nullptr;
  int rows = 0;
  int slot = -1;                   // >= 0: routed expert (needs MatvecParams::route)
  long long w_expert_stride = 0;   // uint4 per expert
  long long sb_expert_stride = 0;  // u32 per expert
  float* out = nullptr;
};

// MoE routing as a matvec prologue (the MoE gate_up launch): after the wait,
// one warp per block reads the router logits, takes the softmax, the top k
// (ties to the lower expert index), renormalises them when norm_topk, and
// puts the shared-expert gate sigmoid at index k; the routed jobs read their
// expert from that selection in shared memory. Block 0 also writes it to
// sel_idx / sel_w for the down projection.
constexpr int kMaxRouteExperts = 512;
struct RouteSpec {
  const float* logits = nullptr;  // [experts]; null: no routing
  int experts = 0, k = 0, norm_topk = 1;
  const float* shared_gate_logit = nullptr;  // null: no shared expert
  int* sel_idx = nullptr;                    // [k]
  float* sel_w = nullptr;                    // [k] (+1: shared gate)
  // Folded router (see RouterFold): the logits come as fixed-point sums of
  // W (g h) over the previous launch's blocks, unnormalised; acc non-null
  // replaces logits (which must then be null). acc[experts] is the shared
  // gate's when acc_shared. h is the launch's own input x: block 0 takes
  // 1 / rms(x) (the staging's, with MatvecParams::eps) for the
  // probabilities; the top k need no scale.
  const unsigned long long* acc = nullptr;
  int acc_shared = 0;
  __host__ __device__ bool on() const { return logits != nullptr || acc != nullptr; }
};

// The MoE router folded into the launch that writes its input (the out_proj
// / o_proj residual add): router logits are W rmsnorm(h) = (W (g h)) / rms(h)
// with g the post-attention norm weights, so each block of the launch that
// produces rows j of h adds W[:, j] g_j h_j over its rows to the E (+1:
// shared gate) outputs, and gate_up's route prologue divides by rms(h) (the
// top k are the same without it). The partial sums go in as 64-bit fixed
// point (2^32 units) through integer atomics: exact and order-independent,
// so the result is deterministic. The router is stored transposed for it:
// codes one byte per (input j, output e), q[j][ld] (ld: the outputs padded
// to 16), and the affine groups' scale/bias words sb[j >> gshift][ld] (q4
// and q8 alike, groups of at least 16; float routers are not folded).
// The layer's first launch zeroes acc (MatvecParams::zero_acc) before the
// step's adds.
constexpr int kFoldMaxOut = 384;           // E + 1 <= this (three code words per lane)
constexpr float kFoldUnit = 4294967296.f;  // 2^32
struct RouterFold {
  const uint32_t* q = nullptr;  // [rows of the launch][ld / 4] code words
  const uint32_t* sb = nullptr;
  const float* g = nullptr;     // [rows]: the norm weights applied to h
  unsigned long long* acc = nullptr;  // [n]
  int n = 0, ld = 0, gshift = 0, sb_f16 = 0;
};
// Whether a router (and shared gate, may be null) can be folded for inputs
// of width h.
bool router_fold_ok(const DevMatView& router, const DevMatView* shared_gate, int h);
// The fold's layout (n, ld, gshift, sb_f16; no pointers) for a foldable
// router; its buffers: q [cols][ld] bytes, sb [groups][ld] words, acc [ld].
RouterFold router_fold_shape(const DevMatView& router, const DevMatView* shared_gate);
// Writes the transposed codes q and scale/bias words sb (see
// router_fold_shape) of the router rows (+ the shared gate at row E).
void build_router_fold(const DevMatView& router, const DevMatView* shared_gate, uint32_t* q, uint32_t* sb,
                       cudaStream_t s);

struct MatvecParams {
  QFmt fmt = QFmt::F32;
  int cols = 0, chunks = 0, groups = 0, chunks_per_group = 0, sb_f16 = 0;
  int njobs = 0;
  MatvecJob jobs[kMaxJobs];
  const float* x = nullptr;
  RouteSpec route;
  Prologue pro = Prologue::None;
  const float* norm_w = nullptr;
  const float* gate_z = nullptr;
  int seg = 0;
  float eps = 1e-6f;
  Epilogue epi = Epilogue::Store;
  int argmax = 0;  // fold each stored row into ctrl->argmax_key
  Finish fin = Finish::None;
  unsigned* counter = nullptr;  // zero between launches; the last block resets it
  DecodeCtrl* ctrl = nullptr;  // argmax / LmHead: argmax_key, pos += 1 at the end
  int balanced = 0;            // set by launch_matvec: the tile split (see matvec_body)
  int l2_prefetch = 0;         // set by launch_matvec: the second tile's L2 prefetch (LILY_CUDA_L2PF=1)
  // gate_z was written before the previous kernel started (by the launch
  // two back), so the gated prologue may read it before griddepcontrol.wait.
  int gate_z_early = 0;
  // The router fold on this launch's rows (Epilogue::Add, one job).
  RouterFold fold;
  // zero_n fold sums zeroed by block 0 before the wait: a later launch's
  // (RouterFold::acc). Their last reader, the previous step's gate_up,
  // finished before this launch could start.
  unsigned long long* zero_acc = nullptr;
  int zero_n = 0;
  // q4 weights: the staged input as integer codes per 32-input chunk (16:
  // two int8 parts, 8: one) and the products on IDP.4A (matvec.cu, "Integer
  // inputs"); 0: f32. Only with the one-pass staging; other formats and
  // stagings keep f32.
  int act_bits = 0;
  TraceSpec trace;  // set by the launch function
  // Several input rows through one pass over the weights (a short run: a
  // draft's tokens): row i's input at x + i * ldx (its gate z at gate_z + i
  // * ldz), its outputs at each job's out + i * ldo. Each row is staged and
  // summed exactly as a launch of that row alone (the same bits). 2..
  // kMaxMatvecRows only with q4 weights on integer inputs (act_bits) and the
  // one-pass staging, without route, fold, argmax, finish or gate_z_early
  // (matvec_rows_ok; zero_acc as in any launch: a run's in_proj zeroes its
  // rows' fold sums). (Last, so the other fields keep their offsets.)
  int nrows = 1;
  long long ldx = 0, ldz = 0, ldo = 0;
  // The launch's grid at most 1 / grid_div of what the SMs hold (a launch
  // that shares the GPU with another stream's; host only).
  int grid_div = 1;
};
constexpr int kMaxMatvecRows = 4;
// Whether launch_matvec takes p with p.nrows rows (the shapes, format,
// alignment and options above; nrows 1 always).
bool matvec_rows_ok(const MatvecParams& p);
void launch_matvec(const MatvecParams& p, cudaStream_t s, bool pdl);

// ---- MoE down projection + weighted sum over experts, added to out -----------
struct MoeDownJob {
  const uint4* w = nullptr;
  const uint32_t* sb = nullptr;
  const int* expert = nullptr;  // non-null: expert *expert of the stack
  int experts = 0;              // the stack's experts (bounds the ids read before the wait)
  long long w_expert_stride = 0, sb_expert_stride = 0;
  const float* x = nullptr;     // [cols] input of this expert
  const float* coef = nullptr;  // device scalar weight (null: 1)
};
struct MoeDownParams {
  QFmt fmt = QFmt::F32;
  int cols = 0, chunks = 0, groups = 0, chunks_per_group = 0, sb_f16 = 0;
  int rows = 0;
  int njobs = 0;
  MoeDownJob jobs[kMaxJobs];
  float* out = nullptr;  // out[r] += sum_j coef_j * (W_j x_j)[r]
  int fast_stage = 0;    // set by launch_moe_down: one-pass staging
  int split = 1;         // set by launch_moe_down: warps per row pair (1, 2 or 4)
  int spec_ids = 1;      // set by launch_moe_down: expert ids read before the wait (2: wrongly, a test)
  int act_bits = 0;      // q4: integer inputs on IDP.4A, as MatvecParams::act_bits
  TraceSpec trace;  // set by the launch function
  int grid_div = 1;  // as MatvecParams::grid_div (last: the other fields keep their offsets)
};
void launch_moe_down(const MoeDownParams& p, cudaStream_t s, bool pdl);

// ---- Several launches' rows as one launch (a short run's MoE) ---------------
// Up to kMaxGridRows launches whose parameters differ only in their pointers
// (the decode MoE of each residual row of a short run: router, routed
// gate_up, down) run as one launch over a grid of (the first's grid, rows):
// blockIdx.y picks the row's parameters, so each row computes exactly what
// its own launch would, the same bits. Each row's grid is the first's, which
// counts grid_div as for launches side by side. The _ok functions say
// whether the launch takes them: q4 weights on integer inputs (act_bits 8 /
// 16) or q8 (matvec only; a router fold (RouterFold): q4 only), the
// one-pass staging, and no argmax, finish, early gate or zeroing
// (zero_acc), and a fold not with routing; the launches fail (lily::Error)
// otherwise. ps: n parameters.
constexpr int kMaxGridRows = 8;
struct MatvecGridParams {
  int n = 0;
  MatvecParams p[kMaxGridRows];
};
struct MoeDownGridParams {
  int n = 0;
  MoeDownParams p[kMaxGridRows];
};
bool matvec_grid_ok(const MatvecParams* ps, int n);
void launch_matvec_grid(const MatvecParams* ps, int n, cudaStream_t s, bool pdl);
bool moe_down_grid_ok(const MoeDownParams* ps, int n);
void launch_moe_down_grid(const MoeDownParams* ps, int n, cudaStream_t s, bool pdl);

// ---- Gated DeltaNet decode step ---------------------------------------------
// proj: in_proj outputs [qkv C | z vdim | b nv | a nv]. conv_ring: [C][K] raw
// inputs by position % K. state: [nv][dk][dv] f32. out: [nv * dv], before the
// gated RMSNorm (the out_proj prologue applies it).
struct DeltaNetParams {
  const float* proj = nullptr;
  float* conv_ring = nullptr;
  const float* conv_w = nullptr;  // [C][K]
  float* state = nullptr;
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  float* out = nullptr;
  const DecodeCtrl* ctrl = nullptr;
  int nk = 0, nv = 0, dk = 0, dv = 0, K = 0;
  TraceSpec trace;  // set by the launch function
};
void launch_deltanet_step(const DeltaNetParams& p, cudaStream_t s, bool pdl);

// The in_proj (q|k|v, z, b, a: four jobs storing into d.proj) with the
// DeltaNet step in the same launch: one cluster per key head computes the
// key head's rows, then its first blocks run the step on them after the
// cluster barrier (matvec.cu; the row map below). The step's results equal
// deltanet_step's bit for bit. matvec_dn_ok: whether the shapes allow it
// (dk and the rows per key head multiples of 16, at most 8 step blocks per
// key head, dk <= 128, the outputs where the step reads them).
struct MatvecDnParams {
  MatvecParams mv;
  DeltaNetParams dn;
  int cluster = 0;  // set by launch_matvec_dn: blocks per cluster (a multiple of dn_step_blocks)
};
// Its row map. A key head g's rows in 16-row tiles: tile 0 holds b (rows
// 0-7) and a (8-15) of g's value heads, then q and k (dk each) and v (ratio x
// dv): the step tiles, which the step reads; then z (ratio x dv), which only
// the out_proj reads. dk and ratio x dv are multiples of 16, so no warp's row
// pair straddles two segments. Block `rank` of the cluster takes a share of
// the step tiles [sb, se) and then of the z tiles [zb, ze), arriving at the
// cluster barrier between the two and waiting on it after both, so the z
// tiles hide the wait. The first dn_step_blocks ranks then run one step
// block each (value head, 32-column slice): value heads per key head x
// dv / 32 of them. Uneven shares: the last ranks (without a step block when
// the cluster has more blocks) take the extra step tiles, the first ranks
// the extra z tiles.
__host__ __device__ inline int dn_step_blocks(const DeltaNetParams& d) { return d.nv / d.nk * (d.dv / 32); }
__host__ __device__ inline int dn_step_tiles(const DeltaNetParams& d) {
  return 1 + (2 * d.dk + d.nv / d.nk * d.dv) / kRowsPerTile;
}
__host__ __device__ inline int dn_z_tiles(const DeltaNetParams& d) { return d.nv / d.nk * d.dv / kRowsPerTile; }
struct DnBlockTiles {
  int sb, se, zb, ze;  // tiles of the key head's layout
};
__host__ __device__ inline DnBlockTiles dn_block_tiles(const DeltaNetParams& d, int cluster, int rank) {
  auto split = [](int n, int parts, int i, int* b, int* e) {
    const int base = n / parts, extra = n % parts;
    *b = i * base + (i < extra ? i : extra);
    *e = *b + base + (i < extra ? 1 : 0);
  };
  DnBlockTiles t;
  const int ns = dn_step_tiles(d);
  split(ns, cluster, cluster - 1 - rank, &t.sb, &t.se);
  split(dn_z_tiles(d), cluster, rank, &t.zb, &t.ze);
  t.zb += ns;
  t.ze += ns;
  return t;
}
// The row pair at offset lr (even) of key head g's rows: its job, its first
// row in the job, and how many of its two rows exist (0, 1 or 2).
struct DnRowPair {
  int job, row, n;
};
__host__ __device__ inline DnRowPair dn_row_pair(const DeltaNetParams& d, int g, int lr) {
  const int ratio = d.nv / d.nk, rv = ratio * d.dv;
  int job, first, seg, off;  // the segment: its job, first row in the job, rows; lr's offset in it
  if (lr < kRowsPerTile) {
    job = lr < 8 ? 2 : 3;
    first = g * ratio;
    seg = ratio;
    off = lr & 7;
  } else if (lr < kRowsPerTile + 2 * d.dk) {
    const bool k = lr >= kRowsPerTile + d.dk;
    job = 0;
    off = lr - kRowsPerTile - (k ? d.dk : 0);
    first = (k ? d.nk * d.dk : 0) + g * d.dk;
    seg = d.dk;
  } else {
    const int o = lr - kRowsPerTile - 2 * d.dk;
    job = o < rv ? 0 : 1;
    off = o < rv ? o : o - rv;
    first = (o < rv ? 2 * d.nk * d.dk : 0) + g * rv;
    seg = rv;
  }
  const int n = off >= seg ? 0 : off + 1 < seg ? 2 : 1;
  return {job, first + off, n};
}
bool matvec_dn_ok(const MatvecParams& in, const DeltaNetParams& d);
void launch_matvec_dn(const MatvecParams& in, const DeltaNetParams& d, cudaStream_t s, bool pdl);

// ---- Gated attention decode: split over the context, then combine -----------
// qkv: [q heads x q_head_stride | k nkv x hd | v nkv x hd] (q head: query
// then, when gated, the gate). Caches [nkv][capacity][hd] of f32, bf16 or q8
// (with k_scale / v_scale [nkv][scale_stride]).
struct AttentionParams {
  const float* qkv = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  int rotary_dim = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  KvType kv = KvType::BF16;
  int capacity = 0;
  float* k_scale = nullptr;  // q8 only
  float* v_scale = nullptr;
  int scale_stride = 0;
  float* part_o = nullptr;   // [nh][max_splits][hd]
  float* part_ml = nullptr;  // [nh][max_splits][2]
  int max_splits = 0;
  int min_split = 32;  // positions per split at least (a multiple of 32)
  const DecodeCtrl* ctrl = nullptr;
  int nh = 0, nkv = 0, hd = 0, q_head_stride = 0, gated = 0;
  float* out = nullptr;  // combine: [nh * hd], times sigmoid(gate) when gated
  int prefetch = 1;      // set by launch_attention: first K / V rows requested before the wait
  TraceSpec trace;  // set by the launch function
};
void launch_attention(const AttentionParams& p, cudaStream_t s, bool pdl);
void launch_attention_combine(const AttentionParams& p, cudaStream_t s, bool pdl);
// Positions per split for a context of n positions (shared by both kernels).
int attention_split_len_host(int n, int max_splits, int min_split = 32);

// ---- Embedding lookup (the first kernel of a step) ---------------------------
struct EmbedParams {
  DevMatView m;
  DecodeCtrl* ctrl = nullptr;
  float* x = nullptr;
  TraceSpec trace;
};
void launch_embed(const EmbedParams& p, cudaStream_t s, bool pdl);

// cudaSuccess when this build's kernels can run on the current device, else
// the error a launch would meet (cudaErrorNoKernelImageForDevice on a GPU
// the build has no code for: the kernels are compiled for sm_90a only).
cudaError_t kernel_image_status();

// An empty kernel (launch-overhead measurements).
void launch_empty(int blocks, int threads, int* sink, cudaStream_t s, bool pdl);
// One launch of the hand-over probe chain (bench): y from x (2048 floats,
// 256 threads per block, at least 256 blocks) after stage 0 (nothing: the
// empty kernel with one dependent store), 1 (every block reads all of x),
// 2 (+ the input RMSNorm's block reduction), 3 (+ integer codes in shared
// memory and the first item's dot products), with pre (0-4) 16-byte weight
// pieces per thread requested before the wait from w + blockIdx * 16 KB.
void launch_handover_probe(const float* x, float* y, const uint4* w, int stage, int pre, int blocks,
                           cudaStream_t s, bool pdl);
// One launch of the resident probe chain (bench): 2048 inputs, `rows` q4
// rows of 1024 bytes per block (w: the grid's rows back to back; rs: one
// float scale per row, each block's slice padded to 4), copied whole into
// shared memory with bulk copies (at most 110 KB, so two launches fit on an
// SM), inputs as xbits (8 or 16) integer codes per 32-input chunk. threads:
// 256 or 512 (two blocks per SM), -256 (256 threads, four blocks per SM).
// mode bit 0: trigger the next launch before the wait (else after it); bit
// 1: issue the copies after the wait (else before it); bit 2: no wait at
// all (x must then be constant; timing the copies alone); bits 3-4: bulk
// copies of 16 (0), 1, 4 or 64 KB; bit 5: 16-byte cp.async by every thread
// instead of bulk copies; bit 6: four rows per warp at a time with their
// reductions batched; bit 7: 3,000 SM clocks of one warp's work after the
// wait before anything else (a routed launch's selection). y[o] for the
// rows o < 2048: x[o] / 2 + 1e-3 dot(o) (misc.cu has the layout). marks
// (optional, 5 per block): the SM clock at entry, past the wait, input
// staged, weights in, end.
void launch_resident_probe(const float* x, float* y, const uint4* w, const float* rs, int rows, int blocks,
                           int threads, int xbits, int mode, unsigned long long* marks, cudaStream_t s, bool pdl);
// The persistent probe (bench; docs/cuda-decode.md "v28"): a chain of
// `nstages` dependent q4 matvecs (2048 inputs, stages[i].x rows of 1 KB per
// block, 1..128, at least 2048 outputs over the grid; stages[i].y bit 0: a
// routed stage) in one launch of one block per SM, each block streaming its
// weight slices through `slots` (2..13) 16 KB shared-memory slots ahead of
// the chain and the stages ordered by a global counter (*counter, zeroed by
// the launch). w: stage after stage, each the grid's slices back to back
// (block b's at b x rows x 1 KB). Stage i writes buf[(i & 1) 2048 + o] =
// x[o] / 2 + 1e-3 dot(o) for o < 2048, x the previous stage's output (x0 for
// the first): the dot of row o with the RMSNorm of x as 16-bit codes per
// 32-input chunk, as the resident probe. mode bit 0: a routed stage's
// copies wait until the previous stage is done; bit 1: then 3,000 SM clocks
// more (the selection); bit 2: no dependency at all (every stage reads x0;
// timing only). marks (optional, 4 per block): SM clocks spent waiting for
// the previous stage, waiting for weights, in all, and the producer's wait
// for a free slot. stages_dev: the same table in device memory.
void launch_persistent_probe(const float* x0, float* buf, const uint4* w, const int2* stages_dev, const int2* stages,
                             int nstages, int slots, int mode, unsigned* counter, unsigned long long* marks,
                             cudaStream_t s);
// SM clock in MHz while a one-thread kernel spins (cycles over globaltimer).
double measure_sm_clock_mhz(cudaStream_t s);
// One thread busy for `cycles` SM clocks (bench: launches queued behind it
// start back to back, as they do behind a decode step).
void spin_device(long long cycles, cudaStream_t s);

// ---- On-device sampling (sample.cu; the pipeline: backend/sampling.h) --------
constexpr int kMaxSampleRows = 16;  // rows of one launch (a draft run's)
struct SampleArgs {
  const float* logits = nullptr;  // rows x V logits, row r at r * row_stride
  int V = 0;
  int rows = 1;  // 1..kMaxSampleRows
  size_t row_stride = 0;
  const LogitAdjust* adjust = nullptr;  // device copy, ascending ids within a row
  const int* adjust_off = nullptr;      // row r's are [adjust_off[r], adjust_off[r + 1]); null: none
  const uint32_t* allow = nullptr;      // row r's allow mask at r * allow_words (sampling.h); null: none
  size_t allow_words = 0;
  float rep_penalty = 1.f;
  int kc = 1;  // top_k, or 1 when greedy; 0: sampling over the whole vocabulary
  float temperature = 0.f, top_p = 1.f, min_p = 0.f;
  double u[kMaxSampleRows] = {};  // each row's draw
  uint64_t* cand = nullptr;  // workspace: sample_workspace_bytes(V, kc, rows) bytes
  int* out = nullptr;        // row r: [2r] the token, [2r + 1] 1: the draw was used, 2: no finite logit
};
size_t sample_workspace_bytes(int V, int kc, int rows = 1);
// marks (bench): when given, an event is recorded before each launch and one
// after the last (at most kSampleLaunches + 1); returns the launches made.
constexpr int kSampleLaunches = 5;
int launch_sample(const SampleArgs& a, cudaStream_t s, cudaEvent_t* marks = nullptr);

// Log-probabilities under the raw rows (TokenLogprobs, sampling.h): the
// chosen ids' (ids[2r], SampleArgs::out's layout) and each row's `top` most
// likely ids'. Two launches: each block's max, sum of exp(x - max) in
// double and top ids; then one block a row merges them (the log-sum-exp as
// engine::log_sum_exp computes it, up to the order of the double sum).
struct RowLogprobs {
  float logprob;  // the chosen id's
  int n;          // alternatives listed (min(top, V))
  int ids[kMaxBackendLogprobs];
  float lp[kMaxBackendLogprobs];
};
struct LogprobArgs {
  const float* logits = nullptr;  // rows x V, row r at r * row_stride
  int V = 0;
  int rows = 1;  // 1..kMaxSampleRows
  size_t row_stride = 0;
  const int* ids = nullptr;  // row r's chosen id at ids[2r]
  // Or (one row): the id from the lm_head's argmax key, the complement of
  // its low 32 bits (DecodeCtrl::argmax_key).
  const unsigned long long* argmax_key = nullptr;
  int top = 0;               // 0..kMaxBackendLogprobs
  void* work = nullptr;      // logprob_workspace_bytes(V, rows) bytes
  RowLogprobs* out = nullptr;
};
size_t logprob_workspace_bytes(int V, int rows);
void launch_logprobs(const LogprobArgs& a, cudaStream_t s);

// ---- Random fills for synthetic models and benchmark caches ------------------
void fill_random_u32(uint32_t* p, size_t n, uint64_t seed, cudaStream_t s);
// u32 = (bf16 scale) | (bf16 bias) << 16 with scale ~ scale * (1 +- jitter),
// bias = bias_per_scale * scale.
void fill_random_scale_bias(uint32_t* p, size_t n, float scale, float jitter,
                            float bias_per_scale, uint64_t seed, cudaStream_t s);
void fill_random_f32(float* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t s);
void fill_random_bf16(uint16_t* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t s);

}  // namespace lily::cuda

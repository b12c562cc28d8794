// CPU kernels: f32 activations, weights read in their stored format and
// dequantized in registers / a per-thread row buffer. Each is tested against
// a plain reference on random, odd-sized inputs (tests/cpu_kernels_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/thread_pool.h"
#include "model/weights.h"

namespace lily::cpu {

// out[c] = W[r][c] as f32, for one row.
void dequantize_row(const Matrix& w, int row, float* out);

// y[t * y_stride + r] = sum_c W[r][c] * x[t * x_stride + c] for t < T, in
// f32. On x86-64 CPUs with AVX2 + FMA (or AVX-512) the weights are decoded
// in registers (up to 4 or 8 input rows per pass over a row); elsewhere
// each weight row is expanded once into a buffer and reused across the T
// input rows. A row's result does not depend on the thread count.
// act: the precision of the inputs of quantized weights (below); F32 for
// every other format.
enum class ActPrecision { F32, Q16, Q8 };
void matmul(ThreadPool& pool, const Matrix& w, const float* x, int T, size_t x_stride, float* y,
            size_t y_stride, ActPrecision act = ActPrecision::F32);
// Several matmuls as one parallel loop over all their rows (one hand-off to
// the threads instead of one each; every row computed as matmul computes
// it, so the results are the same bits). Jobs with T <= 0 are skipped.
struct MatmulJob {
  const Matrix* w;
  const float* x;
  int T;
  size_t x_stride;
  float* y;
  size_t y_stride;
};
void matmul_many(ThreadPool& pool, std::span<const MatmulJob> jobs, ActPrecision act = ActPrecision::F32);

// Integer inputs (ActPrecision::Q16 / Q8): a quantized matrix's inputs are
// rounded to integer codes per weight group (quantize_inputs) and multiplied
// with integer dot products (AVX-512 VNNI: 4 weight codes x 8-bit inputs per
// instruction, exact in int32), the sums scaled per group in f32 and the
// bias term taken from the f32 inputs. Q16: codes up to +-32512 (15 bits
// under the group's largest |x|, as the cuda backend's default), held as two
// int8 parts, hi = floor((code + 128) / 256) and lo = code - 256 hi, so
// sum(q code) = 256 sum(q hi) + sum(q lo); Q8: +-127 (7 bits, llama.cpp's
// class; the tiny random test models drift by tens of percent at 8 bits
// while each product moves by ~1%: their MoE flips experts, docs/benchmarks.md).
// Without VNNI, AVX2's VPMADDUBSW + VPMADDWD do the same for 4-bit
// weights (8-bit weights would saturate its 16-bit pair sums). A matrix the
// kernel cannot take (group sizes that do not tile a load, columns not a
// multiple of 128 / 64, 8-bit weights on AVX2) runs the f32 kernels.
enum class IntKernel { None, Avx2, Avx512Vnni };
IntKernel integer_kernel();  // for this CPU under the matmul_isa() cap
const char* integer_kernel_name(IntKernel k);
inline bool integer_inputs_supported() { return integer_kernel() != IntKernel::None; }
bool integer_inputs_fit(const Matrix& w, IntKernel k);  // the kernel takes this matrix's layout
constexpr int kMaxCode16 = 32512;
// The rounding: per group, scale = max|x| / max_code (0 for an all-zero
// group) and codes round(x / scale) in [-max_code, max_code].
void quantize_inputs(const float* x, int cols, int group_size, int max_code, int32_t* codes, float* scales);
// The kernel matmul takes: the widest the CPU has (checked at run time) up
// to a cap, set by set_matmul_isa (tests, A/B runs) or else by the
// environment (LILY_CPU_SIMD=0|portable, avx2 or avx512; default: no cap).
// A matrix the kernel cannot take (quantization groups not whole vectors)
// takes the next narrower one.
enum class MatmulIsa { Portable = 0, Avx2 = 1, Avx512 = 2 };
MatmulIsa matmul_isa();
void set_matmul_isa(MatmulIsa cap);
const char* matmul_isa_name(MatmulIsa isa);

// The attention's two products over a slice of n cached positions for the
// G query heads of one KV head (matmul's kernel choice; attention.cpp):
// s[g n + p] = scale q_g . k_p (q_g at q + g q_stride, k_p at k + p kv_row),
// and o_g += sum_p w[g n + p] v_p (o_g at o + g o_stride).
void attention_scores(const float* q, size_t q_stride, int G, const float* k, size_t kv_row, int n, int hd,
                      float scale, float* s);
void attention_values(const float* w, int G, int n, const float* v, size_t kv_row, int hd, float* o,
                      size_t o_stride);
// s[i] = exp(s[i] - m) for i < n, returning their sum (vector exp: within
// ~2 ulp of std::exp for arguments >= -87, ~1.6e-38 below).
float exp_shift_sum(float* s, int n, float m);

// y = x / sqrt(mean(x^2) + eps) * weight, over n values (in place allowed).
void rms_norm(const float* x, const float* weight, int n, float eps, float* y);

// NeoX ("rotate half") RoPE on the first rotary_dim values of one head.
void rope_neox(float* head, int rotary_dim, int position, float theta);
// The same in two steps, so that the heads of a token share one table:
// cos / sin of each rotary pair's angle (rotary_dim / 2 values each), then
// the rotation of one head.
void rope_table(int rotary_dim, int position, float theta, float* cos_out, float* sin_out);
void rope_apply(float* head, int rotary_dim, const float* cos_in, const float* sin_in);

float silu(float x);
float sigmoid(float x);
float softplus(float x);  // torch semantics: x for x > 20

// Gated DeltaNet over one value head. q, k: [T][dk] (q already scaled and
// both L2-normalised), v: [T][dv], g (log-decay) and beta: [T]; state:
// [dk][dv], updated in place; out: [T][dv] (deltanet_recurrent: null for
// the state update alone). Strides in floats between tokens.
struct DeltaNetHeadIO {
  const float* q; size_t q_stride;
  const float* k; size_t k_stride;
  const float* v; size_t v_stride;
  const float* g; const float* beta; size_t gb_stride;
  float* out; size_t out_stride;
  int T, dk, dv;
};
void deltanet_recurrent(const DeltaNetHeadIO& io, float* state);
// Chunked (WY) form, chunk_size tokens per block; equal to the recurrent form.
void deltanet_chunked(const DeltaNetHeadIO& io, float* state, int chunk_size = 64);

// A Gated DeltaNet layer between its projections and its gated norm, for T
// tokens: causal depthwise conv1d (kernel K) over [carried K-1 inputs | qkv],
// SiLU, the carried inputs updated; L2 norm of every q and k head (q also
// scaled by 1/sqrt(dk)); beta = sigmoid(b), g = -exp(a_log) softplus(a +
// dt_bias); then the delta rule per value head (value head h reads key head
// h / (nv / nk)): recurrent for one token, chunked by 64 otherwise.
struct DeltaNetLayerIO {
  int T, nk, nv, dk, dv, K;
  const float* qkv;      // [T][C], C = 2 nk dk + nv dv: [all q | all k | all v]
  const float* a;        // [T][nv]
  const float* b;        // [T][nv]
  const float* conv_w;   // [C][K]
  const float* a_log;    // [nv]
  const float* dt_bias;  // [nv]
  float* conv_state;     // [C][K-1] (updated)
  float* state;          // [nv][dk][dv] (updated)
  float* out;            // [T][nv dv]
  // Speculative runs: the recurrent form for every token (as T decode
  // steps) and the per-token values deltanet_replay needs written here:
  // rec_qkv [T][C] (after the conv, SiLU and the L2 norms), rec_g and
  // rec_beta [T][nv]. Null: not recorded.
  float* rec_qkv = nullptr;
  float* rec_g = nullptr;
  float* rec_beta = nullptr;
};
void deltanet_layer(ThreadPool& pool, const DeltaNetLayerIO& io);

// Brings a layer from its state before a recorded run (conv_state, state as
// they were) to its state after the run's first n tokens: the conv inputs
// advance by qkv_in's first n rows (the run's in_proj outputs, [T][C]) and
// the delta rule replays rec_* of deltanet_layer for those tokens without
// computing outputs. The same arithmetic as the run, so the same bits.
struct DeltaNetReplayIO {
  int n, nk, nv, dk, dv, K;
  const float* qkv_in;  // [n][C]
  const float* rec_qkv;
  const float* rec_g;
  const float* rec_beta;
  float* conv_state;  // [C][K-1] (updated)
  float* state;       // [nv][dk][dv] (updated)
};
void deltanet_replay(ThreadPool& pool, const DeltaNetReplayIO& io);

}  // namespace lily::cpu

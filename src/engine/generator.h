// The request-level generation loop: prompt tokens + sampling parameters +
// stop conditions in, a stream of token / text events out.
//
// A Generator owns one Sequence (one slot) and runs one request at a time on
// the calling thread. Between requests it keeps the model state of the last
// conversation, so that a request whose prompt extends what the slot holds
// (the previous prompt + reply, as a chat follow-up renders it) only runs the
// new tokens. Two candidates are tried, longest first:
//   * the live sequence (previous prompt + generated tokens fed so far);
//   * a snapshot taken right after the previous prompt's prefill (so a
//     follow-up whose rendering of the reply differs from the generated
//     tokens, e.g. with the reasoning stripped, or a regenerate of the same
//     prompt, still reuses the prompt). The snapshot is skipped when the
//     cache is larger than snapshot_budget_bytes.
// The reused length is reported as cached_tokens. Greedy and seeded
// generations are reproducible with or without reuse up to floating-point
// differences between one prefill and several (the same math, other chunks).
//
// Text: generated ids go through a StreamDecoder (valid UTF-8 only) and a
// StopMatcher; the text in the events is what the client may see. A token in
// stop_token_ids ends the generation without adding text; it counts as a
// completion token. The last sampled token is never fed to the model.
//
// Cancellation: `cancel` is polled between prefill chunks and before each
// decode step; on_event returning false cancels too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "engine/sequence.h"

namespace lily::text {
class Tokenizer;
}

namespace lily::engine {

struct GenerationParams {
  std::vector<int> prompt;
  SamplingParams sampling;
  int max_tokens = 16;              // >= 1
  std::vector<int> stop_token_ids;  // e.g. the model's EOS ids
  std::vector<std::string> stop_strings;
  int top_logprobs = -1;     // -1: no logprobs; else 0..20 alternatives
  bool skip_special = true;  // leave special tokens out of the text
  bool reuse_prefix = true;
};

enum class FinishReason { Stop, Length, Cancelled };
const char* finish_reason_name(FinishReason r);

struct TokenInfo {
  int id = 0;
  float logprob = 0;                       // under the raw logits
  std::vector<std::pair<int, float>> top;  // top_logprobs alternatives
};

// One step of output. A token event carries the sampled token and the text
// that became visible with it (possibly empty: held back by the UTF-8
// decoder or the stop matcher). The last event of a generation may carry
// text only (what was held back until the end).
struct GenerationEvent {
  std::optional<TokenInfo> token;
  std::string text;
};

struct GenerationResult {
  FinishReason finish = FinishReason::Stop;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  int completion_tokens = 0;
  std::string matched_stop;    // the stop string that ended it, if any
  int stop_token = -1;         // the stop token that ended it, if any
  double prefill_seconds = 0;  // start of generate() to the first token
  double decode_seconds = 0;   // first token to the end
};

class Generator {
 public:
  // `backend` and `tokenizer` must outlive the generator. context: the
  // sequence capacity (prompt + generated tokens).
  Generator(Backend& backend, const text::Tokenizer& tokenizer, int context);

  int context() const { return context_; }
  size_t snapshot_budget_bytes = size_t{1} << 30;
  int prefill_chunk = 512;  // tokens per forward during prefill (cancellation points)

  // Runs one generation. Throws lily::Error on an invalid request (prompt
  // empty or beyond the context, bad token ids, bad sampling parameters)
  // before anything is emitted; the slot is then reset.
  using EventFn = std::function<bool(GenerationEvent&&)>;
  GenerationResult generate(const GenerationParams& params, const EventFn& on_event,
                            const std::atomic<bool>* cancel = nullptr);

  // Forgets the kept state.
  void reset();
  // Tokens the live slot holds (for tests).
  const std::vector<int>& slot_tokens() const { return seq_.tokens(); }

 private:
  // Brings the sequence to `prompt`, reusing what it can; returns the
  // logits after the last prompt token, or nullopt if cancelled.
  std::optional<std::vector<float>> prefill(const std::vector<int>& prompt, bool reuse, int& cached,
                                            const std::atomic<bool>* cancel);

  GenerationResult run(const GenerationParams& params, Sampler& sampler, int max_new,
                       std::chrono::steady_clock::time_point t0, const EventFn& on_event,
                       const std::atomic<bool>* cancel);

  Backend& backend_;
  const text::Tokenizer& tokenizer_;
  int context_;
  Sequence seq_;
  std::optional<Sequence::Snapshot> snap_;
  std::vector<float> snap_logits_;
};

}  // namespace lily::engine

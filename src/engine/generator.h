// The request-level generation loop: prompt tokens + sampling parameters +
// stop conditions in, a stream of token / text events out.
//
// A Generator owns one Sequence (the live slot) and runs one request at a
// time on the calling thread. Between requests it keeps model states in a
// prefix cache (engine/prefix_cache.h, bounded in bytes and entries), so
// that a request only runs what no kept state covers:
//   * the live sequence (previous prompt + generated tokens fed so far), for
//     a follow-up turn that extends it;
//   * (hybrid models) a state kept right after each prompt's prefill, with
//     its logits, for a follow-up whose rendering of the reply differs from
//     the generated tokens (e.g. with the reasoning stripped) and for a
//     regenerate of the same prompt;
//   * (hybrid models) a state kept where two prompts diverged (a branch
//     point), so that requests sharing a preamble (system prompt, tool
//     definitions) reuse it from the third on: the prefill of the second
//     stops there first;
//   * the live sequence of another conversation, parked in the cache when a
//     request switched away from it.
// Models without DeltaNet layers reuse any common prefix of any kept state
// (a KV cache can be cut back); hybrid models need a state at exactly the
// reused length, which is why branch points are kept for them.
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
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/sequence.h"

namespace lily::text {
class Tokenizer;
class JsonGrammar;
class TokenTrie;
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
  // Constrained decoding (needs a tokenizer): every token is drawn from those
  // the grammar allows next, and a stop token only once the output is a
  // complete value. With grammar_after set (e.g. "</think>"), the
  // constraint starts after that text in the output.
  std::shared_ptr<const text::JsonGrammar> json_grammar;
  std::string grammar_after;
  // Constrained tool calls (needs a tokenizer; ignored with json_grammar):
  // after each tool_trigger in the output (past grammar_after when set, and
  // past the reasoning when the output opens with think_open), the call
  // follows tool_grammar (JsonGrammar::tool_calls) until it is released;
  // then the output is free again until the next trigger. tool_forced: the
  // prompt ends inside a call (tool_choice required / named), whose text
  // after the trigger is tool_prefix: the constraint starts there.
  std::shared_ptr<const text::JsonGrammar> tool_grammar;
  std::string tool_trigger = "<tool_call>";
  std::string think_open;  // e.g. "<think>" when reasoning is on
  bool tool_forced = false;
  std::string tool_prefix;
  // Speculative decoding: the most tokens drafted (by prompt lookup) after
  // a token and verified with it in one forward; 0: none; -1: the
  // generator's speculative_tokens.
  int speculative_tokens = -1;
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
  int draft_tokens = 0;        // speculative: tokens drafted and run
  int accepted_tokens = 0;     // of them, those the samples matched
};

class Generator {
 public:
  // `backend` and `tokenizer` must outlive the generator. context: the
  // sequence capacity (prompt + generated tokens).
  Generator(Backend& backend, const text::Tokenizer& tokenizer, int context)
      : Generator(backend, &tokenizer, context) {}
  // Without a tokenizer the events carry token ids and no text (stop
  // strings never match): for benchmarks of models without one.
  Generator(Backend& backend, const text::Tokenizer* tokenizer, int context);

  int context() const { return context_; }
  int prefill_chunk = 512;  // tokens per forward during prefill (cancellation points)
  // A branch point is kept only where at least this many tokens are shared,
  // and a conversation switched away from is parked only when no kept state
  // (or, for a pure-attention model, the part the next request keeps) covers
  // all but fewer than this many of its tokens.
  int keep_min_tokens = 64;
  // Speculative decoding (prompt lookup): the most tokens drafted per step
  // (capped by Backend::max_draft_run; 0: off), and whether drafting pauses
  // while its runs cost more time than the tokens they produce (off: always
  // draft when a draft is found, for tests).
  int speculative_tokens = 0;
  bool speculative_adaptive = true;
  // Whether a decode step's next token may be chosen by the backend itself
  // (Backend::can_sample: the same pipeline and draw as engine::Sampler,
  // without the row of logits coming back; with a request's logprobs where
  // the backend gives them too), where no grammar mask it cannot apply is
  // needed at that token. Off: always on the host.
  bool backend_sampling = true;
  // Limits of the prefix cache (default 1 GiB, 32 entries; 0 bytes or
  // entries: only the live sequence is reused).
  void set_prefix_cache(size_t budget_bytes, int max_entries) { cache_.configure(budget_bytes, max_entries); }
  const PrefixCache& prefix_cache() const { return cache_; }

  // Runs one generation. Throws lily::Error on an invalid request (prompt
  // empty or beyond the context, bad token ids, bad sampling parameters)
  // before anything is emitted; the slot is then reset.
  using EventFn = std::function<bool(GenerationEvent&&)>;
  GenerationResult generate(const GenerationParams& params, const EventFn& on_event,
                            const std::atomic<bool>* cancel = nullptr);

  // Forgets the kept states.
  void reset();
  // Tokens the live slot holds (for tests).
  const std::vector<int>& slot_tokens() const { return seq_.tokens(); }

 private:
  class Speculation;

  // Brings the sequence to `prompt`, reusing what it can; returns the
  // logits after the last prompt token, or nullopt if cancelled.
  std::optional<std::vector<float>> prefill(const std::vector<int>& prompt, bool reuse, int& cached,
                                            const std::atomic<bool>* cancel);

  GenerationResult run(const GenerationParams& params, Sampler& sampler, int max_new,
                       std::chrono::steady_clock::time_point t0, const EventFn& on_event,
                       const std::atomic<bool>* cancel);

  // Runs prompt[seq_.size(), end) in chunks; false if cancelled.
  bool feed(const std::vector<int>& prompt, size_t end, std::vector<float>& logits,
            const std::atomic<bool>* cancel);
  // Keeps a copy of the live sequence's state in the cache (with the logits
  // after its last token, if given) unless a kept state, or the `held`
  // first tokens staying in the live sequence, cover all but fewer than
  // `min_new` of its tokens.
  // Returns the kept entry (nullptr if none); `keep` as PrefixCache::insert.
  const PrefixCache::Entry* keep_live(std::vector<float> logits, size_t held = 0,
                                      size_t min_new = 1, const PrefixCache::Entry* keep = nullptr);

  Backend& backend_;
  const text::Tokenizer* tokenizer_;
  std::shared_ptr<const text::TokenTrie> trie_;  // for constrained decoding, built on first use
  int context_;
  Sequence seq_;
  PrefixCache cache_{size_t{1} << 30, 32};
};

}  // namespace lily::engine

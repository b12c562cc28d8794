#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <new>

#include "core/error.h"
#include "engine/draft.h"
#include "text/detokenizer.h"
#include "text/json_constraint.h"
#include "text/stop_matcher.h"
#include "text/tokenizer.h"

namespace lily::engine {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// A grammar's token mask (one 0 / 1 byte an id) as a backend's allow mask
// (backend/sampling.h), the stop tokens added once the value is complete or
// when nothing else is left: what the host path leaves finite in the row.
void pack_allowed(const std::vector<uint8_t>& allowed, bool can_end, const std::vector<int>& stop_ids,
                  std::vector<uint32_t>& bits) {
  const size_t V = allowed.size();
  bits.assign(allow_words(V), 0u);
  bool any = false;
  size_t i = 0;
  for (; i + 8 <= V; i += 8) {
    uint64_t x;
    std::memcpy(&x, allowed.data() + i, 8);
    // Byte k (0 or 1) to bit k: the products land on distinct bits, those of
    // b_k * 2^(8k + 56 - 7k) at bit 56 + k.
    const uint32_t b = static_cast<uint32_t>((x * 0x0102040810204080ull) >> 56);
    bits[i / 32] |= b << (i % 32);
    any = any || b != 0;
  }
  for (; i < V; ++i)
    if (allowed[i]) {
      bits[i / 32] |= 1u << (i % 32);
      any = true;
    }
  if (can_end || !any)
    for (int s : stop_ids)
      if (s >= 0 && static_cast<size_t>(s) < V) bits[static_cast<size_t>(s) / 32] |= 1u << (s % 32);
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop:
      return "stop";
    case FinishReason::Length:
      return "length";
    case FinishReason::Cancelled:
      return "cancelled";
  }
  return "stop";
}

Generator::Generator(Backend& backend, const text::Tokenizer* tokenizer, int context)
    : backend_(backend), tokenizer_(tokenizer), context_(context), seq_(backend, context) {}

void Generator::reset() {
  seq_.reset();
  cache_.clear();
}

bool Generator::feed(const std::vector<int>& prompt, size_t end, std::vector<float>& logits,
                     const std::atomic<bool>* cancel) {
  size_t pos = static_cast<size_t>(seq_.size());
  const size_t chunk = static_cast<size_t>(std::max(1, prefill_chunk));
  while (pos < end) {
    if (cancel && cancel->load()) return false;
    const size_t n = std::min(chunk, end - pos);
    logits = seq_.append(std::span<const int>(prompt.data() + pos, n));
    pos += n;
  }
  return true;
}

const PrefixCache::Entry* Generator::keep_live(std::vector<float> logits, size_t held,
                                               size_t min_new, const PrefixCache::Entry* keep) {
  if (!cache_.enabled() || seq_.size() == 0) return nullptr;
  const size_t covered = std::max(held, cache_.reach(seq_.tokens(), backend_.can_truncate()));
  if (static_cast<size_t>(seq_.size()) < covered + std::max<size_t>(1, min_new)) return nullptr;
  try {
    Sequence::Snapshot snap = seq_.snapshot();
    return cache_.insert(std::move(snap.tokens), std::move(snap.cache), std::move(logits), keep);
  } catch (const lily::Error&) {
    // No memory for the copy (e.g. on the GPU): go on without keeping it.
  } catch (const std::bad_alloc&) {
  }
  return nullptr;
}

std::optional<std::vector<float>> Generator::prefill(const std::vector<int>& prompt, bool reuse,
                                                     int& cached, const std::atomic<bool>* cancel) {
  cached = 0;
  const size_t P = prompt.size();
  const bool cut = backend_.can_truncate();
  std::vector<float> logits;

  // The live sequence is cut back or dropped unless the prompt extends it:
  // keep its state first (another conversation may continue it) unless
  // little of it would be lost.
  const size_t live_common = common_prefix(seq_.tokens(), prompt);
  const size_t min_keep = static_cast<size_t>(std::max(1, keep_min_tokens));
  if (!reuse || live_common < static_cast<size_t>(seq_.size()))
    keep_live({}, reuse && cut ? std::min(live_common, P - 1) : 0, min_keep);

  // How far the live sequence and the kept states reach into the prompt.
  // A start shorter than the prompt leaves a token to run for the logits.
  size_t live_use = 0, entry_use = 0, kept_common = 0;
  const PrefixCache::Entry* entry = nullptr;
  if (reuse) {
    if (cut) live_use = std::min(live_common, P - 1);
    else if (live_common == static_cast<size_t>(seq_.size()) && live_common < P) live_use = live_common;
    const auto [common_entry, common_len] = cache_.find_common(prompt);
    kept_common = common_len;
    if (cut) {
      entry = common_entry;
      const bool whole = entry && common_len == P && entry->tokens.size() == P && !entry->logits.empty();
      entry_use = whole ? P : std::min(common_len, P - 1);
    } else if ((entry = cache_.find_prefix(prompt))) {
      entry_use = entry->tokens.size();
    }
  }

  bool have_logits = false;
  const PrefixCache::Entry* base = nullptr;  // the kept state this prompt builds on
  if (entry && entry_use > live_use) {
    base = entry;
    seq_.restore(entry->tokens, *entry->state);
    if (entry_use < entry->tokens.size()) seq_.truncate(static_cast<int>(entry_use));
    if (entry_use == P) {
      logits = entry->logits;
      have_logits = true;
    }
    cached = static_cast<int>(entry_use);
  } else if (live_use > 0) {
    seq_.truncate(static_cast<int>(live_use));
    cached = static_cast<int>(live_use);
  } else {
    seq_.reset();
  }

  // A hybrid model reuses a state only at its exact length: where this
  // prompt leaves a kept sequence (or the live one), keep a state for the
  // next prompt that shares the same beginning.
  const size_t branch = std::max(kept_common, live_common);
  if (reuse && !cut && branch > static_cast<size_t>(seq_.size()) && branch < P &&
      branch >= min_keep) {
    if (!feed(prompt, branch, logits, cancel)) return std::nullopt;
    if (const PrefixCache::Entry* b = keep_live(logits, 0, 1, base)) base = b;
  }
  if (static_cast<size_t>(seq_.size()) < P) {
    if (!feed(prompt, P, logits, cancel)) return std::nullopt;
    have_logits = true;
  }
  if (!have_logits) fail("internal: no logits after prefill");

  // Keep the state at the end of this prompt for a follow-up or a
  // regenerate (a pure-attention model's live sequence serves both once
  // parked, cut back).
  if (reuse && !cut) keep_live(logits, 0, 1, base);
  return logits;
}

GenerationResult Generator::generate(const GenerationParams& params, const EventFn& on_event,
                                     const std::atomic<bool>* cancel) {
  const auto t0 = Clock::now();
  const std::vector<int>& prompt = params.prompt;
  if (prompt.empty()) fail("the prompt is empty");
  if (static_cast<long long>(prompt.size()) > context_)
    fail("the prompt has ", prompt.size(), " tokens, more than the context of ", context_);
  if (params.max_tokens < 1) fail("max_tokens must be at least 1 (got ", params.max_tokens, ")");
  const int V = backend_.config().vocab_size;
  for (int t : prompt)
    if (t < 0 || t >= V) fail("token id ", t, " is outside the vocabulary [0, ", V, ")");
  for (const auto& b : params.sampling.logit_bias)
    if (b.first >= V) fail("logit_bias: token id ", b.first, " is outside the vocabulary [0, ", V, ")");
  Sampler sampler(params.sampling);  // validates

  // The last sampled token is never fed, so a prompt of P tokens can grow
  // by context - P + 1 tokens.
  const int room = context_ - static_cast<int>(prompt.size()) + 1;
  const int max_new = std::min(params.max_tokens, room);

  // Any failure past this point may leave the slot half-updated: forget it.
  try {
    return run(params, sampler, max_new, t0, on_event, cancel);
  } catch (...) {
    reset();
    throw;
  }
}

// Speculative decoding inside Generator::run. A draft (prompt lookup) is
// fed with the token after which it follows as one run; each sample then
// either matches the run's next draft token (its logits are the run's next
// row: no forward) or ends the run's use, the unmatched rest dropped. The
// samples are drawn exactly as without drafts (same sampler, same random
// draws), so the output's distribution, and a seeded output, are those of
// plain decoding up to the floating-point difference between a run and
// single steps. Runs are timed against plain steps: while runs produce
// fewer tokens per second than plain steps would, drafting pauses for a
// growing number of steps.
class Generator::Speculation {
 public:
  Speculation(Generator& g, const GenerationParams& params, int max_new)
      : g_(g), max_new_(max_new), logprobs_(params.top_logprobs) {
    const int limit = params.speculative_tokens >= 0 ? params.speculative_tokens : g.speculative_tokens;
    max_k_ = std::min(limit, g.backend_.max_draft_run() - 1);
    k_ = max_k_;
  }

  // A grammar's masks for a run's rows (rows[i]: the token after run[i]);
  // false where the backend cannot take the run (it goes to the host).
  std::function<bool(const std::vector<int>& run, std::vector<TokenSampling>& rows)> row_masks;

  // Whether the backend chose the pending run's tokens (row_id(i): row
  // i's), rather than returning its rows of logits.
  bool picked() const { return picker_ != nullptr; }
  int row_id(size_t i) const { return row_ids_[i]; }
  // Row i's log-probabilities as the backend gave them with its choice
  // (null when the request has none).
  const TokenLogprobs* row_logprobs(size_t i) const { return logprobs_ >= 0 ? &row_lp_[i] : nullptr; }

  // Whether the sampled token is the run's next draft (then already fed).
  bool matched(int id) {
    if (used_ < draft_.size() && draft_[used_] == id) {
      ++used_;
      return true;
    }
    return false;
  }
  size_t used() const { return used_; }

  // Keeps the fed token and the matched drafts of the pending run.
  void settle(GenerationResult& res) {
    if (draft_.empty()) return;
    if (picker_) {  // rows 0..used_ were sampled: their draws stay taken, the rest go back
      int draws = 0;
      for (size_t r = 0; r <= used_; ++r) draws += row_drew_[r];
      picker_->backend_done(draws);
      picker_ = nullptr;
    }
    const auto t = Clock::now();
    g_.seq_.accept_draft(static_cast<int>(1 + used_));
    run_s_ += seconds_between(t, Clock::now());
    res.draft_tokens += static_cast<int>(draft_.size());
    res.accepted_tokens += static_cast<int>(used_);
    learn(static_cast<int>(used_));
    draft_.clear();
    used_ = 0;
  }

  // Feeds `id` with a draft after it, if there is one worth running;
  // `out` gets a row of logits per token of the run, or, with `picker` (the
  // sampler, where the backend may choose) and a backend that takes it,
  // the backend samples the rows itself (picked()): row i with the
  // history up to the run's token i and the i-th of as many draws taken
  // ahead, those of rows never reached given back at settle().
  bool start(int id, const std::vector<int>& history, int produced, std::vector<float>& out, Sampler* picker,
             size_t prompt_len) {
    if (max_k_ <= 0) return false;
    if (pause_ > 0) {
      --pause_;
      return false;
    }
    if (step_s_ <= 0) return false;  // time a plain step first
    // Drafts past the last sample, or past the context, are wasted.
    const int room = std::min(max_new_ - produced - 1, g_.context_ - g_.seq_.size() - 1);
    const int k = std::min(k_, room);
    if (k <= 0) return false;
    std::vector<int> d = lookup_.propose(history, k);
    if (d.empty()) return false;
    std::vector<int> run;
    run.reserve(d.size() + 1);
    run.push_back(id);
    run.insert(run.end(), d.begin(), d.end());
    const auto t = Clock::now();
    if (!(picker && start_picked(run, history, *picker, prompt_len))) out = g_.seq_.append_draft(run);
    run_s_ = seconds_between(t, Clock::now());
    draft_ = std::move(d);
    used_ = 0;
    return true;
  }

  // A plain step whose next token the backend chooses (Sampler's
  // backend_request r): timed as plain steps are.
  int sampled_step(int id, TokenSampling& r, Sampler& sampler) {
    const auto t = Clock::now();
    sampler.backend_draw(r);
    bool drew = false;
    const int next = g_.seq_.append_sample(id, r, drew);
    sampler.backend_done(drew ? 1 : 0);
    const double s = seconds_between(t, Clock::now());
    step_s_ = step_s_ <= 0 ? s : 0.8 * step_s_ + 0.2 * s;
    return next;
  }

  std::vector<float> plain_step(int id) {
    const auto t = Clock::now();
    std::vector<float> out = g_.seq_.append(std::span<const int>(&id, 1));
    const double s = seconds_between(t, Clock::now());
    step_s_ = step_s_ <= 0 ? s : 0.8 * step_s_ + 0.2 * s;
    return out;
  }

 private:
  // After a run that matched `a` of its drafts: the next draft length and
  // whether drafting pays here.
  void learn(int a) {
    const int k = static_cast<int>(draft_.size());
    k_ = a == k ? std::min(max_k_, k + 1) : std::max(1, a + 1);
    if (!g_.speculative_adaptive || step_s_ <= 0) return;
    // Tokens this run produced per plain step's time.
    const double gain = (1 + a) * step_s_ / std::max(run_s_, 1e-9);
    gain_ = runs_ == 0 ? gain : 0.7 * gain_ + 0.3 * gain;
    ++runs_;
    if (runs_ >= 3 && gain_ < 1.0) {
      pause_ = backoff_;
      backoff_ = std::min(backoff_ * 2, 1024);
      runs_ = 0;
    } else if (gain_ >= 1.0) {
      backoff_ = 16;
    }
  }

  // The run's rows sampled by the backend, if it takes all of them.
  bool start_picked(const std::vector<int>& run, const std::vector<int>& history, Sampler& picker,
                    size_t prompt_len) {
    const size_t V = static_cast<size_t>(g_.backend_.config().vocab_size);
    std::vector<TokenSampling> rows;
    std::vector<int> h = history;  // ends with run[0]
    row_lp_.assign(run.size(), {});
    for (size_t i = 0; i < run.size(); ++i) {
      if (i > 0) h.push_back(run[i]);
      std::optional<TokenSampling> r = picker.backend_request(h, prompt_len, V);
      if (r && logprobs_ >= 0) {
        r->logprobs = logprobs_;
        r->logprobs_out = &row_lp_[i];
      }
      if (!r || !g_.backend_.can_sample_draft(*r)) return false;
      rows.push_back(std::move(*r));
    }
    if (row_masks && !row_masks(run, rows)) return false;
    picker.backend_draw(rows);
    row_ids_.assign(run.size(), 0);
    row_drew_.assign(run.size(), 0);
    g_.seq_.append_draft_sample(run, rows, row_ids_.data(), row_drew_.data());
    picker_ = &picker;
    return true;
  }

  Generator& g_;
  int max_new_;
  int logprobs_;  // the request's top_logprobs (-1: none)
  int max_k_ = 0, k_ = 0;
  PromptLookup lookup_;
  std::vector<int> draft_;  // the pending run's drafts
  Sampler* picker_ = nullptr;  // set while the backend's choices for the run are pending
  std::vector<int> row_ids_, row_drew_;
  std::vector<TokenLogprobs> row_lp_;
  size_t used_ = 0;         // how many of them the samples matched
  double step_s_ = 0, run_s_ = 0, gain_ = 0;
  int runs_ = 0, pause_ = 0, backoff_ = 16;
};

GenerationResult Generator::run(const GenerationParams& params, Sampler& sampler, int max_new,
                                std::chrono::steady_clock::time_point t0, const EventFn& on_event,
                                const std::atomic<bool>* cancel) {
  GenerationResult res;
  const std::vector<int>& prompt = params.prompt;
  res.prompt_tokens = static_cast<int>(prompt.size());
  std::optional<std::vector<float>> pre =
      prefill(prompt, params.reuse_prefix, res.cached_tokens, cancel);
  if (!pre) {
    res.finish = FinishReason::Cancelled;
    res.prefill_seconds = seconds_between(t0, Clock::now());
    return res;
  }
  // The logits the next token is drawn from: a row of `buf` (the last
  // forward's output).
  std::vector<float> buf = std::move(*pre);
  std::span<const float> logits = buf;
  const size_t V = buf.size();
  Speculation spec(*this, params, max_new);

  std::optional<text::StreamDecoder> decoder;
  if (tokenizer_) decoder.emplace(*tokenizer_, params.skip_special);
  text::StopMatcher stops(params.stop_strings);
  std::vector<int> history = prompt;
  history.reserve(prompt.size() + static_cast<size_t>(max_new));

  // Text still held back by the decoder and the stop matcher, at the end.
  auto drain = [&]() {
    std::string out = stops.push(decoder ? decoder->flush() : std::string()).emit;
    out += stops.flush();
    return out;
  };

  // Constrained decoding: the matcher follows the output while active.
  // JSON output: [WaitAfter ->] Active. Tool calls: [WaitAfter ->]
  // WaitTrigger -> Active -> (released) WaitTrigger -> ...
  enum class Gate { Off, WaitAfter, WaitTrigger, Active };
  const bool tools = !params.json_grammar && params.tool_grammar;
  const std::shared_ptr<const text::JsonGrammar>& grammar = tools ? params.tool_grammar : params.json_grammar;
  std::optional<text::JsonMatcher> matcher;
  Gate gate = Gate::Off;
  std::string after = params.grammar_after;  // the text WaitAfter waits for
  std::string before;  // output bytes while waiting for `after` or a trigger
  std::vector<uint8_t> allowed;
  std::vector<float> masked;
  if (grammar) {
    if (!tokenizer_) fail("constrained decoding needs a tokenizer");
    if (!trie_) trie_ = text::TokenTrie::build(*tokenizer_, backend_.config().vocab_size);
    if (tools && params.tool_forced) {
      matcher.emplace(grammar);
      gate = matcher->feed(params.tool_prefix) ? Gate::Active : Gate::Off;
    } else {
      gate = !after.empty() ? Gate::WaitAfter : tools ? Gate::WaitTrigger : Gate::Active;
      if (gate == Gate::Active) matcher.emplace(grammar);
    }
  }
  // Bytes of the output once a gate waits: the next gate when its text shows.
  auto wait = [&](std::string_view bytes) {
    before += bytes;
    for (;;) {
      const std::string& want = gate == Gate::WaitAfter ? after : params.tool_trigger;
      const size_t at = before.find(want);
      if (at == std::string::npos) {
        // Keep what may be the start of `want`.
        if (before.size() >= want.size()) before.erase(0, before.size() - (want.size() - 1));
        return;
      }
      std::string rest = before.substr(at + want.size());
      before.clear();
      if (gate == Gate::WaitAfter && tools) {
        gate = Gate::WaitTrigger;
        before = std::move(rest);
        continue;
      }
      matcher.emplace(grammar);
      gate = matcher->feed(rest) ? Gate::Active : Gate::Off;
      if (gate == Gate::Active && tools && matcher->released()) {
        gate = Gate::WaitTrigger;
        continue;
      }
      return;
    }
  };

  // The next token when the backend chose it with the step (no logits came
  // back): only where nothing needs the row itself (no grammar mask the
  // backend cannot apply at that token); with logprobs, next_lp holds the
  // backend's for it.
  std::optional<int> next_id;
  const TokenLogprobs* next_lp = nullptr;
  TokenLogprobs step_lp;  // a plain step's, when the backend chose its token
  // The request's log-probabilities asked of the backend with its choice.
  auto with_logprobs = [&](TokenSampling& r, TokenLogprobs* out) {
    if (params.top_logprobs < 0) return;
    r.logprobs = params.top_logprobs;
    r.logprobs_out = out;
  };
  // Whether the backend takes these parameters is asked once (can_sample
  // looks at the parameters, not at a history's adjustments).
  const bool backend_picks = [&] {
    if (!backend_sampling) return false;
    std::optional<TokenSampling> probe = sampler.backend_params(V);
    if (probe) with_logprobs(*probe, &step_lp);
    return probe && backend_.can_sample(*probe);
  }();
  // Constrained tokens too where the backend applies the grammar's mask:
  // the mask goes with the request (a bit an id) instead of the row
  // coming back to be masked here.
  const bool backend_masks = [&] {
    if (!backend_picks || !grammar) return false;
    std::optional<TokenSampling> probe = sampler.backend_params(V);
    probe->allow.assign(allow_words(V), ~0u);
    with_logprobs(*probe, &step_lp);
    return backend_.can_sample(*probe);
  }();
  // A draft run's rows too (with their grammar masks, below).
  Sampler* const run_picker = backend_picks && (!grammar || backend_masks) ? &sampler : nullptr;
  // The matcher's mask for the next token, as the backend takes it.
  auto mask_bits = [&](std::vector<uint32_t>& bits) {
    matcher->allowed_tokens(*trie_, allowed);
    pack_allowed(allowed, matcher->accepting(), params.stop_token_ids, bits);
  };
  // The backend's request for the token after the one about to be fed, if
  // the backend takes it (the grammar's mask for it when one is active).
  auto backend_request = [&]() -> std::optional<TokenSampling> {
    if (!backend_picks || (gate == Gate::Active && !backend_masks)) return std::nullopt;
    std::optional<TokenSampling> r = sampler.backend_request(history, prompt.size(), V);
    if (r) with_logprobs(*r, &step_lp);
    if (r && !backend_.can_sample(*r)) r.reset();
    if (r && gate == Gate::Active) r->allow_fill = mask_bits;  // filled while the device runs the step
    return r;
  };
  // A run's rows under a grammar: where the gate waits for a text the rows
  // are free unless the drafts' bytes bring the text (then the host takes
  // the run); where it is active, row i's mask is the matcher's after the
  // drafts up to run[i], computed while the device runs the run's forward
  // (the matcher fed ahead and put back). A run whose drafts end a tool call
  // goes to the host; rows past a draft the grammar refuses are never used
  // (that row's sample differs from the draft) and stay unmasked.
  if (grammar && run_picker)
    spec.row_masks = [&](const std::vector<int>& run, std::vector<TokenSampling>& rows) {
      if (gate == Gate::Off) return true;
      if (gate != Gate::Active) {
        std::string text = before;
        for (size_t i = 1; i < run.size(); ++i) text += tokenizer_->token_bytes(run[i]);
        return text.find(gate == Gate::WaitAfter ? after : params.tool_trigger) == std::string::npos;
      }
      const std::shared_ptr<const text::JsonMatcher::Checkpoint> start = matcher->checkpoint();
      size_t reached = 1;  // rows [0, reached) follow drafts the grammar allows
      bool ends_call = false;
      for (; reached < run.size() && matcher->feed(tokenizer_->token_bytes(run[reached])); ++reached)
        if (matcher->released()) {
          ends_call = true;
          break;
        }
      matcher->restore(*start);
      if (ends_call) return false;
      auto drafts = std::make_shared<const std::vector<int>>(run);
      for (size_t i = 0; i < reached; ++i)
        rows[i].allow_fill = [&, start, drafts, i](std::vector<uint32_t>& bits) {
          for (size_t k = 1; k <= i; ++k) matcher->feed(tokenizer_->token_bytes((*drafts)[k]));
          mask_bits(bits);
          matcher->restore(*start);
        };
      return true;
    };
  Clock::time_point t_first{};
  for (;;) {
    std::span<const float> pick_from = logits;
    if (!next_id && gate == Gate::Active) {
      matcher->allowed_tokens(*trie_, allowed);
      const bool can_end = matcher->accepting();
      masked.assign(logits.size(), -std::numeric_limits<float>::infinity());
      bool any = false;
      for (size_t i = 0; i < logits.size(); ++i)
        if (allowed[i]) {
          masked[i] = logits[i];
          any = true;
        }
      // A stop token once the value is complete (or when nothing else is
      // left, which a consistent grammar never leaves).
      for (int s : params.stop_token_ids)
        if ((can_end || !any) && s >= 0 && static_cast<size_t>(s) < logits.size()) masked[static_cast<size_t>(s)] = logits[static_cast<size_t>(s)];
      pick_from = masked;
    }
    const int id = next_id ? *next_id : sampler.sample(pick_from, history, prompt.size());
    const TokenLogprobs* id_lp = next_id ? next_lp : nullptr;
    next_id.reset();
    next_lp = nullptr;
    if (gate != Gate::Off) {
      std::string_view bytes = tokenizer_->token_bytes(id);
      if (gate == Gate::Active) {
        matcher->feed(bytes);  // allowed by construction (a stop token feeds nothing)
        if (tools && matcher->released()) {
          gate = Gate::WaitTrigger;
          before.clear();
        }
      } else {
        // Reasoning the output opens itself is never constrained.
        if (res.completion_tokens == 0 && gate == Gate::WaitTrigger && !params.think_open.empty() &&
            bytes.substr(0, params.think_open.size()) == params.think_open) {
          gate = Gate::WaitAfter;
          after = "</" + params.think_open.substr(1);  // "<think>" -> "</think>"
          bytes.remove_prefix(params.think_open.size());
        }
        wait(bytes);
      }
    }
    history.push_back(id);
    res.completion_tokens++;
    if (res.completion_tokens == 1) t_first = Clock::now();

    GenerationEvent ev;
    TokenInfo info;
    info.id = id;
    if (id_lp) {  // the backend's, with its choice
      info.logprob = id_lp->logprob;
      info.top = id_lp->top;
    } else if (params.top_logprobs >= 0) {  // from the row (one log-sum-exp for both)
      TokenLogprobs lp = token_logprobs(logits, id, static_cast<size_t>(params.top_logprobs));
      info.logprob = lp.logprob;
      info.top = std::move(lp.top);
    }
    ev.token = std::move(info);

    bool done = false;
    if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), id) !=
        params.stop_token_ids.end()) {
      res.finish = FinishReason::Stop;
      res.stop_token = id;
      ev.text = drain();
      done = true;
    } else {
      auto r = stops.push(decoder ? decoder->push(id) : std::string());
      ev.text = std::move(r.emit);
      if (r.stopped) {
        res.finish = FinishReason::Stop;
        res.matched_stop = stops.matched();
        done = true;
      } else if (res.completion_tokens >= max_new) {
        res.finish = FinishReason::Length;
        ev.text += drain();
        done = true;
      }
    }
    const bool keep_going = on_event(std::move(ev));
    if (done) break;
    if (!keep_going || (cancel && cancel->load())) {
      res.finish = FinishReason::Cancelled;
      break;
    }
    // Feed the token, unless a draft run already did: its next row holds
    // the logits. Otherwise settle the run (its unmatched drafts dropped)
    // and feed the token with new drafts after it, if any.
    if (spec.matched(id)) {
      if (spec.picked()) {
        next_id = spec.row_id(spec.used());
        next_lp = spec.row_logprobs(spec.used());
      } else {
        logits = std::span<const float>(buf).subspan(spec.used() * V, V);
      }
      continue;
    }
    spec.settle(res);
    std::optional<TokenSampling> request;
    if (spec.start(id, history, res.completion_tokens, buf, run_picker, prompt.size())) {
      if (spec.picked()) {
        next_id = spec.row_id(0);
        next_lp = spec.row_logprobs(0);
      } else {
        logits = std::span<const float>(buf).first(V);
      }
    } else if ((request = backend_request())) {
      next_id = spec.sampled_step(id, *request, sampler);
      next_lp = request->logprobs_out;
    } else {
      buf = spec.plain_step(id);
      logits = buf;
    }
  }
  // The last sampled token is never fed: a draft run's unmatched part, and
  // the token itself where it matched a draft, are dropped.
  spec.settle(res);
  const auto t_end = Clock::now();
  res.prefill_seconds = seconds_between(t0, t_first);
  res.decode_seconds = seconds_between(t_first, t_end);
  return res;
}

}  // namespace lily::engine

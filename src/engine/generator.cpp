#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <new>

#include "core/error.h"
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
  std::vector<float> logits = std::move(*pre);

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

  Clock::time_point t_first{};
  for (;;) {
    std::span<const float> pick_from = logits;
    if (gate == Gate::Active) {
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
    const int id = sampler.sample(pick_from, history, prompt.size());
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
    if (params.top_logprobs >= 0) {
      info.logprob = logprob_of(logits, id);
      if (params.top_logprobs > 0)
        info.top = top_logprobs(logits, static_cast<size_t>(params.top_logprobs));
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
    logits = seq_.append(std::span<const int>(&id, 1));
  }
  const auto t_end = Clock::now();
  res.prefill_seconds = seconds_between(t0, t_first);
  res.decode_seconds = seconds_between(t_first, t_end);
  return res;
}

}  // namespace lily::engine

#include "engine/generator.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "text/detokenizer.h"
#include "text/stop_matcher.h"
#include "text/tokenizer.h"

namespace lily::engine {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

bool starts_with(const std::vector<int>& whole, const std::vector<int>& prefix) {
  return prefix.size() <= whole.size() && std::equal(prefix.begin(), prefix.end(), whole.begin());
}

// Bytes of model state per position, as the CPU backend stores it (f32 K and V
// for every attention layer). Only used to decide whether a snapshot is
// affordable; DeltaNet state is a constant on top.
size_t kv_bytes_per_position(const ModelConfig& c) {
  size_t attn = 0;
  for (auto k : c.layer_kinds) attn += k == LayerKind::FullAttention;
  return attn * 2 * static_cast<size_t>(c.num_kv_heads) * c.head_dim * sizeof(float);
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

Generator::Generator(Backend& backend, const text::Tokenizer& tokenizer, int context)
    : backend_(backend), tokenizer_(tokenizer), context_(context), seq_(backend, context) {}

void Generator::reset() {
  if (seq_.size() > 0) seq_.reset();
  snap_.reset();
  snap_logits_.clear();
}

std::optional<std::vector<float>> Generator::prefill(const std::vector<int>& prompt, bool reuse,
                                                     int& cached, const std::atomic<bool>* cancel) {
  cached = 0;
  std::vector<float> logits;
  bool have_logits = false;
  if (reuse && seq_.size() > 0 && seq_.size() < static_cast<int>(prompt.size()) &&
      starts_with(prompt, seq_.tokens())) {
    cached = seq_.size();
  } else if (reuse && snap_ && !snap_->tokens.empty() && starts_with(prompt, snap_->tokens)) {
    seq_.restore(*snap_);
    cached = seq_.size();
    if (cached == static_cast<int>(prompt.size())) {
      logits = snap_logits_;
      have_logits = true;
    }
  } else if (seq_.size() > 0) {
    seq_.reset();
  }
  if (!reuse) {
    snap_.reset();
    snap_logits_.clear();
  }

  size_t pos = static_cast<size_t>(seq_.size());
  const size_t chunk = static_cast<size_t>(std::max(1, prefill_chunk));
  while (pos < prompt.size()) {
    if (cancel && cancel->load()) return std::nullopt;
    const size_t n = std::min(chunk, prompt.size() - pos);
    logits = seq_.append(std::span<const int>(prompt.data() + pos, n));
    pos += n;
    have_logits = true;
  }
  if (!have_logits) fail("internal: no logits after prefill");

  // Keep the state at the end of this prompt for a later request.
  const bool affordable =
      kv_bytes_per_position(backend_.config()) * prompt.size() <= snapshot_budget_bytes;
  if (reuse && affordable && !(snap_ && snap_->tokens == prompt)) {
    snap_ = seq_.snapshot();
    snap_logits_ = logits;
  } else if (!affordable) {
    snap_.reset();
    snap_logits_.clear();
  }
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

  text::StreamDecoder decoder(tokenizer_, params.skip_special);
  text::StopMatcher stops(params.stop_strings);
  std::vector<int> history = prompt;
  history.reserve(prompt.size() + static_cast<size_t>(max_new));

  // Text still held back by the decoder and the stop matcher, at the end.
  auto drain = [&]() {
    std::string out = stops.push(decoder.flush()).emit;
    out += stops.flush();
    return out;
  };

  Clock::time_point t_first{};
  for (;;) {
    const int id = sampler.sample(logits, history, prompt.size());
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
      auto r = stops.push(decoder.push(id));
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

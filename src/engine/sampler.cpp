#include "engine/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace lily::engine {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr size_t kHeapLimit = 1024;  // up to this many, top-n by one pass with a heap

float key(float x) { return std::isnan(x) ? kNegInf : x; }

// Ids of the n largest value(id) for id in [0, count), largest first, lower id
// first on ties (a strict total order, so the result is unique).
template <typename Value>
void top_n(size_t count, size_t n, Value value, std::vector<int>& out) {
  auto better = [&](int a, int b) {
    const float va = value(a), vb = value(b);
    return va > vb || (va == vb && a < b);
  };
  n = std::min(n, count);
  out.clear();
  if (n == 0) return;
  if (n <= kHeapLimit && n < count) {
    // A heap whose front is the worst id kept; most ids fail the first test.
    out.reserve(n);
    for (int i = 0; i < static_cast<int>(count); ++i) {
      if (out.size() < n) {
        out.push_back(i);
        std::push_heap(out.begin(), out.end(), better);
      } else if (better(i, out.front())) {
        std::pop_heap(out.begin(), out.end(), better);
        out.back() = i;
        std::push_heap(out.begin(), out.end(), better);
      }
    }
  } else {
    out.resize(count);
    std::iota(out.begin(), out.end(), 0);
    if (n < count) std::nth_element(out.begin(), out.begin() + (n - 1), out.end(), better);
    out.resize(n);
  }
  std::sort(out.begin(), out.end(), better);
}

}  // namespace

// ---------------------------------------------------------------- params

SamplingParams SamplingParams::from_generation_config(const nlohmann::json& config) {
  if (!config.is_object()) fail("generation_config: expected a JSON object, got ", config.dump());
  SamplingParams p;
  auto number = [&](const char* field, float& out) {
    if (!config.contains(field) || config[field].is_null()) return;
    if (!config[field].is_number())
      fail("generation_config: \"", field, "\" must be a number, got ", config[field].dump());
    out = static_cast<float>(config[field].get<double>());
  };
  number("temperature", p.temperature);
  number("top_p", p.top_p);
  number("min_p", p.min_p);
  number("repetition_penalty", p.repetition_penalty);
  if (config.contains("top_k") && !config["top_k"].is_null()) {
    const auto& k = config["top_k"];
    if (!k.is_number() || std::floor(k.get<double>()) != k.get<double>() ||
        std::abs(k.get<double>()) > 1e9)
      fail("generation_config: \"top_k\" must be an integer, got ", k.dump());
    p.top_k = static_cast<int>(k.get<double>());
  }
  if (config.contains("do_sample") && !config["do_sample"].is_null()) {
    if (!config["do_sample"].is_boolean())
      fail("generation_config: \"do_sample\" must be true or false, got ",
           config["do_sample"].dump());
    if (!config["do_sample"].get<bool>()) p.temperature = 0.0f;
  }
  return p;
}

std::optional<std::string> SamplingParams::validation_error() const {
  if (!std::isfinite(temperature) || temperature < 0.0f)
    return str_cat("temperature must be a finite number >= 0 (0 = greedy), got ", temperature);
  if (!(top_p > 0.0f && top_p <= 1.0f))
    return str_cat("top_p must be in (0, 1] (1 = off), got ", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f))
    return str_cat("min_p must be in [0, 1] (0 = off), got ", min_p);
  if (top_k < 0) return str_cat("top_k must be >= 0 (0 = off), got ", top_k);
  if (!std::isfinite(repetition_penalty) || !(repetition_penalty > 0.0f))
    return str_cat("repetition_penalty must be a finite number > 0 (1 = off), got ",
                   repetition_penalty);
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) return str_cat("logit_bias: token id ", id, " is negative");
    if (!(bias >= -100.0f && bias <= 100.0f))
      return str_cat("logit_bias: the bias of token ", id, " must be in [-100, 100], got ", bias);
  }
  if (logit_bias.size() > 1) {
    std::vector<int> ids;
    for (const auto& b : logit_bias) ids.push_back(b.first);
    std::sort(ids.begin(), ids.end());
    if (auto d = std::adjacent_find(ids.begin(), ids.end()); d != ids.end())
      return str_cat("logit_bias: token id ", *d, " appears more than once");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return str_cat("presence_penalty must be in [-2, 2], got ", presence_penalty);
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    return str_cat("frequency_penalty must be in [-2, 2], got ", frequency_penalty);
  return std::nullopt;
}

void SamplingParams::validate() const {
  if (auto e = validation_error()) fail("invalid sampling parameters: ", *e);
}

// ---------------------------------------------------------------- sampler

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  params_.validate();
  if (params_.has_seed) {
    rng_.seed(params_.seed);
  } else {
    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

// ---------------------------------------------------------------- counts

namespace {

void check_history_id(int t, size_t vocab) {
  if (t < 0 || static_cast<size_t>(t) >= vocab)
    fail("Sampler: history token id ", t, " is outside the vocabulary of ", vocab);
}

}  // namespace

void TokenCounts::sync(std::span<const int> history, size_t prompt_len, size_t vocab) {
  if (vocab != vocab_ || prompt_len != prompt_len_) {
    vocab_ = vocab;
    prompt_len_ = prompt_len;
    counted_.clear();
    seen_ids_ = 0;
    seen_.assign(vocab, 0);
    generated_.assign(vocab, 0);
    seen_bits_.assign((vocab + 63) / 64, 0);
    generated_bits_.assign((vocab + 63) / 64, 0);
  }
  // The length both share: usually all of counted_ (one token appended), or
  // all but its last few (a draft run's refused tokens).
  const size_t n = std::min(counted_.size(), history.size());
  size_t common = 0;
  constexpr size_t kTail = 64;
  if (n > kTail && std::equal(counted_.begin(), counted_.begin() + static_cast<std::ptrdiff_t>(n - kTail),
                              history.begin()))
    common = n - kTail;
  common += static_cast<size_t>(std::mismatch(counted_.begin() + static_cast<std::ptrdiff_t>(common),
                                              counted_.begin() + static_cast<std::ptrdiff_t>(n),
                                              history.begin() + static_cast<std::ptrdiff_t>(common))
                                    .first -
                                (counted_.begin() + static_cast<std::ptrdiff_t>(common)));
  while (counted_.size() > common) {
    const size_t i = counted_.size() - 1;
    add(counted_[i], i >= prompt_len_, -1);
    counted_.pop_back();
  }
  for (size_t i = common; i < history.size(); ++i) {
    const int t = history[i];
    check_history_id(t, vocab_);
    add(t, i >= prompt_len_, 1);
    counted_.push_back(t);
  }
}

void TokenCounts::add(int id, bool generated, int step) {
  const size_t w = static_cast<size_t>(id) / 64;
  const uint64_t bit = uint64_t{1} << (id % 64);
  auto bump = [&](std::vector<uint32_t>& count, std::vector<uint64_t>& bits) {
    uint32_t& c = count[static_cast<size_t>(id)];
    c = static_cast<uint32_t>(static_cast<int64_t>(c) + step);
    if (c) bits[w] |= bit;
    else bits[w] &= ~bit;
    return c;
  };
  const uint32_t c = bump(seen_, seen_bits_);
  if (step > 0 && c == 1) ++seen_ids_;
  if (step < 0 && c == 0) --seen_ids_;
  if (generated) bump(generated_, generated_bits_);
}

namespace {

template <typename Fn>
void for_each_bit(const std::vector<uint64_t>& bits, Fn fn) {
  for (size_t w = 0; w < bits.size(); ++w)
    for (uint64_t b = bits[w]; b; b &= b - 1) fn(static_cast<int>(w * 64 + static_cast<size_t>(std::countr_zero(b))));
}

}  // namespace

template <typename Fn>
void TokenCounts::for_each_seen(Fn fn) const {
  for_each_bit(seen_bits_, fn);
}

template <typename Fn>
void TokenCounts::for_each_generated(Fn fn) const {
  for_each_bit(generated_bits_, [&](int id) { fn(id, static_cast<float>(generated_[static_cast<size_t>(id)])); });
}

// ---------------------------------------------------------------- penalties

bool Sampler::penalised() const {
  return params_.repetition_penalty != 1.0f || params_.frequency_penalty != 0.0f ||
         params_.presence_penalty != 0.0f;
}

void Sampler::apply_penalties(std::span<const int> history, size_t prompt_len) {
  if (!penalised()) {
    for (int t : history) check_history_id(t, work_.size());
    return;
  }
  counts_.sync(history, prompt_len, work_.size());
  if (params_.repetition_penalty != 1.0f) {
    const float r = params_.repetition_penalty;
    counts_.for_each_seen([&](int t) { work_[t] = work_[t] > 0.0f ? work_[t] / r : work_[t] * r; });
  }
  if (params_.frequency_penalty != 0.0f || params_.presence_penalty != 0.0f)
    counts_.for_each_generated([&](int id, float count) { work_[id] -= penalty_sub(count); });
}

float Sampler::penalty_sub(float count) const {
  return params_.frequency_penalty * count + params_.presence_penalty;
}

std::optional<TokenSampling> Sampler::backend_params(size_t vocab) const {
  const SamplingParams& p = params_;
  const bool whole = p.top_k <= 0 || static_cast<size_t>(p.top_k) >= vocab;
  if (!p.greedy() && !whole && p.top_k > kMaxBackendTopK) return std::nullopt;
  TokenSampling r;
  r.temperature = p.temperature;
  r.top_k = p.greedy() ? 1 : whole ? 0 : p.top_k;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.rep_penalty = p.repetition_penalty;
  return r;
}

std::optional<TokenSampling> Sampler::backend_request(std::span<const int> history, size_t prompt_len,
                                                      size_t vocab) {
  const SamplingParams& p = params_;
  std::optional<TokenSampling> req = backend_params(vocab);
  if (!req) return std::nullopt;
  TokenSampling& r = *req;
  // Each listed id once, ascending, with what sample() does to its logit in
  // sample()'s order: the bias, the repetition penalty, then the others.
  std::vector<std::pair<int, float>> bias(p.logit_bias.begin(), p.logit_bias.end());
  for (const auto& [id, b] : bias)
    if (static_cast<size_t>(id) >= vocab)
      fail("Sampler: logit_bias token id ", id, " is outside the vocabulary of ", vocab);
  std::sort(bias.begin(), bias.end());
  std::vector<LogitAdjust>& a = r.adjust;
  size_t next_bias = 0;
  auto bias_before = [&](int id) {  // the biased ids below id, with nothing else on them
    for (; next_bias < bias.size() && bias[next_bias].first < id; ++next_bias)
      a.push_back({bias[next_bias].first, LogitAdjust::kBias, bias[next_bias].second, 0.f});
  };
  auto entry = [&](int id) -> LogitAdjust& {
    bias_before(id);
    if (!a.empty() && a.back().id == id) return a.back();
    a.push_back({id, 0, 0.f, 0.f});
    if (next_bias < bias.size() && bias[next_bias].first == id) {
      a.back().ops = LogitAdjust::kBias;
      a.back().bias = bias[next_bias++].second;
    }
    return a.back();
  };
  if (penalised()) {
    counts_.sync(history, prompt_len, vocab);
    a.reserve(bias.size() + counts_.seen_ids());
    const bool rep = p.repetition_penalty != 1.0f, sub = p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
    // Every generated id is a seen one: the repetition penalty's entries
    // (ascending) already hold each; else the generated ids get their own.
    if (rep) counts_.for_each_seen([&](int id) { entry(id).ops |= LogitAdjust::kRep; });
    if (sub) {
      size_t at = 0;
      counts_.for_each_generated([&](int id, float count) {
        if (rep)
          while (a[at].id != id) ++at;
        LogitAdjust& e = rep ? a[at] : entry(id);
        e.ops |= LogitAdjust::kSub;
        e.sub = penalty_sub(count);
      });
    }
  }
  bias_before(std::numeric_limits<int>::max());
  return req;
}

void Sampler::backend_draw(std::span<TokenSampling> rows) {
  rng_before_draw_ = rng_;
  for (TokenSampling& r : rows) r.u = params_.greedy() ? 0.0 : uniform();
}

void Sampler::backend_done(int draws_used) {
  if (params_.greedy()) return;
  rng_ = rng_before_draw_;
  rng_.discard(static_cast<unsigned long long>(draws_used));  // one engine output a draw (uniform())
}

void Sampler::select_top(size_t n) {
  top_n(work_.size(), n, [this](int id) { return work_[id]; }, order_);
}

int Sampler::sample(std::span<const float> logits, std::span<const int> history,
                    size_t prompt_len) {
  const size_t vocab = logits.size();
  if (vocab == 0) fail("Sampler: empty logits");
  if (vocab > static_cast<size_t>(std::numeric_limits<int>::max()))
    fail("Sampler: vocabulary of ", vocab, " does not fit token ids");
  work_.resize(vocab);
  for (size_t i = 0; i < vocab; ++i) work_[i] = key(logits[i]);
  for (const auto& [id, bias] : params_.logit_bias) {
    if (static_cast<size_t>(id) >= vocab)
      fail("Sampler: logit_bias token id ", id, " is outside the vocabulary of ", vocab);
    work_[id] += bias;  // -inf (a masked token) stays -inf
  }
  apply_penalties(history, prompt_len);

  const int best = argmax(work_);
  const float max_logit = work_[best];
  if (!(max_logit > kNegInf)) fail("Sampler: no token has a finite logit");
  if (params_.greedy() || std::isinf(max_logit)) return best;

  // Weight of a token relative to the best one: exp((l - max) / T) in (0, 1].
  const double inv_t = 1.0 / static_cast<double>(params_.temperature);
  if (!std::isfinite(inv_t)) return best;  // a temperature too small to divide by
  auto weight = [&](int id) {
    return std::exp((static_cast<double>(work_[id]) - max_logit) * inv_t);
  };

  // Candidates: either every id (in id order, weights in weights_ by id) or
  // the list order_[0, n), in an order fixed by the logits alone.
  const size_t k = params_.top_k > 0 ? std::min(vocab, static_cast<size_t>(params_.top_k)) : vocab;
  bool listed = false;
  size_t n = vocab;
  if (k < vocab) {
    select_top(k);
    listed = true;
    n = k;
  } else {
    weights_.resize(vocab);
    // exp(-inf) is 0: a masked id (a grammar's, or -inf logits) costs no exp.
    for (size_t i = 0; i < vocab; ++i) weights_[i] = work_[i] > kNegInf ? weight(static_cast<int>(i)) : 0.0;
  }
  auto w = [&](int id) { return k < vocab ? weight(id) : weights_[id]; };

  if (params_.top_p < 1.0f) {
    // Token t is kept while the mass of the tokens better than it is below
    // top_p of the total (so the token that crosses top_p is kept).
    double total = 0.0;
    if (listed) {  // order_[0, n) is sorted, most likely first
      for (size_t i = 0; i < n; ++i) total += w(order_[i]);
      const double target = static_cast<double>(params_.top_p) * total;
      double mass = 0.0;
      size_t i = 0;
      for (; i < n && mass < target; ++i) mass += w(order_[i]);
      n = i;
    } else {
      for (size_t i = 0; i < vocab; ++i) total += weights_[i];
      const double target = static_cast<double>(params_.top_p) * total;
      // Bucket the tokens by weight, 1/8 nat per bucket, best first: every
      // bucket before the one where the mass reaches target is kept whole,
      // and only that one bucket is sorted.
      constexpr int kBuckets = 512;
      constexpr double kPerNat = 8.0;
      auto bucket_of = [&](size_t id) {
        const double d = (static_cast<double>(max_logit) - work_[id]) * inv_t * kPerNat;
        return d < kBuckets - 1 ? static_cast<int>(d) : kBuckets - 1;
      };
      std::array<double, kBuckets> bucket_mass{};
      for (size_t i = 0; i < vocab; ++i) bucket_mass[bucket_of(i)] += weights_[i];
      int cross = 0;
      double before = 0.0;
      while (cross < kBuckets - 1 && before + bucket_mass[cross] < target)
        before += bucket_mass[cross++];
      order_.clear();
      crossing_.clear();
      for (size_t i = 0; i < vocab; ++i) {
        const int b = bucket_of(i);
        if (b < cross)
          order_.push_back(static_cast<int>(i));
        else if (b == cross)
          crossing_.push_back(static_cast<int>(i));
      }
      std::sort(crossing_.begin(), crossing_.end(), [this](int a, int b) {
        return work_[a] > work_[b] || (work_[a] == work_[b] && a < b);
      });
      double mass = before;
      for (int id : crossing_) {
        if (mass >= target) break;
        order_.push_back(id);
        mass += weights_[id];
      }
      n = order_.size();
      listed = true;
    }
  }

  if (params_.min_p > 0.0f) {
    // Relative to the best token, whose weight is 1 (and which always stays).
    const double threshold = params_.min_p;
    if (listed) {
      size_t kept = 0;
      for (size_t i = 0; i < n; ++i)
        if (w(order_[i]) >= threshold) order_[kept++] = order_[i];
      n = kept;
    } else {
      order_.clear();
      for (size_t i = 0; i < vocab; ++i)
        if (weights_[i] >= threshold) order_.push_back(static_cast<int>(i));
      n = order_.size();
      listed = true;
    }
  }

  double total = 0.0;
  if (listed) {
    for (size_t i = 0; i < n; ++i) total += w(order_[i]);
  } else {
    for (size_t i = 0; i < vocab; ++i) total += weights_[i];
  }
  const double u = uniform() * total;
  double mass = 0.0;
  int last = best;
  for (size_t i = 0; i < n; ++i) {
    const int id = listed ? order_[i] : static_cast<int>(i);
    const double wi = w(id);
    if (wi <= 0.0) continue;
    mass += wi;
    last = id;
    if (u < mass) return id;
  }
  return last;  // u rounded up to the total
}

// ---------------------------------------------------------------- helpers

int argmax(std::span<const float> logits) {
  int best = 0;
  float best_value = kNegInf;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] > best_value) {  // NaN never compares greater
      best_value = logits[i];
      best = static_cast<int>(i);
    }
  }
  return best;
}

double log_sum_exp(std::span<const float> logits) {
  float max_logit = kNegInf;
  for (float x : logits)
    if (x > max_logit) max_logit = x;
  if (std::isinf(max_logit)) return max_logit;
  double sum = 0.0;
  for (float x : logits)
    if (!std::isnan(x)) sum += std::exp(static_cast<double>(x) - max_logit);
  return max_logit + std::log(sum);
}

namespace {

float logprob_under(float logit, double lse) {
  const float x = key(logit);
  return x == kNegInf ? kNegInf : static_cast<float>(static_cast<double>(x) - lse);
}

std::vector<std::pair<int, float>> top_under(std::span<const float> logits, size_t n, double lse) {
  std::vector<std::pair<int, float>> out;
  if (n == 0 || logits.empty()) return out;
  std::vector<int> ids;
  top_n(logits.size(), n, [&](int id) { return key(logits[id]); }, ids);
  for (int id : ids) out.emplace_back(id, logprob_under(logits[id], lse));
  return out;
}

void check_id(std::span<const float> logits, int id) {
  if (id < 0 || static_cast<size_t>(id) >= logits.size())
    fail("logprob_of: token id ", id, " is outside the vocabulary of ", logits.size());
}

}  // namespace

float logprob_of(std::span<const float> logits, int id) {
  check_id(logits, id);
  if (key(logits[id]) == kNegInf) return kNegInf;
  return logprob_under(logits[id], log_sum_exp(logits));
}

std::vector<std::pair<int, float>> top_logprobs(std::span<const float> logits, size_t n) {
  if (n == 0 || logits.empty()) return {};
  return top_under(logits, n, log_sum_exp(logits));
}

TokenLogprobs token_logprobs(std::span<const float> logits, int id, size_t n) {
  check_id(logits, id);
  const double lse = log_sum_exp(logits);
  return {logprob_under(logits[id], lse), top_under(logits, n, lse)};
}

}  // namespace lily::engine

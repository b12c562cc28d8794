#include "text/stop_matcher.h"

#include <algorithm>

namespace lily::text {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) max_len_ = std::max(max_len_, s.size());
}

const std::string& StopMatcher::matched() const {
  static const std::string kNone;
  return matched_ < 0 ? kNone : stops_[matched_];
}

StopMatcher::Result StopMatcher::push(std::string_view piece) {
  Result r;
  if (stopped_) {
    r.stopped = true;
    return r;
  }
  if (max_len_ == 0) {
    r.emit.assign(piece);
    return r;
  }
  // Everything before pending_ is already out; a match cannot start there,
  // since pending_ holds every suffix that could begin one.
  pending_.append(piece);
  size_t best_end = std::string::npos, best_start = 0;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const std::string& s = stops_[i];
    if (s.empty()) continue;
    const size_t at = pending_.find(s);
    if (at == std::string::npos) continue;
    const size_t end = at + s.size();
    if (end < best_end || (end == best_end && at < best_start)) {
      best_end = end;
      best_start = at;
      matched_ = static_cast<int>(i);
    }
  }
  if (best_end != std::string::npos) {
    r.emit = pending_.substr(0, best_start);
    r.stopped = stopped_ = true;
    pending_.clear();
    return r;
  }
  // Hold the longest suffix that is a proper prefix of a stop string.
  size_t hold = 0;
  for (size_t k = std::min(pending_.size(), max_len_ - 1); k > 0 && hold == 0; --k) {
    std::string_view tail = std::string_view(pending_).substr(pending_.size() - k);
    for (const auto& s : stops_)
      if (s.size() > k && std::string_view(s).substr(0, k) == tail) {
        hold = k;
        break;
      }
  }
  r.emit = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return r;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace lily::text

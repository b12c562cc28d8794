// Stop strings over streamed text.
//
// push() takes the next piece of generated text and returns what may be shown
// now. Text that could still turn into a stop string is held back: only the
// longest suffix that is a proper prefix of some stop string. When a stop
// string completes, everything before it is emitted, nothing of it or after it
// is, and the matcher is stopped (later pushes emit nothing). flush() returns
// the held text at the end of generation.
//
// Which match: the one that completes first in the stream (smallest end
// offset); of those ending at the same byte, the longest. This is what a
// byte-by-byte feed would find, so the result does not depend on how the text
// is cut into pieces. Matching is on bytes; empty stop strings are ignored.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace lily::text {

class StopMatcher {
 public:
  struct Result {
    std::string emit;      // text safe to show now
    bool stopped = false;  // a stop string has been matched (now or before)
  };

  StopMatcher() = default;
  explicit StopMatcher(std::vector<std::string> stops);

  Result push(std::string_view piece);
  // The text held back so far (empty once stopped); call at the end.
  std::string flush();

  bool stopped() const { return stopped_; }
  // Index into the stop strings given of the one that matched, or -1.
  int matched_index() const { return matched_; }
  const std::string& matched() const;
  const std::vector<std::string>& stops() const { return stops_; }
  // Bytes currently held back.
  size_t held() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;  // as given (empty ones included, never matched)
  size_t max_len_ = 0;
  std::string pending_;
  bool stopped_ = false;
  int matched_ = -1;
};

}  // namespace lily::text

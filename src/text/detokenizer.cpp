#include "text/detokenizer.h"

#include <cstdint>

#include "text/tokenizer.h"

namespace lily::text {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the sequence a lead byte announces, 0 for a byte that cannot
// start one (a continuation byte, an overlong C0/C1 lead, F5..FF).
int sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

// The range the second byte must fall in. The bounds after E0, ED, F0 and F4
// are what excludes overlong forms, surrogates and code points past U+10FFFF,
// so a sequence is known to be ill-formed as early as its second byte.
void second_byte_range(uint8_t lead, uint8_t& lo, uint8_t& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (lead == 0xE0) lo = 0xA0;
  if (lead == 0xED) hi = 0x9F;
  if (lead == 0xF0) lo = 0x90;
  if (lead == 0xF4) hi = 0x8F;
}

}  // namespace

size_t append_utf8_lossy(std::string_view bytes, bool at_end, std::string& out) {
  const auto* s = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  size_t run_start = 0;  // start of the valid bytes not yet copied to `out`
  out.reserve(out.size() + n);
  while (i < n) {
    const uint8_t lead = s[i];
    if (lead < 0x80) {  // ASCII: the common case, no bookkeeping
      ++i;
      continue;
    }
    const int len = sequence_length(lead);
    if (len == 0) {
      out.append(bytes.substr(run_start, i - run_start));
      out.append(kReplacement);
      run_start = ++i;
      continue;
    }
    // Walk the continuation bytes while they are well-formed.
    int have = 1;
    while (have < len && i + have < n) {
      uint8_t lo = 0x80, hi = 0xBF;
      if (have == 1) second_byte_range(lead, lo, hi);
      const uint8_t c = s[i + have];
      if (c < lo || c > hi) break;
      ++have;
    }
    if (have == len) {
      i += len;
      continue;
    }
    if (i + have == n && !at_end) {
      // A valid prefix cut off by the end of the input: leave it for the
      // caller to complete with the next bytes.
      out.append(bytes.substr(run_start, i - run_start));
      return i;
    }
    // Ill-formed (or unfinished at the very end): the maximal subpart seen so
    // far becomes one U+FFFD, and scanning resumes at the offending byte.
    out.append(bytes.substr(run_start, i - run_start));
    out.append(kReplacement);
    i += have;
    run_start = i;
  }
  out.append(bytes.substr(run_start, n - run_start));
  return n;
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int id) {
  std::string out;
  if (skip_special_ && tokenizer_->is_special(id)) return out;
  const std::string_view bytes = tokenizer_->token_bytes(id);
  if (bytes.empty()) return out;
  if (pending_.empty()) {
    // Fast path: nothing held back, so the token's own bytes are scanned in
    // place and only an unfinished tail (at most 3 bytes) is kept.
    const size_t used = append_utf8_lossy(bytes, /*at_end=*/false, out);
    pending_.assign(bytes.substr(used));
    return out;
  }
  // pending_ holds at most 3 bytes, so this stays proportional to the token.
  pending_.append(bytes);
  const size_t used = append_utf8_lossy(pending_, /*at_end=*/false, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_utf8_lossy(pending_, /*at_end=*/true, out);
  pending_.clear();
  return out;
}

}  // namespace lily::text

// Turning token bytes into text that is safe to show or send piece by piece.
//
// A byte-level BPE token is a run of bytes, not of characters: a CJK
// character or an emoji is often split over two or three tokens. Streaming
// each token's bytes as they come would put broken UTF-8 on the wire, so the
// StreamDecoder holds back an incomplete character until the token that
// completes it arrives.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace lily::text {

class Tokenizer;

// Appends `bytes` to `out` as valid UTF-8, each ill-formed sequence replaced
// by one U+FFFD per maximal subpart (the Unicode-recommended practice, which
// is also what Rust's from_utf8_lossy and so `tokenizers` produce). Returns
// how many bytes were consumed: when `at_end` is false, a trailing sequence
// that is incomplete but could still become valid is left unconsumed
// (at most 3 bytes); when `at_end` is true everything is consumed.
size_t append_utf8_lossy(std::string_view bytes, bool at_end, std::string& out);

// Incremental ids -> text. Every string returned is valid UTF-8 that ends on
// a character boundary, and the concatenation of all pushes plus the final
// flush equals Tokenizer::decode of the same ids. O(token length) per push.
class StreamDecoder {
 public:
  // `tokenizer` must outlive the decoder.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);

  // The text that became complete with this token (possibly empty).
  std::string push(int id);
  // Ends the stream: whatever is still held back (an unfinished character)
  // comes out as U+FFFD. The decoder is then ready for a new stream.
  std::string flush();
  // Drops anything held back without emitting it.
  void reset() { pending_.clear(); }

  // Bytes held back waiting for the rest of a character (0 to 3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace lily::text

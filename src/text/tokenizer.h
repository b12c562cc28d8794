// Byte-level BPE tokenizer driven by a Hugging Face `tokenizer.json`.
//
// Encoding follows the `tokenizers` pipeline (the library that produced the
// reference ids for every Qwen checkpoint), without any post-processor
// insertion of special tokens:
//
//   1. added tokens are cut out of the raw text (leftmost, longest first);
//   2. the rest is normalized (NFC when the file says so);
//   3. pre-tokenized into words by the file's Split regex (PCRE2, UTF + UCP)
//      and/or the ByteLevel pre-tokenizer;
//   4. each word's bytes are merged by BPE rank into vocabulary ids.
//
// Decoding maps ids back to their bytes (the inverse of the GPT-2 byte <->
// unicode table) and the result to valid UTF-8 (U+FFFD for broken sequences,
// as `tokenizers` does). For incremental output see detokenizer.h.
//
// A Tokenizer is immutable after loading apart from an internal word cache,
// which is locked, so one instance may be shared by threads.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lily::text {

class Tokenizer {
 public:
  // Loads `dir`/tokenizer.json.
  static Tokenizer from_dir(const std::string& dir);
  // Loads a tokenizer.json file.
  static Tokenizer from_file(const std::string& path);
  // Parses tokenizer.json content; `origin` names it in error messages.
  static Tokenizer from_json(std::string_view json, const std::string& origin);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text -> ids. With allow_special, added tokens marked `special` (e.g.
  // <|im_start|>) are recognised inside the text; without it they are
  // tokenized as ordinary text. Non-special added tokens (e.g. <think>) are
  // matched either way, as in `tokenizers` with split_special_tokens.
  // Input need not be valid UTF-8: bytes that are not pass through as
  // byte tokens, so the bytes always survive a round trip.
  std::vector<int> encode(std::string_view text, bool allow_special = true) const;

  // Ids -> UTF-8 text. Ids the tokenizer does not know (e.g. padded
  // embedding rows) contribute nothing; broken UTF-8 becomes U+FFFD.
  std::string decode(std::span<const int> ids, bool skip_special = false) const;

  // The raw bytes one id stands for: a vocabulary token's bytes or an added
  // token's content; empty for unknown ids. May be part of a character.
  std::string_view token_bytes(int id) const;

  // Looks a token up in its tokenizer.json spelling: an added token's
  // content, or a vocabulary key in byte-level form ("Ġthe" for " the").
  std::optional<int> token_to_id(std::string_view token) const;
  // The inverse: the tokenizer.json spelling of an id, if it has one.
  std::optional<std::string> id_to_token(int id) const;

  // One past the highest id that has a token (vocabulary or added).
  int vocab_size() const;
  // Ids of the added tokens marked special, ascending.
  const std::vector<int>& special_ids() const;
  bool is_special(int id) const;
  bool is_added(int id) const;

  // The words BPE sees for `text` (normalized and pre-tokenized, no added
  // token matching), as raw bytes. For inspection and tests.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily::text

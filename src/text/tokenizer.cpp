#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "core/mapped_file.h"
#include "text/detokenizer.h"
#include "text/utf8.h"

namespace lily::text {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------
// UTF-8 helpers. The tokenizer works on bytes throughout; these are only
// needed where a rule is stated in characters (added-token stripping, the
// byte-level spelling of vocabulary keys).

// Decodes the well-formed character at s[0..n), returning its code point and
// length, or -1 (length 1) for a byte that does not start one.
int32_t decode_char(const uint8_t* s, size_t n, size_t& len) {
  len = 1;
  const uint8_t b = s[0];
  if (b < 0x80) return b;
  int need;
  int32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
    cp = b & 0x1F;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    cp = b & 0x0F;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    cp = b & 0x07;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  if (n < static_cast<size_t>(need) + 1) return -1;
  for (int k = 1; k <= need; ++k) {
    const uint8_t c = s[k];
    if (c < lo || c > hi) return -1;
    lo = 0x80;
    hi = 0xBF;
    cp = (cp << 6) | (c & 0x3F);
  }
  len = static_cast<size_t>(need) + 1;
  return cp;
}

// The code point of the character that ends at s[0..end) and where it
// begins, or -1 when no well-formed character ends there.
int32_t char_before(const uint8_t* s, size_t end, size_t& begin) {
  begin = end;
  if (end == 0) return -1;
  size_t start = end - 1;
  while (start > 0 && end - start < 4 && (s[start] & 0xC0) == 0x80) --start;
  size_t len;
  const int32_t cp = decode_char(s + start, end - start, len);
  if (cp < 0 || start + len != end) return -1;
  begin = start;
  return cp;
}

// Unicode White_Space, the set `\s` means to the Rust regex crate that
// `tokenizers` uses for lstrip/rstrip.
bool is_white_space(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Unicode `\w` (letters, marks, decimal and letter numbers, connector
// punctuation, joiners), used by single_word added tokens.
bool is_word_char(int32_t cp) {
  if (cp < 0) return false;
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') ||
           (cp >= 'A' && cp <= 'Z') || cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// True when NFC keeps `cp` as it is and never combines it with what comes
// before: a starter, NFC_QC=Yes, and not the second half of any canonical
// composition. Conservative: precomposed letters at or above U+0300 (e.g.
// Vietnamese) count as not, which only costs a trip through utf8proc.
bool is_nfc_boundary(int32_t cp) {
  if (cp < 0x300) return true;  // no marks, no composition seconds below here
  // Hangul vowel and trailing jamo compose algorithmically (not in the table).
  if ((cp >= 0x1161 && cp <= 0x1175) || (cp >= 0x11A8 && cp <= 0x11C2)) return false;
  const utf8proc_property_t* p = utf8proc_get_property(cp);
  if (p->combining_class != 0) return false;
  // utf8proc marks possible second halves of a composition with bit 15.
  if (p->comb_index != UINT16_MAX && (p->comb_index & 0x8000) != 0) return false;
  // A canonical decomposition (decomp_type 0 is "canonical") may be a
  // singleton or an exclusion that NFC rewrites.
  if (p->decomp_type == 0 && p->decomp_seqindex != UINT16_MAX) return false;
  return true;
}

// Appends the utf8proc normalization of valid UTF-8 `text` to `out`.
void append_normalized(std::string_view text, int options, std::string& out) {
  if (text.empty()) return;
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t got =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                   static_cast<utf8proc_option_t>(options));
  if (got >= 0) {
    out.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(got));
  } else {
    out.append(text);  // cannot happen for valid input; keep the text rather than lose it
  }
  std::free(mapped);
}

// ---------------------------------------------------------------------------
// The GPT-2 byte <-> unicode table. Byte-level BPE vocabularies spell every
// byte as a printable character so that keys are valid JSON strings: bytes
// that are already printable Latin-1 (! .. ~, ¡ .. ¬, ® .. ÿ) stand for
// themselves, the other 68 are mapped in order onto U+0100 and up (so the
// space 0x20 becomes U+0120 'Ġ' and the newline 0x0A becomes U+010A 'Ċ').
class ByteLevelTable {
 public:
  ByteLevelTable() {
    cp_to_byte_.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) ||
                             (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
      cp_to_byte_[cp] = b;
      spelling_[b].clear();
      append_utf8(spelling_[b], cp);
    }
  }

  // Byte-level spelling of raw bytes.
  std::string spell(std::string_view bytes) const {
    std::string out;
    out.reserve(bytes.size() * 2);
    for (unsigned char b : bytes) out += spelling_[b];
    return out;
  }

  // Raw bytes of a byte-level spelling; false if some character is not in
  // the table (the key is then not a byte-level token).
  bool unspell(std::string_view spelling, std::string& bytes) const {
    bytes.clear();
    const auto* s = reinterpret_cast<const uint8_t*>(spelling.data());
    size_t i = 0;
    while (i < spelling.size()) {
      size_t len;
      const int32_t cp = decode_char(s + i, spelling.size() - i, len);
      if (cp < 0 || cp >= static_cast<int32_t>(cp_to_byte_.size()) || cp_to_byte_[cp] < 0) {
        return false;
      }
      bytes.push_back(static_cast<char>(cp_to_byte_[cp]));
      i += len;
    }
    return true;
  }

  const std::string& spelling(uint8_t b) const { return spelling_[b]; }

 private:
  std::array<std::string, 256> spelling_;
  std::array<int, 256 + 68> cp_to_byte_;
};

const ByteLevelTable& byte_level() {
  static const ByteLevelTable table;
  return table;
}

// ---------------------------------------------------------------------------
// JSON access that names the field at fault.

[[noreturn]] void bad_field(const std::string& origin, const std::string& field,
                            const std::string& what) {
  fail(origin, ": field '", field, "' ", what);
}

const json& need(const json& obj, const char* key, const std::string& origin,
                 const std::string& where) {
  const std::string field = where.empty() ? key : where + "." + key;
  if (!obj.is_object()) bad_field(origin, where, "is not an object");
  auto it = obj.find(key);
  if (it == obj.end()) bad_field(origin, field, "is missing");
  return *it;
}

std::string need_string(const json& obj, const char* key, const std::string& origin,
                        const std::string& where) {
  const json& v = need(obj, key, origin, where);
  if (!v.is_string()) {
    bad_field(origin, where.empty() ? key : where + "." + key, "is not a string");
  }
  return v.get<std::string>();
}

// Optional boolean: absent or null gives `fallback`.
bool opt_bool(const json& obj, const char* key, bool fallback, const std::string& origin,
              const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) bad_field(origin, where + "." + key, "is not a boolean");
  return it->get<bool>();
}

// Token ids must index the embedding table; anything past this is a broken
// file, not a vocabulary (the largest real ones are ~260k).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

int need_id(const json& v, const std::string& origin, const std::string& field) {
  if (!v.is_number_integer()) bad_field(origin, field, "is not an integer id");
  const int64_t id = v.get<int64_t>();
  if (id < 0 || id > kMaxTokenId) {
    bad_field(origin, field, str_cat("has id ", id, " outside [0, ", kMaxTokenId, "]"));
  }
  return static_cast<int>(id);
}

// ---------------------------------------------------------------------------
// PCRE2 regex, compiled once with UTF + UCP (so \p{L}, \s and \w are the
// Unicode classes the patterns in tokenizer.json are written for) and JIT.
// MATCH_INVALID_UTF lets it run over text that is not valid UTF-8: such
// bytes simply never match and end up in the gaps between matches.

// Per-call match state. The JIT's default 32 KiB stack suffices for these
// patterns on ordinary text, so a larger one (an mmap) is only made for the
// piece that needs it; short encodes stay cheap.
class MatchScratch {
 public:
  MatchScratch() : data_(pcre2_match_data_create(1, nullptr)) {
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~MatchScratch() {
    pcre2_match_data_free(data_);  // each accepts nullptr
    pcre2_match_context_free(big_stack_context_);
    pcre2_jit_stack_free(big_stack_);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;

  pcre2_match_data* data() { return data_; }

  // A match context with an 8 MiB JIT stack, or nullptr if none can be had.
  pcre2_match_context* big_stack_context() {
    if (big_stack_context_ == nullptr) {
      big_stack_ = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
      big_stack_context_ = pcre2_match_context_create(nullptr);
      if (big_stack_ == nullptr || big_stack_context_ == nullptr) return nullptr;
      pcre2_jit_stack_assign(big_stack_context_, nullptr, big_stack_);
    }
    return big_stack_context_;
  }

 private:
  pcre2_match_data* data_ = nullptr;
  pcre2_jit_stack* big_stack_ = nullptr;
  pcre2_match_context* big_stack_context_ = nullptr;
};

// The patterns in tokenizer.json were written for Oniguruma, whose Unicode
// `\s` is exactly the White_Space property. PCRE2's UCP `\s` also takes
// U+180E MONGOLIAN VOWEL SEPARATOR (White_Space before Unicode 6.3), which
// would split "\u180e's" differently from `tokenizers`. Spelling the property
// out removes the difference; \p{...} is valid inside classes as well, so
// `[^\s\p{L}]` rewrites the same way.
std::string with_white_space_property(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool quoted = false;  // inside \Q ... \E, where escapes are literal
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c != '\\' || i + 1 == pattern.size()) {
      out.push_back(c);
      continue;
    }
    const char next = pattern[i + 1];
    ++i;
    if (quoted) {
      if (next == 'E') quoted = false;
      out.push_back(c);
      out.push_back(next);
    } else if (next == 's') {
      out += "\\p{White_Space}";
    } else if (next == 'S') {
      out += "\\P{White_Space}";
    } else {
      if (next == 'Q') quoted = true;
      out.push_back(c);
      out.push_back(next);
    }
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& file_pattern, bool literal, const std::string& origin,
        const std::string& field) {
    uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
    if (literal) options |= PCRE2_LITERAL;
    const std::string pattern = literal ? file_pattern : with_white_space_property(file_pattern);
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          options, &error, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      bad_field(origin, field,
                str_cat("has a regex PCRE2 rejects at offset ", offset, ": ",
                        reinterpret_cast<const char*>(message)));
    }
    // JIT is an optimisation: where it is unavailable, pcre2_match falls
    // back to the interpreter, which gives the same matches.
    (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_span(begin, end, is_match) for consecutive spans covering
  // `text`: the matches and the gaps between them. Empty matches only cut
  // a gap in two, as they do in `tokenizers`.
  template <typename OnSpan>
  void spans(std::string_view text, MatchScratch& scratch, const OnSpan& on_span) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const size_t n = text.size();
    size_t gap_start = 0;
    size_t search = 0;
    while (search <= n) {
      int rc = pcre2_match(code_, subject, n, search, 0, scratch.data(), nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        // Long backtracking on odd input: retry with a bigger JIT stack, and
        // failing that with the interpreter, which keeps its state on the heap.
        if (pcre2_match_context* big = scratch.big_stack_context()) {
          rc = pcre2_match(code_, subject, n, search, 0, scratch.data(), big);
        }
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
          rc = pcre2_match(code_, subject, n, search, PCRE2_NO_JIT, scratch.data(), nullptr);
        }
      }
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof message);
        fail("tokenizer: pre-tokenizer regex failed: ", reinterpret_cast<const char*>(message));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.data());
      const size_t begin = ov[0], end = ov[1];
      if (begin > gap_start) on_span(gap_start, begin, false);
      if (end > begin) {
        on_span(begin, end, true);
        search = end;
      } else {
        // Step over one character (or one invalid byte) so the scan moves on.
        if (begin >= n) break;
        size_t len;
        decode_char(subject + begin, n - begin, len);
        search = begin + len;
      }
      gap_start = end;
    }
    if (gap_start < n) on_span(gap_start, n, false);
  }

 private:
  pcre2_code* code_ = nullptr;
};

// The ByteLevel pre-tokenizer's own split (when use_regex is true): GPT-2's.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------
// BPE merge table: (left id, right id) -> (rank, merged id), open addressing.
// It is probed once per adjacent pair of every word, so it is kept flat.

struct Merge {
  int rank;
  int merged;
};

class MergeTable {
 public:
  void reserve(size_t count) {
    size_t capacity = 16;
    bits_ = 4;
    while (capacity < count * 2) {
      capacity *= 2;
      ++bits_;
    }
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, Merge{0, 0});
    size_ = 0;
  }

  // Later entries replace earlier ones for the same pair, as in `tokenizers`.
  void put(int left, int right, Merge merge) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    const uint64_t key = pack(left, right);
    size_t slot = home(key);
    while (keys_[slot] != kEmpty && keys_[slot] != key) slot = (slot + 1) & mask();
    if (keys_[slot] == kEmpty) ++size_;
    keys_[slot] = key;
    values_[slot] = merge;
  }

  const Merge* find(int left, int right) const {
    if (keys_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    size_t slot = home(key);
    while (true) {
      const uint64_t k = keys_[slot];
      if (k == key) return &values_[slot];
      if (k == kEmpty) return nullptr;
      slot = (slot + 1) & mask();
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t pack(int left, int right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  size_t mask() const { return keys_.size() - 1; }
  size_t home(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> (64 - bits_));
  }
  void grow() {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<Merge> values = std::move(values_);
    reserve(std::max<size_t>(16, keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != kEmpty) {
        put(static_cast<int>(keys[i] >> 32), static_cast<int>(keys[i] & 0xFFFFFFFFu),
            values[i]);
      }
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<Merge> values_;
  size_t size_ = 0;
  int bits_ = 4;
};

// BPE work items: a symbol of the word being merged, and a candidate merge.
struct Symbol {
  int id;
  int prev;
  int next;
  int len;  // bytes covered; 0 once merged into its left neighbour
};

struct Candidate {
  int rank;
  int pos;  // index of the left symbol
  int merged;
};

// std heap is a max-heap: "less" means lower priority, i.e. a higher rank,
// or the same rank further right (ties merge leftmost first).
struct CandidateLess {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

// Scratch space for one encode call: regex match state and the BPE work
// arrays, reused across the words of the call.
struct EncodeScratch {
  MatchScratch match;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::vector<int> word_ids;
  std::string spelled;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

enum class Normalization { kNfc, kNfd, kNfkc, kNfkd };

enum class SplitBehavior { kIsolated, kRemoved };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel } kind;
  std::unique_ptr<Regex> regex;  // Split's pattern, or GPT-2's for ByteLevel
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
};

struct AddedToken {
  std::string content;     // as written in the file
  std::string match_text;  // what is searched for (normalized if `normalized`)
  int id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest search for a set of added tokens (the Aho-Corasick
// LeftmostLongest semantics `tokenizers` uses). Sets are tiny (tens of
// tokens, most starting with '<'), so candidates are bucketed by first byte
// and compared longest first.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token) {
    if (token->match_text.empty()) return;
    auto& bucket = by_first_byte_[static_cast<uint8_t>(token->match_text[0])];
    bucket.push_back(token);
    std::stable_sort(bucket.begin(), bucket.end(), [](const AddedToken* a, const AddedToken* b) {
      return a->match_text.size() > b->match_text.size();
    });
    empty_ = false;
  }
  bool empty() const { return empty_; }

  // The first match at or after `from`: its token and start, or nullptr.
  const AddedToken* next(std::string_view text, size_t from, size_t& start) const {
    for (size_t i = from; i < text.size(); ++i) {
      const auto& bucket = by_first_byte_[static_cast<uint8_t>(text[i])];
      for (const AddedToken* token : bucket) {
        const std::string& m = token->match_text;
        if (text.size() - i >= m.size() && std::memcmp(text.data() + i, m.data(), m.size()) == 0) {
          start = i;
          return token;
        }
      }
    }
    return nullptr;
  }

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
  bool empty_ = true;
};

enum TokenKind : uint8_t { kNone = 0, kVocab = 1, kAdded = 2, kSpecial = 3 };

}  // namespace

// ---------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string origin;

  // Per id: raw bytes, tokenizer.json spelling, and what kind of token it is.
  std::vector<std::string> bytes;
  std::vector<std::string> spelling;
  std::vector<uint8_t> kind;

  std::unordered_map<std::string, int, StringHash, std::equal_to<>> vocab;  // spelling -> id
  std::unordered_map<std::string, int, StringHash, std::equal_to<>> added_by_content;
  std::array<int, 256> byte_id{};
  int unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;
  MergeTable merges;

  std::vector<Normalization> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizer;

  std::vector<AddedToken> added;  // stable: matchers point into it
  AddedTokenMatcher raw_matcher;         // tokens matched before normalization
  AddedTokenMatcher normalized_matcher;  // tokens matched after it
  std::vector<int> special_ids;

  // word bytes -> ids. Bounded: cleared when full, which keeps memory flat
  // and lets the cache follow a change of language or domain.
  static constexpr size_t kCacheCapacity = 1 << 15;
  static constexpr size_t kCacheMaxWord = 256;
  mutable std::shared_mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> cache;

  void load(const json& root);
  void load_model(const json& model);
  void load_normalizer(const json& node, const std::string& where);
  void load_pre_tokenizer(const json& node, const std::string& where);
  void load_added_tokens(const json& list);
  void set_token(int id, std::string raw, std::string spelled, uint8_t token_kind);

  std::string_view normalize(std::string_view text, std::string& storage) const;
  static std::string_view nfc(std::string_view text, std::string& storage);

  template <typename Emit>
  void split_added(std::string_view text, const AddedTokenMatcher& matcher, bool allow_special,
                   const Emit& emit) const;
  template <typename Emit>
  void pre_tokenize(size_t step, std::string_view piece, EncodeScratch& scratch,
                    const Emit& emit) const;

  void encode_word(std::string_view word, EncodeScratch& scratch, std::vector<int>& out) const;
  void merge_word(std::string_view word, EncodeScratch& scratch, std::vector<int>& out) const;
};

void Tokenizer::Impl::set_token(int id, std::string raw, std::string spelled,
                                uint8_t token_kind) {
  if (static_cast<size_t>(id) >= bytes.size()) {
    bytes.resize(id + 1);
    spelling.resize(id + 1);
    kind.resize(id + 1, kNone);
  }
  bytes[id] = std::move(raw);
  spelling[id] = std::move(spelled);
  kind[id] = token_kind;
}

void Tokenizer::Impl::load(const json& root) {
  if (!root.is_object()) fail(origin, ": not a tokenizer.json (top level is not an object)");
  load_model(need(root, "model", origin, ""));

  auto norm = root.find("normalizer");
  if (norm != root.end()) load_normalizer(*norm, "normalizer");

  auto pre = root.find("pre_tokenizer");
  if (pre == root.end() || pre->is_null()) {
    fail(origin, ": field 'pre_tokenizer' is missing; only byte-level BPE tokenizers "
                 "(with a ByteLevel pre-tokenizer) are supported");
  }
  load_pre_tokenizer(*pre, "pre_tokenizer");
  const bool has_byte_level =
      std::any_of(pre_tokenizer.begin(), pre_tokenizer.end(), [](const PreTokenizerStep& s) {
        return s.kind == PreTokenizerStep::Kind::kByteLevel;
      });
  if (!has_byte_level) {
    fail(origin, ": field 'pre_tokenizer' has no ByteLevel step; only byte-level BPE "
                 "tokenizers are supported");
  }

  auto decoder = root.find("decoder");
  if (decoder != root.end() && !decoder->is_null()) {
    const std::string type = need_string(*decoder, "type", origin, "decoder");
    if (type != "ByteLevel") {
      bad_field(origin, "decoder.type", str_cat("is '", type, "'; only ByteLevel is supported"));
    }
  }

  auto added_list = root.find("added_tokens");
  if (added_list != root.end() && !added_list->is_null()) load_added_tokens(*added_list);
}

void Tokenizer::Impl::load_model(const json& model) {
  if (!model.is_object()) bad_field(origin, "model", "is not an object");
  auto type = model.find("type");
  if (type != model.end() && !(type->is_string() && type->get<std::string>() == "BPE")) {
    bad_field(origin, "model.type", str_cat("is ", type->dump(), "; only BPE is supported"));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model.find(key);
    if (it != model.end() && !it->is_null() &&
        !(it->is_string() && it->get<std::string>().empty())) {
      bad_field(origin, str_cat("model.", key), "is set; byte-level BPE does not use it");
    }
  }
  auto dropout = model.find("dropout");
  if (dropout != model.end() && !dropout->is_null() &&
      !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    // Dropout randomises merges, which is for training; refusing is better
    // than silently encoding differently from the file's intent.
    bad_field(origin, "model.dropout", "is set; BPE dropout is not supported");
  }
  ignore_merges = opt_bool(model, "ignore_merges", false, origin, "model");
  fuse_unk = opt_bool(model, "fuse_unk", false, origin, "model");

  const json& vocab_json = need(model, "vocab", origin, "model");
  if (!vocab_json.is_object()) bad_field(origin, "model.vocab", "is not an object");
  const ByteLevelTable& table = byte_level();
  vocab.reserve(vocab_json.size());
  std::string raw;
  for (auto it = vocab_json.begin(); it != vocab_json.end(); ++it) {
    const int id = need_id(it.value(), origin, str_cat("model.vocab[\"", it.key(), "\"]"));
    // A key that is not a byte-level spelling stands for its own UTF-8
    // bytes, as the ByteLevel decoder in `tokenizers` treats it.
    if (!table.unspell(it.key(), raw)) raw = it.key();
    set_token(id, raw, it.key(), kVocab);
    vocab.emplace(it.key(), id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(table.spelling(static_cast<uint8_t>(b)));
    byte_id[b] = it == vocab.end() ? -1 : it->second;
  }

  auto unk = model.find("unk_token");
  if (unk != model.end() && unk->is_string()) {
    auto it = vocab.find(unk->get<std::string>());
    if (it == vocab.end()) bad_field(origin, "model.unk_token", "is not in model.vocab");
    unk_id = it->second;
  }

  const json& merges_json = need(model, "merges", origin, "model");
  if (!merges_json.is_array()) bad_field(origin, "model.merges", "is not an array");
  merges.reserve(merges_json.size());
  std::string left, right;
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& m = merges_json[rank];
    const std::string field = str_cat("model.merges[", rank, "]");
    // Two spellings exist: "a b" (older files) and ["a", "b"] (newer ones,
    // which can hold tokens containing spaces).
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        bad_field(origin, field, str_cat("is \"", s, "\", not two tokens separated by a space"));
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      bad_field(origin, field, "is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto l = vocab.find(left);
    auto r = vocab.find(right);
    auto merged = vocab.find(left + right);
    if (l == vocab.end() || r == vocab.end() || merged == vocab.end()) {
      const std::string& missing =
          l == vocab.end() ? left : r == vocab.end() ? right : left + right;
      bad_field(origin, field, str_cat("uses \"", missing, "\", which is not in model.vocab"));
    }
    merges.put(l->second, r->second, Merge{static_cast<int>(rank), merged->second});
  }
}

void Tokenizer::Impl::load_normalizer(const json& node, const std::string& where) {
  if (node.is_null()) return;
  const std::string type = need_string(node, "type", origin, where);
  if (type == "Sequence") {
    const json& list = need(node, "normalizers", origin, where);
    if (!list.is_array()) bad_field(origin, where + ".normalizers", "is not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      load_normalizer(list[i], str_cat(where, ".normalizers[", i, "]"));
    }
  } else if (type == "NFC") {
    normalizers.push_back(Normalization::kNfc);
  } else if (type == "NFD") {
    normalizers.push_back(Normalization::kNfd);
  } else if (type == "NFKC") {
    normalizers.push_back(Normalization::kNfkc);
  } else if (type == "NFKD") {
    normalizers.push_back(Normalization::kNfkd);
  } else {
    bad_field(origin, where + ".type",
              str_cat("is '", type, "'; supported: NFC, NFD, NFKC, NFKD, Sequence"));
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const json& node, const std::string& where) {
  const std::string type = need_string(node, "type", origin, where);
  if (type == "Sequence") {
    const json& list = need(node, "pretokenizers", origin, where);
    if (!list.is_array()) bad_field(origin, where + ".pretokenizers", "is not an array");
    for (size_t i = 0; i < list.size(); ++i) {
      load_pre_tokenizer(list[i], str_cat(where, ".pretokenizers[", i, "]"));
    }
  } else if (type == "Split") {
    PreTokenizerStep step{PreTokenizerStep::Kind::kSplit, nullptr};
    const json& pattern = need(node, "pattern", origin, where);
    const std::string field = where + ".pattern";
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      step.regex = std::make_unique<Regex>(pattern["Regex"].get<std::string>(), false, origin,
                                           field + ".Regex");
    } else if (pattern.is_object() && pattern.contains("String") &&
               pattern["String"].is_string()) {
      step.regex = std::make_unique<Regex>(pattern["String"].get<std::string>(), true, origin,
                                           field + ".String");
    } else {
      bad_field(origin, field, "is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
    const std::string behavior = need_string(node, "behavior", origin, where);
    if (behavior == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (behavior == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else {
      bad_field(origin, where + ".behavior",
                str_cat("is '", behavior, "'; supported: Isolated, Removed"));
    }
    step.invert = opt_bool(node, "invert", false, origin, where);
    pre_tokenizer.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    PreTokenizerStep step{PreTokenizerStep::Kind::kByteLevel, nullptr};
    step.add_prefix_space = opt_bool(node, "add_prefix_space", false, origin, where);
    if (opt_bool(node, "use_regex", true, origin, where)) {
      step.regex = std::make_unique<Regex>(kGpt2Pattern, false, origin, where);
    }
    pre_tokenizer.push_back(std::move(step));
  } else {
    bad_field(origin, where + ".type",
              str_cat("is '", type, "'; supported: Sequence, Split, ByteLevel"));
  }
}

void Tokenizer::Impl::load_added_tokens(const json& list) {
  if (!list.is_array()) bad_field(origin, "added_tokens", "is not an array");
  added.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = str_cat("added_tokens[", i, "]");
    const json& node = list[i];
    AddedToken token;
    token.id = need_id(need(node, "id", origin, where), origin, where + ".id");
    token.content = need_string(node, "content", origin, where);
    if (token.content.empty()) bad_field(origin, where + ".content", "is empty");
    token.special = opt_bool(node, "special", false, origin, where);
    token.lstrip = opt_bool(node, "lstrip", false, origin, where);
    token.rstrip = opt_bool(node, "rstrip", false, origin, where);
    token.single_word = opt_bool(node, "single_word", false, origin, where);
    // `tokenizers` defaults `normalized` to the opposite of `special`.
    token.normalized = opt_bool(node, "normalized", !token.special, origin, where);
    added.push_back(std::move(token));
  }
  // A later entry with the same content replaces an earlier one.
  std::unordered_map<std::string, size_t> last;
  for (size_t i = 0; i < added.size(); ++i) last[added[i].content] = i;
  std::vector<AddedToken> unique;
  for (size_t i = 0; i < added.size(); ++i) {
    if (last[added[i].content] == i) unique.push_back(std::move(added[i]));
  }
  added = std::move(unique);

  for (AddedToken& token : added) {
    std::string storage;
    token.match_text =
        token.normalized ? std::string(normalize(token.content, storage)) : token.content;
    set_token(token.id, token.content, token.content, token.special ? kSpecial : kAdded);
    added_by_content[token.content] = token.id;
    if (token.special) special_ids.push_back(token.id);
  }
  for (const AddedToken& token : added) {
    (token.normalized ? normalized_matcher : raw_matcher).add(&token);
  }
  std::sort(special_ids.begin(), special_ids.end());
  special_ids.erase(std::unique(special_ids.begin(), special_ids.end()), special_ids.end());
}

// Unicode normalization of the text between added tokens. Runs of invalid
// UTF-8 (which utf8proc refuses) are passed through untouched.
std::string_view Tokenizer::Impl::normalize(std::string_view text, std::string& storage) const {
  if (normalizers.empty()) return text;
  const bool only_nfc = std::all_of(normalizers.begin(), normalizers.end(),
                                    [](Normalization n) { return n == Normalization::kNfc; });
  // NFC is idempotent, so NFC (or a Sequence of only NFC) takes the chunked
  // path, which leaves text that is already NFC alone at little cost.
  if (only_nfc) return nfc(text, storage);

  // Other forms: ASCII is invariant under all of them; otherwise each valid
  // run goes through utf8proc whole.
  if (std::all_of(text.begin(), text.end(),
                  [](char c) { return static_cast<uint8_t>(c) < 0x80; })) {
    return text;
  }
  std::string current(text);
  for (Normalization form : normalizers) {
    int options = UTF8PROC_STABLE;
    switch (form) {
      case Normalization::kNfc: options |= UTF8PROC_COMPOSE; break;
      case Normalization::kNfd: options |= UTF8PROC_DECOMPOSE; break;
      case Normalization::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
      case Normalization::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    }
    std::string next;
    next.reserve(current.size());
    const auto* s = reinterpret_cast<const uint8_t*>(current.data());
    const size_t n = current.size();
    size_t i = 0;
    while (i < n) {
      size_t j = i;  // extent of the valid run starting at i
      size_t len;
      while (j < n && decode_char(s + j, n - j, len) >= 0) j += len;
      append_normalized(current.substr(i, j - i), options, next);
      if (j < n) next.push_back(current[j++]);  // one invalid byte, as is
      i = j;
    }
    current = std::move(next);
  }
  storage = std::move(current);
  return storage;
}

// NFC in chunks. A character that is a starter (combining class 0), is
// NFC_QC=Yes and cannot be the second half of a composition is left alone
// by NFC, and NFC never reaches across it: text splits into independent
// chunks in front of every such character. Only the chunks that hold some
// other character go through utf8proc, from the boundary character before
// it (which it may compose with) to the next boundary. Text that is already
// NFC, which is nearly all text, is returned as it is.
std::string_view Tokenizer::Impl::nfc(std::string_view text, std::string& storage) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  bool changed = false;
  size_t copied = 0;       // text[0, copied) is dealt with
  size_t chunk_floor = 0;  // where a chunk holding the next character may start
  size_t i = 0;
  while (i < n) {
    if (s[i] < 0x80) {  // ASCII: a boundary, and the common case
      chunk_floor = i++;
      continue;
    }
    size_t len;
    const int32_t cp = decode_char(s + i, n - i, len);
    if (cp < 0) {  // invalid byte: passed through, and a chunk cannot span it
      chunk_floor = ++i;
      continue;
    }
    if (is_nfc_boundary(cp)) {
      chunk_floor = i;
      i += len;
      continue;
    }
    size_t end = i + len;
    while (end < n) {
      const int32_t next = decode_char(s + end, n - end, len);
      if (next < 0 || is_nfc_boundary(next)) break;
      end += len;
    }
    if (!changed) {
      storage.clear();
      storage.reserve(n + 16);
      changed = true;
    }
    storage.append(text.substr(copied, chunk_floor - copied));
    append_normalized(text.substr(chunk_floor, end - chunk_floor),
                      UTF8PROC_STABLE | UTF8PROC_COMPOSE, storage);
    copied = end;
    i = end;
  }
  if (!changed) return text;
  storage.append(text.substr(copied));
  return storage;
}

// Cuts `text` at the added tokens of `matcher`, calling emit(piece, -1) for
// text and emit(content, id) for each token, in order. Mirrors
// `tokenizers`' find_matches: non-overlapping leftmost-longest matches,
// single_word matches dropped when a word character touches them, and
// lstrip/rstrip absorbing the neighbouring whitespace.
template <typename Emit>
void Tokenizer::Impl::split_added(std::string_view text, const AddedTokenMatcher& matcher,
                                  bool allow_special, const Emit& emit) const {
  if (matcher.empty()) {
    if (!text.empty()) emit(text, -1);
    return;
  }
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  size_t done = 0;    // text before this is emitted
  size_t search = 0;  // where the next match may start
  size_t start;
  while (const AddedToken* token = matcher.next(text, search, start)) {
    size_t stop = start + token->match_text.size();
    search = stop;
    if (token->special && !allow_special) continue;
    if (start < done) continue;  // inside a previous token's rstrip
    if (token->single_word) {
      size_t begin;
      const bool word_before = is_word_char(char_before(s, start, begin));
      size_t len;
      const bool word_after =
          stop < text.size() && is_word_char(decode_char(s + stop, text.size() - stop, len));
      if (word_before || word_after) continue;
    }
    if (token->lstrip) {
      // Never reaching back into text an earlier token already took.
      size_t begin;
      while (start > done && is_white_space(char_before(s, start, begin))) start = begin;
    }
    if (token->rstrip) {
      size_t len;
      while (stop < text.size() &&
             is_white_space(decode_char(s + stop, text.size() - stop, len))) {
        stop += len;
      }
      search = stop;
    }
    if (start > done) emit(text.substr(done, start - done), -1);
    emit(text.substr(start, stop - start), token->id);
    done = stop;
  }
  if (done < text.size()) emit(text.substr(done), -1);
}

// Applies pre-tokenizer steps [step, end) to `piece`, calling emit(word) for
// each resulting word.
template <typename Emit>
void Tokenizer::Impl::pre_tokenize(size_t step, std::string_view piece, EncodeScratch& scratch,
                                   const Emit& emit) const {
  if (piece.empty()) return;
  if (step == pre_tokenizer.size()) {
    emit(piece);
    return;
  }
  const PreTokenizerStep& s = pre_tokenizer[step];
  if (s.kind == PreTokenizerStep::Kind::kByteLevel) {
    // The byte -> character mapping itself is implicit: BPE runs on raw
    // bytes. What is left here is the optional prefix space and split.
    std::string prefixed;
    if (s.add_prefix_space && piece[0] != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed.push_back(' ');
      prefixed.append(piece);
      piece = prefixed;
    }
    if (s.regex == nullptr) {
      pre_tokenize(step + 1, piece, scratch, emit);
      return;
    }
    s.regex->spans(piece, scratch.match, [&](size_t begin, size_t end, bool) {
      pre_tokenize(step + 1, piece.substr(begin, end - begin), scratch, emit);
    });
    return;
  }
  s.regex->spans(piece, scratch.match, [&](size_t begin, size_t end, bool is_match) {
    if (s.behavior == SplitBehavior::kRemoved && is_match != s.invert) return;
    pre_tokenize(step + 1, piece.substr(begin, end - begin), scratch, emit);
  });
}

void Tokenizer::Impl::encode_word(std::string_view word, EncodeScratch& scratch,
                                  std::vector<int>& out) const {
  if (word.size() == 1) {
    const int id = byte_id[static_cast<uint8_t>(word[0])];
    if (id >= 0) {
      out.push_back(id);
    } else if (unk_id >= 0) {
      out.push_back(unk_id);
    }
    return;
  }
  if (ignore_merges) {
    // The file asks for whole-word vocabulary hits to bypass the merges.
    scratch.spelled = byte_level().spell(word);
    auto it = vocab.find(scratch.spelled);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWord;
  if (cacheable) {
    std::shared_lock lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  scratch.word_ids.clear();
  merge_word(word, scratch, scratch.word_ids);
  out.insert(out.end(), scratch.word_ids.begin(), scratch.word_ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mu);
    if (cache.size() >= kCacheCapacity) cache.clear();
    cache.emplace(std::string(word), scratch.word_ids);
  }
}

// BPE on one word: start from one symbol per byte and repeatedly apply the
// lowest-ranked merge among adjacent pairs (leftmost on ties), until none
// applies. Symbols form a linked list over an array; candidate merges sit in
// a binary heap and are checked when popped, since earlier merges may have
// consumed either side. O(n log n) in the word length, which matters for
// long runs without spaces (CJK text, long digit-free identifiers).
void Tokenizer::Impl::merge_word(std::string_view word, EncodeScratch& scratch,
                                 std::vector<int>& out) const {
  std::vector<Symbol>& symbols = scratch.symbols;
  std::vector<Candidate>& heap = scratch.heap;
  symbols.clear();
  heap.clear();
  for (unsigned char b : word) {
    int id = byte_id[b];
    if (id < 0) {
      if (unk_id < 0) continue;  // no unk token: the byte is dropped, as upstream
      if (fuse_unk && !symbols.empty() && symbols.back().id == unk_id) {
        ++symbols.back().len;
        continue;
      }
      id = unk_id;
    }
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{id, index - 1, index + 1, 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const Merge* m = merges.find(symbols[i].id, symbols[i + 1].id)) {
      heap.push_back(Candidate{m->rank, static_cast<int>(i), m->merged});
    }
  }
  std::make_heap(heap.begin(), heap.end(), CandidateLess{});

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), CandidateLess{});
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const Merge* m = merges.find(left.id, right.id);
    if (m == nullptr || m->merged != top.merged) continue;  // stale candidate

    left.id = top.merged;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;

    if (left.prev >= 0) {
      if (const Merge* p = merges.find(symbols[left.prev].id, left.id)) {
        heap.push_back(Candidate{p->rank, left.prev, p->merged});
        std::push_heap(heap.begin(), heap.end(), CandidateLess{});
      }
    }
    if (left.next >= 0) {
      if (const Merge* n = merges.find(left.id, symbols[left.next].id)) {
        heap.push_back(Candidate{n->rank, top.pos, n->merged});
        std::push_heap(heap.begin(), heap.end(), CandidateLess{});
      }
    }
  }
  for (int i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

// ---------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  if (!file_exists(path)) fail(path, ": no tokenizer.json in model directory '", dir, "'");
  return from_file(path);
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  if (!file_exists(path)) fail(path, ": tokenizer file does not exist");
  const MappedFile file(path);
  return from_json(
      std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), path);
}

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& origin) {
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    fail(origin, ": malformed JSON: ", e.what());
  }
  auto impl = std::make_unique<Impl>();
  impl->origin = origin;
  try {
    impl->load(root);
  } catch (const json::exception& e) {
    // The loader checks the types it reads; this is a backstop so that no
    // shape of file escapes as anything but a lily::Error naming it.
    fail(origin, ": unexpected tokenizer.json structure: ", e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<int> out;
  out.reserve(text.size() / 3 + 4);
  EncodeScratch scratch;
  const Impl& im = *impl_;
  im.split_added(text, im.raw_matcher, allow_special, [&](std::string_view piece, int id) {
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    std::string storage;
    const std::string_view normalized = im.normalize(piece, storage);
    im.split_added(normalized, im.normalized_matcher, allow_special,
                   [&](std::string_view rest, int rest_id) {
                     if (rest_id >= 0) {
                       out.push_back(rest_id);
                     } else {
                       // Already normalized: go straight to pre-tokenization.
                       im.pre_tokenize(0, rest, scratch, [&](std::string_view word) {
                         im.encode_word(word, scratch, out);
                       });
                     }
                   });
  });
  return out;
}

std::string Tokenizer::decode(std::span<const int> ids, bool skip_special) const {
  std::string raw;
  for (int id : ids) {
    if (skip_special && is_special(id)) continue;
    raw.append(token_bytes(id));
  }
  std::string out;
  append_utf8_lossy(raw, /*at_end=*/true, out);
  return out;
}

std::string_view Tokenizer::token_bytes(int id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->bytes.size()) return {};
  return impl_->bytes[id];
}

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) {
    return it->second;
  }
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->kind.size() || impl_->kind[id] == kNone) {
    return std::nullopt;
  }
  return impl_->spelling[id];
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->bytes.size()); }

const std::vector<int>& Tokenizer::special_ids() const { return impl_->special_ids; }

bool Tokenizer::is_special(int id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->kind.size() && impl_->kind[id] == kSpecial;
}

bool Tokenizer::is_added(int id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->kind.size() &&
         (impl_->kind[id] == kAdded || impl_->kind[id] == kSpecial);
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::string> words;
  EncodeScratch scratch;
  std::string storage;
  const std::string_view normalized = impl_->normalize(text, storage);
  impl_->pre_tokenize(0, normalized, scratch,
                      [&](std::string_view word) { words.emplace_back(word); });
  return words;
}

}  // namespace lily::text

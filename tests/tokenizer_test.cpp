// Tests of the byte-level BPE tokenizer (text/tokenizer.h) and the streaming
// detokenizer (text/detokenizer.h). Ground truth is the real Qwen3
// tokenizer.json with ids produced by Hugging Face `tokenizers`
// (fixtures/tokenizer/encode.json, chat.json); small tokenizers built here
// cover the options Qwen files do not use.
#include <gtest/gtest.h>
#include <utf8proc.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace lily::text {
namespace {

using nlohmann::json;

const std::string kTokenizerDir = std::string(LILY_FIXTURES_DIR) + "/tokenizer";

// The real Qwen3 tokenizer, parsed once per test binary (~11 MB of JSON).
const Tokenizer& qwen3() {
  static const Tokenizer tokenizer = Tokenizer::from_dir(kTokenizerDir);
  return tokenizer;
}

json load_json(const std::string& path) { return json::parse(read_text_file(path)); }

// An independent UTF-8 validity check (not the library's), so the streaming
// tests do not grade the decoder with its own code.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated at the end
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    const uint32_t min_for_length[] = {0, 0x80, 0x800, 0x10000};
    if (cp < min_for_length[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* out = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
  EXPECT_NE(out, nullptr) << "test input is not valid UTF-8";
  if (out == nullptr) return s;
  std::string result(reinterpret_cast<char*>(out));
  std::free(out);
  return result;
}

// NFC of each maximal valid UTF-8 run, invalid bytes kept as they are:
// what the tokenizer's normalizer does to text that is not all UTF-8.
std::string nfc_valid_runs(const std::string& bytes) {
  std::string out, run;
  size_t i = 0;
  while (i < bytes.size()) {
    size_t len = 0;
    for (size_t n = 1; n <= 4 && i + n <= bytes.size(); ++n) {
      if (valid_utf8(bytes.substr(i, n))) {
        len = n;
        break;
      }
    }
    if (len > 0 && bytes[i] != '\0') {
      run += bytes.substr(i, len);
      i += len;
      continue;
    }
    out += nfc(run);
    run.clear();
    out += bytes[i++];
  }
  return out + nfc(run);
}

// Random valid UTF-8 (no NUL, which utf8proc_NFC's C-string API stops at),
// weighted toward the scripts a chat model sees, with some of everything.
std::string random_utf8(std::mt19937& rng, size_t chars) {
  struct Range {
    uint32_t lo, hi;
  };
  static const Range ranges[] = {
      {0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x24F},    {0x300, 0x36F},
      {0x370, 0x3FF},   {0x400, 0x4FF},   {0x590, 0x6FF},   {0x900, 0x97F},
      {0xE00, 0xE7F},   {0x1100, 0x11FF}, {0x2000, 0x206F}, {0x3000, 0x30FF},
      {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0xFE00, 0xFFFD}, {0x1F300, 0x1FAFF},
      {0x1, 0x10FFFF},
  };
  std::uniform_int_distribution<size_t> pick(0, std::size(ranges) - 1);
  std::string s;
  for (size_t i = 0; i < chars; ++i) {
    const Range r = ranges[pick(rng)];
    uint32_t cp = std::uniform_int_distribution<uint32_t>(r.lo, r.hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0x20;  // surrogates are not characters
    append_utf8(s, cp);
  }
  return s;
}

const char* const kMultilingual[] = {
    "The quick brown fox jumps over the lazy dog.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "敏捷的棕色狐狸跳过了懒狗。我们今天去公园散步吧！",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "다람쥐 헌 쳇바퀴에 타고파. 한국어 문장입니다.",
    "نص عربي قصير للاختبار مع أرقام ١٢٣",
    "עברית: שלום עולם",
    "हिन्दी पाठ: नमस्ते दुनिया, यह एक परीक्षण है।",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Ελληνικά: Γειά σου Κόσμε",
    "emoji 😀😃😄 family 👨‍👩‍👧‍👦 flags 🇯🇵🇺🇸 skin 👍🏽 keycap 1️⃣",
    "code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // done\n",
    "math ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6 ≈ 3.14159 × 10⁻³",
    "Zalgo t̸̢̛e̴̡͝x̷̧̛t̶̨̛ and ﬁ ligature Ⅻ ①",
    "\t\ttabs\r\n\r\n   spaces    and\u00a0nbsp\u3000",
};

// ---------------------------------------------------------------------------
// Against the fixtures: ids from `tokenizers` itself.

TEST(TokenizerQwen3, EncodeFixtureIdsAndDecode) {
  const json cases = load_json(kTokenizerDir + "/encode.json");
  ASSERT_GE(cases.size(), 10u);
  for (const json& c : cases) {
    const std::string text = c["text"];
    const std::vector<int> expected = c["ids"];
    EXPECT_EQ(qwen3().encode(text), expected) << "text: " << text;
    EXPECT_EQ(qwen3().decode(expected), c["decoded"].get<std::string>()) << "text: " << text;
  }
}

TEST(TokenizerQwen3, ChatFixtureIds) {
  const json cases = load_json(kTokenizerDir + "/chat.json");
  ASSERT_GE(cases.size(), 10u);
  for (const json& c : cases) {
    const std::string text = c["text"];
    const std::vector<int> expected = c["ids"];
    EXPECT_EQ(qwen3().encode(text), expected) << "case: " << c["name"];
    EXPECT_EQ(qwen3().decode(expected), text) << "case: " << c["name"];
  }
}

TEST(TokenizerQwen3, Lookups) {
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.token_to_id("<think>"), 151667);
  EXPECT_EQ(t.token_to_id("Hello"), 9707);
  EXPECT_EQ(t.token_to_id("Ġdog"), 5562);  // the vocabulary's own spelling of " dog"
  EXPECT_EQ(t.token_to_id("no such token here"), std::nullopt);
  EXPECT_EQ(t.id_to_token(5562), "Ġdog");
  EXPECT_EQ(t.id_to_token(151644), "<|im_start|>");
  EXPECT_EQ(t.id_to_token(151669), std::nullopt);
  EXPECT_EQ(t.id_to_token(-3), std::nullopt);
  EXPECT_EQ(t.token_bytes(5562), " dog");
  EXPECT_EQ(t.token_bytes(198), "\n");

  // Qwen3 marks 14 added tokens special (<|endoftext|> .. <|video_pad|>);
  // <tool_call>, <think> and the FIM tokens are added but not special.
  const std::vector<int>& special = t.special_ids();
  ASSERT_EQ(special.size(), 14u);
  EXPECT_EQ(special.front(), 151643);
  EXPECT_EQ(special.back(), 151656);
  EXPECT_TRUE(t.is_special(151645));
  EXPECT_FALSE(t.is_special(151667));
  EXPECT_TRUE(t.is_added(151667));
  EXPECT_FALSE(t.is_added(9707));
}

TEST(TokenizerQwen3, OutOfRangeIdsDecodeToNothing) {
  // Qwen3.5/3.6 checkpoints have 248,320 embedding rows for fewer tokens; a
  // sampled padding id must not break decoding.
  const std::vector<int> ids = {9707, 151669, 200000, 248319, -1, 11, 1 << 30};
  EXPECT_EQ(qwen3().decode(ids), "Hello,");
  EXPECT_EQ(qwen3().token_bytes(248319), "");
}

TEST(TokenizerQwen3, SpecialTokensMatchedInsideText) {
  const Tokenizer& t = qwen3();
  const std::string text = "abc<|im_start|>def<|im_end|><|endoftext|>x";
  const std::vector<int> ids = t.encode(text);
  const std::vector<int> head = t.encode("abc");
  ASSERT_GE(ids.size(), head.size() + 2);
  EXPECT_EQ(std::vector<int>(ids.begin(), ids.begin() + head.size()), head);
  EXPECT_EQ(ids[head.size()], 151644);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 151645), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), 151643), ids.end());
  EXPECT_EQ(t.decode(ids), text);
  EXPECT_EQ(t.decode(ids, /*skip_special=*/true), "abcdefx");

  // Longest match first: "<|im_start|>" must not be read as '<' + "|im_start|>".
  EXPECT_EQ(t.encode("<|im_start|>"), std::vector<int>{151644});
}

TEST(TokenizerQwen3, AllowSpecialFalseTokenizesAsText) {
  const Tokenizer& t = qwen3();
  const std::string text = "say <|im_end|> and <|endoftext|> literally";
  const std::vector<int> ids = t.encode(text, /*allow_special=*/false);
  for (int id : ids) EXPECT_FALSE(t.is_special(id)) << "special id " << id << " matched";
  EXPECT_GT(ids.size(), 8u);
  EXPECT_EQ(t.decode(ids), text);

  // Non-special added tokens are still recognised, as upstream does.
  const std::vector<int> think = t.encode("<think>x</think>", /*allow_special=*/false);
  EXPECT_EQ(think.front(), 151667);
  EXPECT_EQ(think.back(), 151668);
}

TEST(TokenizerQwen3, WhiteSpaceMeansUnicodeWhiteSpace) {
  // U+180E MONGOLIAN VOWEL SEPARATOR is `\s` to PCRE2's UCP mode but not to
  // Oniguruma (it left White_Space in Unicode 6.3). Upstream reads "\u180e'"
  // as one punctuation piece, so "'S" is not a contraction here. Ids from
  // `tokenizers` 0.23.
  EXPECT_EQ(qwen3().encode("I'm\u180e\uFB01\u180e'S"),
            (std::vector<int>{40, 2776, 123970, 236, 144300, 123970, 236, 6, 50}));
}

TEST(TokenizerQwen3, MatchesTokenizersOnOddCharacters) {
  // Cases from a differential run against `tokenizers` 0.23.2 (4,000 random
  // strings, all identical): NEL, zero-width and no-break spaces, BOM, long
  // s, dotted capital I, decomposed accents, vertical tab.
  struct Case {
    const char* text;
    std::vector<int> ids;
  };
  const Case cases[] = {
      {"Hello\u0085\u200b", {9707, 126, 227, 15692}},
      {"//  '\u017f\t", {322, 220, 364, 144815, 197}},
      {"\u0130stanbul", {47780, 45116}},
      {"\u00e9\u180e3.14\v", {963, 123970, 236, 18, 13, 16, 19, 199}},
      {"\ufb01\u2028==\u00a0{\u00a0", {144300, 378, 101, 418, 4102, 90, 4102}},
      {"\u0928\u092e\u0938\u094d\u0924\u0947\ufeff", {60096, 87244, 78368, 30484, 97, 34370, 3225}},
      {"e\u0301123}\u200b", {963, 16, 17, 18, 92, 15692}},
  };
  for (const Case& c : cases) EXPECT_EQ(qwen3().encode(c.text), c.ids) << c.text;

  // The same run with special-token matching off (split_special_tokens).
  const std::string text = "'S3.14//<|endoftext|>\v";
  EXPECT_EQ(qwen3().encode(text), (std::vector<int>{13272, 18, 13, 16, 19, 322, 151643, 199}));
  EXPECT_EQ(qwen3().encode(text, /*allow_special=*/false),
            (std::vector<int>{13272, 18, 13, 16, 19, 322, 27, 91, 8691, 723, 427, 91, 29, 199}));
}

TEST(TokenizerQwen3, NfcNormalizes) {
  // "e" + U+0301 (combining acute) composes to "é" before BPE.
  EXPECT_EQ(qwen3().encode("caf\x65\xCC\x81"), qwen3().encode("caf\xC3\xA9"));
}

TEST(TokenizerQwen3, RoundTripRandomUtf8) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string text = random_utf8(rng, 1 + trial % 60);
    const std::vector<int> ids = qwen3().encode(text);
    ASSERT_EQ(qwen3().decode(ids), nfc(text)) << "trial " << trial;
  }
}

TEST(TokenizerQwen3, RoundTripMultilingual) {
  std::string all;
  for (const char* text : kMultilingual) {
    const std::vector<int> ids = qwen3().encode(text);
    EXPECT_EQ(qwen3().decode(ids), nfc(text)) << text;
    all += text;
  }
  EXPECT_EQ(qwen3().decode(qwen3().encode(all)), nfc(all));
}

TEST(TokenizerQwen3, RawBytesSurviveEncoding) {
  // Text that is not UTF-8 still round-trips byte for byte through the ids
  // (decode() would show the broken parts as U+FFFD).
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes;
    const int n = 1 + trial % 40;
    for (int i = 0; i < n; ++i) {
      bytes += static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng));
    }
    std::string back;
    for (int id : qwen3().encode(bytes)) back.append(qwen3().token_bytes(id));
    // Valid stretches are still NFC-normalized (a random U+0387 becomes
    // U+00B7), everything else comes back unchanged.
    ASSERT_EQ(back, nfc_valid_runs(bytes)) << "trial " << trial;
  }
}

TEST(TokenizerQwen3, LongWordsAndRuns) {
  // Single pre-tokens of tens of kilobytes: BPE must stay O(n log n) and the
  // regex must not run out of stack.
  const std::vector<std::string> texts = {
      std::string(100000, 'a'),
      std::string(50000, ' ') + "x",
      std::string(20000, '\n'),
      [] {
        std::string s;
        for (int i = 0; i < 20000; ++i) s += "中文";
        return s;
      }(),
  };
  for (const std::string& text : texts) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int> ids = qwen3().encode(text);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(qwen3().decode(ids), text);
    // Quadratic BPE would take minutes here in a release build; the bound
    // leaves room for a sanitizer build on a loaded 2-core machine (~12 s
    // seen for one text).
    EXPECT_LT(seconds, 60.0);
  }
}

// A megabyte of mixed text round-trips. Its speed is measured by
// bench/tokenizer_bench.cpp (docs/tokenizer.md), not asserted here.
TEST(TokenizerQwen3, EncodesAMegabyte) {
  std::string text;
  while (text.size() < (1u << 20)) {
    for (const char* piece : kMultilingual) text += piece;
    text += std::to_string(text.size()) + " ";
  }
  const std::vector<int> ids = qwen3().encode(text);
  EXPECT_EQ(qwen3().decode(ids), nfc(text));
}

TEST(TokenizerQwen3, ConcurrentEncodeAgrees) {
  // The word cache is shared; encoding from several threads must give the
  // same ids as encoding alone.
  std::string text;
  for (const char* piece : kMultilingual) text += piece;
  const std::vector<int> expected = qwen3().encode(text);
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      bool same = true;
      for (int i = 0; i < 20; ++i) same = same && qwen3().encode(text) == expected;
      ok[t] = same;
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_TRUE(ok[t]) << "thread " << t;
}

// ---------------------------------------------------------------------------
// Small tokenizers built in code, for the options and errors.

// GPT-2's byte -> character table, written independently of the library.
std::string spell(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int cp = b;
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (!printable) {
      int n = 0;
      for (int c = 0; c < b; ++c) {
        const bool p = (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
        if (!p) ++n;
      }
      cp = 256 + n;
    }
    append_utf8(out, static_cast<uint32_t>(cp));
  }
  return out;
}

struct TinyOptions {
  std::vector<std::pair<std::string, std::string>> merges;  // raw bytes
  bool pair_form = false;
  json normalizer = nullptr;
  json pre_tokenizer = json{{"type", "ByteLevel"}, {"add_prefix_space", false},
                            {"trim_offsets", false}, {"use_regex", true}};
  json added_tokens = json::array();
  bool ignore_merges = false;
};

// A byte-level BPE: ids 0..255 are the bytes in order, then one id per merge.
json tiny_tokenizer(const TinyOptions& o) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[spell(std::string(1, static_cast<char>(b)))] = b;
  json merges = json::array();
  for (const auto& [a, b] : o.merges) {
    if (!vocab.contains(spell(a + b))) vocab[spell(a + b)] = static_cast<int>(vocab.size());
    if (o.pair_form) {
      merges.push_back(json::array({spell(a), spell(b)}));
    } else {
      merges.push_back(spell(a) + " " + spell(b));
    }
  }
  return json{{"version", "1.0"},
              {"added_tokens", o.added_tokens},
              {"normalizer", o.normalizer},
              {"pre_tokenizer", o.pre_tokenizer},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"ignore_merges", o.ignore_merges},
                {"vocab", vocab},
                {"merges", merges}}}};
}

Tokenizer tiny(const TinyOptions& o) { return Tokenizer::from_json(tiny_tokenizer(o).dump(), "tiny.json"); }

json split_then_byte_level(const std::string& regex) {
  return json{{"type", "Sequence"},
              {"pretokenizers",
               json::array({json{{"type", "Split"},
                                 {"pattern", {{"Regex", regex}}},
                                 {"behavior", "Isolated"},
                                 {"invert", false}},
                            json{{"type", "ByteLevel"},
                                 {"add_prefix_space", false},
                                 {"trim_offsets", false},
                                 {"use_regex", false}}})}};
}

const char* const kQwen3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Qwen3.5 / 3.6: letters may carry combining marks ([\p{L}\p{M}]+).
const char* const kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

TEST(TokenizerBpe, MergesByRankLeftmostFirst) {
  TinyOptions o;
  // Rank order decides: "b c" (rank 0) beats "a b" (rank 1) in "abc".
  o.merges = {{"b", "c"}, {"a", "b"}, {"a", "bc"}};
  const Tokenizer t = tiny(o);
  EXPECT_EQ(t.encode("abc"), std::vector<int>{*t.token_to_id(spell("abc"))});
  EXPECT_EQ(t.encode("ab"), std::vector<int>{*t.token_to_id(spell("ab"))});
  // Equal ranks resolve leftmost first: "aaa" -> "aa" + "a".
  TinyOptions o2;
  o2.merges = {{"a", "a"}};
  const Tokenizer t2 = tiny(o2);
  EXPECT_EQ(t2.encode("aaa"), (std::vector<int>{*t2.token_to_id("aa"), 'a'}));
  EXPECT_EQ(t2.encode("aaaa"), (std::vector<int>{*t2.token_to_id("aa"), *t2.token_to_id("aa")}));
}

TEST(TokenizerBpe, PairFormMergesEqualStringForm) {
  TinyOptions o;
  o.merges = {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}};
  const Tokenizer strings = tiny(o);
  o.pair_form = true;
  const Tokenizer pairs = tiny(o);
  for (const char* text : {"hello world", "hellhole", "  wow"}) {
    EXPECT_EQ(strings.encode(text), pairs.encode(text)) << text;
  }
  EXPECT_EQ(pairs.encode("hello"), std::vector<int>{*pairs.token_to_id("hello")});
}

TEST(TokenizerBpe, IgnoreMergesTakesWholeWords) {
  // "abc" is in the vocabulary, but the merges can only reach "ab" + "c".
  TinyOptions o;
  o.merges = {{"a", "b"}, {"b", "c"}, {"a", "bc"}};
  json j = tiny_tokenizer(o);
  j["model"]["merges"] = json::array({spell("a") + " " + spell("b")});
  json plain = j;
  j["model"]["ignore_merges"] = true;
  const Tokenizer with = Tokenizer::from_json(j.dump(), "with.json");
  const Tokenizer without = Tokenizer::from_json(plain.dump(), "without.json");
  EXPECT_EQ(with.encode("abc"), std::vector<int>{*with.token_to_id("abc")});
  EXPECT_EQ(without.encode("abc"), (std::vector<int>{*without.token_to_id("ab"), 'c'}));
}

TEST(TokenizerPreTokenize, Gpt2ByteLevelRegex) {
  const Tokenizer t = tiny(TinyOptions{});
  EXPECT_EQ(t.pre_tokenize("Hello world's  end 123!?"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " end", " 123", "!?"}));
}

TEST(TokenizerPreTokenize, AddPrefixSpace) {
  TinyOptions o;
  o.pre_tokenizer["add_prefix_space"] = true;
  const Tokenizer t = tiny(o);
  EXPECT_EQ(t.pre_tokenize("Hello world"), (std::vector<std::string>{" Hello", " world"}));
  EXPECT_EQ(t.pre_tokenize(" Hello"), (std::vector<std::string>{" Hello"}));
}

TEST(TokenizerPreTokenize, Qwen3Pattern) {
  TinyOptions o;
  o.pre_tokenizer = split_then_byte_level(kQwen3Pattern);
  const Tokenizer t = tiny(o);
  // Digits one by one, contractions case-insensitive, a run of spaces leaves
  // its last one to the next word, newlines stick together.
  EXPECT_EQ(t.pre_tokenize("I'M 2024   ok\n\nyes"),
            (std::vector<std::string>{"I", "'M", " ", "2", "0", "2", "4", "  ", " ok", "\n\n",
                                      "yes"}));
  EXPECT_EQ(t.pre_tokenize("a, b!!\n"), (std::vector<std::string>{"a", ",", " b", "!!\n"}));
  EXPECT_EQ(t.pre_tokenize("a\u180e'S"), (std::vector<std::string>{"a", "\u180e'", "S"}));
}

TEST(TokenizerPreTokenize, Qwen35PatternKeepsMarksInWords) {
  TinyOptions o3, o35;
  o3.pre_tokenizer = split_then_byte_level(kQwen3Pattern);
  o35.pre_tokenizer = split_then_byte_level(kQwen35Pattern);
  const Tokenizer t3 = tiny(o3);
  const Tokenizer t35 = tiny(o35);
  // Devanagari vowel signs and the virama are marks (Mc/Mn), not letters.
  const std::string hindi = "नमस्ते दुनिया";
  EXPECT_EQ(t35.pre_tokenize(hindi), (std::vector<std::string>{"नमस्ते", " दुनिया"}));
  EXPECT_GT(t3.pre_tokenize(hindi).size(), 2u);
  // A decomposed accent (no NFC here) stays inside its word too.
  const std::string decomposed = "cafe\xCC\x81 ok";
  EXPECT_EQ(t35.pre_tokenize(decomposed),
            (std::vector<std::string>{"cafe\xCC\x81", " ok"}));
  EXPECT_EQ(t3.pre_tokenize(decomposed),
            (std::vector<std::string>{"cafe", "\xCC\x81", " ok"}));
}

TEST(TokenizerNormalizer, NullNfcAndSequence) {
  const std::string decomposed = "e\xCC\x81";
  const std::string composed = "\xC3\xA9";
  TinyOptions none;
  none.pre_tokenizer["use_regex"] = false;  // one piece: see the normalizer alone
  EXPECT_EQ(tiny(none).pre_tokenize(decomposed), std::vector<std::string>{decomposed});
  TinyOptions nfc_only = none;
  nfc_only.normalizer = json{{"type", "NFC"}};
  EXPECT_EQ(tiny(nfc_only).pre_tokenize(decomposed), std::vector<std::string>{composed});
  TinyOptions sequence = none;
  sequence.normalizer =
      json{{"type", "Sequence"}, {"normalizers", json::array({json{{"type", "NFC"}}})}};
  EXPECT_EQ(tiny(sequence).pre_tokenize(decomposed), std::vector<std::string>{composed});
  // Invalid UTF-8 next to text that needs normalizing: passed through as is.
  EXPECT_EQ(tiny(nfc_only).pre_tokenize("\xFF" + decomposed + "\xFF"),
            std::vector<std::string>{"\xFF" + composed + "\xFF"});
}

json added(const std::string& content, int id, bool special, json extra = json::object()) {
  json j = {{"id", id},          {"content", content}, {"single_word", false},
            {"lstrip", false},   {"rstrip", false},    {"normalized", false},
            {"special", special}};
  j.update(extra);
  return j;
}

TEST(TokenizerAddedTokens, LongestMatchAndStripOptions) {
  TinyOptions o;
  o.added_tokens = json::array({added("<a>", 300, true), added("<a><b>", 301, true),
                                added("<m>", 302, false, {{"lstrip", true}, {"rstrip", true}}),
                                added("tok", 303, false, {{"single_word", true}})});
  const Tokenizer t = tiny(o);
  EXPECT_EQ(t.encode("<a><b>"), std::vector<int>{301});
  EXPECT_EQ(t.encode("<a><a>"), (std::vector<int>{300, 300}));
  // lstrip/rstrip: the spaces around <m> belong to it.
  EXPECT_EQ(t.encode("x  <m>  y"), (std::vector<int>{'x', 302, 'y'}));
  EXPECT_EQ(t.decode(t.encode("x  <m>  y")), "x<m>y");
  // single_word: only where no word character touches it.
  EXPECT_EQ(t.encode("a tok b")[2], 303);
  const std::vector<int> inside = t.encode("atok");
  EXPECT_EQ(std::count(inside.begin(), inside.end(), 303), 0);
  EXPECT_EQ(t.special_ids(), (std::vector<int>{300, 301}));
}

TEST(TokenizerAddedTokens, NormalizedTokensMatchAfterNormalization) {
  TinyOptions o;
  o.normalizer = json{{"type", "NFC"}};
  // Written decomposed in the file; matched against NFC text.
  o.added_tokens = json::array({added("ne\xCC\x81", 300, false, {{"normalized", true}})});
  const Tokenizer t = tiny(o);
  EXPECT_EQ(t.encode("n\xC3\xA9"), std::vector<int>{300});
  EXPECT_EQ(t.encode("ne\xCC\x81"), std::vector<int>{300});
}

// ---------------------------------------------------------------------------
// Loading errors name the file and the field.

std::string load_error(const std::string& json_text) {
  try {
    Tokenizer::from_json(json_text, "bad.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenizerErrors, MissingFileAndDirectory) {
  try {
    Tokenizer::from_file("/nonexistent/tokenizer.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.json"), std::string::npos);
  }
  try {
    Tokenizer::from_dir("/nonexistent-model-dir");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-model-dir/tokenizer.json"),
              std::string::npos);
  }
}

TEST(TokenizerErrors, MalformedFields) {
  EXPECT_NE(load_error("{not json").find("bad.json: malformed JSON"), std::string::npos);
  EXPECT_NE(load_error("{}").find("'model' is missing"), std::string::npos);

  json j = tiny_tokenizer(TinyOptions{});
  j["model"].erase("vocab");
  EXPECT_NE(load_error(j.dump()).find("'model.vocab' is missing"), std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["model"]["merges"] = json::array({"a zz"});
  const std::string merge_error = load_error(j.dump());
  EXPECT_NE(merge_error.find("bad.json"), std::string::npos) << merge_error;
  EXPECT_NE(merge_error.find("model.merges[0]"), std::string::npos) << merge_error;
  EXPECT_NE(merge_error.find("zz"), std::string::npos) << merge_error;

  j = tiny_tokenizer(TinyOptions{});
  j["model"]["merges"] = json::array({"abc"});
  EXPECT_NE(load_error(j.dump()).find("model.merges[0]"), std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["pre_tokenizer"] = split_then_byte_level("(unclosed");
  EXPECT_NE(load_error(j.dump()).find("pre_tokenizer.pretokenizers[0].pattern.Regex"),
            std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["normalizer"] = json{{"type", "Lowercase"}};
  EXPECT_NE(load_error(j.dump()).find("normalizer.type"), std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["added_tokens"] = json::array({json{{"content", "<x>"}}});
  EXPECT_NE(load_error(j.dump()).find("added_tokens[0].id' is missing"), std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["model"]["vocab"]["Ġx"] = -5;
  EXPECT_NE(load_error(j.dump()).find("model.vocab"), std::string::npos);

  j = tiny_tokenizer(TinyOptions{});
  j["pre_tokenizer"] = json{{"type", "Whitespace"}};
  EXPECT_NE(load_error(j.dump()).find("pre_tokenizer.type"), std::string::npos);
}

TEST(TokenizerErrors, FromDirReadsTokenizerJson) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("lily_tok_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    TinyOptions o;
    o.merges = {{"h", "i"}};
    std::ofstream(dir / "tokenizer.json") << tiny_tokenizer(o).dump();
  }
  const Tokenizer t = Tokenizer::from_dir(dir.string());
  EXPECT_EQ(t.encode("hi"), std::vector<int>{256});
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------
// Streaming detokenizer.

std::string lossy(const std::string& bytes) {
  std::string out;
  append_utf8_lossy(bytes, /*at_end=*/true, out);
  return out;
}

TEST(DetokUtf8, LossyReplacesMaximalSubparts) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("\xE4\xBD\xA0"), "\xE4\xBD\xA0");  // 你
  EXPECT_EQ(lossy("a\xF0\x9F\x98"), "a" + fffd);    // truncated emoji: one U+FFFD
  EXPECT_EQ(lossy("\xE0\x80"), fffd + fffd);        // overlong lead, then a stray byte
  EXPECT_EQ(lossy("\xED\xA0\x80"), fffd + fffd + fffd);  // a surrogate
  EXPECT_EQ(lossy("\xC3(x"), fffd + "(x");
  EXPECT_EQ(lossy("\xFF\xFE"), fffd + fffd);
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF

  std::string out;
  EXPECT_EQ(append_utf8_lossy("ab\xE4\xBD", /*at_end=*/false, out), 2u);
  EXPECT_EQ(out, "ab");
}

TEST(DetokStream, CjkAndEmojiNeverBroken) {
  const Tokenizer& t = qwen3();
  const std::string text =
      "中文字符与日本語のテキスト 😀🚀👩‍💻🇫🇷 한국어 ∑≈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and plain ASCII.";
  const std::vector<int> ids = t.encode(text);
  // Byte-level BPE splits some of these characters across tokens; the test
  // is only meaningful if at least one token is a partial character.
  bool some_partial = false;
  for (int id : ids) some_partial |= !valid_utf8(std::string(t.token_bytes(id)));
  ASSERT_TRUE(some_partial);

  StreamDecoder stream(t);
  std::string joined;
  for (int id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(valid_utf8(piece)) << "broken piece after id " << id;
    joined += piece;
  }
  const std::string tail = stream.flush();
  EXPECT_TRUE(tail.empty());
  joined += tail;
  EXPECT_EQ(joined, t.decode(ids));
  EXPECT_EQ(joined, text);
}

TEST(DetokStream, RandomIdsMatchDecode) {
  // Arbitrary id sequences, including partial characters that never
  // complete: each piece is valid UTF-8 and the stream equals decode().
  const Tokenizer& t = qwen3();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> any_id(-5, 160000);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int> ids(1 + trial % 30);
    for (int& id : ids) id = any_id(rng);
    StreamDecoder stream(t);
    std::string joined;
    for (int id : ids) {
      const std::string piece = stream.push(id);
      ASSERT_TRUE(valid_utf8(piece)) << "trial " << trial;
      joined += piece;
    }
    EXPECT_LE(stream.pending_bytes(), 3u);
    joined += stream.flush();
    ASSERT_EQ(joined, t.decode(ids)) << "trial " << trial;
  }
}

TEST(DetokStream, FlushEmitsReplacementForLeftovers) {
  const Tokenizer& t = qwen3();
  // Find a token that is the first part of a character.
  int partial = -1;
  for (int id = 0; id < t.vocab_size() && partial < 0; ++id) {
    const std::string_view b = t.token_bytes(id);
    if (b.size() == 1 && static_cast<uint8_t>(b[0]) >= 0xE0 && static_cast<uint8_t>(b[0]) < 0xF0) {
      partial = id;
    }
  }
  ASSERT_GE(partial, 0);
  StreamDecoder stream(t);
  EXPECT_EQ(stream.push(partial), "");
  EXPECT_EQ(stream.pending_bytes(), 1u);
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.pending_bytes(), 0u);
  EXPECT_EQ(stream.push(9707), "Hello");  // ready for a new stream
}

TEST(DetokStream, SkipSpecial) {
  const Tokenizer& t = qwen3();
  const std::vector<int> ids = t.encode("<|im_start|>assistant\nHi<|im_end|>");
  StreamDecoder stream(t, /*skip_special=*/true);
  std::string joined;
  for (int id : ids) joined += stream.push(id);
  joined += stream.flush();
  EXPECT_EQ(joined, "assistant\nHi");
}

}  // namespace
}  // namespace lily::text

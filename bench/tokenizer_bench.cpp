// Tokenizer throughput on generated mixed-language text.
//
//   tokenizer_bench [tokenizer.json | model dir] [megabytes]
//
// Defaults: the Qwen3 tokenizer in tests/fixtures, 2 MB of text.
// The text is made here from a fixed seed (English prose, source code, CJK,
// Cyrillic, emoji, numbers in paragraphs of random kind), so runs compare.
// Reports load time, encode MB/s with a cold word cache (the first pass of a
// fresh tokenizer) and a warm one, and decode / streaming-decode MB/s.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// CPU time of this thread: steadier than wall time on a shared machine.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Splits a UTF-8 string into its characters.
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 1;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0xF0) n = 4;
    else if (b >= 0xE0) n = 3;
    else if (b >= 0xC0) n = 2;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

class TextGenerator {
 public:
  explicit TextGenerator(uint32_t seed) : rng_(seed) {
    english_ = split(
        "the of and to in is that it for was on are as with his they at be this have from or "
        "one had by word but not what all were we when your can said there use an each which "
        "she do how their if will up other about out many then them these so some her would "
        "make like him into time has look two more write go see number no way could people my "
        "than first water been call who oil its now find long down day did get come made may "
        "part model token inference memory cache latency throughput quantization attention "
        "layer kernel vector matrix gradient batch sequence context window benchmark server");
    russian_ = split(
        "и в не на я быть он с что а по это она этот к но они мы как из у который то за свой "
        "весь год от так о для ты же все тот мочь вы человек такой его сказать только или еще "
        "бы себя один как уже до время если сам когда другой вот говорить наш мой знать стать "
        "при чтобы дело жизнь кто первый очень два день её новый рука даже во со раз где там "
        "модель память скорость токен сервер запрос ответ данные");
    han_ = characters(
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过"
        "家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所"
        "本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全"
        "工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教"
        "西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性"
        "模型推理内存缓存延迟吞吐量化注意力");
    kana_ = characters(
        "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわを"
        "んアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロ");
    emoji_ = split(
        "😀 😂 🥲 😍 🤔 🙃 🚀 🔥 ✨ 🎉 👍 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 🇺🇸 ❤️ ✅ ⚠️ 🧠 🐍 🦀 1️⃣ ☕");
    code_keywords_ = split(
        "int float double auto const static return if else for while struct class template "
        "typename void bool size_t std::vector std::string def self import from lambda None "
        "True False async await let fn mut impl pub match");
  }

  std::string make(size_t bytes) {
    std::string text;
    text.reserve(bytes + 4096);
    while (text.size() < bytes) {
      switch (pick(0, 9)) {
        case 0: case 1: case 2: text += english_paragraph(); break;
        case 3: case 4: text += code_block(); break;
        case 5: text += chinese_paragraph(); break;
        case 6: text += japanese_paragraph(); break;
        case 7: text += russian_paragraph(); break;
        case 8: text += numbers_line(); break;
        default: text += emoji_line(); break;
      }
      text += pick(0, 3) == 0 ? "\n\n" : "\n";
    }
    return text;
  }

 private:
  static std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    size_t i = 0;
    while (i < s.size()) {
      const size_t j = std::min(s.find(' ', i), s.size());
      if (j > i) out.push_back(s.substr(i, j - i));
      i = j + 1;
    }
    return out;
  }
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  const std::string& any(const std::vector<std::string>& v) {
    return v[static_cast<size_t>(pick(0, static_cast<int>(v.size()) - 1))];
  }
  std::string identifier() {
    static const char* const parts[] = {"get", "set", "max", "min", "buf", "idx", "tok",
                                        "len", "ptr", "src", "dst", "tmp", "num", "key"};
    std::string id = parts[pick(0, 13)];
    for (int k = pick(0, 2); k > 0; --k) id += std::string("_") + parts[pick(0, 13)];
    if (pick(0, 3) == 0) id += std::to_string(pick(0, 99));
    return id;
  }

  std::string english_paragraph() {
    std::string p;
    for (int s = pick(2, 6); s > 0; --s) {
      std::string sentence;
      for (int w = pick(5, 18); w > 0; --w) {
        if (!sentence.empty()) sentence += pick(0, 12) == 0 ? ", " : " ";
        sentence += any(english_);
      }
      sentence[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(sentence[0])));
      p += sentence + (pick(0, 5) == 0 ? "? " : ". ");
    }
    return p;
  }
  std::string code_block() {
    std::string c;
    int indent = 0;
    for (int line = pick(3, 12); line > 0; --line) {
      c += std::string(static_cast<size_t>(indent) * 4, ' ');
      switch (pick(0, 4)) {
        case 0:
          c += any(code_keywords_) + " " + identifier() + " = " + identifier() + "(" +
               identifier() + ", " + std::to_string(pick(0, 4096)) + ");";
          break;
        case 1:
          c += "for (int i = 0; i < " + identifier() + ".size(); ++i) {";
          ++indent;
          break;
        case 2:
          c += identifier() + "[i] += " + identifier() + " * 0x" + std::to_string(pick(10, 99)) +
               "f;  // " + any(english_) + " " + any(english_);
          break;
        case 3:
          if (indent > 0) {
            --indent;
            c.resize(c.size() - 4);
            c += "}";
          } else {
            c += "return " + identifier() + ";";
          }
          break;
        default:
          c += "if " + identifier() + " == " + identifier() + ":\n" +
               std::string(static_cast<size_t>(indent + 1) * 4, ' ') + "print(f\"{" +
               identifier() + "!r}\")";
          break;
      }
      c += "\n";
    }
    return c;
  }
  std::string chinese_paragraph() {
    std::string p;
    for (int s = pick(2, 5); s > 0; --s) {
      for (int ch = pick(8, 30); ch > 0; --ch) p += any(han_);
      p += pick(0, 2) == 0 ? "，" : "。";
    }
    return p;
  }
  std::string japanese_paragraph() {
    std::string p;
    for (int ch = pick(15, 60); ch > 0; --ch) p += pick(0, 2) == 0 ? any(han_) : any(kana_);
    return p + "。";
  }
  std::string russian_paragraph() {
    std::string p;
    for (int w = pick(10, 40); w > 0; --w) {
      if (!p.empty()) p += " ";
      p += any(russian_);
    }
    return p + ".";
  }
  std::string numbers_line() {
    std::string n;
    for (int k = pick(3, 10); k > 0; --k) {
      switch (pick(0, 3)) {
        case 0: n += std::to_string(pick(0, 1000000)); break;
        case 1: n += std::to_string(pick(0, 999)) + "." + std::to_string(pick(0, 99999)); break;
        case 2:
          n += "20" + std::to_string(pick(10, 39)) + "-" + std::to_string(pick(10, 12)) + "-" +
               std::to_string(pick(10, 28));
          break;
        default: n += "$" + std::to_string(pick(1, 9999)) + ",00"; break;
      }
      n += " ";
    }
    return n;
  }
  std::string emoji_line() {
    std::string e;
    for (int k = pick(3, 12); k > 0; --k) {
      e += any(emoji_);
      if (pick(0, 1) == 0) e += " " + any(english_) + " ";
    }
    return e;
  }

  std::mt19937 rng_;
  std::vector<std::string> english_, russian_, han_, kana_, emoji_, code_keywords_;
};

}  // namespace

int main(int argc, char** argv) {
  using lily::text::StreamDecoder;
  using lily::text::Tokenizer;
#ifdef LILY_FIXTURES_DIR
  std::string source = std::string(LILY_FIXTURES_DIR) + "/tokenizer/tokenizer.json";
#else
  std::string source = "tokenizer.json";
#endif
  if (argc > 1 && argv[1][0] != '\0') source = argv[1];  // "" keeps the default
  const double megabytes = argc > 2 ? std::atof(argv[2]) : 2.0;
  if (!(megabytes > 0.0 && megabytes <= 1024.0)) {
    std::fprintf(stderr, "usage: %s [tokenizer.json | model dir] [megabytes]\n", argv[0]);
    return 2;
  }

  try {
    const std::string text =
        TextGenerator(20251202).make(static_cast<size_t>(megabytes * 1024 * 1024));
    const double mb = static_cast<double>(text.size()) / (1024.0 * 1024.0);

    auto start = Clock::now();
    const bool is_file = source.size() >= 5 && source.compare(source.size() - 5, 5, ".json") == 0;
    const Tokenizer tokenizer = is_file ? Tokenizer::from_file(source) : Tokenizer::from_dir(source);
    const double load_s = seconds_since(start);

    start = Clock::now();
    double cpu = thread_cpu_seconds();
    const std::vector<int> ids = tokenizer.encode(text);
    const double cold_s = seconds_since(start);
    const double cold_cpu_s = thread_cpu_seconds() - cpu;

    double warm_s = 1e30, warm_cpu_s = 1e30;
    for (int run = 0; run < 3; ++run) {
      start = Clock::now();
      cpu = thread_cpu_seconds();
      const std::vector<int> again = tokenizer.encode(text);
      warm_s = std::min(warm_s, seconds_since(start));
      warm_cpu_s = std::min(warm_cpu_s, thread_cpu_seconds() - cpu);
      if (again != ids) lily::fail("encode is not deterministic");
    }

    start = Clock::now();
    const std::string decoded = tokenizer.decode(ids);
    const double decode_s = seconds_since(start);

    start = Clock::now();
    StreamDecoder stream(tokenizer);
    std::string streamed;
    streamed.reserve(decoded.size());
    for (int id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    const double stream_s = seconds_since(start);
    if (streamed != decoded) lily::fail("streamed text differs from decode()");

    std::printf("tokenizer      %s\n", source.c_str());
    std::printf("text           %.2f MB generated (English, code, CJK, Cyrillic, emoji, numbers)\n",
                mb);
    std::printf("tokens         %zu (%.2f bytes/token)\n", ids.size(),
                static_cast<double>(text.size()) / static_cast<double>(ids.size()));
    std::printf("load           %.3f s\n", load_s);
    std::printf("encode cold    %.3f s  %.1f MB/s  (empty word cache; CPU time %.1f MB/s)\n",
                cold_s, mb / cold_s, mb / cold_cpu_s);
    std::printf("encode warm    %.3f s  %.1f MB/s  (best of 3; CPU time %.1f MB/s)\n", warm_s,
                mb / warm_s, mb / warm_cpu_s);
    std::printf("decode         %.3f s  %.1f MB/s\n", decode_s, mb / decode_s);
    std::printf("stream decode  %.3f s  %.1f MB/s  (%.0f ns/token)\n", stream_s, mb / stream_s,
                stream_s * 1e9 / static_cast<double>(ids.size()));
    if (decoded.size() != text.size()) {
      std::printf("note: decoded text is %zu bytes vs %zu in (NFC normalization)\n",
                  decoded.size(), text.size());
    }
  } catch (const lily::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

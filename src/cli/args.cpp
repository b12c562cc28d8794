#include "cli/args.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace lily::cli {

Args::Args(int argc, char** argv, const std::set<std::string>& flags,
           const std::set<std::string>& switches) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string value;
      bool inline_value = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        inline_value = true;
      }
      if (switches.count(a)) {
        values_[a] = inline_value ? value : "1";
      } else if (flags.count(a)) {
        if (!inline_value) {
          if (i + 1 >= argc) fail("option ", a, " needs a value");
          value = argv[++i];
        }
        values_[a] = value;
      } else {
        fail("unknown option ", a);
      }
    } else {
      positional_.push_back(a);
    }
  }
}

std::string Args::str(const std::string& flag, const std::string& def) const {
  auto it = values_.find(flag);
  return it == values_.end() ? def : it->second;
}

std::string Args::required(const std::string& flag) const {
  auto it = values_.find(flag);
  if (it == values_.end()) fail("missing required option ", flag);
  return it->second;
}

long long Args::integer(const std::string& flag, long long def, long long lo, long long hi) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return def;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != 0 || errno != 0)
    fail("option ", flag, ": '", it->second, "' is not an integer");
  if (v < lo || v > hi) fail("option ", flag, ": ", v, " is outside [", lo, ", ", hi, "]");
  return v;
}

double Args::number(const std::string& flag, double def, double lo, double hi) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return def;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != 0) fail("option ", flag, ": '", it->second, "' is not a number");
  if (!(v >= lo && v <= hi)) fail("option ", flag, ": ", v, " is outside [", lo, ", ", hi, "]");
  return v;
}

std::vector<int> parse_int_list(const std::string& s, const std::string& what) {
  std::vector<int> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    errno = 0;
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != 0 || errno != 0 || v < 0 || v > 0x7fffffff)
      fail(what, ": '", item, "' is not a non-negative integer");
    out.push_back(static_cast<int>(v));
    i = j + 1;
  }
  return out;
}

}  // namespace lily::cli

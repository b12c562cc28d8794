// Minimal `--flag value` parsing for the subcommands; unknown flags and
// malformed values are errors that name the flag.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace lily::cli {

class Args {
 public:
  // argv after the subcommand. `flags` take a value; `switches` do not.
  Args(int argc, char** argv, const std::set<std::string>& flags,
       const std::set<std::string>& switches = {});

  bool has(const std::string& flag) const { return values_.count(flag) != 0; }
  std::string str(const std::string& flag, const std::string& def = "") const;
  std::string required(const std::string& flag) const;
  long long integer(const std::string& flag, long long def, long long lo, long long hi) const;
  double number(const std::string& flag, double def, double lo, double hi) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// "1,2,3" -> {1, 2, 3}; fails naming `what` on anything else.
std::vector<int> parse_int_list(const std::string& s, const std::string& what);

}  // namespace lily::cli

// Errors that say what is at fault: the file, tensor, field or parameter, and
// what was expected. Everything a user can get wrong is reported through
// lily::Error, never an assert.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace lily {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates its arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(str_cat(std::forward<Args>(args)...));
}

}  // namespace lily

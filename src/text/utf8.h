// UTF-8 encoding of one code point (shared by the tokenizer, the Jinja
// interpreter and the tests).
#pragma once

#include <cstdint>
#include <string>

namespace lily::text {

// Appends cp (< 0x110000) as 1-4 UTF-8 bytes.
void append_utf8(std::string& out, uint32_t cp);

}  // namespace lily::text

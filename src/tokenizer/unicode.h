// UTF-8 and Unicode helpers for the tokenizer: validation and lossy repair (each maximal invalid
// subsequence becomes U+FFFD, as Python's errors="replace", Rust's from_utf8_lossy and the
// WHATWG TextDecoder do), NFC normalization through utf8proc with a fast path for text that NFC
// cannot change, and the character classes that Hugging Face's added-token matching uses
// (Unicode White_Space and regex \w).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace memtune::tokenizer_detail {

// True when `bytes` is well-formed UTF-8 (no overlongs, surrogates or values past U+10FFFF).
bool is_valid_utf8(std::string_view bytes);

// Appends `bytes` to `out` with every maximal invalid subsequence replaced by U+FFFD.
void append_utf8_lossy(std::string_view bytes, std::string& out);

// The length of the longest prefix of `bytes` that does not end inside a character: a lead byte
// whose continuation bytes have not all arrived is cut (streamed text is printed whole
// characters at a time); anything else, invalid bytes included, is kept.
size_t complete_utf8_prefix(std::string_view bytes);

// Decodes the code point starting at text[i] of valid UTF-8 and advances i past it.
char32_t next_code_point(std::string_view text, size_t& i);
// Decodes the code point that ends just before text[end] of valid UTF-8; `start` receives its
// first byte's index.
char32_t previous_code_point(std::string_view text, size_t end, size_t& start);

// Appends the UTF-8 encoding of a code point (cp <= U+10FFFF, not a surrogate).
void append_utf8(char32_t cp, std::string& out);

// NFC of valid UTF-8. Returns false and leaves `out` untouched when the text is already in NFC
// by a quick check (the common case), true when `out` holds the normalized text.
bool nfc_if_changed(std::string_view text, std::string& out);

// Unicode White_Space (what Rust's and Oniguruma's \s match).
bool is_white_space(char32_t cp);
// Regex \w in Unicode mode: letters, marks, decimal digits, letter numbers, connector
// punctuation and the joiners U+200C/U+200D.
bool is_word_char(char32_t cp);

}  // namespace memtune::tokenizer_detail

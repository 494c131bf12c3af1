// A pre-tokenizer regex compiled with PCRE2 (UTF + Unicode properties, JIT when available), used
// with Hugging Face's "Isolated" split behaviour: every match and every stretch of text between
// matches becomes its own piece. Hugging Face compiles these patterns with Oniguruma, whose \s is
// the Unicode White_Space set; PCRE2's \s also matches U+180E, so \s and \S are rewritten to the
// explicit White_Space set before compiling. Matching is const and thread-safe: each thread
// keeps its own match data and JIT stack.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace memtune::tokenizer_detail {

class SplitRegex {
 public:
  // `what` names the pattern's origin (file and field) for error messages.
  SplitRegex(std::string_view pattern, const std::string& what);
  SplitRegex(SplitRegex&& other) noexcept;
  SplitRegex& operator=(SplitRegex&&) = delete;
  SplitRegex(const SplitRegex&) = delete;
  ~SplitRegex();

  // Calls piece(begin, end) for each piece of `text` (valid UTF-8), in order, covering it all.
  template <class F>
  void split(std::string_view text, F&& piece) const {
    size_t last = 0, pos = 0, begin = 0, end = 0;
    while (pos <= text.size() && find(text, pos, begin, end)) {
      if (begin == end) {
        // An empty match is not a piece; search again one code point further on.
        if (begin >= text.size()) break;
        pos = begin + 1;
        while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
        continue;
      }
      if (begin > last) piece(last, begin);
      piece(begin, end);
      last = pos = end;
    }
    if (last < text.size()) piece(last, text.size());
  }

 private:
  // The first match at or after byte offset `start`; false when there is none.
  bool find(std::string_view text, size_t start, size_t& begin, size_t& end) const;

  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
  std::string what_;
};

// The pattern with \s and \S replaced by explicit Unicode White_Space classes (exposed for tests).
std::string with_unicode_white_space(std::string_view pattern, const std::string& what);

}  // namespace memtune::tokenizer_detail

// PCRE2-backed pre-tokenizer regex (see split_regex.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/split_regex.h"

#include <pcre2.h>

#include "core/error.h"

namespace memtune::tokenizer_detail {
namespace {

// Unicode White_Space, as members of a character class.
constexpr std::string_view kWhiteSpaceMembers =
    "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof buffer) < 0) return fmt::format("PCRE2 error {}", code);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread matching state, shared by all patterns: match data (only the whole-match offsets
// are read, so a small ovector suffices for any pattern) and a JIT stack larger than PCRE2's
// default so that long pieces do not exhaust it.
struct MatchState {
  pcre2_match_data* data;
  pcre2_jit_stack* jit_stack;
  pcre2_match_context* context;

  MatchState()
      : data(pcre2_match_data_create(4, nullptr)),
        jit_stack(pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)),
        context(pcre2_match_context_create(nullptr)) {
    if (!data || !jit_stack || !context) {
      release();
      throw Error("out of memory creating regex match state");
    }
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() { release(); }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;

  // The PCRE2 free functions accept null.
  void release() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

std::string with_unicode_white_space(std::string_view pattern, const std::string& what) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size();) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char d = pattern[i + 1];
      if (d == 'Q') {
        // \Q...\E quotes its contents literally: copy them untouched.
        const size_t close = pattern.find("\\E", i + 2);
        const size_t stop = close == std::string_view::npos ? pattern.size() : close + 2;
        out.append(pattern.substr(i, stop - i));
        i = stop;
        continue;
      }
      if (d == 's') {
        if (in_class) {
          out += kWhiteSpaceMembers;
        } else {
          out += '[';
          out += kWhiteSpaceMembers;
          out += ']';
        }
      } else if (d == 'S') {
        if (in_class)
          throw Error(fmt::format("{}: \\S inside a character class is not supported", what));
        out += "[^";
        out += kWhiteSpaceMembers;
        out += ']';
      } else {
        out += c;
        out += d;
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      in_class = true;
      out += c;
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out += pattern[i++];
      if (i < pattern.size() && pattern[i] == ']') out += pattern[i++];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      // POSIX class such as [:alpha:] inside a bracket expression.
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 2;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

SplitRegex::SplitRegex(std::string_view pattern, const std::string& what) : what_(what) {
  const std::string rewritten = with_unicode_white_space(pattern, what);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(), PCRE2_UTF | PCRE2_UCP,
                        &error_code, &error_offset, nullptr);
  if (!code_)
    throw Error(fmt::format("{}: invalid regex: {} (at offset {} of the pattern with \\s expanded: {})", what,
                            pcre2_message(error_code), error_offset, rewritten));
  // Without JIT support (some platforms) matching falls back to the interpreter.
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

SplitRegex::SplitRegex(SplitRegex&& other) noexcept
    : code_(other.code_), jit_(other.jit_), what_(std::move(other.what_)) {
  other.code_ = nullptr;
}

SplitRegex::~SplitRegex() {
  pcre2_code_free(code_);
}

bool SplitRegex::find(std::string_view text, size_t start, size_t& begin, size_t& end) const {
  MatchState& state = match_state();
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // The text was validated once up front; skipping PCRE2's own check keeps matching linear.
  int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), start, 0, state.data, state.context)
                : pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
    rc = pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, state.data,
                     state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  // rc == 0 means the ovector was too small for all groups; the whole match is still there.
  if (rc < 0)
    throw Error(fmt::format("{}: regex matching failed on a {}-byte piece of text: {}", what_, text.size(),
                            pcre2_message(rc)));
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  begin = ovector[0];
  end = ovector[1];
  return true;
}

}  // namespace memtune::tokenizer_detail

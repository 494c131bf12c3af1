// UTF-8 validation and repair, NFC with a quick check, and character classes (see unicode.h).
#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.h"

namespace memtune::tokenizer_detail {
namespace {

// The well-formed UTF-8 sequences (Unicode Table 3-7): a lead byte fixes the length and the
// allowed range of the second byte; later bytes are plain continuations 80..BF.
struct LeadInfo {
  int length;          // 0: never valid as a lead byte
  uint8_t second_lo;
  uint8_t second_hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};  // excludes the surrogates U+D800..U+DFFF
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};  // nothing past U+10FFFF
  return {0, 0, 0};
}

// Length of the maximal prefix of a well-formed sequence at bytes[i]: equals the sequence length
// when the sequence is complete and valid, otherwise it is the "maximal subpart" (at least 1)
// that one U+FFFD replaces.
size_t valid_prefix(std::string_view bytes, size_t i, int& length) {
  const LeadInfo info = lead_info(static_cast<uint8_t>(bytes[i]));
  length = info.length;
  if (info.length <= 1) return 1;
  size_t k = 1;
  if (i + 1 < bytes.size()) {
    const auto b1 = static_cast<uint8_t>(bytes[i + 1]);
    if (b1 >= info.second_lo && b1 <= info.second_hi) {
      k = 2;
      while (k < static_cast<size_t>(info.length) && i + k < bytes.size() &&
             (static_cast<uint8_t>(bytes[i + k]) & 0xC0) == 0x80)
        ++k;
    }
  }
  return k;
}

bool all_ascii8(const char* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return (word & 0x8080808080808080ull) == 0;
}

// Whether NFC could change the text around this code point (>= U+0300): it has a canonical
// decomposition, a non-zero combining class, takes part in a canonical composition, or is a
// conjoining Hangul jamo (composed algorithmically, so utf8proc's tables do not flag it).
// Code points below U+0300 never need this: they are all NFC_QC=Yes starters, and anything that
// could combine with them is itself flagged.
bool nfc_sensitive(char32_t cp) {
  if (cp >= 0x1100 && cp <= 0x11FF) return true;
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  return p->combining_class != 0 || p->decomp_seqindex != UINT16_MAX || p->comb_index != UINT16_MAX;
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  size_t i = 0;
  const size_t n = bytes.size();
  while (i < n) {
    if (i + 8 <= n && all_ascii8(bytes.data() + i)) {
      i += 8;
      continue;
    }
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    int length;
    const size_t k = valid_prefix(bytes, i, length);
    if (length == 0 || k != static_cast<size_t>(length)) return false;
    i += k;
  }
  return true;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  out.reserve(out.size() + bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    int length;
    const size_t k = valid_prefix(bytes, i, length);
    if (length != 0 && k == static_cast<size_t>(length)) {
      out.append(bytes.data() + i, k);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += k;
  }
}

char32_t next_code_point(std::string_view text, size_t& i) {
  const auto b0 = static_cast<uint8_t>(text[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  const int length = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = b0 & (0x7F >> length);
  for (int k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[i + k]) & 0x3F);
  i += length;
  return cp;
}

char32_t previous_code_point(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  size_t i = start;
  return next_code_point(text, i);
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool nfc_if_changed(std::string_view text, std::string& out) {
  // Quick check: a lead byte below 0xCC starts a code point below U+0300.
  bool sensitive = false;
  for (size_t i = 0; i < text.size();) {
    if (static_cast<uint8_t>(text[i]) < 0xCC) {
      ++i;
      continue;
    }
    if (nfc_sensitive(next_code_point(text, i))) {
      sensitive = true;
      break;
    }
  }
  if (!sensitive) return false;

  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(mapped, &std::free);
  // The input was validated before normalization, so the only possible failure is memory.
  if (n < 0) throw Error(fmt::format("NFC normalization failed: {}", utf8proc_errmsg(n)));
  out.assign(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
  return true;
}

bool is_white_space(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

size_t complete_utf8_prefix(std::string_view bytes) {
  const size_t n = bytes.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto b = static_cast<unsigned char>(bytes[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: look further back for its lead
    const size_t expected = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 1;
    return back < expected ? n - back : n;
  }
  return n;
}

}  // namespace memtune::tokenizer_detail

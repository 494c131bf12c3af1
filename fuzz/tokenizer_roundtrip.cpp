// The real Qwen2.5 tokenizer on arbitrary bytes: encoding never fails, every id decodes, and for
// valid UTF-8 decode(encode(x)) is x in NFC (the tokenizer's normalizer); a mismatch aborts.
#include <cstdio>
#include <vector>

#include "fuzz_support.h"
#include "tokenizer/unicode.h"

MEMTUNE_FUZZ_LOAD_QWEN_TOKENIZER_FIRST()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const Tokenizer& tokenizer = fuzz::qwen_tokenizer();
  const std::string_view text = fuzz::text_of(data, size);
  const std::vector<int32_t> ids = tokenizer.encode(text);
  const std::string decoded = tokenizer.decode(ids);
  if (!tokenizer_detail::is_valid_utf8(text)) return 0;
  std::string normalized(text);
  std::string nfc;
  if (tokenizer_detail::nfc_if_changed(text, nfc)) normalized = nfc;
  if (decoded != normalized) {
    std::fprintf(stderr, "decode(encode(x)) != NFC(x): %zu bytes in, %zu out\n", normalized.size(), decoded.size());
    std::abort();
  }
  return 0;
}

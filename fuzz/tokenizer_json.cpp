// tokenizer.json (and, after a NUL byte, tokenizer_config.json): a tokenizer that loads must
// encode and decode a fixed text without failing, and every id it produces must decode.
#include <vector>

#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string_view input = fuzz::text_of(data, size);
  const size_t nul = input.find('\0');
  const std::string tokenizer_json(input.substr(0, nul));
  const std::string config_json(nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1));
  fuzz::refusals_are_errors([&] {
    const Tokenizer tokenizer = Tokenizer::from_json(tokenizer_json, config_json, "fuzz");
    const std::vector<int32_t> ids = tokenizer.encode("Hello, world! 123 \xC3\xA9t\xC3\xA9\n<|im_end|>", true);
    for (const int32_t id : ids)
      if (id < 0 || id >= tokenizer.vocab_size()) std::abort();
    tokenizer.decode(ids);
  });
  return 0;
}

// Dataset JSONL in every format, tokenized with the real Qwen2.5 tokenizer. The first byte picks
// the options (format or detection, chat template, truncation, max_length, train_on_prompt,
// skip_bad_lines); the rest is the file. Every example that loads must be consistent.
#include <array>
#include <sstream>

#include "data/dataset.h"
#include "data/formats.h"
#include "fuzz_support.h"

MEMTUNE_FUZZ_LOAD_QWEN_TOKENIZER_FIRST()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  if (size == 0) return 0;
  const Tokenizer& tokenizer = fuzz::qwen_tokenizer();
  static constexpr std::array<const char*, 7> kFormats = {
      "", "messages", "sharegpt", "alpaca", "query_response", "text", "classification"};
  static constexpr std::array<const char*, 4> kTemplates = {"", "qwen2_5", "chatml", "plain"};
  const uint8_t choice = data[0];
  DataOptions options;
  if (const char* format = kFormats[choice % kFormats.size()]; *format) options.format = parse_data_format(format);
  options.chat_template = kTemplates[(choice / 7) % kTemplates.size()];
  options.truncation_strategy = static_cast<TruncationStrategy>((choice / 28) % 3);
  options.max_length = (choice & 0x40) ? 16 : 0;
  options.train_on_prompt = (choice & 0x80) != 0;
  options.skip_bad_lines = (choice & 0x01) != 0;
  options.block_lines = 3;  // several blocks even for small inputs
  std::istringstream in(std::string(fuzz::text_of(data + 1, size - 1)));
  fuzz::refusals_are_errors([&] {
    const Dataset dataset = load_dataset(in, "fuzz.jsonl", tokenizer, options);
    for (size_t i = 0; i < dataset.size(); ++i) {
      const size_t length = dataset.length(i);
      if (length == 0 || (options.max_length > 0 && length > static_cast<size_t>(options.max_length))) std::abort();
    }
  });
  return 0;
}

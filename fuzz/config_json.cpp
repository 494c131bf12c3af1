// config.json of a Qwen2 model: a config that parses must survive the round trip through
// config_to_json unchanged.
#include <nlohmann/json.hpp>

#include "core/json_reader.h"
#include "fuzz_support.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  fuzz::refusals_are_errors([&] {
    const ModelConfig c = parse_model_config(parse_json(fuzz::text_of(data, size), "config.json"), "config.json");
    const ModelConfig back = parse_model_config(config_to_json(c), "round trip");
    if (back.hidden_size != c.hidden_size || back.num_key_value_heads != c.num_key_value_heads ||
        back.vocab_size != c.vocab_size || back.max_position_embeddings != c.max_position_embeddings ||
        back.rope_theta != c.rope_theta || back.torch_dtype != c.torch_dtype)
      std::abort();
    check_max_length(c, c.max_position_embeddings, "config.json");
  });
  return 0;
}

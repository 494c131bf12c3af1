// adapter_config.json of a PEFT LoRA adapter: one that parses must round-trip through
// lora_adapter_config_json.
#include <nlohmann/json.hpp>

#include "core/json_reader.h"
#include "fuzz_support.h"
#include "model/lora.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  fuzz::refusals_are_errors([&] {
    const LoraConfig c =
        parse_lora_adapter_config(parse_json(fuzz::text_of(data, size), "adapter_config.json"), "adapter_config.json");
    const LoraConfig back = parse_lora_adapter_config(lora_adapter_config_json(c, "base"), "round trip");
    if (back.rank != c.rank || back.alpha != c.alpha || back.dropout != c.dropout || back.use_rslora != c.use_rslora ||
        back.targets != c.targets)
      std::abort();
  });
  return 0;
}

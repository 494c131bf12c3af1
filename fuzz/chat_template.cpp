// The chat template: a JSON {"messages": [...]} is validated, rendered with each template and
// encoded with the real Qwen2.5 tokenizer; after the first byte's choices. With the low bit of the
// first byte set, the rest is instead a tokenizer_config chat_template (Jinja) to recognize.
#include <array>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/json_reader.h"
#include "data/formats.h"
#include "fuzz_support.h"
#include "tokenizer/chat_template.h"

MEMTUNE_FUZZ_LOAD_QWEN_TOKENIZER_FIRST()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  if (size == 0) return 0;
  const uint8_t choice = data[0];
  const std::string_view rest = fuzz::text_of(data + 1, size - 1);
  if (choice & 0x01) {
    fuzz::refusals_are_errors([&] { detect_chat_template(rest, "tokenizer_config.json"); });
    return 0;
  }
  static constexpr std::array<ChatTemplate, 3> kTemplates = {ChatTemplate::Qwen2_5, ChatTemplate::ChatML,
                                                             ChatTemplate::Plain};
  const Tokenizer& tokenizer = fuzz::qwen_tokenizer();
  fuzz::refusals_are_errors([&] {
    const nlohmann::json doc = parse_json(rest, "chat.json");
    const std::vector<ChatMessage> messages = parse_messages(JsonReader(doc, "chat.json").get("messages"));
    validate_conversation(messages, (choice & 0x02) != 0);
    RenderOptions render;
    render.add_generation_prompt = (choice & 0x04) != 0;
    render.train_on_prompt = (choice & 0x08) != 0;
    render.eos_token = "<|endoftext|>";
    const std::vector<ChatSegment> segments = render_chat(kTemplates[(choice >> 4) % 3], messages, render);
    std::vector<int32_t> ids, labels;
    encode_segments(tokenizer, segments, ids, labels);
    if (ids.size() != labels.size()) std::abort();
  });
  return 0;
}

// `memtune chat`: one conversation in the terminal. The model is planned once for one sequence
// of max_model_len (default: the model's max_position_embeddings); each answer streams as it is
// generated, and Ctrl-C stops it (the part written so far stays in the history).
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "cli/inference_flags.h"
#include "core/console.h"
#include "core/error.h"
#include "model/load.h"
#include "tokenizer/chat_template.h"

namespace memtune::cli {

namespace {

void chat(const InferenceArgs& a) {
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.flags.model : a.tokenizer);
  const ChatTemplate templ = resolve_chat_template(a.templ, tokenizer, "tokenizer_config.json");
  InferenceArgs one = a;
  one.max_num_seqs = 1;
  const InferenceSetup setup = plan_inference_setup(one, {}, 0);
  const std::optional<DType> dtype = storage_dtype(a.flags.torch_dtype, a.flags.bf16, a.flags.fp16);
  const std::unique_ptr<Decoder> model = load_model(a.flags.model, setup.options, a.flags.adapter, {dtype, a.flags.lm_head_bits});
  const int64_t max_model_len = setup.options.kv_cache.max_model_len;
  Generator generator(*model, &tokenizer);
  std::vector<ChatMessage> history;
  std::cerr << fmt::format(
      "memtune chat: {} ({} KV cache for {} tokens). /reset clears the history, /exit quits, Ctrl-C stops an "
      "answer.\n",
      a.flags.model, format_bytes(model->plan().live_bytes(Phase::Forward, Category::KvCache)), max_model_len);
  std::string line;
  uint64_t turn = 0;
  while (std::cout << "> " << std::flush, std::getline(std::cin, line)) {
    if (line == "/exit") break;
    if (line == "/reset") {
      history.clear();
      turn = 0;  // a conversation's answers depend on its own turns only
      std::cout << "(history cleared)\n";
      continue;
    }
    if (line.empty()) continue;
    history.push_back({.role = "user", .content = line});
    GenerationRequest r{.prompt_ids = chat_prompt_ids(tokenizer, templ, history, a.system, a.enable_thinking),
                        .max_new_tokens = a.max_new_tokens,
                        .sampling = a.sampling,
                        .stop = a.stop,
                        .stop_ids = stop_ids(a, &tokenizer, true)};
    r.sampling.stream = turn++;
    const int64_t room = max_model_len - static_cast<int64_t>(r.prompt_ids.size());
    if (room < 1) {
      history.pop_back();
      std::cout << fmt::format("(the conversation is {} tokens, max_model_len is {}: /reset to start again)\n",
                               r.prompt_ids.size(), max_model_len);
      continue;
    }
    r.max_new_tokens = std::min(r.max_new_tokens, room);
    const InterruptRequests interrupts;
    const GenerationResult out = generator.generate(
        {r}, [](size_t, std::string_view piece) { std::cout << piece << std::flush; },
        [&] { return interrupts.requested(); })[0];
    std::cout << (out.finish_reason == "abort" ? " (stopped)\n" : "\n");
    history.push_back({.role = "assistant", .content = out.text});
  }
}

}  // namespace

Action add_chat(CLI::App& app) {
  return inference_action(app, InferenceCommand::Chat, chat);
}

}  // namespace memtune::cli

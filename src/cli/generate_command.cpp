// `memtune generate`: text from a model (optionally with LoRA adapters, applied unmerged) for one
// prompt or a JSONL file of prompts, over a KV cache whose size the plan fixes before the first
// token (model/kv_cache.h), scheduled by the generation engine (generate/generator.h).
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "backend/products.h"
#include "cli/commands.h"
#include "cli/inference_flags.h"
#include "core/console.h"
#include "core/error.h"
#include "memory/memory_files.h"
#include "memory/process_memory.h"
#include "model/load.h"
#include "tokenizer/chat_template.h"
#include "options/command_setup.h"

namespace memtune::cli {

namespace {

void generate(const InferenceArgs& a) {
  const size_t startup_rss = startup_rss_bytes(a.flags.backend);
  const std::optional<DType> dtype = storage_dtype(a.flags.torch_dtype, a.flags.bf16, a.flags.fp16);
  const std::optional<Tokenizer> tokenizer = load_tokenizer(a);
  const std::vector<GenerationRequest> requests = read_requests(a, tokenizer ? &*tokenizer : nullptr);
  const InferenceSetup setup = plan_inference_setup(a, requests, startup_rss);
  const ProcessPlan& process = setup.process;
  const std::unique_ptr<Decoder> model = load_model(a.flags.model, setup.options, a.flags.adapter, {dtype, a.flags.lm_head_bits});
  for (size_t k = 0; k < a.named_adapters.size(); ++k)
    model->parameters().load_adapter_set(k, a.named_adapters[k].second);
  if (a.merge_adapter) {
    if (a.flags.adapter.empty()) throw Error("--merge_adapter needs --adapter");
    model->parameters().merge_lora();
  }
  Generator generator(*model, tokenizer ? &*tokenizer : nullptr);
  const bool stream = !a.prompt.empty() && !a.json;
  const std::vector<GenerationResult> results = generator.generate(requests, [&](size_t, std::string_view piece) {
    if (!stream) return;
    std::cout << piece << std::flush;
  });
  if (stream) std::cout << "\n";

  model->arena().sample();
  const GenerationStats& st = generator.stats();
  const KvCacheOptions& kv = model->options().kv_cache;
  nlohmann::json summary = {{"requests", results.size()},
                            {"prefill_tokens", st.prefill_tokens},
                            {"decode_tokens", st.decode_tokens},
                            {"prefill_tokens_per_second", st.prefill_tokens_per_second()},
                            {"decode_tokens_per_second", st.decode_tokens_per_second()},
                            {"max_model_len", kv.max_model_len},
                            {"max_num_seqs", kv.max_seqs},
                            {"kv_cache_blocks", kv.blocks},
                            {"kv_cache_tokens", kv.blocks * kv.block_size},
                            {"arena_bytes", model->plan().peak_bytes()},
                            {"process_predicted_peak_bytes", process.peak_bytes()},
                            {"process_peak_rss_bytes", process_peak_rss_bytes(model->arena())},
                            {"device_work", generator.device_work_json()},
                            {"products", products_json()}};
  std::string lines;
  for (size_t i = 0; i < results.size(); ++i) {
    const GenerationResult& r = results[i];
    lines += nlohmann::json{{"index", i},
                            {"text", r.text},
                            {"token_ids", r.token_ids},
                            {"finish_reason", r.finish_reason},
                            {"prompt_tokens", r.prompt_tokens},
                            {"completion_tokens", r.token_ids.size()}}
                 .dump() +
             "\n";
  }
  if (!a.output.empty()) write_file_atomically(a.output, lines);
  if (a.json) {
    if (a.output.empty()) std::cout << lines;
    std::cout << summary.dump() << "\n";
    return;
  }
  if (a.prompt.empty() && a.output.empty()) std::cout << lines;
  std::cerr << fmt::format(
      "{} requests: prefill {} tokens at {:.1f} tokens/s, decode {} tokens at {:.1f} tokens/s; KV cache {} blocks "
      "of {} tokens; arena {} (planned), process peak {} (measured, {} predicted)\n",
      results.size(), st.prefill_tokens, st.prefill_tokens_per_second(), st.decode_tokens,
      st.decode_tokens_per_second(), kv.blocks, kv.block_size, format_bytes(model->plan().peak_bytes()),
      format_bytes(process_peak_rss_bytes(model->arena())), format_bytes(process.peak_bytes()));
}

}  // namespace

Action add_generate(CLI::App& app) {
  return inference_action(app, InferenceCommand::Generate, generate);
}

}  // namespace memtune::cli

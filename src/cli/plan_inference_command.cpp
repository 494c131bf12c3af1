// `memtune plan --inference`: the bill of a generate command line before it runs.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/inference_flags.h"
#include "core/console.h"
#include "core/error.h"
#include "memory/memory_files.h"
#include "memory/process_memory.h"
#include "model/decoder.h"
#include "model/load.h"
#include "model/lora.h"
#include "tokenizer/chat_template.h"
#include "options/command_setup.h"

namespace memtune::cli {

namespace {

void plan_inference(const InferenceArgs& a) {
  const size_t startup_rss = startup_rss_bytes(a.flags.backend);
  std::vector<GenerationRequest> requests;
  if (!a.prompt.empty() || !a.input.empty()) {
    const std::optional<Tokenizer> tokenizer = load_tokenizer(a);
    requests = read_requests(a, tokenizer ? &*tokenizer : nullptr);
  }
  InferenceSetup s = plan_inference_setup(a, requests, requests.empty() ? 0 : startup_rss);
  if (requests.empty()) s.process.startup_bytes = startup_rss;
  ModelOptions planned = s.options;
  planned.allocate = false;
  if (!a.flags.adapter.empty()) planned.lora = load_lora_adapter_config(a.flags.adapter);
  const Decoder model(s.model.config, planned);
  const MemoryPlan& plan = model.plan();
  const KvCacheOptions& kv = s.options.kv_cache;
  const size_t per_token = kv_bytes_per_token(s.model.config);
  const int64_t cache_tokens = kv.blocks * kv.block_size;
  const int64_t fit = kv.blocks / kv.max_blocks_per_seq;
  nlohmann::json out = plan_to_json(plan);
  out["arena_bytes"] = plan.peak_bytes();
  out["max_model_len"] = kv.max_model_len;
  out["max_num_seqs"] = kv.max_seqs;
  out["max_num_batched_tokens"] = s.options.max_tokens;
  out["block_size"] = kv.block_size;
  out["kv_cache_blocks"] = kv.blocks;
  out["kv_cache_tokens"] = cache_tokens;
  out["kv_bytes_per_token"] = per_token;
  out["kv_cache_bytes"] = plan.live_bytes(Phase::Forward, Category::KvCache);
  out["sequences_of_max_model_len"] = fit;
  out["process_plan"] = s.process.to_json();
  out["process_predicted_peak_bytes"] = s.process.peak_bytes();
  if (a.json) {
    std::cout << out.dump() << "\n";
    return;
  }
  std::cout << inference_plan_text(s, plan) << "\n";
}

}  // namespace

Action add_plan_inference(CLI::App& app) {
  return inference_action(app, InferenceCommand::Plan, plan_inference);
}

}  // namespace memtune::cli

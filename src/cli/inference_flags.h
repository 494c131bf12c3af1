// The flags of the commands that run an inference model (generate, chat, serve and
// `plan --inference`), and what they share: the requests of --prompt / --input, the stop ids,
// the model's plan for the flags' limits and its printed form.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "generate/generator.h"
#include "memory/plan.h"
#include "options/command_setup.h"
#include "tokenizer/tokenizer.h"

namespace memtune::cli {

enum class InferenceCommand { Generate, Plan, Chat, Serve };

struct InferenceArgs {
  // --model (or --preset, --quantization with plan --inference), --adapter (the named ones in
  // adapter_sets), --backend, --torch_dtype, --bf16, --fp16, --host_memory, --quantized_activations,
  // --lm_head_bits
  ModelFlags flags;
  std::string tokenizer, prompt, input, output, system, templ;
  std::string device_memory;
  bool chat = false, json = false, ignore_eos = false, inference = false;
  bool merge_adapter = false;
  bool skip_tokenizer_init = false;   // generate, serve: token ids in and out, no tokenizer files read
  bool enable_thinking = true;        // Qwen3's template: false writes an empty think block into the prompt
  std::vector<std::string> adapters;  // --adapter values as given
  std::vector<std::pair<std::string, std::string>> named_adapters;  // --adapter NAME=DIR, in order
  // serve: tokens of a step that decodes (unset: the backend's Backend::stored_weight_rows)
  std::optional<int64_t> max_decode_step_tokens;
  int64_t max_new_tokens = 256, max_model_len = 0, max_num_seqs = 8, max_num_batched_tokens = 512, block_size = 16;
  double memory_fraction = 0.9;
  SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  // serve
  std::string host = "127.0.0.1", api_key, served_model_name;
  int port = 8000;
  int64_t max_queue = 256;
  double shutdown_timeout = 30;
};

// Registers the flags `command` takes on `app`, and their checks once parsed.
void add_inference_flags(CLI::App& app, InferenceArgs& a, InferenceCommand command);

// Registers the flags of `command` and returns the action that runs `run` on them once parsed.
std::function<void()> inference_action(CLI::App& app, InferenceCommand command, void (*run)(const InferenceArgs&));

// The tokenizer of --tokenizer (default: the model directory); none with --skip_tokenizer_init.
std::optional<Tokenizer> load_tokenizer(const InferenceArgs& a);

// The stop ids of a request: --stop_token_ids and, unless --ignore_eos, the model's.
std::vector<int32_t> stop_ids(const InferenceArgs& a, const Tokenizer* tokenizer, bool chat);

// The requests of --prompt or --input, each with its prompt ids. Without a tokenizer only
// "prompt_ids" lines are taken (anything else is an Error naming the line).
std::vector<GenerationRequest> read_requests(const InferenceArgs& a, const Tokenizer* tokenizer);

// What generation will hold: the model's options for the limits (max_model_len: the flag, else
// the longest request, else the model's max_position_embeddings) and the whole process around it.
InferenceSetup plan_inference_setup(const InferenceArgs& a, const std::vector<GenerationRequest>& requests,
                                    size_t startup_rss);

// The plan of an inference model as `plan --inference` and `serve` print it: the limits, the KV
// cache ("S sequences of L tokens fit"), the table per category and the process prediction.
std::string inference_plan_text(const InferenceSetup& s, const MemoryPlan& plan);

}  // namespace memtune::cli

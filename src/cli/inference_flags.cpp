// The inference commands' flags and what they share (see inference_flags.h).
#include "cli/inference_flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"
#include "data/formats.h"
#include "memory/memory_files.h"
#include "options/arguments.h"
#include "tokenizer/chat_template.h"
#include "model/config.h"

namespace memtune::cli {

std::optional<Tokenizer> load_tokenizer(const InferenceArgs& a) {
  if (a.skip_tokenizer_init) return std::nullopt;
  return Tokenizer::load(a.tokenizer.empty() ? a.flags.model : a.tokenizer);
}

std::vector<int32_t> stop_ids(const InferenceArgs& a, const Tokenizer* tokenizer, bool chat) {
  std::set<int32_t> ids(a.stop_token_ids.begin(), a.stop_token_ids.end());
  if (!a.ignore_eos)
    for (const int32_t id : model_stop_ids(a.flags.model, tokenizer, chat)) ids.insert(id);
  return {ids.begin(), ids.end()};
}

std::vector<GenerationRequest> read_requests(const InferenceArgs& a, const Tokenizer* tokenizer) {
  auto text = [&]() -> const Tokenizer& {
    if (!tokenizer)
      throw Error("with --skip_tokenizer_init there is no tokenizer: give \"prompt_ids\" lines (token ids)");
    return *tokenizer;
  };
  std::optional<ChatTemplate> templ;
  auto chat_template = [&] {
    if (!templ) templ = resolve_chat_template(a.templ, text(), "tokenizer_config.json");
    return *templ;
  };
  std::vector<GenerationRequest> requests;
  auto add_request = [&](std::vector<int32_t> ids, bool chat) {
    GenerationRequest r{.prompt_ids = std::move(ids),
                        .max_new_tokens = a.max_new_tokens,
                        .sampling = a.sampling,
                        .stop = a.stop,
                        .stop_ids = stop_ids(a, tokenizer, chat)};
    r.sampling.stream = requests.size();
    requests.push_back(std::move(r));
  };
  auto text_prompt = [&](const std::string& prompt) {
    if (a.chat)
      add_request(
          chat_prompt_ids(text(), chat_template(), {{.role = "user", .content = prompt}}, a.system, a.enable_thinking),
          true);
    else
      add_request(text().encode(prompt), false);
  };
  if (!a.prompt.empty()) {
    text_prompt(a.prompt);
    return requests;
  }
  JsonlReader reader(a.input);
  JsonlLine line;
  while (reader.next_line(line)) {
    std::string error;
    const std::optional<nlohmann::json> doc = parse_json_line(line.text, error);
    if (!doc) reader.bad_line(line.number, error);
    const JsonReader r(*doc, "");
    try {
      int32_t adapter = -1;
      if (const auto name = r.find("adapter")) {
        const std::string wanted = name->as_string();
        for (size_t k = 0; k < a.named_adapters.size(); ++k)
          if (a.named_adapters[k].first == wanted) adapter = static_cast<int32_t>(k);
        if (adapter < 0) throw Error(fmt::format("adapter \"{}\" is not one of the --adapter NAME=DIR given", wanted));
      }
      const size_t before = requests.size();
      if (const auto ids = r.find("prompt_ids")) {
        std::vector<int32_t> v;
        for (size_t i = 0; i < ids->as_array().size(); ++i)
          v.push_back(static_cast<int32_t>((*ids)[i].as_integer(0, INT32_MAX)));
        add_request(std::move(v), false);
      } else if (const auto messages = r.find("messages")) {
        add_request(chat_prompt_ids(text(), chat_template(), parse_messages(*messages), a.system, a.enable_thinking),
                    true);
      } else if (r.has("prompt")) {
        text_prompt(r.string("prompt"));
      } else {
        throw Error("expected a \"prompt\", \"messages\" or \"prompt_ids\" field");
      }
      if (requests.size() > before) requests.back().adapter = adapter;
    } catch (const Error& e) {
      reader.bad_line(line.number, e.what());
    }
  }
  if (requests.empty()) throw Error(fmt::format("--input {}: no requests", a.input));
  return requests;
}

InferenceSetup plan_inference_setup(const InferenceArgs& a, const std::vector<GenerationRequest>& requests,
                                    size_t startup_rss) {
  int64_t longest = 0;
  for (const auto& r : requests)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(r.prompt_ids.size()) + r.max_new_tokens);
  InferenceLimits limits{.max_model_len = a.max_model_len > 0 ? a.max_model_len : longest,
                         .max_num_seqs = a.max_num_seqs,
                         .max_num_batched_tokens = a.max_num_batched_tokens,
                         .block_size = a.block_size,
                         .device_memory = a.device_memory.empty() ? 0 : device_memory_bytes(a.device_memory, a.flags.backend),
                         .memory_fraction = a.memory_fraction};
  if (!requests.empty()) {  // no more sequences than requests
    limits.max_num_seqs = std::min<int64_t>(limits.max_num_seqs, static_cast<int64_t>(requests.size()));
    limits.max_num_batched_tokens = std::max(limits.max_num_batched_tokens, limits.max_num_seqs);
  }
  return inference_setup(a.flags, limits, startup_rss);
}

std::string inference_plan_text(const InferenceSetup& s, const MemoryPlan& plan) {
  const KvCacheOptions& kv = s.options.kv_cache;
  const int64_t fit = kv.blocks / kv.max_blocks_per_seq;
  return fmt::format(
      "inference plan ({}): max_model_len {}, max_num_seqs {}, max_num_batched_tokens {}, blocks of {} tokens\n"
      "KV cache: {} per token; {} blocks = {} tokens = {}: {} sequences of {} tokens fit{}\n\n{}\n{}",
      std::string(dtype_torch_name(s.model.config.torch_dtype)) +
          (s.model.config.quant.enabled() ? ", linear layers " + quantization_name(s.model.config.quant)
                                          : std::string()),
      kv.max_model_len, kv.max_seqs, s.options.max_tokens, kv.block_size,
      format_bytes(kv_bytes_per_token(s.model.config)), kv.blocks, kv.blocks * kv.block_size,
      format_bytes(plan.live_bytes(Phase::Forward, Category::KvCache)), fit, kv.max_model_len,
      fit < kv.max_seqs ? fmt::format(" (fewer than --max_num_seqs {}: the others wait)", kv.max_seqs) : "",
      plan.summary(nullptr, Phase::Loss), s.process.summary());
}

namespace {

// The model: its directory (or plan --inference's preset and quantization), its adapters, the
// tokenizer, the backend and how quantized products take their input.
void add_model_flags(CLI::App& app, InferenceArgs& args, InferenceCommand command) {
  const bool plan_only = command == InferenceCommand::Plan, serving = command == InferenceCommand::Serve;
  InferenceArgs* a = &args;
  auto* model = app.add_option(serving ? "model,--model_name_or_path,--model" : "--model_name_or_path,--model",
                               a->flags.model, "Hugging Face model directory");
  if (plan_only) {
    app.add_flag("--inference", a->inference, "plan generation (memtune generate's flags)");
    app.add_option("--preset", a->flags.preset, model_preset_names() + " (instead of --model)")->excludes(model);
    app.add_option("--quantization", a->flags.quantization,
                   "plan the model's linear layers quantized: gptq-int4 | gptq-int8 | awq (group 128)");
  } else {
    model->required();
  }
  if (serving) {
    app.add_option("--lora_modules,--lora-modules", a->adapters,
                   "LoRA adapters NAME=DIR (repeatable, or several after one flag): a request's \"model\": NAME "
                   "selects one, applied without merging; requests with different adapters share a step");
    app.add_option("--served_model_name,--served-model-name", a->served_model_name,
                   "the base model's name in requests and /v1/models (default: the model path as given)");
    app.add_option("--host", a->host, "address to listen on")->capture_default_str();
    app.add_option("--port", a->port, "port to listen on (0: any free port, printed)")->capture_default_str();
    app.add_option("--api_key,--api-key", a->api_key, "require Authorization: Bearer KEY on /v1 routes");
    app.add_option("--max_queue", a->max_queue, "requests waiting beyond this get 429 with Retry-After")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--max_decode_step_tokens", a->max_decode_step_tokens,
                   "tokens a step that decodes holds at most, prompt chunks filling what the decoding streams "
                   "leave (at least 4; 0: up to max_num_batched_tokens): keeps inter-token latency near a decode "
                   "step's while prompts are read, at some cost in throughput and time to first token; default: "
                   "the most rows the backend reads 16-bit weights as stored for, 16 on cpu)")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--shutdown_timeout", a->shutdown_timeout,
                   "seconds in-flight requests may take to finish after SIGTERM / Ctrl-C before they are cancelled")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
  } else {
    app.add_option("--adapter", a->adapters,
                   "PEFT LoRA adapter directory, applied without merging; or NAME=DIR, repeated: several adapters "
                   "held at once, an input line's \"adapter\": NAME picks one");
    app.add_flag("--merge_adapter", a->merge_adapter,
                 "merge the adapter into the weights at load (faster: no adapter path in each step)");
  }
  app.add_option("--tokenizer", a->tokenizer, "tokenizer directory (default: the model directory)");
  if (command == InferenceCommand::Generate || command == InferenceCommand::Serve)
    app.add_flag("--skip_tokenizer_init", a->skip_tokenizer_init,
                 serving ? "serve token ids only, without tokenizer files: /v1/completions with a prompt of token "
                           "ids; answers carry token_ids (text is empty); chat and text prompts are refused"
                         : "generate from \"prompt_ids\" lines without tokenizer files: results carry token_ids "
                           "(text is empty)");
  add_backend_option(app, a->flags.backend);
  add_quantized_model_options(app, a->flags.quantized_activations, a->flags.lm_head_bits);
  add_template_option(app, a->templ);
  if (!serving)
    app.add_option("--enable_thinking", a->enable_thinking,
                   "Qwen3's chat template: false starts the reply after an empty think block (no reasoning)")
        ->capture_default_str();
}

// What to generate and how to choose tokens (generate, chat, plan --inference; serve takes
// these per request).
void add_request_flags(CLI::App& app, InferenceArgs& args) {
  InferenceArgs* a = &args;
  app.add_option("--prompt", a->prompt, "one prompt; its text is streamed to stdout");
  app.add_option("--input", a->input,
                 "JSONL, one request per line: {\"prompt\": TEXT} | {\"messages\": [...]} | {\"prompt_ids\": [...]}");
  app.add_option("--output", a->output, "write the results here as JSONL, in input order (default: stdout)");
  app.add_flag("--chat", a->chat, "render --prompt and \"prompt\" lines as a user message with the chat template");
  app.add_option("--system", a->system, "system message for chat prompts without one");
  app.add_option("--max_new_tokens", a->max_new_tokens, "the most tokens generated per request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  SamplingParams& s = a->sampling;
  app.add_option("--temperature", s.temperature, "0: greedy")->capture_default_str();
  app.add_option("--top_k", s.top_k, "keep the k most likely tokens (0 or -1: all)")->capture_default_str();
  app.add_option("--top_p", s.top_p, "keep the smallest set reaching this probability")->capture_default_str();
  app.add_option("--min_p", s.min_p, "keep tokens at least min_p times as likely as the best")->capture_default_str();
  app.add_option("--repetition_penalty", s.repetition_penalty, "> 1 discourages prompt and output tokens")
      ->capture_default_str();
  app.add_option("--presence_penalty", s.presence_penalty)->capture_default_str();
  app.add_option("--frequency_penalty", s.frequency_penalty)->capture_default_str();
  app.add_option("--seed", s.seed, "random seed; request i of the input draws from stream i")->capture_default_str();
  app.add_option("--stop", a->stop, "a stop string (repeatable): the reply ends before it");
  app.add_option("--stop_token_ids", a->stop_token_ids, "more stop token ids")->delimiter(',');
  app.add_flag("--ignore_eos", a->ignore_eos, "do not stop at eos / <|im_end|>: always max_new_tokens");
}

// The KV cache's and a step's limits, the memory the plan may use, and the weights' storage.
void add_limit_flags(CLI::App& app, InferenceArgs& args, InferenceCommand command) {
  const bool serving = command == InferenceCommand::Serve;
  InferenceArgs* a = &args;
  app.add_option("--max_model_len,--max-model-len", a->max_model_len,
                 serving ? "the most tokens (prompt + output) of one sequence (default: max_position_embeddings)"
                         : "the most tokens (prompt + output) of one sequence (default: the longest request)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max_num_seqs,--max-num-seqs", a->max_num_seqs, "sequences decoded together")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max_num_batched_tokens,--max-num-batched-tokens", a->max_num_batched_tokens,
                 "tokens one step computes: prompts are prefilled in chunks of at most this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--block_size,--block-size", a->block_size, "tokens per KV cache block")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--device_memory", a->device_memory,
                 "size the KV cache from this budget (e.g. 24GiB, or auto: the device's budget or heap): what is left "
                 "after weights and workspace");
  app.add_option("--memory_fraction,--gpu_memory_utilization,--gpu-memory-utilization", a->memory_fraction,
                 "the share of --device_memory the plan may use")
      ->capture_default_str();
  // Each dtype's arithmetic, as inference_model_options (options/inference_options.h) sets it.
  app.add_option("--torch_dtype,--dtype", a->flags.torch_dtype,
                 "storage dtype of the weights: float32 | bfloat16 | float16 (default: the checkpoint's). An "
                 "unquantized bfloat16 model's steps of more than 16 rows (prompts, long serving steps) take bfloat16 "
                 "operands with float32 accumulation where the backend has bfloat16 products (cpu: oneDNN's "
                 "AVX512-BF16 or AMX kernels; reference), and decoding's few rows keep float32 inputs against the "
                 "weights as stored; float16 and float32 models compute in float32");
  app.add_flag("--bf16", a->flags.bf16, "the same as --torch_dtype bfloat16");
  app.add_flag("--fp16", a->flags.fp16, "the same as --torch_dtype float16");
  app.add_option("--host_memory", a->flags.host_memory,
                 "budget for the whole process (e.g. 16GiB): refuse to start when the prediction is above it");
}

// The checks of the flags together, once parsed; named adapters go to the model's adapter sets.
void check_inference_flags(InferenceArgs& a, InferenceCommand command) {
  const bool plan_only = command == InferenceCommand::Plan;
  for (const std::string& value : a.adapters) {
    const size_t eq = value.find('=');
    if (eq != std::string::npos && eq > 0 && value.find('/') > eq) {
      a.named_adapters.emplace_back(value.substr(0, eq), value.substr(eq + 1));
      a.flags.adapter_sets.push_back(value.substr(eq + 1));
    } else if (a.flags.adapter.empty()) {
      a.flags.adapter = value;
    } else {
      throw Error("--adapter: several adapters need names: --adapter NAME=DIR for each");
    }
  }
  if (!a.flags.adapter.empty() && !a.named_adapters.empty())
    throw Error("--adapter: give one adapter DIR, or NAME=DIR for each of several, not both");
  if (a.merge_adapter && !a.named_adapters.empty())
    throw Error("--merge_adapter merges one adapter: it cannot be combined with named adapters");
  if (a.skip_tokenizer_init && !a.stop.empty())
    throw Error("--stop: stop strings are matched in text, which --skip_tokenizer_init does not make (use "
                "--stop_token_ids)");
  if (command == InferenceCommand::Chat) {
    if (!a.prompt.empty() || !a.input.empty()) throw Error("chat reads its prompts from the terminal");
    return;
  }
  if (command == InferenceCommand::Serve) {
    if (!a.flags.adapter.empty()) throw Error("--lora_modules: give each adapter a name, NAME=DIR");
    for (const auto& [name, dir] : a.named_adapters)
      if (name == (a.served_model_name.empty() ? a.flags.model : a.served_model_name))
        throw Error(fmt::format("--lora_modules {}: the name is the base model's", name));
    if (a.port < 0 || a.port > 65535) throw Error(fmt::format("--port {}: expected 0 to 65535", a.port));
    return;
  }
  if (!plan_only && a.prompt.empty() == a.input.empty())
    throw Error("give one of --prompt TEXT and --input FILE.jsonl");
  if (!a.prompt.empty() && !a.input.empty())
    throw Error("give one of --prompt TEXT and --input FILE.jsonl, not both");
  if (plan_only && a.flags.model.empty() == a.flags.preset.empty())
    throw Error("plan needs exactly one of --model or --preset");
  check_local_dataset(a.input, "--input");
}

}  // namespace

void add_inference_flags(CLI::App& app, InferenceArgs& args, InferenceCommand command) {
  const bool serving = command == InferenceCommand::Serve;
  add_model_flags(app, args, command);
  if (!serving) add_request_flags(app, args);
  add_limit_flags(app, args, command);
  if (!serving) app.add_flag("--json", args.json, "print the results and the summary as JSON");
  app.parse_complete_callback([a = &args, command] { check_inference_flags(*a, command); });
}

std::function<void()> inference_action(CLI::App& app, InferenceCommand command, void (*run)(const InferenceArgs&)) {
  auto a = std::make_shared<InferenceArgs>();
  add_inference_flags(app, *a, command);
  return [a, run] { run(*a); };
}

}  // namespace memtune::cli

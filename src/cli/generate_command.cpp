// `memtune generate`: text from a model (optionally with LoRA adapters, applied unmerged) for one
// prompt or a JSONL file of prompts, over a KV cache whose size the plan fixes before the first
// token (generate/inference_plan.h), scheduled by the generation engine (generate/generator.h).
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"
#include "data/formats.h"
#include "generate/generator.h"
#include "generate/inference_plan.h"
#include "io/safetensors.h"
#include "memory/memory_files.h"
#include "memory/process_memory.h"
#include "memory/process_plan.h"
#include "model/load.h"
#include "model/lora.h"
#include "serve/server.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "train/arguments.h"
#include "train/console.h"
#include "train/run.h"

namespace memtune::cli {

namespace {

struct GenerateArgs {
  std::string model, adapter, tokenizer, prompt, input, output, system, templ, backend = "cpu", torch_dtype;
  std::string device_memory, host_memory, preset, quantization;
  bool chat = false, json = false, ignore_eos = false, bf16 = false, fp16 = false, inference = false;
  bool merge_adapter = false;
  bool enable_thinking = true;        // Qwen3's template: false writes an empty think block into the prompt
  std::vector<std::string> adapters;  // --adapter values as given
  std::vector<std::pair<std::string, std::string>> named_adapters;  // --adapter NAME=DIR, in order
  int64_t max_decode_step_tokens = kSixteenBitWeightRows;  // serve: tokens of a step that decodes
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

std::vector<int32_t> stop_ids(const GenerateArgs& a, const Tokenizer& tokenizer, bool chat) {
  std::set<int32_t> ids(a.stop_token_ids.begin(), a.stop_token_ids.end());
  if (!a.ignore_eos)
    for (const int32_t id : model_stop_ids(a.model, tokenizer, chat)) ids.insert(id);
  return {ids.begin(), ids.end()};
}

// The requests of --prompt or --input, each with its prompt ids.
std::vector<GenerationRequest> read_requests(const GenerateArgs& a, const Tokenizer& tokenizer) {
  std::optional<ChatTemplate> templ;
  auto chat_template = [&] {
    if (!templ) templ = resolve_chat_template(a.templ, tokenizer, "tokenizer_config.json");
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
  auto text_prompt = [&](const std::string& text) {
    if (a.chat)
      add_request(
          chat_prompt_ids(tokenizer, chat_template(), {{.role = "user", .content = text}}, a.system, a.enable_thinking),
          true);
    else
      add_request(tokenizer.encode(text), false);
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
        add_request(chat_prompt_ids(tokenizer, chat_template(), parse_messages(*messages), a.system, a.enable_thinking),
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

// What generation will hold: the model's options for the limits (max_model_len: the flag, else
// the longest request, else the model's max_position_embeddings) and the whole process around it.
struct InferenceSetup {
  Qwen2Config config;
  ModelOptions options;
  ProcessPlan process;
};
InferenceSetup plan_setup(const GenerateArgs& a, const std::vector<GenerationRequest>& requests, size_t startup_rss) {
  const std::optional<DType> dtype = storage_dtype(a.torch_dtype, a.bf16, a.fp16);
  InferenceSetup s;
  s.config = a.preset.empty() ? load_model_config(a.model) : qwen2_preset(a.preset);
  const DType checkpoint_dtype = s.config.torch_dtype;
  if (dtype) s.config.torch_dtype = *dtype;
  if (!a.quantization.empty()) apply_quantization(s.config, a.quantization);
  int64_t longest = 0;
  for (const auto& r : requests)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(r.prompt_ids.size()) + r.max_new_tokens);
  InferenceLimits limits{.max_model_len = a.max_model_len > 0 ? a.max_model_len
                                          : longest > 0       ? longest
                                                              : s.config.max_position_embeddings,
                         .max_num_seqs = a.max_num_seqs,
                         .max_num_batched_tokens = a.max_num_batched_tokens,
                         .block_size = a.block_size,
                         .device_memory = a.device_memory.empty() ? 0 : parse_bytes(a.device_memory, "--device_memory"),
                         .memory_fraction = a.memory_fraction};
  if (!requests.empty()) {  // no more sequences than requests
    limits.max_num_seqs = std::min<int64_t>(limits.max_num_seqs, static_cast<int64_t>(requests.size()));
    limits.max_num_batched_tokens = std::max(limits.max_num_batched_tokens, limits.max_num_seqs);
  }
  s.options = inference_model_options(s.config, limits, &backend_named(a.backend));
  for (const auto& [name, dir] : a.named_adapters) s.options.adapter_sets.push_back(load_lora_adapter_config(dir));
  if (startup_rss > 0) s.process.measure_preparation(startup_rss);
  ModelOptions planned = s.options;
  planned.allocate = false;
  if (!a.adapter.empty()) planned.lora = load_lora_adapter_config(a.adapter);
  add_planned_terms(s.process, Qwen2Model(s.config, planned), checkpoint_dtype, 1);
  if (!a.host_memory.empty())
    check_host_budget(s.process, parse_bytes(a.host_memory, "--host_memory"), "--host_memory");
  return s;
}

// The plan of an inference model as `plan --inference` and `serve` print it: the limits, the KV
// cache ("S sequences of L tokens fit"), the table per category and the process prediction.
std::string inference_plan_text(const InferenceSetup& s, const MemoryPlan& plan) {
  const KvCacheOptions& kv = s.options.kv_cache;
  const int64_t fit = kv.blocks / kv.max_blocks_per_seq;
  return fmt::format(
      "inference plan ({}): max_model_len {}, max_num_seqs {}, max_num_batched_tokens {}, blocks of {} tokens\n"
      "KV cache: {} per token; {} blocks = {} tokens = {}: {} sequences of {} tokens fit{}\n\n{}\n{}",
      std::string(dtype_torch_name(s.config.torch_dtype)) +
          (s.config.quant.enabled() ? ", linear layers " + quantization_name(s.config.quant) : std::string()),
      kv.max_model_len, kv.max_seqs, s.options.max_tokens, kv.block_size,
      format_bytes(kv_bytes_per_token(s.config)), kv.blocks, kv.blocks * kv.block_size,
      format_bytes(plan.live_bytes(Phase::Forward, Category::KvCache)), fit, kv.max_model_len,
      fit < kv.max_seqs ? fmt::format(" (fewer than --max_num_seqs {}: the others wait)", kv.max_seqs) : "",
      plan.summary(nullptr, Phase::Loss), s.process.summary());
}

// `memtune plan --inference`: the bill of a generate command line before it runs.
void plan_inference(const GenerateArgs& a) {
  const size_t startup_rss = current_rss_bytes();
  std::vector<GenerationRequest> requests;
  if (!a.prompt.empty() || !a.input.empty()) {
    const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.model : a.tokenizer);
    requests = read_requests(a, tokenizer);
  }
  InferenceSetup s = plan_setup(a, requests, requests.empty() ? 0 : startup_rss);
  if (requests.empty()) s.process.startup_bytes = startup_rss;
  ModelOptions planned = s.options;
  planned.allocate = false;
  if (!a.adapter.empty()) planned.lora = load_lora_adapter_config(a.adapter);
  const Qwen2Model model(s.config, planned);
  const MemoryPlan& plan = model.plan();
  const KvCacheOptions& kv = s.options.kv_cache;
  const size_t per_token = kv_bytes_per_token(s.config);
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

// `memtune chat`: one conversation in the terminal. The model is planned once for one sequence
// of max_model_len (default: the model's max_position_embeddings); each answer streams as it is
// generated, and Ctrl-C stops it (the part written so far stays in the history).
void chat(const GenerateArgs& a) {
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.model : a.tokenizer);
  const ChatTemplate templ = resolve_chat_template(a.templ, tokenizer, "tokenizer_config.json");
  GenerateArgs one = a;
  one.max_num_seqs = 1;
  const InferenceSetup setup = plan_setup(one, {}, 0);
  const std::optional<DType> dtype = storage_dtype(a.torch_dtype, a.bf16, a.fp16);
  const std::unique_ptr<Qwen2Model> model = load_model(a.model, setup.options, a.adapter, dtype);
  const int64_t max_model_len = setup.options.kv_cache.max_model_len;
  Generator generator(*model, &tokenizer);
  std::vector<ChatMessage> history;
  std::cerr << fmt::format(
      "memtune chat: {} ({} KV cache for {} tokens). /reset clears the history, /exit quits, Ctrl-C stops an "
      "answer.\n",
      a.model, format_bytes(model->plan().live_bytes(Phase::Forward, Category::KvCache)), max_model_len);
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
                        .stop_ids = stop_ids(a, tokenizer, true)};
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

// `memtune serve`: the plan of the flags, then the OpenAI-compatible server until SIGTERM or Ctrl-C.
void serve(const GenerateArgs& a) {
  const size_t startup_rss = current_rss_bytes();
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.model : a.tokenizer);
  const ChatTemplate templ = resolve_chat_template(a.templ, tokenizer, "tokenizer_config.json");
  const InferenceSetup setup = plan_setup(a, {}, startup_rss);
  const std::optional<DType> dtype = storage_dtype(a.torch_dtype, a.bf16, a.fp16);
  const std::unique_ptr<Qwen2Model> model = load_model(a.model, setup.options, "", dtype);
  for (size_t k = 0; k < a.named_adapters.size(); ++k)
    model->parameters().load_adapter_set(k, a.named_adapters[k].second);
  std::cout << inference_plan_text(setup, model->plan()) << std::flush;
  GenerationEngine engine(*model, &tokenizer);
  engine.set_max_decode_step_tokens(a.max_decode_step_tokens);
  ServeOptions o;
  o.host = a.host;
  o.port = a.port;
  o.api_key = a.api_key;
  o.model_name = a.served_model_name.empty() ? a.model : a.served_model_name;
  for (const auto& [name, dir] : a.named_adapters) o.adapter_names.push_back(name);
  o.max_queue = a.max_queue;
  o.shutdown_grace_seconds = a.shutdown_timeout;
  o.chat_template = templ;
  o.chat_stop_ids = model_stop_ids(a.model, tokenizer, /*chat=*/true);
  o.completion_stop_ids = model_stop_ids(a.model, tokenizer, /*chat=*/false);
  Server server(engine, tokenizer, o);
  const int port = server.bind();
  std::cout << fmt::format("serving {}{} on http://{}:{} (OpenAI API under /v1; /health, /metrics)\n", o.model_name,
                           o.adapter_names.empty() ? std::string()
                                                   : fmt::format(" and LoRA {}", fmt::join(o.adapter_names, ", ")),
                           a.host, port)
            << std::flush;
  const InterruptRequests interrupts(/*also_sigterm=*/true);
  server.run([&] { return interrupts.requested(); });
  std::cout << "stopped\n" << std::flush;
}

}  // namespace

Action add_generate(CLI::App& app, GenerateMode mode) {
  const bool plan_only = mode == GenerateMode::Plan, serving = mode == GenerateMode::Serve;
  auto a = std::make_shared<GenerateArgs>();
  auto* model = app.add_option(serving ? "model,--model_name_or_path,--model" : "--model_name_or_path,--model",
                               a->model, "Hugging Face model directory");
  if (plan_only) {
    app.add_flag("--inference", a->inference, "plan generation (memtune generate's flags)");
    app.add_option("--preset", a->preset, "qwen2.5-0.5b ... qwen2.5-72b, tiny (instead of --model)")->excludes(model);
    app.add_option("--quantization", a->quantization,
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
        ->capture_default_str();
    app.add_option("--max_decode_step_tokens", a->max_decode_step_tokens,
                   "tokens a step that decodes holds at most, prompt chunks filling what the decoding streams "
                   "leave (at least 4; 0: up to max_num_batched_tokens): keeps inter-token latency near a decode "
                   "step's while prompts are read, at some cost in throughput and time to first token")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    app.add_option("--shutdown_timeout", a->shutdown_timeout,
                   "seconds in-flight requests may take to finish after SIGTERM / Ctrl-C before they are cancelled")
        ->capture_default_str();
  } else {
    app.add_option("--adapter", a->adapters,
                   "PEFT LoRA adapter directory, applied without merging; or NAME=DIR, repeated: several adapters "
                   "held at once, an input line's \"adapter\": NAME picks one");
    app.add_flag("--merge_adapter", a->merge_adapter,
                 "merge the adapter into the weights at load (faster: no adapter path in each step)");
  }
  app.add_option("--tokenizer", a->tokenizer, "tokenizer directory (default: the model directory)");
  add_backend_option(app, a->backend);
  add_template_option(app, a->templ);
  if (!serving)
    app.add_option("--enable_thinking", a->enable_thinking,
                   "Qwen3's chat template: false starts the reply after an empty think block (no reasoning)")
        ->capture_default_str();
  if (!serving) {
    app.add_option("--prompt", a->prompt, "one prompt; its text is streamed to stdout");
    app.add_option("--input", a->input,
                   "JSONL, one request per line: {\"prompt\": TEXT} | {\"messages\": [...]} | {\"prompt_ids\": [...]}");
    app.add_option("--output", a->output, "write the results here as JSONL, in input order (default: stdout)");
    app.add_flag("--chat", a->chat, "render --prompt and \"prompt\" lines as a user message with the chat template");
    app.add_option("--system", a->system, "system message for chat prompts without one");
    app.add_option("--max_new_tokens", a->max_new_tokens, "the most tokens generated per request")
        ->capture_default_str();
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
  app.add_option("--max_model_len,--max-model-len", a->max_model_len,
                 serving ? "the most tokens (prompt + output) of one sequence (default: max_position_embeddings)"
                         : "the most tokens (prompt + output) of one sequence (default: the longest request)");
  app.add_option("--max_num_seqs,--max-num-seqs", a->max_num_seqs, "sequences decoded together")->capture_default_str();
  app.add_option("--max_num_batched_tokens,--max-num-batched-tokens", a->max_num_batched_tokens,
                 "tokens one step computes: prompts are prefilled in chunks of at most this")
      ->capture_default_str();
  app.add_option("--block_size,--block-size", a->block_size, "tokens per KV cache block")->capture_default_str();
  app.add_option("--device_memory", a->device_memory,
                 "size the KV cache from this budget (e.g. 24GiB): what is left after weights and workspace");
  app.add_option("--memory_fraction,--gpu_memory_utilization,--gpu-memory-utilization", a->memory_fraction,
                 "the share of --device_memory the plan may use")
      ->capture_default_str();
  app.add_option("--torch_dtype,--dtype", a->torch_dtype, "storage dtype of the weights: float32 | bfloat16 | float16");
  app.add_flag("--bf16", a->bf16, "store weights in bfloat16");
  app.add_flag("--fp16", a->fp16, "store weights in float16");
  app.add_option("--host_memory", a->host_memory,
                 "budget for the whole process (e.g. 16GiB): refuse to start when the prediction is above it");
  if (!serving) app.add_flag("--json", a->json, "print the results and the summary as JSON");
  app.parse_complete_callback([a, mode, plan_only] {
    for (const std::string& value : a->adapters) {
      const size_t eq = value.find('=');
      if (eq != std::string::npos && eq > 0 && value.find('/') > eq) {
        a->named_adapters.emplace_back(value.substr(0, eq), value.substr(eq + 1));
      } else if (a->adapter.empty()) {
        a->adapter = value;
      } else {
        throw Error("--adapter: several adapters need names: --adapter NAME=DIR for each");
      }
    }
    if (!a->adapter.empty() && !a->named_adapters.empty())
      throw Error("--adapter: give one adapter DIR, or NAME=DIR for each of several, not both");
    if (a->merge_adapter && !a->named_adapters.empty())
      throw Error("--merge_adapter merges one adapter: it cannot be combined with named adapters");
    if (mode == GenerateMode::Chat) {
      if (!a->prompt.empty() || !a->input.empty()) throw Error("chat reads its prompts from the terminal");
      return;
    }
    if (mode == GenerateMode::Serve) {
      if (!a->adapter.empty()) throw Error("--lora_modules: give each adapter a name, NAME=DIR");
      for (const auto& [name, dir] : a->named_adapters)
        if (name == (a->served_model_name.empty() ? a->model : a->served_model_name))
          throw Error(fmt::format("--lora_modules {}: the name is the base model's", name));
      if (a->port < 0 || a->port > 65535) throw Error(fmt::format("--port {}: expected 0 to 65535", a->port));
      if (a->max_queue < 0) throw Error("--max_queue must not be negative");
      return;
    }
    if (!plan_only && a->prompt.empty() == a->input.empty())
      throw Error("give one of --prompt TEXT and --input FILE.jsonl");
    if (!a->prompt.empty() && !a->input.empty())
      throw Error("give one of --prompt TEXT and --input FILE.jsonl, not both");
    if (plan_only && a->model.empty() == a->preset.empty())
      throw Error("plan needs exactly one of --model or --preset");
    check_local_dataset(a->input, "--input");
  });
  if (plan_only) return [a] { plan_inference(*a); };
  if (mode == GenerateMode::Chat) return [a] { chat(*a); };
  if (serving) return [a] { serve(*a); };
  return [a] {
    const size_t startup_rss = current_rss_bytes();
    const std::optional<DType> dtype = storage_dtype(a->torch_dtype, a->bf16, a->fp16);
    const Tokenizer tokenizer = Tokenizer::load(a->tokenizer.empty() ? a->model : a->tokenizer);
    const std::vector<GenerationRequest> requests = read_requests(*a, tokenizer);
    const InferenceSetup setup = plan_setup(*a, requests, startup_rss);
    const ProcessPlan& process = setup.process;
    const std::unique_ptr<Qwen2Model> model = load_model(a->model, setup.options, a->adapter, dtype);
    for (size_t k = 0; k < a->named_adapters.size(); ++k)
      model->parameters().load_adapter_set(k, a->named_adapters[k].second);
    if (a->merge_adapter) {
      if (a->adapter.empty()) throw Error("--merge_adapter needs --adapter");
      model->parameters().merge_lora();
    }
    Generator generator(*model, &tokenizer);
    const bool stream = !a->prompt.empty() && !a->json;
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
                              {"process_peak_rss_bytes", process_peak_rss_bytes(model->arena())}};
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
    if (!a->output.empty()) write_file_atomically(a->output, lines);
    if (a->json) {
      if (a->output.empty()) std::cout << lines;
      std::cout << summary.dump() << "\n";
      return;
    }
    if (a->prompt.empty() && a->output.empty()) std::cout << lines;
    std::cerr << fmt::format(
        "{} requests: prefill {} tokens at {:.1f} tokens/s, decode {} tokens at {:.1f} tokens/s; KV cache {} blocks "
        "of {} tokens; arena {} (planned), process peak {} (measured, {} predicted)\n",
        results.size(), st.prefill_tokens, st.prefill_tokens_per_second(), st.decode_tokens,
        st.decode_tokens_per_second(), kv.blocks, kv.block_size, format_bytes(model->plan().peak_bytes()),
        format_bytes(process_peak_rss_bytes(model->arena())), format_bytes(process.peak_bytes()));
  };
}

}  // namespace memtune::cli

// `memtune serve`: the plan of the flags, then the OpenAI-compatible server until SIGTERM or Ctrl-C.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "cli/inference_flags.h"
#include "core/console.h"
#include "core/error.h"
#include "memory/process_memory.h"
#include "model/load.h"
#include "serve/server.h"
#include "tokenizer/chat_template.h"
#include "options/command_setup.h"

namespace memtune::cli {

namespace {

void serve(const InferenceArgs& a) {
  const size_t startup_rss = startup_rss_bytes(a.flags.backend);
  const std::optional<Tokenizer> tokenizer = load_tokenizer(a);
  const Tokenizer* tok = tokenizer ? &*tokenizer : nullptr;
  const ChatTemplate templ =
      tok ? resolve_chat_template(a.templ, *tok, "tokenizer_config.json") : ChatTemplate::Qwen2_5;
  const InferenceSetup setup = plan_inference_setup(a, {}, startup_rss);
  const std::optional<DType> dtype = storage_dtype(a.flags.torch_dtype, a.flags.bf16, a.flags.fp16);
  const std::unique_ptr<Decoder> model = load_model(a.flags.model, setup.options, "", {dtype, a.flags.lm_head_bits});
  for (size_t k = 0; k < a.named_adapters.size(); ++k)
    model->parameters().load_adapter_set(k, a.named_adapters[k].second);
  std::cout << inference_plan_text(setup, model->plan()) << std::flush;
  GenerationEngine engine(*model, tok);
  engine.set_max_decode_step_tokens(a.max_decode_step_tokens.value_or(model->backend().stored_weight_rows()));
  ServeOptions o;
  o.host = a.host;
  o.port = a.port;
  o.api_key = a.api_key;
  o.model_name = a.served_model_name.empty() ? a.flags.model : a.served_model_name;
  for (const auto& [name, dir] : a.named_adapters) o.adapter_names.push_back(name);
  o.max_queue = a.max_queue;
  o.shutdown_grace_seconds = a.shutdown_timeout;
  o.chat_template = templ;
  o.chat_stop_ids = model_stop_ids(a.flags.model, tok, /*chat=*/true);
  o.completion_stop_ids = model_stop_ids(a.flags.model, tok, /*chat=*/false);
  Server server(engine, tok, o);
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

Action add_serve(CLI::App& app) {
  return inference_action(app, InferenceCommand::Serve, serve);
}

}  // namespace memtune::cli

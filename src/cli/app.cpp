// Every memtune subcommand on one CLI11 app: what main() parses, and what the option tests walk.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cli/commands.h"
#include "options/arguments.h"
#include "options/config_file.h"

namespace memtune::cli {

Commands add_commands(CLI::App& app, const TrainingHooks& hooks) {
  app.require_subcommand(1);
  Commands commands;
  auto add = [&](const char* name, const char* help, auto adder) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands.actions.emplace_back(sub, adder(*sub));
  };
  add("init-model", "write a randomly initialized checkpoint (config.json + safetensors; qwen2, qwen3 or llama)",
      add_init_model);
  add("dump", "debugging: logits, loss and every parameter gradient for a small batch", add_dump);
  add("merge", "merge a LoRA adapter into its base model and write a Hugging Face checkpoint", add_merge);
  add("quantize", "quantize a model's linear layers to 4 or 8 bits (round-to-nearest or GPTQ) in GPTQ / AWQ files",
      add_quantize);
  add("dequantize", "write a GPTQ / AWQ model's weights back as a float checkpoint", add_dequantize);
  add("train", "fine-tune (LoRA or full) on a JSONL dataset with Hugging Face's arguments",
      [&hooks](CLI::App& sub) { return add_train(sub, hooks); });
  add("eval", "streaming evaluation: loss, perplexity, token accuracy without ever holding logits",
      [&hooks](CLI::App& sub) { return add_eval(sub, hooks.eval); });
  add("generate", "text from a model over a planned, paged KV cache (a prompt, or a JSONL file of them)", add_generate);
  add("chat", "an interactive chat in the terminal (chat template, history; /reset, /exit; Ctrl-C stops an answer)",
      add_chat);
  add("serve", "an OpenAI-compatible server (chat and completions, streaming, LoRA adapters) over a planned KV cache",
      add_serve);
  commands.plan_inference = app.add_subcommand("plan-inference", "")->group("");  // `plan --inference`
  commands.actions.emplace_back(commands.plan_inference, add_plan_inference(*commands.plan_inference));
  add("plan", "the memory bill of a run before it starts, against a device budget", add_plan);
  add("devices", "the Vulkan devices of this machine (memory, features) and the one --backend vulkan would take",
      add_devices);
  add("report", "regenerate report.html (charts, memory timeline, plan, arguments) from a run's output_dir",
      add_report);
  add("tokenize", "encode JSONL text (or chat messages) to token ids, or decode ids", add_tokenize);
  // `data` groups dataset tools; its sub-subcommands are dispatched like the others.
  CLI::App* data = app.add_subcommand("data", "dataset tools");
  data->require_subcommand(1);
  CLI::App* data_stats = data->add_subcommand("stats", "token-length statistics of a JSONL dataset");
  commands.actions.emplace_back(data_stats, add_data_stats(*data_stats));
  refuse_non_finite_numbers(app);
  return commands;
}

CommandLine::CommandLine(const TrainingHooks& hooks)
    : hooks_(hooks),
      app_("memtune: fine-tune, evaluate, quantize and serve Qwen2.5, Qwen3 and Llama 3 models with planned memory"),
      commands_(add_commands(app_, hooks_)) {}

void CommandLine::parse(std::vector<std::string> args) {
  // The subcommand named on the command line (e.g. "train", or "data stats"), then its flags
  // made into CLI11's: boolean flag values, a --config file (train, plan, eval) and the Hugging
  // Face / ms-swift / LLaMA-Factory keys that are not memtune flags.
  CLI::App* command = &app_;
  size_t command_at = 0;
  for (; command_at < args.size() && !args[command_at].starts_with("-"); ++command_at) {
    CLI::App* sub = nullptr;
    for (CLI::App* candidate : command->get_subcommands([](CLI::App*) { return true; }))
      if (candidate->get_name() == args[command_at]) sub = candidate;
    if (!sub) break;
    command = sub;
  }
  // `plan --inference` takes generate's flags: it is the inference planner's own subcommand.
  if (command->get_name() == "plan" && std::find(args.begin(), args.end(), "--inference") != args.end()) {
    args[command_at - 1] = "plan-inference";
    command = commands_.plan_inference;
  }
  const std::string name = command->get_name();
  const bool compatible = command->get_parent() == &app_ && (name == "train" || name == "plan" || name == "eval");
  PreparedArguments prepared = prepare_arguments(args, command_at, *command, compatible);
  if (const std::string notice = ignored_keys_notice(prepared.ignored); !notice.empty()) {
    // Once per job: rank 0 of an mpirun launch, or the only process.
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!rank || std::string(rank) == "0") std::fprintf(stderr, "%s\n", notice.c_str());
  }
  args = std::move(prepared.args);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector back to front
  app_.parse(args);
}

void CommandLine::run() const {
  for (const auto& [sub, action] : commands_.actions)
    if (sub->parsed()) action();
}

}  // namespace memtune::cli

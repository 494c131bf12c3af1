// Every memtune subcommand on one CLI11 app: what main() parses, and what the option tests walk.
#include <vector>

#include "cli/commands.h"
#include "options/arguments.h"

namespace memtune::cli {

Commands add_commands(CLI::App& app) {
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
  add("train", "fine-tune (LoRA or full) on a JSONL dataset with Hugging Face's arguments", add_train);
  add("eval", "streaming evaluation: loss, perplexity, token accuracy without ever holding logits", add_eval);
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

}  // namespace memtune::cli

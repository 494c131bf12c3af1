// memtune command line: dispatches to subcommands; user errors print one clear message and exit 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "options/arguments.h"
#include "options/config_file.h"

namespace {

// A failing rank of a data-parallel job names itself and stops the whole job (MPI_Abort), so
// the other ranks do not wait forever in their next collective.
int fail(int code, const char* kind, const char* what) {
  memtune::Communicator& comm = memtune::world();
  if (comm.world_size() > 1) {
    std::fprintf(stderr, "memtune: %s on rank %d of %d: %s; stopping all ranks\n", kind, comm.rank(), comm.world_size(),
                 what);
    std::fflush(stderr);
    comm.abort(code);
  }
  std::fprintf(stderr, "memtune: %s: %s\n", kind, what);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"memtune: fine-tune, evaluate, quantize and serve Qwen2.5, Qwen3 and Llama 3 models with planned memory"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, memtune::cli::Action>> commands;
  auto add = [&](const char* name, const char* help, auto adder) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands.emplace_back(sub, adder(*sub));
  };
  add("init-model", "write a randomly initialized checkpoint (config.json + safetensors; qwen2, qwen3 or llama)",
      memtune::cli::add_init_model);
  add("dump", "debugging: logits, loss and every parameter gradient for a small batch", memtune::cli::add_dump);
  add("merge", "merge a LoRA adapter into its base model and write a Hugging Face checkpoint", memtune::cli::add_merge);
  add("quantize", "quantize a model's linear layers to 4 or 8 bits (round-to-nearest or GPTQ) in GPTQ / AWQ files",
      memtune::cli::add_quantize);
  add("dequantize", "write a GPTQ / AWQ model's weights back as a float checkpoint", memtune::cli::add_dequantize);
  add("train", "fine-tune (LoRA or full) on a JSONL dataset with Hugging Face's arguments", memtune::cli::add_train);
  add("eval", "streaming evaluation: loss, perplexity, token accuracy without ever holding logits",
      memtune::cli::add_eval);
  add("generate", "text from a model over a planned, paged KV cache (a prompt, or a JSONL file of them)",
      memtune::cli::add_generate);
  add("chat", "an interactive chat in the terminal (chat template, history; /reset, /exit; Ctrl-C stops an answer)",
      memtune::cli::add_chat);
  add("serve", "an OpenAI-compatible server (chat and completions, streaming, LoRA adapters) over a planned KV cache",
      memtune::cli::add_serve);
  CLI::App* plan_inference = app.add_subcommand("plan-inference", "")->group("");  // `plan --inference`
  commands.emplace_back(plan_inference, memtune::cli::add_plan_inference(*plan_inference));
  add("plan", "the memory bill of a run before it starts, against a device budget", memtune::cli::add_plan);
  add("devices", "the Vulkan devices of this machine (memory, features) and the one --backend vulkan would take",
      memtune::cli::add_devices);
  add("report", "regenerate report.html (charts, memory timeline, plan, arguments) from a run's output_dir",
      memtune::cli::add_report);
  add("tokenize", "encode JSONL text (or chat messages) to token ids, or decode ids", memtune::cli::add_tokenize);
  // `data` groups dataset tools; its sub-subcommands are dispatched like the others.
  CLI::App* data = app.add_subcommand("data", "dataset tools");
  data->require_subcommand(1);
  CLI::App* data_stats = data->add_subcommand("stats", "token-length statistics of a JSONL dataset");
  commands.emplace_back(data_stats, memtune::cli::add_data_stats(*data_stats));
  memtune::refuse_non_finite_numbers(app);
  try {
    // The subcommand named on the command line (e.g. "train", or "data stats"), then its flags
    // made into CLI11's: boolean flag values, a --config file (train, plan, eval) and the
    // Hugging Face / ms-swift / LLaMA-Factory keys that are not memtune flags.
    std::vector<std::string> args(argv + 1, argv + argc);
    CLI::App* command = &app;
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
      command = plan_inference;
    }
    const std::string name = command->get_name();
    const bool compatible = command->get_parent() == &app && (name == "train" || name == "plan" || name == "eval");
    memtune::PreparedArguments prepared = memtune::prepare_arguments(args, command_at, *command, compatible);
    if (const std::string notice = memtune::ignored_keys_notice(prepared.ignored); !notice.empty()) {
      // Once per job: rank 0 of an mpirun launch, or the only process.
      const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
      if (!rank || std::string(rank) == "0") std::fprintf(stderr, "%s\n", notice.c_str());
    }
    args = std::move(prepared.args);
    std::reverse(args.begin(), args.end());  // CLI11 takes the vector back to front
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const memtune::Error& e) {
    std::fprintf(stderr, "memtune: error: %s\n", e.what());
    return 1;
  }
  try {
    for (auto& [sub, action] : commands)
      if (sub->parsed()) action();
  } catch (const memtune::Interrupted& e) {
    std::fprintf(stderr, "memtune: %s\n", e.what());
    return 130;
  } catch (const memtune::Error& e) {
    return fail(1, "error", e.what());
  } catch (const std::exception& e) {
    return fail(2, "internal error", e.what());
  }
  return 0;
}

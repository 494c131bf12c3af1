// The memtune subcommands. Each registers its flags on the CLI11 app and returns the action to
// run once parsing succeeded; main() owns error reporting and exit codes.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

#include "train/run.h"

namespace memtune::cli {

using Action = std::function<void()>;

// The subcommands registered on an app, each with its action; plan_inference is `plan
// --inference` (a hidden subcommand main() redirects to).
struct Commands {
  std::vector<std::pair<CLI::App*, Action>> actions;
  CLI::App* plan_inference = nullptr;
};
// Registers every subcommand and its flags (floating-point flags refuse nan and inf). `hooks`
// (kept by reference, alive while the commands run) reach train (all of them) and eval (.eval).
Commands add_commands(CLI::App& app, const TrainingHooks& hooks);

// One memtune command line in this process: what main() runs and what the Python package calls.
// parse() takes the arguments without the program name, Hugging Face / ms-swift / LLaMA-Factory
// flags and --config files prepared first (config_file.h), and throws CLI::ParseError (also for
// --help: app().exit(e) prints it) or memtune::Error. run() runs the parsed subcommand and throws
// memtune::Error, memtune::Interrupted, or whatever a hook threw.
class CommandLine {
 public:
  explicit CommandLine(const TrainingHooks& hooks = {});
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;
  void parse(std::vector<std::string> args);
  void run() const;
  CLI::App& app() { return app_; }

 private:
  TrainingHooks hooks_;
  CLI::App app_;
  Commands commands_;
};

Action add_init_model(CLI::App& app);
Action add_dump(CLI::App& app);
Action add_merge(CLI::App& app);
Action add_quantize(CLI::App& app);
Action add_dequantize(CLI::App& app);
Action add_train(CLI::App& app, const TrainingHooks& hooks);
Action add_eval(CLI::App& app, const EvalHooks& hooks);
// generate, chat, serve and `memtune plan --inference` (generate's flags with --preset: the plan,
// nothing run) share their flags and their planning (cli/inference_flags.h).
Action add_generate(CLI::App& app);
Action add_chat(CLI::App& app);
Action add_serve(CLI::App& app);
Action add_plan_inference(CLI::App& app);
Action add_plan(CLI::App& app);
Action add_tokenize(CLI::App& app);
Action add_data_stats(CLI::App& app);
Action add_report(CLI::App& app);
Action add_devices(CLI::App& app);


// The options of a parsed subcommand as a JSON object (name -> value as given, or the default),
// written to output_dir/run_args.json for the run report.
nlohmann::json arguments_json(const CLI::App& app);

}  // namespace memtune::cli

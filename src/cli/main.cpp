// memtune command line: dispatches to subcommands; user errors print one clear message and exit 1.
#include <cstdio>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"memtune: fine-tune and evaluate Qwen2.5-family models with planned memory"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, memtune::cli::Action>> commands;
  auto add = [&](const char* name, const char* help, auto adder) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands.emplace_back(sub, adder(*sub));
  };
  add("init-model", "write a randomly initialized Qwen2 checkpoint (config.json + safetensors)",
      memtune::cli::add_init_model);
  add("dump", "debugging: logits, loss and every parameter gradient for a small batch", memtune::cli::add_dump);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, action] : commands)
      if (sub->parsed()) action();
  } catch (const memtune::Error& e) {
    std::fprintf(stderr, "memtune: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memtune: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}

// memtune command line: dispatches to subcommands; user errors print one clear message and exit 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "distributed/communicator.h"
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
  const memtune::cli::Commands commands = memtune::cli::add_commands(app);
  CLI::App* plan_inference = commands.plan_inference;
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
    for (auto& [sub, action] : commands.actions)
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

// memtune command line: dispatches to subcommands; user errors print one clear message and exit 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "distributed/communicator.h"

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
  memtune::cli::CommandLine line;
  try {
    line.parse(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const CLI::ParseError& e) {
    return line.app().exit(e);
  } catch (const memtune::Error& e) {
    std::fprintf(stderr, "memtune: error: %s\n", e.what());
    return 1;
  }
  try {
    line.run();
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

// Runs the memtune binary (or a shell script) as a user would and captures what it prints, for
// the command-line tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace memtune::testing_support {

struct CommandResult {
  int status;          // exit status, -1 if killed by a signal
  std::string output;  // stdout and stderr together
};

inline CommandResult run_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buffer{};
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) out.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Where this test suite was built from and the memtune binary built with it. They are defined in
// one generated file of the build tree (CMakeLists.txt), not on every test file's command line, so
// the test files compile the same in any clone and build directory (what ccache needs to share them).
std::string source_dir();
std::string built_memtune_binary();

// The memtune binary the CLI tests run: $MEMTUNE_BINARY when set (a bundle moved to another
// machine, scripts/device-check.sh), else the one this test suite was built with.
inline std::string memtune_binary() {
  const char* env = std::getenv("MEMTUNE_BINARY");
  return env && *env ? std::string(env) : built_memtune_binary();
}

// `memtune ARGS` with memtune_binary().
inline CommandResult run_memtune(const std::string& args) {
  return run_command(memtune_binary() + " " + args);
}

// A POSIX shell script run in `dir`.
inline CommandResult run_shell(const std::filesystem::path& dir, const std::string& script) {
  return run_command("cd '" + dir.string() + "' && sh -c '" + script + "'");
}

}  // namespace memtune::testing_support

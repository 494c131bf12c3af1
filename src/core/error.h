// Errors. User-facing failures (bad files, bad flags, a plan that cannot fit) throw
// memtune::Error with a message naming the file, field and what was expected; the CLI prints
// it and exits non-zero. Internal invariants use MT_ASSERT, which reports file:line and aborts
// through an exception so tests can observe it.
#pragma once

#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace memtune {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// The user interrupted (Ctrl-C) after the work in progress was saved; the CLI exits with 130.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// An invariant of the engine itself was broken: a bug, not a user error.
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

[[noreturn]] void assert_failed(const char* expr, const char* file, int line, const std::string& message);

}  // namespace memtune

#define MT_ASSERT(cond, ...)                                                                    \
  do {                                                                                          \
    if (!(cond)) ::memtune::assert_failed(#cond, __FILE__, __LINE__, std::string{__VA_ARGS__}); \
  } while (0)

#include "core/console.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <iostream>

namespace memtune {
namespace {

std::atomic<bool> g_interrupted{false};
extern "C" void on_sigint(int) {
  g_interrupted = true;
}

}  // namespace

InterruptRequests::InterruptRequests(bool also_sigterm) : also_sigterm_(also_sigterm) {
  g_interrupted = false;
  struct sigaction action {};
  action.sa_handler = on_sigint;
  sigaction(SIGINT, &action, &previous_);
  if (also_sigterm_) sigaction(SIGTERM, &action, &previous_term_);
}

InterruptRequests::~InterruptRequests() {
  sigaction(SIGINT, &previous_, nullptr);
  if (also_sigterm_) sigaction(SIGTERM, &previous_term_, nullptr);
}

bool InterruptRequests::requested() const {
  return g_interrupted;
}

void InterruptRequests::request() {
  g_interrupted = true;
}

bool progress_line_on_terminal(const std::ostream& out, int world_size) {
  return world_size == 1 && &out == &std::cout && isatty(STDOUT_FILENO);
}

std::string format_bytes(size_t bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(units)) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

}  // namespace memtune

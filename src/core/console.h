// What a training run needs from the process it runs in, kept apart from the training itself:
// Ctrl-C as a request to stop after the current step (the run then saves a checkpoint), whether
// progress can be a live terminal line, and durations for people.
#pragma once

#include <atomic>
#include <csignal>
#include <ostream>
#include <string>

namespace memtune {

// While alive, SIGINT (and with also_sigterm SIGTERM) sets requested() instead of ending the
// process; the previous handlers are restored on destruction. One at a time.
class InterruptRequests {
 public:
  explicit InterruptRequests(bool also_sigterm = false);
  ~InterruptRequests();
  InterruptRequests(const InterruptRequests&) = delete;
  InterruptRequests& operator=(const InterruptRequests&) = delete;
  bool requested() const;
  // Another rank asked: behave as if this process had been interrupted too.
  void request();

 private:
  struct sigaction previous_ {}, previous_term_ {};
  bool also_sigterm_ = false;
};

// A live, rewritten progress line: only on an interactive terminal in a single process (under
// mpirun stdout is a pseudo-terminal even when the job's output goes to a file).
bool progress_line_on_terminal(const std::ostream& out, int world_size);

// "1h02m" or "3m05s".
std::string format_duration(double seconds);
// "512 B", "1.50 KiB", "24.00 GiB".
std::string format_bytes(size_t bytes);

}  // namespace memtune

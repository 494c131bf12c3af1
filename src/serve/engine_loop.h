// The engine thread of the server and the channels between it and the HTTP workers.
//
// A worker parses a request, submits it with a fresh Channel and waits on that channel; the
// engine thread (EngineLoop::run) owns the GenerationEngine: between steps it takes the new
// requests and the cancellations, runs a step while there is work, and reports text pieces and
// the finish through each request's channel. The engine itself is never touched by a worker.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "generate/generator.h"
#include "serve/prometheus.h"

namespace memtune {

// One request's channel between its HTTP worker and the engine thread.
struct Channel {
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;  // text not yet sent (streaming)
  bool collect_ids = false;        // a server without a tokenizer streams token ids instead
  std::vector<int32_t> ids;        // token ids not yet sent (streaming, collect_ids)
  bool finished = false;
  GenerationResult result;
  std::string error;  // set with finished when the engine refused the request
  std::optional<uint64_t> engine_id;
  bool cancel_requested = false;
  // The engine thread's own: for the latency metrics.
  Clock::time_point arrived = Clock::now(), last_token;
  bool has_token = false;
};

class EngineLoop {
 public:
  EngineLoop(GenerationEngine& engine, ServerMetrics& metrics, int64_t max_queue, double shutdown_grace_seconds);

  // From a worker: hands the request to the engine thread. ApiError 503 once the loop has
  // ended, 429 when max_queue requests are already waiting.
  void submit(GenerationRequest request, const std::shared_ptr<Channel>& channel);
  // From a worker: the client has gone; the engine cancels the request and frees its blocks.
  void cancel(const std::shared_ptr<Channel>& channel);
  // False from the moment run() has been asked to stop.
  bool accepting() const { return accepting_; }
  // As published after the engine's latest step.
  EngineGauges gauges() const;

  // On the engine thread: steps until stop_requested() says yes (asked every few milliseconds),
  // then calls stop_listening(), lets in-flight requests finish for up to shutdown_grace_seconds,
  // cancels what is left, and returns.
  void run(const std::function<bool()>& stop_requested, const std::function<void()>& stop_listening);

 private:
  void start(GenerationRequest request, const std::shared_ptr<Channel>& channel);
  void publish();

  GenerationEngine& engine_;
  ServerMetrics& metrics_;
  const int64_t max_queue_;
  const double shutdown_grace_seconds_;
  std::mutex mu_;
  std::condition_variable wake_;
  mutable std::mutex work_mu_;  // the device work totals, copied out after each step
  std::optional<DeviceWork::Totals> decode_work_, prefill_work_;
  std::vector<std::pair<GenerationRequest, std::shared_ptr<Channel>>> inbox_;
  std::vector<std::shared_ptr<Channel>> cancels_;
  bool closed_ = false;  // the loop has ended: nothing more is taken (guarded by mu_)
  std::atomic<bool> accepting_{true};
  std::atomic<int64_t> running_{0}, waiting_{0}, blocks_free_{0};
  // The engine thread's own: the requests the engine holds, by engine id.
  std::unordered_map<uint64_t, std::shared_ptr<Channel>> active_;
};

}  // namespace memtune

// The server's Prometheus metrics (GET /metrics): responses by status, prompt and generated
// tokens, the engine's queue and KV-cache gauges, and latency histograms of the first token and
// of the gaps between tokens. Workers and the engine thread record into it at once (one mutex).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/device_work.h"

namespace memtune {

// A Prometheus histogram with fixed bucket bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}
  void observe(double value);
  // The exposition text: cumulative buckets, +Inf, sum and count.
  void write(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, each observation counted in every bucket it fits
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What the engine thread publishes after every step; on a device, what its decode and prefill
// steps asked of it (backend/device_work.h).
struct EngineGauges {
  int64_t running = 0, waiting = 0, blocks_used = 0, blocks_free = 0;
  std::optional<DeviceWork::Totals> decode_work, prefill_work;
};

class ServerMetrics {
 public:
  void count_response(int status);
  void observe_first_token(double seconds_since_arrival);
  void observe_token_gap(double seconds_since_previous);
  void count_finished(uint64_t prompt_tokens, uint64_t generation_tokens);
  // The Prometheus text of everything recorded, with the engine's gauges.
  std::string text(const EngineGauges& gauges) const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> requests_by_status_;
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  Histogram time_to_first_token_{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token_latency_{{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5}};
};

}  // namespace memtune

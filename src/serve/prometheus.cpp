// Prometheus metrics of the server (see prometheus.h).
#include "serve/prometheus.h"

#include <fmt/format.h>

namespace memtune {

void Histogram::observe(double value) {
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (value <= bounds_[i]) ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::write(std::string& out, const std::string& name, const std::string& help) const {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  for (size_t i = 0; i < bounds_.size(); ++i)
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], counts_[i]);
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
}

void ServerMetrics::count_response(int status) {
  const std::lock_guard lock(mu_);
  ++requests_by_status_[status];
}

void ServerMetrics::observe_first_token(double seconds_since_arrival) {
  const std::lock_guard lock(mu_);
  time_to_first_token_.observe(seconds_since_arrival);
}

void ServerMetrics::observe_token_gap(double seconds_since_previous) {
  const std::lock_guard lock(mu_);
  inter_token_latency_.observe(seconds_since_previous);
}

void ServerMetrics::count_finished(uint64_t prompt_tokens, uint64_t generation_tokens) {
  const std::lock_guard lock(mu_);
  prompt_tokens_ += prompt_tokens;
  generation_tokens_ += generation_tokens;
}

std::string ServerMetrics::text(const EngineGauges& gauges) const {
  std::string out;
  const std::lock_guard lock(mu_);
  out +=
      "# HELP memtune_requests_total HTTP requests answered, by status code.\n"
      "# TYPE memtune_requests_total counter\n";
  for (const auto& [status, n] : requests_by_status_)
    out += fmt::format("memtune_requests_total{{status=\"{}\"}} {}\n", status, n);
  out += fmt::format(
      "# HELP memtune_prompt_tokens_total Prompt tokens of finished requests.\n"
      "# TYPE memtune_prompt_tokens_total counter\nmemtune_prompt_tokens_total {}\n"
      "# HELP memtune_generation_tokens_total Tokens generated.\n"
      "# TYPE memtune_generation_tokens_total counter\nmemtune_generation_tokens_total {}\n"
      "# HELP memtune_num_requests_running Sequences in the running batch.\n"
      "# TYPE memtune_num_requests_running gauge\nmemtune_num_requests_running {}\n"
      "# HELP memtune_num_requests_waiting Requests waiting for KV blocks or a batch slot.\n"
      "# TYPE memtune_num_requests_waiting gauge\nmemtune_num_requests_waiting {}\n"
      "# HELP memtune_kv_cache_blocks_used KV cache blocks reserved by running sequences.\n"
      "# TYPE memtune_kv_cache_blocks_used gauge\nmemtune_kv_cache_blocks_used {}\n"
      "# HELP memtune_kv_cache_blocks_free KV cache blocks free.\n"
      "# TYPE memtune_kv_cache_blocks_free gauge\nmemtune_kv_cache_blocks_free {}\n",
      prompt_tokens_, generation_tokens_, gauges.running, gauges.waiting, gauges.blocks_used, gauges.blocks_free);
  if (gauges.decode_work && gauges.prefill_work) {
    const DeviceWork::Totals &d = *gauges.decode_work, &p = *gauges.prefill_work;
    auto counter = [&](const char* name, const char* help, uint64_t decode, uint64_t prefill) {
      out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0}{{kind=\"decode\"}} {2}\n{0}{{kind=\"prefill\"}} {3}\n",
                         name, help, decode, prefill);
    };
    counter("memtune_engine_steps_total", "Engine steps on the device: decode (no prompt token) and prefill.",
            static_cast<uint64_t>(d.units), static_cast<uint64_t>(p.units));
    counter("memtune_device_waits_total", "Waits of the host for the device during engine steps.", d.waits, p.waits);
    counter("memtune_device_submissions_total", "Command buffers submitted to the device during engine steps.",
            d.submissions, p.submissions);
    counter("memtune_device_dispatches_total", "Compute dispatches run during engine steps.", d.dispatches,
            p.dispatches);
    counter("memtune_device_barriers_total", "Barriers between device commands during engine steps.", d.barriers,
            p.barriers);
    counter("memtune_device_replayed_dispatches_total",
            "Of the dispatches, those of recorded command buffers submitted again (not recorded by the host).",
            d.replayed_dispatches, p.replayed_dispatches);
  }
  time_to_first_token_.write(out, "memtune_time_to_first_token_seconds",
                             "Seconds from a request's arrival to its first generated token.");
  inter_token_latency_.write(out, "memtune_inter_token_latency_seconds",
                             "Seconds between consecutive tokens of a request.");
  return out;
}

}  // namespace memtune

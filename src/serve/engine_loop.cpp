// The server's engine thread (see engine_loop.h).
#include "serve/engine_loop.h"

#include <fmt/format.h>

#include "core/error.h"
#include "serve/api_error.h"

namespace memtune {

using Clock = Channel::Clock;

EngineLoop::EngineLoop(GenerationEngine& engine, ServerMetrics& metrics, int64_t max_queue,
                       double shutdown_grace_seconds)
    : engine_(engine), metrics_(metrics), max_queue_(max_queue), shutdown_grace_seconds_(shutdown_grace_seconds) {}

void EngineLoop::submit(GenerationRequest request, const std::shared_ptr<Channel>& channel) {
  {
    const std::lock_guard lock(mu_);
    if (closed_) throw ApiError(503, "the server is shutting down");
    if (static_cast<int64_t>(inbox_.size()) + waiting_.load() >= max_queue_)
      throw ApiError(429, fmt::format("the server has {} requests waiting (--max_queue {}): retry later",
                                      inbox_.size() + static_cast<size_t>(waiting_.load()), max_queue_));
    inbox_.emplace_back(std::move(request), channel);
  }
  wake_.notify_one();
}

void EngineLoop::cancel(const std::shared_ptr<Channel>& channel) {
  {
    const std::lock_guard lock(mu_);
    cancels_.push_back(channel);
  }
  {
    const std::lock_guard lock(channel->mu);
    channel->cancel_requested = true;
  }
  wake_.notify_one();
}

EngineGauges EngineLoop::gauges() const {
  const int64_t free = blocks_free_.load();
  const std::lock_guard lock(work_mu_);
  return {.running = running_.load(),
          .waiting = waiting_.load(),
          .blocks_used = engine_.total_blocks() - free,
          .blocks_free = free,
          .decode_work = decode_work_,
          .prefill_work = prefill_work_};
}

void EngineLoop::publish() {
  running_ = engine_.num_running();
  waiting_ = engine_.num_waiting();
  blocks_free_ = engine_.free_blocks();
  const std::lock_guard lock(work_mu_);
  decode_work_ = engine_.decode_work().totals();
  prefill_work_ = engine_.prefill_work().totals();
}

// Adds the request to the engine with callbacks that feed its channel and the metrics; a
// request the engine refuses finishes its channel with the error.
void EngineLoop::start(GenerationRequest request, const std::shared_ptr<Channel>& channel) {
  const auto prompt_tokens = static_cast<uint64_t>(request.prompt_ids.size());
  RequestCallbacks callbacks;
  callbacks.on_text = [channel](std::string_view piece) {
    {
      const std::lock_guard lock(channel->mu);
      channel->pieces.emplace_back(piece);
    }
    channel->cv.notify_all();
  };
  callbacks.on_token = [this, channel](int32_t id) {
    if (channel->collect_ids) {
      {
        const std::lock_guard lock(channel->mu);
        channel->ids.push_back(id);
      }
      channel->cv.notify_all();
    }
    const auto now = Clock::now();
    if (channel->has_token)
      metrics_.observe_token_gap(std::chrono::duration<double>(now - channel->last_token).count());
    else
      metrics_.observe_first_token(std::chrono::duration<double>(now - channel->arrived).count());
    channel->has_token = true;
    channel->last_token = now;
  };
  callbacks.on_finish = [this, channel, prompt_tokens](GenerationResult&& result) {
    metrics_.count_finished(prompt_tokens, result.token_ids.size());
    if (channel->engine_id) active_.erase(*channel->engine_id);
    {
      const std::lock_guard lock(channel->mu);
      channel->result = std::move(result);
      channel->finished = true;
    }
    channel->cv.notify_all();
  };
  try {
    const uint64_t id = engine_.add(std::move(request), std::move(callbacks));
    channel->engine_id = id;
    active_[id] = channel;
  } catch (const Error& e) {
    {
      const std::lock_guard lock(channel->mu);
      channel->error = e.what();
      channel->finished = true;
    }
    channel->cv.notify_all();
  }
}

void EngineLoop::run(const std::function<bool()>& stop_requested, const std::function<void()>& stop_listening) {
  bool stopping = false;
  Clock::time_point deadline;
  publish();
  for (;;) {
    if (!stopping && stop_requested()) {
      stopping = true;
      accepting_ = false;
      deadline = Clock::now() +
                 std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(shutdown_grace_seconds_));
      stop_listening();  // no new connections; the workers finish the requests they hold
    }
    std::vector<std::pair<GenerationRequest, std::shared_ptr<Channel>>> fresh;
    std::vector<std::shared_ptr<Channel>> cancelled;
    {
      std::unique_lock lock(mu_);
      if (inbox_.empty() && cancels_.empty() && engine_.idle())
        wake_.wait_for(lock, std::chrono::milliseconds(20), [&] { return !inbox_.empty() || !cancels_.empty(); });
      fresh.swap(inbox_);
      cancelled.swap(cancels_);
    }
    for (auto& [request, channel] : fresh) start(std::move(request), channel);
    for (const auto& channel : cancelled)
      if (channel->engine_id) engine_.cancel(*channel->engine_id);
    if (stopping && Clock::now() >= deadline) {
      std::vector<uint64_t> ids;
      for (const auto& [id, channel] : active_) ids.push_back(id);
      for (const uint64_t id : ids) engine_.cancel(id);
    }
    if (!engine_.idle()) engine_.step();
    publish();
    if (stopping && engine_.idle()) {
      const std::lock_guard lock(mu_);
      if (inbox_.empty()) {
        closed_ = true;  // a request that passed the accepting check late gets 503 from submit
        break;
      }
    }
  }
}

}  // namespace memtune

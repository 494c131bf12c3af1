// Server-sent events of a streamed completion (see event_stream.h).
#include "serve/event_stream.h"

#include <chrono>
#include <deque>
#include <string>

namespace memtune {

void stream_completion(httplib::Response& res, const std::shared_ptr<Channel>& channel, CompletionResponse response,
                       bool include_usage, std::function<void(bool)> on_end) {
  using Clock = Channel::Clock;
  res.set_header("Cache-Control", "no-cache");
  auto started = std::make_shared<bool>(false);
  auto last_write = std::make_shared<Clock::time_point>(Clock::now());
  res.set_chunked_content_provider(
      "text/event-stream",
      [=](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& data) {
          *last_write = Clock::now();
          return sink.write(data.data(), data.size());
        };
        if (!*started) {
          *started = true;
          const std::string opening = response.opening_event();
          if (!opening.empty() && !send(opening)) return false;
        }
        std::deque<std::string> pieces;
        std::vector<int32_t> ids;
        bool finished = false;
        {
          std::unique_lock lock(channel->mu);
          channel->cv.wait_for(lock, std::chrono::milliseconds(100), [&] {
            return !channel->pieces.empty() || !channel->ids.empty() || channel->finished;
          });
          pieces.swap(channel->pieces);
          ids.swap(channel->ids);
          finished = channel->finished;
        }
        for (const std::string& piece : pieces)
          if (!send(response.text_event(piece))) return false;
        if (!ids.empty() && !send(response.token_ids_event(ids))) return false;
        if (!finished) {
          if (Clock::now() - *last_write > std::chrono::seconds(1)) return send(CompletionResponse::kKeepAlive);
          return true;
        }
        if (!channel->error.empty()) {
          send(CompletionResponse::error_event(channel->error));
        } else {
          const GenerationResult& r = channel->result;
          if (!send(response.finish_event(r.finish_reason))) return false;
          if (include_usage && !send(response.usage_event(static_cast<int64_t>(r.token_ids.size())))) return false;
        }
        if (!send(CompletionResponse::kDoneEvent)) return false;
        sink.done();
        return true;
      },
      [on_end = std::move(on_end)](bool success) { on_end(success); });
}

}  // namespace memtune

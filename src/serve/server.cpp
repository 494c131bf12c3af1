// The OpenAI-compatible server (see server.h): routes, the API key, binding and the threads,
// wiring the parts that do the work: request_parser (bodies to requests), engine_loop (the
// engine thread and the channels to it), completion_response and event_stream (answers, whole
// or streamed), metrics (GET /metrics) and api_error (the shape of every refusal).
#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "serve/api_error.h"
#include "serve/completion_response.h"
#include "serve/engine_loop.h"
#include "serve/event_stream.h"
#include "serve/prometheus.h"
#include "serve/request_parser.h"

namespace memtune {

namespace {

using json = nlohmann::json;

void write_error(httplib::Response& res, int status, const std::string& message, const std::string& param = {},
                 const std::string& code = {}) {
  res.status = status;
  res.set_content(api_error_body(status, message, param, code), "application/json");
}

}  // namespace

bool keys_equal(const std::string& presented, const std::string& expected) {
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < presented.size() ? presented[i] : 0));
  return diff == 0;
}

struct Server::State {
  State(GenerationEngine& e, const Tokenizer* t, ServeOptions o)
      : engine(e),
        options(std::move(o)),
        served{.tokenizer = t,
               .name = options.model_name,
               .adapter_names = options.adapter_names,
               .chat_template = options.chat_template,
               .chat_stop_ids = options.chat_stop_ids,
               .completion_stop_ids = options.completion_stop_ids,
               .max_model_len = e.model().options().kv_cache.max_model_len,
               .vocab_size = e.model().config().vocab_size},
        loop(e, metrics, options.max_queue, options.shutdown_grace_seconds) {}
  GenerationEngine& engine;
  ServeOptions options;
  ServedModel served;
  ServerMetrics metrics;
  EngineLoop loop;
  httplib::Server http;
  int port = 0;
  // The listening socket, while it listens: shutting it down makes the library's accept loop end
  // (it closes the socket and waits for its workers) without cutting the streams in progress,
  // which httplib::Server::stop() would.
  std::atomic<int> listen_fd{-1};

  void stop_listening();

  void handle_completion(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  std::string models_json() const;
};

void Server::State::handle_completion(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  if (!loop.accepting()) throw ApiError(503, "the server is shutting down");
  ParsedRequest p = parse_request(req.body, endpoint, served);
  try {
    engine.validate(p.request, "request");
  } catch (const Error& e) {
    throw engine_refusal(e, p);
  }
  auto channel = std::make_shared<Channel>();
  channel->collect_ids = p.stream && served.tokenizer == nullptr;
  const CompletionResponse response(endpoint, p.model, static_cast<int64_t>(p.request.prompt_ids.size()),
                                    served.tokenizer == nullptr);
  loop.submit(std::move(p.request), channel);

  if (!p.stream) {
    std::unique_lock lock(channel->mu);
    channel->cv.wait(lock, [&] { return channel->finished; });
    if (!channel->error.empty()) throw ApiError(400, channel->error);
    if (channel->result.finish_reason == "abort")
      throw ApiError(503, "the server shut down before the request finished");
    res.set_content(response.whole(channel->result), "application/json");
    return;
  }
  stream_completion(res, channel, response, p.include_usage, [this, channel](bool complete) {
    if (!complete) loop.cancel(channel);
  });
}

void Server::State::stop_listening() {
  const int fd = listen_fd.exchange(-1);
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

std::string Server::State::models_json() const {
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  json data = json::array();
  data.push_back({{"id", options.model_name},
                  {"object", "model"},
                  {"created", created},
                  {"owned_by", "memtune"},
                  {"root", options.model_name},
                  {"parent", nullptr},
                  {"max_model_len", served.max_model_len}});
  for (const std::string& name : options.adapter_names)
    data.push_back({{"id", name},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "memtune"},
                    {"root", name},
                    {"parent", options.model_name},
                    {"max_model_len", served.max_model_len}});
  return json{{"object", "list"}, {"data", data}}.dump();
}

Server::Server(GenerationEngine& engine, const Tokenizer* tokenizer, ServeOptions options)
    : state_(std::make_unique<State>(engine, tokenizer, std::move(options))) {
  State& s = *state_;
  httplib::Server& http = s.http;
  const size_t threads = s.options.http_threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(s.options.max_body_bytes);
  // The library's default also sets SO_REUSEPORT, which would let a second server bind a port in
  // use; this one records the listening socket for a graceful stop.
  http.set_socket_options([&s](int sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    s.listen_fd = sock;
  });
  http.set_keep_alive_timeout(5);
  http.set_read_timeout(30);
  http.set_write_timeout(30);
  // Library-made errors (413, 404 for an unknown path, 400 for a bad request line) in OpenAI's shape.
  http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string message = res.status == 413   ? "the request body is too large"
                                : res.status == 404 ? fmt::format("no route for {} {}", req.method, req.path)
                                                    : fmt::format("HTTP {}", res.status);
    write_error(res, res.status, message);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    write_error(res, 500, message);
  });
  http.set_logger(
      [&s](const httplib::Request&, const httplib::Response& res) { s.metrics.count_response(res.status); });
  // Every /v1 route checks the key (when one is set) before anything else.
  auto guarded = [&s](std::function<void(const httplib::Request&, httplib::Response&)> handler) {
    return [&s, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        if (!s.options.api_key.empty()) {
          const std::string auth = req.get_header_value("Authorization");
          const std::string prefix = "Bearer ";
          if (!auth.starts_with(prefix) || !keys_equal(auth.substr(prefix.size()), s.options.api_key))
            throw ApiError(401, "a valid API key is required (Authorization: Bearer KEY)");
        }
        handler(req, res);
      } catch (const ApiError& e) {
        write_error(res, e.status, e.what(), e.param, e.code);
        if (e.status == 429) res.set_header("Retry-After", "1");
      } catch (const Error& e) {
        write_error(res, 400, e.what());
      }
    };
  };
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("", "text/plain"); });
  http.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(s.metrics.text(s.loop.gauges()), "text/plain; version=0.0.4");
  });
  http.Get("/v1/models", guarded([&s](const httplib::Request&, httplib::Response& res) {
             res.set_content(s.models_json(), "application/json");
           }));
  http.Post("/v1/chat/completions", guarded([&s](const httplib::Request& req, httplib::Response& res) {
              s.handle_completion(req, res, Endpoint::ChatCompletions);
            }));
  http.Post("/v1/completions", guarded([&s](const httplib::Request& req, httplib::Response& res) {
              s.handle_completion(req, res, Endpoint::Completions);
            }));
}

Server::~Server() = default;

int Server::bind() {
  State& s = *state_;
  if (s.options.port == 0) {
    s.port = s.http.bind_to_any_port(s.options.host);
    if (s.port < 0) throw Error(fmt::format("--host {}: cannot bind a port", s.options.host));
  } else {
    if (!s.http.bind_to_port(s.options.host, s.options.port))
      throw Error(fmt::format("--host {} --port {}: cannot bind (in use, or not an address of this machine)",
                              s.options.host, s.options.port));
    s.port = s.options.port;
  }
  return s.port;
}

void Server::run(const std::function<bool()>& stop_requested) {
  State& s = *state_;
  std::signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not a signal
  std::atomic<bool> listener_done{false};
  std::thread listener([&s, &listener_done] {
    s.http.listen_after_bind();
    listener_done = true;
  });
  // Stopped listening, the library ends once its workers have written their last responses
  // (streams end promptly once their requests have finished or been aborted; an idle keep-alive
  // connection is held for its 5-second timeout). Should it not, it is stopped outright.
  auto finish = [&] {
    using Clock = std::chrono::steady_clock;
    const auto give_up = Clock::now() + std::chrono::seconds(15);
    while (!listener_done && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!listener_done) s.http.stop();
    listener.join();
  };
  try {
    s.loop.run(stop_requested, [&s] { s.stop_listening(); });
  } catch (...) {
    s.stop_listening();
    finish();
    throw;
  }
  finish();
}

}  // namespace memtune

// The OpenAI-compatible server (see server.h).
#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace memtune {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// A request refused with an HTTP status and OpenAI's error fields.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param, code;
};

std::string error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

void write_error(httplib::Response& res, int status, const std::string& message, const std::string& param = {},
                 const std::string& code = {}) {
  res.status = status;
  const json body = {{"error",
                      {{"message", message},
                       {"type", error_type(status)},
                       {"param", param.empty() ? json(nullptr) : json(param)},
                       {"code", code.empty() ? json(nullptr) : json(code)}}}};
  res.set_content(body.dump(), "application/json");
}

// One request's channel between its HTTP worker and the engine thread.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;  // text not yet sent (streaming)
  bool finished = false;
  GenerationResult result;
  std::string error;  // set with finished when the engine refused the request
  std::optional<uint64_t> engine_id;
  bool cancel_requested = false;
  Clock::time_point arrived = Clock::now(), last_token;
  bool has_token = false;
};

// Prometheus histogram with fixed bounds (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // per bound, cumulative when written
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size(), 0) {}
  void observe(double v) {
    for (size_t i = 0; i < bounds.size(); ++i)
      if (v <= bounds[i]) ++counts[i];
    sum += v;
    ++count;
  }
  void write(std::string& out, const std::string& name, const std::string& help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    for (size_t i = 0; i < bounds.size(); ++i)
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], counts[i]);
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count, name, sum, name, count);
  }
};

struct Metrics {
  std::mutex mu;
  std::map<int, uint64_t> requests_by_status;
  uint64_t prompt_tokens = 0, generation_tokens = 0;
  Histogram time_to_first_token{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token_latency{{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5}};
};

// The parts of a request body the engine needs, and how to answer.
struct ParsedRequest {
  GenerationRequest request;
  std::string model;
  bool stream = false, include_usage = false;
  bool max_tokens_given = false;
};

std::string random_hex() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return fmt::format("{:016x}", salt ^ (++counter * 0x9E3779B97F4A7C15ull));
}

}  // namespace

bool keys_equal(const std::string& presented, const std::string& expected) {
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < presented.size() ? presented[i] : 0));
  return diff == 0;
}

struct Server::State {
  State(GenerationEngine& e, const Tokenizer& t, ServeOptions o) : engine(e), tokenizer(t), options(std::move(o)) {}
  GenerationEngine& engine;
  const Tokenizer& tokenizer;
  ServeOptions options;
  httplib::Server http;
  int port = 0;
  // Between the workers and the engine thread.
  std::mutex mu;
  std::condition_variable wake;
  std::vector<std::pair<GenerationRequest, std::shared_ptr<Channel>>> inbox;
  std::vector<std::shared_ptr<Channel>> cancels;
  bool closed = false;  // the engine loop has ended: nothing more is taken (guarded by mu)
  std::atomic<bool> accepting{true};
  // Published by the engine thread after every step.
  std::atomic<int64_t> running{0}, waiting{0}, blocks_free{0};
  Metrics metrics;

  void submit(GenerationRequest request, const std::shared_ptr<Channel>& channel);
  void cancel(const std::shared_ptr<Channel>& channel);
  ParsedRequest parse(const json& body, bool chat) const;
  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat);
  std::string metrics_text();
  void engine_loop(const std::function<bool()>& stop_requested);
};

void Server::State::submit(GenerationRequest request, const std::shared_ptr<Channel>& channel) {
  {
    const std::lock_guard lock(mu);
    if (closed) throw ApiError(503, "the server is shutting down");
    if (static_cast<int64_t>(inbox.size()) + waiting.load() >= options.max_queue)
      throw ApiError(429, fmt::format("the server has {} requests waiting (--max_queue {}): retry later",
                                      inbox.size() + static_cast<size_t>(waiting.load()), options.max_queue));
    inbox.emplace_back(std::move(request), channel);
  }
  wake.notify_one();
}

void Server::State::cancel(const std::shared_ptr<Channel>& channel) {
  {
    const std::lock_guard lock(mu);
    cancels.push_back(channel);
  }
  {
    const std::lock_guard lock(channel->mu);
    channel->cancel_requested = true;
  }
  wake.notify_one();
}

ParsedRequest Server::State::parse(const json& body, bool chat) const {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  ParsedRequest p;
  GenerationRequest& r = p.request;
  auto number = [&](const char* name) -> std::optional<double> {
    if (!body.contains(name) || body[name].is_null()) return std::nullopt;
    if (!body[name].is_number()) throw ApiError(400, fmt::format("{} must be a number", name), name);
    return body[name].get<double>();
  };
  auto integer = [&](const char* name) -> std::optional<int64_t> {
    if (!body.contains(name) || body[name].is_null()) return std::nullopt;
    if (!body[name].is_number_integer()) throw ApiError(400, fmt::format("{} must be an integer", name), name);
    return body[name].get<int64_t>();
  };
  auto flag = [&](const char* name) {
    if (!body.contains(name) || body[name].is_null()) return false;
    if (!body[name].is_boolean()) throw ApiError(400, fmt::format("{} must be true or false", name), name);
    return body[name].get<bool>();
  };

  // The model: the base or one of the LoRA adapters.
  p.model = options.model_name;
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) throw ApiError(400, "model must be a string", "model");
    p.model = body["model"].get<std::string>();
    if (p.model != options.model_name) {
      const auto it = std::find(options.adapter_names.begin(), options.adapter_names.end(), p.model);
      if (it == options.adapter_names.end())
        throw ApiError(404,
                       fmt::format("the model `{}` does not exist: this server has {}{}", p.model, options.model_name,
                                   options.adapter_names.empty() ? std::string()
                                                                 : fmt::format(" and the LoRA adapters {}",
                                                                               fmt::join(options.adapter_names, ", "))),
                       "model", "model_not_found");
      r.adapter = static_cast<int32_t>(it - options.adapter_names.begin());
    }
  }
  if (const auto n = integer("n"); n && *n != 1)
    throw ApiError(400, fmt::format("n = {}: this server returns one choice per request (n = 1)", *n), "n");
  for (const char* unsupported : {"logprobs", "echo"})
    if (body.contains(unsupported) && !body[unsupported].is_null() && body[unsupported] != false)
      throw ApiError(400, fmt::format("{} is not supported", unsupported), unsupported);
  if (body.contains("top_logprobs") && !body["top_logprobs"].is_null())
    throw ApiError(400, "top_logprobs is not supported", "top_logprobs");
  if (body.contains("tools") && !body["tools"].is_null() && !body["tools"].empty())
    throw ApiError(400, "tools are not supported", "tools");
  if (body.contains("suffix") && !body["suffix"].is_null()) throw ApiError(400, "suffix is not supported", "suffix");

  // The prompt.
  if (chat) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      throw ApiError(400, "messages must be a non-empty array", "messages");
    std::vector<ChatMessage> messages;
    for (const json& m : body["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        throw ApiError(400, "each message needs a role", "messages");
      ChatMessage message{.role = m["role"].get<std::string>(), .content = {}};
      const json content = m.value("content", json(nullptr));
      if (content.is_string()) {
        message.content = content.get<std::string>();
      } else if (content.is_array()) {  // content parts: the text ones, joined
        for (const json& part : content) {
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
              !part["text"].is_string())
            throw ApiError(400, "message content parts must be {\"type\": \"text\", \"text\": ...}", "messages");
          message.content += part["text"].get<std::string>();
        }
      } else {
        throw ApiError(400, "a message's content must be a string or an array of text parts", "messages");
      }
      messages.push_back(std::move(message));
    }
    bool enable_thinking = true;  // Qwen3's template argument, as vLLM takes it
    if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].is_object() &&
        body["chat_template_kwargs"].contains("enable_thinking")) {
      const json& v = body["chat_template_kwargs"]["enable_thinking"];
      if (!v.is_boolean())
        throw ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs");
      enable_thinking = v.get<bool>();
    }
    try {
      r.prompt_ids = chat_prompt_ids(tokenizer, options.chat_template, std::move(messages), {}, enable_thinking);
    } catch (const Error& e) {
      throw ApiError(400, e.what(), "messages");
    }
    r.stop_ids = options.chat_stop_ids;
  } else {
    if (!body.contains("prompt")) throw ApiError(400, "prompt is required", "prompt");
    json prompt = body["prompt"];
    if (prompt.is_array() && prompt.size() == 1 && (prompt[0].is_string() || prompt[0].is_array())) prompt = prompt[0];
    if (prompt.is_string()) {
      r.prompt_ids = tokenizer.encode(prompt.get<std::string>());
    } else if (prompt.is_array() &&
               std::all_of(prompt.begin(), prompt.end(), [](const json& x) { return x.is_number_integer(); })) {
      for (const json& id : prompt) {
        const int64_t v = id.get<int64_t>();
        if (v < 0 || v > INT32_MAX) throw ApiError(400, fmt::format("token id {} is out of range", v), "prompt");
        r.prompt_ids.push_back(static_cast<int32_t>(v));
      }
    } else {
      throw ApiError(400, "prompt must be a string or an array of token ids (one prompt per request)", "prompt");
    }
    r.stop_ids = options.completion_stop_ids;
  }
  if (r.prompt_ids.empty()) throw ApiError(400, "the prompt is empty", chat ? "messages" : "prompt");

  // Output length: max_tokens or max_completion_tokens, else what max_model_len leaves.
  std::optional<int64_t> max_tokens = integer("max_completion_tokens");
  const char* max_param = "max_completion_tokens";
  if (!max_tokens) {
    max_tokens = integer("max_tokens");
    max_param = "max_tokens";
  }
  const int64_t room = engine.model().options().kv_cache.max_model_len - static_cast<int64_t>(r.prompt_ids.size());
  if (max_tokens) {
    if (*max_tokens < 1)
      throw ApiError(400, fmt::format("{} must be at least 1, got {}", max_param, *max_tokens), max_param);
    r.max_new_tokens = *max_tokens;
    p.max_tokens_given = true;
  } else {
    if (room < 1)
      throw ApiError(400,
                     fmt::format("the prompt is {} tokens; this server's max_model_len is {}", r.prompt_ids.size(),
                                 engine.model().options().kv_cache.max_model_len),
                     chat ? "messages" : "prompt");
    r.max_new_tokens = room;
  }

  // Sampling, with OpenAI's defaults and ranges.
  SamplingParams& s = r.sampling;
  if (const auto t = number("temperature")) {
    if (*t < 0 || *t > 2) throw ApiError(400, fmt::format("temperature must be in [0, 2], got {}", *t), "temperature");
    s.temperature = *t;
  }
  if (const auto v = number("top_p")) {
    if (*v <= 0 || *v > 1) throw ApiError(400, fmt::format("top_p must be in (0, 1], got {}", *v), "top_p");
    s.top_p = *v;
  }
  if (const auto v = integer("top_k")) {
    if (*v < -1) throw ApiError(400, fmt::format("top_k must be -1, 0 or positive, got {}", *v), "top_k");
    s.top_k = *v;
  }
  if (const auto v = number("min_p")) {
    if (*v < 0 || *v > 1) throw ApiError(400, fmt::format("min_p must be in [0, 1], got {}", *v), "min_p");
    s.min_p = *v;
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"})
    if (const auto v = number(name)) {
      if (*v < -2 || *v > 2) throw ApiError(400, fmt::format("{} must be in [-2, 2], got {}", name, *v), name);
      (std::string_view(name) == "presence_penalty" ? s.presence_penalty : s.frequency_penalty) = *v;
    }
  if (const auto v = number("repetition_penalty")) {
    if (*v <= 0)
      throw ApiError(400, fmt::format("repetition_penalty must be positive, got {}", *v), "repetition_penalty");
    s.repetition_penalty = *v;
  }
  if (const auto v = integer("seed")) {
    s.seed = static_cast<uint64_t>(*v);
  } else {
    s.seed = std::random_device{}();
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      r.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && std::all_of(stop.begin(), stop.end(), [](const json& x) { return x.is_string(); })) {
      for (const json& x : stop) r.stop.push_back(x.get<std::string>());
    } else {
      throw ApiError(400, "stop must be a string or an array of strings", "stop");
    }
    for (const std::string& x : r.stop)
      if (x.empty()) throw ApiError(400, "a stop string is empty", "stop");
  }
  if (flag("ignore_eos")) r.stop_ids.clear();  // vLLM's extension: always max_tokens
  p.stream = flag("stream");
  if (body.contains("stream_options") && body["stream_options"].is_object())
    p.include_usage = body["stream_options"].value("include_usage", false);
  // What the engine refuses (prompt + max_tokens beyond max_model_len, ids outside the vocabulary).
  try {
    engine.validate(r, "request");
  } catch (const Error& e) {
    std::string message = e.what();
    if (message.starts_with("request: ")) message.erase(0, 9);
    throw ApiError(400, message, p.max_tokens_given ? max_param : (chat ? "messages" : "prompt"));
  }
  return p;
}

void Server::State::handle_completion(const httplib::Request& req, httplib::Response& res, bool chat) {
  if (!accepting) throw ApiError(503, "the server is shutting down");
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::exception& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  ParsedRequest p = parse(body, chat);
  auto channel = std::make_shared<Channel>();
  const int64_t prompt_tokens = static_cast<int64_t>(p.request.prompt_ids.size());
  submit(std::move(p.request), channel);
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + random_hex();
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const std::string object = chat ? "chat.completion" : "text_completion";
  auto usage = [prompt_tokens](int64_t completion) {
    return json{{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion},
                {"total_tokens", prompt_tokens + completion}};
  };

  if (!p.stream) {
    std::unique_lock lock(channel->mu);
    channel->cv.wait(lock, [&] { return channel->finished; });
    if (!channel->error.empty()) throw ApiError(400, channel->error);
    const GenerationResult& r = channel->result;
    if (r.finish_reason == "abort") throw ApiError(503, "the server shut down before the request finished");
    json choice = {{"index", 0}, {"finish_reason", r.finish_reason}, {"logprobs", nullptr}};
    if (chat)
      choice["message"] = {{"role", "assistant"}, {"content", r.text}};
    else
      choice["text"] = r.text;
    const json out = {
        {"id", id},         {"object", object},    {"created", created},
        {"model", p.model}, {"choices", {choice}}, {"usage", usage(static_cast<int64_t>(r.token_ids.size()))}};
    res.set_content(out.dump(), "application/json");
    return;
  }

  // Server-sent events: a chunk per piece of text, the finish, usage when asked, [DONE]. A
  // comment line every second of silence finds a client that has gone away.
  const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  auto chunk = [=](const json& choice) {
    return "data: " +
           json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", p.model}, {"choices", {choice}}}
               .dump() +
           "\n\n";
  };
  auto text_choice = [chat](const std::string& text, const json& finish) {
    json c = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
    if (chat)
      c["delta"] =
          text.empty() && finish.is_null() ? json{{"role", "assistant"}, {"content", ""}} : json{{"content", text}};
    else
      c["text"] = text;
    if (chat && !finish.is_null()) c["delta"] = json::object();
    return c;
  };
  res.set_header("Cache-Control", "no-cache");
  auto started = std::make_shared<bool>(false);
  auto last_write = std::make_shared<Clock::time_point>(Clock::now());
  const bool include_usage = p.include_usage;
  const std::string model = p.model;
  res.set_chunked_content_provider(
      "text/event-stream",
      [=, this](size_t, httplib::DataSink& sink) {
        auto send = [&](const std::string& data) {
          *last_write = Clock::now();
          return sink.write(data.data(), data.size());
        };
        if (!*started) {
          *started = true;
          if (chat && !send(chunk(text_choice("", nullptr)))) return false;
        }
        std::deque<std::string> pieces;
        bool finished = false;
        {
          std::unique_lock lock(channel->mu);
          channel->cv.wait_for(lock, std::chrono::milliseconds(100),
                               [&] { return !channel->pieces.empty() || channel->finished; });
          pieces.swap(channel->pieces);
          finished = channel->finished;
        }
        for (const std::string& piece : pieces)
          if (!send(chunk(text_choice(piece, nullptr)))) return false;
        if (!finished) {
          if (Clock::now() - *last_write > std::chrono::seconds(1)) return send(": waiting\n\n");
          return true;
        }
        if (!channel->error.empty()) {
          send("data: " + json{{"error", {{"message", channel->error}, {"type", error_type(400)}}}}.dump() + "\n\n");
        } else {
          const GenerationResult& r = channel->result;
          if (!send(chunk(text_choice("", r.finish_reason)))) return false;
          if (include_usage) {
            const json last = {{"id", id},
                               {"object", chunk_object},
                               {"created", created},
                               {"model", model},
                               {"choices", json::array()},
                               {"usage", usage(static_cast<int64_t>(r.token_ids.size()))}};
            if (!send("data: " + last.dump() + "\n\n")) return false;
          }
        }
        if (!send("data: [DONE]\n\n")) return false;
        sink.done();
        return true;
      },
      [this, channel](bool success) {
        if (!success) cancel(channel);
      });
}

std::string Server::State::metrics_text() {
  std::string out;
  const std::lock_guard lock(metrics.mu);
  out +=
      "# HELP memtune_requests_total HTTP requests answered, by status code.\n"
      "# TYPE memtune_requests_total counter\n";
  for (const auto& [status, n] : metrics.requests_by_status)
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
      metrics.prompt_tokens, metrics.generation_tokens, running.load(), waiting.load(),
      engine.total_blocks() - blocks_free.load(), blocks_free.load());
  metrics.time_to_first_token.write(out, "memtune_time_to_first_token_seconds",
                                    "Seconds from a request's arrival to its first generated token.");
  metrics.inter_token_latency.write(out, "memtune_inter_token_latency_seconds",
                                    "Seconds between consecutive tokens of a request.");
  return out;
}

void Server::State::engine_loop(const std::function<bool()>& stop_requested) {
  std::unordered_map<uint64_t, std::shared_ptr<Channel>> active;
  bool stopping = false;
  Clock::time_point deadline;
  auto publish = [&] {
    running = engine.num_running();
    waiting = engine.num_waiting();
    blocks_free = engine.free_blocks();
  };
  publish();
  for (;;) {
    if (!stopping && stop_requested()) {
      stopping = true;
      accepting = false;
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(options.shutdown_grace_seconds));
      http.stop();  // no new connections; the workers finish the requests they hold
    }
    std::vector<std::pair<GenerationRequest, std::shared_ptr<Channel>>> fresh;
    std::vector<std::shared_ptr<Channel>> cancelled;
    {
      std::unique_lock lock(mu);
      if (inbox.empty() && cancels.empty() && engine.idle())
        wake.wait_for(lock, std::chrono::milliseconds(20), [&] { return !inbox.empty() || !cancels.empty(); });
      fresh.swap(inbox);
      cancelled.swap(cancels);
    }
    for (auto& [request, channel] : fresh) {
      const int64_t prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
      RequestCallbacks callbacks;
      callbacks.on_text = [channel](std::string_view piece) {
        {
          const std::lock_guard lock(channel->mu);
          channel->pieces.emplace_back(piece);
        }
        channel->cv.notify_all();
      };
      callbacks.on_token = [this, channel](int32_t) {
        const auto now = Clock::now();
        const std::lock_guard lock(metrics.mu);
        if (channel->has_token)
          metrics.inter_token_latency.observe(std::chrono::duration<double>(now - channel->last_token).count());
        else
          metrics.time_to_first_token.observe(std::chrono::duration<double>(now - channel->arrived).count());
        channel->has_token = true;
        channel->last_token = now;
      };
      callbacks.on_finish = [this, channel, prompt_tokens, &active](GenerationResult&& result) {
        {
          const std::lock_guard lock(metrics.mu);
          metrics.prompt_tokens += static_cast<uint64_t>(prompt_tokens);
          metrics.generation_tokens += result.token_ids.size();
        }
        if (channel->engine_id) active.erase(*channel->engine_id);
        {
          const std::lock_guard lock(channel->mu);
          channel->result = std::move(result);
          channel->finished = true;
        }
        channel->cv.notify_all();
      };
      try {
        const uint64_t id = engine.add(std::move(request), std::move(callbacks));
        channel->engine_id = id;
        active[id] = channel;
      } catch (const Error& e) {
        {
          const std::lock_guard lock(channel->mu);
          channel->error = e.what();
          channel->finished = true;
        }
        channel->cv.notify_all();
      }
    }
    for (const auto& channel : cancelled)
      if (channel->engine_id) engine.cancel(*channel->engine_id);
    if (stopping && Clock::now() >= deadline) {
      std::vector<uint64_t> ids;
      for (const auto& [id, channel] : active) ids.push_back(id);
      for (const uint64_t id : ids) engine.cancel(id);
    }
    if (!engine.idle()) engine.step();
    publish();
    if (stopping && engine.idle()) {
      const std::lock_guard lock(mu);
      if (inbox.empty()) {
        closed = true;  // a request that passed the accepting check late gets 503 from submit
        break;
      }
    }
  }
}

Server::Server(GenerationEngine& engine, const Tokenizer& tokenizer, ServeOptions options)
    : state_(std::make_unique<State>(engine, tokenizer, std::move(options))) {
  State& s = *state_;
  httplib::Server& http = s.http;
  const size_t threads = s.options.http_threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(s.options.max_body_bytes);
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
  http.set_logger([&s](const httplib::Request&, const httplib::Response& res) {
    const std::lock_guard lock(s.metrics.mu);
    ++s.metrics.requests_by_status[res.status];
  });
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
    res.set_content(s.metrics_text(), "text/plain; version=0.0.4");
  });
  http.Get("/v1/models", guarded([&s](const httplib::Request&, httplib::Response& res) {
             const int64_t created = static_cast<int64_t>(std::time(nullptr));
             const int64_t max_len = s.engine.model().options().kv_cache.max_model_len;
             json data = json::array();
             data.push_back({{"id", s.options.model_name},
                             {"object", "model"},
                             {"created", created},
                             {"owned_by", "memtune"},
                             {"root", s.options.model_name},
                             {"parent", nullptr},
                             {"max_model_len", max_len}});
             for (const std::string& name : s.options.adapter_names)
               data.push_back({{"id", name},
                               {"object", "model"},
                               {"created", created},
                               {"owned_by", "memtune"},
                               {"root", name},
                               {"parent", s.options.model_name},
                               {"max_model_len", max_len}});
             res.set_content(json{{"object", "list"}, {"data", data}}.dump(), "application/json");
           }));
  http.Post("/v1/chat/completions", guarded([&s](const httplib::Request& req, httplib::Response& res) {
              s.handle_completion(req, res, true);
            }));
  http.Post("/v1/completions", guarded([&s](const httplib::Request& req, httplib::Response& res) {
              s.handle_completion(req, res, false);
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
  std::thread listener([&s] { s.http.listen_after_bind(); });
  try {
    s.engine_loop(stop_requested);
  } catch (...) {
    s.http.stop();
    listener.join();
    throw;
  }
  listener.join();
}

}  // namespace memtune

// OpenAI's completion responses and stream events (see completion_response.h).
#include "serve/completion_response.h"

#include <fmt/format.h>

#include <atomic>
#include <ctime>
#include <random>

#include <nlohmann/json.hpp>

#include "serve/api_error.h"

namespace memtune {

namespace {

using json = nlohmann::json;

std::string random_hex() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return fmt::format("{:016x}", salt ^ (++counter * 0x9E3779B97F4A7C15ull));
}

json usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

std::string event(const json& data) {
  return "data: " + data.dump() + "\n\n";
}

// A streamed choice: chat's delta (the role on the opening event, nothing on the finish) or a
// completion's text.
json stream_choice(bool chat, const std::string& text, const json& finish) {
  json c = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
  if (chat)
    c["delta"] =
        text.empty() && finish.is_null() ? json{{"role", "assistant"}, {"content", ""}} : json{{"content", text}};
  else
    c["text"] = text;
  if (chat && !finish.is_null()) c["delta"] = json::object();
  return c;
}

}  // namespace

CompletionResponse::CompletionResponse(Endpoint endpoint, std::string model, int64_t prompt_tokens, bool token_ids)
    : chat_(endpoint == Endpoint::ChatCompletions),
      token_ids_(token_ids),
      id_((chat_ ? "chatcmpl-" : "cmpl-") + random_hex()),
      model_(std::move(model)),
      created_(static_cast<int64_t>(std::time(nullptr))),
      prompt_tokens_(prompt_tokens) {}

std::string CompletionResponse::whole(const GenerationResult& result) const {
  json choice = {{"index", 0}, {"finish_reason", result.finish_reason}, {"logprobs", nullptr}};
  if (chat_)
    choice["message"] = {{"role", "assistant"}, {"content", result.text}};
  else
    choice["text"] = result.text;
  if (token_ids_) choice["token_ids"] = result.token_ids;
  const json out = {
      {"id", id_},           {"object", chat_ ? "chat.completion" : "text_completion"},
      {"created", created_}, {"model", model_},
      {"choices", {choice}}, {"usage", usage(prompt_tokens_, static_cast<int64_t>(result.token_ids.size()))}};
  return out.dump();
}

std::string CompletionResponse::opening_event() const {
  if (!chat_) return {};
  return text_event("");
}

std::string CompletionResponse::text_event(const std::string& text) const {
  return event(chunk(json::array({stream_choice(chat_, text, nullptr)})));
}

std::string CompletionResponse::token_ids_event(const std::vector<int32_t>& ids) const {
  json choice = stream_choice(chat_, "", nullptr);
  choice["token_ids"] = ids;
  return event(chunk(json::array({choice})));
}

std::string CompletionResponse::finish_event(const std::string& finish_reason) const {
  return event(chunk(json::array({stream_choice(chat_, "", finish_reason)})));
}

std::string CompletionResponse::usage_event(int64_t completion_tokens) const {
  json last = chunk(json::array());
  last["usage"] = usage(prompt_tokens_, completion_tokens);
  return event(last);
}

json CompletionResponse::chunk(json choices) const {
  return {{"id", id_},
          {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", std::move(choices)}};
}

std::string CompletionResponse::error_event(const std::string& message) {
  return event({{"error", {{"message", message}, {"type", api_error_type(400)}}}});
}

}  // namespace memtune

// OpenAI request bodies to GenerationRequests (see request_parser.h).
#include "serve/request_parser.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "tokenizer/unicode.h"

namespace memtune {

namespace {

using json = nlohmann::json;

// Text for a message that may quote request bytes: invalid UTF-8 becomes U+FFFD.
std::string lossy(std::string_view text) {
  std::string out;
  tokenizer_detail::append_utf8_lossy(text, out);
  return out;
}

// The body as JSON. The depth guard runs while parsing (nlohmann's parser keeps its own stack,
// but copying and comparing values recurse, so 100,000 nested arrays would overflow ours). A
// body that is not UTF-8 is refused naming the top-level field whose value held the bad bytes.
json parse_body(std::string_view body) {
  std::string field;  // the top-level field whose value is being read
  const json::parser_callback_t watch = [&field](int depth, json::parse_event_t event, json& parsed) {
    using Event = json::parse_event_t;
    if ((event == Event::object_start || event == Event::array_start) && depth >= kMaxRequestJsonDepth)
      throw ApiError(
          400, fmt::format("the request body nests arrays and objects deeper than {} levels", kMaxRequestJsonDepth));
    if (depth == 1 && event == Event::key) field = parsed.get<std::string>();
    if (depth == 1 && (event == Event::value || event == Event::object_end || event == Event::array_end)) field.clear();
    return true;
  };
  try {
    return json::parse(body, watch);
  } catch (const json::parse_error& e) {
    // The parser stops at the first byte that is not UTF-8, so bad bytes before the error's
    // position are its cause (a character cut at that position is not).
    const std::string_view read = body.substr(0, std::min(static_cast<size_t>(e.byte), body.size()));
    if (!tokenizer_detail::is_valid_utf8(read.substr(0, tokenizer_detail::complete_utf8_prefix(read)))) {
      if (field.empty()) throw ApiError(400, "the request body is not valid UTF-8 text");
      throw ApiError(400, fmt::format("{} is not valid UTF-8 text", field), field);
    }
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", lossy(e.what())));
  } catch (const json::exception& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", lossy(e.what())));
  }
}

// The fields of a JSON object; absent and null are the same.
class Fields {
 public:
  explicit Fields(const json& body) : body_(body) {}
  bool has(const char* name) const { return body_.contains(name) && !body_[name].is_null(); }
  const json& operator[](const char* name) const { return body_[name]; }
  std::optional<double> number(const char* name) const {
    if (!has(name)) return std::nullopt;
    if (!body_[name].is_number()) throw ApiError(400, fmt::format("{} must be a number", name), name);
    return body_[name].get<double>();
  }
  std::optional<int64_t> integer(const char* name) const {
    if (!has(name)) return std::nullopt;
    const json& v = body_[name];
    if (!v.is_number_integer()) throw ApiError(400, fmt::format("{} must be an integer", name), name);
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw ApiError(400, fmt::format("{} = {} is beyond the 64-bit integer range", name, v.dump()), name);
    return v.get<int64_t>();
  }
  bool flag(const char* name) const {
    if (!has(name)) return false;
    if (!body_[name].is_boolean()) throw ApiError(400, fmt::format("{} must be true or false", name), name);
    return body_[name].get<bool>();
  }

 private:
  const json& body_;
};

// The adapter set `model` selects (-1: the base model), or 404.
int32_t adapter_of(const std::string& model, const ServedModel& served) {
  if (model == served.name) return -1;
  const auto it = std::find(served.adapter_names.begin(), served.adapter_names.end(), model);
  if (it == served.adapter_names.end())
    throw ApiError(404,
                   fmt::format("the model `{}` does not exist: this server has {}{}", model, served.name,
                               served.adapter_names.empty()
                                   ? std::string()
                                   : fmt::format(" and the LoRA adapters {}", fmt::join(served.adapter_names, ", "))),
                   "model", "model_not_found");
  return static_cast<int32_t>(it - served.adapter_names.begin());
}

// A chat request's messages rendered with the chat template, as ids.
std::vector<int32_t> chat_prompt(const Fields& body, const ServedModel& served) {
  if (!body.has("messages") || !body["messages"].is_array() || body["messages"].empty())
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
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
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
  if (body.has("chat_template_kwargs") && body["chat_template_kwargs"].is_object() &&
      body["chat_template_kwargs"].contains("enable_thinking")) {
    const json& v = body["chat_template_kwargs"]["enable_thinking"];
    if (!v.is_boolean())
      throw ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs");
    enable_thinking = v.get<bool>();
  }
  try {
    return chat_prompt_ids(*served.tokenizer, served.chat_template, std::move(messages), {}, enable_thinking);
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "messages");
  }
}

// A completion request's prompt: a string, or token ids (either alone in a one-element array).
std::vector<int32_t> completion_prompt(const Fields& body, const ServedModel& served) {
  const json* prompt = &body["prompt"];
  if (prompt->is_array() && prompt->size() == 1 && ((*prompt)[0].is_string() || (*prompt)[0].is_array()))
    prompt = &(*prompt)[0];
  if (prompt->is_string()) {
    if (!served.tokenizer)
      throw ApiError(400,
                     "this server was started with --skip_tokenizer_init: the prompt must be token ids, e.g. "
                     "\"prompt\": [9707, 1879]",
                     "prompt");
    return served.tokenizer->encode(prompt->get<std::string>());
  }
  if (!prompt->is_array() ||
      !std::all_of(prompt->begin(), prompt->end(), [](const json& x) { return x.is_number_integer(); }))
    throw ApiError(400, "prompt must be a string or an array of token ids (one prompt per request)", "prompt");
  std::vector<int32_t> ids;
  for (const json& id : *prompt) {
    const bool in_range = id.is_number_unsigned() ? id.get<uint64_t>() <= INT32_MAX
                                                  : id.get<int64_t>() >= 0 && id.get<int64_t>() <= INT32_MAX;
    if (!in_range) throw ApiError(400, fmt::format("token id {} is out of range", id.dump()), "prompt");
    if (served.vocab_size > 0 && id.get<int64_t>() >= served.vocab_size)
      throw ApiError(400, fmt::format("token id {} is outside the vocabulary [0, {})", id.dump(), served.vocab_size),
                     "prompt");
    ids.push_back(id.get<int32_t>());
  }
  return ids;
}

// The model (the base or one of the LoRA adapters), and what no request may ask for.
void take_model(const Fields& body, const ServedModel& served, ParsedRequest& p) {
  GenerationRequest& r = p.request;
  p.model = served.name;
  if (body.has("model")) {
    if (!body["model"].is_string()) throw ApiError(400, "model must be a string", "model");
    p.model = body["model"].get<std::string>();
    r.adapter = adapter_of(p.model, served);
  }
  if (const auto n = body.integer("n"); n && *n != 1)
    throw ApiError(400, fmt::format("n = {}: this server returns one choice per request (n = 1)", *n), "n");
  for (const char* unsupported : {"logprobs", "echo"})
    if (body.has(unsupported) && body[unsupported] != false)
      throw ApiError(400, fmt::format("{} is not supported", unsupported), unsupported);
  if (body.has("top_logprobs")) throw ApiError(400, "top_logprobs is not supported", "top_logprobs");
  if (body.has("tools") && !body["tools"].empty()) throw ApiError(400, "tools are not supported", "tools");
  if (body.has("suffix")) throw ApiError(400, "suffix is not supported", "suffix");
}

// The prompt's ids, and the model's own stop ids for the endpoint.
void take_prompt(const Fields& body, const json& document, bool chat, const ServedModel& served,
                 GenerationRequest& r) {
  const char* prompt_param = chat ? "messages" : "prompt";
  if (chat && !served.tokenizer)
    throw ApiError(400,
                   "this server was started with --skip_tokenizer_init: chat messages need the tokenizer; send "
                   "token ids to /v1/completions",
                   "messages");
  if (chat) {
    r.prompt_ids = chat_prompt(body, served);
    r.stop_ids = served.chat_stop_ids;
  } else {
    if (!document.contains("prompt")) throw ApiError(400, "prompt is required", "prompt");
    r.prompt_ids = completion_prompt(body, served);
    r.stop_ids = served.completion_stop_ids;
  }
  if (r.prompt_ids.empty()) throw ApiError(400, "the prompt is empty", prompt_param);
}

// Output length: max_tokens or max_completion_tokens, else what max_model_len leaves.
void take_output_length(const Fields& body, const ServedModel& served, const char* prompt_param, ParsedRequest& p) {
  GenerationRequest& r = p.request;
  std::optional<int64_t> max_tokens = body.integer("max_completion_tokens");
  const char* max_param = "max_completion_tokens";
  if (!max_tokens) {
    max_tokens = body.integer("max_tokens");
    max_param = "max_tokens";
  }
  p.engine_refusal_param = max_tokens ? max_param : prompt_param;
  if (max_tokens) {
    if (*max_tokens < 1)
      throw ApiError(400, fmt::format("{} must be at least 1, got {}", max_param, *max_tokens), max_param);
    r.max_new_tokens = *max_tokens;
  } else {
    const int64_t room = served.max_model_len - static_cast<int64_t>(r.prompt_ids.size());
    if (room < 1)
      throw ApiError(400,
                     fmt::format("the prompt is {} tokens; this server's max_model_len is {}", r.prompt_ids.size(),
                                 served.max_model_len),
                     prompt_param);
    r.max_new_tokens = room;
  }
}

// Sampling, with OpenAI's defaults and ranges (closed at both ends where OpenAI's are).
void take_sampling(const Fields& body, SamplingParams& s) {
  if (const auto t = body.number("temperature")) {
    if (*t < 0 || *t > 2) throw ApiError(400, fmt::format("temperature must be in [0, 2], got {}", *t), "temperature");
    s.temperature = *t;
  }
  if (const auto v = body.number("top_p")) {
    if (*v <= 0 || *v > 1) throw ApiError(400, fmt::format("top_p must be in (0, 1], got {}", *v), "top_p");
    s.top_p = *v;
  }
  if (const auto v = body.integer("top_k")) {
    if (*v < -1) throw ApiError(400, fmt::format("top_k must be -1, 0 or positive, got {}", *v), "top_k");
    s.top_k = *v;
  }
  if (const auto v = body.number("min_p")) {
    if (*v < 0 || *v > 1) throw ApiError(400, fmt::format("min_p must be in [0, 1], got {}", *v), "min_p");
    s.min_p = *v;
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"})
    if (const auto v = body.number(name)) {
      if (*v < -2 || *v > 2) throw ApiError(400, fmt::format("{} must be in [-2, 2], got {}", name, *v), name);
      (std::string_view(name) == "presence_penalty" ? s.presence_penalty : s.frequency_penalty) = *v;
    }
  if (const auto v = body.number("repetition_penalty")) {
    if (*v <= 0)
      throw ApiError(400, fmt::format("repetition_penalty must be positive, got {}", *v), "repetition_penalty");
    s.repetition_penalty = *v;
  }
  if (body.has("seed")) {  // any 64-bit integer, negative ones as their two's complement
    if (!body["seed"].is_number_integer()) throw ApiError(400, "seed must be an integer", "seed");
    s.seed = body["seed"].get<uint64_t>();
  } else {
    s.seed = std::random_device{}();
  }
}

// Stop strings, ignore_eos and vLLM's stop_token_ids (each below the vocabulary).
void take_stops(const Fields& body, const ServedModel& served, GenerationRequest& r) {
  if (body.has("stop")) {
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
    if (!r.stop.empty() && !served.tokenizer)
      throw ApiError(400,
                     "stop strings are matched in text, which a server started with --skip_tokenizer_init does not "
                     "make: use stop_token_ids",
                     "stop");
  }
  if (body.flag("ignore_eos")) r.stop_ids.clear();  // vLLM's extension: always max_tokens
  if (body.has("stop_token_ids")) {  // vLLM's extension: more ids that end the reply
    const json& ids = body["stop_token_ids"];
    if (!ids.is_array()) throw ApiError(400, "stop_token_ids must be an array of token ids", "stop_token_ids");
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          (served.vocab_size > 0 && id.get<int64_t>() >= served.vocab_size))
        throw ApiError(400, fmt::format("stop_token_ids: {} is not a token id of this model", id.dump()),
                       "stop_token_ids");
      r.stop_ids.push_back(id.get<int32_t>());
    }
  }
}

void take_streaming(const Fields& body, ParsedRequest& p) {
  p.stream = body.flag("stream");
  if (body.has("stream_options") && body["stream_options"].is_object() &&
      body["stream_options"].contains("include_usage") && !body["stream_options"]["include_usage"].is_null()) {
    const json& v = body["stream_options"]["include_usage"];
    if (!v.is_boolean()) throw ApiError(400, "stream_options.include_usage must be true or false", "stream_options");
    p.include_usage = v.get<bool>();
  }
}

}  // namespace

ParsedRequest parse_request(std::string_view text, Endpoint endpoint, const ServedModel& served) {
  const json document = parse_body(text);
  if (!document.is_object()) throw ApiError(400, "the request body must be a JSON object");
  const Fields body(document);
  const bool chat = endpoint == Endpoint::ChatCompletions;
  ParsedRequest p;
  take_model(body, served, p);
  take_prompt(body, document, chat, served, p.request);
  take_output_length(body, served, chat ? "messages" : "prompt", p);
  take_sampling(body, p.request.sampling);
  take_stops(body, served, p.request);
  take_streaming(body, p);
  // The engine adds max_tokens to the prompt's length (GenerationEngine::validate, which the
  // server runs next): a value no prompt leaves room for is refused here, before that sum.
  if (p.request.max_new_tokens > served.max_model_len)
    throw ApiError(400,
                   fmt::format("{} = {} is beyond this server's max_model_len {}", p.engine_refusal_param,
                               p.request.max_new_tokens, served.max_model_len),
                   p.engine_refusal_param);
  return p;
}

ApiError engine_refusal(const Error& error, const ParsedRequest& parsed) {
  std::string message = error.what();
  if (message.starts_with("request: ")) message.erase(0, 9);
  return ApiError(400, message, parsed.engine_refusal_param);
}

}  // namespace memtune

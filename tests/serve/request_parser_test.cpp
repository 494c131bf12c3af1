// The OpenAI request parser on its own: every refusal has its status, the parameter at fault and
// a message saying what was expected; accepted bodies become the GenerationRequest they ask
// for. A small synthetic tokenizer stands in for Qwen2.5's; the engine's own checks run on a
// tiny model.
#include "serve/request_parser.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "model/kv_cache.h"
#include "support/test_util.h"
#include "tokenizer/unicode.h"
#include "options/inference_options.h"

namespace memtune {
namespace {

using nlohmann::json;
using testing_support::kSyntheticEndOfText;
using testing_support::kSyntheticImEnd;

constexpr int64_t kMaxModelLen = 256;  // Qwen2.5's default system message is 98 synthetic tokens

class RequestParser : public ::testing::Test {
 protected:
  const Tokenizer tokenizer = testing_support::synthetic_tokenizer();
  const ServedModel served{.tokenizer = &tokenizer,
                           .name = "base",
                           .adapter_names = {"sql", "poems"},
                           .chat_template = ChatTemplate::Qwen2_5,
                           .chat_stop_ids = {kSyntheticEndOfText, kSyntheticImEnd},
                           .completion_stop_ids = {kSyntheticEndOfText},
                           .max_model_len = kMaxModelLen};

  ParsedRequest completion(const std::string& body) const { return parse_request(body, Endpoint::Completions, served); }
  ParsedRequest chat(const std::string& body) const { return parse_request(body, Endpoint::ChatCompletions, served); }
  // The refusal of `body`; a test failure when it is accepted.
  ApiError refusal(const std::string& body, Endpoint endpoint = Endpoint::Completions) const {
    return refusal_by(served, body, endpoint);
  }
  static ApiError refusal_by(const ServedModel& model, const std::string& body, Endpoint endpoint) {
    try {
      parse_request(body, endpoint, model);
    } catch (const ApiError& e) {
      return e;
    }
    ADD_FAILURE() << "accepted: " << body;
    return ApiError(0, "");
  }
  // A completion body: {"prompt": "hello", <fields>}.
  ApiError field_refusal(const std::string& fields) const { return refusal(R"({"prompt": "hello", )" + fields + "}"); }
};

#define EXPECT_REFUSED(error, status_, param_, part) \
  do {                                               \
    const ApiError e_ = (error);                     \
    EXPECT_EQ(e_.status, status_) << e_.what();      \
    EXPECT_EQ(e_.param, param_) << e_.what();        \
    EXPECT_CONTAINS(std::string(e_.what()), part);   \
  } while (0)

TEST_F(RequestParser, MalformedJsonIsRefused) {
  EXPECT_REFUSED(refusal(R"({"messages": [oops)", Endpoint::ChatCompletions), 400, "", "not valid JSON");
  EXPECT_REFUSED(refusal(""), 400, "", "not valid JSON");
  EXPECT_REFUSED(refusal(R"({"prompt": "hi",})"), 400, "", "not valid JSON");
  EXPECT_REFUSED(refusal(R"({"prompt": "hi"} trailing)"), 400, "", "not valid JSON");
}

TEST_F(RequestParser, BodyMustBeAnObject) {
  for (const char* body : {"[1, 2]", R"("hello")", "5", "null", "true"})
    EXPECT_REFUSED(refusal(body), 400, "", "the request body must be a JSON object");
}

TEST_F(RequestParser, WrongTypesNameTheirField) {
  struct Case {
    const char* fields;
    const char* param;
    const char* message;
  };
  const std::vector<Case> cases = {
      {R"("model": 5)", "model", "model must be a string"},
      {R"("max_tokens": "10")", "max_tokens", "max_tokens must be an integer"},
      {R"("max_tokens": 1.5)", "max_tokens", "max_tokens must be an integer"},
      {R"("max_completion_tokens": [4])", "max_completion_tokens", "max_completion_tokens must be an integer"},
      {R"("temperature": "hot")", "temperature", "temperature must be a number"},
      {R"("top_p": true)", "top_p", "top_p must be a number"},
      {R"("top_k": 0.5)", "top_k", "top_k must be an integer"},
      {R"("min_p": "0.1")", "min_p", "min_p must be a number"},
      {R"("presence_penalty": {})", "presence_penalty", "presence_penalty must be a number"},
      {R"("frequency_penalty": [])", "frequency_penalty", "frequency_penalty must be a number"},
      {R"("repetition_penalty": "1")", "repetition_penalty", "repetition_penalty must be a number"},
      {R"("seed": "1")", "seed", "seed must be an integer"},
      {R"("seed": 1.5)", "seed", "seed must be an integer"},
      {R"("n": "2")", "n", "n must be an integer"},
      {R"("stop": 5)", "stop", "stop must be a string or an array of strings"},
      {R"("stop": ["a", 1])", "stop", "stop must be a string or an array of strings"},
      {R"("stop": "")", "stop", "a stop string is empty"},
      {R"("stream": "yes")", "stream", "stream must be true or false"},
      {R"("stream": 1)", "stream", "stream must be true or false"},
      {R"("ignore_eos": 1)", "ignore_eos", "ignore_eos must be true or false"},
      {R"("stream_options": {"include_usage": "yes"})", "stream_options",
       "stream_options.include_usage must be true or false"},
  };
  for (const Case& c : cases) EXPECT_REFUSED(field_refusal(c.fields), 400, c.param, c.message);
}

TEST_F(RequestParser, CompletionPromptForms) {
  const std::vector<int32_t> hello = tokenizer.encode("hello");
  EXPECT_EQ(completion(R"({"prompt": "hello"})").request.prompt_ids, hello);
  EXPECT_EQ(completion(R"({"prompt": ["hello"]})").request.prompt_ids, hello);  // one prompt in a list
  EXPECT_EQ(completion(R"({"prompt": [1, 2, 3]})").request.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(completion(R"({"prompt": [[1, 2, 3]]})").request.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  for (const char* prompt : {"5", R"({"a": 1})", R"([1, "x"])", R"(["a", "b"])", R"([[1], [2]])", "null", "true"})
    EXPECT_REFUSED(refusal(std::string(R"({"prompt": )") + prompt + "}"), 400, "prompt",
                   "prompt must be a string or an array of token ids (one prompt per request)");
  EXPECT_REFUSED(refusal(R"({"messages": [{"role": "user", "content": "hi"}]})"), 400, "prompt", "prompt is required");
  EXPECT_REFUSED(refusal(R"({"prompt": ""})"), 400, "prompt", "the prompt is empty");
  EXPECT_REFUSED(refusal(R"({"prompt": []})"), 400, "prompt", "the prompt is empty");
  EXPECT_REFUSED(refusal(R"({"prompt": [-1]})"), 400, "prompt", "token id -1 is out of range");
  EXPECT_REFUSED(refusal(R"({"prompt": [2147483648]})"), 400, "prompt", "token id 2147483648 is out of range");
  EXPECT_REFUSED(refusal(R"({"prompt": [9223372036854775808]})"), 400, "prompt",
                 "token id 9223372036854775808 is out of range");
  const ParsedRequest p = completion(R"({"prompt": "hello"})");
  EXPECT_EQ(p.request.stop_ids, served.completion_stop_ids);
  EXPECT_EQ(p.request.max_new_tokens, kMaxModelLen - static_cast<int64_t>(hello.size()));  // what is left
  EXPECT_EQ(p.engine_refusal_param, "prompt");
}

TEST_F(RequestParser, ChatMessagesBecomeTheTemplatedPrompt) {
  const std::vector<int32_t> expected =
      chat_prompt_ids(tokenizer, ChatTemplate::Qwen2_5, {{.role = "user", .content = "hello world"}}, {});
  const ParsedRequest p = chat(R"({"messages": [{"role": "user", "content": "hello world"}]})");
  EXPECT_EQ(p.request.prompt_ids, expected);
  EXPECT_EQ(p.request.stop_ids, served.chat_stop_ids);
  EXPECT_EQ(p.engine_refusal_param, "messages");
  // Text content parts are joined.
  EXPECT_EQ(chat(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                               {"type": "text", "text": " world"}]}]})")
                .request.prompt_ids,
            expected);
  EXPECT_EQ(
      chat(R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}})")
          .request.prompt_ids,
      chat_prompt_ids(tokenizer, ChatTemplate::Qwen2_5, {{.role = "user", .content = "hi"}}, {}, false));
}

TEST_F(RequestParser, ChatMessageRefusals) {
  const auto chat_refusal = [&](const std::string& messages) {
    return refusal(R"({"messages": )" + messages + "}", Endpoint::ChatCompletions);
  };
  EXPECT_REFUSED(refusal("{}", Endpoint::ChatCompletions), 400, "messages", "messages must be a non-empty array");
  for (const char* messages : {"[]", R"("hi")", "null", "{}"})
    EXPECT_REFUSED(chat_refusal(messages), 400, "messages", "messages must be a non-empty array");
  for (const char* messages : {"[5]", R"([{"content": "hi"}])", R"([{"role": 1, "content": "hi"}])"})
    EXPECT_REFUSED(chat_refusal(messages), 400, "messages", "each message needs a role");
  for (const char* messages : {R"([{"role": "user", "content": 5}])", R"([{"role": "user"}])"})
    EXPECT_REFUSED(chat_refusal(messages), 400, "messages",
                   "a message's content must be a string or an array of text parts");
  for (const char* messages :
       {R"([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])",
        R"([{"role": "user", "content": [{"type": 5, "text": "x"}]}])",
        R"([{"role": "user", "content": [{"type": null, "text": "x"}]}])",
        R"([{"role": "user", "content": [{"type": "text", "text": 5}]}])", R"([{"role": "user", "content": ["x"]}])"})
    EXPECT_REFUSED(chat_refusal(messages), 400, "messages", "message content parts must be");
  EXPECT_REFUSED(chat_refusal(R"([{"role": "assistant", "content": "hi"}])"), 400, "messages", "message 0");
  EXPECT_REFUSED(chat_refusal(R"([{"role": "robot", "content": "hi"}])"), 400, "messages", "unknown role \"robot\"");
  EXPECT_REFUSED(refusal(R"({"messages": [{"role": "user", "content": "hi"}],
                             "chat_template_kwargs": {"enable_thinking": "no"}})",
                         Endpoint::ChatCompletions),
                 400, "chat_template_kwargs", "chat_template_kwargs.enable_thinking must be true or false");
}

TEST_F(RequestParser, RangesAreOpenAIs) {
  EXPECT_REFUSED(field_refusal(R"("temperature": 2.5)"), 400, "temperature", "temperature must be in [0, 2], got 2.5");
  EXPECT_REFUSED(field_refusal(R"("temperature": -0.1)"), 400, "temperature", "temperature must be in [0, 2]");
  EXPECT_REFUSED(field_refusal(R"("top_p": 0)"), 400, "top_p", "top_p must be in (0, 1], got 0");
  EXPECT_REFUSED(field_refusal(R"("top_k": -2)"), 400, "top_k", "top_k must be -1, 0 or positive, got -2");
  EXPECT_REFUSED(field_refusal(R"("min_p": 1.5)"), 400, "min_p", "min_p must be in [0, 1], got 1.5");
  EXPECT_REFUSED(field_refusal(R"("presence_penalty": -3)"), 400, "presence_penalty",
                 "presence_penalty must be in [-2, 2], got -3");
  EXPECT_REFUSED(field_refusal(R"("frequency_penalty": 2.5)"), 400, "frequency_penalty",
                 "frequency_penalty must be in [-2, 2], got 2.5");
  EXPECT_REFUSED(field_refusal(R"("repetition_penalty": 0)"), 400, "repetition_penalty",
                 "repetition_penalty must be positive, got 0");
}

TEST_F(RequestParser, SamplingFieldsAreTaken) {
  const ParsedRequest p = completion(R"({"prompt": "hello", "temperature": 0.5, "top_p": 0.9, "top_k": 5,
      "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 42,
      "stop": ["a", "bc"], "max_tokens": 7, "stream": true, "stream_options": {"include_usage": true}})");
  const SamplingParams& s = p.request.sampling;
  EXPECT_EQ(s.temperature, 0.5);
  EXPECT_EQ(s.top_p, 0.9);
  EXPECT_EQ(s.top_k, 5);
  EXPECT_EQ(s.min_p, 0.1);
  EXPECT_EQ(s.presence_penalty, 0.5);
  EXPECT_EQ(s.frequency_penalty, -0.5);
  EXPECT_EQ(s.repetition_penalty, 1.1);
  EXPECT_EQ(s.seed, 42u);
  EXPECT_EQ(p.request.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(p.request.max_new_tokens, 7);
  EXPECT_EQ(p.engine_refusal_param, "max_tokens");
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  EXPECT_EQ(completion(R"({"prompt": "hello", "stop": "x"})").request.stop, (std::vector<std::string>{"x"}));
  EXPECT_TRUE(completion(R"({"prompt": "hello", "ignore_eos": true})").request.stop_ids.empty());
  // Nulls are absent fields.
  const ParsedRequest nulls = completion(R"({"prompt": "hello", "temperature": null, "stream": null, "stop": null,
      "stream_options": {"include_usage": null}, "model": null, "n": null, "logprobs": null})");
  EXPECT_EQ(nulls.request.sampling.temperature, 1.0);
  EXPECT_FALSE(nulls.stream);
  EXPECT_FALSE(nulls.include_usage);
  EXPECT_EQ(nulls.model, "base");
}

// The limits themselves are taken, each kept as given: the ranges are closed where vLLM's are.
TEST_F(RequestParser, SamplingLimitsThemselvesAreAccepted) {
  const SamplingParams high = completion(R"({"prompt": "hello", "temperature": 2, "top_p": 1, "top_k": -1,
      "min_p": 1, "presence_penalty": 2, "frequency_penalty": 2})").request.sampling;
  EXPECT_EQ(high.temperature, 2.0);
  EXPECT_EQ(high.top_p, 1.0);
  EXPECT_EQ(high.top_k, -1);
  EXPECT_EQ(high.min_p, 1.0);
  EXPECT_EQ(high.presence_penalty, 2.0);
  EXPECT_EQ(high.frequency_penalty, 2.0);
  const SamplingParams low = completion(R"({"prompt": "hello", "temperature": 0, "top_k": 0, "min_p": 0,
      "presence_penalty": -2, "frequency_penalty": -2})").request.sampling;
  EXPECT_EQ(low.temperature, 0.0);
  EXPECT_EQ(low.top_k, 0);
  EXPECT_EQ(low.min_p, 0.0);
  EXPECT_EQ(low.presence_penalty, -2.0);
  EXPECT_EQ(low.frequency_penalty, -2.0);
}

TEST_F(RequestParser, MaxTokens) {
  EXPECT_REFUSED(field_refusal(R"("max_tokens": -3)"), 400, "max_tokens", "max_tokens must be at least 1, got -3");
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 0)"), 400, "max_tokens", "max_tokens must be at least 1, got 0");
  EXPECT_REFUSED(field_refusal(R"("max_completion_tokens": 0)"), 400, "max_completion_tokens",
                 "max_completion_tokens must be at least 1");
  // max_completion_tokens wins over max_tokens.
  EXPECT_EQ(completion(R"({"prompt": "hello", "max_completion_tokens": 3, "max_tokens": 9})").request.max_new_tokens,
            3);
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 257)"), 400, "max_tokens",
                 "max_tokens = 257 is beyond this server's max_model_len 256");
  // Without max_tokens, a prompt that leaves no room is refused naming the prompt.
  EXPECT_REFUSED(refusal(json{{"prompt", std::vector<int32_t>(kMaxModelLen, 7)}}.dump()), 400, "prompt",
                 "the prompt is 256 tokens; this server's max_model_len is 256");
}

TEST_F(RequestParser, HugeNumbers) {
  EXPECT_REFUSED(field_refusal(R"("temperature": 1e400)"), 400, "", "not valid JSON");
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 9223372036854775807)"), 400, "max_tokens",
                 "max_tokens = 9223372036854775807 is beyond this server's max_model_len 256");
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 9223372036854775808)"), 400, "max_tokens",
                 "max_tokens = 9223372036854775808 is beyond the 64-bit integer range");
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 18446744073709551616)"), 400, "max_tokens",
                 "max_tokens must be an integer");  // past uint64: a float
  EXPECT_REFUSED(field_refusal(R"("max_tokens": 1e30)"), 400, "max_tokens", "max_tokens must be an integer");
  EXPECT_REFUSED(field_refusal(R"("max_tokens": -9223372036854775809)"), 400, "max_tokens",
                 "max_tokens must be an integer");
  EXPECT_REFUSED(field_refusal(R"("n": 9223372036854775808)"), 400, "n", "n = 9223372036854775808 is beyond");
  EXPECT_REFUSED(field_refusal(R"("temperature": 1e300)"), 400, "temperature", "temperature must be in [0, 2]");
  EXPECT_REFUSED(field_refusal(R"("top_k": 9223372036854775808)"), 400, "top_k", "is beyond the 64-bit");
  // A seed is any 64-bit integer.
  EXPECT_EQ(completion(R"({"prompt": "hello", "seed": 18446744073709551615})").request.sampling.seed,
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(completion(R"({"prompt": "hello", "seed": -1})").request.sampling.seed,
            std::numeric_limits<uint64_t>::max());
}

TEST_F(RequestParser, DeepNestingIsRefusedBeforeItIsWalked) {
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_REFUSED(refusal(R"({"prompt": )" + nested(100000) + "}"), 400, "", "deeper than 64 levels");
  EXPECT_REFUSED(refusal(nested(100000)), 400, "", "deeper than 64 levels");
  EXPECT_REFUSED(
      refusal(R"({"messages": [{"role": "user", "content": )" + nested(100000) + "}]}", Endpoint::ChatCompletions), 400,
      "", "deeper than 64 levels");
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += R"({"a":)";
  objects += "1" + std::string(100000, '}');
  EXPECT_REFUSED(refusal(R"({"prompt": "hi", "metadata": )" + objects + "}"), 400, "", "deeper than 64 levels");
  // The body object and 63 levels inside it are fine.
  EXPECT_EQ(
      completion(R"({"prompt": "hello", "metadata": )" + nested(kMaxRequestJsonDepth - 1) + "}").request.prompt_ids,
      tokenizer.encode("hello"));
  EXPECT_REFUSED(refusal(R"({"prompt": "hello", "metadata": )" + nested(kMaxRequestJsonDepth) + "}"), 400, "",
                 "deeper than 64 levels");
}

TEST_F(RequestParser, UnknownFieldsAreIgnored) {
  const ParsedRequest p =
      completion(R"({"prompt": "hello", "max_tokens": 2, "user": "u-1", "metadata": {"x": [1, 2]}, "frobnicate": null,
                     "response_format": {"type": "text"}, "tools": [], "logprobs": false})");
  EXPECT_EQ(p.request.prompt_ids, tokenizer.encode("hello"));
  EXPECT_EQ(p.request.max_new_tokens, 2);
}

TEST_F(RequestParser, OneChoicePerRequest) {
  EXPECT_REFUSED(field_refusal(R"("n": 2)"), 400, "n", "n = 2: this server returns one choice per request (n = 1)");
  EXPECT_REFUSED(field_refusal(R"("n": 0)"), 400, "n", "n = 0");
  EXPECT_EQ(completion(R"({"prompt": "hello", "n": 1})").request.prompt_ids, tokenizer.encode("hello"));
}

TEST_F(RequestParser, UnsupportedFeaturesAreRefused) {
  EXPECT_REFUSED(field_refusal(R"("logprobs": true)"), 400, "logprobs", "logprobs is not supported");
  EXPECT_REFUSED(field_refusal(R"("logprobs": 3)"), 400, "logprobs", "logprobs is not supported");
  EXPECT_REFUSED(field_refusal(R"("echo": true)"), 400, "echo", "echo is not supported");
  EXPECT_REFUSED(field_refusal(R"("top_logprobs": 0)"), 400, "top_logprobs", "top_logprobs is not supported");
  EXPECT_REFUSED(field_refusal(R"("tools": [{"type": "function"}])"), 400, "tools", "tools are not supported");
  EXPECT_REFUSED(field_refusal(R"("suffix": "x")"), 400, "suffix", "suffix is not supported");
}

TEST_F(RequestParser, ModelSelectsTheBaseOrAnAdapter) {
  EXPECT_EQ(completion(R"({"prompt": "hello"})").request.adapter, -1);
  EXPECT_EQ(completion(R"({"prompt": "hello"})").model, "base");
  EXPECT_EQ(completion(R"({"prompt": "hello", "model": "base"})").request.adapter, -1);
  EXPECT_EQ(completion(R"({"prompt": "hello", "model": "sql"})").request.adapter, 0);
  const ParsedRequest poems = completion(R"({"prompt": "hello", "model": "poems"})");
  EXPECT_EQ(poems.request.adapter, 1);
  EXPECT_EQ(poems.model, "poems");
  const ApiError unknown = refusal(R"({"prompt": "hello", "model": "nope"})");
  EXPECT_REFUSED(unknown, 404, "model",
                 "the model `nope` does not exist: this server has base and the LoRA adapters sql, poems");
  EXPECT_EQ(unknown.code, "model_not_found");
}

TEST_F(RequestParser, InvalidUtf8IsRefusedNamingItsField) {
  EXPECT_REFUSED(refusal("{\"prompt\": \"a\xFF"
                         "b\"}"),
                 400, "prompt", "prompt is not valid UTF-8 text");
  EXPECT_REFUSED(refusal("{\"prompt\": \"hi\", \"stop\": [\"x\", \"\xC3\x28\"]}"), 400, "stop",
                 "stop is not valid UTF-8 text");
  EXPECT_REFUSED(refusal("{\"messages\": [{\"role\": \"user\", \"content\": \"\xFF\"}]}", Endpoint::ChatCompletions),
                 400, "messages", "messages is not valid UTF-8 text");
  EXPECT_REFUSED(refusal("{\"\xFF\": 1}"), 400, "", "the request body is not valid UTF-8 text");
  EXPECT_REFUSED(refusal("{\"prompt\": \xFF}"), 400, "prompt", "prompt is not valid UTF-8 text");
  // Valid UTF-8 that is not JSON: the message quotes what it read, still as valid UTF-8.
  const ApiError cut = refusal("{\"prompt\": \xC3\xA9}");
  EXPECT_REFUSED(cut, 400, "", "not valid JSON");
  EXPECT_TRUE(tokenizer_detail::is_valid_utf8(cut.what()));
  // Bad bytes after a syntax error: the syntax error is the answer.
  EXPECT_REFUSED(refusal("{\"prompt\" 5, \"stop\": \"\xFF\"}"), 400, "", "not valid JSON");
}

TEST(ApiErrorBody, HasOpenAIsShape) {
  const json body = json::parse(api_error_body(404, "no such model", "model", "model_not_found"));
  EXPECT_EQ(body, (json{{"error",
                         {{"message", "no such model"},
                          {"type", "invalid_request_error"},
                          {"param", "model"},
                          {"code", "model_not_found"}}}}));
  const json bare = json::parse(api_error_body(429, "later"));
  EXPECT_EQ(bare["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(bare["error"]["param"].is_null());
  EXPECT_TRUE(bare["error"]["code"].is_null());
  EXPECT_EQ(json::parse(api_error_body(401, "key"))["error"]["type"], "authentication_error");
  EXPECT_EQ(json::parse(api_error_body(500, "bug"))["error"]["type"], "server_error");
  // A message quoting bytes that are not UTF-8 is still written.
  EXPECT_EQ(json::parse(api_error_body(400, "got \xFF"))["error"]["message"], "got \xEF\xBF\xBD");
}

// With the model's vocabulary known (the server passes it), a token id outside it is the
// prompt's fault, whatever else the body sets.
TEST_F(RequestParser, TokenIdsOutsideTheVocabularyNameThePrompt) {
  ServedModel with_vocab = served;
  with_vocab.vocab_size = 512;
  const auto refused = [&](const std::string& body) {
    try {
      parse_request(body, Endpoint::Completions, with_vocab);
    } catch (const ApiError& e) {
      return e;
    }
    ADD_FAILURE() << "accepted: " << body;
    return ApiError(0, "");
  };
  EXPECT_REFUSED(refused(R"({"prompt": [600], "max_tokens": 4})"), 400, "prompt",
                 "token id 600 is outside the vocabulary [0, 512)");
  EXPECT_REFUSED(refused(R"({"prompt": [[1, 512]]})"), 400, "prompt", "token id 512");
  EXPECT_EQ(parse_request(R"({"prompt": [0, 511], "max_tokens": 4})", Endpoint::Completions, with_vocab).request.prompt_ids,
            (std::vector<int32_t>{0, 511}));
}

// What the engine refuses after parsing (the server runs GenerationEngine::validate next) is a
// 400 naming max_tokens when the body set it, else the prompt.
// Without a tokenizer (--skip_tokenizer_init) a completion's prompt is token ids; text, chat and
// stop strings are refused naming their field, and stop_token_ids (vLLM's) end the reply.
TEST_F(RequestParser, WithoutATokenizerOnlyTokenIdsAreTaken) {
  ServedModel ids_only = served;
  ids_only.tokenizer = nullptr;
  ids_only.vocab_size = 300;
  auto refuse = [&](const std::string& body, Endpoint endpoint = Endpoint::Completions) {
    return refusal_by(ids_only, body, endpoint);
  };
  const ParsedRequest p =
      parse_request(R"({"prompt": [5, 6, 7], "stop_token_ids": [9, 12], "max_tokens": 3})", Endpoint::Completions,
                    ids_only);
  EXPECT_EQ(p.request.prompt_ids, (std::vector<int32_t>{5, 6, 7}));
  // Every stop id is kept, after the model's own.
  std::vector<int32_t> want = served.completion_stop_ids;
  want.insert(want.end(), {9, 12});
  EXPECT_EQ(p.request.stop_ids, want);
  EXPECT_EQ(parse_request(R"({"prompt": [5], "stop_token_ids": [0, 299, 1, 0]})", Endpoint::Completions, ids_only)
                .request.stop_ids.size(),
            served.completion_stop_ids.size() + 4);
  EXPECT_REFUSED(refuse(R"({"prompt": "hello"})"), 400, "prompt", "--skip_tokenizer_init");
  EXPECT_REFUSED(refuse(R"({"messages": [{"role": "user", "content": "hi"}]})", Endpoint::ChatCompletions), 400,
                 "messages", "--skip_tokenizer_init");
  EXPECT_REFUSED(refuse(R"({"prompt": [5], "stop": "x"})"), 400, "stop", "stop_token_ids");
  EXPECT_REFUSED(refuse(R"({"prompt": [5], "stop_token_ids": [300]})"), 400, "stop_token_ids", "300");
  EXPECT_REFUSED(refuse(R"({"prompt": [5], "stop_token_ids": 4})"), 400, "stop_token_ids", "array");
}

TEST_F(RequestParser, EngineRefusalsNameMaxTokensOrThePrompt) {
  const ModelConfig config = model_preset("tiny");  // vocabulary of 512
  const InferenceLimits limits{
      .max_model_len = kMaxModelLen, .max_num_seqs = 2, .max_num_batched_tokens = 64, .block_size = 16};
  Decoder model(config, inference_model_options(config, limits, nullptr));
  const GenerationEngine engine(model, &tokenizer);
  const auto engine_error = [&](const std::string& body) {
    const ParsedRequest p = completion(body);
    try {
      engine.validate(p.request, "request");
    } catch (const Error& e) {
      return engine_refusal(e, p);
    }
    ADD_FAILURE() << "the engine accepted: " << body;
    return ApiError(0, "");
  };
  EXPECT_REFUSED(engine_error(R"({"prompt": [600]})"), 400, "prompt", "token id 600 is outside the vocabulary");
  EXPECT_EQ(std::string(engine_error(R"({"prompt": [600]})").what()).find("request"), std::string::npos);
  EXPECT_REFUSED(engine_error(json{{"prompt", std::vector<int32_t>(200, 7)}, {"max_tokens", 100}}.dump()), 400,
                 "max_tokens", "the prompt's 200 tokens + max_new_tokens 100 = 300 exceed max_model_len 256");
  EXPECT_REFUSED(engine_error(R"({"prompt": [1], "max_completion_tokens": 1, "model": "sql"})"), 400,
                 "max_completion_tokens", "adapter 0 is not one of the model's 0 adapters");
}

}  // namespace
}  // namespace memtune

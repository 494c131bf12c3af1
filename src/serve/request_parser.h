// OpenAI's request bodies (POST /v1/chat/completions and /v1/completions) turned into a
// GenerationRequest: a pure function of the body text and what the server serves, with no
// HTTP and no engine in it, so it is tested and fuzzed on its own.
//
// A body is refused with an ApiError (400 for anything malformed or out of range, 404 for an
// unknown model) naming the parameter at fault, the way OpenAI's server answers. Unknown
// fields are ignored, as OpenAI ignores them. The body must be UTF-8 and nest at most
// kMaxRequestJsonDepth arrays and objects (deeper JSON is refused before anything walks it).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "generate/generator.h"
#include "serve/api_error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

inline constexpr int kMaxRequestJsonDepth = 64;

enum class Endpoint { ChatCompletions, Completions };

// What a request may ask for: the model names it can select and how its prompt becomes ids.
struct ServedModel {
  // Null with --skip_tokenizer_init: completions take token ids only; chat, text prompts and stop
  // strings are refused.
  const Tokenizer* tokenizer = nullptr;
  std::string name;                        // the base model's name in requests
  std::vector<std::string> adapter_names;  // the name of the engine model's adapter set k
  ChatTemplate chat_template = ChatTemplate::Qwen2_5;
  std::vector<int32_t> chat_stop_ids, completion_stop_ids;
  int64_t max_model_len = 0;  // prompt + output tokens of one sequence
  int64_t vocab_size = 0;     // > 0: a prompt's token ids must be below it (the model's vocab_size)
};

// The parts of a request body the engine needs, and how to answer.
struct ParsedRequest {
  GenerationRequest request;  // sampling.seed drawn at random when the body has none
  std::string model;
  bool stream = false, include_usage = false;
  // The parameter a refusal by GenerationEngine::validate names: max_tokens (or
  // max_completion_tokens) when the body set it, else the prompt's (messages or prompt).
  std::string engine_refusal_param;
};

// The request in `body`, or an ApiError (and nothing else) saying why not.
ParsedRequest parse_request(std::string_view body, Endpoint endpoint, const ServedModel& served);

// The 400 for a request the engine refuses (GenerationEngine::validate's Error: a prompt and
// max_tokens beyond max_model_len, an id outside the vocabulary, a sampling value it rejects).
ApiError engine_refusal(const Error& error, const ParsedRequest& parsed);

}  // namespace memtune

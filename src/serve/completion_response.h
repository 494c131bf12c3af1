// OpenAI's response bodies for one completion: the whole answer (chat.completion or
// text_completion) and, when the client streams, the server-sent events that carry it piece by
// piece: chat's opening role delta, a chunk per piece of text, the finish chunk, a usage chunk
// when asked, and [DONE]. Only text: no HTTP here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "generate/generator.h"
#include "serve/request_parser.h"

namespace memtune {

class CompletionResponse {
 public:
  // A fresh id (chatcmpl-... or cmpl-...) and the creation time, shared by all its events. With
  // token_ids (a server without a tokenizer), each choice also carries its tokens' ids.
  CompletionResponse(Endpoint endpoint, std::string model, int64_t prompt_tokens, bool token_ids = false);

  // The non-streamed answer (JSON).
  std::string whole(const GenerationResult& result) const;

  // Server-sent events ("data: ...\n\n"). The opening event is chat's alone (empty otherwise).
  std::string opening_event() const;
  std::string text_event(const std::string& text) const;
  std::string token_ids_event(const std::vector<int32_t>& ids) const;  // a completion chunk: "", token_ids
  bool with_token_ids() const { return token_ids_; }
  std::string finish_event(const std::string& finish_reason) const;
  std::string usage_event(int64_t completion_tokens) const;
  static std::string error_event(const std::string& message);
  static constexpr const char* kDoneEvent = "data: [DONE]\n\n";
  // A comment line: what a silent stream sends to find a client that has gone.
  static constexpr const char* kKeepAlive = ": waiting\n\n";

 private:
  nlohmann::json chunk(nlohmann::json choices) const;  // a stream chunk's fields around its choices

  bool chat_, token_ids_;
  std::string id_, model_;
  int64_t created_, prompt_tokens_;
};

}  // namespace memtune

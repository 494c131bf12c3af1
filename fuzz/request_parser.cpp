// OpenAI request bodies, as POST /v1/chat/completions and /v1/completions receive them, with the
// real Qwen2.5 tokenizer: any bytes, given to both endpoints, become a request the engine can be
// handed (a prompt, 1 <= max_tokens <= max_model_len, every token id inside the vocabulary) or an
// ApiError with a client status (400, 404) and a message that is valid UTF-8; another exception,
// another status or a crash is a finding (the server would answer it with a 5xx, or die).
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "fuzz_support.h"
#include "serve/api_error.h"
#include "serve/request_parser.h"
#include "tokenizer/unicode.h"

MEMTUNE_FUZZ_LOAD_QWEN_TOKENIZER_FIRST()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  static const ServedModel served{.tokenizer = &fuzz::qwen_tokenizer(),
                                  .name = "base",
                                  .adapter_names = {"sql", "poems"},
                                  .chat_template = ChatTemplate::Qwen2_5,
                                  .chat_stop_ids = {151643, 151645},
                                  .completion_stop_ids = {151643},
                                  .max_model_len = 4096,
                                  .vocab_size = 151936};  // the model's, as the server sets it
  static const ServedModel ids_only = [] {  // --skip_tokenizer_init
    ServedModel m = served;
    m.tokenizer = nullptr;
    return m;
  }();
  const std::string_view body = fuzz::text_of(data, size);
  for (const ServedModel* model : {&served, &ids_only})
    for (const Endpoint endpoint : {Endpoint::ChatCompletions, Endpoint::Completions}) {
      try {
        const ParsedRequest p = parse_request(body, endpoint, *model);
        const GenerationRequest& r = p.request;
        if (r.prompt_ids.empty() || r.max_new_tokens < 1 || r.max_new_tokens > served.max_model_len || r.adapter < -1 ||
            r.adapter >= static_cast<int32_t>(served.adapter_names.size()) || !tokenizer_detail::is_valid_utf8(p.model))
          std::abort();
        if (!model->tokenizer && (endpoint == Endpoint::ChatCompletions || !r.stop.empty())) std::abort();
        // Token ids (a prompt of ids, stop_token_ids) stay inside the vocabulary.
        for (const std::vector<int32_t>* ids : {&r.prompt_ids, &r.stop_ids})
          for (const int32_t id : *ids)
            if (id < 0 || id >= model->vocab_size) std::abort();
      } catch (const ApiError& e) {
        if ((e.status != 400 && e.status != 404) || !tokenizer_detail::is_valid_utf8(e.what())) std::abort();
        if (!nlohmann::json::parse(api_error_body(e.status, e.what(), e.param, e.code)).contains("error")) std::abort();
      }
    }
  return 0;
}

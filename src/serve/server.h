// `memtune serve`: an OpenAI-compatible HTTP server over the generation engine.
//
// Threads: the HTTP library's workers parse requests, validate them and wait on a per-request
// channel; one engine thread (the caller of run()) owns the GenerationEngine, takes new requests
// and cancellations between steps, runs steps while there is work, and reports text and the
// finish through the channels. Every decode step takes all running sequences and prompt chunks
// fill the rest of max_num_batched_tokens (continuous batching); requests with different LoRA
// adapters share a step.
//
// Memory never runs out while serving: the engine admits a request only when the KV pool holds
// its prompt plus max_tokens, so a full pool means it waits. A request that can never fit
// (prompt + max_tokens > max_model_len) gets 400; more than max_queue waiting gets 429 with
// Retry-After. A streaming client that disconnects cancels its sequence and frees its blocks.
//
// Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
// GET /metrics (Prometheus text). Errors have OpenAI's shape:
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
// 400 malformed JSON or a bad parameter, 401 a missing or wrong key, 404 an unknown model or
// path, 413 a body over max_body_bytes, 429 a full queue, 503 while shutting down.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "generate/generator.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                          // 0: any free port (bind() says which)
  std::string api_key;                      // empty: no key needed
  std::string model_name;                   // the base model's name in requests and /v1/models
  std::vector<std::string> adapter_names;   // the name of the engine model's adapter set k
  int64_t max_queue = 256;                  // requests waiting for room beyond this get 429
  size_t max_body_bytes = size_t{1} << 20;  // larger request bodies get 413
  double shutdown_grace_seconds = 30;       // after SIGTERM: in-flight requests may finish this long
  size_t http_threads = 64;                 // connections served at once (each stream holds one)
  ChatTemplate chat_template = ChatTemplate::Qwen2_5;
  std::vector<int32_t> chat_stop_ids, completion_stop_ids;  // eos (and <|im_end|> for chat)
};

class Server {
 public:
  // tokenizer: null serves token ids only (--skip_tokenizer_init).
  Server(GenerationEngine& engine, const Tokenizer* tokenizer, ServeOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  // Binds the listening socket; returns the port. An Error naming host and port on failure.
  int bind();
  // Serves (on the calling thread: the engine; HTTP on worker threads) until stop_requested()
  // says yes, asked every few milliseconds. Then it closes the listening socket (new connections
  // are refused), lets running and queued requests finish for up to shutdown_grace_seconds,
  // ends what is left with finish_reason "abort" (a stream still gets its last chunk and
  // [DONE]; a whole answer gets 503), waits until the responses are written, and returns.
  void run(const std::function<bool()>& stop_requested);

  struct State;  // shared between the HTTP workers and the engine thread (server.cpp)

 private:
  std::unique_ptr<State> state_;
};

// Compares a presented API key with the expected one in time that does not depend on where
// they differ (nor, beyond the expected key's length, on how long the presented one is).
bool keys_equal(const std::string& presented, const std::string& expected);

}  // namespace memtune

// The generation engine: requests (token ids, sampling, stops) scheduled over an inference model
// (ModelOptions::kv_cache) in steps that mix prefill chunks and decode tokens.
//
// Memory is the plan's: the KV cache is a pool of blocks, and a request is admitted only when
// the pool can hold its prompt plus max_new_tokens, reserved at once. A request that does not
// fit now waits (in input order) until running ones finish; nothing is evicted or recomputed,
// and nothing fails for lack of blocks. A request longer than max_model_len is refused before
// anything runs.
//
// A step takes one token from every sequence that is decoding, then fills the rest of
// max_num_batched_tokens with prompt chunks in admission order. The LM head runs only at the
// last token of the sequences that sample in the step.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/device_work.h"
#include "generate/sampling.h"
#include "model/decoder.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  int64_t max_new_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: generation ends before them (needs a tokenizer)
  std::vector<int32_t> stop_ids;  // stop tokens (eos): kept in token_ids, not in the text
  int32_t adapter = -1;           // the model's adapter set to apply (ModelOptions::adapter_sets), -1 none
};

struct GenerationResult {
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;  // "stop" (a stop id or string) or "length" (max_new_tokens)
  int64_t prompt_tokens = 0;
};

struct GenerationStats {
  int64_t steps = 0, prefill_tokens = 0, decode_tokens = 0;
  // Steps that computed any prompt token count as prefill, the others as decode.
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t most_running = 0;   // the most sequences one step held
  int64_t waiting_steps = 0;  // steps run while a request waited for room
  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prefill_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const { return decode_seconds > 0 ? decode_tokens / decode_seconds : 0; }
};

// Called with a request's index and the next piece of its text, always whole UTF-8 characters;
// the pieces of a request join to its result's text.
using TextCallback = std::function<void(size_t index, std::string_view piece)>;

// The ids that end a reply: the tokenizer's eos, the model directory's generation_config.json
// eos_token_id (a number or a list) and, for chat prompts, <|im_end|> and <|eot_id|> (where the
// tokenizer has them); sorted, no repeats. Without a tokenizer (--skip_tokenizer_init), config.json's
// eos_token_id stands in for the tokenizer's.
std::vector<int32_t> model_stop_ids(const std::string& model_dir, const Tokenizer* tokenizer, bool chat);

// What one request reports while it runs, on the thread that calls GenerationEngine::step().
struct RequestCallbacks {
  std::function<void(std::string_view piece)> on_text;       // the next piece of text, whole UTF-8 characters
  std::function<void(int32_t token)> on_token;               // every sampled token, stop ids included
  std::function<void(GenerationResult&& result)> on_finish;  // once, last
};

// The scheduler, one step at a time, for callers that add and cancel requests while it runs
// (the server); Generator runs a fixed list through it. Not thread-safe: one thread adds,
// cancels and steps.
class GenerationEngine {
 public:
  // tokenizer may be null when no request has stop strings and no text is wanted.
  GenerationEngine(Decoder& model, const Tokenizer* tokenizer);
  ~GenerationEngine();
  GenerationEngine(const GenerationEngine&) = delete;
  GenerationEngine& operator=(const GenerationEngine&) = delete;
  // An Error starting with `label` for a request that can never run: an empty prompt, ids
  // outside the vocabulary, max_new_tokens < 1, prompt + max_new_tokens beyond max_model_len,
  // stop strings without a tokenizer, bad sampling parameters, an unknown adapter.
  void validate(const GenerationRequest& request, const std::string& label) const;
  // Validates, then queues the request behind the waiting ones; returns its id.
  uint64_t add(GenerationRequest request, RequestCallbacks callbacks);
  // Ends the request now with finish_reason "abort" (what it generated so far is its result)
  // and frees its blocks; nothing when it has already finished.
  void cancel(uint64_t id);
  bool idle() const { return waiting_.empty() && running_.empty(); }
  // Admits waiting requests in order while the pool holds each whole, then runs one step.
  void step();
  // A step that decodes holds at most this many tokens in all (0: up to max_num_batched_tokens),
  // its prompt tokens being what the decoding sequences leave (at least 4, so prompts always
  // advance): a long prompt arriving does not stall the running sequences for a whole chunk, and
  // with the backend's stored_weight_rows() the step reads 16-bit weights as stored instead of
  // widening them.
  // Tokens are unchanged.
  void set_max_decode_step_tokens(int64_t tokens) { max_decode_step_tokens_ = tokens; }

  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t free_blocks() const { return pool_.free_blocks(); }
  int64_t total_blocks() const { return model_.options().kv_cache.blocks; }
  const Decoder& model() const { return model_; }
  const GenerationStats& stats() const { return stats_; }
  void reset_stats();
  // What each engine step asked of the device (backend/device_work.h), decode steps (no prompt
  // token) and prefill steps apart: {"decode_step": ..., "prefill_step": ...}, null without device
  // counters.
  nlohmann::json device_work_json() const;
  const DeviceWork& decode_work() const { return decode_work_; }
  const DeviceWork& prefill_work() const { return prefill_work_; }

  struct Sequence;  // one request while it waits or runs (generator.cpp)

 private:
  void finish(Sequence& s, const char* reason);
  const char* append(Sequence& s, int32_t token);
  void emit(Sequence& s, bool all);

  Decoder& model_;
  const Tokenizer* tokenizer_;
  SamplerScratch scratch_;
  GenerationStats stats_;
  DeviceWork decode_work_, prefill_work_;
  uint64_t next_id_ = 0;
  int64_t max_decode_step_tokens_ = 0;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  KvBlockPool pool_;
  // The step's batch, in host vectors sized once for the plan's limits.
  std::vector<int32_t> ids_, cu_, ctx_, tables_, sample_seqs_, seq_adapters_, tokens_;
  std::vector<SampleRow> sample_rows_;
  std::vector<PenaltyToken> penalties_;
  std::vector<Sequence*> in_step_;
};

class Generator {
 public:
  // tokenizer may be null when no request has stop strings and no text is wanted.
  Generator(Decoder& model, const Tokenizer* tokenizer);
  // Refuses (an Error naming the request) an empty prompt, a prompt + max_new_tokens beyond
  // max_model_len, stop strings without a tokenizer; then generates every request.
  // stop_requested is asked before every step: when it says yes (Ctrl-C in chat), the running
  // requests end where they are and the waiting ones end empty, with finish_reason "abort".
  std::vector<GenerationResult> generate(const std::vector<GenerationRequest>& requests,
                                         const TextCallback& on_text = {},
                                         const std::function<bool()>& stop_requested = {});
  const GenerationStats& stats() const { return engine_.stats(); }
  nlohmann::json device_work_json() const { return engine_.device_work_json(); }

 private:
  GenerationEngine engine_;
};

}  // namespace memtune

// The generation engine (see generator.h).
#include "generate/generator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"
#include "tokenizer/unicode.h"

namespace memtune {

// One request while it waits or runs: its tokens, its place in the cache, its text so far.
struct GenerationEngine::Sequence {
  uint64_t id = 0;
  GenerationRequest request;
  RequestCallbacks callbacks;
  std::vector<int32_t> tokens;  // prompt, then output
  int64_t prompt_len = 0;
  int64_t computed = 0;         // tokens whose keys and values are in the cache
  std::vector<int32_t> blocks;  // reserved for prompt + max_new_tokens
  std::optional<TokenSampler> sampler;
  std::string bytes;     // the output's raw bytes (byte-level tokens may split characters)
  size_t emitted = 0;    // bytes handed to the callback
  size_t hold_back = 0;  // the longest stop string minus one: bytes that may begin a stop
  std::string finish;    // set when done
  int64_t output_tokens() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

std::vector<int32_t> model_stop_ids(const std::string& model_dir, const Tokenizer* tokenizer, bool chat) {
  std::set<int32_t> ids;
  if (tokenizer) {
    if (const auto eos = tokenizer->eos_token_id()) ids.insert(*eos);
    if (chat)
      for (const char* end : {"<|im_end|>", "<|eot_id|>"})  // ChatML's and Llama 3's end of a turn
        if (const auto id = tokenizer->token_to_id(end)) ids.insert(*id);
  }
  auto read_eos = [&](const char* name) {
    const std::filesystem::path file = std::filesystem::path(model_dir) / name;
    if (!std::filesystem::exists(file)) return;
    const nlohmann::json doc = read_json_file(file);
    const JsonReader r(doc, file.string());
    const auto eos = r.find("eos_token_id");
    if (!eos || eos->value().is_null()) return;
    if (eos->value().is_array()) {
      for (size_t i = 0; i < eos->size(); ++i) ids.insert(static_cast<int32_t>((*eos)[i].as_integer(0, INT32_MAX)));
    } else {
      ids.insert(static_cast<int32_t>(eos->as_integer(0, INT32_MAX)));
    }
  };
  read_eos("generation_config.json");
  if (!tokenizer) read_eos("config.json");
  return {ids.begin(), ids.end()};
}

GenerationEngine::GenerationEngine(Decoder& model, const Tokenizer* tokenizer)
    : model_(model),
      tokenizer_(tokenizer),
      scratch_(model.config().vocab_size),
      decode_work_(model.backend()),
      prefill_work_(model.backend()),
      pool_(model.options().kv_cache.blocks) {
  MT_ASSERT(model.options().inference(), "the generator needs a model planned with a KV cache");
  const KvCacheOptions& kv = model_.options().kv_cache;
  MT_ASSERT(kv.blocks >= kv.max_blocks_per_seq, "the pool cannot hold one sequence of max_model_len");
  const size_t S = static_cast<size_t>(kv.max_seqs), N = static_cast<size_t>(model_.options().max_tokens);
  seq_adapters_.reserve(S);
  ids_.reserve(N);
  cu_.reserve(S + 1);
  ctx_.reserve(S);
  tables_.reserve(S * static_cast<size_t>(kv.max_blocks_per_seq));
  sample_seqs_.reserve(S);
  sample_rows_.reserve(S);
  tokens_.reserve(S);
  in_step_.reserve(S);
  running_.reserve(S);
}

GenerationEngine::~GenerationEngine() = default;

void GenerationEngine::validate(const GenerationRequest& r, const std::string& label) const {
  const KvCacheOptions& kv = model_.options().kv_cache;
  const int64_t V = model_.config().vocab_size;
  const int64_t P = static_cast<int64_t>(r.prompt_ids.size());
  if (P == 0) throw Error(fmt::format("{}: the prompt is empty", label));
  if (r.max_new_tokens < 1) throw Error(fmt::format("{}: max_new_tokens must be at least 1", label));
  if (P + r.max_new_tokens > kv.max_model_len)
    throw Error(fmt::format("{}: the prompt's {} tokens + max_new_tokens {} = {} exceed max_model_len {}", label, P,
                            r.max_new_tokens, P + r.max_new_tokens, kv.max_model_len));
  for (const int32_t id : r.prompt_ids)
    if (id < 0 || id >= V) throw Error(fmt::format("{}: token id {} is outside the vocabulary [0, {})", label, id, V));
  if (!r.stop.empty() && tokenizer_ == nullptr)
    throw Error(fmt::format("{}: stop strings need the model's tokenizer", label));
  for (const std::string& s : r.stop)
    if (s.empty()) throw Error(fmt::format("{}: a stop string is empty", label));
  validate_sampling(r.sampling);
  if (r.adapter < -1 || r.adapter >= static_cast<int32_t>(model_.parameters().num_adapter_sets()))
    throw Error(fmt::format("{}: adapter {} is not one of the model's {} adapters", label, r.adapter,
                            model_.parameters().num_adapter_sets()));
}

uint64_t GenerationEngine::add(GenerationRequest request, RequestCallbacks callbacks) {
  validate(request, fmt::format("request {}", next_id_));
  auto s = std::make_unique<Sequence>();
  s->id = next_id_++;
  s->tokens = request.prompt_ids;
  s->tokens.reserve(request.prompt_ids.size() + static_cast<size_t>(request.max_new_tokens));
  s->prompt_len = static_cast<int64_t>(request.prompt_ids.size());
  for (const std::string& stop : request.stop) s->hold_back = std::max(s->hold_back, stop.size() - 1);
  s->request = std::move(request);
  s->callbacks = std::move(callbacks);
  waiting_.push_back(std::move(s));
  return waiting_.back()->id;
}

void GenerationEngine::emit(Sequence& s, bool all) {
  size_t end = s.bytes.size();
  if (!all)
    end = tokenizer_detail::complete_utf8_prefix(
        std::string_view(s.bytes).substr(0, end > s.hold_back ? end - s.hold_back : 0));
  if (end <= s.emitted) return;
  if (s.callbacks.on_text) {
    std::string piece;
    tokenizer_detail::append_utf8_lossy(std::string_view(s.bytes).substr(s.emitted, end - s.emitted), piece);
    s.callbacks.on_text(piece);
  }
  s.emitted = end;
}

void GenerationEngine::finish(Sequence& s, const char* reason) {
  s.finish = reason;
  emit(s, true);
  GenerationResult out;
  out.token_ids.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
  tokenizer_detail::append_utf8_lossy(s.bytes, out.text);
  out.finish_reason = s.finish;
  out.prompt_tokens = s.prompt_len;
  pool_.release(s.blocks);
  if (s.callbacks.on_finish) s.callbacks.on_finish(std::move(out));
}

// Appends a sampled token; returns the finish reason when the request is done.
const char* GenerationEngine::append(Sequence& s, int32_t token) {
  const GenerationRequest& r = s.request;
  s.tokens.push_back(token);
  if (s.callbacks.on_token) s.callbacks.on_token(token);
  if (std::find(r.stop_ids.begin(), r.stop_ids.end(), token) != r.stop_ids.end()) return "stop";
  if (tokenizer_) {
    const size_t before = s.bytes.size();
    // An id past the tokenizer's (Qwen2.5 pads its 151665 tokens to 151936 rows) is no text.
    if (tokenizer_->has_id(token)) s.bytes += tokenizer_->token_bytes(token, /*skip_special_tokens=*/true);
    for (const std::string& stop : r.stop) {
      const size_t from = before >= stop.size() - 1 ? before - (stop.size() - 1) : 0;
      if (const size_t at = s.bytes.find(stop, from); at != std::string::npos) {
        s.bytes.resize(at);
        return "stop";
      }
    }
    emit(s, false);
  }
  if (s.output_tokens() >= r.max_new_tokens) return "length";
  return nullptr;
}

void GenerationEngine::cancel(uint64_t id) {
  auto take = [id](auto& queue) -> std::unique_ptr<Sequence> {
    const auto it = std::find_if(queue.begin(), queue.end(), [id](const auto& s) { return s->id == id; });
    if (it == queue.end()) return nullptr;
    std::unique_ptr<Sequence> s = std::move(*it);
    queue.erase(it);
    return s;
  };
  std::unique_ptr<Sequence> s = take(waiting_);
  if (!s) s = take(running_);
  if (s) finish(*s, "abort");
}

void GenerationEngine::step() {
  const KvCacheOptions& kv = model_.options().kv_cache;
  const size_t S = static_cast<size_t>(kv.max_seqs);
  // Admit in arrival order while there is room for a whole request.
  while (!waiting_.empty() && running_.size() < S) {
    Sequence& s = *waiting_.front();
    if (!pool_.reserve(kv_blocks_for(s.prompt_len + s.request.max_new_tokens, kv.block_size), s.blocks)) break;
    s.sampler.emplace(s.request.sampling, s.request.prompt_ids);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  MT_ASSERT(!running_.empty() || waiting_.empty(), "no request could be admitted into an empty pool");
  if (running_.empty()) return;
  if (!waiting_.empty()) ++stats_.waiting_steps;

  // One token of every decoding sequence, then prompt chunks.
  const bool adapters = model_.parameters().num_adapter_sets() > 0;
  ids_.clear();
  cu_.assign(1, 0);
  ctx_.clear();
  tables_.clear();
  sample_seqs_.clear();
  seq_adapters_.clear();
  in_step_.clear();
  int64_t budget = model_.options().max_tokens, prompt_tokens = 0;
  auto add_tokens = [&](Sequence& s, int64_t n) {
    ids_.insert(ids_.end(), s.tokens.begin() + s.computed, s.tokens.begin() + s.computed + n);
    cu_.push_back(static_cast<int32_t>(ids_.size()));
    ctx_.push_back(static_cast<int32_t>(s.computed + n));
    const size_t row = tables_.size();
    tables_.resize(row + static_cast<size_t>(kv.max_blocks_per_seq), 0);
    std::copy(s.blocks.begin(), s.blocks.end(), tables_.begin() + static_cast<std::ptrdiff_t>(row));
    if (s.computed + n == static_cast<int64_t>(s.tokens.size()))
      sample_seqs_.push_back(static_cast<int32_t>(in_step_.size()));
    in_step_.push_back(&s);
    if (adapters) seq_adapters_.push_back(s.request.adapter);
    budget -= n;
  };
  for (auto& s : running_)
    if (s->computed >= s->prompt_len) add_tokens(*s, 1);
  if (!ids_.empty() && max_decode_step_tokens_ > 0)
    budget = std::min(budget, std::max<int64_t>(4, max_decode_step_tokens_ - static_cast<int64_t>(ids_.size())));
  for (auto& s : running_) {
    if (s->computed >= s->prompt_len || budget == 0) continue;
    const int64_t n = std::min(s->prompt_len - s->computed, budget);
    prompt_tokens += n;
    add_tokens(*s, n);
  }

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  DeviceWork& work = prompt_tokens > 0 ? prefill_work_ : decode_work_;
  work.begin();
  model_.generation_forward({.input_ids = ids_,
                             .cu_seqlens = cu_,
                             .context_lens = ctx_,
                             .block_tables = tables_,
                             .sample_seqs = sample_seqs_,
                             .seq_adapters = seq_adapters_});
  for (size_t i = 0; i < in_step_.size(); ++i) in_step_[i]->computed = ctx_[i];
  sample_rows_.clear();
  penalties_.clear();
  for (const int32_t seq : sample_seqs_)
    sample_rows_.push_back(in_step_[static_cast<size_t>(seq)]->sampler->next_row(penalties_));
  tokens_.resize(sample_seqs_.size());
  model_.sample_tokens(sample_rows_, penalties_, tokens_, scratch_);
  for (size_t r = 0; r < sample_seqs_.size(); ++r) {
    Sequence& s = *in_step_[static_cast<size_t>(sample_seqs_[r])];
    s.sampler->accept(tokens_[r]);
    if (const char* reason = append(s, tokens_[r])) finish(s, reason);
  }
  work.end();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ++stats_.steps;
  stats_.most_running = std::max<int64_t>(stats_.most_running, static_cast<int64_t>(in_step_.size()));
  stats_.prefill_tokens += prompt_tokens;
  stats_.decode_tokens += static_cast<int64_t>(ids_.size()) - prompt_tokens;
  (prompt_tokens > 0 ? stats_.prefill_seconds : stats_.decode_seconds) += seconds;
  std::erase_if(running_, [](const std::unique_ptr<Sequence>& s) { return !s->finish.empty(); });
}

void GenerationEngine::reset_stats() {
  stats_ = {};
  decode_work_ = DeviceWork(model_.backend());
  prefill_work_ = DeviceWork(model_.backend());
}

nlohmann::json GenerationEngine::device_work_json() const {
  const nlohmann::json decode = decode_work_.to_json("decode step");
  if (decode.is_null()) return nullptr;
  return {{"decode_step", decode}, {"prefill_step", prefill_work_.to_json("prefill step")}};
}

Generator::Generator(Decoder& model, const Tokenizer* tokenizer) : engine_(model, tokenizer) {}

std::vector<GenerationResult> Generator::generate(const std::vector<GenerationRequest>& requests,
                                                  const TextCallback& on_text,
                                                  const std::function<bool()>& stop_requested) {
  for (size_t i = 0; i < requests.size(); ++i) engine_.validate(requests[i], fmt::format("request {}", i));
  engine_.reset_stats();
  std::vector<GenerationResult> results(requests.size());
  std::vector<uint64_t> ids;
  ids.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    RequestCallbacks callbacks;
    if (on_text) callbacks.on_text = [&on_text, i](std::string_view piece) { on_text(i, piece); };
    callbacks.on_finish = [&results, i](GenerationResult&& r) { results[i] = std::move(r); };
    ids.push_back(engine_.add(requests[i], std::move(callbacks)));
  }
  while (!engine_.idle()) {
    if (stop_requested && stop_requested()) {
      for (const uint64_t id : ids) engine_.cancel(id);
      break;
    }
    engine_.step();
  }
  return results;
}

}  // namespace memtune

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

namespace {

// One request while it runs: its tokens, its place in the cache, its text so far.
struct Sequence {
  size_t index = 0;
  const GenerationRequest* request = nullptr;
  std::vector<int32_t> tokens;  // prompt, then output
  int64_t prompt_len = 0;
  int64_t computed = 0;         // tokens whose keys and values are in the cache
  std::vector<int32_t> blocks;  // reserved for prompt + max_new_tokens
  std::optional<TokenSampler> sampler;
  std::string bytes;       // the output's raw bytes (byte-level tokens may split characters)
  size_t emitted = 0;      // bytes handed to the callback
  size_t hold_back = 0;    // the longest stop string minus one: bytes that may begin a stop
  std::string finish;      // set when done
  int64_t output_tokens() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

int64_t blocks_for(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

}  // namespace

std::vector<int32_t> model_stop_ids(const std::string& model_dir, const Tokenizer& tokenizer, bool chat) {
  std::set<int32_t> ids;
  if (const auto eos = tokenizer.eos_token_id()) ids.insert(*eos);
  if (chat)
    if (const auto im_end = tokenizer.token_to_id("<|im_end|>")) ids.insert(*im_end);
  const std::filesystem::path gen = std::filesystem::path(model_dir) / "generation_config.json";
  if (std::filesystem::exists(gen)) {
    const nlohmann::json doc = read_json_file(gen);
    const JsonReader r(doc, gen.string());
    if (const auto eos = r.find("eos_token_id")) {
      if (eos->value().is_array()) {
        for (size_t i = 0; i < eos->size(); ++i) ids.insert(static_cast<int32_t>((*eos)[i].as_integer(0, INT32_MAX)));
      } else {
        ids.insert(static_cast<int32_t>(eos->as_integer(0, INT32_MAX)));
      }
    }
  }
  return {ids.begin(), ids.end()};
}

Generator::Generator(Qwen2Model& model, const Tokenizer* tokenizer)
    : model_(model), tokenizer_(tokenizer), scratch_(model.config().vocab_size) {
  MT_ASSERT(model.options().inference(), "the generator needs a model planned with a KV cache");
}

std::vector<GenerationResult> Generator::generate(const std::vector<GenerationRequest>& requests,
                                                  const TextCallback& on_text,
                                                  const std::function<bool()>& stop_requested) {
  const KvCacheOptions& kv = model_.options().kv_cache;
  const int64_t V = model_.config().vocab_size;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    const int64_t P = static_cast<int64_t>(r.prompt_ids.size());
    if (P == 0) throw Error(fmt::format("request {}: the prompt is empty", i));
    if (r.max_new_tokens < 1) throw Error(fmt::format("request {}: max_new_tokens must be at least 1", i));
    if (P + r.max_new_tokens > kv.max_model_len)
      throw Error(fmt::format("request {}: the prompt's {} tokens + max_new_tokens {} = {} exceed max_model_len {}", i,
                              P, r.max_new_tokens, P + r.max_new_tokens, kv.max_model_len));
    for (const int32_t id : r.prompt_ids)
      if (id < 0 || id >= V) throw Error(fmt::format("request {}: token id {} is outside the vocabulary [0, {})", i, id, V));
    if (!r.stop.empty() && tokenizer_ == nullptr)
      throw Error(fmt::format("request {}: stop strings need the model's tokenizer", i));
    for (const std::string& s : r.stop)
      if (s.empty()) throw Error(fmt::format("request {}: a stop string is empty", i));
    validate_sampling(r.sampling);
    if (r.adapter < -1 || r.adapter >= static_cast<int32_t>(model_.parameters().num_adapter_sets()))
      throw Error(fmt::format("request {}: adapter {} is not one of the model's {} adapters", i, r.adapter,
                              model_.parameters().num_adapter_sets()));
  }
  const bool adapters = model_.parameters().num_adapter_sets() > 0;
  MT_ASSERT(kv.blocks >= kv.max_blocks_per_seq, "the pool cannot hold one sequence of max_model_len");

  stats_ = {};
  std::vector<GenerationResult> results(requests.size());
  std::deque<size_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(i);
  std::vector<int32_t> free_blocks(static_cast<size_t>(kv.blocks));
  for (int64_t b = 0; b < kv.blocks; ++b) free_blocks[static_cast<size_t>(b)] = static_cast<int32_t>(kv.blocks - 1 - b);
  std::vector<std::unique_ptr<Sequence>> running;

  // The step's batch, in host vectors sized once for the plan's limits.
  const size_t S = static_cast<size_t>(kv.max_seqs), N = static_cast<size_t>(model_.options().max_tokens);
  std::vector<int32_t> ids, cu, ctx, tables, sample_seqs, seq_adapters;
  seq_adapters.reserve(S);
  ids.reserve(N);
  cu.reserve(S + 1);
  ctx.reserve(S);
  tables.reserve(S * static_cast<size_t>(kv.max_blocks_per_seq));
  sample_seqs.reserve(S);
  std::vector<Sequence*> in_step;
  in_step.reserve(S);

  auto emit = [&](Sequence& s, bool all) {
    size_t end = s.bytes.size();
    if (!all) end = tokenizer_detail::complete_utf8_prefix(std::string_view(s.bytes).substr(0, end > s.hold_back ? end - s.hold_back : 0));
    if (end <= s.emitted) return;
    if (on_text) {
      std::string piece;
      tokenizer_detail::append_utf8_lossy(std::string_view(s.bytes).substr(s.emitted, end - s.emitted), piece);
      on_text(s.index, piece);
    }
    s.emitted = end;
  };
  auto finish = [&](Sequence& s, const char* reason) {
    s.finish = reason;
    emit(s, true);
    GenerationResult& out = results[s.index];
    out.token_ids.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    tokenizer_detail::append_utf8_lossy(s.bytes, out.text);
    out.finish_reason = s.finish;
    out.prompt_tokens = s.prompt_len;
    free_blocks.insert(free_blocks.end(), s.blocks.rbegin(), s.blocks.rend());
  };
  // Appends a sampled token; returns the finish reason when the request is done.
  auto append = [&](Sequence& s, int32_t token) -> const char* {
    const GenerationRequest& r = *s.request;
    s.tokens.push_back(token);
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
  };

  using Clock = std::chrono::steady_clock;
  while (!waiting.empty() || !running.empty()) {
    if (stop_requested && stop_requested()) {
      for (auto& s : running) finish(*s, "abort");
      for (size_t i : waiting) {
        results[i].finish_reason = "abort";
        results[i].prompt_tokens = static_cast<int64_t>(requests[i].prompt_ids.size());
      }
      break;
    }
    // Admit in input order while there is room for a whole request.
    while (!waiting.empty() && running.size() < S) {
      const GenerationRequest& r = requests[waiting.front()];
      const int64_t need =
          blocks_for(static_cast<int64_t>(r.prompt_ids.size()) + r.max_new_tokens, kv.block_size);
      if (need > static_cast<int64_t>(free_blocks.size())) break;
      auto s = std::make_unique<Sequence>();
      s->index = waiting.front();
      s->request = &r;
      s->tokens = r.prompt_ids;
      s->tokens.reserve(r.prompt_ids.size() + static_cast<size_t>(r.max_new_tokens));
      s->prompt_len = static_cast<int64_t>(r.prompt_ids.size());
      for (int64_t b = 0; b < need; ++b) {
        s->blocks.push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      s->sampler.emplace(r.sampling, r.prompt_ids);
      for (const std::string& stop : r.stop) s->hold_back = std::max(s->hold_back, stop.size() - 1);
      running.push_back(std::move(s));
      waiting.pop_front();
    }
    MT_ASSERT(!running.empty(), "no request could be admitted into an empty pool");
    if (!waiting.empty()) ++stats_.waiting_steps;

    // One token of every decoding sequence, then prompt chunks.
    ids.clear();
    cu.assign(1, 0);
    ctx.clear();
    tables.clear();
    sample_seqs.clear();
    seq_adapters.clear();
    in_step.clear();
    int64_t budget = static_cast<int64_t>(N), prompt_tokens = 0;
    auto add = [&](Sequence& s, int64_t n) {
      ids.insert(ids.end(), s.tokens.begin() + s.computed, s.tokens.begin() + s.computed + n);
      cu.push_back(static_cast<int32_t>(ids.size()));
      ctx.push_back(static_cast<int32_t>(s.computed + n));
      const size_t row = tables.size();
      tables.resize(row + static_cast<size_t>(kv.max_blocks_per_seq), 0);
      std::copy(s.blocks.begin(), s.blocks.end(), tables.begin() + static_cast<std::ptrdiff_t>(row));
      if (s.computed + n == static_cast<int64_t>(s.tokens.size()))
        sample_seqs.push_back(static_cast<int32_t>(in_step.size()));
      in_step.push_back(&s);
      if (adapters) seq_adapters.push_back(s.request->adapter);
      budget -= n;
    };
    for (auto& s : running)
      if (s->computed >= s->prompt_len) add(*s, 1);
    for (auto& s : running) {
      if (s->computed >= s->prompt_len || budget == 0) continue;
      const int64_t n = std::min(s->prompt_len - s->computed, budget);
      prompt_tokens += n;
      add(*s, n);
    }

    const auto t0 = Clock::now();
    const StepLogits logits = model_.generation_step(
        {.input_ids = ids,
         .cu_seqlens = cu,
         .context_lens = ctx,
         .block_tables = tables,
         .sample_seqs = sample_seqs,
         .seq_adapters = seq_adapters});
    for (size_t i = 0; i < in_step.size(); ++i) in_step[i]->computed = ctx[i];
    for (size_t r = 0; r < sample_seqs.size(); ++r) {
      Sequence& s = *in_step[static_cast<size_t>(sample_seqs[r])];
      const int32_t token = s.sampler->sample(logits.row(static_cast<int64_t>(r)), 1, scratch_);
      if (const char* reason = append(s, token)) finish(s, reason);
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    ++stats_.steps;
    stats_.most_running = std::max<int64_t>(stats_.most_running, static_cast<int64_t>(in_step.size()));
    const int64_t decode_tokens = static_cast<int64_t>(ids.size()) - prompt_tokens;
    stats_.prefill_tokens += prompt_tokens;
    stats_.decode_tokens += decode_tokens;
    (prompt_tokens > 0 ? stats_.prefill_seconds : stats_.decode_seconds) += seconds;
    std::erase_if(running, [](const std::unique_ptr<Sequence>& s) { return !s->finish.empty(); });
  }
  return results;
}

}  // namespace memtune

// The generation engine against the training model's full forward pass (no cache, packed
// causal attention): greedy tokens are its argmax, the cache's logits are its logits; batching,
// chunked prefill and a pool that makes requests wait change no token; the plan is the arena.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "backend/registry.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/synthetic_tokenizer.h"
#include "generate/generator.h"
#include "model/kv_cache.h"
#include "memory/process_memory.h"
#include "model/decoder.h"
#include "support/test_util.h"
#include "tokenizer/unicode.h"
#include "support/numeric.h"
#include "support/visible_weights.h"
#include "options/inference_options.h"

namespace memtune {
namespace {

constexpr uint64_t kWeightsSeed = 7;

ModelConfig tiny(DType dtype = DType::F32, bool tied = true, const char* preset = "tiny") {
  ModelConfig c = model_preset(preset);
  c.torch_dtype = dtype;
  c.tie_word_embeddings = tied;
  return c;
}

InferenceLimits limits(int64_t max_model_len, int64_t max_num_seqs = 8, int64_t max_num_batched_tokens = 64) {
  return {.max_model_len = max_model_len, .max_num_seqs = max_num_seqs,
          .max_num_batched_tokens = max_num_batched_tokens, .block_size = 16};
}

std::unique_ptr<Decoder> inference_model(const ModelConfig& c, const InferenceLimits& l,
                                            Backend* backend = nullptr) {
  auto m = std::make_unique<Decoder>(c, inference_model_options(c, l, backend));
  testing_support::init_visible_weights(*m, kWeightsSeed);
  return m;
}

// The training model's forward (packed causal attention, no cache): the logits at every
// position but the last, row t predicting token t + 1.
class CollectLogits final : public ChunkObserver {
 public:
  explicit CollectLogits(size_t n) : rows(n) {}
  void observe(const LogitsChunk& c) override {
    for (int64_t r = 0; r < c.rows; ++r)
      rows[static_cast<size_t>(c.positions[r])].assign(c.logits + r * c.V, c.logits + (r + 1) * c.V);
  }
  std::vector<std::vector<float>> rows;
};
std::vector<std::vector<float>> full_forward_logits(const ModelConfig& c, const std::vector<int32_t>& tokens) {
  ModelOptions o;
  o.max_tokens = static_cast<int64_t>(tokens.size());
  o.with_grads = false;
  Decoder m(c, o);
  testing_support::init_visible_weights(m, kWeightsSeed);
  CollectLogits observer(tokens.size());
  m.set_observer(&observer);
  const std::vector<int32_t> cu = {0, static_cast<int32_t>(tokens.size())};
  m.forward_loss({tokens, tokens, cu});
  observer.rows.pop_back();
  return observer.rows;
}

GenerationRequest request(std::vector<int32_t> prompt, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  return r;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(vocab));
  return ids;
}

struct Variant {
  DType dtype;
  bool tied;
  // On logits, relative to the largest |logit|: a few times the error measured on an AMD EPYC
  // (Zen 4): 1.3e-6 in float32, 2.5e-3 to 4.6e-3 where a bfloat16 model's cache holds K and V
  // rounded to bfloat16.
  double tolerance;
  const char* preset = "tiny";  // tiny (Qwen2), tiny-qwen3 (q_norm/k_norm), tiny-llama (llama3 RoPE)
};
class GenerationVariants : public ::testing::TestWithParam<Variant> {};

TEST_P(GenerationVariants, GreedyTokensAreTheArgmaxOfFullForwardPasses) {
  const Variant v = GetParam();
  const ModelConfig c = tiny(v.dtype, v.tied, v.preset);
  const int64_t P = 9, T = 300;
  auto m = inference_model(c, limits(P + T, 1, 16));
  Generator g(*m, nullptr);
  GenerationRequest r = request(random_ids(P, c.vocab_size, 1), T);
  r.sampling.temperature = 0;
  const GenerationResult out = g.generate({r})[0];
  ASSERT_EQ(out.token_ids.size(), static_cast<size_t>(T));
  EXPECT_EQ(out.finish_reason, "length");
  std::vector<int32_t> all = r.prompt_ids;
  all.insert(all.end(), out.token_ids.begin(), out.token_ids.end());
  const auto logits = full_forward_logits(c, all);
  int exact = 0;
  for (int64_t i = 0; i < T; ++i) {
    const std::vector<float>& row = logits[static_cast<size_t>(P - 1 + i)];
    const auto best = std::max_element(row.begin(), row.end());
    exact += (best - row.begin()) == out.token_ids[static_cast<size_t>(i)];
    // A different choice is only acceptable between (numerically) tied logits.
    const float scale = std::max(*best, -*std::min_element(row.begin(), row.end()));
    EXPECT_GE(row[static_cast<size_t>(out.token_ids[static_cast<size_t>(i)])], *best - v.tolerance * scale)
        << "token " << i;
  }
  EXPECT_GE(exact, T - 3);
}

TEST_P(GenerationVariants, CacheLogitsEqualFullForwardLogitsAtEveryStep) {
  const Variant v = GetParam();
  const ModelConfig c = tiny(v.dtype, v.tied, v.preset);
  const int64_t P = 37, T = 40;
  auto m = inference_model(c, limits(P + T, 1, 8));
  // Prefill in chunks of 8 (the last one samples), then one token per step, greedily.
  std::vector<int32_t> tokens = random_ids(P, c.vocab_size, 2), blocks = {3, 0, 4, 1, 2};
  std::vector<std::vector<float>> cached;
  StepAllocations steps;  // operator new inside generation steps after the first
  int64_t computed = 0;
  while (static_cast<int64_t>(tokens.size()) < P + T) {
    const int64_t n = std::min<int64_t>(8, static_cast<int64_t>(tokens.size()) - computed);
    const std::vector<int32_t> ids(tokens.begin() + computed, tokens.begin() + computed + n);
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(n)}, ctx = {static_cast<int32_t>(computed + n)};
    const bool samples = computed + n == static_cast<int64_t>(tokens.size());
    const std::vector<int32_t> sample = samples ? std::vector<int32_t>{0} : std::vector<int32_t>{};
    steps.begin();
    const StepLogits l = m->generation_step(
        {.input_ids = ids, .cu_seqlens = cu, .context_lens = ctx, .block_tables = blocks, .sample_seqs = sample});
    steps.end();
    computed += n;
    if (!samples) continue;
    std::vector<float> row(static_cast<size_t>(c.vocab_size));
    for (int64_t t = 0; t < c.vocab_size; ++t) row[static_cast<size_t>(t)] = l.row(0)[t];
    tokens.push_back(static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
    cached.push_back(std::move(row));
  }
  const auto full = full_forward_logits(c, tokens);
  double worst = 0;  // relative to the step's largest |logit|
  for (size_t i = 0; i < cached.size(); ++i) {
    const testing_support::Difference d = testing_support::difference(cached[i], full[static_cast<size_t>(P - 1) + i]);
    EXPECT_TRUE(d.ok() && d.worst < v.tolerance * d.scale) << "step " << i << ": " << d.describe();
    if (!(d.worst / d.scale <= worst)) worst = d.worst / d.scale;
  }
  std::printf("worst logit difference relative to the largest |logit|: %.3g (bound %.3g)\n", worst, v.tolerance);
  RecordProperty("max_relative_logit_difference", std::to_string(worst));
  EXPECT_EQ(steps.total().count, 0u) << "a generation step allocated " << steps.total().bytes << " bytes";
}

INSTANTIATE_TEST_SUITE_P(Models, GenerationVariants,
                         ::testing::Values(Variant{DType::F32, true, 5e-6}, Variant{DType::F32, false, 5e-6},
                                           Variant{DType::BF16, true, 1.5e-2}, Variant{DType::BF16, false, 1.5e-2},
                                           Variant{DType::F32, true, 5e-6, "tiny-qwen3"},
                                           Variant{DType::BF16, false, 1.5e-2, "tiny-qwen3"},
                                           Variant{DType::F32, false, 5e-6, "tiny-llama"},
                                           Variant{DType::BF16, true, 1.5e-2, "tiny-llama"},
                                           // Decoding's few rows run every routed expert as one
                                           // group of products; the full forward, one by one.
                                           Variant{DType::F32, false, 5e-6, "tiny-qwen3-moe"},
                                           Variant{DType::BF16, false, 1.5e-2, "tiny-qwen3-moe"},
                                           Variant{DType::F32, false, 5e-6, "tiny-qwen2-moe"},
                                           Variant{DType::BF16, false, 1.5e-2, "tiny-qwen2-moe"}),
                         [](const auto& info) {
                           std::string family = info.param.preset;
                           family = family == "tiny" ? "" : family.substr(5) + "_";
                           std::replace(family.begin(), family.end(), '-', '_');
                           return family + (info.param.dtype == DType::F32 ? "f32" : "bf16") +
                                  (info.param.tied ? "_tied" : "_untied");
                         });

// Five requests of mixed lengths, greedy and sampled.
std::vector<GenerationRequest> mixed_requests(const ModelConfig& c) {
  std::vector<GenerationRequest> rs;
  const int64_t lengths[] = {3, 17, 9, 30, 1};
  for (int i = 0; i < 5; ++i) {
    GenerationRequest r = request(random_ids(lengths[i], c.vocab_size, 10 + i), 12 + 3 * i);
    r.sampling.temperature = i % 2 ? 0.8 : 0.0;
    r.sampling.top_p = 0.9;
    r.sampling.seed = 5;
    r.sampling.stream = static_cast<uint64_t>(i);
    rs.push_back(r);
  }
  return rs;
}
std::vector<std::vector<int32_t>> tokens_of(const std::vector<GenerationResult>& results) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : results) out.push_back(r.token_ids);
  return out;
}

// A bfloat16 model's prefill (more rows than decoding's products read 16-bit weights as stored
// for) takes bfloat16 operands with float32 accumulation, as Hugging Face and vLLM compute such a
// model: its logits agree with the reference backend's, which rounds at the same points and sums
// exact products, and lie within bfloat16's precision of float32 arithmetic (and differ from it).
// Where the cpu backend has no bfloat16 products the prefill is float32 arithmetic, bit for bit.
TEST(Generator, ABfloat16ModelsPrefillTakesBfloat16ProductsAsTheReferenceDoes) {
  const bool products = !backend_named("cpu").sixteen_bit_products(DType::BF16).empty();
  const ModelConfig c = tiny(DType::BF16);
  const int64_t P = 40;
  const std::vector<int32_t> tokens = random_ids(P, c.vocab_size, 5);
  auto last_logits = [&](const char* backend, DType compute) {
    ModelOptions o = inference_model_options(c, limits(64, 1, 64), &backend_named(backend));
    EXPECT_EQ(o.compute_dtype, DType::BF16) << "a bfloat16 model's inference options";
    o.compute_dtype = compute;
    o.host_logits = true;
    Decoder m(c, o);
    testing_support::init_visible_weights(m, kWeightsSeed);
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(P)}, ctx = {static_cast<int32_t>(P)},
                               blocks = {0, 1, 2, 3}, sample = {0};
    const StepLogits l = m.generation_step(
        {.input_ids = tokens, .cu_seqlens = cu, .context_lens = ctx, .block_tables = blocks, .sample_seqs = sample});
    return std::vector<float>(l.row(0), l.row(0) + c.vocab_size);
  };
  const std::vector<float> cpu = last_logits("cpu", DType::BF16), float32 = last_logits("cpu", DType::F32);
  if (!products) {
    EXPECT_EQ(cpu, float32);
    const testing_support::Difference d = testing_support::difference(cpu, last_logits("reference", DType::F32));
    // float32 against float64 sums: 1.6e-6 of the largest logit measured (the sanitizer build).
    EXPECT_TRUE(d.ok() && d.worst < 5e-6 * d.scale) << d.describe();
    return;
  }
  const std::vector<float> reference = last_logits("reference", DType::BF16);
  const testing_support::Difference same = testing_support::difference(cpu, reference),
                                    rounded = testing_support::difference(cpu, float32);
  // Measured on an AMD EPYC (Zen 4), relative to the largest |logit| (2.7): 1.3e-7 from the
  // reference, 6.7e-3 from float32 arithmetic.
  EXPECT_TRUE(same.ok() && same.worst < 1e-6 * same.scale) << same.describe();
  EXPECT_TRUE(rounded.ok() && rounded.worst > 1e-3 * rounded.scale && rounded.worst < 2e-2 * rounded.scale)
      << rounded.describe();
  std::printf("prefill logits, cpu against the reference: %s; against float32 arithmetic: %s\n",
              same.describe().c_str(), rounded.describe().c_str());
}

// With bfloat16 products no layer matrix is widened in inference either: the forward's matrix
// scratch holds only a group's 16-bit biases (three vectors), where float32 arithmetic widens a
// whole matrix into it.
// (Where the cpu backend has no bfloat16 products, a whole matrix is widened as for float32.)
TEST(Generator, ABfloat16ModelsInferencePlanWidensNoMatrix) {
  const bool products = !backend_named("cpu").sixteen_bit_products(DType::BF16).empty();
  const ModelConfig c = tiny(DType::BF16);
  auto matrix_scratch = [&](DType compute, int64_t step_tokens) {
    ModelOptions o = inference_model_options(c, limits(64, 1, step_tokens), &backend_named("cpu"));
    o.compute_dtype = compute;
    const Decoder m(c, o);
    for (const BufferDecl& b : m.plan().buffers())
      if (b.name == "forward.matrix_f32") return b.bytes;
    return size_t{0};
  };
  const size_t largest_vector = static_cast<size_t>(std::max(c.q_dim(), c.intermediate_size));
  const size_t matrix = static_cast<size_t>(c.intermediate_size * c.hidden_size) * 4;
  if (products)
    EXPECT_LE(matrix_scratch(DType::BF16, 64), 3 * largest_vector * 4);
  else
    EXPECT_EQ(matrix_scratch(DType::BF16, 64), matrix);
  EXPECT_EQ(matrix_scratch(DType::F32, 64), matrix);
  // float32 arithmetic whose steps never exceed the rows read as stored (decoding's few rows):
  // no matrix widened either, and generation runs inside that plan (a view beyond a planned
  // buffer stops it).
  const int64_t few = backend_named("cpu").stored_weight_rows();
  EXPECT_LE(matrix_scratch(DType::F32, few), 3 * largest_vector * 4);
  ModelOptions o = inference_model_options(c, limits(64, 4, few), &backend_named("cpu"));
  o.compute_dtype = DType::F32;
  Decoder m(c, o);
  testing_support::init_visible_weights(m, kWeightsSeed);
  const std::vector<GenerationResult> r = Generator(m, nullptr).generate(mixed_requests(c));
  for (const GenerationResult& g : r) EXPECT_FALSE(g.token_ids.empty());
}

TEST(Generator, BatchedChunkedAndWaitingRequestsGiveTheSameTokensAsOneByOne) {
  const ModelConfig c = tiny();
  const std::vector<GenerationRequest> rs = mixed_requests(c);
  std::vector<std::vector<int32_t>> alone;
  for (const auto& r : rs) {
    auto m = inference_model(c, limits(64, 1, 64));
    alone.push_back(Generator(*m, nullptr).generate({r})[0].token_ids);
  }
  {  // all at once, prompts in one step
    auto m = inference_model(c, limits(64, 8, 64));
    Generator g(*m, nullptr);
    EXPECT_EQ(tokens_of(g.generate(rs)), alone);
    EXPECT_EQ(g.stats().most_running, 5);
    EXPECT_EQ(g.stats().waiting_steps, 0);
  }
  {  // prompts chunked to 8 tokens a step, mixed with decode tokens
    auto m = inference_model(c, limits(64, 8, 8));
    Generator g(*m, nullptr);
    EXPECT_EQ(tokens_of(g.generate(rs)), alone);
    EXPECT_GT(g.stats().steps, 30 / 8);
  }
  {  // one sequence at a time: the others wait and all finish
    auto m = inference_model(c, limits(64, 1, 64));
    Generator g(*m, nullptr);
    const auto results = g.generate(rs);
    EXPECT_EQ(tokens_of(results), alone);
    EXPECT_EQ(g.stats().most_running, 1);
    EXPECT_GT(g.stats().waiting_steps, 0);
    for (const auto& r : results) EXPECT_EQ(r.finish_reason, "length");
  }
}

// A prompt arriving while another sequence decodes is read in chunks that fill a step up to N
// tokens (set_max_decode_step_tokens), so the decoding one keeps stepping; the tokens are unchanged.
TEST(Generator, DecodingStepsTakeAtMostTheirPrefillShareOfAPrompt) {
  const ModelConfig c = tiny();
  const GenerationRequest first = request(random_ids(2, c.vocab_size, 3), 24);
  const GenerationRequest second = request(random_ids(40, c.vocab_size, 4), 6);
  std::vector<std::vector<int32_t>> alone;
  for (const auto& r : {first, second}) {
    auto m = inference_model(c, limits(64, 1, 64));
    alone.push_back(Generator(*m, nullptr).generate({r})[0].token_ids);
  }
  auto m = inference_model(c, limits(64, 2, 64));
  GenerationEngine engine(*m, nullptr);
  engine.set_max_decode_step_tokens(8);
  std::vector<std::vector<int32_t>> got(2);
  engine.add(first, {.on_text = nullptr, .on_token = nullptr, .on_finish = [&](GenerationResult&& r) { got[0] = r.token_ids; }});
  engine.step();  // the first prompt alone
  engine.add(second, {.on_text = nullptr, .on_token = nullptr, .on_finish = [&](GenerationResult&& r) { got[1] = r.token_ids; }});
  int64_t prefill_steps = 0;
  while (!engine.idle()) {
    const int64_t before = engine.stats().prefill_tokens;
    engine.step();
    const int64_t read = engine.stats().prefill_tokens - before;
    EXPECT_LE(read, 7);  // one decode token and 7 of the prompt
    prefill_steps += read > 0;
  }
  EXPECT_EQ(prefill_steps, 6);  // 40 prompt tokens, 7 a step
  EXPECT_EQ(got, alone);
}

TEST(Generator, APoolSizedByABudgetMakesRequestsWaitForBlocks) {
  const ModelConfig c = tiny();
  InferenceLimits l = limits(64, 8, 64);
  // The budget: everything but the pool, plus 6 blocks (two requests of 3 blocks each at most).
  ModelOptions one = inference_model_options(c, l, nullptr, false);
  one.kv_cache.blocks = 1;
  const Decoder probe(c, one);
  const size_t per_block = kv_bytes_per_token(c) * 16;
  l.device_memory = probe.plan().peak_bytes() + 5 * per_block;
  l.memory_fraction = 1.0;
  const ModelOptions o = inference_model_options(c, l, nullptr);
  EXPECT_EQ(o.kv_cache.blocks, 6);
  Decoder m(c, o);
  testing_support::init_visible_weights(m, kWeightsSeed);
  EXPECT_LE(m.plan().peak_bytes(), l.device_memory);
  Generator g(m, nullptr);
  const auto rs = mixed_requests(c);
  const auto results = g.generate(rs);
  EXPECT_GT(g.stats().waiting_steps, 0);
  EXPECT_LT(g.stats().most_running, 5);
  auto m1 = inference_model(c, limits(64, 1, 64));
  for (size_t i = 0; i < rs.size(); ++i)
    EXPECT_EQ(results[i].token_ids, Generator(*m1, nullptr).generate({rs[i]})[0].token_ids) << i;
  // Planned == handed out: the arena's high-water mark is the plan's peak.
  EXPECT_EQ(m.arena().high_water_bytes(), m.plan().peak_bytes());

  l.device_memory = probe.plan().peak_bytes() + per_block;  // less than one sequence of 64 tokens
  EXPECT_NE(testing_support::error_of([&] { inference_model_options(c, l, nullptr); }).find("cannot hold"),
            std::string::npos);
}

// A LoRA adapter of rank 4 on every linear layer, with random A and B (B is zero at PEFT's
// initialization, which would make the adapter change nothing).
LoraConfig test_lora() {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8;
  l.targets.fill(true);
  return l;
}
void randomize_adapter(Decoder& m, uint64_t seed) {
  m.parameters().init_lora(3);
  for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
    const Tensor t = m.parameters().trainable_value(i);
    Rng rng(seed + i);
    std::vector<float> v(static_cast<size_t>(t.numel()));
    for (float& x : v) x = static_cast<float>(0.05 * rng.normal());
    upload_f32(m.backend(), t, v);
  }
}

// An adapter applied on the fly (y = Wx + s B(Ax)) gives the logits of the same adapter merged
// into W, at every step of a greedy generation.
TEST(Generator, UnmergedLoraEqualsMergedLora) {
  const ModelConfig c = tiny();
  ModelOptions o = inference_model_options(c, limits(64, 2, 16), nullptr);
  o.lora = test_lora();
  auto with_adapter = [&] {
    auto m = std::make_unique<Decoder>(c, o);
    testing_support::init_visible_weights(*m, kWeightsSeed);
    randomize_adapter(*m, 100);
    return m;
  };
  auto unmerged = with_adapter(), merged = with_adapter();
  merged->parameters().merge_lora();
  auto plain = inference_model(c, limits(64, 2, 16));
  const std::vector<GenerationRequest> rs = {mixed_requests(c)[0], mixed_requests(c)[1]};
  std::vector<std::vector<float>> rows_unmerged, rows_merged, rows_plain;
  const auto a = Generator(*unmerged, nullptr).generate(rs);
  const auto b = Generator(*merged, nullptr).generate(rs);
  EXPECT_EQ(tokens_of(a), tokens_of(b));
  EXPECT_NE(tokens_of(a), tokens_of(Generator(*plain, nullptr).generate(rs))) << "the adapter changed nothing";
  // Logits of one prefill step, within float32 rounding of the two association orders.
  const std::vector<int32_t> ids = rs[0].prompt_ids, cu = {0, static_cast<int32_t>(ids.size())},
                             ctx = {static_cast<int32_t>(ids.size())}, tables = {0, 1, 2, 3}, sample = {0};
  const GenerationBatch batch{.input_ids = ids, .cu_seqlens = cu, .context_lens = ctx, .block_tables = tables,
                              .sample_seqs = sample};
  const StepLogits lu = unmerged->generation_step(batch);
  const std::vector<float> u(lu.row(0), lu.row(0) + c.vocab_size);
  const StepLogits lm = merged->generation_step(batch);
  const std::vector<float> m(lm.row(0), lm.row(0) + c.vocab_size);
  EXPECT_TRUE(testing_support::close(m, u, testing_support::absolute_tolerance(1e-5)));
}

// Evaluation by generation during training: a generation view of the training model (LoRA being
// trained, bfloat16 base) computes with the training model's parameters as they are, so it
// generates what an inference model holding copies of them generates, follows their updates,
// and plans no weights of its own.
TEST(Generator, AGenerationViewUsesItsBaseModelsCurrentParameters) {
  const ModelConfig c = tiny(DType::BF16);
  ModelOptions train_options;
  train_options.max_tokens = 64;
  train_options.with_optimizer = true;
  train_options.lora = test_lora();
  Decoder training(c, train_options);
  testing_support::init_visible_weights(training, kWeightsSeed);
  randomize_adapter(training, 100);
  Decoder view(training, inference_model_options(c, limits(64, 2, 16), nullptr));

  ModelOptions copy_options = inference_model_options(c, limits(64, 2, 16), nullptr);
  copy_options.lora = test_lora();
  auto copy_with_adapter = [&](uint64_t seed) {
    auto m = std::make_unique<Decoder>(c, copy_options);
    testing_support::init_visible_weights(*m, kWeightsSeed);
    randomize_adapter(*m, seed);
    return m;
  };
  const std::vector<GenerationRequest> rs = {mixed_requests(c)[0], mixed_requests(c)[1]};
  const auto before = tokens_of(Generator(view, nullptr).generate(rs));
  EXPECT_EQ(before, tokens_of(Generator(*copy_with_adapter(100), nullptr).generate(rs)));
  randomize_adapter(training, 200);  // as an optimizer step would change them
  const auto after = tokens_of(Generator(view, nullptr).generate(rs));
  EXPECT_NE(before, after);
  EXPECT_EQ(after, tokens_of(Generator(*copy_with_adapter(200), nullptr).generate(rs)));

  EXPECT_EQ(view.plan().live_bytes(Phase::Forward, Category::Weights), 0u);
  EXPECT_GT(view.plan().live_bytes(Phase::Forward, Category::KvCache), 0u);
  const auto copy = copy_with_adapter(1);
  const size_t copy_weights = copy->plan().live_bytes(Phase::Forward, Category::Weights);
  EXPECT_GT(copy_weights, 0u);
  EXPECT_LE(view.plan().peak_bytes() + copy_weights, copy->plan().peak_bytes());
}

// Two adapters held side by side and chosen per request, in one batch, give each request the
// tokens of a model with only its adapter (or none). In a mixture of experts (tiny-qwen3-moe,
// tiny-qwen2-moe with its shared expert), the second adapter is on every expert's projections,
// each expert's rows taking their own sequences' adapters.
void adapters_chosen_per_request_equal_each_alone(const ModelConfig& c) {
  const auto dir = testing_support::make_temp_dir("adapter_sets");
  std::vector<LoraConfig> configs;
  for (int k = 0; k < 2; ++k) {  // two adapters of different ranks and targets, saved as PEFT files
    LoraConfig lora;
    lora.rank = 2 + 2 * k;
    lora.alpha = 8;
    lora.targets.fill(k == 1);
    lora.targets[static_cast<size_t>(LinearSite::Q)] = lora.targets[static_cast<size_t>(LinearSite::V)] = true;
    ModelOptions o;
    o.max_tokens = 8;
    o.with_grads = false;
    o.lora = lora;
    Decoder m(c, o);
    testing_support::init_visible_weights(m, kWeightsSeed);
    for (size_t i = 0; i < m.parameters().num_trainable(); ++i) {
      const Tensor t = m.parameters().trainable_value(i);
      Rng rng(200 + 10 * k + i);
      std::vector<float> v(static_cast<size_t>(t.numel()));
      for (float& x : v) x = static_cast<float>(0.05 * rng.normal());
      upload_f32(m.backend(), t, v);
    }
    m.parameters().save_adapter((dir / std::to_string(k)).string(), "tiny");
    configs.push_back(lora);
  }
  ModelOptions o = inference_model_options(c, limits(64, 6, 64), nullptr);
  o.adapter_sets = configs;
  Decoder both(c, o);
  testing_support::init_visible_weights(both, kWeightsSeed);
  for (size_t k = 0; k < 2; ++k) both.parameters().load_adapter_set(k, (dir / std::to_string(k)).string());
  std::vector<GenerationRequest> rs = mixed_requests(c);
  rs.push_back(rs[1]);
  for (size_t i = 0; i < rs.size(); ++i) rs[i].adapter = static_cast<int32_t>(i % 3) - 1;  // none, 0, 1, none, ...
  const auto together = Generator(both, nullptr).generate(rs);
  for (size_t i = 0; i < rs.size(); ++i) {
    ModelOptions alone_options = inference_model_options(c, limits(64, 1, 64), nullptr);
    if (rs[i].adapter >= 0) alone_options.lora = configs[static_cast<size_t>(rs[i].adapter)];
    Decoder alone(c, alone_options);
    testing_support::init_visible_weights(alone, kWeightsSeed);
    if (rs[i].adapter >= 0) alone.parameters().load_adapter((dir / std::to_string(rs[i].adapter)).string());
    GenerationRequest r = rs[i];
    r.adapter = -1;
    EXPECT_EQ(together[i].token_ids, Generator(alone, nullptr).generate({r})[0].token_ids) << "request " << i;
  }
  // Requests 1 and 5 are the same request (prompt, seed, stream) with adapters 0 and 1.
  EXPECT_NE(together[1].token_ids, together[5].token_ids);
  std::filesystem::remove_all(dir);
}

TEST(Generator, AdaptersChosenPerRequestEqualEachAlone) { adapters_chosen_per_request_equal_each_alone(tiny()); }

TEST(Generator, AdaptersChosenPerRequestEqualEachAloneInAMixtureOfExperts) {
  for (const char* preset : {"tiny-qwen3-moe", "tiny-qwen2-moe"}) {
    SCOPED_TRACE(preset);
    adapters_chosen_per_request_equal_each_alone(tiny(DType::F32, true, preset));
  }
}

TEST(Generator, RefusesARequestLongerThanMaxModelLen) {
  const ModelConfig c = tiny();
  auto m = inference_model(c, limits(32));
  Generator g(*m, nullptr);
  GenerationRequest ok = request(random_ids(4, c.vocab_size, 1), 28);
  GenerationRequest too_long = request(random_ids(20, c.vocab_size, 1), 13);
  EXPECT_EQ(testing_support::error_of([&] { g.generate({ok, too_long}); }),
            "request 1: the prompt's 20 tokens + max_new_tokens 13 = 33 exceed max_model_len 32");
  EXPECT_EQ(g.generate({ok})[0].token_ids.size(), 28u);
}

TEST(Generator, ReferenceBackendGeneratesTheSameTokens) {
  const ModelConfig c = tiny(DType::BF16, false);
  std::vector<GenerationRequest> rs = mixed_requests(c);
  rs.resize(3);
  auto cpu = inference_model(c, limits(64, 4, 16));
  auto ref = inference_model(c, limits(64, 4, 16), &backend_named("reference"));
  EXPECT_EQ(tokens_of(Generator(*ref, nullptr).generate(rs)), tokens_of(Generator(*cpu, nullptr).generate(rs)));
}

TEST(Generator, StopIdsStopStringsAndStreamedText) {
  const Tokenizer tok = testing_support::synthetic_tokenizer();
  ModelConfig c = tiny();
  c.vocab_size = tok.vocab_size();
  auto m = inference_model(c, limits(96, 2, 32));
  Generator g(*m, &tok);
  GenerationRequest r = request(tok.encode("hello world"), 60);
  r.sampling.temperature = 1.0;
  r.sampling.seed = 3;
  std::string streamed;
  const GenerationResult plain = g.generate({r}, [&](size_t, std::string_view piece) { streamed += piece; })[0];
  EXPECT_EQ(streamed, plain.text);
  EXPECT_EQ(plain.text, tok.decode(plain.token_ids, true));
  ASSERT_GT(plain.token_ids.size(), 20u);

  // A model whose vocabulary is padded past the tokenizer's (as Qwen2.5's 151936 rows over 151665
  // tokens): ids without a token add no text instead of failing.
  {
    ModelConfig padded = c;
    padded.vocab_size = tok.vocab_size() + 64;
    auto pm = inference_model(padded, limits(96, 2, 32));
    GenerationRequest beyond = r;
    beyond.sampling.temperature = 3.0;  // flat enough to draw padding ids
    const GenerationResult out = Generator(*pm, &tok).generate({beyond})[0];
    std::string expected_text;
    for (int32_t id : out.token_ids)
      if (tok.has_id(id)) expected_text += tok.token_bytes(id, true);
    EXPECT_TRUE(std::any_of(out.token_ids.begin(), out.token_ids.end(), [&](int32_t id) { return !tok.has_id(id); }));
    std::string lossy;
    tokenizer_detail::append_utf8_lossy(expected_text, lossy);
    EXPECT_EQ(out.text, lossy);
  }

  // A stop id ends the request at that token (kept in token_ids).
  GenerationRequest with_id = r;
  with_id.stop_ids = {plain.token_ids[10]};
  const size_t first =
      std::find(plain.token_ids.begin(), plain.token_ids.end(), plain.token_ids[10]) - plain.token_ids.begin();
  const GenerationResult by_id = g.generate({with_id})[0];
  EXPECT_EQ(by_id.finish_reason, "stop");
  EXPECT_EQ(by_id.token_ids, std::vector<int32_t>(plain.token_ids.begin(), plain.token_ids.begin() + first + 1));

  // A stop string ends the text before it, even when it spans tokens.
  const std::string bytes = [&] {
    std::string b;
    for (int32_t id : plain.token_ids) b += tok.token_bytes(id, true);
    return b;
  }();
  ASSERT_GT(bytes.size(), 12u);
  GenerationRequest with_string = r;
  with_string.stop = {bytes.substr(8, 3)};
  streamed.clear();
  const GenerationResult by_string =
      g.generate({with_string}, [&](size_t, std::string_view piece) { streamed += piece; })[0];
  EXPECT_EQ(by_string.finish_reason, "stop");
  std::string expected;
  tokenizer_detail::append_utf8_lossy(std::string_view(bytes).substr(0, bytes.find(bytes.substr(8, 3))), expected);
  EXPECT_EQ(by_string.text, expected);
  EXPECT_EQ(streamed, by_string.text);
}

TEST(Generator, AStopRequestEndsEveryRequestWhereItIs) {
  const ModelConfig c = tiny();
  auto m = inference_model(c, limits(64, 2, 64));
  Generator g(*m, nullptr);
  int asked = 0;
  const auto results = g.generate(mixed_requests(c), {}, [&] { return ++asked > 4; });
  ASSERT_EQ(results.size(), 5u);
  for (const auto& r : results) {
    EXPECT_EQ(r.finish_reason, "abort");
    EXPECT_LE(r.token_ids.size(), 4u);
  }
  EXPECT_EQ(results[0].token_ids.size(), 4u);  // running from the first step: one token per step
  EXPECT_TRUE(results[4].token_ids.empty());   // still waiting
  EXPECT_EQ(g.stats().steps, 4);
}

TEST(Generator, CompleteUtf8Prefix) {
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("abc"), 3u);
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("a\xc3"), 1u);          // the lead of a 2-byte character
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("a\xc3\xa9"), 3u);      // é whole
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("\xe4\xbd"), 0u);       // 2 of 3 bytes of 你
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("\xe4\xbd\xa0"), 3u);
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("x\xf0\x9f\x98"), 1u);  // 3 of 4 bytes of an emoji
  EXPECT_EQ(tokenizer_detail::complete_utf8_prefix("\x80\x80"), 2u);       // stray continuation bytes pass (lossy)
}

}  // namespace
}  // namespace memtune

// The Qwen2 model on the CPU backend: plan == arena high-water, no allocation during a step,
// gradient checkpointing and loss chunking change nothing numerically, packed sequences are
// independent, 16-bit storage stays 16-bit, and checkpoints round-trip through HF files.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <unistd.h>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "backend/registry.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/decoder.h"
#include "memory/process_memory.h"
#include "support/test_util.h"
#include "support/numeric.h"
#include "support/visible_weights.h"

namespace memtune {
namespace {

struct Sample {
  std::vector<int32_t> ids, labels, cu;
  TokenBatch batch() const { return {ids, labels, cu}; }
};

// Sequences of the given lengths with random ids; some labels masked with -100.
Sample make_sample(const std::vector<int32_t>& lengths, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  Sample s;
  s.cu.push_back(0);
  for (int32_t len : lengths) {
    for (int32_t t = 0; t < len; ++t) {
      s.ids.push_back(static_cast<int32_t>(rng.next_u64() % vocab));
      s.labels.push_back(rng.uniform() < 0.2 ? -100 : s.ids.back());
    }
    s.cu.push_back(static_cast<int32_t>(s.ids.size()));
  }
  return s;
}

ModelConfig tiny(DType dtype = DType::F32, bool tied = true) {
  ModelConfig c = model_preset("tiny");
  c.torch_dtype = dtype;
  c.tie_word_embeddings = tied;
  return c;
}

std::vector<std::vector<float>> grads_of(const Decoder& m) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < m.parameters().specs().size(); ++i)
    out.push_back(download_f32(m.backend(), m.parameters().grad(i)));
  return out;
}

void expect_close(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, double rel,
                  const Decoder& m) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(testing_support::close(a[i], b[i], {1e-9, rel})) << m.parameters().specs()[i].name;
  }
}

// The largest difference of any tensor relative to that tensor's largest value (NaN when a
// value is not finite or the shapes differ: every comparison with it fails).
double worst_relative(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return std::nan("");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const testing_support::Difference d = testing_support::difference(a[i], b[i]);
    if (!d.ok()) return std::nan("");
    if (d.scale > 0 && !(d.worst / d.scale <= worst)) worst = d.worst / d.scale;
  }
  return worst;
}

// What the cpu backend computes when `compute` is asked for: `compute` where it has such
// products, float32 arithmetic otherwise (a CPU without AVX512-BF16 / AMX, or oneDNN capped below
// them by ONEDNN_MAX_CPU_ISA).
DType cpu_arithmetic(DType compute) {
  return compute == DType::F32 || backend_named("cpu").sixteen_bit_products(compute).empty() ? DType::F32 : compute;
}

class PlanTest : public ::testing::TestWithParam<std::tuple<bool, DType, bool>> {};

TEST_P(PlanTest, ArenaHighWaterEqualsPlannedPeakAndNoHeapAllocationInAStep) {
  const auto [checkpointing, dtype, tied] = GetParam();
  ModelOptions opt;
  opt.max_tokens = 48;
  opt.gradient_checkpointing = checkpointing;
  opt.loss_workspace_bytes = 16 * 512 * 4;
  Decoder model(tiny(dtype, tied), opt);
  model.arena().set_poison_on_release(true);
  model.parameters().init_random(1);
  model.parameters().zero_grads();
  const Sample s = make_sample({20, 1, 27}, 512, 2);
  model.forward_backward(s.batch());  // warm-up: thread pools, BLAS buffers

  const HeapAllocations heap_before = heap_allocations();
  const LossSum loss = model.forward_backward(s.batch());
  EXPECT_EQ((heap_allocations() - heap_before).count, 0) << "a forward/backward allocated outside the arena";

  EXPECT_TRUE(std::isfinite(loss.sum));
  EXPECT_GT(loss.count, 0);
  EXPECT_EQ(model.arena().capacity_bytes(), model.plan().peak_bytes());
  const size_t high = model.arena().high_water_bytes();
  EXPECT_LE(high, model.plan().peak_bytes());
  EXPECT_GE(high + (size_t{1} << 20), model.plan().peak_bytes());
  EXPECT_EQ(high, model.plan().peak_bytes());  // no padding besides per-buffer alignment
  // 16-bit storage is not silently widened: weights take 2 bytes per parameter.
  EXPECT_EQ(model.plan().live_bytes(Phase::Forward, Category::Weights) / 64,
            static_cast<size_t>(model_parameter_count(model.config())) * dtype_size(dtype) / 64);
  for (const auto& g : grads_of(model))
    for (float x : g) ASSERT_TRUE(std::isfinite(x));
}

INSTANTIATE_TEST_SUITE_P(Configs, PlanTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "checkpointing_" : "saved_") +
                                  std::string(dtype_safetensors_name(std::get<1>(info.param))) +
                                  (std::get<2>(info.param) ? "_tied" : "_untied");
                         });

TEST(Qwen2, CheckpointingSavesActivationMemoryAndGivesTheSameGradients) {
  const Sample s = make_sample({33, 15}, 512, 3);
  auto run = [&](bool ckpt, std::vector<std::vector<float>>& grads, size_t& saved) {
    ModelOptions opt;
    opt.max_tokens = 48;
    opt.gradient_checkpointing = ckpt;
    Decoder m(tiny(), opt);
    m.parameters().init_random(4);
    m.parameters().zero_grads();
    const double loss = m.forward_backward(s.batch()).sum;
    grads = grads_of(m);
    saved = m.plan().live_bytes(Phase::Backward, Category::SavedActivations);
    return loss;
  };
  std::vector<std::vector<float>> g_full, g_ckpt;
  size_t saved_full = 0, saved_ckpt = 0;
  const double l_full = run(false, g_full, saved_full), l_ckpt = run(true, g_ckpt, saved_ckpt);
  EXPECT_EQ(l_full, l_ckpt);
  ModelOptions opt;
  Decoder shape(tiny(), opt);
  expect_close(g_ckpt, g_full, 1e-6, shape);
  EXPECT_LT(saved_ckpt * 4, saved_full);
}

TEST(Qwen2, LossChunkSizeDoesNotChangeResults) {
  const Sample s = make_sample({40}, 512, 5);
  std::vector<std::vector<float>> grads[2];
  double losses[2];
  const size_t budgets[2] = {1, size_t{64} << 20};  // one row per chunk vs. everything at once
  for (int i = 0; i < 2; ++i) {
    ModelOptions opt;
    opt.max_tokens = 40;
    opt.loss_workspace_bytes = budgets[i];
    Decoder m(tiny(DType::F32, false), opt);
    EXPECT_EQ(m.loss_chunk_rows(), i == 0 ? 1 : 40);
    m.parameters().init_random(6);
    m.parameters().zero_grads();
    losses[i] = m.forward_backward(s.batch()).sum;
    grads[i] = grads_of(m);
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-5 * std::abs(losses[1]));
  ModelOptions opt;
  expect_close(grads[0], grads[1], 1e-5, Decoder(tiny(DType::F32, false), opt));
}

TEST(Qwen2, PackedSequencesAreIndependent) {
  // Loss and gradients of a packed batch equal the sums over each sequence run alone: attention
  // never crosses a boundary and positions restart at 0.
  const Sample packed = make_sample({17, 9, 22}, 512, 7);
  ModelOptions opt;
  opt.max_tokens = 48;
  Decoder m(tiny(), opt);
  m.parameters().init_random(8);
  m.parameters().zero_grads();
  const LossSum whole = m.forward_backward(packed.batch());
  const auto g_whole = grads_of(m);
  m.parameters().zero_grads();
  double sum = 0;
  int64_t count = 0;
  for (size_t s = 0; s + 1 < packed.cu.size(); ++s) {
    const int32_t b = packed.cu[s], e = packed.cu[s + 1];
    Sample one;
    one.ids.assign(packed.ids.begin() + b, packed.ids.begin() + e);
    one.labels.assign(packed.labels.begin() + b, packed.labels.begin() + e);
    one.cu = {0, e - b};
    const LossSum part = m.forward_backward(one.batch());
    sum += part.sum;
    count += part.count;
  }
  EXPECT_EQ(count, whole.count);
  EXPECT_NEAR(sum, whole.sum, 1e-5 * std::abs(whole.sum));
  expect_close(grads_of(m), g_whole, 1e-5, m);
}

TEST(Qwen2, RejectsBadBatches) {
  ModelOptions opt;
  opt.max_tokens = 8;
  Decoder m(tiny(), opt);
  m.parameters().init_random(1);
  Sample s = make_sample({9}, 512, 1);
  EXPECT_THROW(m.forward_backward(s.batch()), Error);  // more tokens than planned
  s = make_sample({4}, 512, 1);
  s.ids[2] = 512;
  EXPECT_THROW(m.forward_backward(s.batch()), Error);  // id outside the vocabulary
}

TEST(Qwen2, SaveLoadRoundTripAndLoadErrors) {
  const auto dir = testing_support::make_temp_dir("model_test");
  struct Cleanup {
    std::filesystem::path p;
    ~Cleanup() { std::filesystem::remove_all(p); }
  } cleanup{dir};
  ModelOptions opt;
  opt.max_tokens = 4;
  Decoder a(tiny(DType::BF16, false), opt);
  a.parameters().init_random(9);
  a.parameters().save(dir.string());
  const ModelConfig loaded = load_config_json(dir.string() + "/config.json");
  EXPECT_EQ(loaded.torch_dtype, DType::BF16);
  EXPECT_FALSE(loaded.tie_word_embeddings);
  Decoder b(loaded, opt);
  b.parameters().load(CheckpointReader(dir.string()));
  for (size_t i = 0; i < a.parameters().specs().size(); ++i) {
    std::vector<uint16_t> wa(a.parameters().specs()[i].numel()), wb(wa.size());
    a.backend().copy_to_host(wa.data(), a.parameters().param(i));
    b.backend().copy_to_host(wb.data(), b.parameters().param(i));
    EXPECT_EQ(wa, wb) << a.parameters().specs()[i].name;
  }

  // A config with one more layer than the checkpoint: the missing tensor is named.
  ModelConfig deeper = loaded;
  deeper.num_hidden_layers = 3;
  Decoder c(deeper, opt);
  EXPECT_CONTAINS(testing_support::error_of([&] { c.parameters().load(CheckpointReader(dir.string())); }),
                  "model.layers.2.input_layernorm.weight");
  // A tied config reading an untied checkpoint is fine (lm_head ignored), a shallower one is not.
  ModelConfig shallower = loaded;
  shallower.num_hidden_layers = 1;
  Decoder d(shallower, opt);
  EXPECT_CONTAINS(testing_support::error_of([&] { d.parameters().load(CheckpointReader(dir.string())); }),
                  "model.layers.1.");
  // Another hidden size: the shape mismatch names the tensor.
  ModelConfig wider = loaded;
  wider.intermediate_size = 180;
  Decoder w(wider, opt);
  EXPECT_CONTAINS(testing_support::error_of([&] { w.parameters().load(CheckpointReader(dir.string())); }),
                  "mlp.gate_proj.weight");
}

TEST(Qwen2, Bfloat16StorageComputesLikeFloat32OnTheSameValues) {
  // A bf16 model and an f32 model holding the same (bf16-representable) values agree.
  ModelOptions opt;
  opt.max_tokens = 32;
  Decoder half(tiny(DType::BF16), opt), full(tiny(DType::F32), opt);
  half.parameters().init_random(10);
  for (size_t i = 0; i < half.parameters().specs().size(); ++i)
    upload_f32(full.backend(), full.parameters().param(i), download_f32(half.backend(), half.parameters().param(i)));
  const Sample s = make_sample({32}, 512, 11);
  half.parameters().zero_grads();
  full.parameters().zero_grads();
  const double lh = half.forward_backward(s.batch()).sum, lf = full.forward_backward(s.batch()).sum;
  EXPECT_NEAR(lh, lf, 1e-6 * std::abs(lf));
  expect_close(grads_of(half), grads_of(full), 1e-6, full);
}

// The whole model on every backend against the reference backend: the same weights give the
// same loss and the same gradient of every parameter (full fine-tuning, 16-bit storage with
// gradient checkpointing, packed sequences with ignored labels; mixed precision, where the
// reference rounds the operands at the same points and sums exact products in float64).
class BackendModelTest : public ::testing::TestWithParam<std::tuple<DType, bool, DType>> {};

TEST_P(BackendModelTest, LossAndGradientsEqualTheReferenceBackend) {
  const auto [dtype, checkpointing, compute] = GetParam();
  // Where the cpu backend has no products of `compute` it runs float32 arithmetic, and is
  // checked against the reference's float32 arithmetic instead.
  const DType arithmetic = cpu_arithmetic(compute);
  const Sample s = make_sample({9, 1, 14}, 512, 12);
  auto run = [&](const char* backend, DType asked, std::vector<std::vector<float>>& grads) {
    ModelOptions opt;
    opt.max_tokens = 24;
    opt.gradient_checkpointing = checkpointing;
    opt.loss_workspace_bytes = 5 * 512 * 4;  // several chunks
    opt.compute_dtype = asked;
    opt.backend = &backend_named(backend);
    Decoder m(tiny(dtype, false), opt);
    m.arena().set_poison_on_release(true);
    testing_support::init_visible_weights(m, 13);
    m.parameters().zero_grads();
    const LossSum loss = m.forward_backward(s.batch());
    grads = grads_of(m);
    return loss;
  };
  std::vector<std::vector<float>> ref_grads, cpu_grads;
  const LossSum ref = run("reference", arithmetic, ref_grads), cpu = run("cpu", compute, cpu_grads);
  EXPECT_EQ(cpu.count, ref.count);
  // Bounds a few times the error measured on an AMD EPYC (Zen 4, AVX512-BF16): the loss within
  // 3e-8 in both arithmetics, gradients within 1.4e-6 (float32) and 1.4e-5 (mixed precision) of
  // their tensor's largest value. Mixed precision's float32 sums that differ in their last bit
  // may round to neighbouring bfloat16 values (2^-8 apart) where the next product takes them, and
  // other CPUs block their sums differently, so its bound leaves more room; a missing rounding
  // point moves gradients by about 2^-9 = 2e-3.
  const bool half = arithmetic != DType::F32;
  const double loss_error = std::abs(cpu.sum - ref.sum) / std::abs(ref.sum), grad_error = worst_relative(cpu_grads, ref_grads);
  std::printf("%s arithmetic: loss relative error %.3g, worst gradient error relative to its tensor %.3g\n",
              std::string(dtype_torch_name(arithmetic)).c_str(), loss_error, grad_error);
  EXPECT_LT(loss_error, 2e-7);
  ModelOptions opt;
  opt.allocate = false;
  expect_close(cpu_grads, ref_grads, half ? 1e-4 : 5e-6, Decoder(tiny(dtype, false), opt));
}

INSTANTIATE_TEST_SUITE_P(Configs, BackendModelTest,
                         ::testing::Values(std::tuple{DType::F32, false, DType::F32},
                                           std::tuple{DType::BF16, true, DType::F32},
                                           std::tuple{DType::BF16, false, DType::BF16},
                                           std::tuple{DType::BF16, true, DType::BF16}));

// Mixed precision keeps the plan exact (arena == plan) and allocates nothing sized by the data
// inside a step: what a step allocates is oneDNN's own table of each call's arguments (a few
// small blocks per product, freed before the call returns), the same for 20 tokens as for 47.
// Where the cpu backend has no bfloat16 products, the same request runs float32 arithmetic over
// widened weights: nothing at all is allocated inside a step, and the plan holds the widening
// scratch.
TEST(Qwen2, MixedPrecisionStepsAllocateOnlyOneDnnsPerCallTables) {
  const bool products = cpu_arithmetic(DType::BF16) == DType::BF16;
  ModelOptions opt;
  opt.max_tokens = 48;
  opt.compute_dtype = DType::BF16;
  opt.loss_workspace_bytes = 16 * 512 * 4;
  Decoder model(tiny(DType::BF16, false), opt);
  model.arena().set_poison_on_release(true);
  model.parameters().init_random(1);
  auto step = [&](const Sample& s) {
    model.parameters().zero_grads();
    const HeapAllocations before = heap_allocations();
    EXPECT_TRUE(std::isfinite(model.forward_backward(s.batch()).sum));
    return heap_allocations() - before;
  };
  const Sample small = make_sample({20}, 512, 2), large = make_sample({20, 1, 26}, 512, 3);
  step(small), step(large);  // warm-up: each shape's primitives are made once
  const HeapAllocations a = step(small), b = step(large), c = step(small);
  EXPECT_EQ(a.count, c.count);
  EXPECT_EQ(a.bytes, c.bytes);
  EXPECT_LT(b.bytes, 2 * a.bytes + 4096) << "allocations grow with the batch";
  EXPECT_LT(a.bytes, size_t{256} << 10);
  EXPECT_EQ(model.arena().high_water_bytes(), model.plan().peak_bytes());
  // With bfloat16 products every product reads the layers' matrices as stored: no float32
  // scratch to widen them into. Without them the step widens, and allocates nothing.
  bool widens = false;
  for (const BufferDecl& buffer : model.plan().buffers()) widens |= buffer.name.ends_with(".matrix_f32");
  EXPECT_EQ(widens, !products);
  if (!products) {
    EXPECT_EQ(a.count + b.count, 0u) << "float32 arithmetic allocates nothing inside a step";
  }
  RecordProperty("heap_allocations_per_step", std::to_string(a.count));
  std::printf("a mixed-precision step (20 tokens): %llu allocations, %llu bytes; 47 tokens: %llu, %llu\n",
              static_cast<unsigned long long>(a.count), static_cast<unsigned long long>(a.bytes),
              static_cast<unsigned long long>(b.count), static_cast<unsigned long long>(b.bytes));
}

// Mixed precision changes the arithmetic, not the function: a bfloat16-operand step's loss and
// gradients stay within bfloat16's precision of the float32-arithmetic step on the same weights,
// and differ from it (the rounding happens).
// Without bfloat16 products the request is float32 arithmetic, bit for bit.
TEST(Qwen2, MixedPrecisionStaysWithinBfloat16PrecisionOfFloat32Arithmetic) {
  const Sample s = make_sample({30, 17}, 512, 21);
  auto run = [&](DType compute, std::vector<std::vector<float>>& grads) {
    ModelOptions opt;
    opt.max_tokens = 48;
    opt.compute_dtype = compute;
    Decoder m(tiny(DType::BF16, false), opt);
    m.parameters().init_random(22);
    m.parameters().zero_grads();
    const LossSum loss = m.forward_backward(s.batch());
    grads = grads_of(m);
    return loss.sum;
  };
  std::vector<std::vector<float>> g32, g16;
  const double l32 = run(DType::F32, g32), l16 = run(DType::BF16, g16);
  if (cpu_arithmetic(DType::BF16) == DType::F32) {
    EXPECT_EQ(l16, l32);
    EXPECT_EQ(g16, g32);
    return;
  }
  EXPECT_NE(l16, l32);
  EXPECT_NEAR(l16, l32, 1e-2 * std::abs(l32));
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < g32.size(); ++i)
    for (size_t k = 0; k < g32[i].size(); ++k) {
      ASSERT_TRUE(std::isfinite(g16[i][k]));
      diff2 += double(g16[i][k] - g32[i][k]) * (g16[i][k] - g32[i][k]);
      ref2 += double(g32[i][k]) * g32[i][k];
    }
  EXPECT_GT(diff2, 0.0);
  EXPECT_LT(std::sqrt(diff2 / ref2), 2.0 / 256) << "relative distance of all gradients";
}

}  // namespace
}  // namespace memtune

namespace memtune {
namespace {

// The dense model's name of a mixture-of-experts parameter: an expert's (routed or shared) is
// the MLP's; the router and the shared expert's gate have none ("").
std::string dense_source(const std::string& n) {
  if (n.ends_with("mlp.gate.weight") || n.ends_with("mlp.shared_expert_gate.weight")) return "";
  if (const size_t at = n.find("mlp.experts."); at != std::string::npos)
    return n.substr(0, at) + "mlp." + n.substr(n.find('.', at + 12) + 1);
  if (const size_t at = n.find("mlp.shared_expert."); at != std::string::npos)
    return n.substr(0, at) + "mlp." + n.substr(at + 18);
  return n;
}
size_t param_index(const Decoder& d, const std::string& name) {
  const auto& specs = d.parameters().specs();
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const ParamSpec& s) { return s.name == name; });
  MT_ASSERT(it != specs.end(), name);
  return static_cast<size_t>(it - specs.begin());
}
// Every expert of m (and its shared expert) becomes d's MLP, every other weight d's; the router
// is zeros (or kept random), the shared expert's gate zeros.
void copy_dense_mlp_into_experts(const Decoder& d, Decoder& m, bool random_router) {
  const std::vector<ParamSpec>& specs = m.parameters().specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string& n = specs[i].name;
    const std::string source = dense_source(n);
    if (source.empty()) {
      if (!random_router || n.ends_with("shared_expert_gate.weight"))
        upload_f32(m.backend(), m.parameters().param(i), std::vector<float>(specs[i].numel(), 0.0f));
      continue;
    }
    upload_f32(m.backend(), m.parameters().param(i), download_f32(d.backend(), d.parameters().param(param_index(d, source))));
  }
}

// The mixtures of experts the dense-model oracle below runs, with their dense siblings: qwen3_moe
// with a router of zeros and a random one, qwen2_moe with a zero router.
struct MoeFamily {
  const char* moe;
  const char* dense;
  bool random_router;
};
constexpr MoeFamily kMoeFamilies[] = {
    {"tiny-qwen3-moe", "tiny-qwen3", false}, {"tiny-qwen3-moe", "tiny-qwen3", true}, {"tiny-qwen2-moe", "tiny", false}};
// The family's mixture and the dense model whose MLP is one expert's shape, in `dtype`, vocabulary
// 300; qwen2_moe with 4 experts, every layer sparse, the shared expert as wide as an expert.
std::pair<ModelConfig, ModelConfig> moe_and_dense(const MoeFamily& f, DType dtype) {
  ModelConfig moe = model_preset(f.moe), dense = model_preset(f.dense);
  if (moe.family == ModelFamily::Qwen2Moe) {
    moe.moe.num_experts = 4;
    moe.moe.decoder_sparse_step = 1;
    moe.moe.shared_expert_intermediate_size = moe.moe.expert_intermediate_size;
  }
  moe.torch_dtype = dense.torch_dtype = dtype;
  dense.intermediate_size = moe.moe.expert_intermediate_size;
  moe.vocab_size = dense.vocab_size = 300;
  return {moe, dense};
}

// A mixture of experts whose experts are all one dense MLP computes that dense model: an oracle
// written apart from the routing, whatever the routing is. qwen3_moe (tiny-qwen3-moe: 2 of 8
// experts a token, weights renormalized to sum to 1) with a router of zeros (every score ties:
// experts 0 and 1 take every token, the other six none) and a random one (uneven loads); qwen2_moe
// with 4 experts, 2 a token, not renormalized, and a zero router (each chosen weight 1/4, so the
// routed half plus the shared expert, the same MLP under a zero gate's sigmoid 1/2, is the MLP).
// On every backend that computes mixtures of experts, in float32 and with bfloat16 weights, and
// with bfloat16 operands where the backend has them (the rounded inputs are the dense model's).
TEST(MixtureOfExperts, ExpertsThatAreOneMlpComputeThatDenseModel) {
  for (const std::string_view name : backend_list()) {
    if (!backend_named(name).computes_mixture_of_experts()) continue;
    for (const MoeFamily& f : kMoeFamilies)
      for (const DType dtype : {DType::F32, DType::BF16})
        for (const bool half : {false, true}) {
          if (half && (dtype != DType::BF16 || backend_named(name).sixteen_bit_products(DType::BF16).empty())) continue;
          SCOPED_TRACE(fmt::format("{} {} {} {} router{}", name, f.moe, dtype_torch_name(dtype),
                                   f.random_router ? "random" : "zero", half ? ", bfloat16 operands" : ""));
          const auto [moe, dense] = moe_and_dense(f, dtype);
          ModelOptions o;
          o.max_tokens = 40;
          o.with_grads = false;
          o.backend = &backend_named(name);
          o.compute_dtype = half ? DType::BF16 : DType::F32;
          Decoder d(dense, o), m(moe, o);
          d.parameters().init_random(3);
          m.parameters().init_random(4);
          copy_dense_mlp_into_experts(d, m, f.random_router);
          const Sample s = make_sample({23, 17}, 300, 9);
          std::vector<float> want(40 * 300), got(40 * 300);
          const double dense_loss = d.forward_loss(s.batch(), want.data()).sum;
          const double moe_loss = m.forward_loss(s.batch(), got.data()).sum;
          // The chosen weights sum to 1 up to float32 rounding: the outputs differ by a few ulps.
          EXPECT_TRUE(testing_support::close(got, std::vector<double>(want.begin(), want.end()),
                                             testing_support::relative_tolerance(1e-5)));
          EXPECT_NEAR(moe_loss, dense_loss, 1e-5 * std::abs(dense_loss));
        }
  }
}

// The same oracle for the backward: where every expert is the dense model's MLP, each weight's
// gradient is the dense model's, and the gradients of an MLP weight's copies (the experts', the
// shared expert's) sum to the dense MLP's, whatever the routing (zero router: two experts take
// every token; random: uneven loads, experts with no token). With and without gradient
// checkpointing (the routing recomputed from the saved input), on every backend that trains
// mixtures of experts. The router's and the shared gate's gradients have no dense counterpart:
// transformers' backward checks them (tests/interop/hf_moe_test.py).
TEST(MixtureOfExperts, ExpertsThatAreOneMlpHaveThatDenseModelsGradients) {
  for (const std::string_view name : backend_list()) {
    if (!backend_named(name).trains_mixture_of_experts()) continue;
    for (const MoeFamily& f : kMoeFamilies)
      for (const auto& [checkpointing, half] : {std::pair(false, false), std::pair(true, false), std::pair(true, true)}) {
        if (half && backend_named(name).sixteen_bit_products(DType::BF16).empty()) continue;
        SCOPED_TRACE(fmt::format("{} {} router {}{}{}", name, f.moe, f.random_router ? "random" : "zero",
                                 checkpointing ? ", gradient checkpointing" : "", half ? ", bfloat16 operands" : ""));
        const auto [moe, dense] = moe_and_dense(f, half ? DType::BF16 : DType::F32);
        ModelOptions o;
        o.max_tokens = 40;
        o.gradient_checkpointing = checkpointing;
        o.compute_dtype = half ? DType::BF16 : DType::F32;
        o.backend = &backend_named(name);
        Decoder d(dense, o), m(moe, o);
        d.parameters().init_random(3);
        m.parameters().init_random(4);
        copy_dense_mlp_into_experts(d, m, f.random_router);
        d.parameters().zero_grads();
        m.parameters().zero_grads();
        const Sample s = make_sample({23, 17}, 300, 9);
        const double dense_loss = d.forward_backward(s.batch()).sum, moe_loss = m.forward_backward(s.batch()).sum;
        EXPECT_NEAR(moe_loss, dense_loss, (half ? 1e-3 : 1e-5) * std::abs(dense_loss));
        const std::vector<std::vector<float>> want = grads_of(d), got = grads_of(m);
        std::vector<std::vector<double>> summed(want.size());
        std::vector<int> copies(want.size(), 0);
        for (size_t i = 0; i < got.size(); ++i) {
          const std::string source = dense_source(m.parameters().specs()[i].name);
          if (source.empty()) continue;
          const size_t j = param_index(d, source);
          summed[j].resize(got[i].size(), 0.0);
          for (size_t k = 0; k < got[i].size(); ++k) summed[j][k] += got[i][k];
          ++copies[j];
        }
        // With bfloat16 operands an expert's output gradient is rounded after its routing weight
        // scales it, the dense model's before: bfloat16 rounding apart, where a weight is not a
        // power of two.
        const double tolerance = half ? 2.0 / 256 : 1e-5;
        for (size_t j = 0; j < want.size(); ++j) {
          const std::string& n = d.parameters().specs()[j].name;
          ASSERT_GT(copies[j], 0) << n;
          EXPECT_TRUE(testing_support::close(summed[j], want[j], testing_support::relative_tolerance(tolerance)))
              << n << " (" << copies[j] << " copies)";
        }
      }
  }
}

// What a mixture-of-experts model does not do yet (training on a backend without the experts'
// backward) is refused by name before any memory exists; training (full and LoRA) and
// forward-only models are accepted where the backend has what they need.
TEST(MixtureOfExperts, AdaptersAndUntrainableBackendsAreRefusedByName) {
  const ModelConfig c = model_preset("tiny-qwen2-moe");
  auto error = [&](const ModelOptions& o) {
    try {
      Decoder m(c, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  ModelOptions o;
  o.max_tokens = 8;
  for (const std::string_view name : backend_list()) {
    SCOPED_TRACE(name);
    o.backend = &backend_named(name);
    o.with_grads = true;
    if (!o.backend->computes_mixture_of_experts()) {
      EXPECT_NE(error(o).find("has no mixture-of-experts layers"), std::string::npos) << error(o);
      continue;
    }
    if (o.backend->trains_mixture_of_experts())
      EXPECT_EQ(error(o), "accepted");
    else
      EXPECT_NE(error(o).find(fmt::format("--backend {} does not train mixture-of-experts layers yet", name)),
                std::string::npos)
          << error(o);
    o.with_grads = false;
    EXPECT_EQ(error(o), "accepted");
  }
  o.backend = &backend_named("cpu");
  o.with_grads = true;
  o.lora.rank = 4;
  o.lora.targets.fill(true);
  EXPECT_EQ(error(o), "accepted");
}

}  // namespace
}  // namespace memtune

namespace memtune {
namespace {

// With bfloat16 operands (a bfloat16 model's prefill), a qwen2_moe model's logits stay within
// bfloat16 rounding of its float32 arithmetic, shared expert gate included (random router and
// gate weights): every product's input rounded once, at the rounding point the dense layers use.
// On the reference backend (exact products of the rounded operands) everywhere, and on the cpu
// backend where it has bfloat16 products. Measured (Zen 4, cpu): 5.9e-3 of the scale; a gate that
// read the last expert's rows instead measured 3.4e-2.
TEST(MixtureOfExperts, BfloatOperandsStayWithinBfloat16PrecisionOfFloat32Arithmetic) {
  for (const char* name : {"reference", "cpu"}) {
    Backend& backend = backend_named(name);
    if (backend.sixteen_bit_products(DType::BF16).empty()) {
      std::printf("%s: no bfloat16 products on this CPU, float32 arithmetic either way\n", name);
      continue;
    }
    SCOPED_TRACE(name);
    ModelConfig c = model_preset("tiny-qwen2-moe");
    c.torch_dtype = DType::BF16;
    c.vocab_size = 300;
    const Sample s = make_sample({23, 17}, 300, 9);
    std::vector<float> logits[2];
    for (const bool half : {false, true}) {
      ModelOptions o;
      o.max_tokens = 40;
      o.with_grads = false;
      o.backend = &backend;
      o.compute_dtype = half ? DType::BF16 : DType::F32;
      Decoder m(c, o);
      m.parameters().init_random(5);
      // Gate weights 100x the initialization's: sigmoid(gate . x) then ranges over (0, 1) across
      // tokens, so a gate that read another token's input would move the logits by far more than
      // bfloat16 rounding does.
      const std::vector<ParamSpec>& specs = m.parameters().specs();
      for (size_t i = 0; i < specs.size(); ++i)
        if (specs[i].name.ends_with("shared_expert_gate.weight")) {
          std::vector<float> w = download_f32(m.backend(), m.parameters().param(i));
          for (float& v : w) v *= 100.0f;
          upload_f32(m.backend(), m.parameters().param(i), w);
        }
      logits[half].resize(40 * 300);
      m.forward_loss(s.batch(), logits[half].data());
    }
    const testing_support::Difference d = testing_support::difference(logits[1], logits[0]);
    std::printf("%s: bfloat16 operands against float32 arithmetic: worst %.3g of scale %.3g\n", name, d.worst,
                d.scale);
    EXPECT_GT(d.worst, 0.0);
    EXPECT_LT(d.worst, 1.5e-2 * d.scale);
  }
}

}  // namespace
}  // namespace memtune

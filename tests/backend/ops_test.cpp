// The op harness (ggml's test-backend-ops is the model): a table of ops, each run on every
// backend of the build with the same inputs and compared with the `reference` backend, and
// every backward checked against central finite differences of its forward, including the
// accumulate contract: gradient buffers start NON-zero, and an accumulating backward must add
// exactly the gradient to what was there (an overwriting one must ignore it). Inputs and
// outputs live in each backend's own device memory and cross through its copy functions, so
// this also runs the reference backend's memory locking. A new backend joins kBackends; no new
// test code.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/registry.h"
#include "model/config.h"
#include "core/labels.h"
#include "core/rng.h"
#include "support/numeric.h"

namespace memtune {
namespace {

// Every backend of the build (the registry), each checked against reference.
const std::vector<std::string_view> kBackends = backend_list();

struct Input {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  bool differentiable = false;
  std::vector<float> values;  // floating inputs (converted to dtype on upload)
  std::vector<int32_t> ints;  // int32 inputs
};
struct Output {
  std::string name;
  std::vector<int64_t> shape;
  bool primary = true;  // part of the differentiated function (saved tensors such as rstd are not)
};

using Views = std::map<std::string, Tensor>;

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  std::vector<Output> outputs;
  // Computes the outputs; may return a host scalar (a loss, a norm), compared across backends.
  std::function<double(Backend&, const Views& in, const Views& out)> forward;
  // With dout (the gradient of sum(r * primary outputs)), adds (or writes) d/d(input) into
  // din[name] for every differentiable input. Absent: forward only.
  std::function<void(Backend&, const Views& in, const Views& out, const Views& dout, const Views& din)> backward =
      nullptr;
  // Inputs whose gradient the backward OVERWRITES (the others are accumulated into).
  std::vector<std::string> overwrites = {};
  // The forward's scalar is itself the function to differentiate (a loss), not sum(r * out).
  bool scalar_is_loss = false;
  double tolerance = 1e-5;  // max |backend - reference| / (max |reference| + 1e-6), per tensor
  // Mixed precision: the case's products take 16-bit operands of this dtype (its douts are made
  // in it); it runs on the backends that have such products (Backend::sixteen_bit_products) and
  // is compared with the reference's exact products only: finite differences of 16-bit inputs
  // would measure their rounding.
  DType operands = DType::F32;
  // The backends that have the backward (a capability the model asks before using it; the
  // others are checked on the forward only); absent: all.
  std::function<bool(const Backend&)> backward_runs_on = nullptr;
};

std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = scale * static_cast<float>(rng.normal());
  return v;
}
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
Tensor make_view(void* data, DType dtype, const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return Tensor(data, dtype, {shape[0]});
  if (shape.size() == 2) return Tensor(data, dtype, {shape[0], shape[1]});
  return Tensor(data, dtype, {shape[0], shape[1], shape[2]});
}

// Device memory of one backend for one run of a case: every tensor carved from one allocation.
class DeviceTensors {
 public:
  explicit DeviceTensors(Backend& be) : be_(be) {}
  ~DeviceTensors() {
    for (auto [p, n] : allocations_) be_.deallocate(p, n);
  }
  Tensor make(DType dtype, const std::vector<int64_t>& shape) {
    const size_t bytes = static_cast<size_t>(numel(shape)) * dtype_size(dtype);
    void* p = be_.allocate(std::max<size_t>(bytes, 64));
    allocations_.push_back({p, std::max<size_t>(bytes, 64)});
    return make_view(p, dtype, shape);
  }
  Tensor upload(const Input& in) {
    Tensor t = make(in.dtype, in.shape);
    if (in.dtype == DType::I32)
      be_.copy_to_device(t, in.ints.data());
    else
      upload_f32(be_, t, in.values);
    return t;
  }

 private:
  Backend& be_;
  std::vector<std::pair<void*, size_t>> allocations_;
};

struct RunResult {
  double scalar = 0;
  std::map<std::string, std::vector<float>> outputs, grads;
};

// Upload, forward, and (when the case has one) backward with the given dout and prior gradients.
RunResult run_case(Backend& be, const OpCase& c, const std::map<std::string, std::vector<float>>& dout_values,
                   const std::map<std::string, std::vector<float>>& prior_grads, const std::vector<Input>& inputs) {
  DeviceTensors mem(be);
  Views in, out, dout, din;
  for (const Input& i : inputs) in[i.name] = mem.upload(i);
  for (const Output& o : c.outputs) {
    out[o.name] = mem.make(DType::F32, o.shape);
    be.fill(out[o.name], 0.25f);  // an accumulating forward adds to this
  }
  RunResult r;
  r.scalar = c.forward(be, in, out);
  for (const Output& o : c.outputs) r.outputs[o.name] = download_f32(be, out[o.name]);
  if (!c.backward) return r;
  for (const Output& o : c.outputs) {
    if (!o.primary || c.scalar_is_loss) continue;
    dout[o.name] = mem.make(c.operands, o.shape);
    upload_f32(be, dout[o.name], dout_values.at(o.name));
  }
  for (const Input& i : inputs) {
    if (!i.differentiable) continue;
    din[i.name] = mem.make(DType::F32, i.shape);
    upload_f32(be, din[i.name], prior_grads.at(i.name));
  }
  c.backward(be, in, out, dout, din);
  for (const auto& [name, t] : din) r.grads[name] = download_f32(be, t);
  return r;
}

// |got - want| < tolerance x (max|want| + 1e-6) everywhere, every value finite.
::testing::AssertionResult close_to(const std::vector<float>& got, const std::vector<float>& want, double tolerance) {
  return testing_support::close(got, want, {tolerance * 1e-6, tolerance});
}

// The function the finite differences differentiate: the scalar, or sum(r * primary outputs).
double objective(const OpCase& c, const RunResult& r, const std::map<std::string, std::vector<float>>& dout_values) {
  if (c.scalar_is_loss) return r.scalar;
  double s = 0;
  for (const Output& o : c.outputs) {
    if (!o.primary) continue;
    const auto& v = r.outputs.at(o.name);
    const auto& w = dout_values.at(o.name);
    for (size_t i = 0; i < v.size(); ++i) s += double(v[i]) * w[i];
  }
  return s;
}

// A backend's results against the reference's: the scalar, every output and every gradient.
void expect_same_results(const RunResult& got, const RunResult& expected, double tolerance) {
  EXPECT_NEAR(got.scalar, expected.scalar, tolerance * (std::abs(expected.scalar) + 1e-6));
  for (const auto& [out, values] : expected.outputs)
    EXPECT_TRUE(close_to(got.outputs.at(out), values, tolerance)) << "output " << out;
  for (const auto& [in, values] : expected.grads)
    EXPECT_TRUE(close_to(got.grads.at(in), values, tolerance)) << "gradient " << in;
}

// What a backend without 16-bit products computes for a mixed-precision case: the 16-bit
// inputs' stored values widened to float32, float32 operands and arithmetic.
OpCase float32_arithmetic(const OpCase& c) {
  OpCase f = c;
  f.operands = DType::F32;
  f.tolerance = std::min(c.tolerance, 1e-5);
  for (Input& in : f.inputs) {
    if (in.dtype != DType::BF16 && in.dtype != DType::F16) continue;
    for (float& v : in.values) v = in.dtype == DType::BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
    in.dtype = DType::F32;
  }
  return f;
}

void check_case(const OpCase& c) {
  SCOPED_TRACE(c.name);
  std::map<std::string, std::vector<float>> dout_values, prior;
  uint64_t seed = 1000;
  for (const Output& o : c.outputs) dout_values[o.name] = randn(numel(o.shape), ++seed);
  for (const Input& i : c.inputs)
    if (i.differentiable) prior[i.name] = randn(numel(i.shape), ++seed, 0.5f);

  Backend& ref = backend_named("reference");
  const RunResult expected = run_case(ref, c, dout_values, prior, c.inputs);
  // A backend without products of the case's 16-bit operands is never handed them: the model
  // widens the stored values and runs float32 arithmetic there, which it is checked on instead.
  std::optional<RunResult> expected_float32;
  const OpCase fallback = float32_arithmetic(c);
  for (const std::string_view name : kBackends) {
    SCOPED_TRACE(name);
    Backend& be = backend_named(name);
    if (c.backward && c.backward_runs_on && !c.backward_runs_on(be)) {
      std::printf("[ forward  ] %s on %s: the backend has no such backward (the model never asks it for one)\n",
                  c.name.c_str(), std::string(name).c_str());
      OpCase forward = c;
      forward.backward = nullptr;
      const RunResult want = run_case(ref, forward, dout_values, prior, c.inputs);
      expect_same_results(run_case(be, forward, dout_values, prior, c.inputs), want, c.tolerance);
      continue;
    }
    if (c.operands != DType::F32 && be.sixteen_bit_products(c.operands).empty()) {
      std::printf("[ float32  ] %s on %s: no %s products here, its float32 arithmetic checked instead\n",
                  c.name.c_str(), std::string(name).c_str(), std::string(dtype_torch_name(c.operands)).c_str());
      if (!expected_float32) expected_float32 = run_case(ref, fallback, dout_values, prior, fallback.inputs);
      expect_same_results(run_case(be, fallback, dout_values, prior, fallback.inputs), *expected_float32,
                          fallback.tolerance);
      continue;
    }
    const RunResult got = run_case(be, c, dout_values, prior, c.inputs);
    expect_same_results(got, expected, c.tolerance);
    if (!c.backward || c.operands != DType::F32) continue;

    // Finite differences of the reference forward (float64 inside) against this backend's
    // gradient, minus the prior for accumulating ops.
    for (const Input& input : c.inputs) {
      if (!input.differentiable) continue;
      std::vector<float> analytic = got.grads.at(input.name);
      if (std::find(c.overwrites.begin(), c.overwrites.end(), input.name) == c.overwrites.end())
        for (size_t k = 0; k < analytic.size(); ++k) analytic[k] -= prior.at(input.name)[k];
      std::vector<Input> perturbed = c.inputs;
      Input* x = nullptr;
      for (Input& p : perturbed)
        if (p.name == input.name) x = &p;
      const float h = 1e-2f;
      double diff2 = 0, ref2 = 0;
      const size_t stride = std::max<size_t>(1, x->values.size() / 64);
      for (size_t k = 0; k < x->values.size(); k += stride) {
        const float saved = x->values[k];
        x->values[k] = saved + h;
        const double lp = objective(c, run_case(ref, c, dout_values, prior, perturbed), dout_values);
        x->values[k] = saved - h;
        const double lm = objective(c, run_case(ref, c, dout_values, prior, perturbed), dout_values);
        x->values[k] = saved;
        const double fd = (lp - lm) / (2.0 * h);
        diff2 += (fd - analytic[k]) * (fd - analytic[k]);
        ref2 += fd * fd;
      }
      ASSERT_GT(ref2, 0.0) << input.name << ": the gradient is zero, the check would prove nothing";
      EXPECT_LT(std::sqrt(diff2 / ref2), 3e-3) << "d" << input.name << " against finite differences";
    }
  }
}

Input f32_input(std::string name, std::vector<int64_t> shape, uint64_t seed, bool differentiable = true,
                float scale = 1.0f) {
  return {std::move(name), shape, DType::F32, differentiable, randn(numel(shape), seed, scale), {}};
}
Input i32_input(std::string name, std::vector<int32_t> values) {
  return {std::move(name), {static_cast<int64_t>(values.size())}, DType::I32, false, {}, std::move(values)};
}

// out = x w^T + b and its backward, x [N, C], w [OC, C], b [OC], with operands of `operands`.
void check_matmul(std::string name, int64_t N, int64_t C, int64_t OC, DType operands) {
  Input x = f32_input("x", {N, C}, 1), w = f32_input("w", {OC, C}, 2);
  x.dtype = w.dtype = operands;
  check_case({.name = std::move(name),
              .inputs = {x, w, f32_input("b", {OC}, 3)},
              .outputs = {{"out", {N, OC}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.matmul_forward(out.at("out"), in.at("x"), in.at("w"), in.at("b"));
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                    be.matmul_backward(din.at("x"), din.at("w"), din.at("b"), dout.at("out"), in.at("x"), in.at("w"),
                                       1.0f);
                  },
              .operands = operands});
}

TEST(BackendOps, Matmul) { check_matmul("matmul", 5, 7, 3, DType::F32); }

// Few rows (decoding) against 16-bit weights widened in registers, and float32 weights through
// the cpu backend's skinny kernel: widths with and without a tail of 16 columns.
TEST(BackendOps, MatmulFewRowsWithSixteenBitWeights) {
  for (const DType dt : {DType::BF16, DType::F16, DType::F32})
    for (const int64_t N : {1, 3, 8, 11, 32})
      for (const int64_t C : {32, 37}) {
        const int64_t OC = 9;
        Input w = f32_input("w", {OC, C}, 2, false);
        w.dtype = dt;
        check_case({.name = fmt::format("matmul {} rows x {} cols, {}", N, C, dtype_torch_name(dt)),
                    .inputs = {f32_input("x", {N, C}, 1, false), w, f32_input("b", {OC}, 3, false)},
                    .outputs = {{"out", {N, OC}}},
                    .forward =
                        [](Backend& be, const Views& in, const Views& out) {
                          be.matmul_forward(out.at("out"), in.at("x"), in.at("w"), in.at("b"));
                          return 0.0;
                        }});
      }
}

// Mixed precision: 16-bit input, weight and output gradient, float32 accumulation, against the
// reference's exact products summed in float64. Shapes large enough for oneDNN's blocked kernels
// and with tails; the bias gradient sums the rounded output gradient.
TEST(BackendOps, MatmulWithSixteenBitOperands) {
  for (const DType dt : {DType::BF16, DType::F16})
    for (const auto& [N, C, OC] : {std::array<int64_t, 3>{37, 96, 80}, std::array<int64_t, 3>{130, 64, 33}})
      check_matmul(fmt::format("matmul {}x{}x{}, {} operands", N, C, OC, dtype_torch_name(dt)), N, C, OC, dt);
}

TEST(BackendOps, MatmulScaledAccumulate) {
  const int64_t N = 4, C = 6, OC = 5;
  const float scale = 0.75f;
  check_case({.name = "matmul_accumulate",
              .inputs = {f32_input("x", {N, C}, 4), f32_input("w", {OC, C}, 5)},
              .outputs = {{"out", {N, OC}}},
              .forward =
                  [=](Backend& be, const Views& in, const Views& out) {
                    be.matmul_accumulate(out.at("out"), in.at("x"), in.at("w"), scale);
                    return 0.0;
                  },
              .backward =
                  [=](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                    be.matmul_backward(din.at("x"), din.at("w"), Tensor{}, dout.at("out"), in.at("x"), in.at("w"),
                                       scale);
                  }});
}

TEST(BackendOps, Rmsnorm) {
  const int64_t N = 4, C = 16;
  check_case({.name = "rmsnorm",
              .inputs = {f32_input("x", {N, C}, 6), f32_input("w", {C}, 7)},
              .outputs = {{"out", {N, C}}, {"rstd", {N}, false}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.rmsnorm_forward(out.at("out"), out.at("rstd"), in.at("x"), in.at("w"), 1e-6f);
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views& out, const Views& dout, const Views& din) {
                    be.rmsnorm_backward(din.at("x"), din.at("w"), dout.at("out"), in.at("x"), in.at("w"),
                                        out.at("rstd"));
                  }});
}

TEST(BackendOps, RopeAtAnOffset) {
  // Positions continue after 37 cached tokens: what a decode step after a KV cache feeds. q (two
  // heads) and k (one) turn in one op, as a layer does (rope_forward_pair: one dispatch on vulkan,
  // equal to the reference's two).
  const int64_t N = 5, heads = 2, hd = 8;
  std::vector<int32_t> pos;
  for (int32_t t = 0; t < N; ++t) pos.push_back(37 + t);
  // Frequencies as a Qwen model's and as a Llama 3 model's (scaled) table holds them.
  ModelConfig llama = model_preset("tiny-llama");
  llama.explicit_head_dim = hd;
  for (const std::vector<float>& freqs : {rope_inv_freq(model_preset("tiny")), rope_inv_freq(llama)}) {
    const Input inv_freq{.name = "inv_freq",
                         .shape = {hd / 2},
                         .values = std::vector<float>(freqs.begin(), freqs.begin() + hd / 2),
                         .ints = {}};
    check_case({.name = "rope",
                .inputs = {f32_input("x", {N, heads * hd}, 8), f32_input("k", {N, hd}, 18), i32_input("pos", pos),
                           inv_freq},
                .outputs = {{"out", {N, heads * hd}}, {"out_k", {N, hd}}},
                .forward =
                    [](Backend& be, const Views& in, const Views& out) {
                      be.copy(out.at("out"), in.at("x"));
                      be.copy(out.at("out_k"), in.at("k"));
                      be.rope_forward_pair(out.at("out"), out.at("out_k"), in.at("pos"), in.at("inv_freq"));
                      return 0.0;
                    },
                .backward =
                    [](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                      be.copy(din.at("x"), dout.at("out"));
                      be.copy(din.at("k"), dout.at("out_k"));
                      be.rope_backward_pair(din.at("x"), din.at("k"), in.at("pos"), in.at("inv_freq"));
                    },
                .overwrites = {"x", "k"}});
  }
}

TEST(BackendOps, AttentionGqaOverPackedSequences) {
  const int64_t N = 7, Hq = 4, Hkv = 2, hd = 8;
  check_case({.name = "attention",
              .inputs = {f32_input("q", {N, Hq * hd}, 9), f32_input("k", {N, Hkv * hd}, 10),
                         f32_input("v", {N, Hkv * hd}, 11), i32_input("cu", {0, 3, 7})},
              .outputs = {{"out", {N, Hq * hd}}, {"lse", {N, Hq}, false}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.attention_forward(out.at("out"), out.at("lse"), in.at("q"), in.at("k"), in.at("v"), in.at("cu"),
                                         8);
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views& out, const Views& dout, const Views& din) {
                    be.attention_backward(din.at("q"), din.at("k"), din.at("v"), dout.at("out"), out.at("out"),
                                          out.at("lse"), in.at("q"), in.at("k"), in.at("v"), in.at("cu"), 8);
                  },
              .overwrites = {"q", "k", "v"},
              .tolerance = 2e-5});
}

// A paged KV cache of 8 blocks of 4 tokens holding two sequences of 9 and 6 tokens through
// scattered block tables; the last 3 and 1 tokens are the new queries (a prefill chunk and a
// decode step in one batch).
struct PagedLayout {
  static constexpr int64_t kBlock = 4, kBlocks = 8, kMaxBlocks = 3, Hq = 4, Hkv = 2, hd = 8;
  std::vector<int32_t> tables = {5, 1, 7, 2, 6, 0}, context = {9, 6}, new_tokens = {3, 1};
  std::vector<int32_t> slots, query_rows, cu = {0};
  PagedLayout() {
    int32_t row = 0;
    for (size_t s = 0; s < context.size(); ++s) {
      for (int32_t j = 0; j < context[s]; ++j, ++row) {
        slots.push_back(tables[s * kMaxBlocks + j / kBlock] * kBlock + j % kBlock);
        if (j >= context[s] - new_tokens[s]) query_rows.push_back(row);
      }
      cu.push_back(cu.back() + new_tokens[s]);
    }
  }
  int64_t tokens() const { return static_cast<int64_t>(slots.size()); }
  int64_t queries() const { return static_cast<int64_t>(query_rows.size()); }
};

void check_paged_attention(DType cache_dtype) {
  const PagedLayout p;
  const int64_t T = p.tokens(), Q = p.queries(), kvd = p.Hkv * p.hd, slots = p.kBlocks * p.kBlock;
  Input k_cache{"k_cache", {slots, kvd}, cache_dtype, false, std::vector<float>(slots * kvd, 0.0f), {}};
  Input v_cache = k_cache;
  v_cache.name = "v_cache";
  check_case({.name = "paged attention",
              .inputs = {f32_input("q", {Q, p.Hq * p.hd}, 21, false), f32_input("k", {T, kvd}, 22, false),
                         f32_input("v", {T, kvd}, 23, false), k_cache, v_cache, i32_input("slots", p.slots),
                         {"tables", {2, p.kMaxBlocks}, DType::I32, false, {}, p.tables}, i32_input("cu", p.cu),
                         i32_input("context", p.context)},
              .outputs = {{"out", {Q, p.Hq * p.hd}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.kv_cache_write(in.at("k_cache"), in.at("v_cache"), in.at("k"), in.at("v"), in.at("slots"));
                    be.paged_attention_forward(out.at("out"), in.at("q"), in.at("k_cache"), in.at("v_cache"),
                                               in.at("tables"), in.at("cu"), in.at("context"), PagedLayout::hd,
                                               PagedLayout::kBlock);
                    return 0.0;
                  },
              .tolerance = 2e-5});
}

TEST(BackendOps, PagedAttentionOverScatteredBlocks) { check_paged_attention(DType::F32); }
TEST(BackendOps, PagedAttentionOverABfloat16Cache) { check_paged_attention(DType::BF16); }

// Independent of the reference: when every token of a sequence is a query, attention through
// the paged cache is the packed causal attention of training.
// Inverted dropout, as statistics rather than against another backend (which could share a wrong
// mask): over 2^20 elements of ones the dropped share is p within 5 standard deviations, every
// kept element is exactly 1 / (1 - p), so the mean stays 1; neighbours and two keys are
// independent (their joint drop rate is p^2), and the same key gives the same mask.
TEST(BackendOps, DropoutDropsAShareOfPAndScalesTheRestByTheInverseOfTheKeepRate) {
  const int64_t n = int64_t{1} << 20;
  const std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  for (const std::string_view name : kBackends) {
    SCOPED_TRACE(name);
    Backend& be = backend_named(name);
    DeviceTensors mem(be);
    const Tensor x = mem.make(DType::F32, {n}), out = mem.make(DType::F32, {n});
    upload_f32(be, x, ones);
    auto mask = [&](uint64_t key, float p) {
      be.dropout_forward(out, x, key, p);
      return download_f32(be, out);
    };
    for (const float p : {0.1f, 0.5f}) {
      SCOPED_TRACE(p);
      const std::vector<float> a = mask(0x1234, p), a_again = mask(0x1234, p), b = mask(0x9876, p);
      EXPECT_EQ(a, a_again) << "the same key must give the same mask (backward regenerates it)";
      const float kept_value = 1.0f / (1.0f - p);
      int64_t dropped = 0, both_keys = 0, neighbours = 0;
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const bool drop = a[static_cast<size_t>(i)] == 0.0f;
        if (!drop) {
          ASSERT_EQ(a[static_cast<size_t>(i)], kept_value) << i;
        }
        dropped += drop;
        both_keys += drop && b[static_cast<size_t>(i)] == 0.0f;
        neighbours += drop && i + 1 < n && a[static_cast<size_t>(i + 1)] == 0.0f;
        sum += a[static_cast<size_t>(i)];
      }
      const double N = static_cast<double>(n), q = p;
      auto within = [&](int64_t count, double rate, const char* what) {
        const double sigma = std::sqrt(N * rate * (1 - rate));
        EXPECT_NEAR(static_cast<double>(count), N * rate, 5 * sigma) << what;
      };
      within(dropped, q, "dropped share");
      within(both_keys, q * q, "dropped under two keys (independent masks)");
      within(neighbours, q * q, "dropped neighbours (independent elements)");
      // The mean of the output is 1 (inverted dropout is unbiased): kept share x 1/(1-p).
      EXPECT_NEAR(sum / N, 1.0, 5 * std::sqrt(q / (1 - q) / N));
    }
    // p = 0 keeps everything unchanged.
    EXPECT_EQ(mask(0x1234, 0.0f), ones);
  }
}

TEST(BackendOps, PagedAttentionEqualsPackedAttentionForWholeSequences) {
  const PagedLayout p;
  const int64_t T = p.tokens(), kvd = p.Hkv * p.hd, qd = p.Hq * p.hd, slots = p.kBlocks * p.kBlock;
  const std::vector<int32_t> cu = {0, p.context[0], p.context[0] + p.context[1]};
  const std::vector<float> q = randn(T * qd, 31), k = randn(T * kvd, 32), v = randn(T * kvd, 33);
  for (const std::string_view name : kBackends) {
    SCOPED_TRACE(name);
    Backend& be = backend_named(name);
    DeviceTensors mem(be);
    const Tensor tq = mem.make(DType::F32, {T, qd}), tk = mem.make(DType::F32, {T, kvd}),
                 tv = mem.make(DType::F32, {T, kvd});
    upload_f32(be, tq, q);
    upload_f32(be, tk, k);
    upload_f32(be, tv, v);
    auto ints = [&](const std::vector<int32_t>& values, std::vector<int64_t> shape) {
      const Tensor t = mem.make(DType::I32, shape);
      be.copy_to_device(t, values.data());
      return t;
    };
    const Tensor tcu = ints(cu, {3}), tslots = ints(p.slots, {T}), ttables = ints(p.tables, {2, p.kMaxBlocks}),
                 tctx = ints(p.context, {2});
    const Tensor kc = mem.make(DType::F32, {slots, kvd}), vc = mem.make(DType::F32, {slots, kvd});
    const Tensor packed = mem.make(DType::F32, {T, qd}), lse = mem.make(DType::F32, {T, p.Hq}),
                 paged = mem.make(DType::F32, {T, qd});
    be.attention_forward(packed, lse, tq, tk, tv, tcu, p.hd);
    be.kv_cache_write(kc, vc, tk, tv, tslots);
    be.paged_attention_forward(paged, tq, kc, vc, ttables, tcu, tctx, p.hd, p.kBlock);
    EXPECT_TRUE(close_to(download_f32(be, paged), download_f32(be, packed), 1e-6));
  }
}

TEST(BackendOps, GatherRows) {
  check_case({.name = "gather rows",
              .inputs = {f32_input("x", {5, 6}, 41, false), i32_input("index", {4, 0, 4})},
              .outputs = {{"out", {3, 6}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.gather_rows(out.at("out"), in.at("x"), in.at("index"));
                    return 0.0;
                  }});
}

// A mixture of experts' combine, out[n] = sum over token n's rows r of weights[r] * x[r], and its
// backward (d x and d weights), over a routing where expert 0 takes every token, expert 3 none:
// 5 tokens, 2 experts each, rows grouped by expert (0: rows 0-4, 1: rows 5-7, 2: rows 8-9).
TEST(BackendOps, CombineRowsOfExperts) {
  const int64_t N = 5, K = 2, R = N * K, C = 6;
  Input rows = i32_input("rows", {0, 5, 1, 8, 2, 6, 3, 9, 4, 7});
  rows.shape = {N, K};
  check_case({.name = "combine rows",
              .inputs = {f32_input("x", {R, C}, 42), f32_input("weights", {R}, 43), rows,
                         i32_input("tokens", {0, 1, 2, 3, 4, 0, 2, 4, 1, 3})},
              .outputs = {{"out", {N, C}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.fill(out.at("out"), 0.0f);
                    be.combine_rows(out.at("out"), in.at("x"), in.at("rows"), in.at("weights"));
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                    be.combine_rows_backward(din.at("x"), din.at("weights"), in.at("x"), dout.at("out"),
                                             in.at("tokens"), in.at("weights"));
                  },
              .overwrites = {"x", "weights"},
              .backward_runs_on = [](const Backend& be) { return be.trains_mixture_of_experts(); }});
  // Without tokens (the shared expert: row n is token n's), the gradient written over the rows.
  check_case({.name = "combine rows, one a token, in place",
              .inputs = {f32_input("x", {N, C}, 44), f32_input("weights", {N}, 45)},
              .outputs = {{"out", {N, C}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.fill(out.at("out"), 0.0f);
                    be.combine_rows(out.at("out"), in.at("x"), Tensor{}, in.at("weights"));
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                    be.copy(din.at("x"), in.at("x"));
                    be.combine_rows_backward(din.at("x"), din.at("weights"), din.at("x"), dout.at("out"), Tensor{},
                                             in.at("weights"));
                  },
              .overwrites = {"x", "weights"},
              .backward_runs_on = [](const Backend& be) { return be.trains_mixture_of_experts(); }});
}

TEST(BackendOps, Swiglu) {
  const int64_t n = 24;
  check_case({.name = "swiglu",
              .inputs = {f32_input("gate", {n}, 12), f32_input("up", {n}, 13)},
              .outputs = {{"h", {n}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.swiglu_forward(out.at("h"), in.at("gate"), in.at("up"));
                    return 0.0;
                  },
              .backward =
                  [](Backend& be, const Views& in, const Views&, const Views& dout, const Views& din) {
                    be.swiglu_backward(din.at("gate"), din.at("up"), dout.at("h"), in.at("gate"), in.at("up"));
                  }});
}

TEST(BackendOps, EmbeddingWithRepeatedIds) {
  const int64_t V = 9, D = 6;
  for (DType dt : {DType::F32, DType::BF16}) {
    Input table = f32_input("table", {V, D}, 14, dt == DType::F32);
    table.dtype = dt;
    check_case({.name = std::string("embedding ") + std::string(dtype_torch_name(dt)),
                .inputs = {table, i32_input("ids", {3, 1, 3, 8, 0, 3})},
                .outputs = {{"out", {6, D}}},
                .forward =
                    [](Backend& be, const Views& in, const Views& out) {
                      be.embedding_forward(out.at("out"), in.at("ids"), in.at("table"));
                      return 0.0;
                    },
                .backward = dt == DType::F32 ? std::function([](Backend& be, const Views& in, const Views&,
                                                                const Views& dout, const Views& din) {
                  be.embedding_backward(din.at("table"), dout.at("out"), in.at("ids"));
                })
                                             : nullptr});
  }
}

TEST(BackendOps, DropoutMasksAreIdenticalAcrossBackends) {
  const int64_t n = 4096;
  check_case({.name = "dropout",
              .inputs = {f32_input("x", {n}, 15)},
              .outputs = {{"out", {n}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.dropout_forward(out.at("out"), in.at("x"), 0xfeedull, 0.3f);
                    return 0.0;
                  },
              .backward = [](Backend& be, const Views&, const Views&, const Views& dout,
                             const Views& din) { be.dropout_forward(din.at("x"), dout.at("out"), 0xfeedull, 0.3f); },
              .overwrites = {"x"}});
}

TEST(BackendOps, AddInplace) {
  const int64_t n = 33;
  check_case({.name = "add_inplace",
              .inputs = {f32_input("x", {n}, 16)},
              .outputs = {{"y", {n}}},
              .forward =
                  [](Backend& be, const Views& in, const Views& out) {
                    be.add_inplace(out.at("y"), in.at("x"));
                    return 0.0;
                  },
              .backward = [](Backend& be, const Views&, const Views&, const Views& dout,
                             const Views& din) { be.add_inplace(din.at("x"), dout.at("y")); }});
}

// The fused head's workspace for N rows in chunks of `chunk` (device memory of `be`) and, for a
// backend whose memory the host cannot address, its host staging; slice > 0: a 16-bit head's
// widening slice; 16-bit operands: the product slice buffer where the backend asks for one.
struct HeadWorkspace {
  HeadWorkspace(Backend& be, int64_t N, int64_t D, int64_t V, int64_t chunk, int64_t slice = 0,
                DType operands = DType::F32)
      : ws(be), logits(static_cast<size_t>(chunk * V)), losses(static_cast<size_t>(N)), ints(static_cast<size_t>(2 * N)),
        stats(static_cast<size_t>(N)) {
    args.logits = ws.make(DType::F32, {chunk, V});
    args.rows = ws.make(DType::F32, {chunk, D});
    args.drows = ws.make(DType::F32, {chunk, D});
    args.positions = ws.make(DType::I32, {N});
    args.row_targets = ws.make(DType::I32, {chunk});
    if (slice > 0) args.weight_slice = ws.make(DType::F32, {slice, D});
    if (const int64_t s = operands == DType::F32 ? 0 : be.head_product_slice(operands); s > 0)
      args.product_slice = ws.make(DType::F32, {chunk, std::min(s, V)});
    args.row_stats = ws.make(DType::I32, {N, 4});
    args.row_losses = ws.make(DType::F32, {N});
    if (!be.host_addressable())
      args.staging = {.logits = logits.data(),
                      .targets = ints.data(),
                      .positions = ints.data() + N,
                      .row_stats = stats.data(),
                      .row_losses = losses.data()};
  }
  DeviceTensors ws;
  std::vector<float> logits, losses;
  std::vector<int32_t> ints;
  std::vector<RowStats> stats;
  LmHeadArgs args;  // the workspace and staging filled in; the caller sets the rest
};

// The fused LM head: loss SUM, d(hidden) (overwritten) and d(weight) (accumulated), with
// ignored targets, chunks smaller than the number of targets, label smoothing, and a 16-bit
// weight widened a slice at a time.
// With 16-bit `operands` (mixed precision: the head stored in that dtype) the hidden rows and
// the loss's gradient are rounded, and the head's float32 gradient is accumulated.
void check_lm_head(DType weight_dtype, float label_smoothing, int64_t V = 11, DType operands = DType::F32) {
  const int64_t N = 7, D = 6, chunk = 3, slice = 4;
  // Over a vocabulary of several loss pieces (8192 columns on vulkan), targets in each of them.
  const std::vector<int32_t> targets = V > 16384
                                           ? std::vector<int32_t>{2, kIgnoreIndex, static_cast<int32_t>(V - 1), 0,
                                                                  kIgnoreIndex, 8192, 8192}
                                           : std::vector<int32_t>{2, kIgnoreIndex, 10, 0, kIgnoreIndex, 7, 7};
  Input weight = f32_input("weight", {V, D}, 18, weight_dtype == DType::F32 || operands != DType::F32);
  weight.dtype = weight_dtype;
  const auto loss = std::make_shared<CrossEntropyLoss>(label_smoothing);
  // One call with its own workspace (device) and staging (host); contents of the workspace
  // legitimately differ between backends, so only the loss and the gradients are compared.
  // The stored head's dtype decides the rest, so the case's float32 arithmetic (its 16-bit
  // inputs widened: float32_arithmetic) runs the float32 head.
  auto run = [=](Backend& be, const Views& in, Tensor dhidden, Tensor dweight) {
    const bool half_head = in.at("weight").dtype != DType::F32;
    HeadWorkspace head(be, N, D, V, chunk, half_head ? slice : 0, half_head ? operands : DType::F32);
    LmHeadArgs& a = head.args;
    a.hidden = in.at("hidden");
    a.targets = in.at("targets");
    a.weight = in.at("weight");
    a.loss = loss.get();
    a.dhidden = dhidden;
    a.dweight = dweight;
    a.operands = half_head ? operands : DType::F32;
    a.grad_scale = operands == DType::F32 ? 1.0f : 0.5f;  // folded into the rounded gradient
    return be.lm_head_loss(a);
  };
  check_case({.name = fmt::format("lm_head_loss {} smoothing {} vocabulary {} operands {}", dtype_torch_name(weight_dtype),
                                  label_smoothing, V, dtype_torch_name(operands)),
              .inputs = {f32_input("hidden", {N, D}, 17), i32_input("targets", targets), weight},
              .outputs = {},
              .forward = [=](Backend& be, const Views& in, const Views&) { return run(be, in, {}, {}).sum; },
              .backward =
                  [=](Backend& be, const Views& in, const Views&, const Views&, const Views& din) {
                    const Tensor dw = din.count("weight") ? din.at("weight") : Tensor{};
                    EXPECT_EQ(run(be, in, din.at("hidden"), dw).count, 5);
                  },
              .overwrites = {"hidden"},
              .scalar_is_loss = true,
              .operands = operands});
}

TEST(BackendOps, LmHeadLossFloat32) {
  check_lm_head(DType::F32, 0.0f);
}
TEST(BackendOps, LmHeadLossLabelSmoothing) {
  check_lm_head(DType::F32, 0.1f);
}
TEST(BackendOps, LmHeadLossBfloat16Head) {
  check_lm_head(DType::BF16, 0.0f);
}
// Both of the cpu's layouts of the head's products (ops.h: HeadProducts), whichever this CPU
// would choose: strided, the logits product in two 16384-row slices at 20000; dense, in slices of
// 2048 through the product slice buffer, d(hidden) summed over them.
TEST(BackendOps, LmHeadLossWithSixteenBitOperands) {
  for (const char* layout : {"strided", "dense"}) {
    SCOPED_TRACE(layout);
    ASSERT_EQ(setenv("MEMTUNE_HEAD_PRODUCTS", layout, 1), 0);
    check_lm_head(DType::BF16, 0.0f, 11, DType::BF16);
    check_lm_head(DType::BF16, 0.1f, 3001, DType::BF16);
    check_lm_head(DType::BF16, 0.0f, 20000, DType::BF16);
    check_lm_head(DType::F16, 0.0f, 11, DType::F16);
  }
  unsetenv("MEMTUNE_HEAD_PRODUCTS");
}
// A vocabulary the vulkan backend's loss splits into pieces reduced apart and combined.
TEST(BackendOps, LmHeadLossOverAVocabularyOfSeveralPieces) {
  check_lm_head(DType::F32, 0.1f, 20000);
}

// What observers get from the fused head, on every backend and through every path (a device
// backend's cross-entropy on the device, a custom loss on the host, an observer that also wants
// logits): RowStats against a float64 computation of the logits on the host, and the logits
// chunks themselves against the same.
class Recorder final : public ChunkObserver {
 public:
  explicit Recorder(bool wants_logits) : wants_logits_(wants_logits) {}
  bool needs_logits() const override { return wants_logits_; }
  void observe_rows(const RowStatsChunk& c) override {
    for (int64_t r = 0; r < c.rows; ++r) {
      stats.push_back(c.stats[r]);
      positions.push_back(c.positions[r]);
      targets.push_back(c.targets[r]);
    }
  }
  void observe(const LogitsChunk& c) override {
    logits.insert(logits.end(), c.logits, c.logits + c.rows * c.V);
    logit_positions.insert(logit_positions.end(), c.positions, c.positions + c.rows);
  }
  std::vector<RowStats> stats;
  std::vector<int32_t> positions, targets, logit_positions;
  std::vector<float> logits;

 private:
  bool wants_logits_;
};
// Twice the cross-entropy: a loss the device does not know, so it runs on the host.
class DoubledCrossEntropy final : public ChunkLoss {
 public:
  double chunk(float* logits, const int32_t* targets, int64_t rows, int64_t V, bool gradient) const override {
    const double sum = ce_.chunk(logits, targets, rows, V, gradient);
    if (gradient)
      for (int64_t i = 0; i < rows * V; ++i) logits[i] *= 2.0f;
    return 2.0 * sum;
  }

 private:
  CrossEntropyLoss ce_;
};

// V = 20000 puts the tie in another piece of the vulkan backend's split rows (tie column 17001).
// With `gradient`, the call also computes d(hidden) (the loss's gradient written over each chunk's
// logits) and the targets lie in every piece: the losses and stats must not change.
void check_observers(int64_t V, int64_t tie, bool gradient = false) {
  const int64_t N = 9, D = 5, chunk = 4;
  const std::vector<int32_t> targets =
      gradient ? std::vector<int32_t>{3, kIgnoreIndex, static_cast<int32_t>(V - 1), 0, 8197, kIgnoreIndex,
                                      static_cast<int32_t>(tie), 7, 1}
               : std::vector<int32_t>{3, kIgnoreIndex, 12, 0, 9, kIgnoreIndex, 7, 7, 1};
  std::vector<float> hidden = randn(N * D, 41), weight = randn(V * D, 42);
  // Quarters: every product and partial sum is exact in float32, so the logits are the same in
  // any summation order and ties are ties on every backend. Rows 6 and 7 share a hidden vector
  // and the head has two equal rows (2 and `tie`): ties for the argmax and for the target's rank.
  for (float& x : hidden) x = std::round(4 * x) / 4;
  for (float& x : weight) x = std::round(4 * x) / 4;
  std::copy_n(hidden.begin() + 6 * D, D, hidden.begin() + 7 * D);
  std::fill_n(weight.begin() + 2 * D, D, 3.0f);
  std::copy_n(weight.begin() + 2 * D, D, weight.begin() + tie * D);
  std::fill_n(hidden.begin() + 8 * D, D, 1.0f);  // row 8's maximum is the tie of 2 and `tie`
  // The oracle: logits in float64 from the definitions.
  std::vector<int32_t> want_positions;
  std::vector<double> want_logits;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] == kIgnoreIndex) continue;
    want_positions.push_back(static_cast<int32_t>(n));
    for (int64_t v = 0; v < V; ++v) {
      double s = 0.0;
      for (int64_t d = 0; d < D; ++d) s += double(hidden[n * D + d]) * weight[v * D + d];
      want_logits.push_back(s);
    }
  }
  const size_t row8 = want_positions.size() - 1;
  ASSERT_EQ(want_logits[row8 * V + 2], want_logits[row8 * V + tie]);
  const DoubledCrossEntropy doubled;
  const CrossEntropyLoss plain;
  for (const std::string_view name : kBackends)
    for (const bool custom_loss : {false, true})
      for (const bool wants_logits : {false, true}) {
        SCOPED_TRACE(fmt::format("{} custom loss {} wants logits {}", name, custom_loss, wants_logits));
        Backend& be = backend_named(name);
        DeviceTensors ws(be);
        const Tensor h = ws.make(DType::F32, {N, D}), w = ws.make(DType::F32, {V, D}), t = ws.make(DType::I32, {N});
        upload_f32(be, h, hidden);
        upload_f32(be, w, weight);
        be.copy_to_device(t, targets.data());
        Recorder rec(wants_logits);
        HeadWorkspace head(be, N, D, V, chunk);
        LmHeadArgs& a = head.args;
        a.hidden = h;
        a.targets = t;
        a.weight = w;
        a.loss = custom_loss ? static_cast<const ChunkLoss*>(&doubled) : &plain;
        a.observer = &rec;
        a.host_targets = targets;
        if (gradient) a.dhidden = ws.make(DType::F32, {N, D});
        const LossSum loss = be.lm_head_loss(a);
        const size_t M = want_positions.size();
        ASSERT_EQ(loss.count, static_cast<int64_t>(M));
        ASSERT_EQ(rec.positions, want_positions);
        double want_loss = 0.0;
        for (size_t r = 0; r < M; ++r) {
          const double* z = want_logits.data() + r * V;
          const int32_t target = targets[static_cast<size_t>(want_positions[r])];
          EXPECT_EQ(rec.targets[r], target);
          int32_t argmax = 0, rank = 0;
          double sum = 0.0;
          for (int64_t v = 0; v < V; ++v) {
            if (z[v] > z[argmax]) argmax = static_cast<int32_t>(v);
            sum += std::exp(z[v]);
          }
          const float zt = static_cast<float>(z[target]);
          // Ties are exact in float32 (equal inputs): compare the ranks in float32 too.
          for (int64_t v = 0; v < V; ++v)
            rank += static_cast<float>(z[v]) > zt || (static_cast<float>(z[v]) == zt && v < target);
          want_loss += std::log(sum) - z[target];
          const RowStats& got = rec.stats[r];
          EXPECT_NEAR(got.logsumexp, std::log(sum), 1e-5 * (1 + std::abs(std::log(sum)))) << "row " << r;
          EXPECT_NEAR(got.target_logit, z[target], 1e-5 * (1 + std::abs(z[target]))) << "row " << r;
          EXPECT_EQ(got.argmax, argmax) << "row " << r;
          EXPECT_EQ(got.target_rank, rank) << "row " << r;
        }
        EXPECT_NEAR(loss.sum, (custom_loss ? 2 : 1) * want_loss, 1e-5 * want_loss);
        if (!wants_logits) {
          EXPECT_TRUE(rec.logits.empty());
          continue;
        }
        ASSERT_EQ(rec.logit_positions, want_positions);
        ASSERT_EQ(rec.logits.size(), want_logits.size());
        for (size_t i = 0; i < want_logits.size(); ++i)
          ASSERT_NEAR(rec.logits[i], want_logits[i], 1e-5 * (1 + std::abs(want_logits[i]))) << "logit " << i;
      }
}
TEST(BackendOps, LmHeadObserversGetRowStatsAndLogits) { check_observers(13, 9); }
TEST(BackendOps, LmHeadObserversGetRowStatsOverAVocabularyOfSeveralPieces) { check_observers(20000, 17001); }
// The vulkan backend's debug ordering (MEMTUNE_VULKAN_TARGET_PIECE_FIRST=1) runs the loss's second
// pass for the pieces holding their row's target before the others: a pass that read z_t from the
// logits, whose target column that piece overwrites with its gradient, gets the losses and the
// target logits wrong in this order (other backends ignore the variable). With and without it,
// a call that computes the gradient gets the losses and stats of one that does not.
TEST(BackendOps, LmHeadLossAndStatsBesideTheGradient) { check_observers(20000, 17001, /*gradient=*/true); }
TEST(BackendOps, LmHeadLossWithTheTargetsPiecesRunFirst) {
  ASSERT_EQ(setenv("MEMTUNE_VULKAN_TARGET_PIECE_FIRST", "1", 1), 0);
  check_observers(20000, 17001, /*gradient=*/true);
  unsetenv("MEMTUNE_VULKAN_TARGET_PIECE_FIRST");
}

TEST(BackendOps, ScaleAndSumSquares) {
  const int64_t n = 50;
  check_case({.name = "scale_and_sum_squares",
              .inputs = {f32_input("x", {n}, 19, false)},
              .outputs = {{"x_scaled", {n}}},
              .forward = [](Backend& be, const Views& in, const Views& out) {
                // Two tensors in one call: both scaled, one sum.
                be.copy(out.at("x_scaled"), in.at("x"));
                const Tensor x = out.at("x_scaled");
                const std::array<Tensor, 2> parts = {x.flat_range(0, 20), x.flat_range(20, n - 20)};
                return be.scale_and_sum_squares(parts, 0.5f);
              }});
}

TEST(BackendOps, ConvertRoundsLikeTheHostConversion) {
  for (const std::string_view name : kBackends) {
    Backend& be = backend_named(name);
    DeviceTensors mem(be);
    const std::vector<float> x = randn(100, 20);
    const Tensor f = mem.make(DType::F32, {100}), b = mem.make(DType::BF16, {100}), h = mem.make(DType::F16, {100});
    upload_f32(be, f, x);
    be.convert(b, f);
    be.convert(h, f);
    std::vector<uint16_t> bits(100);
    be.copy_to_host(bits.data(), b);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits[i], f32_to_bf16(x[i])) << name;
    be.copy_to_host(bits.data(), h);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits[i], f32_to_f16(x[i])) << name;
  }
}

TEST(BackendOps, AdamWMatchesTheTorchAlgorithmInDouble) {
  // torch.optim.AdamW, written out from its documentation in double precision, on every backend.
  const AdamWConfig c{0.9, 0.95, 1e-6, 0.1};
  const double lr = 1e-2;
  for (const std::string_view name : kBackends) {
    Backend& be = backend_named(name);
    DeviceTensors mem(be);
    const Tensor p = mem.make(DType::F32, {3}), g = mem.make(DType::F32, {3}), m = mem.make(DType::F32, {3}),
                 v = mem.make(DType::F32, {3});
    upload_f32(be, p, std::vector<float>{0.5f, -1.0f, 2.0f});
    be.fill(m, 0.0f);
    be.fill(v, 0.0f);
    std::vector<double> pd = {0.5, -1.0, 2.0}, md(3, 0.0), vd(3, 0.0);
    Rng rng(3);
    for (int t = 1; t <= 5; ++t) {
      std::vector<float> gh(3);
      for (auto& x : gh) x = static_cast<float>(rng.normal());
      upload_f32(be, g, gh);
      be.adamw_update(p, g, m, v, {.t = t, .learning_rate = lr, .config = c, .decay = true, .grad_scale = 0.5f});
      for (int i = 0; i < 3; ++i) {
        const double gi = 0.5 * gh[i];
        pd[i] *= 1 - lr * c.weight_decay;
        md[i] = c.beta1 * md[i] + (1 - c.beta1) * gi;
        vd[i] = c.beta2 * vd[i] + (1 - c.beta2) * gi * gi;
        const double mhat = md[i] / (1 - std::pow(c.beta1, t)), vhat = vd[i] / (1 - std::pow(c.beta2, t));
        pd[i] -= lr * mhat / (std::sqrt(vhat) + c.eps);
      }
    }
    const std::vector<float> got = download_f32(be, p);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(got[i], pd[i], 1e-6) << name;
  }
}

TEST(BackendOps, FastExpIsAccurate) {
  for (float x = -80.0f; x < 80.0f; x += 0.37f) EXPECT_NEAR(fast_exp(x) / std::exp(double(x)), 1.0, 5e-7) << x;
  EXPECT_LT(fast_exp(-1000.0f), 1e-37f);
}

// The reference backend's memory is device memory in earnest: the process cannot touch it
// outside the backend's own calls.
TEST(ReferenceBackendDeathTest, HostAccessToItsMemoryCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Backend& be = backend_named("reference");
  float* p = static_cast<float*>(be.allocate(4096));
  be.fill(Tensor(p, DType::F32, {16}), 1.0f);  // through the backend: fine
  std::vector<float> back(16);
  be.copy_to_host(back.data(), Tensor(p, DType::F32, {16}));
  EXPECT_EQ(back[3], 1.0f);
  EXPECT_DEATH({ [[maybe_unused]] volatile float x = p[3]; }, "");
  EXPECT_DEATH({ p[0] = 2.0f; }, "");
  be.deallocate(p, 4096);
}

TEST(Backends, UnknownNameIsRefusedWithTheChoices) {
  try {
    backend_named("tpu");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu, reference"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memtune

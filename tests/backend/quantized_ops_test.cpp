// Quantized matmuls on every backend against dequantize-then-matmul: the layer's float32 weights
// from io/quantized's dequantize_layer (the formula of the files, checked against numpy vectors
// in tests/io), multiplied on the host in double. Shapes cover both cpu paths (codes read
// directly up to cpu::kSixteenBitWeightRows rows, dequantized tiles beyond), inputs that end in a
// partial chunk, groups smaller than a chunk, one group per row, act-order g_idx, and output
// rows that leave a partial tile.
#include <gtest/gtest.h>

#include <cstring>
#include <omp.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "backend/registry.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "io/quantized.h"
#include "support/numeric.h"

namespace memtune {
namespace {

QuantizedLayer random_layer(int bits, int64_t in, int64_t out, int64_t group_size, bool act_order, uint64_t seed) {
  Rng rng(seed);
  QuantizedLayer l;
  l.bits = bits;
  l.in = in;
  l.out = out;
  l.group_size = group_size;
  l.groups = (in + group_size - 1) / group_size;
  const int per_word = 32 / bits;
  l.codes.assign(static_cast<size_t>(out * (in / per_word)), 0);
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k = 0; k < in; ++k) {
      const uint32_t q = static_cast<uint32_t>(rng.uniform() * (1 << bits)) & ((1u << bits) - 1u);
      auto& word = l.codes[static_cast<size_t>(n * (in / per_word) + k / per_word)];
      word = static_cast<int32_t>(static_cast<uint32_t>(word) | (q << (bits * (k % per_word))));
    }
  for (int64_t i = 0; i < out * l.groups; ++i) {
    l.scales.push_back(f32_to_f16(static_cast<float>(0.005 + 0.02 * rng.uniform())));
    l.zeros.push_back(f32_to_f16(std::floor(static_cast<float>(rng.uniform() * (1 << bits)))));
  }
  if (act_order) {  // GPTQ's: inputs taken in a shuffled order, groups by place in that order
    std::vector<int64_t> order(static_cast<size_t>(in));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = in - 1; i > 0; --i)
      std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(rng.uniform() * static_cast<double>(i + 1))]);
    l.g_idx.resize(static_cast<size_t>(in));
    for (int64_t i = 0; i < in; ++i)
      l.g_idx[static_cast<size_t>(order[static_cast<size_t>(i)])] = static_cast<int32_t>(i / group_size);
  }
  return l;
}

std::vector<float> randn(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// Device copies of a layer and of float32 arrays, freed with the object.
struct Device {
  Backend& be;
  std::vector<std::pair<void*, size_t>> blocks;
  explicit Device(Backend& b) : be(b) {}
  ~Device() {
    for (auto [p, n] : blocks) be.deallocate(p, n);
  }
  Tensor alloc(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t bytes = std::max<size_t>(4096, static_cast<size_t>(n) * dtype_size(dt));
    void* p = be.allocate(bytes);
    blocks.emplace_back(p, bytes);
    return Tensor(p, dt, shape);
  }
  Tensor f32(const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    Tensor t = alloc(DType::F32, shape);
    be.copy_to_device(t, v.data());
    return t;
  }
  QuantizedWeight weight(const QuantizedLayer& l) {
    QuantizedWeight w;
    w.codes = alloc(DType::I32, {l.out, l.in * l.bits / 32});
    be.copy_to_device(w.codes, l.codes.data());
    w.scales = alloc(DType::F16, {l.out, l.groups});
    be.copy_to_device(w.scales, l.scales.data());
    w.zeros = alloc(DType::F16, {l.out, l.groups});
    be.copy_to_device(w.zeros, l.zeros.data());
    if (!l.g_idx.empty()) {
      w.g_idx = alloc(DType::I32, {l.in});
      be.copy_to_device(w.g_idx, l.g_idx.data());
    }
    w.bits = l.bits;
    w.in = l.in;
    w.out = l.out;
    w.group_size = l.group_size;
    w.groups = l.groups;
    return w;
  }
};

struct Shape {
  int bits;
  int64_t in, group_size;
  bool act_order;
};
const Shape kShapes[] = {
    {4, 256, 128, false},  // whole chunks of 128 inputs, two groups
    {4, 176, 128, false},  // one chunk and a tail of 48 inputs in a partial group
    {4, 256, 64, false},   // groups smaller than a 4-bit chunk: per element
    {8, 256, 64, false},   // an 8-bit chunk is 64 inputs
    {8, 96, 96, false},    // one group per row (group_size -1 in a file)
    {4, 128, 32, true},    // act-order g_idx
    {8, 64, 16, true},
};

TEST(QuantizedOps, ForwardEqualsDequantizeThenMatmul) {
  const int64_t OC = cpu::kQuantizedTileRows + 9;  // a full tile of output rows, a partial one, an odd count
  for (const std::string_view name : backend_list())
    for (const Shape& s : kShapes)
      for (const int64_t N : {1, 2, 3, 4, 5, 8, 9, 16, 17, 33}) {  // every row-count path
        if (name == "reference" && N > 9) continue;                // slow, and one path only
        Backend& be = backend_named(name);
        const QuantizedLayer layer = random_layer(s.bits, s.in, OC, s.group_size, s.act_order, 11 + s.in + N);
        const std::vector<float> w = dequantize_layer(layer), x = randn(N * s.in, 3 + N), bias = randn(OC, 5);
        const bool with_bias = N % 2 == 1;
        std::vector<double> expected(static_cast<size_t>(N * OC));
        for (int64_t n = 0; n < N; ++n)
          for (int64_t o = 0; o < OC; ++o) {
            double sum = with_bias ? bias[static_cast<size_t>(o)] : 0.0;
            for (int64_t k = 0; k < s.in; ++k)
              sum += double(x[static_cast<size_t>(n * s.in + k)]) * w[static_cast<size_t>(o * s.in + k)];
            expected[static_cast<size_t>(n * OC + o)] = sum;
          }
        Device d(be);
        const Tensor out = d.alloc(DType::F32, {N, OC});
        be.quantized_matmul_forward(out, d.f32(x, {N, s.in}), d.weight(layer), with_bias ? d.f32(bias, {OC}) : Tensor{},
                                    d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(s.in))}));
        std::vector<float> got(static_cast<size_t>(N * OC));
        be.copy_to_host(got.data(), out);
        EXPECT_TRUE(testing_support::close(got, expected, {1e-11, 1e-5})) << fmt::format(
            "{}: {}-bit, in {}, group {}, act-order {}, {} rows", name, s.bits, s.in, s.group_size, s.act_order, N);
      }
}

// Int8 activations (int8_activations.h), against this test's own rounding: per block of 128, 64
// or 32 inputs (the largest dividing the group), q = rint(x * (127 / amax)) in float32, the
// product sum_k (amax / 127) q_k w_k in double. Decoding's row counts (<= 16) round where the
// backend takes int8 decoding (the cpu's AVX512-VNNI kernels, and the reference where the cpu
// does) and the groups are whole blocks of 128, else keep float32 inputs; act-order and inputs
// that are no whole number of groups keep float32 inputs; so does a backend that does not take
// int8 activations (vulkan without int8 cooperative matrices), and the flag unset.
TEST(QuantizedOps, Int8ActivationsRoundTheInputPerBlockForManyRows) {
  const int64_t OC = 39;  // a 32-row tile and a 7-row one: a pass takes 32 (AVX-512) or 16 rows
  // With more threads than tiles, the cpu kernel splits each tile's input rows between tasks.
  const int saved_threads = omp_get_max_threads();
  for (const int threads : {saved_threads, 7}) {
    omp_set_num_threads(threads);
    struct Case {
      Shape shape;
      int64_t block;  // 0: float32 inputs
    };
    const Case cases[] = {{{4, 256, 128, false}, 128}, {{4, 256, 64, false}, 64},   {{8, 256, 64, false}, 64},
                          {{8, 96, 96, false}, 32},    {{8, 512, 128, false}, 128}, {{4, 176, 128, false}, 0},
                          {{4, 128, 32, true}, 0},     {{8, 256, 256, false}, 128}, {{4, 384, 384, false}, 128}};
    for (const std::string_view name : backend_list())
      for (const Case& c : cases)
        for (const int64_t N : {3, 8, 16, 17, 38}) {
          Backend& be = backend_named(name);
          const Shape& s = c.shape;
          const bool decodes = be.takes_int8_decode_activations() && c.block == 128 && s.group_size % 128 == 0;
          const bool rounds = be.takes_int8_activations() && c.block > 0 && (N > 16 || decodes);
          const QuantizedLayer layer = random_layer(s.bits, s.in, OC, s.group_size, s.act_order, 21 + s.in + N);
          const std::vector<float> w = dequantize_layer(layer), bias = randn(OC, 9);
          std::vector<float> x = randn(N * s.in, 7 + N);
          // Row 1 is all zeros (every block's scale is 0) and row 2 holds one huge value (its
          // block's other inputs round to 0 or +-1).
          std::fill(x.begin() + s.in, x.begin() + 2 * s.in, 0.0f);
          x[static_cast<size_t>(2 * s.in + 5)] = 3.0e4f;
          std::vector<double> input(x.begin(), x.end());
          if (rounds)
            for (int64_t b = 0; b < N * s.in; b += c.block) {
              float amax = 0.0f;
              for (int64_t i = b; i < b + c.block; ++i) amax = std::max(amax, std::fabs(x[static_cast<size_t>(i)]));
              for (int64_t i = b; i < b + c.block; ++i)  // a zero block stays zero (no 127 / 0)
                input[static_cast<size_t>(i)] =
                    amax == 0.0f ? 0.0
                                 : double(amax / 127.0f) * std::nearbyint(x[static_cast<size_t>(i)] * (127.0f / amax));
            }
          std::vector<double> expected(static_cast<size_t>(N * OC)), unrounded(expected.size());
          for (int64_t n = 0; n < N; ++n)
            for (int64_t o = 0; o < OC; ++o) {
              double sum = bias[static_cast<size_t>(o)], plain = sum;
              for (int64_t k = 0; k < s.in; ++k) {
                sum += input[static_cast<size_t>(n * s.in + k)] * w[static_cast<size_t>(o * s.in + k)];
                plain += double(x[static_cast<size_t>(n * s.in + k)]) * w[static_cast<size_t>(o * s.in + k)];
              }
              expected[static_cast<size_t>(n * OC + o)] = sum;
              unrounded[static_cast<size_t>(n * OC + o)] = plain;
            }
          Device d(be);
          const Tensor out = d.alloc(DType::F32, {N, OC});
          QuantizedWeight qw = d.weight(layer);
          qw.int8_activations = true;
          qw.int8_decode = be.takes_int8_decode_activations();  // as the model sets it
          be.quantized_matmul_forward(out, d.f32(x, {N, s.in}), qw, d.f32(bias, {OC}),
                                      d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(s.in))}));
          std::vector<float> got(static_cast<size_t>(N * OC));
          be.copy_to_host(got.data(), out);
          const std::string what = fmt::format("{}: {}-bit, in {}, group {}, act-order {}, {} rows, {} threads", name,
                                               s.bits, s.in, s.group_size, s.act_order, N, threads);
          // The row with the huge value is compared on its own scale, the others on theirs.
          const auto huge = [&](const auto& v) {
            return std::vector<double>(v.begin() + 2 * OC, v.begin() + 3 * OC);
          };
          const auto others = [&](const auto& v) {
            std::vector<double> rest(v.begin(), v.end());
            rest.erase(rest.begin() + 2 * OC, rest.begin() + 3 * OC);
            return rest;
          };
          const auto tolerance = testing_support::relative_tolerance(1e-5);
          EXPECT_TRUE(testing_support::close(others(got), others(expected), tolerance)) << what;
          EXPECT_TRUE(testing_support::close(huge(got), huge(expected), tolerance)) << what << ", the huge value's row";
          // The all-zero row's products are its bias alone.
          for (int64_t o = 0; o < OC; ++o)
            EXPECT_EQ(got[static_cast<size_t>(OC + o)], bias[static_cast<size_t>(o)]) << what << ", output " << o;
          // The rounding moved the product (so the comparison above tells the two numerics apart),
          // and by little: int8 per block is within about 1% of float32 inputs here.
          if (rounds) {
            const testing_support::Difference moved = testing_support::difference(others(expected), others(unrounded));
            EXPECT_GT(moved.worst, 1e-4 * moved.scale) << what;
            EXPECT_LT(moved.worst, 2e-2 * moved.scale) << what;
          }
        }
  }
  omp_set_num_threads(saved_threads);
}

// This test's own bfloat16 rounding (to nearest, ties to even) of a finite float32.
double to_bfloat16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// bfloat16 operands (int8_activations.h: rounds_to_bfloat16) against this test's own rounding
// of the input and of each dequantized weight (scale * (code - zero) in float32), summed in
// double: products of more than 16 rows on every backend that has them (the cpu's oneDNN
// products: tiles of 128 weight rows, blocks of input rows, the output copied into place; the
// reference's float64 sums); 16 rows (decoding) keep float32 inputs and the float weights.
TEST(QuantizedOps, Bfloat16ProductsRoundTheInputAndTheWeightForManyRows) {
  const int64_t OC = 300;  // tiles of 128, 128 and 44 weight rows
  int backends = 0;
  for (const std::string_view name : backend_list()) {
    Backend& be = backend_named(name);
    if (be.bf16_quantized_products().empty()) {
      std::printf("%s: no bfloat16 quantized products (%s)\n", std::string(name).c_str(),
                  name == "cpu" ? "no oneDNN bfloat16 kernel on this CPU" : "the backend has none");
      continue;
    }
    ++backends;
    for (const Shape& s : kShapes)
      for (const int64_t N : {16, 17, 700}) {  // 700 rows: more than one block of input rows on the cpu
        if (name == "reference" && N > 17) continue;  // float64 sums of every product: slow
        const bool rounds = N > 16;
        const QuantizedLayer layer = random_layer(s.bits, s.in, OC, s.group_size, s.act_order, 5 + s.in + N);
        const std::vector<float> w = dequantize_layer(layer), bias = randn(OC, 3), x = randn(N * s.in, 4 + N);
        std::vector<double> expected(static_cast<size_t>(N * OC));
        for (int64_t n = 0; n < N; ++n)
          for (int64_t o = 0; o < OC; ++o) {
            double sum = bias[static_cast<size_t>(o)];
            for (int64_t k = 0; k < s.in; ++k) {
              const float xv = x[static_cast<size_t>(n * s.in + k)], wv = w[static_cast<size_t>(o * s.in + k)];
              sum += rounds ? to_bfloat16(xv) * to_bfloat16(wv) : double(xv) * wv;
            }
            expected[static_cast<size_t>(n * OC + o)] = sum;
          }
        Device d(be);
        const Tensor out = d.alloc(DType::F32, {N, OC});
        QuantizedWeight qw = d.weight(layer);
        qw.bf16_products = true;
        qw.int8_activations = true;  // bfloat16 operands take precedence
        be.quantized_matmul_forward(out, d.f32(x, {N, s.in}), qw, d.f32(bias, {OC}),
                                    d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(s.in))}));
        std::vector<float> got(static_cast<size_t>(N * OC));
        be.copy_to_host(got.data(), out);
        EXPECT_TRUE(testing_support::close(got, expected, testing_support::relative_tolerance(1e-5)))
            << name << ": " << s.bits << "-bit, in " << s.in << ", group " << s.group_size << ", act-order "
            << s.act_order << ", " << N << " rows";
      }
  }
  EXPECT_GE(backends, 1);
}

TEST(QuantizedOps, BackwardInputAccumulatesDoutTimesTheDequantizedWeight) {
  const int64_t OC = cpu::kQuantizedTileRows + 9;
  for (const std::string_view name : backend_list())
    for (const Shape& s : kShapes)
      for (const int64_t N : {3, 20}) {
        Backend& be = backend_named(name);
        const QuantizedLayer layer = random_layer(s.bits, s.in, OC, s.group_size, s.act_order, 7 + s.in);
        const std::vector<float> w = dequantize_layer(layer), dout = randn(N * OC, 9), start = randn(N * s.in, 10);
        std::vector<double> expected(start.begin(), start.end());  // accumulated onto what is there
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < s.in; ++k)
            for (int64_t o = 0; o < OC; ++o)
              expected[static_cast<size_t>(n * s.in + k)] +=
                  double(dout[static_cast<size_t>(n * OC + o)]) * w[static_cast<size_t>(o * s.in + k)];
        Device d(be);
        const Tensor dinp = d.f32(start, {N, s.in});
        be.quantized_matmul_backward_input(
            dinp, d.f32(dout, {N, OC}), d.weight(layer),
            d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(s.in))}));
        std::vector<float> got(static_cast<size_t>(N * s.in));
        be.copy_to_host(got.data(), dinp);
        EXPECT_TRUE(testing_support::close(got, expected, {1e-11, 1e-5})) << fmt::format(
            "{}: {}-bit, in {}, group {}, act-order {}, {} rows", name, s.bits, s.in, s.group_size, s.act_order, N);
      }
}

}  // namespace
// matmul_forward_group (decoding's q / k / v and gate / up in one pass) gives each member exactly
// what matmul_forward / quantized_matmul_forward give it alone: float32 and 16-bit members, with
// and without bias, quantized members sharing one prepared input, a group of float and quantized
// members, quantized members of different layouts, and row counts past the skinny kernels (each
// product then runs alone).
TEST(MatmulGroup, EachMemberEqualsItsProductAlone) {
  struct Member {
    DType dtype;  // I32: quantized
    int bits;
    int64_t out;
    bool bias;
  };
  const std::vector<std::vector<Member>> groups = {
      {{DType::BF16, 0, 48, true}, {DType::BF16, 0, 16, true}, {DType::BF16, 0, 16, false}},
      {{DType::F32, 0, 40, true}, {DType::F32, 0, 7, false}},
      {{DType::F16, 0, 33, false}, {DType::F16, 0, 33, true}},
      {{DType::I32, 4, 40, true}, {DType::I32, 4, 9, true}, {DType::I32, 4, 24, false}},
      {{DType::I32, 8, 17, false}, {DType::BF16, 0, 21, true}},
      {{DType::I32, 4, 16, true}, {DType::I32, 8, 16, false}},  // two layouts: one by one
  };
  const int64_t C = 256;
  for (const std::string_view name : backend_list())
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (const int64_t N : {1, 2, 3, 8, 12, 17}) {
        Backend& be = backend_named(name);
        Device d(be);
        const std::vector<float> x = randn(N * C, 7 + N);
        const Tensor inp = d.f32(x, {N, C}),
                     scratch = d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(C))});
        std::vector<GroupMember> group;
        std::vector<QuantizedWeight> packed;
        packed.reserve(groups[gi].size());
        std::vector<Tensor> alone;
        for (size_t i = 0; i < groups[gi].size(); ++i) {
          const Member& m = groups[gi][i];
          GroupMember g;
          g.out = d.alloc(DType::F32, {N, m.out});
          if (m.bias) g.bias = d.f32(randn(m.out, 40 + i), {m.out});
          if (m.dtype == DType::I32) {
            packed.push_back(d.weight(random_layer(m.bits, C, m.out, 128, false, 20 + i)));
            g.quantized = &packed.back();
          } else {
            const std::vector<float> w = randn(m.out * C, 30 + i);
            std::vector<uint16_t> half(w.size());
            convert_from_f32(w.data(), half.data(), m.dtype == DType::F32 ? DType::BF16 : m.dtype, w.size());
            g.weight = d.alloc(m.dtype, {m.out, C});
            be.copy_to_device(g.weight, m.dtype == DType::F32 ? static_cast<const void*>(w.data()) : half.data());
          }
          alone.push_back(d.alloc(DType::F32, {N, m.out}));
          if (g.quantized)
            be.quantized_matmul_forward(alone.back(), inp, *g.quantized, g.bias, scratch);
          else if (g.weight.dtype == DType::F32 || N <= be.stored_weight_rows())
            be.matmul_forward(alone.back(), inp, g.weight, g.bias);
          else
            continue;  // many rows take float32 weights (the caller widens them)
          group.push_back(g);
        }
        if (group.size() != groups[gi].size()) continue;
        be.fill(scratch, 0.0f);  // nothing left from the products alone
        be.matmul_forward_group(group, inp, scratch);
        for (size_t i = 0; i < group.size(); ++i) {
          std::vector<float> got(static_cast<size_t>(group[i].out.numel())), want(got.size());
          be.copy_to_host(got.data(), group[i].out);
          be.copy_to_host(want.data(), alone[i]);
          EXPECT_EQ(got, want) << fmt::format("{}: group {}, member {}, {} rows", name, gi, i, N);
        }
      }
}

// matmul_forward_group_swiglu (the MLP's gate and up, then its activation) gives gate, up and h
// exactly what matmul_forward_group and swiglu_forward give them one after the other: float32
// and 16-bit weights, with and without biases, few rows (decoding) and more than one matvec pass
// takes (float32 weights: training's forward). On a backend that counts its dispatches (vulkan),
// they take one product pass and no activation pass of its own.
TEST(MatmulGroup, GateAndUpWithTheActivationEqualTheGroupThenSwiglu) {
  const int64_t C = 256;
  for (const std::string_view name : backend_list())
    for (const DType dtype : {DType::F32, DType::BF16, DType::F16})
      for (const bool bias : {false, true})
        for (const int64_t N : {1, 3, 32, 40}) {
          SCOPED_TRACE(fmt::format("{}: {} weights, {}, {} rows", name, dtype_torch_name(dtype), bias ? "biases" : "no biases", N));
          Backend& be = backend_named(name);
          if (dtype != DType::F32 && N > be.stored_weight_rows()) continue;  // the caller widens them
          Device d(be);
          const int64_t cols = 70;  // the last workgroup of 4 columns has two
          const Tensor inp = d.f32(randn(N * C, 3 + N), {N, C});
          std::array<GroupMember, 2> fused, apart;
          for (size_t i = 0; i < 2; ++i) {
            const std::vector<float> w = randn(cols * C, 50 + i);
            std::vector<uint16_t> half(w.size());
            Tensor weight = d.alloc(dtype, {cols, C});
            if (dtype == DType::F32) {
              be.copy_to_device(weight, w.data());
            } else {
              convert_from_f32(w.data(), half.data(), dtype, w.size());
              be.copy_to_device(weight, half.data());
            }
            const Tensor b = bias ? d.f32(randn(cols, 60 + i), {cols}) : Tensor{};
            fused[i] = GroupMember{d.alloc(DType::F32, {N, cols}), weight, b, nullptr, Tensor{}};
            apart[i] = GroupMember{d.alloc(DType::F32, {N, cols}), weight, b, nullptr, Tensor{}};
          }
          const Tensor h = d.alloc(DType::F32, {N, cols}), h_apart = d.alloc(DType::F32, {N, cols});
          be.matmul_forward_group(apart, inp, Tensor{});
          be.swiglu_forward(h_apart, apart[0].out, apart[1].out);
          const std::map<std::string, uint64_t> before = be.dispatches_by_shader();
          be.matmul_forward_group_swiglu(fused, inp, Tensor{}, h);
          const std::map<std::string, uint64_t> after = be.dispatches_by_shader();
          for (const auto& [got, want] : {std::pair{fused[0].out, apart[0].out}, std::pair{fused[1].out, apart[1].out},
                                          std::pair{h, h_apart}}) {
            std::vector<float> g(static_cast<size_t>(got.numel())), w(g.size());
            be.copy_to_host(g.data(), got);
            be.copy_to_host(w.data(), want);
            EXPECT_EQ(g, w);
          }
          if (!after.empty()) {  // few rows: one matvec; more (float32 weights here): one gemm
            const auto count = [](const std::map<std::string, uint64_t>& m, const char* shader) {
              const auto it = m.find(shader);
              return it == m.end() ? uint64_t{0} : it->second;
            };
            const char* pass = N <= 32 ? "matvec" : "gemm";
            EXPECT_EQ(count(after, "swiglu"), count(before, "swiglu"));
            EXPECT_EQ(count(after, pass), count(before, pass) + 1);
          }
        }
}

// Mixed precision's gate and up (16-bit inputs and weights over more rows than decoding's, on
// every backend that multiplies 16-bit operands: the reference everywhere, the cpu where oneDNN
// has the kernels, vulkan on float16 cooperative matrices): matmul_forward_group_swiglu gives
// gate, up and h what the two products and swiglu_forward give them, bit for bit where a device
// backend does not split the products over K (none of these shapes does).
TEST(MatmulGroup, SixteenBitGateAndUpWithTheActivationEqualTheProductsThenSwiglu) {
  const int64_t C = 96, I = 80;
  int ran = 0;
  for (const std::string_view name : backend_list())
    for (const DType dtype : {DType::BF16, DType::F16}) {
      Backend& be = backend_named(name);
      if (be.sixteen_bit_products(dtype).empty()) continue;
      for (const bool bias : {false, true})
        for (const int64_t N : {40, 100}) {
          SCOPED_TRACE(fmt::format("{}: {} operands, {}, {} rows", name, dtype_torch_name(dtype),
                                   bias ? "biases" : "no biases", N));
          ++ran;
          Device d(be);
          auto half = [&](const std::vector<float>& v, std::initializer_list<int64_t> shape) {
            std::vector<uint16_t> h(v.size());
            convert_from_f32(v.data(), h.data(), dtype, v.size());
            const Tensor t = d.alloc(dtype, shape);
            be.copy_to_device(t, h.data());
            return t;
          };
          const Tensor x = half(randn(N * C, 80 + N), {N, C});
          std::array<GroupMember, 2> fused, apart;
          for (size_t i = 0; i < 2; ++i) {
            const Tensor w = half(randn(I * C, 81 + i), {I, C});
            const Tensor b = bias ? d.f32(randn(I, 83 + i), {I}) : Tensor{};
            fused[i] = GroupMember{d.alloc(DType::F32, {N, I}), w, b, nullptr, Tensor{}};
            apart[i] = GroupMember{d.alloc(DType::F32, {N, I}), w, b, nullptr, Tensor{}};
          }
          const Tensor h = d.alloc(DType::F32, {N, I}), h_apart = d.alloc(DType::F32, {N, I});
          for (const GroupMember& m : apart) be.matmul_forward(m.out, x, m.weight, m.bias);
          be.swiglu_forward(h_apart, apart[0].out, apart[1].out);
          be.matmul_forward_group_swiglu(fused, x, Tensor{}, h);
          for (const auto& [got, want] : {std::pair{fused[0].out, apart[0].out}, std::pair{fused[1].out, apart[1].out},
                                          std::pair{h, h_apart}})
            EXPECT_EQ(download_f32(be, got), download_f32(be, want));
        }
    }
  EXPECT_GT(ran, 0) << "the reference backend multiplies 16-bit operands everywhere";
}

// Members with their own inputs (a mixture of experts' routed rows: each expert's gate and up
// read its rows, its down its h): each member equals its product alone, over more members than
// one pass takes and more prepared inputs than the scratch holds at once, members of one input
// next to each other (sharing its preparation) and apart, quantized of two layouts and 16-bit.
TEST(MatmulGroup, MembersWithTheirOwnInputsEqualTheirProductsAlone) {
  const int64_t C = 256;
  for (const std::string_view name : backend_list()) {
    Backend& be = backend_named(name);
    Device d(be);
    const Tensor scratch = d.alloc(DType::F32, {static_cast<int64_t>(be.quantized_scratch_elems(C))});
    const int64_t kInputs = 23;
    std::vector<Tensor> inputs;
    for (int64_t i = 0; i < kInputs; ++i) {
      const int64_t rows = i % 7 == 3 ? 16 : 1 + i % 5;  // the 16-row ones fill the scratch
      inputs.push_back(d.f32(randn(rows * C, 100 + i), {rows, C}));
    }
    std::vector<QuantizedWeight> packed;
    packed.reserve(2 * kInputs);
    std::vector<GroupMember> group;
    std::vector<Tensor> alone;
    for (int64_t i = 0; i < 2 * kInputs; ++i) {
      // Members 2j and 2j+1 read input j (gate and up), but every fifth pair reads inputs apart.
      const Tensor& x = inputs[static_cast<size_t>(i % 10 == 9 ? (i * 7) % kInputs : i / 2)];
      const int64_t out = 16 + 8 * (i % 3);
      GroupMember g;
      g.inp = x;
      g.out = d.alloc(DType::F32, {x.rows(), out});
      if (i % 4 == 3) {
        const std::vector<float> w = randn(out * C, 300 + i);
        std::vector<uint16_t> half(w.size());
        convert_from_f32(w.data(), half.data(), DType::BF16, w.size());
        g.weight = d.alloc(DType::BF16, {out, C});
        be.copy_to_device(g.weight, half.data());
      } else {
        packed.push_back(d.weight(random_layer(i % 8 == 0 ? 8 : 4, C, out, 128, i % 6 == 1, 200 + i)));
        g.quantized = &packed.back();
      }
      alone.push_back(d.alloc(DType::F32, {x.rows(), out}));
      if (g.quantized)
        be.quantized_matmul_forward(alone.back(), x, *g.quantized, g.bias, scratch);
      else
        be.matmul_forward(alone.back(), x, g.weight, g.bias);
      group.push_back(g);
    }
    be.fill(scratch, 0.0f);
    be.matmul_forward_group(group, Tensor{}, scratch);
    for (size_t i = 0; i < group.size(); ++i) {
      std::vector<float> got(static_cast<size_t>(group[i].out.numel())), want(got.size());
      be.copy_to_host(got.data(), group[i].out);
      be.copy_to_host(want.data(), alone[i]);
      EXPECT_EQ(got, want) << fmt::format("{}: member {} ({} rows)", name, i, group[i].out.rows());
    }
  }
}

}  // namespace memtune

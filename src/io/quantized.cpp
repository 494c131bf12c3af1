// Packed GPTQ / AWQ weights (see quantized.h).
#include "io/quantized.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace memtune {

namespace {

void check_size(size_t got, int64_t want, const char* name) {
  if (static_cast<int64_t>(got) != want) throw Error(fmt::format("{} has {} elements, expected {}", name, got, want));
}

uint32_t field(int32_t word, int bits, int j) {
  return (static_cast<uint32_t>(word) >> (bits * j)) & ((1u << bits) - 1u);
}

void check_bits(int bits) {
  if (bits != 4 && bits != 8) throw Error(fmt::format("bits is {}; GPTQ layers here have 4 or 8 bits", bits));
}

// A GPTQ layer's bits and tensor sizes (g_idx may be absent when `g_idx_optional`).
void check_gptq(const GptqPacked& p, int bits, int64_t in, int64_t out, int64_t groups, bool g_idx_optional) {
  check_bits(bits);
  const int per_word = 32 / bits;
  if (in % per_word != 0 || out % per_word != 0)
    throw Error(fmt::format("a {}-bit GPTQ layer needs in ({}) and out ({}) divisible by {}", bits, in, out, per_word));
  check_size(p.qweight.size(), in / per_word * out, "qweight");
  check_size(p.qzeros.size(), groups * (out / per_word), "qzeros");
  check_size(p.scales.size(), groups * out, "scales");
  if (!g_idx_optional || !p.g_idx.empty()) check_size(p.g_idx.size(), in, "g_idx");
}

// An AWQ layer's shape and tensor sizes; returns its number of groups.
int64_t check_awq(const AwqPacked& p, int64_t in, int64_t out, int64_t group_size) {
  if (out % 8 != 0) throw Error(fmt::format("an AWQ layer needs out ({}) divisible by 8", out));
  if (group_size <= 0 || in % group_size != 0)
    throw Error(fmt::format("an AWQ layer needs in ({}) divisible by group_size ({})", in, group_size));
  const int64_t groups = in / group_size;
  check_size(p.qweight.size(), in * (out / 8), "qweight");
  check_size(p.qzeros.size(), groups * (out / 8), "qzeros");
  check_size(p.scales.size(), groups * out, "scales");
  return groups;
}

}  // namespace

void gptq_dequantize(const GptqPacked& p, int bits, int64_t in, int64_t out, int64_t groups, std::span<float> w) {
  check_gptq(p, bits, in, out, groups, false);
  const int per_word = 32 / bits;
  check_size(w.size(), in * out, "the output");
  for (int64_t k = 0; k < in; ++k) {
    const int32_t g = p.g_idx[static_cast<size_t>(k)];
    if (g < 0 || g >= groups) throw Error(fmt::format("g_idx[{}] is {}, outside [0, {})", k, g, groups));
    const int64_t word_row = k / per_word;
    const int j = static_cast<int>(k % per_word);
    for (int64_t n = 0; n < out; ++n) {
      const uint32_t q = field(p.qweight[static_cast<size_t>(word_row * out + n)], bits, j);
      const uint32_t zero_minus_one = field(p.qzeros[static_cast<size_t>(g * (out / per_word) + n / per_word)], bits,
                                            static_cast<int>(n % per_word));
      const float zero = static_cast<float>(zero_minus_one + 1u);  // as stored + 1, unmasked (16 for 0xF)
      w[static_cast<size_t>(k * out + n)] =
          f16_to_f32(p.scales[static_cast<size_t>(g * out + n)]) * (static_cast<float>(q) - zero);
    }
  }
}

void awq_dequantize(const AwqPacked& p, int64_t in, int64_t out, int64_t group_size, std::span<float> w) {
  check_awq(p, in, out, group_size);
  check_size(w.size(), in * out, "the output");
  for (int64_t k = 0; k < in; ++k) {
    const int64_t g = k / group_size;
    for (int64_t c = 0; c < out / 8; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + kAwqOrder[static_cast<size_t>(i)];
        const uint32_t q = field(p.qweight[static_cast<size_t>(k * (out / 8) + c)], 4, i);
        const uint32_t z = field(p.qzeros[static_cast<size_t>(g * (out / 8) + c)], 4, i);
        w[static_cast<size_t>(k * out + n)] =
            f16_to_f32(p.scales[static_cast<size_t>(g * out + n)]) * (static_cast<float>(q) - static_cast<float>(z));
      }
  }
}

void gptq_pack(std::span<const uint8_t> q, std::span<const uint8_t> zeros, int bits, int64_t in, int64_t out,
               int64_t groups, std::span<int32_t> qweight, std::span<int32_t> qzeros) {
  check_bits(bits);
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  check_size(q.size(), in * out, "q");
  check_size(zeros.size(), groups * out, "zeros");
  check_size(qweight.size(), in / per_word * out, "qweight");
  check_size(qzeros.size(), groups * (out / per_word), "qzeros");
  std::fill(qweight.begin(), qweight.end(), 0);
  std::fill(qzeros.begin(), qzeros.end(), 0);
  for (int64_t k = 0; k < in; ++k)
    for (int64_t n = 0; n < out; ++n) {
      auto& word = qweight[static_cast<size_t>((k / per_word) * out + n)];
      word = static_cast<int32_t>(static_cast<uint32_t>(word) |
                                  ((q[static_cast<size_t>(k * out + n)] & mask) << (bits * (k % per_word))));
    }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t n = 0; n < out; ++n) {
      const uint32_t stored = (static_cast<uint32_t>(zeros[static_cast<size_t>(g * out + n)]) - 1u) & mask;
      auto& word = qzeros[static_cast<size_t>(g * (out / per_word) + n / per_word)];
      word = static_cast<int32_t>(static_cast<uint32_t>(word) | (stored << (bits * (n % per_word))));
    }
}

void awq_pack(std::span<const uint8_t> q, std::span<const uint8_t> zeros, int64_t in, int64_t out, int64_t groups,
              std::span<int32_t> qweight, std::span<int32_t> qzeros) {
  check_size(q.size(), in * out, "q");
  check_size(zeros.size(), groups * out, "zeros");
  check_size(qweight.size(), in * (out / 8), "qweight");
  check_size(qzeros.size(), groups * (out / 8), "qzeros");
  auto pack_rows = [out](std::span<const uint8_t> codes, int64_t rows, std::span<int32_t> words) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < out / 8; ++c) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i)
          word |= (codes[static_cast<size_t>(r * out + 8 * c + kAwqOrder[static_cast<size_t>(i)])] & 0xFu) << (4 * i);
        words[static_cast<size_t>(r * (out / 8) + c)] = static_cast<int32_t>(word);
      }
  };
  pack_rows(q, in, qweight);
  pack_rows(zeros, groups, qzeros);
}

int64_t quantized_layer_bytes(int bits, int64_t in, int64_t out, int64_t groups, bool with_g_idx) {
  return out * in * bits / 8 + out * groups * 4 + (with_g_idx ? in * 4 : 0);
}

namespace {

QuantizedLayer empty_layer(int bits, int64_t in, int64_t out, int64_t groups, int64_t group_size) {
  const int per_word = 32 / bits;
  if (in % per_word != 0)
    throw Error(fmt::format("a {}-bit layer needs in ({}) divisible by {}", bits, in, per_word));
  QuantizedLayer layer{bits, in, out, group_size, groups, {}, {}, {}, {}};
  layer.codes.assign(static_cast<size_t>(out * (in / per_word)), 0);
  layer.scales.assign(static_cast<size_t>(out * groups), 0);
  layer.zeros.assign(static_cast<size_t>(out * groups), 0);
  return layer;
}

uint32_t layer_code(const QuantizedLayer& layer, int64_t n, int64_t k) {
  const int per_word = 32 / layer.bits;
  return field(layer.codes[static_cast<size_t>(n * (layer.in / per_word) + k / per_word)], layer.bits,
               static_cast<int>(k % per_word));
}

int64_t layer_group(const QuantizedLayer& layer, int64_t k) {
  return layer.g_idx.empty() ? k / layer.group_size : layer.g_idx[static_cast<size_t>(k)];
}

}  // namespace

QuantizedLayer gptq_to_layer(const GptqPacked& p, int bits, int64_t in, int64_t out, int64_t groups,
                             int64_t group_size) {
  check_gptq(p, bits, in, out, groups, true);
  const int per_word = 32 / bits;
  const int64_t size = group_size > 0 ? group_size : in;
  QuantizedLayer layer = empty_layer(bits, in, out, groups, size);
  for (int64_t w = 0; w < in / per_word; ++w)
    for (int64_t n = 0; n < out; ++n)
      layer.codes[static_cast<size_t>(n * (in / per_word) + w)] = p.qweight[static_cast<size_t>(w * out + n)];
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t n = 0; n < out; ++n) {
      const uint32_t zero_minus_one =
          field(p.qzeros[static_cast<size_t>(g * (out / per_word) + n / per_word)], bits, static_cast<int>(n % per_word));
      layer.zeros[static_cast<size_t>(n * groups + g)] = f32_to_f16(static_cast<float>(zero_minus_one + 1u));
      layer.scales[static_cast<size_t>(n * groups + g)] = p.scales[static_cast<size_t>(g * out + n)];
    }
  bool trivial = true;
  for (int64_t k = 0; k < static_cast<int64_t>(p.g_idx.size()); ++k) {
    const int32_t g = p.g_idx[static_cast<size_t>(k)];
    if (g < 0 || g >= groups) throw Error(fmt::format("g_idx[{}] is {}, outside [0, {})", k, g, groups));
    trivial = trivial && g == k / size;
  }
  if (p.g_idx.empty() && (in + size - 1) / size != groups)
    throw Error(fmt::format("{} groups of {} inputs do not cover in = {}", groups, size, in));
  if (!trivial) layer.g_idx.assign(p.g_idx.begin(), p.g_idx.end());
  return layer;
}

QuantizedLayer awq_to_layer(const AwqPacked& p, int64_t in, int64_t out, int64_t group_size) {
  const int64_t groups = check_awq(p, in, out, group_size);
  QuantizedLayer layer = empty_layer(4, in, out, groups, group_size);
  for (int64_t k = 0; k < in; ++k)
    for (int64_t c = 0; c < out / 8; ++c) {
      const int32_t word = p.qweight[static_cast<size_t>(k * (out / 8) + c)];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + kAwqOrder[static_cast<size_t>(i)];
        auto& dst = layer.codes[static_cast<size_t>(n * (in / 8) + k / 8)];
        dst = static_cast<int32_t>(static_cast<uint32_t>(dst) | (field(word, 4, i) << (4 * (k % 8))));
      }
    }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < out / 8; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + kAwqOrder[static_cast<size_t>(i)];
        const uint32_t z = field(p.qzeros[static_cast<size_t>(g * (out / 8) + c)], 4, i);
        layer.zeros[static_cast<size_t>(n * groups + g)] = f32_to_f16(static_cast<float>(z));
        layer.scales[static_cast<size_t>(n * groups + g)] = p.scales[static_cast<size_t>(g * out + n)];
      }
  return layer;
}

std::vector<float> dequantize_layer(const QuantizedLayer& layer) {
  std::vector<float> w(static_cast<size_t>(layer.out * layer.in));
  for (int64_t n = 0; n < layer.out; ++n)
    for (int64_t k = 0; k < layer.in; ++k) {
      const size_t g = static_cast<size_t>(n * layer.groups + layer_group(layer, k));
      w[static_cast<size_t>(n * layer.in + k)] =
          f16_to_f32(layer.scales[g]) * (static_cast<float>(layer_code(layer, n, k)) - f16_to_f32(layer.zeros[g]));
    }
  return w;
}

namespace {

// The integer codes [in, out] and zeros [groups, out] of a layer, the zeros checked against what
// the format can store (lowest..highest).
void layer_codes(const QuantizedLayer& layer, uint32_t lowest, uint32_t highest, std::vector<uint8_t>& q,
                 std::vector<uint8_t>& zeros) {
  q.resize(static_cast<size_t>(layer.in * layer.out));
  for (int64_t n = 0; n < layer.out; ++n)
    for (int64_t k = 0; k < layer.in; ++k)
      q[static_cast<size_t>(k * layer.out + n)] = static_cast<uint8_t>(layer_code(layer, n, k));
  zeros.resize(static_cast<size_t>(layer.groups * layer.out));
  for (int64_t n = 0; n < layer.out; ++n)
    for (int64_t g = 0; g < layer.groups; ++g) {
      const float z = f16_to_f32(layer.zeros[static_cast<size_t>(n * layer.groups + g)]);
      if (z != std::floor(z) || z < static_cast<float>(lowest) || z > static_cast<float>(highest))
        throw Error(fmt::format("zero point {} of output {} cannot be stored (the format takes integers {}..{})", z, n,
                                lowest, highest));
      zeros[static_cast<size_t>(g * layer.out + n)] = static_cast<uint8_t>(z);
    }
}

std::vector<uint16_t> file_scales(const QuantizedLayer& layer) {
  std::vector<uint16_t> scales(static_cast<size_t>(layer.groups * layer.out));
  for (int64_t n = 0; n < layer.out; ++n)
    for (int64_t g = 0; g < layer.groups; ++g)
      scales[static_cast<size_t>(g * layer.out + n)] = layer.scales[static_cast<size_t>(n * layer.groups + g)];
  return scales;
}

}  // namespace

PackedTensors layer_to_gptq(const QuantizedLayer& layer) {
  const int per_word = 32 / layer.bits;
  std::vector<uint8_t> q, zeros;
  // GPTQ stores zero - 1 in `bits` bits: zero 0 would read back as 2^bits.
  layer_codes(layer, 1, (1u << layer.bits) - 1u, q, zeros);
  PackedTensors t;
  t.qweight.resize(static_cast<size_t>(layer.in / per_word * layer.out));
  t.qzeros.resize(static_cast<size_t>(layer.groups * (layer.out / per_word)));
  gptq_pack(q, zeros, layer.bits, layer.in, layer.out, layer.groups, t.qweight, t.qzeros);
  t.scales = file_scales(layer);
  t.g_idx.resize(static_cast<size_t>(layer.in));
  for (int64_t k = 0; k < layer.in; ++k) t.g_idx[static_cast<size_t>(k)] = static_cast<int32_t>(layer_group(layer, k));
  return t;
}

PackedTensors layer_to_awq(const QuantizedLayer& layer) {
  if (layer.bits != 4 || !layer.g_idx.empty() || layer.in % layer.group_size != 0)
    throw Error("AWQ files hold 4-bit layers with whole groups in input order");
  std::vector<uint8_t> q, zeros;
  layer_codes(layer, 0, 15, q, zeros);
  PackedTensors t;
  t.qweight.resize(static_cast<size_t>(layer.in * (layer.out / 8)));
  t.qzeros.resize(static_cast<size_t>(layer.groups * (layer.out / 8)));
  awq_pack(q, zeros, layer.in, layer.out, layer.groups, t.qweight, t.qzeros);
  t.scales = file_scales(layer);
  return t;
}

}  // namespace memtune

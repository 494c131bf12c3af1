// Packed GPTQ / AWQ weights (see quantized.h).
#include "io/quantized.h"

#include <fmt/format.h>

#include <algorithm>

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

}  // namespace

void gptq_dequantize(const GptqPacked& p, int bits, int64_t in, int64_t out, int64_t groups, std::span<float> w) {
  check_bits(bits);
  const int per_word = 32 / bits;
  if (in % per_word != 0 || out % per_word != 0)
    throw Error(fmt::format("a {}-bit GPTQ layer needs in ({}) and out ({}) divisible by {}", bits, in, out, per_word));
  check_size(p.qweight.size(), in / per_word * out, "qweight");
  check_size(p.qzeros.size(), groups * (out / per_word), "qzeros");
  check_size(p.scales.size(), groups * out, "scales");
  check_size(p.g_idx.size(), in, "g_idx");
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
  if (out % 8 != 0) throw Error(fmt::format("an AWQ layer needs out ({}) divisible by 8", out));
  if (group_size <= 0 || in % group_size != 0)
    throw Error(fmt::format("an AWQ layer needs in ({}) divisible by group_size ({})", in, group_size));
  const int64_t groups = in / group_size;
  check_size(p.qweight.size(), in * (out / 8), "qweight");
  check_size(p.qzeros.size(), groups * (out / 8), "qzeros");
  check_size(p.scales.size(), groups * out, "scales");
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

}  // namespace memtune

// Int8 activations for quantized products of many rows (prefill, serving steps, evaluation): a
// numerics choice the model makes per weight (QuantizedWeight::int8_activations), written here
// once for every backend that takes it (cpu computes it with integer dot products, reference in
// float64 from the same rounded values). The other choice for those products, bfloat16 operands
// (QuantizedWeight::bf16_products), is written here too (rounds_to_bfloat16).
//
// The input of a product of more than kInt8ActivationRows rows is rounded per block of
// int8_activation_block(w) inputs (128, 64 or 32: the largest that divides the weight's group),
// symmetric, one float32 scale per block: q = rint(x * (127 / amax)), x ~ (amax / 127) q, so the
// product is exactly the dequantized weight times the rounded input. Decoding (at most
// kInt8ActivationRows rows) rounds the same way where the weight says so (int8_decode: the
// backend's kernels read the codes as stored, 128 inputs at a time) and its layout allows
// (rounds_decode_layout: its blocks are then 128); otherwise it keeps float32 inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/backend.h"

namespace memtune {

constexpr int64_t kInt8ActivationRows = 16;

// The inputs one activation scale covers; 0 where int8 activations do not apply to this weight
// (other than 4 or 8 bits, act-order g_idx, a group that is no multiple of 32, or inputs that are
// no whole number of groups).
inline int64_t int8_activation_block(const QuantizedWeight& w) {
  if ((w.bits != 4 && w.bits != 8) || w.g_idx || w.in % 32 != 0 || w.group_size <= 0 || w.in % w.group_size != 0)
    return 0;
  for (const int64_t a : {128, 64, 32})
    if (w.group_size % a == 0 && w.in % a == 0) return a;
  return 0;
}

// The layouts decoding rounds for: 4 or 8 bits, no g_idx, inputs and groups whole multiples of
// 128 (one activation block of 128 within one group).
inline bool rounds_decode_layout(const QuantizedWeight& w) {
  return (w.bits == 4 || w.bits == 8) && !w.g_idx && w.in % 128 == 0 && w.group_size > 0 && w.group_size % 128 == 0;
}

// Whether a product of `rows` input rows with w rounds its input to int8.
inline bool rounds_activations(const QuantizedWeight& w, int64_t rows) {
  if (!w.int8_activations || w.bf16_products) return false;
  return rows > kInt8ActivationRows ? int8_activation_block(w) > 0 : w.int8_decode && rounds_decode_layout(w);
}

// Whether a product of `rows` input rows with w takes bfloat16 operands instead: the input
// rounded to bfloat16 (round to nearest even) and each dequantized weight, scale * (code - zero)
// in float32, rounded the same way; products accumulate in float32. Decoding keeps its kernels.
inline bool rounds_to_bfloat16(const QuantizedWeight& w, int64_t rows) {
  return w.bf16_products && rows > kInt8ActivationRows;
}

// One block: q[i] = rint(x[i] * (127 / amax)); returns the scale amax / 127 (0 for a zero block).
inline float round_block_to_int8(const float* x, int64_t n, int8_t* q) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0.0f) {
    std::fill(q, q + n, int8_t{0});
    return 0.0f;
  }
  const float inverse = 127.0f / amax;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
  return amax / 127.0f;
}

}  // namespace memtune

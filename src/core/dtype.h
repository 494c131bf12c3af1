// Storage dtypes. Compute is always float32; parameters may be stored as float32, bfloat16 or
// float16 (as the checkpoint's torch_dtype says). bf16 rounds to nearest even like torch.
// I32 is the element type of token ids, positions and sequence offsets (never a parameter's
// storage: parse_dtype refuses it, and the float conversions do not take it).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace memtune {

enum class DType { F32, BF16, F16, I32 };

size_t dtype_size(DType dtype);
// safetensors spelling: "F32", "BF16", "F16".
std::string_view dtype_safetensors_name(DType dtype);
// torch_dtype spelling: "float32", "bfloat16", "float16".
std::string_view dtype_torch_name(DType dtype);
// Parses either spelling (and "fp32"/"bf16"/"fp16"); throws Error naming `what` otherwise.
DType parse_dtype(std::string_view name, const std::string& what);

inline float bf16_to_f32(uint16_t v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);

// Converts n elements between storage dtypes (either side may be F32).
void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t n);
void convert_from_f32(const float* src, void* dst, DType dst_dtype, size_t n);

}  // namespace memtune

#include <fmt/format.h>

#include "core/dtype.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace memtune {

size_t dtype_size(DType dtype) {
  return dtype == DType::F32 || dtype == DType::I32 ? 4 : 2;
}

std::string_view dtype_safetensors_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
  }
  return "?";
}

std::string_view dtype_torch_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "float32";
    case DType::BF16:
      return "bfloat16";
    case DType::F16:
      return "float16";
    case DType::I32:
      return "int32";
  }
  return "?";
}

DType parse_dtype(std::string_view name, const std::string& what) {
  if (name == "F32" || name == "float32" || name == "fp32" || name == "float") return DType::F32;
  if (name == "BF16" || name == "bfloat16" || name == "bf16") return DType::BF16;
  if (name == "F16" || name == "float16" || name == "fp16" || name == "half") return DType::F16;
  throw Error(fmt::format("{}: unsupported dtype \"{}\" (expected float32, bfloat16 or float16)", what, name));
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 112) << 23 | mant << 13;
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // result is subnormal or zero: round via float arithmetic
    float a = std::bit_cast<float>(absx);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t rounded = absx + 0xfffu + ((absx >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t n) {
  switch (src_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16: {
      auto* s = static_cast<const uint16_t*>(src);
#pragma omp parallel for simd if (n > 65536)
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::I32:
      break;
  }
  MT_ASSERT(false, "int32 is not a floating storage dtype");
}

void convert_from_f32(const float* src, void* dst, DType dst_dtype, size_t n) {
  switch (dst_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16: {
      auto* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for simd if (n > 65536)
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::F16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::I32:
      break;
  }
  MT_ASSERT(false, "int32 is not a floating storage dtype");
}

}  // namespace memtune

// Tests for the storage dtype conversions: float32 -> bfloat16/float16 must round to nearest
// even exactly like torch (ties, overflow to inf, subnormals for f16), keep NaN a NaN, and the
// widening conversions must be exact; plus the dtype names and sizes.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"

namespace memtune {
namespace {

float from_bits(uint32_t b) {
  return std::bit_cast<float>(b);
}
const float kInf = std::numeric_limits<float>::infinity();

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_safetensors_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_torch_name(DType::F16), "float16");
  for (DType d : {DType::F32, DType::BF16, DType::F16}) {
    EXPECT_EQ(parse_dtype(dtype_safetensors_name(d), "x"), d);
    EXPECT_EQ(parse_dtype(dtype_torch_name(d), "x"), d);
  }
  EXPECT_EQ(parse_dtype("bf16", "x"), DType::BF16);
  try {
    parse_dtype("int8", "config.json: field \"torch_dtype\"");
    ADD_FAILURE() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: field \"torch_dtype\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("int8"), std::string::npos) << e.what();
  }
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // below half: down
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, even below
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808001)), 0x3F81);  // above half: up
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, even above
  EXPECT_EQ(f32_to_bf16(from_bits(0xBF818000)), 0xBF82);  // sign is symmetric
  EXPECT_EQ(f32_to_bf16(from_bits(0x00008000)), 0x0000);  // f32 subnormals round too
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000)), 0x0002);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
}

TEST(DTypeTest, Bf16InfinityOverflowAndNan) {
  EXPECT_EQ(f32_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-kInf), 0xFF80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds past the largest bf16
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F7FFF)), 0x7F7F);              // just below: stays finite
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    uint16_t b = f32_to_bf16(from_bits(nan));
    EXPECT_TRUE(std::isnan(bf16_to_f32(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7FC0)));
  EXPECT_EQ(bf16_to_f32(0xFF80), -kInf);
}

TEST(DTypeTest, Bf16WideningIsExactForEveryValue) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    float f = bf16_to_f32(static_cast<uint16_t>(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(f32_to_bf16(f), b);
    }
  }
}

TEST(DTypeTest, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);      // tie, even below
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, even above
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7BFF);  // below half to the next binade
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);  // tie rounds to even = inf
  EXPECT_EQ(f32_to_f16(1e6f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-1e6f), 0xFC00);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
}

TEST(DTypeTest, F16Subnormals) {
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);             // tie with zero: even
  EXPECT_EQ(f32_to_f16(0x1p-25f + 0x1p-40f), 0x0001);  // just above the tie
  EXPECT_EQ(f32_to_f16(3 * 0x1p-25f), 0x0002);         // tie between 1 and 2: even
  EXPECT_EQ(f32_to_f16(-0x1p-24f), 0x8001);
  EXPECT_EQ(f32_to_f16(1023 * 0x1p-24f), 0x03FF);     // largest subnormal
  EXPECT_EQ(f32_to_f16(1023.5f * 0x1p-24f), 0x0400);  // tie: rounds up into the normals
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);            // smallest normal
  EXPECT_EQ(f32_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x8200), -512 * 0x1p-24f);
}

TEST(DTypeTest, F16InfinityAndNan) {
  EXPECT_EQ(f32_to_f16(kInf), 0x7C00);
  EXPECT_EQ(f32_to_f16(-kInf), 0xFC00);
  EXPECT_EQ(f16_to_f32(0x7C00), kInf);
  EXPECT_EQ(f16_to_f32(0xFC00), -kInf);
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFFC00000u}) {
    uint16_t h = f32_to_f16(from_bits(nan));
    EXPECT_TRUE(std::isnan(f16_to_f32(h))) << std::hex << nan;
  }
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7C01)));
}

TEST(DTypeTest, F16WideningIsExactForEveryValue) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_EQ(h & 0x7C00, 0x7C00u);
      continue;
    }
    // Every finite f16 is m * 2^(e-25) with an 11-bit m; reconstruct it independently.
    uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    double expect = e == 31 ? INFINITY : e == 0 ? std::ldexp(m, -24) : std::ldexp(m | 0x400, static_cast<int>(e) - 25);
    EXPECT_EQ(static_cast<double>(f), (h & 0x8000) ? -expect : expect) << std::hex << h;
    EXPECT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
}

TEST(DTypeTest, F16MatchesNearestEvenOnRandomValues) {
  // Reference: the representable neighbours of |x| and a tie broken towards the even mantissa.
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0x477FFFFF);  // up to just past 65504
  for (int i = 0; i < 200000; ++i) {
    float x = from_bits(bits(rng));
    uint16_t h = f32_to_f16(x);
    if (h == 0x7C00) {
      EXPECT_GE(x, 65520.0f);
      continue;
    }
    double v = f16_to_f32(h), err = std::abs(static_cast<double>(x) - v);
    double up = h < 0x7BFF ? f16_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0;
    double down = h > 0 ? f16_to_f32(static_cast<uint16_t>(h - 1)) : -static_cast<double>(f16_to_f32(1));
    EXPECT_LE(err, std::abs(x - up)) << x;
    EXPECT_LE(err, std::abs(x - down)) << x;
    if (err == std::abs(x - up) || err == std::abs(x - down)) {
      EXPECT_EQ(h & 1, 0) << x;
    }
  }
}

TEST(DTypeTest, BulkConversionsMatchTheScalarOnes) {
  const size_t n = 70000;  // past the size where the loops go parallel
  std::vector<float> src(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (float& v : src) v = dist(rng);
  src[0] = kInf;
  src[1] = std::numeric_limits<float>::quiet_NaN();
  src[2] = 1e-7f;

  for (DType d : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> narrow(n);
    convert_from_f32(src.data(), narrow.data(), d, n);
    std::vector<float> wide(n);
    convert_to_f32(narrow.data(), d, wide.data(), n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t expect = d == DType::BF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
      ASSERT_EQ(narrow[i], expect) << i;
      float back = d == DType::BF16 ? bf16_to_f32(expect) : f16_to_f32(expect);
      if (std::isnan(back)) {
        ASSERT_TRUE(std::isnan(wide[i])) << i;
      } else {
        ASSERT_EQ(wide[i], back) << i;
      }
    }
  }
  std::vector<float> copy(n);
  convert_to_f32(src.data(), DType::F32, copy.data(), n);
  EXPECT_EQ(std::memcmp(copy.data(), src.data(), n * 4), 0);
}

}  // namespace
}  // namespace memtune

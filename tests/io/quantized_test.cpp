// GPTQ (4 and 8 bits, with and without act-order g_idx) and AWQ (4 bits) packing against test
// vectors that tests/io/quantized_vectors.py writes with numpy from the formats' description,
// independently of the C++: our unpacking gives the vectors' weights exactly, and our packing
// gives their words.
#include "io/quantized.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

class QuantizedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing_support::make_temp_dir("quantized_vectors");
    const auto r = testing_support::run_command(
        "/usr/bin/python3 " + testing_support::source_dir() + "/tests/io/quantized_vectors.py " + dir_.string());
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  template <class T>
  static std::vector<T> read(const std::string& name, const std::string& array) {
    const fs::path path = dir_ / (name + "." + array + ".bin");
    std::vector<T> v(fs::file_size(path) / sizeof(T));
    std::ifstream(path, std::ios::binary)
        .read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(fs::file_size(path)));
    return v;
  }
  static nlohmann::json meta(const std::string& name) {
    return nlohmann::json::parse(std::ifstream(dir_ / (name + ".json")));
  }
  static inline fs::path dir_;
};

TEST_F(QuantizedTest, GptqUnpacksAndPacksLikeTheReference) {
  for (const std::string name : {"gptq4", "gptq8", "gptq4_actorder"}) {
    const nlohmann::json m = meta(name);
    const int bits = m["bits"];
    const int64_t in = m["in"], out = m["out"], groups = m["groups"];
    const auto qweight = read<int32_t>(name, "qweight"), qzeros = read<int32_t>(name, "qzeros");
    const auto g_idx = read<int32_t>(name, "g_idx");
    const auto scales = read<uint16_t>(name, "scales");
    const auto expected = read<float>(name, "w");
    std::vector<float> w(static_cast<size_t>(in * out));
    gptq_dequantize({.qweight = qweight, .qzeros = qzeros, .g_idx = g_idx, .scales = scales}, bits, in, out, groups, w);
    EXPECT_EQ(w, expected) << name;

    const auto q = read<uint8_t>(name, "q"), zeros = read<uint8_t>(name, "zeros");
    std::vector<int32_t> packed_w(qweight.size()), packed_z(qzeros.size());
    gptq_pack(q, zeros, bits, in, out, groups, packed_w, packed_z);
    EXPECT_EQ(packed_w, qweight) << name;
    EXPECT_EQ(packed_z, qzeros) << name;
  }
}

TEST_F(QuantizedTest, AwqUnpacksAndPacksLikeTheReference) {
  const nlohmann::json m = meta("awq4");
  const int64_t in = m["in"], out = m["out"], groups = m["groups"], group_size = m["group_size"];
  const auto qweight = read<int32_t>("awq4", "qweight"), qzeros = read<int32_t>("awq4", "qzeros");
  const auto scales = read<uint16_t>("awq4", "scales");
  std::vector<float> w(static_cast<size_t>(in * out));
  awq_dequantize({.qweight = qweight, .qzeros = qzeros, .scales = scales}, in, out, group_size, w);
  EXPECT_EQ(w, read<float>("awq4", "w"));
  std::vector<int32_t> packed_w(qweight.size()), packed_z(qzeros.size());
  awq_pack(read<uint8_t>("awq4", "q"), read<uint8_t>("awq4", "zeros"), in, out, groups, packed_w, packed_z);
  EXPECT_EQ(packed_w, qweight);
  EXPECT_EQ(packed_z, qzeros);
}

TEST_F(QuantizedTest, RefusesMismatchedShapesAndGroups) {
  const std::vector<int32_t> qweight(8 * 8), qzeros(1), g_idx(64, 3);
  const std::vector<uint16_t> scales(8);
  std::vector<float> w(64 * 8);
  EXPECT_NE(testing_support::error_of([&] {
              gptq_dequantize({.qweight = qweight, .qzeros = qzeros, .g_idx = g_idx, .scales = scales}, 4, 64, 8, 1, w);
            }).find("g_idx[0] is 3"),
            std::string::npos);
  EXPECT_NE(testing_support::error_of([&] {
              gptq_dequantize({.qweight = qweight, .qzeros = qzeros, .g_idx = g_idx, .scales = scales}, 3, 64, 8, 1, w);
            }).find("4 or 8 bits"),
            std::string::npos);
  EXPECT_NE(testing_support::error_of([&] {
              awq_dequantize({.qweight = qweight, .qzeros = qzeros, .scales = scales}, 64, 8, 16, w);
            }).find("qzeros has 1 elements, expected 4"),
            std::string::npos);
}

}  // namespace
}  // namespace memtune

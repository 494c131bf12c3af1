// Tests for the safetensors reader and writer: round trips in every supported dtype, the exact
// byte layout the writer produces, and one hand-crafted malformed file per validation rule,
// checking that the Error names the file and the tensor or field at fault.
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

using testing_support::error_of;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_support::make_temp_dir("safetensors_test"); }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string read_bytes(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Writes an 8-byte little-endian length (header.size() unless overridden), header, data.
  std::string craft(const std::string& header, const std::string& data, uint64_t length) const {
    std::string bytes;
    for (int i = 0; i < 8; ++i) bytes += static_cast<char>((length >> (8 * i)) & 0xff);
    bytes += header + data;
    std::string p = path("crafted.safetensors");
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  std::string craft(const std::string& header, const std::string& data) const {
    return craft(header, data, header.size());
  }

  // The Error from opening a crafted file; it must name the file.
  std::string open_error(const std::string& header, const std::string& data) const {
    std::string p = craft(header, data);
    std::string msg = error_of([&] { SafetensorsFile f(p); });
    EXPECT_CONTAINS(msg, p);
    return msg;
  }

  fs::path dir_;
};

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
bool same_bytes(std::span<const std::byte> got, const std::vector<T>& want) {
  return got.size() == want.size() * sizeof(T) && std::memcmp(got.data(), want.data(), got.size()) == 0;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeWithMetadataAndScalar) {
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f};
  std::vector<uint16_t> b = {f32_to_bf16(1.0f), f32_to_bf16(-0.5f), f32_to_bf16(3.0f), f32_to_bf16(1e10f)};
  std::vector<uint16_t> c = {f32_to_f16(0.25f), f32_to_f16(-65504.0f), f32_to_f16(6e-8f), f32_to_f16(2.0f)};
  std::vector<float> s = {42.0f};
  std::string p = path("round.safetensors");
  write_safetensors(p,
                    {{"a", DType::F32, {2, 3}, a.data()},
                     {"b.weight", DType::BF16, {4}, b.data()},
                     {"c", DType::F16, {2, 1, 2}, c.data()},
                     {"scalar", DType::F32, {}, s.data()}},
                    {{"format", "pt"}, {"note", "hello"}});

  SafetensorsFile f(p);
  EXPECT_EQ(f.path(), p);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.tensors()[0].name, "a");
  EXPECT_EQ(f.tensors()[1].name, "b.weight");
  EXPECT_EQ(f.tensors()[2].name, "c");
  EXPECT_EQ(f.tensors()[3].name, "scalar");

  const TensorInfo* ta = f.find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, DType::F32);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ta->numel(), 6);
  EXPECT_EQ(ta->nbytes(), 24u);
  EXPECT_TRUE(same_bytes(f.data(*ta), a));

  const TensorInfo* tb = f.find("b.weight");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->dtype, DType::BF16);
  EXPECT_TRUE(same_bytes(f.data(*tb), b));

  const TensorInfo* tc = f.find("c");
  ASSERT_NE(tc, nullptr);
  EXPECT_EQ(tc->dtype, DType::F16);
  EXPECT_EQ(tc->shape, (std::vector<int64_t>{2, 1, 2}));
  EXPECT_TRUE(same_bytes(f.data(*tc), c));

  const TensorInfo* ts = f.find("scalar");
  ASSERT_NE(ts, nullptr);
  EXPECT_TRUE(ts->shape.empty());
  EXPECT_EQ(ts->numel(), 1);
  EXPECT_TRUE(same_bytes(f.data(*ts), s));

  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "hello"}}));
}

TEST_F(SafetensorsTest, WriterProducesTheExactLayout) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> y = {1, 2, 3, 4};
  std::string p = path("layout.safetensors");
  write_safetensors(p, {{"x", DType::F32, {6}, x.data()}, {"y", DType::BF16, {2, 2}, y.data()}}, {{"format", "pt"}});

  std::string raw = read_bytes(p);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(raw[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u) << "data must start 8-byte aligned";
  ASSERT_EQ(raw.size(), 8 + n + 24 + 8);

  std::string header = raw.substr(8, n);
  size_t json_end = header.rfind('}') + 1;
  EXPECT_EQ(header.substr(json_end), std::string(n - json_end, ' ')) << "padding must be spaces";
  EXPECT_LT(n - json_end, 8u);
  EXPECT_LT(header.find("\"x\""), header.find("\"y\"")) << "tensor entries in the given order";
  EXPECT_LT(header.find("\"y\""), header.find("\"__metadata__\"")) << "metadata after the tensors";

  auto doc = nlohmann::json::parse(header);
  EXPECT_EQ(doc["x"]["dtype"], "F32");
  EXPECT_EQ(doc["x"]["shape"], nlohmann::json({6}));
  EXPECT_EQ(doc["x"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(doc["y"]["dtype"], "BF16");
  EXPECT_EQ(doc["y"]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(doc["y"]["data_offsets"], nlohmann::json({24, 32}));
  EXPECT_EQ(doc["__metadata__"], nlohmann::json({{"format", "pt"}}));

  EXPECT_EQ(std::memcmp(raw.data() + 8 + n, x.data(), 24), 0);
  EXPECT_EQ(std::memcmp(raw.data() + 8 + n + 24, y.data(), 8), 0);
}

TEST_F(SafetensorsTest, EmptyFilesAreValid) {
  std::string p = path("empty.safetensors");
  write_safetensors(p, {});
  EXPECT_EQ(read_bytes(p), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  SafetensorsFile f(p);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());

  SafetensorsFile unpadded(craft("{}", ""));
  EXPECT_TRUE(unpadded.tensors().empty());
}

TEST_F(SafetensorsTest, ZeroSizeTensorsRoundTrip) {
  std::vector<float> v = {1, 2};
  std::string p = path("zero.safetensors");
  write_safetensors(
      p, {{"empty", DType::F32, {0, 3}, nullptr}, {"v", DType::F32, {2}, v.data()}, {"e2", DType::BF16, {0}, nullptr}});
  SafetensorsFile f(p);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_TRUE(f.data(*f.find("empty")).empty());
  EXPECT_TRUE(same_bytes(f.data(*f.find("v")), v));
}

TEST_F(SafetensorsTest, AcceptsUnpaddedHeaderAndNullMetadata) {
  // An unaligned data start is legal; data() still returns the right bytes.
  std::string header = R"({"t":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"__metadata__":null})";
  ASSERT_NE(header.size() % 2, 0u);
  SafetensorsFile f(craft(header, std::string("\x01\x02\x03\x04", 4)));
  auto d = f.data(*f.find("t"));
  ASSERT_EQ(d.size(), 4u);
  EXPECT_EQ(std::to_integer<int>(d[0]), 1);
  EXPECT_EQ(std::to_integer<int>(d[3]), 4);
  EXPECT_TRUE(f.metadata().empty());
}

TEST_F(SafetensorsTest, OverwritesAtomicallyAndLeavesNoTempFiles) {
  std::vector<float> a = {1}, b = {2, 3};
  std::string p = path("over.safetensors");
  write_safetensors(p, {{"a", DType::F32, {1}, a.data()}});
  write_safetensors(p, {{"b", DType::F32, {2}, b.data()}});
  SafetensorsFile f(p);
  EXPECT_EQ(f.find("a"), nullptr);
  EXPECT_TRUE(same_bytes(f.data(*f.find("b")), b));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(SafetensorsTest, MissingOrNonRegularFile) {
  std::string p = path("nope.safetensors");
  std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "cannot open");
  msg = error_of([&] { SafetensorsFile f(dir_.string()); });
  EXPECT_CONTAINS(msg, "not a regular file");
}

TEST_F(SafetensorsTest, RefusesFileShorterThanEightBytes) {
  std::string p = path("short.safetensors");
  std::ofstream(p, std::ios::binary) << "abcde";
  std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "too short");
}

TEST_F(SafetensorsTest, RefusesHeaderLengthPastEndOfFile) {
  std::string p = craft("{}", "", 1000);
  std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "header length 1000 runs past the end");
}

TEST_F(SafetensorsTest, RefusesAbsurdHeaderLength) {
  std::string p = craft("{}", "", uint64_t{1} << 40);
  std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "exceeds");
}

TEST_F(SafetensorsTest, RefusesInvalidJson) {
  std::string msg = open_error(R"({"t": {"dtype": "F32",)", "");
  EXPECT_CONTAINS(msg, "invalid JSON");
}

TEST_F(SafetensorsTest, RefusesHeaderThatIsNotAnObject) {
  std::string msg = open_error("[1, 2]  ", "");
  EXPECT_CONTAINS(msg, "not a JSON object");
}

TEST_F(SafetensorsTest, RefusesDuplicateTensorNames) {
  std::string msg = open_error(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                               std::string(8, '\0'));
  EXPECT_CONTAINS(msg, "key \"t\" appears twice");
}

TEST_F(SafetensorsTest, RefusesEntryMissingAField) {
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    nlohmann::json entry = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}};
    entry.erase(field);
    std::string msg = open_error(nlohmann::json({{"w.q", entry}}).dump(), std::string(4, '\0'));
    EXPECT_CONTAINS(msg, "tensor \"w.q\"");
    EXPECT_CONTAINS(msg, std::string("missing required field \"") + field + "\"");
  }
}

TEST_F(SafetensorsTest, RefusesEntryFieldsOfTheWrongType) {
  struct Case {
    const char* header;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"w":[1]})", "expected a JSON object, got [1]"},
      {R"({"w":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", "field \"dtype\": expected a string, got 5"},
      {R"({"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", "field \"shape\": expected an array"},
      {R"({"w":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})",
       "field \"shape[0]\": expected a non-negative integer, got 1.0"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "field \"data_offsets\": expected [begin, end]"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})",
       "field \"data_offsets[1]\": expected a non-negative integer"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
       "field \"data_offsets[0]\": expected a non-negative integer"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "end before they begin"},
  };
  for (const Case& c : cases) {
    std::string msg = open_error(c.header, std::string(4, '\0'));
    EXPECT_CONTAINS(msg, "tensor \"w\"");
    EXPECT_CONTAINS(msg, c.expect);
  }
}

TEST_F(SafetensorsTest, RefusesUnsupportedDtype) {
  std::string msg = open_error(R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_CONTAINS(msg, "tensor \"ids\"");
  EXPECT_CONTAINS(msg, "I64 not supported");
  EXPECT_CONTAINS(msg, "F32, BF16, F16");
}

TEST_F(SafetensorsTest, RefusesNegativeDimension) {
  std::string msg = open_error(R"({"w":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_CONTAINS(msg, "tensor \"w\"");
  EXPECT_CONTAINS(msg, "field \"shape[0]\": expected a non-negative integer, got -1");
}

TEST_F(SafetensorsTest, RefusesByteSizeThatDoesNotMatchTheShape) {
  std::string msg = open_error(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(12, '\0'));
  EXPECT_CONTAINS(msg, "tensor \"w\"");
  EXPECT_CONTAINS(msg, "needs 16 bytes");
  EXPECT_CONTAINS(msg, "cover 12");
}

TEST_F(SafetensorsTest, RefusesShapeWhoseSizeOverflows) {
  std::string msg =
      open_error(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})", "");
  EXPECT_CONTAINS(msg, "tensor \"w\"");
  EXPECT_CONTAINS(msg, "needs");
}

TEST_F(SafetensorsTest, EmptyTensorWithHugeDimensionsHasZeroElements) {
  // Accepted (0 elements, 0 bytes); numel() must not multiply 2^62 * 2^62 in int64 first.
  const std::string p =
      craft(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}})", "");
  const SafetensorsFile f(p);
  ASSERT_NE(f.find("w"), nullptr);
  EXPECT_EQ(f.find("w")->numel(), 0);
  EXPECT_EQ(f.find("w")->nbytes(), 0u);
}

TEST_F(SafetensorsTest, RefusesNumberTooLargeForADouble) {
  std::string msg = open_error(R"({"w":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", std::string(4, '\0'));
  EXPECT_CONTAINS(msg, "invalid JSON");
  EXPECT_CONTAINS(msg, "1e400");
}

TEST_F(SafetensorsTest, RefusesOffsetsPastTheData) {
  std::string msg = open_error(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'));
  EXPECT_CONTAINS(msg, "tensor \"w\"");
  EXPECT_CONTAINS(msg, "run past the end");
}

TEST_F(SafetensorsTest, RefusesOverlappingTensors) {
  std::string msg = open_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                               std::string(12, '\0'));
  EXPECT_CONTAINS(msg, "tensor \"b\" overlaps tensor \"a\"");
}

TEST_F(SafetensorsTest, RefusesGapBetweenTensors) {
  std::string msg = open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                               std::string(12, '\0'));
  EXPECT_CONTAINS(msg, "gap before tensor \"b\"");
}

TEST_F(SafetensorsTest, RefusesDataThatDoesNotStartAtZero) {
  std::string msg = open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'));
  EXPECT_CONTAINS(msg, "bytes 0 to 4");
  EXPECT_CONTAINS(msg, "tensor \"a\"");
}

TEST_F(SafetensorsTest, RefusesTrailingBytesNoTensorCovers) {
  std::string msg = open_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(12, '\0'));
  EXPECT_CONTAINS(msg, "12 bytes but the tensors cover only 4");
}

TEST_F(SafetensorsTest, RefusesMalformedMetadata) {
  std::string msg = open_error(R"({"__metadata__":["pt"]})", "");
  EXPECT_CONTAINS(msg, "field \"__metadata__\": expected a JSON object");
  msg = open_error(R"({"__metadata__":{"format":"pt","step":3}})", "");
  EXPECT_CONTAINS(msg, "field \"__metadata__[\"step\"]\": expected a string");
}

TEST(ShapeStringTest, RendersShapes) {
  EXPECT_EQ(shape_string(std::vector<int64_t>{}), "[]");
  EXPECT_EQ(shape_string(std::vector<int64_t>{151936, 896}), "[151936, 896]");
}

TEST_F(SafetensorsTest, WriterRefusesBadTensors) {
  std::vector<float> v = {1};
  std::string p = path("bad.safetensors");
  std::string msg = error_of([&] {
    write_safetensors(p, {{"a", DType::F32, {1}, v.data()}, {"a", DType::F32, {1}, v.data()}});
  });
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "tensor \"a\": given more than once");
  msg = error_of([&] { write_safetensors(p, {{"__metadata__", DType::F32, {1}, v.data()}}); });
  EXPECT_CONTAINS(msg, "reserved");
  msg = error_of([&] { write_safetensors(p, {{"n", DType::F32, {-1}, v.data()}}); });
  EXPECT_CONTAINS(msg, "tensor \"n\": negative dimension");
  msg = error_of([&] { write_safetensors(p, {{"d", DType::F32, {1}, nullptr}}); });
  EXPECT_CONTAINS(msg, "tensor \"d\": no data");
  msg = error_of([&] { write_safetensors(p, {{std::string("bad\xff", 4), DType::F32, {1}, v.data()}}); });
  EXPECT_CONTAINS(msg, "not valid UTF-8");
  EXPECT_FALSE(fs::exists(p));

  std::string in_missing_dir = path("no/such/dir/x.safetensors");
  msg = error_of([&] { write_safetensors(in_missing_dir, {}); });
  EXPECT_CONTAINS(msg, in_missing_dir);
}

}  // namespace
}  // namespace memtune

// Tests for Hugging Face checkpoint directories: single-file and sharded round trips with the
// HF file names and index, dtype conversion in read_into, the index cross-checks, and that a
// rewrite into a directory holding an older checkpoint leaves exactly the new one.
#include "io/checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testing_support::error_of;

const std::vector<int64_t> k2x2 = {2, 2};

// "t<i>". (Written without `"t" + std::to_string(i)`, which trips a false -Wrestrict in GCC 12 at -O2.)
std::string tensor_name(int i) {
  return std::string(1, 't').append(std::to_string(i));
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_support::make_temp_dir("checkpoint_test").string(); }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::set<std::string> files() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.insert(e.path().filename().string());
    return names;
  }

  json read_json(const std::string& name) const {
    std::ifstream in(path(name));
    return json::parse(in);
  }
  void write_text(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }

  // Six F32 tensors of 4 elements (16 bytes) each; t<i> holds i*10 + element index.
  std::vector<TensorToWrite> six_tensors() {
    data_.assign(6, std::vector<float>(4));
    std::vector<TensorToWrite> out;
    for (int i = 0; i < 6; ++i) {
      for (int j = 0; j < 4; ++j) data_[i][j] = static_cast<float>(i * 10 + j);
      out.push_back({tensor_name(i), DType::F32, {2, 2}, data_[i].data()});
    }
    return out;
  }

  std::string dir_;
  std::vector<std::vector<float>> data_;
};

TEST_F(CheckpointTest, SingleFileRoundTrip) {
  write_checkpoint(dir_, six_tensors());
  EXPECT_EQ(files(), (std::set<std::string>{"model.safetensors"}));
  SafetensorsFile f(path("model.safetensors"));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  CheckpointReader r(dir_);
  EXPECT_EQ(r.tensor_names(), (std::vector<std::string>{"t0", "t1", "t2", "t3", "t4", "t5"}));
  EXPECT_TRUE(r.contains("t3"));
  EXPECT_FALSE(r.contains("t6"));
  EXPECT_EQ(r.info("t3").shape, k2x2);
  EXPECT_EQ(r.file_of("t3").path(), path("model.safetensors"));
  std::vector<float> out(4);
  r.read_into("t3", k2x2, out.data(), DType::F32);
  EXPECT_EQ(out, data_[3]);
}

TEST_F(CheckpointTest, ShardedRoundTripWithHfNamesAndIndex) {
  write_checkpoint(dir_, six_tensors(), 40);  // two 16-byte tensors per shard
  EXPECT_EQ(files(), (std::set<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                            "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  json index = read_json("model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"], 96);
  EXPECT_EQ(index["weight_map"], json({{"t0", "model-00001-of-00003.safetensors"},
                                       {"t1", "model-00001-of-00003.safetensors"},
                                       {"t2", "model-00002-of-00003.safetensors"},
                                       {"t3", "model-00002-of-00003.safetensors"},
                                       {"t4", "model-00003-of-00003.safetensors"},
                                       {"t5", "model-00003-of-00003.safetensors"}}));
  for (int i = 1; i <= 3; ++i) {
    SafetensorsFile shard(path("model-0000" + std::to_string(i) + "-of-00003.safetensors"));
    EXPECT_EQ(shard.tensors().size(), 2u);
    EXPECT_EQ(shard.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  }

  CheckpointReader r(dir_);
  EXPECT_EQ(r.tensor_names().size(), 6u);
  EXPECT_EQ(r.file_of("t4").path(), path("model-00003-of-00003.safetensors"));
  for (int i = 0; i < 6; ++i) {
    std::vector<float> out(4);
    r.read_into(tensor_name(i), k2x2, out.data(), DType::F32);
    EXPECT_EQ(out, data_[i]);
  }
}

TEST_F(CheckpointTest, TensorLargerThanTheLimitGetsItsOwnShard) {
  std::vector<float> small(2, 1.0f), big(25, 2.0f);
  write_checkpoint(dir_,
                   {{"a", DType::F32, {2}, small.data()},
                    {"big", DType::F32, {25}, big.data()},
                    {"c", DType::F32, {2}, small.data()}},
                   50);
  json index = read_json("model.safetensors.index.json");
  EXPECT_EQ(index["weight_map"]["a"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["big"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["c"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 116);
}

TEST_F(CheckpointTest, ReadIntoConvertsBetweenDtypes) {
  const std::vector<float> values = {1.0f, -2.5f, 0.15625f, 3.0e4f};
  std::vector<uint16_t> bf16(4), f16(4);
  convert_from_f32(values.data(), bf16.data(), DType::BF16, 4);
  convert_from_f32(values.data(), f16.data(), DType::F16, 4);
  write_checkpoint(dir_, {{"b", DType::BF16, {4}, bf16.data()},
                          {"f", DType::F32, {4}, values.data()},
                          {"h", DType::F16, {4}, f16.data()}});
  CheckpointReader r(dir_);
  const std::vector<int64_t> shape = {4};

  std::vector<float> as_f32(4);
  r.read_into("b", shape, as_f32.data(), DType::F32);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(as_f32[i], bf16_to_f32(bf16[i]));

  std::vector<uint16_t> as_bf16(4);
  r.read_into("f", shape, as_bf16.data(), DType::BF16);
  EXPECT_EQ(as_bf16, bf16);

  std::vector<uint16_t> as_f16(4);
  r.read_into("f", shape, as_f16.data(), DType::F16);
  EXPECT_EQ(as_f16, f16);

  r.read_into("h", shape, as_bf16.data(), DType::BF16);  // F16 -> BF16 goes through F32
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(as_bf16[i], f32_to_bf16(f16_to_f32(f16[i])));
}

TEST_F(CheckpointTest, ReadIntoHandlesUnalignedTensorData) {
  // A foreign writer that did not pad the header leaves BF16 data at an odd address.
  std::string header = R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}})";
  ASSERT_NE(header.size() % 2, 0u);
  const uint16_t v[3] = {f32_to_bf16(1.5f), f32_to_bf16(-3.0f), f32_to_bf16(0.25f)};
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header + std::string(reinterpret_cast<const char*>(v), sizeof v);
  std::ofstream(path("model.safetensors"), std::ios::binary) << bytes;

  CheckpointReader r(dir_);
  std::vector<float> out(3);
  r.read_into("w", std::vector<int64_t>{3}, out.data(), DType::F32);
  EXPECT_EQ(out, (std::vector<float>{1.5f, -3.0f, 0.25f}));
}

TEST_F(CheckpointTest, ShapeMismatchNamesBothShapesTheTensorAndTheFile) {
  write_checkpoint(dir_, six_tensors());
  CheckpointReader r(dir_);
  std::vector<float> out(4);
  std::string msg = error_of([&] { r.read_into("t1", std::vector<int64_t>{4, 1}, out.data(), DType::F32); });
  EXPECT_CONTAINS(msg, "\"t1\"");
  EXPECT_CONTAINS(msg, path("model.safetensors"));
  EXPECT_CONTAINS(msg, "[2, 2]");
  EXPECT_CONTAINS(msg, "[4, 1]");
}

TEST_F(CheckpointTest, AbsentTensorNamesDirAndTensor) {
  write_checkpoint(dir_, six_tensors());
  CheckpointReader r(dir_);
  std::string msg = error_of([&] { r.info("model.norm.weight"); });
  EXPECT_CONTAINS(msg, dir_);
  EXPECT_CONTAINS(msg, "\"model.norm.weight\"");
  EXPECT_CONTAINS(error_of([&] { r.file_of("x"); }), "\"x\"");
}

TEST_F(CheckpointTest, MissingShardIsNamed) {
  write_checkpoint(dir_, six_tensors(), 40);
  fs::remove(path("model-00002-of-00003.safetensors"));
  std::string msg = error_of([&] { CheckpointReader r(dir_); });
  EXPECT_CONTAINS(msg, path("model-00002-of-00003.safetensors"));
  EXPECT_CONTAINS(msg, "does not exist");
  EXPECT_CONTAINS(msg, "\"t2\"");
}

TEST_F(CheckpointTest, TensorListedInIndexButMissingFromItsShard) {
  write_checkpoint(dir_, six_tensors(), 40);
  json index = read_json("model.safetensors.index.json");
  index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors";
  write_text("model.safetensors.index.json", index.dump());
  std::string msg = error_of([&] { CheckpointReader r(dir_); });
  EXPECT_CONTAINS(msg, "model.safetensors.index.json");
  EXPECT_CONTAINS(msg, "has no tensor \"lm_head.weight\"");
}

TEST_F(CheckpointTest, TotalSizeMustMatchTheTensors) {
  write_checkpoint(dir_, six_tensors(), 40);
  json index = read_json("model.safetensors.index.json");
  index["metadata"]["total_size"] = 100;
  write_text("model.safetensors.index.json", index.dump());
  std::string msg = error_of([&] { CheckpointReader r(dir_); });
  EXPECT_CONTAINS(msg, "model.safetensors.index.json");
  EXPECT_CONTAINS(msg, "total_size is 100");
  EXPECT_CONTAINS(msg, "96 bytes");
}

TEST_F(CheckpointTest, MalformedIndexIsRefused) {
  write_checkpoint(dir_, six_tensors(), 40);
  struct Case {
    std::string text;
    const char* expect;
  };
  const Case cases[] = {
      {"{\"weight_map\": ", "invalid JSON"},
      {"[]", "expected a JSON object"},
      {R"({"metadata": {"total_size": 96}})", "missing required field \"weight_map\""},
      {R"({"weight_map": ["t0"]})", "field \"weight_map\": expected a JSON object"},
      {R"({"weight_map": {"t0": 1}})", "field \"weight_map[\"t0\"]\": expected a shard file name"},
      {R"({"weight_map": {"t0": "../model-00001-of-00003.safetensors"}})", "not a plain file name"},
      {R"({"weight_map": {"t0": "model-00001-of-00003.safetensors"}, "metadata": {"total_size": "16"}})",
       "field \"metadata.total_size\": expected a non-negative integer"},
  };
  for (const Case& c : cases) {
    write_text("model.safetensors.index.json", c.text);
    std::string msg = error_of([&] { CheckpointReader r(dir_); });
    EXPECT_CONTAINS(msg, path("model.safetensors.index.json"));
    EXPECT_CONTAINS(msg, c.expect);
  }
}

TEST_F(CheckpointTest, IndexNumberTooLargeForADoubleIsAnError) {
  write_checkpoint(dir_, six_tensors(), 40);
  write_text("model.safetensors.index.json", R"({"metadata": {"total_size": 1e400}, "weight_map": {}})");
  const std::string msg = error_of([&] { CheckpointReader r(dir_); });
  EXPECT_CONTAINS(msg, path("model.safetensors.index.json") + ": invalid JSON");
  EXPECT_CONTAINS(msg, "1e400");
}

TEST_F(CheckpointTest, DirectoryWithoutACheckpoint) {
  std::string msg = error_of([&] { CheckpointReader r(dir_); });
  EXPECT_CONTAINS(msg, dir_);
  EXPECT_CONTAINS(msg, "model.safetensors");
  EXPECT_CONTAINS(msg, "model.safetensors.index.json");
  msg = error_of([&] { CheckpointReader r(path("absent")); });
  EXPECT_CONTAINS(msg, "does not exist");
}

TEST_F(CheckpointTest, SingleFileWinsOverAnIndexLikeTransformers) {
  write_checkpoint(dir_, six_tensors(), 40);
  std::vector<float> only = {7};
  write_safetensors(path("model.safetensors"), {{"only", DType::F32, {1}, only.data()}});
  CheckpointReader r(dir_);
  EXPECT_EQ(r.tensor_names(), std::vector<std::string>{"only"});
}

TEST_F(CheckpointTest, RewritingShardedAsSingleRemovesTheOldIndexAndShards) {
  write_checkpoint(dir_, six_tensors(), 40);
  write_text("config.json", "{}");
  write_text("adapter_model.safetensors", "unrelated");
  std::vector<float> v = {1, 2, 3, 4};
  write_checkpoint(dir_, {{"new", DType::F32, {2, 2}, v.data()}});
  EXPECT_EQ(files(), (std::set<std::string>{"model.safetensors", "config.json", "adapter_model.safetensors"}));
  EXPECT_EQ(CheckpointReader(dir_).tensor_names(), std::vector<std::string>{"new"});
}

TEST_F(CheckpointTest, RewritingSingleAsShardedRemovesTheOldSingleFile) {
  std::vector<float> v = {1, 2, 3, 4};
  write_checkpoint(dir_, {{"old", DType::F32, {2, 2}, v.data()}});
  write_checkpoint(dir_, six_tensors(), 40);
  EXPECT_FALSE(fs::exists(path("model.safetensors")));
  CheckpointReader r(dir_);
  EXPECT_EQ(r.tensor_names().size(), 6u);
  EXPECT_FALSE(r.contains("old"));
}

TEST_F(CheckpointTest, RewritingWithFewerShardsRemovesTheStaleOnes) {
  write_checkpoint(dir_, six_tensors(), 40);
  std::vector<float> v(4, 5.0f);
  write_checkpoint(dir_, {{"a", DType::F32, {2, 2}, v.data()}, {"b", DType::F32, {2, 2}, v.data()}}, 20);
  EXPECT_EQ(files(), (std::set<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                            "model.safetensors.index.json"}));
  CheckpointReader r(dir_);
  EXPECT_EQ(r.tensor_names(), (std::vector<std::string>{"a", "b"}));
  std::vector<float> out(4);
  r.read_into("b", k2x2, out.data(), DType::F32);
  EXPECT_EQ(out, v);
}

TEST_F(CheckpointTest, CreatesTheDirectory) {
  std::string nested = path("a/b/c");
  write_checkpoint(nested, six_tensors());
  EXPECT_EQ(CheckpointReader(nested).tensor_names().size(), 6u);
}

TEST_F(CheckpointTest, WriterRefusesBadInput) {
  std::vector<float> v = {1};
  std::string msg = error_of([&] {
    write_checkpoint(dir_, {{"a", DType::F32, {1}, v.data()}, {"a", DType::F32, {1}, v.data()}}, 4);
  });
  EXPECT_CONTAINS(msg, dir_);
  EXPECT_CONTAINS(msg, "\"a\" given more than once");
  msg = error_of([&] { write_checkpoint(dir_, {{"n", DType::F32, {-2}, v.data()}}); });
  EXPECT_CONTAINS(msg, "\"n\": negative dimension");
  msg = error_of([&] { write_checkpoint(dir_, {}, 0); });
  EXPECT_CONTAINS(msg, "must be positive");
  EXPECT_TRUE(files().empty());
}

}  // namespace
}  // namespace memtune

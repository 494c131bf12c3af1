// TensorBoard event files (report/tensorboard.h) read back by a decoder written here: a bitwise
// CRC-32C (the writer's is table-driven), TFRecord framing with both masked CRCs checked, and the
// Event / Summary / Value protobuf fields by number and wire type. Anchors from outside: CRC-32C's
// check value for "123456789" and TensorBoard's own RecordWriter's bytes for "hello". Also the
// tags Hugging Face's rewrite_logs gives, its default logging_dir, and --report_to's names.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "options/arguments.h"
#include "report/tensorboard.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_support::error_of;

// ---- the independent decoder --------------------------------------------------------------

uint32_t bitwise_crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const unsigned char c : bytes) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t little_endian(std::string_view bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + static_cast<size_t>(i)]);
  return v;
}

// The records of a TFRecord file, or nullopt (with `why`) when a length or a CRC does not check.
std::optional<std::vector<std::string>> decode_tfrecords(std::string_view file, std::string* why) {
  auto fail = [&](const char* reason) {
    *why = reason;
    return std::optional<std::vector<std::string>>();
  };
  std::vector<std::string> out;
  for (size_t at = 0; at < file.size();) {
    if (file.size() - at < 12) return fail("truncated length");
    const uint64_t length = little_endian(file, at, 8);
    if (little_endian(file, at + 8, 4) != mask(bitwise_crc32c(file.substr(at, 8)))) return fail("length crc");
    if (file.size() - at - 12 < length + 4) return fail("truncated data");
    const std::string_view data = file.substr(at + 12, length);
    if (little_endian(file, at + 12 + length, 4) != mask(bitwise_crc32c(data))) return fail("data crc");
    out.emplace_back(data);
    at += 12 + length + 4;
  }
  return out;
}

struct Field {
  uint32_t number = 0, wire = 0;
  uint64_t integer = 0;  // varint, fixed64 or fixed32 bits
  std::string bytes;     // length-delimited
};

uint64_t read_varint(std::string_view m, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; at < m.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(m[at++]);
    v |= uint64_t{b & 0x7Fu} << shift;
    if (!(b & 0x80)) return v;
  }
  ADD_FAILURE() << "truncated varint";
  return v;
}

std::vector<Field> decode_message(std::string_view m) {
  std::vector<Field> out;
  for (size_t at = 0; at < m.size();) {
    Field f;
    const uint64_t key = read_varint(m, at);
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<uint32_t>(key & 7);
    if (f.wire == 0) {
      f.integer = read_varint(m, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      if (m.size() - at < static_cast<size_t>(n)) {
        ADD_FAILURE() << "truncated fixed field";
        return out;
      }
      f.integer = little_endian(m, at, n);
      at += static_cast<size_t>(n);
    } else if (f.wire == 2) {
      const uint64_t n = read_varint(m, at);
      if (m.size() - at < n) {
        ADD_FAILURE() << "truncated bytes field";
        return out;
      }
      f.bytes = m.substr(at, n);
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.push_back(f);
  }
  return out;
}

// tensorflow's Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary{repeated Value value = 1}), Value{tag = 1 (string), simple_value = 2 (float)}}.
struct DecodedEvent {
  std::optional<double> wall_time;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

DecodedEvent decode_event(std::string_view bytes) {
  DecodedEvent e;
  for (const Field& f : decode_message(bytes)) {
    if (f.number == 1 && f.wire == 1) {
      double d = 0;
      std::memcpy(&d, &f.integer, sizeof d);
      e.wall_time = d;
    } else if (f.number == 2 && f.wire == 0) {
      e.step = static_cast<int64_t>(f.integer);
    } else if (f.number == 3 && f.wire == 2) {
      e.file_version = f.bytes;
    } else if (f.number == 5 && f.wire == 2) {
      for (const Field& value : decode_message(f.bytes)) {
        EXPECT_TRUE(value.number == 1 && value.wire == 2) << "Summary field " << value.number;
        std::pair<std::string, float> v;
        for (const Field& g : decode_message(value.bytes)) {
          if (g.number == 1 && g.wire == 2) {
            v.first = g.bytes;
          } else if (g.number == 2 && g.wire == 5) {
            const auto bits = static_cast<uint32_t>(g.integer);
            std::memcpy(&v.second, &bits, sizeof bits);
          } else {
            ADD_FAILURE() << "Value field " << g.number << " wire " << g.wire;
          }
        }
        e.values.push_back(v);
      }
    } else {
      ADD_FAILURE() << "Event field " << f.number << " wire " << f.wire;
    }
  }
  return e;
}

std::string to_hex(std::string_view bytes) {
  std::string out;
  for (const unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

// ---- the tests ----------------------------------------------------------------------------

TEST(TensorBoard, Crc32cHasItsCheckValue) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // CRC-32C's published check value
  EXPECT_EQ(bitwise_crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(masked_crc32c("123456789"), 0xc78ab0e5u);  // tensorboard's masked_crc32c(b"123456789")
  const std::string bytes = "brain.Event:2 and some more bytes \x01\x02\xff";
  EXPECT_EQ(crc32c(bytes), bitwise_crc32c(bytes));
  EXPECT_EQ(masked_crc32c(bytes), mask(bitwise_crc32c(bytes)));
}

TEST(TensorBoard, RecordFramingReadsBack) {
  // tensorboard.summary.writer.record_writer.RecordWriter(f).write(b"hello"), byte for byte.
  EXPECT_EQ(to_hex(tfrecord("hello")), "0500000000000000eab2043e68656c6c6fbb1f1c19");
  const std::vector<std::string> data = {"", "a", "brain.Event:2", std::string(300, '\x7f'), std::string("\0x\0", 3)};
  std::string file;
  for (const std::string& d : data) file += tfrecord(d);
  std::string why;
  const auto records = decode_tfrecords(file, &why);
  ASSERT_TRUE(records) << why;
  EXPECT_EQ(*records, data);
  // The decoder's checks can fail: a flipped bit in a length, in data, or a cut file.
  for (const size_t at : {size_t{0}, size_t{12}}) {
    std::string broken = tfrecord("abc");
    broken[at] ^= 0x04;
    EXPECT_FALSE(decode_tfrecords(broken, &why)) << at;
  }
  EXPECT_FALSE(decode_tfrecords(file.substr(0, file.size() - 1), &why));
}

TEST(TensorBoard, EventsAreEventProtobufs) {
  const DecodedEvent first = decode_event(file_version_event(1700000000.25));
  EXPECT_EQ(first.wall_time, 1700000000.25);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_TRUE(first.values.empty());
  const std::vector<TensorBoardScalar> scalars = {{"train/loss", 0.5f}, {"eval/loss", -2.25f}, {"train/x", 3e38f}};
  const DecodedEvent e = decode_event(scalars_event(1.5, 300, scalars));  // 300: a two-byte varint
  EXPECT_EQ(e.wall_time, 1.5);
  EXPECT_EQ(e.step, 300);
  EXPECT_TRUE(e.file_version.empty());
  ASSERT_EQ(e.values.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(e.values[i].first, scalars[i].tag);
    EXPECT_EQ(e.values[i].second, scalars[i].value);
  }
  EXPECT_EQ(decode_event(scalars_event(0, int64_t{1} << 40, scalars)).step, int64_t{1} << 40);
}

TEST(TensorBoard, TagsAndScalarsAreHuggingFaces) {
  EXPECT_EQ(tensorboard_tag("loss"), "train/loss");
  EXPECT_EQ(tensorboard_tag("eval_loss"), "eval/loss");
  EXPECT_EQ(tensorboard_tag("eval_label_accuracy"), "eval/label_accuracy");
  EXPECT_EQ(tensorboard_tag("test_loss"), "test/loss");
  EXPECT_EQ(tensorboard_tag("evaluation"), "train/evaluation");
  const json record = {{"loss", 1.0000001},     {"eval_tokens", 67},         {"phase_clock", "host"},
                       {"learning_rate", 1e-3}, {"big", int64_t{1} << 40}, {"flag", true}};
  std::vector<TensorBoardScalar> got = tensorboard_scalars(record);
  std::sort(got.begin(), got.end(), [](const auto& a, const auto& b) { return a.tag < b.tag; });
  const std::vector<std::pair<std::string, float>> want = {{"eval/tokens", 67.0f},
                                                           {"train/big", 1099511627776.0f},
                                                           {"train/flag", 1.0f},
                                                           {"train/learning_rate", 1e-3f},
                                                           {"train/loss", 1.0000001f}};
  ASSERT_EQ(got.size(), want.size()) << "strings are not scalars";
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tag, want[i].first);
    EXPECT_EQ(got[i].value, want[i].second) << got[i].tag;
  }
}

TEST(TensorBoard, WriterWritesAFlushedEventFile) {
  const fs::path dir = testing_support::make_temp_dir("tensorboard_test") / "runs" / "a";
  const auto before = static_cast<int64_t>(std::time(nullptr));
  TensorBoardWriter writer(dir.string());  // creates the directory and its parents
  writer.add_scalars(7, std::vector<TensorBoardScalar>{{"train/loss", 2.5f}, {"train/epoch", 0.25f}});
  writer.add_scalars(8, {});  // nothing to write
  writer.add_scalars(9, std::vector<TensorBoardScalar>{{"eval/loss", 3.0f}});
  const auto after = static_cast<int64_t>(std::time(nullptr));
  EXPECT_EQ(writer.path().parent_path(), dir);
  const std::string name = writer.path().filename().string();
  std::smatch m;
  ASSERT_TRUE(std::regex_match(name, m, std::regex(R"(events\.out\.tfevents\.(\d{10})\.(.+)\.(\d+)\.0)"))) << name;
  EXPECT_GE(std::stoll(m[1]), before);
  EXPECT_LE(std::stoll(m[1]), after);
  EXPECT_EQ(m[2], host_name());
  EXPECT_EQ(std::stoll(m[3]), getpid());
  // Read while the writer is open: every event is flushed as it is written.
  std::string why;
  const auto records = decode_tfrecords(testing_support::read_text(writer.path()), &why);
  ASSERT_TRUE(records) << why;
  ASSERT_EQ(records->size(), 3u);
  const DecodedEvent version = decode_event((*records)[0]);
  EXPECT_EQ(version.file_version, "brain.Event:2");
  ASSERT_TRUE(version.wall_time);
  EXPECT_GE(*version.wall_time, static_cast<double>(before));
  EXPECT_LE(*version.wall_time, static_cast<double>(after + 1));
  const DecodedEvent step7 = decode_event((*records)[1]), step9 = decode_event((*records)[2]);
  EXPECT_EQ(step7.step, 7);
  EXPECT_EQ(step7.values, (std::vector<std::pair<std::string, float>>{{"train/loss", 2.5f}, {"train/epoch", 0.25f}}));
  EXPECT_EQ(step9.step, 9);
  EXPECT_EQ(step9.values, (std::vector<std::pair<std::string, float>>{{"eval/loss", 3.0f}}));
  fs::remove_all(dir.parent_path().parent_path());
}

TEST(TensorBoard, DefaultLoggingDirIsHuggingFaces) {
  std::tm t{};
  t.tm_year = 2026 - 1900;
  t.tm_mon = 2;
  t.tm_mday = 7;
  t.tm_hour = 9;
  t.tm_min = 5;
  t.tm_sec = 3;
  t.tm_isdst = -1;
  EXPECT_EQ(default_logging_dir("out/run", std::mktime(&t)), "out/run/runs/Mar07_09-05-03_" + host_name());
  t.tm_mon = 11;
  t.tm_mday = 31;
  t.tm_hour = 23;
  EXPECT_EQ(default_logging_dir("/o", std::mktime(&t)), "/o/runs/Dec31_23-05-03_" + host_name());
}

TEST(TensorBoard, ReportToTakesHuggingFacesNames) {
  EXPECT_FALSE(parse_report_to({}).tensorboard) << "memtune's default writes nothing";
  EXPECT_FALSE(parse_report_to({"none"}).tensorboard);
  EXPECT_FALSE(parse_report_to({""}).tensorboard) << "an empty list in a config file";
  EXPECT_TRUE(parse_report_to({"tensorboard"}).tensorboard);
  EXPECT_TRUE(parse_report_to({"all"}).tensorboard);
  EXPECT_EQ(report_to_note(parse_report_to({"tensorboard"})), "");
  const ReportTo wandb = parse_report_to({"wandb"});
  EXPECT_FALSE(wandb.tensorboard);
  EXPECT_EQ(report_to_note(wandb),
            "memtune: note: --report_to wandb: memtune writes tensorboard event files only; wandb is not written");
  const ReportTo several = parse_report_to({"mlflow", "tensorboard", "wandb", "mlflow"});
  EXPECT_TRUE(several.tensorboard);
  EXPECT_EQ(several.not_written, (std::vector<std::string>{"mlflow", "wandb"}));
  EXPECT_EQ(report_to_note(several),
            "memtune: note: --report_to mlflow tensorboard wandb mlflow: memtune writes tensorboard event files only; "
            "mlflow, wandb are not written");
  for (const char* name : {"azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "mlflow",
                           "neptune", "swanlab", "wandb"})
    EXPECT_EQ(parse_report_to({name}).not_written, std::vector<std::string>{name});

  const std::string bad = error_of([] { parse_report_to({"wandb", "tensorbord"}); });
  EXPECT_CONTAINS(bad, "--report_to tensorbord");
  for (const char* valid : {"none", "all", "tensorboard", "wandb", "mlflow", "swanlab"}) EXPECT_CONTAINS(bad, valid);
  EXPECT_CONTAINS(error_of([] { parse_report_to({"TensorBoard"}); }), "TensorBoard") << "names are exact, as in HF";
  EXPECT_CONTAINS(error_of([] { parse_report_to({"none", "tensorboard"}); }), "none stands alone");
  EXPECT_CONTAINS(error_of([] { parse_report_to({"tensorboard", "all"}); }), "all stands alone");
  // validate_training_arguments refuses it before anything else.
  TrainingArguments args;
  args.report_to = {"tensorbord"};
  EXPECT_CONTAINS(error_of([&] { validate_training_arguments(args); }), "--report_to tensorbord");
}

}  // namespace
}  // namespace memtune

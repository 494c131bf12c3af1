#include "report/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace memtune {

namespace {

constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}

// Protobuf's wire format, the four field kinds an Event needs.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7F) | 0x80));
  out.push_back(static_cast<char>(v));
}

void put_little_endian(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (uint64_t{field} << 3) | type); }

void put_double(std::string& out, uint32_t field, double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed64);
  put_little_endian(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed32);
  put_little_endian(out, bits, 4);
}

void put_int64(std::string& out, uint32_t field, int64_t value) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(value));  // two's complement, as protobuf encodes int64
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2;

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  static constexpr std::array<uint32_t, 256> kTable = crc32c_table();
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : bytes) crc = (crc >> 8) ^ kTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF];
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string length;
  put_little_endian(length, data.size(), 8);
  std::string out = length;
  put_little_endian(out, masked_crc32c(length), 4);
  out.append(data);
  put_little_endian(out, masked_crc32c(data), 4);
  return out;
}

std::string file_version_event(double wall_time) {
  std::string event;
  put_double(event, kEventWallTime, wall_time);
  put_bytes(event, kEventFileVersion, "brain.Event:2");
  return event;
}

std::string scalars_event(double wall_time, int64_t step, std::span<const TensorBoardScalar> scalars) {
  std::string summary;
  for (const TensorBoardScalar& s : scalars) {
    std::string value;
    put_bytes(value, kValueTag, s.tag);
    put_float(value, kValueSimpleValue, s.value);
    put_bytes(summary, kSummaryValue, value);
  }
  std::string event;
  put_double(event, kEventWallTime, wall_time);
  put_int64(event, kEventStep, step);
  put_bytes(event, kEventSummary, summary);
  return event;
}

std::string tensorboard_tag(std::string_view key) {
  if (key.starts_with("eval_")) return fmt::format("eval/{}", key.substr(5));
  if (key.starts_with("test_")) return fmt::format("test/{}", key.substr(5));
  return fmt::format("train/{}", key);
}

std::vector<TensorBoardScalar> tensorboard_scalars(const nlohmann::json& record) {
  std::vector<TensorBoardScalar> out;
  for (const auto& [key, value] : record.items()) {
    // Python's float(), then float32: what SummaryWriter.add_scalar stores as simple_value.
    if (value.is_number()) out.push_back({tensorboard_tag(key), static_cast<float>(value.get<double>())});
    if (value.is_boolean()) out.push_back({tensorboard_tag(key), value.get<bool>() ? 1.0f : 0.0f});
  }
  return out;
}

std::string host_name() {
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0) return "localhost";
  return name.data();
}

std::string default_logging_dir(const std::string& output_dir, std::time_t now) {
  // datetime.now().strftime("%b%d_%H-%M-%S") under Python's default C locale.
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  std::tm t{};
  localtime_r(&now, &t);
  const std::string name = fmt::format("{}{:02}_{:02}-{:02}-{:02}_{}", kMonths[t.tm_mon], t.tm_mday, t.tm_hour,
                                       t.tm_min, t.tm_sec, host_name());
  return (std::filesystem::path(output_dir) / "runs" / name).string();
}

TensorBoardWriter::TensorBoardWriter(const std::string& logging_dir) {
  create_directory(logging_dir, "--logging_dir");
  const double now = wall_time_now();
  path_ = std::filesystem::path(logging_dir) / fmt::format("events.out.tfevents.{:010d}.{}.{}.0",
                                                           static_cast<int64_t>(now), host_name(), getpid());
  file_.open(path_, std::ios::binary | std::ios::app);
  if (!file_) throw Error(fmt::format("--logging_dir {}: cannot write {}", logging_dir, path_.string()));
  write_record(file_version_event(now));
}

void TensorBoardWriter::add_scalars(int64_t step, std::span<const TensorBoardScalar> scalars) {
  if (scalars.empty()) return;
  write_record(scalars_event(wall_time_now(), step, scalars));
}

void TensorBoardWriter::write_record(std::string_view event) {
  const std::string record = tfrecord(event);
  file_.write(record.data(), static_cast<std::streamsize>(record.size()));
  file_.flush();
  if (!file_) throw Error(fmt::format("{}: cannot write the TensorBoard event file", path_.string()));
}

}  // namespace memtune

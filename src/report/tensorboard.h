// TensorBoard event files for `memtune train --report_to tensorboard`, written as Hugging Face's
// TensorBoardCallback (through torch's SummaryWriter) writes them, so TensorBoard shows a memtune
// run beside a Trainer run: the same file name, the same tags (train/loss, eval/loss, ...), one
// float32 simple_value per logged number at the global step.
//
// The format is small enough to write by hand, without protobuf or TensorFlow: a file is a
// sequence of TFRecords (uint64 little-endian length, masked CRC-32C of those 8 bytes, the data,
// masked CRC-32C of the data), each holding one serialized Event protobuf. The first Event carries
// file_version "brain.Event:2"; each logged step adds Event{wall_time, step, Summary{Value{tag,
// simple_value}...}}. Every event is flushed when written, so a killed run keeps what it logged.
#pragma once

#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace memtune {

// CRC-32C (Castagnoli polynomial, reflected), and TFRecord's mask of it:
// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(std::string_view bytes);
uint32_t masked_crc32c(std::string_view bytes);

// One TFRecord around `data`.
std::string tfrecord(std::string_view data);

struct TensorBoardScalar {
  std::string tag;
  float value = 0;
};

// Serialized Event protobufs: the file's first one, and one of scalars at a step.
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, std::span<const TensorBoardScalar> scalars);

// Hugging Face's rewrite_logs: a log key eval_X becomes eval/X, test_X test/X, anything else train/X.
std::string tensorboard_tag(std::string_view log_key);

// The scalars of one log record, as TensorBoardCallback.on_log takes them: every number (and
// boolean, a number in Python) under its tag, in the record's key order. Strings are not scalars.
std::vector<TensorBoardScalar> tensorboard_scalars(const nlohmann::json& record);

// Hugging Face's default logging_dir (TrainingArguments, from torch's SummaryWriter):
// output_dir/runs/<Mon><DD>_<HH>-<MM>-<SS>_<hostname>, in local time, English month names.
std::string default_logging_dir(const std::string& output_dir, std::time_t now);

// This machine's host name, as the event file and the default logging_dir name it.
std::string host_name();

// One event file, events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>.0 in
// logging_dir (created with its parents), opened with the file_version event.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& logging_dir);
  // Appends one Event of `scalars` at `step` (none: nothing is written) and flushes it.
  void add_scalars(int64_t step, std::span<const TensorBoardScalar> scalars);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(std::string_view event);

  std::filesystem::path path_;
  std::ofstream file_;
};

}  // namespace memtune

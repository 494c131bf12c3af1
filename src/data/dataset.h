// A tokenized training set held compactly: every example's input_ids and unshifted labels
// (-100 where no loss is taken) back to back in two flat int32 arrays with offsets, so memory is
// the token ids and nothing of the JSON. load_dataset streams a JSONL file line by line, parses
// and tokenizes a block of lines on all cores, and appends the results in file order, so the
// dataset is identical whatever the thread count.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/jsonl.h"
#include "data/formats.h"

namespace memtune {

class Tokenizer;

// What happens to an example longer than max_length (ms-swift's truncation_strategy).
enum class TruncationStrategy {
  Delete,  // drop it (counted in deleted_too_long)
  Left,    // keep its last max_length tokens
  Right,   // keep its first max_length tokens
};
// "delete" | "left" | "right".
TruncationStrategy parse_truncation_strategy(std::string_view name);
std::string_view truncation_strategy_name(TruncationStrategy strategy);

struct DataOptions {
  int64_t max_length = 0;  // 0: no limit
  TruncationStrategy truncation_strategy = TruncationStrategy::Delete;
  // Take the loss on every token, the prompt (system, user, template markup) included.
  bool train_on_prompt = false;
  // Skip lines that fail to parse or validate (counted, first reasons kept) instead of stopping.
  bool skip_bad_lines = false;
  // Record format; unset: detected from the keys of the first JSON object in the file.
  std::optional<DataFormat> format;
  // Chat template name (qwen2_5 | chatml | plain); empty: detected from the tokenizer.
  std::string chat_template;
  RecordOptions record;
  // Lines parsed and tokenized together, in parallel; bounds the memory of a block's text.
  size_t block_lines = 2048;
};

struct DatasetCounts {
  int64_t lines = 0;                          // non-blank lines read
  int64_t dropped_no_targets = 0;             // kept no token to take the loss on (after truncation)
  int64_t truncated = 0;                      // kept, cut to max_length (strategies left and right)
  int64_t deleted_too_long = 0;               // longer than max_length (strategy delete)
  int64_t bad_lines = 0;                      // skipped with skip_bad_lines
  std::vector<std::string> bad_line_reasons;  // the first kMaxBadLineReasons, "FILE:LINE: what"
  static constexpr size_t kMaxBadLineReasons = JsonlReader::kMaxBadLineReasons;
};

class Dataset {
 public:
  size_t size() const { return offsets_.size() - 1; }
  bool empty() const { return size() == 0; }
  std::span<const int32_t> input_ids(size_t i) const { return {ids_.data() + offsets_[i], length(i)}; }
  std::span<const int32_t> labels(size_t i) const { return {labels_.data() + offsets_[i], length(i)}; }
  size_t length(size_t i) const { return static_cast<size_t>(offsets_[i + 1] - offsets_[i]); }
  int64_t num_tokens() const { return offsets_.back(); }
  // Tokens that are a loss target: labels[t] != -100 for t >= 1 (the model predicts token t
  // from position t-1, so the first label of an example is never a target).
  int64_t num_targets(size_t i) const;
  int64_t num_targets() const;
  // Length of the longest example, 0 when empty.
  int64_t max_length() const;

  // Appends an example; ids and labels have the same length.
  void add(std::span<const int32_t> input_ids, std::span<const int32_t> labels);

  const DatasetCounts& counts() const { return counts_; }
  DatasetCounts& counts() { return counts_; }
  // The record format the file was read as (nullopt for a dataset built in code or an empty file).
  const std::optional<DataFormat>& format() const { return format_; }
  void set_format(DataFormat format) { format_ = format; }

 private:
  std::vector<int32_t> ids_, labels_;
  std::vector<int64_t> offsets_{0};
  DatasetCounts counts_;
  std::optional<DataFormat> format_;
};

// Reads a JSONL file (one JSON object per line; blank lines ignored; a UTF-8 byte order mark is
// skipped). A bad line is an Error "FILE:LINE: what was expected" unless skip_bad_lines.
Dataset load_dataset(const std::string& path, const Tokenizer& tokenizer, const DataOptions& options);
// The same from a stream; `source` names it in messages.
Dataset load_dataset(std::istream& in, const std::string& source, const Tokenizer& tokenizer,
                     const DataOptions& options);

}  // namespace memtune

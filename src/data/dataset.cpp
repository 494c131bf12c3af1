// Loading a JSONL dataset (see dataset.h). A block of lines is parsed, rendered and tokenized in
// parallel into per-line results; the results are then applied in file order (append, count,
// or report), so the dataset and the first error reported do not depend on the thread count.
#include "data/dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <exception>
#include <istream>

#include "core/error.h"
#include "core/json_reader.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

namespace {

using nlohmann::json;

constexpr std::array<std::pair<std::string_view, TruncationStrategy>, 3> kStrategyNames{{
    {"delete", TruncationStrategy::Delete},
    {"left", TruncationStrategy::Left},
    {"right", TruncationStrategy::Right},
}};

// The outcome of one line, computed in parallel and applied in order.
struct LineResult {
  enum class Kind { Example, Bad, TooLong, NoTargets } kind = Kind::Example;
  bool truncated = false;
  std::vector<int32_t> ids, labels;
  std::string error;            // Bad: what was expected, without the location
  std::exception_ptr internal;  // a failure that is not the line's fault, rethrown in order
};

// Parses a line as a JSON object, or says what is wrong with it.
std::optional<json> parse_object(const std::string& text, std::string& error) {
  std::optional<json> value = parse_json_line(text, error);
  if (value && !value->is_object()) {
    error = fmt::format("expected one JSON object per line (JSON Lines), got {}", value->type_name());
    return std::nullopt;
  }
  return value;
}

// Turns lines into examples; everything that is fixed for the file is resolved once here.
class ExampleBuilder {
 public:
  ExampleBuilder(const Tokenizer& tokenizer, const DataOptions& options) : tokenizer_(tokenizer), options_(options) {
    if (options.max_length < 0) throw Error(fmt::format("max_length must be >= 0, got {}", options.max_length));
    if (options.record.prompt_template.find("{text}") == std::string::npos)
      throw Error(
          fmt::format("prompt_template \"{}\" must contain the placeholder {{text}}", options.record.prompt_template));
  }

  bool has_format() const { return format_.has_value(); }

  // Fixes the record format and resolves what it needs: the chat template, the eos token.
  void set_format(DataFormat format) {
    format_ = format;
    if (format == DataFormat::Tokens) return;  // ids as they are: no template, no eos
    const bool needs_eos = format == DataFormat::Text;
    if (format != DataFormat::Text)
      template_ = resolve_chat_template(options_.chat_template, tokenizer_, "tokenizer_config.json");
    if (needs_eos || template_ == ChatTemplate::Plain) {
      const std::optional<int32_t> eos = tokenizer_.eos_token_id();
      if (!eos)
        throw Error(fmt::format("the tokenizer has no eos_token (tokenizer_config.json), which the {} needs",
                                needs_eos ? "text format" : "plain template"));
      eos_ = *eos;
      eos_text_ = tokenizer_.decode(std::span<const int32_t>(&eos_, 1));
    }
  }

  void build(const JsonlLine& line, LineResult& out) const {
    try {
      std::optional<json> object = parse_object(line.text, out.error);
      if (!object) {
        out.kind = LineResult::Kind::Bad;
        return;
      }
      MT_ASSERT(format_.has_value(), "a JSON object was seen before the format was fixed");
      Record record = parse_record(*object, *format_, options_.record);
      if (record.is_tokens) {
        const int64_t vocab = tokenizer_.vocab_size();
        for (const auto& [field, ids] : {std::pair{"input_ids", &record.ids}, std::pair{"labels", &record.labels}})
          for (const int32_t id : *ids)
            if (id >= vocab) throw Error(fmt::format("{}: {} is not below the tokenizer's {} ids", field, id, vocab));
        out.ids = std::move(record.ids);
        out.labels = std::move(record.labels);
      } else if (record.is_text) {
        tokenizer_.encode(record.text, out.ids, /*add_special_tokens=*/true);
        out.ids.push_back(eos_);
        out.labels = out.ids;
      } else {
        RenderOptions render;
        render.train_on_prompt = options_.train_on_prompt;
        render.eos_token = eos_text_;
        // Segment by segment, not the whole text as prompts are (tokenizer/chat_template.h says why).
        encode_segments(tokenizer_, render_chat(*template_, record.messages, render), out.ids, out.labels);
      }
      limit_length(out);
    } catch (const Error& e) {
      out.kind = LineResult::Kind::Bad;
      out.error = e.what();
    } catch (const json::exception& e) {
      out.kind = LineResult::Kind::Bad;
      out.error = json_error_text(e);
    } catch (...) {
      out.internal = std::current_exception();
    }
  }

 private:
  void limit_length(LineResult& out) const {
    const size_t max = static_cast<size_t>(options_.max_length);
    if (max > 0 && out.ids.size() > max) {
      switch (options_.truncation_strategy) {
        case TruncationStrategy::Delete:
          out.kind = LineResult::Kind::TooLong;
          return;
        case TruncationStrategy::Left:
          out.ids.erase(out.ids.begin(), out.ids.end() - static_cast<std::ptrdiff_t>(max));
          out.labels.erase(out.labels.begin(), out.labels.end() - static_cast<std::ptrdiff_t>(max));
          break;
        case TruncationStrategy::Right:
          out.ids.resize(max);
          out.labels.resize(max);
          break;
      }
      out.truncated = true;
    }
    if (std::none_of(out.labels.begin() + std::min<size_t>(1, out.labels.size()), out.labels.end(),
                     [](int32_t l) { return l != kIgnoreIndex; }))
      out.kind = LineResult::Kind::NoTargets;
  }

  const Tokenizer& tokenizer_;
  const DataOptions& options_;
  std::optional<DataFormat> format_;
  std::optional<ChatTemplate> template_;
  int32_t eos_ = 0;
  std::string eos_text_;
};

// Fixes the format from the first JSON object among the block's lines (or the option). A block
// without any object leaves it open: its lines are all bad and reported as such.
void fix_format(ExampleBuilder& builder, const std::vector<JsonlLine>& block, const std::string& source,
                const DataOptions& options, Dataset& dataset) {
  if (options.format) {
    builder.set_format(*options.format);
    dataset.set_format(*options.format);
    return;
  }
  for (const JsonlLine& line : block) {
    std::string error;
    std::optional<json> object = parse_object(line.text, error);
    if (!object) continue;
    std::optional<DataFormat> format = detect_data_format(*object);
    if (!format) {
      std::string keys;
      for (const auto& item : object->items()) keys += (keys.empty() ? "" : ", ") + item.key();
      throw Error(fmt::format("{}:{}: cannot tell the record format from the keys [{}]: expected {}; or pass --format",
                              source, line.number, keys, data_format_keys_help()));
    }
    builder.set_format(*format);
    dataset.set_format(*format);
    return;
  }
}

void apply(LineResult& result, const JsonlLine& line, JsonlReader& reader, Dataset& dataset) {
  if (result.internal) std::rethrow_exception(result.internal);
  DatasetCounts& counts = dataset.counts();
  switch (result.kind) {
    case LineResult::Kind::Bad:
      reader.bad_line(line.number, result.error);
      return;
    case LineResult::Kind::TooLong:
      ++counts.deleted_too_long;
      return;
    case LineResult::Kind::NoTargets:
      ++counts.dropped_no_targets;
      return;
    case LineResult::Kind::Example:
      dataset.add(result.ids, result.labels);
      if (result.truncated) ++counts.truncated;
      return;
  }
}

Dataset read_dataset(JsonlReader& reader, const Tokenizer& tokenizer, const DataOptions& options) {
  ExampleBuilder builder(tokenizer, options);
  Dataset dataset;
  const size_t block_size = std::max<size_t>(options.block_lines, 1);
  std::vector<JsonlLine> block;
  std::vector<LineResult> results;
  JsonlLine line;
  bool more = true;
  while (more) {
    block.clear();
    while (block.size() < block_size && (more = reader.next_line(line))) block.push_back(std::move(line));
    if (block.empty()) break;
    dataset.counts().lines += static_cast<int64_t>(block.size());
    if (!builder.has_format()) fix_format(builder, block, reader.source(), options, dataset);

    results.assign(block.size(), LineResult{});
    const int64_t n = static_cast<int64_t>(block.size());
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t i = 0; i < n; ++i) builder.build(block[i], results[i]);
    for (size_t i = 0; i < block.size(); ++i) apply(results[i], block[i], reader, dataset);
  }
  dataset.counts().bad_lines = reader.bad_lines();
  dataset.counts().bad_line_reasons = reader.bad_line_reasons();
  return dataset;
}

BadLines bad_line_policy(const DataOptions& options) {
  return options.skip_bad_lines ? BadLines::Skip : BadLines::Stop;
}

}  // namespace

TruncationStrategy parse_truncation_strategy(std::string_view name) {
  for (const auto& [n, s] : kStrategyNames)
    if (n == name) return s;
  throw Error(fmt::format("unknown truncation_strategy \"{}\": expected delete, left or right", name));
}

std::string_view truncation_strategy_name(TruncationStrategy strategy) {
  for (const auto& [n, s] : kStrategyNames)
    if (s == strategy) return n;
  throw InternalError("truncation strategy without a name");
}

int64_t Dataset::num_targets(size_t i) const {
  const std::span<const int32_t> l = labels(i);
  if (l.empty()) return 0;
  return std::count_if(l.begin() + 1, l.end(), [](int32_t v) { return v != kIgnoreIndex; });
}

int64_t Dataset::num_targets() const {
  int64_t total = 0;
  for (size_t i = 0; i < size(); ++i) total += num_targets(i);
  return total;
}

int64_t Dataset::max_length() const {
  size_t longest = 0;
  for (size_t i = 0; i < size(); ++i) longest = std::max(longest, length(i));
  return static_cast<int64_t>(longest);
}

void Dataset::add(std::span<const int32_t> input_ids, std::span<const int32_t> labels) {
  MT_ASSERT(input_ids.size() == labels.size());
  ids_.insert(ids_.end(), input_ids.begin(), input_ids.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
  offsets_.push_back(static_cast<int64_t>(ids_.size()));
}

Dataset load_dataset(const std::string& path, const Tokenizer& tokenizer, const DataOptions& options) {
  JsonlReader reader(path, bad_line_policy(options));
  return read_dataset(reader, tokenizer, options);
}

Dataset load_dataset(std::istream& in, const std::string& source, const Tokenizer& tokenizer,
                     const DataOptions& options) {
  JsonlReader reader(in, source, bad_line_policy(options));
  return read_dataset(reader, tokenizer, options);
}

}  // namespace memtune

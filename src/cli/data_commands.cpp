// `memtune tokenize` and `memtune data stats`: the tokenizer and the data pipeline from the
// command line, to check what a model will see before training on it.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/jsonl.h"
#include "data/dataset.h"
#include "data/formats.h"
#include "data/stats.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace memtune::cli {

namespace {

using nlohmann::json;

// One input line to one output line; the line's failures are reported as FILE:LINE.
struct TokenizeMode {
  const Tokenizer& tokenizer;
  bool add_special_tokens = false;
  bool decode = false;
  std::optional<ChatTemplate> chat;  // set with --chat
  std::string eos_text;              // the plain template's eos

  std::string run(const std::string& line) const {
    std::string error;
    const std::optional<json> parsed = parse_json_line(line, error);
    if (!parsed)
      throw Error(fmt::format("{}; expected {}", error,
                              decode ? "an array of token ids"
                              : chat ? "{\"messages\": [...]}"
                                     : "a JSON string"));
    const json& value = *parsed;
    if (decode) {
      if (!value.is_array()) throw Error(fmt::format("expected an array of token ids, got {}", value.type_name()));
      std::vector<int32_t> ids;
      for (const json& id : value) {
        if (!id.is_number_integer()) throw Error(fmt::format("expected integer token ids, got {}", id.dump()));
        const auto v = id.get<int64_t>();
        if (v < 0 || v >= tokenizer.vocab_size())
          throw Error(fmt::format("token id {} is outside the vocabulary [0, {})", v, tokenizer.vocab_size()));
        ids.push_back(static_cast<int32_t>(v));
      }
      return json(tokenizer.decode(ids)).dump(-1, ' ', false, json::error_handler_t::replace);
    }
    std::vector<int32_t> ids;
    if (chat) {
      if (!value.is_object() || !value.contains("messages"))
        throw Error("expected an object {\"messages\": [...]} (--chat)");
      const std::vector<ChatMessage> messages = parse_messages(JsonReader(value, "").get("messages"));
      validate_conversation(messages, /*require_final_assistant=*/false);
      RenderOptions render;
      render.add_generation_prompt = messages.back().role != "assistant";
      render.eos_token = eos_text;
      if (value.contains("enable_thinking")) {  // Qwen3's template argument
        if (!value["enable_thinking"].is_boolean()) throw Error("\"enable_thinking\" must be true or false");
        render.enable_thinking = value["enable_thinking"].get<bool>();
      }
      ids = encode_chat_text(tokenizer, render_chat(*chat, messages, render));
    } else {
      if (!value.is_string()) throw Error(fmt::format("expected a JSON string, got {}", value.type_name()));
      tokenizer.encode(value.get<std::string>(), ids, add_special_tokens);
    }
    return json(ids).dump();
  }
};

}  // namespace

Action add_tokenize(CLI::App& app) {
  struct Args {
    std::string tokenizer, chat_template, input;
    bool add_special_tokens = false, chat = false, decode = false;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--tokenizer", args->tokenizer, "directory with tokenizer.json (and tokenizer_config.json)")
      ->required();
  auto* special = app.add_flag("--add_special_tokens", args->add_special_tokens,
                               "apply the tokenizer's post-processor (e.g. a BOS token; Qwen2 adds none)");
  auto* chat = app.add_flag("--chat", args->chat,
                            "lines are {\"messages\": [...]} (and optionally \"enable_thinking\": false for Qwen3), "
                            "rendered with the chat template (with the generation prompt unless the last message is "
                            "the assistant's)");
  auto* tmpl =
      app.add_option("--template", args->chat_template,
                     "chat template: qwen2_5 | chatml | plain | qwen3 | llama3 (default: detected from the tokenizer)");
  app.add_option("--input", args->input, "JSONL input file (default: standard input)");
  auto* decode = app.add_flag("--decode", args->decode, "lines are arrays of ids; print the decoded text");
  tmpl->needs(chat);
  chat->excludes(decode);
  special->excludes(chat);
  special->excludes(decode);
  return [args] {
    const Tokenizer tokenizer = Tokenizer::load(args->tokenizer);
    TokenizeMode mode{tokenizer, args->add_special_tokens, args->decode, std::nullopt, ""};
    if (args->chat) {
      mode.chat = resolve_chat_template(args->chat_template, tokenizer, args->tokenizer + "/tokenizer_config.json");
      if (*mode.chat == ChatTemplate::Plain) {
        const std::optional<int32_t> eos = tokenizer.eos_token_id();
        if (!eos)
          throw Error(
              fmt::format("{}: the tokenizer has no eos_token, which the plain template needs", args->tokenizer));
        const int32_t id = *eos;
        mode.eos_text = tokenizer.decode(std::span<const int32_t>(&id, 1));
      }
    }
    std::ifstream file;
    if (!args->input.empty()) {
      file.open(args->input, std::ios::binary);
      if (!file) throw Error(fmt::format("{}: cannot open the input file", args->input));
    }
    std::istream& in = args->input.empty() ? std::cin : file;
    const std::string source = args->input.empty() ? "<stdin>" : args->input;
    JsonlReader reader(in, source);
    for (JsonlLine line; reader.next_line(line);) {  // blank lines give no output
      try {
        std::cout << mode.run(line.text) << '\n';
      } catch (const Error& e) {
        reader.bad_line(line.number, e.what());
      }
    }
    std::cout.flush();
  };
}

Action add_data_stats(CLI::App& app) {
  struct Args {
    std::string tokenizer, file, format, chat_template, system, prompt_template = "{text}";
    int64_t max_length = 0;
    bool train_on_prompt = false, skip_bad_lines = false, json = false;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--tokenizer", args->tokenizer, "directory with tokenizer.json (and tokenizer_config.json)")
      ->required();
  app.add_option("--file", args->file, "JSONL data file")->required();
  app.add_option("--max_length", args->max_length, "report how many examples are longer than this")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--format", args->format,
                 "messages | sharegpt | alpaca | query_response | text | classification (default: from the keys)");
  app.add_option("--template", args->chat_template, "chat template: qwen2_5 | chatml | plain (default: detected)");
  auto* system = app.add_option("--system", args->system, "system message for records without one");
  app.add_option("--prompt_template", args->prompt_template, "classification: the user message, with {text}")
      ->capture_default_str();
  app.add_flag("--train_on_prompt", args->train_on_prompt, "count prompt tokens as trainable");
  app.add_flag("--skip_bad_lines", args->skip_bad_lines, "skip lines that fail to parse (counted) instead of stopping");
  app.add_flag("--json", args->json,
               "print JSON: file, format, dropped_no_targets, bad_lines, bad_line_reasons and the keys of "
               "length_stats_to_json (src/data/stats.h)");
  return [args, system] {
    const Tokenizer tokenizer = Tokenizer::load(args->tokenizer);
    DataOptions options;
    options.train_on_prompt = args->train_on_prompt;
    options.skip_bad_lines = args->skip_bad_lines;
    if (!args->format.empty()) options.format = parse_data_format(args->format);
    options.chat_template = args->chat_template;
    if (system->count() > 0) options.record.system = args->system;
    options.record.prompt_template = args->prompt_template;
    // Loaded without a length limit: the statistics are about the full lengths.
    const Dataset dataset = load_dataset(args->file, tokenizer, options);
    const LengthStats stats = compute_length_stats(dataset, args->max_length);
    const DatasetCounts& counts = dataset.counts();
    const std::string format = dataset.format() ? std::string(data_format_name(*dataset.format())) : "unknown";

    if (args->json) {
      json doc = length_stats_to_json(stats);
      doc["file"] = args->file;
      doc["format"] = format;
      doc["dropped_no_targets"] = counts.dropped_no_targets;
      doc["bad_lines"] = counts.bad_lines;
      doc["bad_line_reasons"] = counts.bad_line_reasons;
      if (format == "classification") {
        const LabelCounts labels = count_labels(args->file);
        doc["labels"] = labels.counts;
        doc["majority_label"] = labels.majority;
        doc["majority_baseline"] = labels.majority_share;
      }
      std::cout << doc.dump(2, ' ', false, json::error_handler_t::replace) << '\n';
      return;
    }
    std::cout << fmt::format("{}: {} examples (format {}), {} dropped without a loss target, {} bad lines skipped\n",
                             args->file, stats.num_examples, format, counts.dropped_no_targets, counts.bad_lines);
    for (const std::string& reason : counts.bad_line_reasons) std::cout << "  skipped " << reason << '\n';
    if (stats.num_examples == 0) return;
    std::cout << fmt::format("tokens: {} total, {} loss targets ({:.1f}% trainable)\n", stats.total_tokens,
                             stats.target_tokens, 100.0 * stats.trainable_share);
    std::cout << fmt::format("length: min {}  mean {:.1f}  p50 {}  p90 {}  p95 {}  p99 {}  max {}\n", stats.min,
                             stats.mean, stats.p50, stats.p90, stats.p95, stats.p99, stats.max);
    int64_t most = 1;
    for (const auto& bin : stats.histogram) most = std::max(most, bin.count);
    std::cout << "histogram of lengths:\n";
    for (const auto& bin : stats.histogram) {
      std::string line = fmt::format("  [{:>7}, {:>7})  {:>9}", bin.lo, bin.hi, bin.count);
      if (bin.count > 0)
        line += "  " + std::string(static_cast<size_t>(std::max<int64_t>(1, 40 * bin.count / most)), '#');
      std::cout << line << '\n';
    }
    if (stats.max_length > 0)
      std::cout << fmt::format(
          "max_length {}: {} examples longer ({:.2f}%): deleted with truncation_strategy delete, cut with left/right\n",
          stats.max_length, stats.over_max_length, 100.0 * stats.over_max_length / stats.num_examples);
    std::cout << fmt::format("suggested max_length: {} (p99 rounded up to a multiple of 64)\n",
                             stats.suggested_max_length);
    if (format == "classification") {
      const LabelCounts labels = count_labels(args->file);
      std::string list;
      for (const auto& [label, n] : labels.counts) list += fmt::format("{}{} {}", list.empty() ? "" : ", ", label, n);
      std::cout << fmt::format("labels: {} classes ({})\nmajority-class baseline accuracy: {:.4f} (always \"{}\")\n",
                               labels.counts.size(), list, labels.majority_share, labels.majority);
    }
  };
}

}  // namespace memtune::cli

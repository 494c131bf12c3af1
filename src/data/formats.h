// Dataset record formats: the JSON shapes fine-tuning data comes in (OpenAI messages, ShareGPT,
// Alpaca, query/response, plain text, text classification), recognized from a record's keys and
// turned into one common form: a conversation to render with a chat template, or plain text for
// language modelling. Field names and aliases follow ms-swift and LLaMA-Factory.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/json_reader.h"
#include "tokenizer/chat_template.h"

namespace memtune {

enum class DataFormat {
  Messages,        // {"messages": [{"role", "content", "loss"?}, ...]}
  ShareGPT,        // {"conversations": [{"from": human|gpt|system|user|assistant, "value"}], "system"?}
  Alpaca,          // {"instruction", "input"?, "output", "system"?, "history"?: [[q, a], ...]}
  QueryResponse,   // {"query"|"prompt"|"question", "response"|"answer"|"completion", "system"?, "history"?}
  Text,            // {"text"}: every token trainable; encoded with the tokenizer's special tokens
                   // (its post-processor, e.g. a BOS; Qwen2 adds none) and eos appended
  Classification,  // {"text", "label"}: a one-turn chat whose answer is the label
  Tokens,          // {"input_ids", "labels"?}: already tokenized (a Hugging Face dataset after its map):
                   // the ids as they are, labels unshifted with -100 (default: the ids, every one a target)
};

// "messages" | "sharegpt" | "alpaca" | "query_response" | "text" | "classification" | "tokens".
DataFormat parse_data_format(std::string_view name);
std::string_view data_format_name(DataFormat format);

// The format a record's keys indicate, checked in this order: input_ids, messages, conversations,
// instruction, a query alias, text + label, text. nullopt when none matches.
std::optional<DataFormat> detect_data_format(const nlohmann::json& record);
// The keys detect_data_format looks for, for error messages.
std::string_view data_format_keys_help();

// Options that shape how a record becomes a conversation.
struct RecordOptions {
  // System message for records that carry none (ms-swift's --system); unset keeps the
  // template's own default.
  std::optional<std::string> system;
  // Classification: the user message, with {text} replaced by the record's text.
  std::string prompt_template = "{text}";
};

// One record in the common form: text for the Text format, token ids for the Tokens format, a
// conversation otherwise.
struct Record {
  bool is_text = false;
  std::string text;
  std::vector<ChatMessage> messages;
  bool is_tokens = false;
  std::vector<int32_t> ids, labels;
};

// Parses one JSON record of the given format. Throws an Error naming the field and what was
// expected (without a location: the caller knows the file and line). Conversations are
// validated with validate_conversation(messages, /*require_final_assistant=*/true).
Record parse_record(const nlohmann::json& record, DataFormat format, const RecordOptions& options);

// The text of a classification record's "label" (a string, or a number written as JSON).
std::string label_text(const nlohmann::json& label);

// An OpenAI-style messages array ({"role", "content", "loss"?} objects); errors name the field
// by the reader's path. The conversation is not validated here.
std::vector<ChatMessage> parse_messages(const JsonReader& messages);

}  // namespace memtune

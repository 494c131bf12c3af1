// Record formats (see formats.h): key-based detection and the conversion of each JSON shape to
// a conversation or plain text, with errors that name the field and the expected type.
#include "data/formats.h"

#include <fmt/format.h>

#include <array>
#include <limits>
#include <span>

#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {

namespace {

using nlohmann::json;

constexpr std::array<std::pair<std::string_view, DataFormat>, 7> kFormatNames{{
    {"messages", DataFormat::Messages},
    {"sharegpt", DataFormat::ShareGPT},
    {"alpaca", DataFormat::Alpaca},
    {"query_response", DataFormat::QueryResponse},
    {"text", DataFormat::Text},
    {"classification", DataFormat::Classification},
    {"tokens", DataFormat::Tokens},
}};

using Names = std::span<const std::string_view>;
constexpr std::array<std::string_view, 3> kQueryKeys = {"query", "prompt", "question"};
constexpr std::array<std::string_view, 3> kResponseKeys = {"response", "answer", "completion"};

// The first of `names` present in the object with a non-null value.
std::optional<JsonReader> find_field(const JsonReader& object, Names names) {
  for (std::string_view name : names)
    if (std::optional<JsonReader> value = object.find(name)) return value;
  return std::nullopt;
}

std::string alternatives(Names names) {
  std::string out;
  for (std::string_view name : names) out += fmt::format("{}\"{}\"", out.empty() ? "" : " or ", name);
  return out;
}

std::string required_string(const JsonReader& object, Names names, std::string_view format) {
  const std::optional<JsonReader> value = find_field(object, names);
  if (!value) object.fail(fmt::format("missing field {} ({} format)", alternatives(names), format));
  return value->as_string();
}

std::string required_string(const JsonReader& object, std::string_view name, std::string_view format) {
  return required_string(object, Names(&name, 1), format);
}

// A system text the record carries; an empty string counts as none, as in Alpaca-style files
// that leave the column blank.
std::optional<std::string> record_system(const JsonReader& object) {
  std::optional<std::string> text = object.optional_string("system");
  if (text && text->empty()) return std::nullopt;
  return text;
}

// Puts the system message first: the record's own, else the --system option, else none (the
// template's default applies).
void add_system(std::vector<ChatMessage>& messages, const std::optional<std::string>& own,
                const RecordOptions& options) {
  if (!messages.empty() && messages[0].role == "system") return;
  const std::optional<std::string>& system = own ? own : options.system;
  if (system) messages.insert(messages.begin(), ChatMessage{"system", *system});
}

// [[query, response], ...] before the current turn.
void add_history(std::vector<ChatMessage>& messages, const JsonReader& object) {
  const std::optional<JsonReader> history = object.find("history");
  if (!history) return;
  if (!history->value().is_array()) history->fail("expected [[query, response], ...]");
  for (size_t i = 0; i < history->size(); ++i) {
    const JsonReader turn = (*history)[i];
    if (!turn.value().is_array() || turn.size() != 2) turn.fail("expected a [query, response] pair of strings");
    messages.push_back({"user", turn[0].as_string()});
    messages.push_back({"assistant", turn[1].as_string()});
  }
}

std::vector<ChatMessage> parse_sharegpt(const JsonReader& conversations) {
  if (!conversations.value().is_array())
    conversations.fail(
        fmt::format("expected an array of {{\"from\", \"value\"}} objects, got {}", conversations.value().type_name()));
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < conversations.size(); ++i) {
    const JsonReader m = conversations[i];
    if (!m.value().is_object()) m.fail("expected an object with \"from\" and \"value\"");
    const std::optional<JsonReader> from = m.find("from");
    const std::optional<JsonReader> value = m.find("value");
    if (!from || !value) m.fail("expected \"from\" and \"value\"");
    const std::string who = from->as_string();
    std::string role;
    if (who == "human" || who == "user")
      role = "user";
    else if (who == "gpt" || who == "assistant")
      role = "assistant";
    else if (who == "system" || who == "function_call" || who == "observation" || who == "tool" || who == "function")
      role = who;  // tool roles are refused by validate_conversation with their name
    else
      from->fail(fmt::format("unknown speaker \"{}\": expected human, gpt or system", who));
    ChatMessage message{role, value->as_string()};
    if (std::optional<bool> loss = m.optional_bool("loss")) message.loss = *loss;
    messages.push_back(std::move(message));
  }
  return messages;
}

std::string replace_all(std::string text, std::string_view from, std::string_view to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
  return text;
}

}  // namespace

std::string label_text(const json& label) {
  if (label.is_string()) return label.get<std::string>();
  if (label.is_number() || label.is_boolean()) return label.dump();
  throw Error(fmt::format("field \"label\": expected a string or a number, got {}", label.type_name()));
}

DataFormat parse_data_format(std::string_view name) {
  for (const auto& [n, f] : kFormatNames)
    if (n == name) return f;
  throw Error(fmt::format(
      "unknown data format \"{}\": expected messages, sharegpt, alpaca, query_response, text or classification", name));
}

std::string_view data_format_name(DataFormat format) {
  for (const auto& [n, f] : kFormatNames)
    if (f == format) return n;
  throw InternalError("data format without a name");
}

std::optional<DataFormat> detect_data_format(const json& record) {
  if (!record.is_object()) return std::nullopt;
  if (record.contains("input_ids")) return DataFormat::Tokens;
  if (record.contains("messages")) return DataFormat::Messages;
  if (record.contains("conversations")) return DataFormat::ShareGPT;
  if (record.contains("instruction")) return DataFormat::Alpaca;
  if (find_field(JsonReader(record, ""), kQueryKeys)) return DataFormat::QueryResponse;
  if (record.contains("text")) return record.contains("label") ? DataFormat::Classification : DataFormat::Text;
  return std::nullopt;
}

std::string_view data_format_keys_help() {
  return "input_ids (+ labels), messages, conversations, instruction/input/output, query/response (or prompt, "
         "question / answer, completion), text + label, or text";
}

std::vector<ChatMessage> parse_messages(const JsonReader& messages) {
  if (!messages.value().is_array())
    messages.fail(
        fmt::format("expected an array of {{\"role\", \"content\"}} objects, got {}", messages.value().type_name()));
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const JsonReader m = messages[i];
    if (!m.value().is_object()) m.fail("expected an object with \"role\" and \"content\"");
    if (!m.has("role")) m.fail("missing \"role\"");
    if (!m.has("content")) m.fail("missing \"content\" (a string)");
    ChatMessage message{m.string("role"), m.string("content")};
    if (std::optional<bool> loss = m.optional_bool("loss")) message.loss = *loss;
    out.push_back(std::move(message));
  }
  return out;
}

Record parse_record(const json& value, DataFormat format, const RecordOptions& options) {
  const JsonReader object(value, "");  // no source: the caller adds the location
  object.as_object();
  Record record;
  std::vector<ChatMessage>& messages = record.messages;
  switch (format) {
    case DataFormat::Text:
      record.is_text = true;
      record.text = required_string(object, "text", "text");
      return record;
    case DataFormat::Tokens: {
      record.is_tokens = true;
      const std::optional<JsonReader> ids = object.find("input_ids");
      if (!ids) object.fail("missing field \"input_ids\" (tokens format)");
      ids->as_array();
      for (size_t i = 0; i < ids->size(); ++i)
        record.ids.push_back(static_cast<int32_t>((*ids)[i].as_integer(0, std::numeric_limits<int32_t>::max())));
      if (record.ids.empty()) ids->fail("expected at least one token id");
      if (const std::optional<JsonReader> labels = object.find("labels")) {
        labels->as_array();
        if (labels->size() != ids->size())
          labels->fail(fmt::format("expected as many labels as input_ids ({}), got {}", ids->size(), labels->size()));
        for (size_t i = 0; i < labels->size(); ++i) {
          const int64_t label = (*labels)[i].as_integer(-100, std::numeric_limits<int32_t>::max());
          if (label < 0 && label != -100) (*labels)[i].fail("expected a token id or -100 (no target)");
          record.labels.push_back(static_cast<int32_t>(label));
        }
      } else {
        record.labels = record.ids;
      }
      return record;
    }
    case DataFormat::Messages: {
      const std::optional<JsonReader> array = object.find("messages");
      if (!array) object.fail("missing field \"messages\" (messages format)");
      messages = parse_messages(*array);
      add_system(messages, std::nullopt, options);
      break;
    }
    case DataFormat::ShareGPT: {
      const std::optional<JsonReader> array = object.find("conversations");
      if (!array) object.fail("missing field \"conversations\" (sharegpt format)");
      messages = parse_sharegpt(*array);
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::Alpaca: {
      std::string user = required_string(object, "instruction", "alpaca");
      const std::string output = required_string(object, "output", "alpaca");
      if (const std::optional<std::string> input = object.optional_string("input"); input && !input->empty())
        user += "\n" + *input;
      add_history(messages, object);
      messages.push_back({"user", std::move(user)});
      messages.push_back({"assistant", output});
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::QueryResponse: {
      const std::string query = required_string(object, kQueryKeys, "query_response");
      const std::string response = required_string(object, kResponseKeys, "query_response");
      add_history(messages, object);
      messages.push_back({"user", query});
      messages.push_back({"assistant", response});
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::Classification: {
      const std::string text = required_string(object, "text", "classification");
      const std::optional<JsonReader> label = object.find("label");
      if (!label) object.fail("missing field \"label\" (classification format)");
      messages.push_back({"user", replace_all(options.prompt_template, "{text}", text)});
      messages.push_back({"assistant", label_text(label->value())});
      add_system(messages, record_system(object), options);
      break;
    }
  }
  validate_conversation(messages, /*require_final_assistant=*/true);
  return record;
}

}  // namespace memtune

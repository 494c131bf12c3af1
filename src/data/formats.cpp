// Record formats (see formats.h): key-based detection and the conversion of each JSON shape to
// a conversation or plain text, with errors that name the field and the expected type.
#include "data/formats.h"

#include <fmt/format.h>

#include <array>
#include <span>

#include "core/error.h"

namespace memtune {

namespace {

using nlohmann::json;

constexpr std::array<std::pair<std::string_view, DataFormat>, 6> kFormatNames{{
    {"messages", DataFormat::Messages},
    {"sharegpt", DataFormat::ShareGPT},
    {"alpaca", DataFormat::Alpaca},
    {"query_response", DataFormat::QueryResponse},
    {"text", DataFormat::Text},
    {"classification", DataFormat::Classification},
}};

using Names = std::span<const std::string_view>;
constexpr std::array<std::string_view, 3> kQueryKeys = {"query", "prompt", "question"};
constexpr std::array<std::string_view, 3> kResponseKeys = {"response", "answer", "completion"};

// The first of `names` present in the object with a non-null value, or nullptr; `found` is set
// to its name.
const json* find_field(const json& object, Names names, std::string_view& found) {
  for (std::string_view name : names) {
    auto it = object.find(name);
    if (it != object.end() && !it->is_null()) {
      found = name;
      return &*it;
    }
  }
  return nullptr;
}

const json* find_field(const json& object, std::string_view name) {
  std::string_view found;
  return find_field(object, Names(&name, 1), found);
}

std::string alternatives(Names names) {
  std::string out;
  for (std::string_view name : names) out += fmt::format("{}\"{}\"", out.empty() ? "" : " or ", name);
  return out;
}

const std::string& as_string(const json& value, std::string_view field) {
  if (!value.is_string()) throw Error(fmt::format("field \"{}\": expected a string, got {}", field, value.type_name()));
  return value.get_ref<const std::string&>();
}

const std::string& required_string(const json& object, Names names, std::string_view format) {
  std::string_view found;
  const json* value = find_field(object, names, found);
  if (!value) throw Error(fmt::format("missing field {} ({} format)", alternatives(names), format));
  return as_string(*value, found);
}

const std::string& required_string(const json& object, std::string_view name, std::string_view format) {
  return required_string(object, Names(&name, 1), format);
}

// A system text the record carries; an empty string counts as none, as in Alpaca-style files
// that leave the column blank.
std::optional<std::string> record_system(const json& object) {
  const json* value = find_field(object, "system");
  if (!value) return std::nullopt;
  const std::string& text = as_string(*value, "system");
  if (text.empty()) return std::nullopt;
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
void add_history(std::vector<ChatMessage>& messages, const json& object) {
  const json* history = find_field(object, "history");
  if (!history) return;
  if (!history->is_array()) throw Error(fmt::format("field \"history\": expected [[query, response], ...]"));
  for (size_t i = 0; i < history->size(); ++i) {
    const json& turn = (*history)[i];
    if (!turn.is_array() || turn.size() != 2)
      throw Error(fmt::format("field \"history[{}]\": expected a [query, response] pair of strings", i));
    messages.push_back({"user", as_string(turn[0], fmt::format("history[{}][0]", i))});
    messages.push_back({"assistant", as_string(turn[1], fmt::format("history[{}][1]", i))});
  }
}

std::optional<bool> optional_loss(const json& message, std::string_view field) {
  const json* loss = find_field(message, "loss");
  if (!loss) return std::nullopt;
  if (!loss->is_boolean())
    throw Error(fmt::format("field \"{}.loss\": expected true or false, got {}", field, loss->type_name()));
  return loss->get<bool>();
}

std::vector<ChatMessage> parse_sharegpt(const json& conversations) {
  if (!conversations.is_array())
    throw Error(fmt::format("field \"conversations\": expected an array of {{\"from\", \"value\"}} objects, got {}",
                            conversations.type_name()));
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < conversations.size(); ++i) {
    const json& m = conversations[i];
    const std::string field = fmt::format("conversations[{}]", i);
    if (!m.is_object()) throw Error(fmt::format("field \"{}\": expected an object with \"from\" and \"value\"", field));
    const json* from = find_field(m, "from");
    const json* value = find_field(m, "value");
    if (!from || !value) throw Error(fmt::format("field \"{}\": expected \"from\" and \"value\"", field));
    const std::string& who = as_string(*from, field + ".from");
    std::string role;
    if (who == "human" || who == "user")
      role = "user";
    else if (who == "gpt" || who == "assistant")
      role = "assistant";
    else if (who == "system" || who == "function_call" || who == "observation" || who == "tool" || who == "function")
      role = who;  // tool roles are refused by validate_conversation with their name
    else
      throw Error(fmt::format("field \"{}.from\": unknown speaker \"{}\": expected human, gpt or system", field, who));
    ChatMessage message{role, as_string(*value, field + ".value")};
    if (auto loss = optional_loss(m, field)) message.loss = *loss;
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
  std::string_view found;
  if (record.contains("messages")) return DataFormat::Messages;
  if (record.contains("conversations")) return DataFormat::ShareGPT;
  if (record.contains("instruction")) return DataFormat::Alpaca;
  if (find_field(record, kQueryKeys, found)) return DataFormat::QueryResponse;
  if (record.contains("text")) return record.contains("label") ? DataFormat::Classification : DataFormat::Text;
  return std::nullopt;
}

std::string_view data_format_keys_help() {
  return "messages, conversations, instruction/input/output, query/response (or prompt, question / answer, "
         "completion), text + label, or text";
}

std::vector<ChatMessage> parse_messages(const json& messages, std::string_view field) {
  if (!messages.is_array())
    throw Error(fmt::format("field \"{}\": expected an array of {{\"role\", \"content\"}} objects, got {}", field,
                            messages.type_name()));
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string name = fmt::format("{}[{}]", field, i);
    if (!m.is_object())
      throw Error(fmt::format("field \"{}\": expected an object with \"role\" and \"content\"", name));
    const json* role = find_field(m, "role");
    if (!role) throw Error(fmt::format("field \"{}\": missing \"role\"", name));
    const json* content = find_field(m, "content");
    if (!content) throw Error(fmt::format("field \"{}\": missing \"content\" (a string)", name));
    ChatMessage message{as_string(*role, name + ".role"), as_string(*content, name + ".content")};
    if (auto loss = optional_loss(m, name)) message.loss = *loss;
    out.push_back(std::move(message));
  }
  return out;
}

Record parse_record(const json& object, DataFormat format, const RecordOptions& options) {
  if (!object.is_object()) throw Error(fmt::format("expected a JSON object, got {}", object.type_name()));
  Record record;
  std::vector<ChatMessage>& messages = record.messages;
  switch (format) {
    case DataFormat::Text:
      record.is_text = true;
      record.text = required_string(object, "text", "text");
      return record;
    case DataFormat::Messages: {
      const json* array = find_field(object, "messages");
      if (!array) throw Error("missing field \"messages\" (messages format)");
      messages = parse_messages(*array, "messages");
      add_system(messages, std::nullopt, options);
      break;
    }
    case DataFormat::ShareGPT: {
      const json* array = find_field(object, "conversations");
      if (!array) throw Error("missing field \"conversations\" (sharegpt format)");
      messages = parse_sharegpt(*array);
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::Alpaca: {
      std::string user = required_string(object, "instruction", "alpaca");
      const std::string& output = required_string(object, "output", "alpaca");
      if (const json* input = find_field(object, "input")) {
        const std::string& text = as_string(*input, "input");
        if (!text.empty()) user += "\n" + text;
      }
      add_history(messages, object);
      messages.push_back({"user", std::move(user)});
      messages.push_back({"assistant", output});
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::QueryResponse: {
      const std::string& query = required_string(object, kQueryKeys, "query_response");
      const std::string& response = required_string(object, kResponseKeys, "query_response");
      add_history(messages, object);
      messages.push_back({"user", query});
      messages.push_back({"assistant", response});
      add_system(messages, record_system(object), options);
      break;
    }
    case DataFormat::Classification: {
      const std::string& text = required_string(object, "text", "classification");
      const json* label = find_field(object, "label");
      if (!label) throw Error("missing field \"label\" (classification format)");
      messages.push_back({"user", replace_all(options.prompt_template, "{text}", text)});
      messages.push_back({"assistant", label_text(*label)});
      add_system(messages, record_system(object), options);
      break;
    }
  }
  validate_conversation(messages, /*require_final_assistant=*/true);
  return record;
}

}  // namespace memtune

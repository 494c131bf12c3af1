// Typed JSON reading with located errors (see json_reader.h).
#include "core/json_reader.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <unordered_set>
#include <vector>

#include "core/error.h"

namespace memtune {

namespace {

using nlohmann::json;

bool is_identifier(std::string_view key) {
  if (key.empty() || (key[0] >= '0' && key[0] <= '9')) return false;
  for (const char c : key)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

// The path of an entry of a map (a key that is data, such as a token or a tensor name): `["key"]`.
std::string entry_path(const std::string& parent, std::string_view key) {
  return fmt::format("{}[\"{}\"]", parent, key);
}

// The path of a field reached by name: `.name`, or `["name"]` when the name is not an identifier.
std::string field_path(const std::string& parent, std::string_view key) {
  if (!is_identifier(key)) return entry_path(parent, key);
  return parent.empty() ? std::string(key) : fmt::format("{}.{}", parent, key);
}

std::string integer_kind(int64_t min, int64_t max) {
  if (max == JsonReader::kMaxInteger) {
    if (min == JsonReader::kMinInteger) return "an integer";
    if (min == 0) return "a non-negative integer";
    if (min == 1) return "a positive integer";
    return fmt::format("an integer >= {}", min);
  }
  return fmt::format("an integer from {} to {}", min, max);
}

}  // namespace

namespace {

// The first key that appears twice in one object of `text` (valid JSON), for the message.
std::string first_duplicate_key(std::string_view text) {
  std::vector<std::unordered_set<std::string>> open_objects;  // keys seen, innermost object last
  std::string duplicate;
  const json::parser_callback_t note_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key && duplicate.empty() &&
               !open_objects.back().insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  const json reparsed = json::parse(text.begin(), text.end(), note_keys);  // for the callback only
  return duplicate;
}

}  // namespace

json parse_json(std::string_view text, const std::string& source, DuplicateKeys duplicate_keys) {
  // Cheap detection: an object that read more keys than it holds kept only the last of some.
  std::vector<size_t> keys_read;  // per object being parsed, innermost last
  bool duplicate = false;
  const json::parser_callback_t count_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys_read.push_back(0);
    } else if (event == json::parse_event_t::key) {
      ++keys_read.back();
    } else if (event == json::parse_event_t::object_end) {
      duplicate = duplicate || keys_read.back() != parsed.size();
      keys_read.pop_back();
    }
    return true;
  };
  json document;
  try {
    document = duplicate_keys == DuplicateKeys::Refuse ? json::parse(text.begin(), text.end(), count_keys)
                                                       : json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: invalid JSON: {}", source, json_error_text(e)));
  }
  if (duplicate)
    throw Error(
        fmt::format("{}: invalid JSON: key \"{}\" appears twice in one object", source, first_duplicate_key(text)));
  return document;
}

json read_json_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(fmt::format("{}: is a directory, expected a JSON file", path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open: {}", path.string(), std::strerror(errno)));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) throw Error(fmt::format("{}: read failed", path.string()));
  return parse_json(text, path.string());
}

std::string json_error_text(const json::exception& error) {
  std::string_view text = error.what();
  if (text.starts_with("[json.exception.")) {
    const size_t end = text.find("] ");
    if (end != std::string_view::npos) text.remove_prefix(end + 2);
  }
  return std::string(text);
}

std::string json_excerpt(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}

JsonReader::JsonReader(const json& value, std::string source) : value_(&value), source_(std::move(source)) {}

JsonReader::JsonReader(const json& value, const std::string& source, std::string path)
    : value_(&value), source_(source), path_(std::move(path)) {}

JsonReader JsonReader::field(std::string_view key, const json& value) const {
  return JsonReader(value, source_, field_path(path_, key));
}

JsonReader JsonReader::entry(std::string_view key, const json& value) const {
  return JsonReader(value, source_, entry_path(path_, key));
}

std::string JsonReader::where() const {
  if (path_.empty()) return source_;
  const std::string field = fmt::format("field \"{}\"", path_);
  return source_.empty() ? field : fmt::format("{}: {}", source_, field);
}

void JsonReader::fail(std::string_view problem) const {
  const std::string location = where();
  throw Error(location.empty() ? std::string(problem) : fmt::format("{}: {}", location, problem));
}

void JsonReader::fail(std::string_view key, std::string_view problem) const {
  JsonReader(*value_, source_, field_path(path_, key)).fail(problem);
}

void JsonReader::fail_missing(std::string_view key) const {
  const std::string message = fmt::format("missing required field \"{}\"", field_path(path_, key));
  throw Error(source_.empty() ? message : fmt::format("{}: {}", source_, message));
}

std::string JsonReader::as_string() const {
  if (!value_->is_string()) fail(fmt::format("expected a string, got {}", json_excerpt(*value_)));
  return value_->get<std::string>();
}

int64_t JsonReader::as_integer(int64_t min, int64_t max) const {
  const bool fits = value_->is_number_integer() &&
                    !(value_->is_number_unsigned() && value_->get<uint64_t>() > static_cast<uint64_t>(kMaxInteger));
  if (!fits || value_->get<int64_t>() < min || value_->get<int64_t>() > max)
    fail(fmt::format("expected {}, got {}", integer_kind(min, max), json_excerpt(*value_)));
  return value_->get<int64_t>();
}

double JsonReader::as_number() const {
  if (!value_->is_number() || !std::isfinite(value_->get<double>()))
    fail(fmt::format("expected a number, got {}", json_excerpt(*value_)));
  return value_->get<double>();
}

bool JsonReader::as_bool() const {
  if (!value_->is_boolean()) fail(fmt::format("expected true or false, got {}", json_excerpt(*value_)));
  return value_->get<bool>();
}

const JsonReader& JsonReader::as_object() const {
  if (!value_->is_object()) fail(fmt::format("expected a JSON object, got {}", json_excerpt(*value_)));
  return *this;
}

const JsonReader& JsonReader::as_array() const {
  if (!value_->is_array()) fail(fmt::format("expected an array, got {}", json_excerpt(*value_)));
  return *this;
}

bool JsonReader::has(std::string_view key) const {
  return find(key).has_value();
}

std::optional<JsonReader> JsonReader::find(std::string_view key) const {
  as_object();
  const auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return field(key, *it);
}

JsonReader JsonReader::get(std::string_view key) const {
  std::optional<JsonReader> value = find(key);
  if (!value) fail_missing(key);
  return *value;
}

std::string JsonReader::string(std::string_view key) const {
  return get(key).as_string();
}

std::optional<std::string> JsonReader::optional_string(std::string_view key) const {
  const std::optional<JsonReader> value = find(key);
  return value ? std::optional(value->as_string()) : std::nullopt;
}

int64_t JsonReader::integer(std::string_view key, int64_t min, int64_t max) const {
  return get(key).as_integer(min, max);
}

std::optional<int64_t> JsonReader::optional_integer(std::string_view key, int64_t min, int64_t max) const {
  const std::optional<JsonReader> value = find(key);
  return value ? std::optional(value->as_integer(min, max)) : std::nullopt;
}

double JsonReader::number(std::string_view key) const {
  return get(key).as_number();
}

std::optional<double> JsonReader::optional_number(std::string_view key) const {
  const std::optional<JsonReader> value = find(key);
  return value ? std::optional(value->as_number()) : std::nullopt;
}

bool JsonReader::boolean(std::string_view key) const {
  return get(key).as_bool();
}

std::optional<bool> JsonReader::optional_bool(std::string_view key) const {
  const std::optional<JsonReader> value = find(key);
  return value ? std::optional(value->as_bool()) : std::nullopt;
}

JsonReader JsonReader::object(std::string_view key) const {
  JsonReader value = get(key);
  value.as_object();
  return value;
}

std::optional<JsonReader> JsonReader::optional_object(std::string_view key) const {
  std::optional<JsonReader> value = find(key);
  if (value) value->as_object();
  return value;
}

JsonReader JsonReader::array(std::string_view key) const {
  JsonReader value = get(key);
  value.as_array();
  return value;
}

std::optional<JsonReader> JsonReader::optional_array(std::string_view key) const {
  std::optional<JsonReader> value = find(key);
  if (value) value->as_array();
  return value;
}

size_t JsonReader::size() const {
  as_array();
  return value_->size();
}

JsonReader JsonReader::operator[](size_t index) const {
  as_array();
  if (index >= value_->size()) fail(fmt::format("has {} elements, no element {}", value_->size(), index));
  return JsonReader((*value_)[index], source_, fmt::format("{}[{}]", path_, index));
}

}  // namespace memtune

// Typed reading of parsed JSON with errors that say where. A JsonReader is a view of one JSON
// value that knows its source (a file, or "FILE:LINE") and its JSON path: fields as
// `added_tokens[3].content`, entries of maps keyed by data as `model.vocab["Ġthe"]`;
// a missing or mistyped value is a memtune::Error such as
//   config.json: field "num_hidden_layers": expected a positive integer, got "abc"
// so the JSON the engine reads (config.json, tokenizer.json, adapter_config.json, safetensors
// headers, checkpoint indexes, dataset records) reports problems the same way.
// null counts as absent, as Hugging Face writes null for unset fields.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace memtune {

// What parse_json does with an object that has the same key twice: nlohmann keeps the last one
// silently; files whose keys are data (a vocabulary, a tensor list) refuse it instead.
enum class DuplicateKeys { KeepLast, Refuse };

// Parses JSON text; anything nlohmann refuses (a syntax error, a number too large for a double
// such as 1e400, a string that is not UTF-8) is an Error "SOURCE: invalid JSON: ...", never one
// of nlohmann's exceptions. With DuplicateKeys::Refuse, a key that appears twice in one object is
// an Error "SOURCE: invalid JSON: key "K" appears twice in one object".
nlohmann::json parse_json(std::string_view text, const std::string& source,
                          DuplicateKeys duplicate_keys = DuplicateKeys::KeepLast);
// Reads and parses a whole JSON file; errors name the path.
nlohmann::json read_json_file(const std::filesystem::path& path);

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string json_error_text(const nlohmann::json::exception& error);
// A JSON value as it would appear in the file, cut to 80 characters, for messages.
std::string json_excerpt(const nlohmann::json& value);

class JsonReader {
 public:
  static constexpr int64_t kMinInteger = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kMaxInteger = std::numeric_limits<int64_t>::max();

  // Reads `value`, which must outlive the reader and every reader taken from it. `source` starts
  // every message; it may be empty when the caller adds the location itself.
  JsonReader(const nlohmann::json& value, std::string source);

  const nlohmann::json& value() const { return *value_; }
  const std::string& path() const { return path_; }
  // "SOURCE: field "PATH"" (just SOURCE for the top-level value), the start of every message.
  std::string where() const;
  // An Error "SOURCE: field "PATH": problem" about this value, or about its member `key`
  // (present or not).
  [[noreturn]] void fail(std::string_view problem) const;
  [[noreturn]] void fail(std::string_view key, std::string_view problem) const;

  // This value as a type; a wrong type or range is "expected ..., got VALUE".
  std::string as_string() const;
  int64_t as_integer(int64_t min = kMinInteger, int64_t max = kMaxInteger) const;
  double as_number() const;  // any finite JSON number
  bool as_bool() const;
  const JsonReader& as_object() const;
  const JsonReader& as_array() const;

  // Members of this value, which must be an object. Required getters fail with "missing
  // required field" when the member is absent or null; optional ones return nullopt then.
  bool has(std::string_view key) const;
  std::optional<JsonReader> find(std::string_view key) const;
  JsonReader get(std::string_view key) const;
  std::string string(std::string_view key) const;
  std::optional<std::string> optional_string(std::string_view key) const;
  int64_t integer(std::string_view key, int64_t min = kMinInteger, int64_t max = kMaxInteger) const;
  std::optional<int64_t> optional_integer(std::string_view key, int64_t min = kMinInteger,
                                          int64_t max = kMaxInteger) const;
  double number(std::string_view key) const;
  std::optional<double> optional_number(std::string_view key) const;
  bool boolean(std::string_view key) const;
  std::optional<bool> optional_bool(std::string_view key) const;
  JsonReader object(std::string_view key) const;
  std::optional<JsonReader> optional_object(std::string_view key) const;
  JsonReader array(std::string_view key) const;
  std::optional<JsonReader> optional_array(std::string_view key) const;

  // Elements of this value, which must be an array.
  size_t size() const;
  JsonReader operator[](size_t index) const;

  // Calls f(key, entry) for every member of this object, in document order: for maps whose keys
  // are data (tokens, tensor names), so entries are written `map["key"]` in paths.
  template <class F>
  void for_each_entry(F&& f) const {
    as_object();
    for (const auto& item : value_->items()) f(item.key(), entry(item.key(), item.value()));
  }

 private:
  JsonReader(const nlohmann::json& value, const std::string& source, std::string path);
  JsonReader field(std::string_view key, const nlohmann::json& value) const;
  JsonReader entry(std::string_view key, const nlohmann::json& value) const;
  [[noreturn]] void fail_missing(std::string_view key) const;

  const nlohmann::json* value_;
  std::string source_;
  std::string path_;
};

}  // namespace memtune

// JSON Lines reading (see jsonl.h).
#include "core/jsonl.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {

namespace {

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

bool is_blank(std::string_view text) {
  return text.find_first_not_of(" \t\r") == std::string_view::npos;
}

}  // namespace

std::optional<nlohmann::json> parse_json_line(std::string_view text, std::string& error) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number such as 1e400
    error = "invalid JSON: " + json_error_text(e);
    return std::nullopt;
  }
}

JsonlReader::JsonlReader(const std::filesystem::path& path, BadLines bad_lines)
    : file_(path, std::ios::binary), in_(file_), source_(path.string()), policy_(bad_lines) {
  if (!file_) throw Error(fmt::format("{}: cannot open: {}", source_, std::strerror(errno)));
}

JsonlReader::JsonlReader(std::istream& in, std::string source, BadLines bad_lines)
    : in_(in), source_(std::move(source)), policy_(bad_lines) {}

bool JsonlReader::next_line(JsonlLine& line) {
  while (std::getline(in_, line.text)) {
    line.number = ++line_number_;
    if (line.number == 1 && line.text.starts_with(kUtf8Bom)) line.text.erase(0, kUtf8Bom.size());
    if (!is_blank(line.text)) return true;
  }
  if (in_.bad()) throw Error(fmt::format("{}:{}: read failed", source_, line_number_ + 1));
  return false;
}

bool JsonlReader::next(nlohmann::json& value) {
  JsonlLine line;
  std::string error;
  while (next_line(line)) {
    std::optional<nlohmann::json> parsed = parse_json_line(line.text, error);
    if (!parsed) {
      bad_line(line.number, error);
      continue;
    }
    value = std::move(*parsed);
    return true;
  }
  return false;
}

void JsonlReader::bad_line(int64_t line_number, std::string_view problem) {
  std::string reason = fmt::format("{}:{}: {}", source_, line_number, problem);
  if (policy_ == BadLines::Stop) throw Error(reason);
  ++bad_lines_;
  if (bad_line_reasons_.size() < kMaxBadLineReasons) bad_line_reasons_.push_back(std::move(reason));
}

}  // namespace memtune

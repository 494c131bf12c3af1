// Reading JSON Lines files by one set of rules, whoever reads them (datasets, `memtune tokenize`,
// label counts, a run's logs): a UTF-8 byte order mark at the start of the file is dropped, blank
// lines (spaces, tabs, a CR) are skipped, and a bad line (not valid JSON, or not what the caller
// expects) is an Error "FILE:LINE: what", or, for readers that tolerate bad lines, counted with
// the first few reasons kept. The input is read one line at a time, never loaded whole.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <istream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace memtune {

// One non-blank line: its 1-based number in the input and its text (no line break, no BOM).
struct JsonlLine {
  int64_t number = 0;
  std::string text;
};

// What a reader does with a bad line.
enum class BadLines {
  Stop,  // throw an Error naming the line
  Skip,  // count it, keep the reason, go on
};

// Parses one line's text as JSON; nullopt, with `error` set to "invalid JSON: ...", when it is not.
std::optional<nlohmann::json> parse_json_line(std::string_view text, std::string& error);

class JsonlReader {
 public:
  static constexpr size_t kMaxBadLineReasons = 5;

  // Opens a file; an Error names the path when it cannot be opened.
  explicit JsonlReader(const std::filesystem::path& path, BadLines bad_lines = BadLines::Stop);
  // Reads an open stream; `source` names it in messages.
  JsonlReader(std::istream& in, std::string source, BadLines bad_lines = BadLines::Stop);
  JsonlReader(const JsonlReader&) = delete;
  JsonlReader& operator=(const JsonlReader&) = delete;

  const std::string& source() const { return source_; }

  // The next non-blank line; false at the end of the input.
  bool next_line(JsonlLine& line);
  // The value of the next non-blank line that parses as JSON; false at the end. A line that does
  // not parse is a bad line.
  bool next(nlohmann::json& value);

  // Reports line `line_number` as bad because of `problem`: an Error "SOURCE:LINE: problem" with
  // BadLines::Stop; counted (and the first kMaxBadLineReasons messages kept) with BadLines::Skip.
  void bad_line(int64_t line_number, std::string_view problem);
  int64_t bad_lines() const { return bad_lines_; }
  const std::vector<std::string>& bad_line_reasons() const { return bad_line_reasons_; }

 private:
  std::ifstream file_;
  std::istream& in_;
  std::string source_;
  BadLines policy_;
  int64_t line_number_ = 0;
  int64_t bad_lines_ = 0;
  std::vector<std::string> bad_line_reasons_;
};

}  // namespace memtune

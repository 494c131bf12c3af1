// Tests for the JSONL reader's one set of rules: a byte order mark on the first line is dropped,
// blank lines are skipped (line numbers still count them), a line that is not JSON is an Error
// "FILE:LINE: invalid JSON: ..." or, when bad lines are skipped, counted with the first reasons
// kept; the input is read a line at a time.
#include "core/jsonl.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_support::error_of;

std::vector<JsonlLine> all_lines(const std::string& text) {
  std::istringstream in(text);
  JsonlReader reader(in, "data.jsonl");
  std::vector<JsonlLine> lines;
  for (JsonlLine line; reader.next_line(line);) lines.push_back(line);
  return lines;
}

TEST(JsonlTest, DropsAByteOrderMarkOnTheFirstLineOnly) {
  const std::vector<JsonlLine> lines = all_lines("\xEF\xBB\xBF{\"a\": 1}\n\xEF\xBB\xBF{\"a\": 2}\n");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].text, "{\"a\": 1}");
  EXPECT_EQ(lines[1].text, "\xEF\xBB\xBF{\"a\": 2}");

  std::istringstream in("\xEF\xBB\xBF{\"a\": 1}\n");
  JsonlReader reader(in, "data.jsonl");
  json value;
  ASSERT_TRUE(reader.next(value));
  EXPECT_EQ(value, json({{"a", 1}}));
  EXPECT_FALSE(reader.next(value));
}

TEST(JsonlTest, SkipsBlankLinesAndKeepsLineNumbers) {
  const std::vector<JsonlLine> lines = all_lines("\n{\"a\": 1}\r\n  \t\r\n\n[2]\n   \n");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].number, 2);
  EXPECT_EQ(lines[0].text, "{\"a\": 1}\r");
  EXPECT_EQ(lines[1].number, 5);
  EXPECT_EQ(lines[1].text, "[2]");
  EXPECT_TRUE(all_lines("").empty());
  EXPECT_TRUE(all_lines("\xEF\xBB\xBF\n \n").empty());
}

TEST(JsonlTest, MalformedJsonNamesFileAndLine) {
  std::istringstream in("{\"a\": 1}\n\n{\"a\": \n{\"a\": 3}\n");
  JsonlReader reader(in, "data.jsonl");
  json value;
  ASSERT_TRUE(reader.next(value));
  const std::string message = error_of([&] { reader.next(value); });
  EXPECT_EQ(message.rfind("data.jsonl:3: invalid JSON: parse error at line 1, column 7", 0), 0u) << message;
  EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;

  std::string error;
  EXPECT_EQ(parse_json_line("[1, 2]", error), json({1, 2}));
  EXPECT_EQ(parse_json_line("{broken", error), std::nullopt);
  EXPECT_EQ(error.rfind("invalid JSON: parse error at line 1", 0), 0u) << error;
}

TEST(JsonlTest, BadLinesStopWithTheirLocation) {
  std::istringstream in("");
  JsonlReader reader(in, "data.jsonl");
  EXPECT_EQ(error_of([&] { reader.bad_line(7, "field \"text\": expected a string, got 5"); }),
            "data.jsonl:7: field \"text\": expected a string, got 5");
}

TEST(JsonlTest, SkippedBadLinesAreCountedWithTheFirstReasons) {
  std::string text = "{\"ok\": 0}\n";
  for (int i = 0; i < 7; ++i) text += "not json\n";
  text += "{\"ok\": 1}\n";
  std::istringstream in(text);
  JsonlReader reader(in, "data.jsonl", BadLines::Skip);
  std::vector<json> values;
  for (json value; reader.next(value);) values.push_back(value);
  EXPECT_EQ(values, (std::vector<json>{json{{"ok", 0}}, json{{"ok", 1}}}));
  EXPECT_EQ(reader.bad_lines(), 7);
  ASSERT_EQ(reader.bad_line_reasons().size(), JsonlReader::kMaxBadLineReasons);
  EXPECT_EQ(reader.bad_line_reasons()[0].rfind("data.jsonl:2: invalid JSON: ", 0), 0u);
  EXPECT_EQ(reader.bad_line_reasons()[4].rfind("data.jsonl:6: invalid JSON: ", 0), 0u);
  // A caller's own reason counts the same way.
  reader.bad_line(12, "expected an object");
  EXPECT_EQ(reader.bad_lines(), 8);
}

TEST(JsonlTest, ReadsALineAtATime) {
  std::istringstream in("{\"a\": 1}\n{\"a\": 2}\n");
  JsonlReader reader(in, "data.jsonl");
  JsonlLine line;
  ASSERT_TRUE(reader.next_line(line));
  EXPECT_EQ(in.tellg(), std::streampos(9)) << "only the first line is consumed";
}

TEST(JsonlTest, OpensFilesAndNamesThemInErrors) {
  const fs::path dir = testing_support::make_temp_dir("jsonl_test");
  const fs::path path = dir / "data.jsonl";
  std::ofstream(path) << "\xEF\xBB\xBF{\"a\": 1}\r\n\r\n{\"a\": 2}\n{\"a\"\n";
  JsonlReader reader(path);
  EXPECT_EQ(reader.source(), path.string());
  json value;
  ASSERT_TRUE(reader.next(value));
  EXPECT_EQ(value["a"], 1);
  ASSERT_TRUE(reader.next(value));
  EXPECT_EQ(value["a"], 2);
  EXPECT_CONTAINS(error_of([&] { reader.next(value); }), path.string() + ":4: invalid JSON");

  const fs::path absent = dir / "absent.jsonl";
  EXPECT_EQ(error_of([&] { JsonlReader missing(absent); }),
            absent.string() + ": cannot open: No such file or directory");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace memtune

// Tests for the typed JSON reader: values of the right type come back, and every refusal is an
// Error whose message names the source, the field by its JSON path, what was expected and what
// the file holds; null counts as absent; files that cannot be read or parsed are named.
#include "core/json_reader.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/jsonl.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_support::error_of;

const json kDocument = json::parse(R"({
  "name": "qwen", "layers": 24, "big": 18446744073709551615, "eps": 1e-6, "tied": true, "unset": null,
  "added_tokens": [{"id": 151643, "content": "<|endoftext|>"}, {"id": 151644, "content": 7}],
  "rope": {"type": "default", "theta": 1000000.0},
  "vocab": {"a": 0, "model.norm": "x"}
})");

TEST(JsonReaderTest, ReadsTypedFields) {
  const JsonReader doc(kDocument, "config.json");
  EXPECT_EQ(doc.string("name"), "qwen");
  EXPECT_EQ(doc.integer("layers", 1), 24);
  EXPECT_DOUBLE_EQ(doc.number("eps"), 1e-6);
  EXPECT_DOUBLE_EQ(doc.number("layers"), 24.0);
  EXPECT_TRUE(doc.boolean("tied"));
  EXPECT_EQ(doc.optional_string("name"), "qwen");
  EXPECT_EQ(doc.optional_integer("layers"), 24);
  EXPECT_EQ(doc.optional_number("eps"), 1e-6);
  EXPECT_EQ(doc.optional_bool("tied"), true);
  const JsonReader rope = doc.object("rope");
  EXPECT_EQ(rope.path(), "rope");
  EXPECT_EQ(rope.string("type"), "default");
  EXPECT_DOUBLE_EQ(rope.number("theta"), 1e6);
  const JsonReader tokens = doc.array("added_tokens");
  ASSERT_EQ(tokens.size(), 2u);
  EXPECT_EQ(tokens[0].integer("id", 0), 151643);
  EXPECT_EQ(tokens[0].string("content"), "<|endoftext|>");
  EXPECT_EQ(tokens[1].path(), "added_tokens[1]");
}

TEST(JsonReaderTest, AbsentAndNullFieldsAreOptional) {
  const JsonReader doc(kDocument, "config.json");
  for (const char* key : {"absent", "unset"}) {
    EXPECT_FALSE(doc.has(key)) << key;
    EXPECT_FALSE(doc.find(key)) << key;
    EXPECT_EQ(doc.optional_string(key), std::nullopt) << key;
    EXPECT_EQ(doc.optional_integer(key), std::nullopt) << key;
    EXPECT_EQ(doc.optional_number(key), std::nullopt) << key;
    EXPECT_EQ(doc.optional_bool(key), std::nullopt) << key;
    EXPECT_FALSE(doc.optional_object(key)) << key;
    EXPECT_FALSE(doc.optional_array(key)) << key;
    EXPECT_EQ(error_of([&] { doc.integer(key); }), std::string("config.json: missing required field \"") + key + "\"");
  }
  EXPECT_TRUE(doc.has("layers"));
  EXPECT_EQ(error_of([&] { doc.object("rope").string("scaling"); }),
            "config.json: missing required field \"rope.scaling\"");
}

TEST(JsonReaderTest, TypeErrorsNameFileFieldExpectationAndValue) {
  const JsonReader doc(kDocument, "config.json");
  EXPECT_EQ(error_of([&] { doc.integer("name", 1); }),
            "config.json: field \"name\": expected a positive integer, got \"qwen\"");
  EXPECT_EQ(error_of([&] { doc.string("layers"); }), "config.json: field \"layers\": expected a string, got 24");
  EXPECT_EQ(error_of([&] { doc.number("name"); }), "config.json: field \"name\": expected a number, got \"qwen\"");
  EXPECT_EQ(error_of([&] { doc.boolean("layers"); }), "config.json: field \"layers\": expected true or false, got 24");
  EXPECT_EQ(error_of([&] { doc.object("layers"); }), "config.json: field \"layers\": expected a JSON object, got 24");
  EXPECT_EQ(error_of([&] { doc.array("rope"); }),
            "config.json: field \"rope\": expected an array, got {\"theta\":1000000.0,\"type\":\"default\"}");
  EXPECT_EQ(error_of([&] { doc.array("added_tokens")[1].string("content"); }),
            "config.json: field \"added_tokens[1].content\": expected a string, got 7");
  EXPECT_EQ(error_of([&] { doc.integer("eps"); }), "config.json: field \"eps\": expected an integer, got 1e-06");
  EXPECT_EQ(error_of([&] { doc.optional_bool("name"); }),
            "config.json: field \"name\": expected true or false, got \"qwen\"");
  // Member access needs an object; element access an array.
  EXPECT_EQ(error_of([&] { doc.get("layers").find("x"); }),
            "config.json: field \"layers\": expected a JSON object, got 24");
  EXPECT_EQ(error_of([&] { doc.get("layers")[0]; }), "config.json: field \"layers\": expected an array, got 24");
  // A long value is cut in the message.
  const json long_text(std::string(200, 'x'));
  const std::string message = error_of([&] { JsonReader(long_text, "f.json").as_integer(); });
  EXPECT_CONTAINS(message, "f.json: expected an integer, got \"xxx");
  EXPECT_CONTAINS(message, "...");
  EXPECT_LT(message.size(), 120u);
}

TEST(JsonReaderTest, IntegerRanges) {
  const JsonReader doc(kDocument, "config.json");
  EXPECT_EQ(doc.integer("layers", 24, 24), 24);
  EXPECT_EQ(error_of([&] { doc.integer("layers", 0, 8); }),
            "config.json: field \"layers\": expected an integer from 0 to 8, got 24");
  EXPECT_EQ(error_of([&] { doc.integer("layers", 25); }),
            "config.json: field \"layers\": expected an integer >= 25, got 24");
  EXPECT_EQ(error_of([&] { JsonReader(json(-1), "c.json").as_integer(0); }),
            "c.json: expected a non-negative integer, got -1");
  EXPECT_EQ(error_of([&] { JsonReader(json(0), "c.json").as_integer(1); }),
            "c.json: expected a positive integer, got 0");
  // Beyond int64 is out of range, not wrapped around.
  EXPECT_EQ(error_of([&] { doc.integer("big"); }),
            "config.json: field \"big\": expected an integer, got 18446744073709551615");
}

TEST(JsonReaderTest, MapEntriesAndOddKeysAreBracketedInPaths) {
  const JsonReader doc(kDocument, "tokenizer.json");
  std::vector<std::string> keys;
  doc.object("vocab").for_each_entry([&](const std::string& key, const JsonReader& id) {
    keys.push_back(key);
    if (key == "a") {
      EXPECT_EQ(id.path(), "vocab[\"a\"]");
      EXPECT_EQ(id.as_integer(0), 0);
    } else {
      EXPECT_EQ(error_of([&] { id.as_integer(0); }),
                "tokenizer.json: field \"vocab[\"model.norm\"]\": expected a non-negative integer, got \"x\"");
    }
  });
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "model.norm"}));
  EXPECT_EQ(doc.object("vocab").get("model.norm").path(), "vocab[\"model.norm\"]");
  EXPECT_EQ(error_of([&] { doc.get("name").for_each_entry([](const std::string&, const JsonReader&) {}); }),
            "tokenizer.json: field \"name\": expected a JSON object, got \"qwen\"");
}

TEST(JsonReaderTest, FailNamesThisValueOrAMemberPresentOrNot) {
  const JsonReader doc(kDocument, "config.json");
  EXPECT_EQ(error_of([&] { doc.fail("neither a nor b is set"); }), "config.json: neither a nor b is set");
  EXPECT_EQ(error_of([&] { doc.object("rope").fail("has no rope_type"); }),
            "config.json: field \"rope\": has no rope_type");
  EXPECT_EQ(error_of([&] { doc.object("rope").fail("scaling", "true is not supported"); }),
            "config.json: field \"rope.scaling\": true is not supported");
  EXPECT_EQ(doc.object("rope").where(), "config.json: field \"rope\"");
  EXPECT_EQ(doc.where(), "config.json");
  // Without a source (the caller adds the location), messages start with the field.
  const JsonReader record(kDocument, "");
  EXPECT_EQ(error_of([&] { record.string("layers"); }), "field \"layers\": expected a string, got 24");
  EXPECT_EQ(error_of([&] { record.string("absent"); }), "missing required field \"absent\"");
  EXPECT_EQ(error_of([&] { record.fail("no text"); }), "no text");
}

TEST(JsonReaderTest, ParseErrorsNameTheSourceAndPosition) {
  EXPECT_EQ(parse_json(R"({"a": [1, 2]})", "x.json")["a"][1], 2);
  const std::string message = error_of([] { parse_json("{\n  \"a\": }", "x.json"); });
  EXPECT_EQ(message.rfind("x.json: invalid JSON: parse error at line 2, column 8", 0), 0u) << message;
  EXPECT_EQ(message.find("[json.exception"), std::string::npos) << message;
}

TEST(JsonReaderTest, EveryNlohmannRefusalIsAnErrorNamingTheSource) {
  // A number beyond a double is nlohmann's out_of_range, not a parse_error; both are Errors.
  std::string message = error_of([] { parse_json(R"({"eps": 1e400})", "x.json"); });
  EXPECT_EQ(message.rfind("x.json: invalid JSON: ", 0), 0u) << message;
  EXPECT_CONTAINS(message, "1e400");
  std::string error;
  EXPECT_FALSE(parse_json_line(R"({"eps": -1e400})", error));
  EXPECT_CONTAINS(error, "invalid JSON");
}

TEST(JsonReaderTest, DuplicateKeysAreRefusedOnRequest) {
  const std::string text = R"({"a": 1, "b": {"x": 1, "y": 2, "x": 3}})";
  EXPECT_EQ(parse_json(text, "x.json")["b"]["x"], 3);  // nlohmann keeps the last
  EXPECT_EQ(error_of([&] { parse_json(text, "x.json", DuplicateKeys::Refuse); }),
            "x.json: invalid JSON: key \"x\" appears twice in one object");
  EXPECT_EQ(parse_json(R"({"a": {"x": 1}, "b": {"x": 2}})", "x.json", DuplicateKeys::Refuse)["b"]["x"], 2);
}

TEST(JsonReaderTest, ReadsFilesAndNamesThemInErrors) {
  const fs::path dir = testing_support::make_temp_dir("json_reader_test");
  const std::string good = (dir / "good.json").string(), bad = (dir / "bad.json").string();
  std::ofstream(good) << R"({"layers": 2})";
  std::ofstream(bad) << "{\"layers\": 2,}";
  EXPECT_EQ(read_json_file(good)["layers"], 2);
  EXPECT_CONTAINS(error_of([&] { read_json_file(bad); }), bad + ": invalid JSON: parse error at line 1");
  const std::string absent = (dir / "absent.json").string();
  EXPECT_EQ(error_of([&] { read_json_file(absent); }), absent + ": cannot open: No such file or directory");
  EXPECT_EQ(error_of([&] { read_json_file(dir); }), dir.string() + ": is a directory, expected a JSON file");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace memtune

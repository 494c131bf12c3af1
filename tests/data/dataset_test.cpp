// Loading datasets: each record format, the masking rules, truncation strategies, dropped
// examples, bad lines (FILE:LINE messages, skip_bad_lines), and results that do not depend on
// the block size or thread count. Checks decode the trainable tokens with a synthetic tokenizer.
#include "data/dataset.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "data/synthetic_tokenizer.h"
#include "support/test_util.h"

namespace memtune {
namespace {

using testing_support::error_of;

class DatasetTest : public ::testing::Test {
 protected:
  Dataset load(const std::string& jsonl, const DataOptions& options = {}) const {
    std::istringstream in(jsonl);
    return load_dataset(in, "data.jsonl", tokenizer_, options);
  }
  std::string load_error(const std::string& jsonl, const DataOptions& options = {}) const {
    return error_of([&] { load(jsonl, options); });
  }
  std::string text(const Dataset& d, size_t i) const { return tokenizer_.decode(d.input_ids(i)); }
  // The trainable tokens decoded, contiguous runs joined with "|".
  std::string trained(const Dataset& d, size_t i) const {
    std::string out;
    std::vector<int32_t> run;
    const auto labels = d.labels(i);
    for (size_t t = 0; t <= labels.size(); ++t) {
      if (t < labels.size() && labels[t] != kIgnoreIndex) {
        EXPECT_EQ(labels[t], d.input_ids(i)[t]);
        run.push_back(labels[t]);
      } else if (!run.empty()) {
        if (!out.empty()) out += '|';
        out += tokenizer_.decode(run);
        run.clear();
      }
    }
    return out;
  }
  std::string chatml_prompt(const std::string& user) const {
    return "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
  }

  const Tokenizer tokenizer_ = testing_support::synthetic_tokenizer();
};

const std::string kDefaultSystem =
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n";

TEST_F(DatasetTest, MessagesFormatTrainsOnAssistantRepliesOnly) {
  const Dataset d =
      load(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello world"}]})"
           "\n");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.format(), DataFormat::Messages);
  EXPECT_EQ(text(d, 0), kDefaultSystem + chatml_prompt("Hi") + "hello world<|im_end|>\n");
  EXPECT_EQ(trained(d, 0), "hello world<|im_end|>");
  EXPECT_EQ(d.counts().lines, 1);
}

TEST_F(DatasetTest, PerTurnLossFalseAndTrainOnPrompt) {
  const std::string line = R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},)"
                           R"( {"role": "assistant", "content": "b", "loss": false}, {"role": "user", "content": "c"},)"
                           R"( {"role": "assistant", "content": "d"}]})";
  Dataset d = load(line);
  EXPECT_EQ(trained(d, 0), "d<|im_end|>");
  DataOptions options;
  options.train_on_prompt = true;
  d = load(line, options);
  const auto labels = d.labels(0);
  EXPECT_TRUE(std::equal(labels.begin(), labels.end(), d.input_ids(0).begin()));
}

TEST_F(DatasetTest, ShareGPTMapsSpeakersAndTakesTheSystemField) {
  const Dataset d = load(
      R"({"system": "Be kind.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "hello"},)"
      R"( {"from": "user", "value": "again"}, {"from": "assistant", "value": "world"}]})");
  EXPECT_EQ(d.format(), DataFormat::ShareGPT);
  EXPECT_EQ(text(d, 0), "<|im_start|>system\nBe kind.<|im_end|>\n" + chatml_prompt("Hi") + "hello<|im_end|>\n" +
                            chatml_prompt("again") + "world<|im_end|>\n");
  EXPECT_EQ(trained(d, 0), "hello<|im_end|>|world<|im_end|>");
}

TEST_F(DatasetTest, AlpacaJoinsInstructionAndInputAndReplaysHistory) {
  const Dataset d =
      load(R"({"instruction": "Add", "input": "1 2", "output": "3", "system": "Math.", "history": [["q", "a"]]})"
           "\n"
           R"({"instruction": "Say hi", "input": "", "output": "Hi"})"
           "\n");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.format(), DataFormat::Alpaca);
  EXPECT_EQ(text(d, 0), "<|im_start|>system\nMath.<|im_end|>\n" + chatml_prompt("q") + "a<|im_end|>\n" +
                            chatml_prompt("Add\n1 2") + "3<|im_end|>\n");
  EXPECT_EQ(trained(d, 0), "a<|im_end|>|3<|im_end|>");
  EXPECT_EQ(text(d, 1), kDefaultSystem + chatml_prompt("Say hi") + "Hi<|im_end|>\n");
}

TEST_F(DatasetTest, QueryResponseAcceptsAliases) {
  const Dataset d = load(R"({"query": "q1", "response": "r1"})"
                         "\n"
                         R"({"prompt": "q2", "completion": "r2"})"
                         "\n"
                         R"({"question": "q3", "answer": "r3", "system": "S"})"
                         "\n");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d.format(), DataFormat::QueryResponse);
  EXPECT_EQ(text(d, 1), kDefaultSystem + chatml_prompt("q2") + "r2<|im_end|>\n");
  EXPECT_EQ(trained(d, 2), "r3<|im_end|>");
  EXPECT_EQ(text(d, 2), "<|im_start|>system\nS<|im_end|>\n" + chatml_prompt("q3") + "r3<|im_end|>\n");
}

TEST_F(DatasetTest, TextFormatTrainsOnEveryTokenAndAppendsEos) {
  const Dataset d = load(R"({"text": "hello world"})");
  EXPECT_EQ(d.format(), DataFormat::Text);
  EXPECT_EQ(text(d, 0), "hello world<|im_end|>");
  const auto labels = d.labels(0);
  EXPECT_TRUE(std::equal(labels.begin(), labels.end(), d.input_ids(0).begin()));
  EXPECT_EQ(d.num_targets(0), static_cast<int64_t>(d.length(0)) - 1);
}

TEST_F(DatasetTest, TokensFormatKeepsTheIdsAndLabelsAsGiven) {
  const Dataset d = load(R"({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "attention_mask": [1, 1, 1, 1]})"
                         "\n"
                         R"({"input_ids": [9, 10, 11]})");
  EXPECT_EQ(d.format(), DataFormat::Tokens);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(std::vector<int32_t>(d.input_ids(0).begin(), d.input_ids(0).end()), (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(std::vector<int32_t>(d.labels(0).begin(), d.labels(0).end()), (std::vector<int32_t>{-100, -100, 7, 8}));
  EXPECT_EQ(d.num_targets(0), 2);
  // Without labels every id is a target (a causal LM collator's labels).
  EXPECT_EQ(std::vector<int32_t>(d.labels(1).begin(), d.labels(1).end()), (std::vector<int32_t>{9, 10, 11}));
  EXPECT_CONTAINS(load_error(R"({"input_ids": [1, 2], "labels": [1]})"),
                  "data.jsonl:1: field \"labels\": expected as many labels as input_ids (2), got 1");
  EXPECT_CONTAINS(load_error(R"({"input_ids": [1, -3]})"), "input_ids[1]");
  EXPECT_CONTAINS(load_error(R"({"input_ids": [1, 2], "labels": [1, -5]})"), "labels[1]");
  EXPECT_CONTAINS(load_error(R"({"input_ids": [1, 100000000]})"), "input_ids: 100000000 is not below the tokenizer's");
  EXPECT_CONTAINS(load_error(R"({"input_ids": []})"), "expected at least one token id");
}

TEST_F(DatasetTest, ClassificationIsAOneTurnChatAnsweredWithTheLabel) {
  DataOptions options;
  options.record.system = "Classify.";
  options.record.prompt_template = "Review: {text}\nSentiment?";
  const Dataset d = load(R"({"text": "great", "label": "positive"})"
                         "\n"
                         R"({"text": "meh", "label": 0})"
                         "\n",
                         options);
  EXPECT_EQ(d.format(), DataFormat::Classification);
  EXPECT_EQ(text(d, 0), "<|im_start|>system\nClassify.<|im_end|>\n" + chatml_prompt("Review: great\nSentiment?") +
                            "positive<|im_end|>\n");
  EXPECT_EQ(trained(d, 1), "0<|im_end|>");
  options.record.prompt_template = "no placeholder";
  EXPECT_CONTAINS(load_error(R"({"text": "a", "label": "b"})", options), "{text}");
}

TEST_F(DatasetTest, SystemOptionAppliesToRecordsWithoutOne) {
  DataOptions options;
  options.record.system = "";
  const Dataset d = load(R"({"query": "q", "response": "r"})", options);
  EXPECT_EQ(text(d, 0), "<|im_start|>system\n<|im_end|>\n" + chatml_prompt("q") + "r<|im_end|>\n");
}

TEST_F(DatasetTest, FormatAndTemplateOptionsOverrideDetection) {
  DataOptions options;
  options.format = DataFormat::Text;
  Dataset d = load(R"({"text": "hi", "label": "x"})", options);
  EXPECT_EQ(d.format(), DataFormat::Text);
  EXPECT_EQ(text(d, 0), "hi<|im_end|>");
  options = {};
  options.chat_template = "plain";
  d = load(R"({"query": "Q:", "response": "A"})", options);
  EXPECT_EQ(text(d, 0), "Q:A<|im_end|>");
  EXPECT_EQ(trained(d, 0), "A<|im_end|>");
}

TEST_F(DatasetTest, UndetectableTemplateAsksForOne) {
  const Tokenizer bare = testing_support::synthetic_tokenizer("");
  std::istringstream in(R"({"query": "q", "response": "r"})");
  const std::string message = error_of([&] { load_dataset(in, "data.jsonl", bare, {}); });
  EXPECT_CONTAINS(message, "--template qwen2_5|chatml|plain");
  // The text format needs no template.
  std::istringstream text_in(R"({"text": "hi"})");
  EXPECT_EQ(load_dataset(text_in, "data.jsonl", bare, {}).size(), 1u);
}

TEST_F(DatasetTest, TruncationStrategies) {
  const std::string lines = R"({"text": "hello world hello world"})"
                            "\n"
                            R"({"text": "Hi"})"
                            "\n";
  const Dataset full = load(lines);
  const size_t n = full.length(0);
  ASSERT_GT(n, 4u);
  DataOptions options;
  options.max_length = 4;
  Dataset d = load(lines, options);  // delete is the default
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(text(d, 0), "Hi<|im_end|>");
  EXPECT_EQ(d.counts().deleted_too_long, 1);
  EXPECT_EQ(d.counts().truncated, 0);

  options.truncation_strategy = TruncationStrategy::Left;
  d = load(lines, options);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.counts().truncated, 1);
  EXPECT_TRUE(std::equal(d.input_ids(0).begin(), d.input_ids(0).end(), full.input_ids(0).end() - 4));
  EXPECT_TRUE(std::equal(d.labels(0).begin(), d.labels(0).end(), full.labels(0).end() - 4));

  options.truncation_strategy = TruncationStrategy::Right;
  d = load(lines, options);
  ASSERT_EQ(d.length(0), 4u);
  EXPECT_TRUE(std::equal(d.input_ids(0).begin(), d.input_ids(0).end(), full.input_ids(0).begin()));
  EXPECT_EQ(parse_truncation_strategy("left"), TruncationStrategy::Left);
  EXPECT_CONTAINS(error_of([] { parse_truncation_strategy("middle"); }), "delete, left or right");
}

TEST_F(DatasetTest, ExamplesWithoutTargetsAreDropped) {
  DataOptions options;
  options.max_length = 6;
  options.truncation_strategy = TruncationStrategy::Right;  // cuts every reply away
  const std::string lines =
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "loss": false}]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]})"
      "\n";
  Dataset d = load(lines);
  EXPECT_EQ(d.size(), 1u);
  EXPECT_EQ(d.counts().dropped_no_targets, 1);
  d = load(lines, options);
  EXPECT_EQ(d.size(), 0u);
  EXPECT_EQ(d.counts().dropped_no_targets, 2);
  EXPECT_EQ(d.counts().truncated, 0);  // a cut example that is then dropped counts as dropped only
}

TEST_F(DatasetTest, BadLinesNameFileAndLine) {
  const std::string good = R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})";
  auto at_line_3 = [&](const std::string& bad) { return load_error(good + "\n\n" + bad + "\n" + good + "\n"); };
  std::string message = at_line_3(R"({"messages": [)");
  EXPECT_CONTAINS(message, "data.jsonl:3: invalid JSON");
  message = at_line_3(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})");
  EXPECT_CONTAINS(message, "data.jsonl:3:");
  EXPECT_CONTAINS(message, "messages[1]");
  EXPECT_CONTAINS(message, "content");
  message = at_line_3(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, )"
                      R"({"role": "assistant", "content": "c"}]})");
  EXPECT_CONTAINS(message, "data.jsonl:3: message 2: expected role \"user\" after \"assistant\"");
  message = at_line_3(R"({"messages": [{"role": "user", "content": "a"}]})");
  EXPECT_CONTAINS(message, "data.jsonl:3:");
  EXPECT_CONTAINS(message, "end with an assistant reply");
  EXPECT_CONTAINS(at_line_3(R"({"messages": []})"), "data.jsonl:3: empty conversation");
  EXPECT_CONTAINS(at_line_3("[1, 2]"), "data.jsonl:3: expected one JSON object per line");
  EXPECT_CONTAINS(at_line_3(R"({"messages": [{"role": "user", "content": 5}]})"),
                  "data.jsonl:3: field \"messages[0].content\": expected a string, got 5");
  EXPECT_CONTAINS(load_error(R"({"instruction": "x"})"), "data.jsonl:1: missing field \"output\" (alpaca format)");
  EXPECT_CONTAINS(load_error(R"({"query": "x"})"), "missing field \"response\" or \"answer\" or \"completion\"");
  EXPECT_CONTAINS(load_error(R"({"conversations": [{"from": "bot", "value": "x"}]})"), "unknown speaker \"bot\"");
  EXPECT_CONTAINS(load_error(R"({"query": "q", "response": "r", "history": [["only one"]]})"), "history[0]");
  message = load_error(R"({"foo": 1, "bar": 2})");
  EXPECT_CONTAINS(message, "data.jsonl:1: cannot tell the record format from the keys [bar, foo]");
  EXPECT_CONTAINS(message, "--format");
}

TEST_F(DatasetTest, SkipBadLinesCountsAndKeepsTheFirstReasons) {
  std::string lines;
  const std::string good = R"({"query": "q", "response": "r"})";
  for (int i = 0; i < 8; ++i) lines += (i % 2 == 0 ? std::string("not json") : good) + "\n";
  DataOptions options;
  options.skip_bad_lines = true;
  const Dataset d = load(lines, options);
  EXPECT_EQ(d.size(), 4u);
  EXPECT_EQ(d.counts().bad_lines, 4);
  EXPECT_EQ(d.counts().lines, 8);
  ASSERT_EQ(d.counts().bad_line_reasons.size(), 4u);
  EXPECT_CONTAINS(d.counts().bad_line_reasons[0], "data.jsonl:1: invalid JSON");
  EXPECT_CONTAINS(d.counts().bad_line_reasons[3], "data.jsonl:7: invalid JSON");

  std::string many;
  for (int i = 0; i < 20; ++i) many += good + "\n{\"query\": 1, \"response\": \"r\"}\n";
  const Dataset d2 = load(many, options);
  EXPECT_EQ(d2.counts().bad_lines, 20);
  EXPECT_EQ(d2.counts().bad_line_reasons.size(), DatasetCounts::kMaxBadLineReasons);
  EXPECT_CONTAINS(d2.counts().bad_line_reasons[1], "data.jsonl:4: field \"query\": expected a string");
}

TEST_F(DatasetTest, ByteOrderMarkCarriageReturnsAndBlankLines) {
  const Dataset d = load("\xEF\xBB\xBF{\"text\": \"Hi\"}\r\n\r\n   \n{\"text\": \"hello\"}\r\n");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.counts().lines, 2);
  EXPECT_EQ(text(d, 1), "hello<|im_end|>");
}

TEST_F(DatasetTest, ResultDoesNotDependOnBlockSizeOrThreads) {
  std::string lines;
  for (int i = 0; i < 300; ++i)
    lines += i % 7 == 3 ? "broken\n"
                        : fmt::format(R"({{"query": "q{}", "response": "{}"}})"
                                      "\n",
                                      i, std::string(static_cast<size_t>(i % 13), 'x'));
  DataOptions options;
  options.skip_bad_lines = true;
  options.block_lines = 1000;
  const Dataset reference = load(lines, options);
  for (size_t block : {1, 7, 64}) {
    options.block_lines = block;
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      const Dataset d = load(lines, options);
      ASSERT_EQ(d.size(), reference.size());
      EXPECT_EQ(d.counts().bad_line_reasons, reference.counts().bad_line_reasons);
      for (size_t i = 0; i < d.size(); ++i) {
        ASSERT_TRUE(std::ranges::equal(d.input_ids(i), reference.input_ids(i))) << i;
        ASSERT_TRUE(std::ranges::equal(d.labels(i), reference.labels(i))) << i;
      }
    }
  }
  omp_set_num_threads(omp_get_num_procs());
  // Without skip_bad_lines, the first bad line in file order is the one reported.
  options.skip_bad_lines = false;
  options.block_lines = 64;
  EXPECT_CONTAINS(load_error(lines, options), "data.jsonl:4: invalid JSON");
}

TEST_F(DatasetTest, LoadsFromAFileAndNamesAMissingOne) {
  const auto dir = testing_support::make_temp_dir("dataset_test");
  const std::string path = (dir / "train.jsonl").string();
  std::ofstream(path) << R"({"text": "Hi"})"
                      << "\n";
  EXPECT_EQ(load_dataset(path, tokenizer_, {}).size(), 1u);
  EXPECT_CONTAINS(error_of([&] { load_dataset((dir / "nope.jsonl").string(), tokenizer_, {}); }), "nope.jsonl");
  std::filesystem::remove_all(dir);
}

// Exact ids and labels with the real Qwen2.5 tokenizer, its chat template detected from
// tokenizer_config.json: what Hugging Face's apply_chat_template gives, the reply and its
// <|im_end|> trainable.
TEST(DatasetRealTokenizer, Qwen2_5MessagesIdsAndLabels) {
  REQUIRE_QWEN_TOKENIZER(dir);
  const Tokenizer tokenizer = Tokenizer::load(*dir);
  std::istringstream in(
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})");
  const Dataset d = load_dataset(in, "data.jsonl", tokenizer, {});
  ASSERT_EQ(d.size(), 1u);
  const std::vector<int32_t> prompt = {151644, 8948,   198, 2610, 525,   1207,   16948, 11,     3465,  553,
                                       54364,  14817,  13,  1446, 525,   264,    10950, 17847,  13,    151645,
                                       198,    151644, 872, 198,  13048, 151645, 198,   151644, 77091, 198};
  std::vector<int32_t> ids = prompt, labels(prompt.size(), kIgnoreIndex);
  ids.insert(ids.end(), {9707, 151645, 198});
  labels.insert(labels.end(), {9707, 151645, kIgnoreIndex});
  EXPECT_TRUE(std::ranges::equal(d.input_ids(0), ids));
  EXPECT_TRUE(std::ranges::equal(d.labels(0), labels));
}

TEST(DataFormat, NamesAndDetection) {
  EXPECT_EQ(parse_data_format("sharegpt"), DataFormat::ShareGPT);
  EXPECT_EQ(data_format_name(DataFormat::QueryResponse), "query_response");
  EXPECT_CONTAINS(error_of([] { parse_data_format("csv"); }), "messages, sharegpt, alpaca");
  EXPECT_EQ(detect_data_format(nlohmann::json::parse(R"({"text": "a", "label": 1})")), DataFormat::Classification);
  EXPECT_EQ(detect_data_format(nlohmann::json::parse(R"({"instruction": "a", "output": "b"})")), DataFormat::Alpaca);
  EXPECT_EQ(detect_data_format(nlohmann::json::parse(R"({"x": 1})")), std::nullopt);
}

}  // namespace
}  // namespace memtune

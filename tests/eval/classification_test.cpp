// Classification evaluation: every candidate's answer log-probability (multi-token labels)
// against full materialized logits, the predicted labels, accuracy, macro F1 and the confusion
// matrix recomputed here from the predictions.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "eval/classification.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;

TEST(Classification, ScoresAndMetricsMatchMaterializedLogits) {
  const auto dir = testing_support::make_temp_dir("classification_test");
  const fs::path file = dir / "eval.jsonl";
  {
    std::ofstream out(file);
    const char* texts[] = {"a b c", "the sky", "grass!", "sea water", "ruby", "leaf", "x"};
    const char* truth[] = {"red", "blue", "green", "blue", "red", "green", "teal"};
    for (int i = 0; i < 7; ++i) out << nlohmann::json{{"text", texts[i]}, {"label", truth[i]}}.dump() << "\n";
  }
  const Tokenizer tok = testing_support::synthetic_tokenizer();
  DataOptions d;
  d.max_length = 4096;
  const ClassificationSet set = build_classification_set(file.string(), tok, d, {});
  ASSERT_EQ(set.labels, (std::vector<std::string>{"blue", "green", "red", "teal"}));
  ASSERT_EQ(set.candidates.size(), 7u * 4);

  BatchOptions b;
  b.per_device_batch_size = 3;  // batches cut across examples' candidate groups
  b.shuffle = false;
  Batcher batcher(set.candidates, b);
  batcher.start_epoch(0);
  ModelOptions o;
  o.max_tokens = batcher.max_micro_batch_tokens();
  o.with_grads = false;
  o.loss_workspace_bytes = 5 * (512 + 128) * 4;  // 5-row chunks
  Decoder m(model_preset("tiny"), o);
  m.parameters().init_random(3);
  const ClassificationResult r = evaluate_classification(m, batcher, set);

  // Reference: each candidate alone, full logits, log-softmax in double.
  ModelOptions one = o;
  one.max_tokens = static_cast<int64_t>(set.candidates.max_length());
  Decoder ref(model_preset("tiny"), one);
  ref.parameters().init_random(3);
  std::vector<int> predicted;
  double true_logp = 0;
  int64_t true_tokens = 0;
  for (size_t i = 0; i < 7; ++i) {
    int best = -1;
    double best_score = -1e300;
    for (size_t k = 0; k < 4; ++k) {
      const size_t e = i * 4 + k;
      const auto ids = set.candidates.input_ids(e);
      const auto labels = set.candidates.labels(e);
      const int32_t T = static_cast<int32_t>(ids.size());
      std::vector<float> logits(static_cast<size_t>(T) * 512);
      const std::vector<int32_t> cu = {0, T};
      ref.forward_backward({ids, labels, cu}, logits.data());
      double score = 0;
      int64_t n = 0;
      for (int32_t t = 0; t + 1 < T; ++t) {
        if (labels[t + 1] == -100) continue;
        const float* z = logits.data() + static_cast<size_t>(t) * 512;
        double mx = -1e300, se = 0;
        for (int v = 0; v < 512; ++v) mx = std::max(mx, double(z[v]));
        for (int v = 0; v < 512; ++v) se += std::exp(z[v] - mx);
        score += z[labels[t + 1]] - mx - std::log(se);
        ++n;
      }
      EXPECT_GE(n, 4) << "labels are several tokens long (plus <|im_end|>)";
      if (score > best_score) best_score = score, best = static_cast<int>(k);
      if (static_cast<int>(k) == set.truth[i]) true_logp += score, true_tokens += n;
    }
    predicted.push_back(best);
  }
  EXPECT_EQ(r.predicted, predicted);
  EXPECT_NEAR(r.eval_loss, -true_logp / true_tokens, 1e-5);
  int correct = 0;
  for (size_t i = 0; i < 7; ++i) correct += predicted[i] == set.truth[i];
  EXPECT_DOUBLE_EQ(r.label_accuracy, correct / 7.0);
  double f1 = 0;
  int present = 0;
  for (int k = 0; k < 4; ++k) {
    int tp = 0, fp = 0, fn = 0;
    for (size_t i = 0; i < 7; ++i) {
      tp += predicted[i] == k && set.truth[i] == k;
      fp += predicted[i] == k && set.truth[i] != k;
      fn += predicted[i] != k && set.truth[i] == k;
    }
    if (tp + fp + fn == 0) continue;
    ++present;
    f1 += 2.0 * tp / (2.0 * tp + fp + fn);
    EXPECT_EQ(r.confusion[k][k], tp);
  }
  EXPECT_NEAR(r.macro_f1, f1 / present, 1e-12);
  std::stringstream lines;
  write_classification_predictions(lines, r, set);
  std::string line;
  for (size_t i = 0; std::getline(lines, line); ++i) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["predicted"], set.labels[static_cast<size_t>(predicted[i])]);
    EXPECT_EQ(j["scores"].size(), 4u);
  }
  fs::remove_all(dir);
}

TEST(Classification, UnknownLabelsAndNonClassificationFilesAreRefused) {
  const auto dir = testing_support::make_temp_dir("classification_test");
  std::ofstream(dir / "a.jsonl") << R"({"text": "x", "label": "red"})"
                                 << "\n";
  std::ofstream(dir / "b.jsonl") << R"({"messages": []})"
                                 << "\n";
  const Tokenizer tok = testing_support::synthetic_tokenizer();
  EXPECT_CONTAINS(testing_support::error_of([&] {
                    build_classification_set((dir / "a.jsonl").string(), tok, DataOptions{}, {"blue", "green"});
                  }),
                  "red");
  EXPECT_CONTAINS(
      testing_support::error_of([&] { build_classification_set((dir / "b.jsonl").string(), tok, DataOptions{}, {}); }),
      "b.jsonl:1");
  // The JSONL rules every reader shares: a BOM and blank lines are fine, the bad line is named.
  std::ofstream(dir / "c.jsonl") << "\xEF\xBB\xBF" << R"({"text": "x", "label": "red"})"
                                 << "\n\n"
                                 << R"({"text": "y"})"
                                 << "\n";
  EXPECT_CONTAINS(
      testing_support::error_of([&] { build_classification_set((dir / "c.jsonl").string(), tok, DataOptions{}, {}); }),
      "c.jsonl:3: expected a classification record");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace memtune

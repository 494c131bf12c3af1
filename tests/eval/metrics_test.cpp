// Streaming metrics against a direct computation on materialized logits, batch-size
// independence, and evaluation memory: independent of the eval set's size and below training's.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/batcher.h"
#include "data/dataset.h"
#include "eval/metrics.h"

namespace memtune {
namespace {

Dataset make_dataset(int copies, uint64_t seed, std::vector<int> lengths = {9, 23, 4, 17, 30, 12}) {
  Rng rng(seed);
  Dataset d;
  for (int c = 0; c < copies; ++c)
    for (int len : lengths) {
      std::vector<int32_t> ids(len), labels(len);
      for (int t = 0; t < len; ++t) {
        ids[t] = static_cast<int32_t>(rng.next_u64() % 512);
        labels[t] = t < 3 ? -100 : ids[t];
      }
      d.add(ids, labels);
    }
  return d;
}

ModelOptions eval_options(int64_t max_tokens, size_t workspace) {
  ModelOptions o;
  o.max_tokens = max_tokens;
  o.with_grads = false;
  o.loss_workspace_bytes = workspace;
  return o;
}

TEST(Metrics, MatchADirectComputationOnMaterializedLogits) {
  const Dataset data = make_dataset(1, 1);
  BatchOptions b;
  b.per_device_batch_size = 6;
  b.shuffle = false;
  Batcher batcher(data, b);
  batcher.start_epoch(0);
  // A 3-row logits chunk, so every metric sees many chunks.
  Decoder m(model_preset("tiny"), eval_options(batcher.max_micro_batch_tokens(), 3 * (512 + 128) * 4));
  ASSERT_EQ(m.loss_chunk_rows(), 3);
  m.parameters().init_random(2);
  MetricSelection s = parse_metrics("eval_loss,perplexity,token_accuracy,top50_accuracy");
  const EvalResult r = evaluate(m, batcher, s);

  // The same batch with full logits, reduced here in double precision.
  batcher.start_epoch(0);
  MicroBatch mb;
  ASSERT_TRUE(batcher.next(mb));
  const int64_t N = static_cast<int64_t>(mb.input_ids.size()), V = 512;
  std::vector<float> logits(N * V);
  m.forward_backward({mb.input_ids, mb.labels, mb.cu_seqlens}, logits.data());
  double loss = 0;
  int64_t count = 0, top1 = 0, top5 = 0;
  for (size_t s_i = 0; s_i + 1 < mb.cu_seqlens.size(); ++s_i)
    for (int32_t t = mb.cu_seqlens[s_i]; t + 1 < mb.cu_seqlens[s_i + 1]; ++t) {
      const int32_t target = mb.labels[t + 1];
      if (target == -100) continue;
      const float* z = logits.data() + t * V;
      double mx = -1e300, se = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(z[v]));
      for (int64_t v = 0; v < V; ++v) se += std::exp(z[v] - mx);
      loss += mx + std::log(se) - z[target];
      int64_t rank = 0;
      for (int64_t v = 0; v < V; ++v) rank += z[v] > z[target] || (z[v] == z[target] && v < target);
      top1 += rank < 1;
      top5 += rank < 50;
      ++count;
    }
  ASSERT_EQ(r.num_tokens, count);
  ASSERT_EQ(r.values.size(), 4u);
  EXPECT_EQ(r.values[0].first, "eval_loss");
  EXPECT_NEAR(r.values[0].second, loss / count, 1e-5);
  EXPECT_NEAR(r.values[1].second, std::exp(loss / count), 1e-3);
  EXPECT_EQ(r.values[2].first, "token_accuracy");
  EXPECT_DOUBLE_EQ(r.values[2].second, double(top1) / count);
  EXPECT_EQ(r.values[3].first, "top50_accuracy");
  EXPECT_DOUBLE_EQ(r.values[3].second, double(top5) / count);
  EXPECT_GT(top5, top1) << "the check needs a case where top-50 differs from top-1";
}

TEST(Metrics, ResultsDoNotDependOnTheEvalBatchSize) {
  const Dataset data = make_dataset(2, 3);
  std::vector<EvalResult> results;
  for (int64_t bs : {1, 8}) {
    BatchOptions b;
    b.per_device_batch_size = bs;
    b.shuffle = false;
    Batcher batcher(data, b);
    batcher.start_epoch(0);
    Decoder m(model_preset("tiny"), eval_options(batcher.max_micro_batch_tokens(), 1 << 20));
    m.parameters().init_random(4);
    MetricSelection s = parse_metrics("eval_loss,token_accuracy,top3_accuracy");
    results.push_back(evaluate(m, batcher, s));
  }
  EXPECT_EQ(results[0].num_tokens, results[1].num_tokens);
  EXPECT_NEAR(results[0].values[0].second, results[1].values[0].second, 1e-6);
  EXPECT_EQ(results[0].values[1].second, results[1].values[1].second);
  EXPECT_EQ(results[0].values[2].second, results[1].values[2].second);
}

TEST(Metrics, EvaluationMemoryIsFixedAndBelowTraining) {
  auto plan_peak = [](const Dataset& data, bool training) {
    BatchOptions b;
    b.per_device_batch_size = 4;
    b.shuffle = false;
    Batcher batcher(data, b);
    ModelOptions o = eval_options(batcher.max_micro_batch_tokens(), 1 << 20);
    o.with_grads = training;
    o.with_optimizer = training;
    return Decoder(model_preset("tiny"), o).plan().peak_bytes();
  };
  // The plan depends on the longest micro-batch, not on how many there are.
  const Dataset small = make_dataset(1, 5, {20, 20, 20, 20, 20, 20}),
                large = make_dataset(10, 5, {20, 20, 20, 20, 20, 20});
  EXPECT_EQ(plan_peak(small, false), plan_peak(large, false));
  EXPECT_LT(plan_peak(small, false), plan_peak(small, true));
}

TEST(Metrics, UnknownMetricsAreRefused) {
  EXPECT_THROW(parse_metrics("eval_loss,bleu"), Error);
  EXPECT_THROW(parse_metrics("top0_accuracy"), Error);
  EXPECT_EQ(parse_metrics("top10_accuracy").metrics.size(), 1u);
}

}  // namespace
}  // namespace memtune

// The user-metric example against full materialized logits, and merging two halves.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/registry.h"
#include "../../examples/target_probability/target_probability.h"
#include "core/rng.h"
#include "data/batcher.h"

namespace memtune {
namespace {

class TargetProbabilityOnBackends : public ::testing::TestWithParam<std::string_view> {};

// On cpu the observer reads each chunk in place; on reference it gets staged host copies.
TEST_P(TargetProbabilityOnBackends, MatchesMaterializedLogitsAndMerges) {
  Rng rng(1);
  Dataset data;
  for (int len : {12, 30, 7}) {
    std::vector<int32_t> ids(len);
    for (auto& id : ids) id = static_cast<int32_t>(rng.next_u64() % 512);
    data.add(ids, ids);
  }
  BatchOptions b;
  b.per_device_batch_size = 3;
  b.shuffle = false;
  Batcher batcher(data, b);
  batcher.start_epoch(0);
  ModelOptions o;
  o.host_logits = true;  // the example is host code reading logits chunks
  o.max_tokens = batcher.max_micro_batch_tokens();
  o.with_grads = false;
  o.loss_workspace_bytes = 4 * (512 + 128) * 4;
  o.backend = &backend_named(GetParam());
  Decoder m(model_preset("tiny"), o);
  m.parameters().init_random(5);
  MetricSelection s;
  s.metrics.push_back(std::make_unique<examples::TargetProbability>());
  const EvalResult r = evaluate(m, batcher, s);

  batcher.start_epoch(0);
  MicroBatch mb;
  ASSERT_TRUE(batcher.next(mb));
  const int64_t N = static_cast<int64_t>(mb.input_ids.size());
  std::vector<float> logits(N * 512);
  m.forward_backward({mb.input_ids, mb.labels, mb.cu_seqlens}, logits.data());
  double sum = 0;
  int64_t count = 0;
  for (size_t q = 0; q + 1 < mb.cu_seqlens.size(); ++q)
    for (int32_t t = mb.cu_seqlens[q]; t + 1 < mb.cu_seqlens[q + 1]; ++t) {
      const float* z = logits.data() + t * 512;
      double se = 0;
      for (int v = 0; v < 512; ++v) se += std::exp(double(z[v]));
      sum += std::exp(double(z[mb.labels[t + 1]])) / se;
      ++count;
    }
  ASSERT_EQ(r.values.size(), 1u);
  EXPECT_EQ(r.values[0].first, "target_probability");
  EXPECT_NEAR(r.values[0].second, sum / count, 1e-6);

  examples::TargetProbability a, half;
  a.merge(*s.metrics[0]);
  half.merge(*s.metrics[0]);
  a.merge(half);
  EXPECT_NEAR(a.compute()[0].second, sum / count, 1e-6) << "merging equal states keeps the mean";
}

INSTANTIATE_TEST_SUITE_P(Backends, TargetProbabilityOnBackends, ::testing::ValuesIn(backend_list()));

}  // namespace
}  // namespace memtune

// The focal-loss example: its gradient against finite differences, gamma = 0 equals
// cross-entropy, and it plugs into the model's fused LM head.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/registry.h"
#include "../../examples/focal_loss/focal_loss.h"
#include "core/rng.h"
#include "model/decoder.h"

namespace memtune {
namespace {

TEST(FocalLossExample, GradientMatchesFiniteDifferences) {
  const int64_t rows = 3, V = 11;
  const std::vector<int32_t> targets = {2, 0, 10};
  Rng rng(1);
  std::vector<float> z(rows * V);
  for (auto& x : z) x = static_cast<float>(2.0 * rng.normal());
  const examples::FocalLoss focal(2.0f);
  std::vector<float> grad = z;
  const double loss = focal.chunk(grad.data(), targets.data(), rows, V, true);
  EXPECT_GT(loss, 0.0);
  for (size_t i = 0; i < z.size(); ++i) {
    const float h = 1e-2f;
    std::vector<float> plus = z, minus = z;
    plus[i] += h;
    minus[i] -= h;
    const double fd = (focal.chunk(plus.data(), targets.data(), rows, V, false) -
                       focal.chunk(minus.data(), targets.data(), rows, V, false)) /
                      (2 * h);
    EXPECT_NEAR(grad[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << i;
  }
}

TEST(FocalLossExample, GammaZeroIsCrossEntropy) {
  const int64_t rows = 2, V = 7;
  const std::vector<int32_t> targets = {3, 6};
  std::vector<float> a(rows * V), b;
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(static_cast<float>(i));
  b = a;
  const double f = examples::FocalLoss(0.0f).chunk(a.data(), targets.data(), rows, V, true);
  const double c = CrossEntropyLoss().chunk(b.data(), targets.data(), rows, V, true);
  EXPECT_NEAR(f, c, 1e-5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6);
}

class FocalLossOnBackends : public ::testing::TestWithParam<std::string_view> {};

// On cpu the loss reads the chunk in place; on reference it gets staged host copies.
TEST_P(FocalLossOnBackends, PlugsIntoTheModel) {
  ModelOptions o;
  o.host_logits = true;  // the example is host code reading logits chunks
  o.max_tokens = 16;
  o.backend = &backend_named(GetParam());
  Decoder m(model_preset("tiny"), o);
  m.parameters().init_random(1);
  std::vector<int32_t> ids(16), cu = {0, 16};
  for (int i = 0; i < 16; ++i) ids[i] = (i * 37) % 512;
  m.parameters().zero_grads();
  const double ce = m.forward_backward({ids, ids, cu}).sum;
  const examples::FocalLoss focal(2.0f);
  m.set_loss(focal);
  m.parameters().zero_grads();
  const LossSum fl = m.forward_backward({ids, ids, cu});
  EXPECT_EQ(fl.count, 15);
  // At initialization p_t ~ 1/512, so (1-p_t)^2 ~ 1: focal loss is just below cross-entropy.
  EXPECT_LT(fl.sum, ce);
  EXPECT_GT(fl.sum, 0.99 * ce);
}

INSTANTIATE_TEST_SUITE_P(Backends, FocalLossOnBackends, ::testing::ValuesIn(backend_list()));

}  // namespace
}  // namespace memtune

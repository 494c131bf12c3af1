// The comparison every numeric test uses (support/numeric.h): NaN and infinities fail it wherever
// they are, unless a test allows them at that index; a failure names the index, both values and
// the tolerance.
#include "support/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace memtune::testing_support {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

std::string message(const ::testing::AssertionResult& r) { return r.message(); }

TEST(NumericCompare, FindsTheWorstDifferenceAndTheScale) {
  const std::vector<float> got = {1.0f, 2.5f, -3.0f, 4.0f};
  const std::vector<double> want = {1.0, 2.0, -3.25, 4.0};
  const Difference d = difference(got, want);
  EXPECT_TRUE(d.ok());
  EXPECT_EQ(d.worst, 0.5);
  EXPECT_EQ(d.index, 1u);
  EXPECT_EQ(d.got, 2.5);
  EXPECT_EQ(d.want, 2.0);
  EXPECT_EQ(d.scale, 4.0);
  EXPECT_TRUE(close(got, want, absolute_tolerance(0.5)));
  EXPECT_FALSE(close(got, want, absolute_tolerance(0.49)));
  EXPECT_TRUE(close(got, want, relative_tolerance(0.125)));  // 0.125 x 4
  EXPECT_FALSE(close(got, want, relative_tolerance(0.12)));
  EXPECT_TRUE(close(got, want, {0.1, 0.1}));  // 0.1 + 0.1 x 4
}

TEST(NumericCompare, ANaNAnywhereFailsEveryBound) {
  for (size_t where = 0; where < 5; ++where)
    for (const bool in_got : {true, false}) {
      std::vector<double> got = {0.1, 0.2, 0.3, 0.4, 0.5}, want = got;
      (in_got ? got : want)[where] = kNaN;
      const Difference d = difference(got, want);
      EXPECT_FALSE(d.ok());
      EXPECT_EQ(d.index, where);
      // The worst difference is NaN, so bounds on it from above and below both fail.
      EXPECT_FALSE(d.worst <= 1e30);
      EXPECT_FALSE(d.worst > 0);
      const auto r = close(got, want, absolute_tolerance(1e30));
      EXPECT_FALSE(r);
      EXPECT_NE(message(r).find("non-finite value at index " + std::to_string(where)), std::string::npos)
          << message(r);
    }
}

TEST(NumericCompare, InfinitiesFailUnlessAllowedAtThatIndexAndEqual) {
  const std::vector<double> want = {1.0, -kInf, 3.0};
  EXPECT_FALSE(close(want, want, absolute_tolerance(1.0)));  // not allowed: even equal infinities fail
  const auto masked = [](size_t i) { return i == 1; };
  EXPECT_TRUE(close(want, want, absolute_tolerance(0.0), masked));
  EXPECT_FALSE(close(std::vector<double>{1.0, kInf, 3.0}, want, absolute_tolerance(1.0), masked));  // other sign
  EXPECT_FALSE(close(std::vector<double>{1.0, kNaN, 3.0}, want, absolute_tolerance(1.0), masked));
  EXPECT_FALSE(close(std::vector<double>{1.0, -kInf, kInf}, want, absolute_tolerance(1.0), masked));  // elsewhere
}

TEST(NumericCompare, AFailureNamesTheIndexBothValuesAndTheTolerance) {
  const auto r = close(std::vector<double>{0.0, 1.25}, std::vector<double>{0.0, 1.0}, {0.001, 0.01});
  ASSERT_FALSE(r);
  const std::string m = message(r);
  EXPECT_NE(m.find("at index 1 of 2"), std::string::npos) << m;
  EXPECT_NE(m.find("got 1.25"), std::string::npos) << m;
  EXPECT_NE(m.find("want 1"), std::string::npos) << m;
  EXPECT_NE(m.find("tolerance 0.011"), std::string::npos) << m;
}

TEST(NumericCompare, SizesMustAgreeAndScalarsFollowTheSameRule) {
  EXPECT_FALSE(close(std::vector<double>{1.0}, std::vector<double>{1.0, 2.0}, absolute_tolerance(kInf)));
  EXPECT_TRUE(close_scalar(1.0, 1.0 + 1e-9, absolute_tolerance(1e-8)));
  EXPECT_FALSE(close_scalar(kNaN, 1.0, absolute_tolerance(kInf)));
  EXPECT_FALSE(close_scalar(1.0, kInf, absolute_tolerance(kInf)));
  EXPECT_TRUE(close(std::vector<double>{}, std::vector<double>{}, absolute_tolerance(0)));
}

}  // namespace
}  // namespace memtune::testing_support

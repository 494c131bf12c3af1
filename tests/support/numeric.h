// The one numeric comparison of the C++ tests. Every comparison of computed numbers goes through
// `difference` (where two sequences differ most) or the assertion `close` built on it.
//
// A NaN or an infinity in either operand is a failure unless the test allows it at that index
// (both operands then hold the same non-finite value there). std::max(worst, |a - b|) would keep
// the old value when |a - b| is NaN, so a kernel that writes NaN would pass; here a non-finite
// value makes `worst` NaN, which every comparison (<, <=, >, >=) rejects.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <string>

#include <fmt/format.h>

namespace memtune::testing_support {

// Where two sequences differ most, or the first place either holds a non-finite value.
struct Difference {
  double worst = 0;  // max |got - want|; NaN when a non-finite value was found (or the sizes differ)
  double scale = 0;  // max |want| over the compared elements
  size_t index = 0;  // where `worst` was found, or the first non-finite value
  double got = 0, want = 0;  // the two values at `index`
  size_t size = 0;
  std::string problem;  // empty, or why `worst` is NaN

  bool ok() const { return problem.empty(); }
  std::string describe() const {
    if (!problem.empty()) return problem;
    return fmt::format("worst |got - want| {:.6g} at index {} of {} (got {:.9g}, want {:.9g}); max |want| {:.6g}",
                       worst, index, size, got, want, scale);
  }
};

// Which indices may hold a non-finite value (the same one in both operands).
using AllowNonFinite = std::function<bool(size_t index)>;

template <class A, class B>
Difference difference(const A& got, const B& want, const AllowNonFinite& allow = {}) {
  Difference d;
  d.size = std::size(want);
  if (std::size(got) != std::size(want)) {
    d.worst = std::numeric_limits<double>::quiet_NaN();
    d.problem = fmt::format("sizes differ: got {} values, want {}", std::size(got), std::size(want));
    return d;
  }
  auto g = std::begin(got);
  auto w = std::begin(want);
  for (size_t i = 0; i < d.size; ++i, ++g, ++w) {
    const double a = static_cast<double>(*g), b = static_cast<double>(*w);
    if (!std::isfinite(a) || !std::isfinite(b)) {
      const bool same = (std::isnan(a) && std::isnan(b)) || a == b;
      if (allow && allow(i) && same) continue;
      d.worst = std::numeric_limits<double>::quiet_NaN();
      d.index = i;
      d.got = a;
      d.want = b;
      d.problem = fmt::format("non-finite value at index {} of {}: got {}, want {}{}", i, d.size, a, b,
                              allow && allow(i) ? " (a non-finite value is allowed here, but not this pair)" : "");
      return d;
    }
    d.scale = std::max(d.scale, std::abs(b));
    const double diff = std::abs(a - b);
    if (i == 0 || diff > d.worst) {
      d.worst = diff;
      d.index = i;
      d.got = a;
      d.want = b;
    }
  }
  return d;
}

// Tolerance: |got - want| <= absolute + relative * max|want|, at every index.
struct Tolerance {
  double absolute = 0, relative = 0;
  double bound(double scale) const { return absolute + relative * scale; }
};
inline Tolerance absolute_tolerance(double t) { return {t, 0}; }
inline Tolerance relative_tolerance(double t, double floor = 0) { return {floor, t}; }

// An assertion: EXPECT_TRUE(close(got, want, relative_tolerance(1e-5))) << "what";
// Its failure message names the index, both values and the tolerance.
template <class A, class B>
::testing::AssertionResult close(const A& got, const B& want, Tolerance tolerance, const AllowNonFinite& allow = {}) {
  const Difference d = difference(got, want, allow);
  const double bound = tolerance.bound(d.scale);
  if (d.ok() && d.worst <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << d.describe()
                                       << fmt::format("; tolerance {:.6g} (absolute {:.3g} + relative {:.3g} x {:.6g})",
                                                      bound, tolerance.absolute, tolerance.relative, d.scale);
}

// A scalar comparison with the same rule (NaN and infinities fail).
inline ::testing::AssertionResult close_scalar(double got, double want, Tolerance tolerance) {
  const double g[1] = {got}, w[1] = {want};
  return close(g, w, tolerance);
}

}  // namespace memtune::testing_support

// The canary of the test switches: a build configured with MEMTUNE_REQUIRE_ALL_TESTS=ON runs
// every test with MEMTUNE_REQUIRE_ALL_TESTS=1 in its environment, which turns each skip for a
// missing device, tokenizer or interpreter into a failure. Without the variable those skips
// would pass silently, so this test fails when the build asked for all tests and it is absent.
// It also checks the ordinary environment every test gets (both entries must arrive: ctest's
// ENVIRONMENT once dropped all but the first).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "support/test_util.h"

namespace memtune {
namespace {

TEST(TestSwitches, TheBuildsRequireAllSwitchReachesEveryTest) {
  const char* omp = std::getenv("OMP_WAIT_POLICY");
  const char* require = std::getenv("MEMTUNE_REQUIRE_ALL_TESTS");
  std::printf("build requires all tests: %s; OMP_WAIT_POLICY=%s; MEMTUNE_REQUIRE_ALL_TESTS=%s\n",
              MEMTUNE_BUILD_REQUIRES_ALL_TESTS ? "yes" : "no", omp ? omp : "(unset)", require ? require : "(unset)");
  if (MEMTUNE_BUILD_REQUIRES_ALL_TESTS) {
    EXPECT_TRUE(testing_support::all_tests_required())
        << "configured with MEMTUNE_REQUIRE_ALL_TESTS=ON, yet MEMTUNE_REQUIRE_ALL_TESTS=1 is not in the "
           "environment: every skip guarded by it would pass";
    // Run by ctest (the switch is ctest's), the ordinary entry arrives beside it.
    EXPECT_STREQ(omp, "PASSIVE");
  }
}

}  // namespace
}  // namespace memtune

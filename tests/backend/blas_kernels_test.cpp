// Which OpenBLAS kernels sgemm runs: on a CPU with AVX-512 the backend never leaves OpenBLAS on its
// AVX2 kernels unless OPENBLAS_CORETYPE asks for them, and the kernels it switches to compute
// sgemm correctly. The choice is made as the program loads, so each case runs this test binary
// again as a child process with the environment under test.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "support/run_command.h"

namespace memtune::cpu {
namespace {

using testing_support::run_command;

bool cpu_has_avx512_for_blas() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// The child: prints the kernels in use, then checks a ragged float32 matmul (sgemm) against a double-precision
// loop written here.
TEST(BlasKernelsChild, ReportsKernelsAndMultipliesCorrectly) {
  if (!std::getenv("MEMTUNE_BLAS_CHILD")) GTEST_SKIP() << "runs as the child of BlasKernels tests";
  std::printf("kernels: %s\n", blas_kernels());
  const int M = 67, N = 131, K = 259;
  std::vector<float> a(M * K), b(N * K), c(M * N);
  for (int i = 0; i < M * K; ++i) a[i] = static_cast<float>((i * 37 % 101) - 50) / 64.0f;
  for (int i = 0; i < N * K; ++i) b[i] = static_cast<float>((i * 53 % 97) - 48) / 32.0f;
  matmul_forward(c.data(), a.data(), b.data(), nullptr, M, K, N);  // sgemm
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double want = 0;
      for (int k = 0; k < K; ++k) want += double(a[m * K + k]) * b[n * K + k];
      ASSERT_NEAR(c[m * N + n], want, 1e-4 * (1 + std::abs(want))) << m << ", " << n;
    }
}

std::string run_child(const std::string& environment) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto r = run_command("env -u OPENBLAS_CORETYPE " + environment + " MEMTUNE_BLAS_CHILD=1 OMP_NUM_THREADS=2 '" +
                             self + "' --gtest_filter='BlasKernelsChild.*'");
  EXPECT_EQ(r.status, 0) << r.output;
  const size_t at = r.output.find("kernels: ");
  EXPECT_NE(at, std::string::npos) << r.output;
  return at == std::string::npos ? "" : r.output.substr(at + 9, r.output.find('\n', at) - at - 9);
}

TEST(BlasKernels, Avx512CpusRunTheAvx512Kernels) {
  const std::string kernels = run_child("");
  if (!cpu_has_avx512_for_blas()) GTEST_SKIP() << "no AVX-512 here; OpenBLAS chose " << kernels;
  EXPECT_TRUE(kernels == "SkylakeX" || kernels == "Cooperlake" || kernels == "SapphireRapids") << kernels;
}

TEST(BlasKernels, OpenblasCoretypeStillDecides) {
  EXPECT_EQ(run_child("OPENBLAS_CORETYPE=Haswell"), "Haswell");
}

}  // namespace
}  // namespace memtune::cpu

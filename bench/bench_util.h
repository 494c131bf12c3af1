// What the benchmarks share: wall-clock seconds, and the sgemm ceiling at a given shape.
#pragma once

#include <cblas.h>

#include <chrono>
#include <cstdint>
#include <vector>

namespace memtune::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// GFLOP/s of OpenBLAS's C[M,N] = A[M,K] B (B given as [N,K] when trans_b, the layout of our
// weights), repeated for half a second after one warm-up call.
inline double sgemm_gflops(int64_t M, int64_t N, int64_t K, bool trans_a = false, bool trans_b = true) {
  std::vector<float> a(M * K, 0.01f), b(K * N, 0.02f), c(M * N, 0.0f);
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                a.data(), trans_a ? M : K, b.data(), trans_b ? K : N, 0.0f, c.data(), N);
  };
  run();
  int reps = 0;
  const auto t0 = Clock::now();
  do {
    run();
    ++reps;
  } while (seconds_since(t0) < 0.5);
  return 2.0 * M * N * K * reps / seconds_since(t0) / 1e9;
}

}  // namespace memtune::bench

// The cpu backend's 16-bit products (backend/cpu/half_gemm.h): which CPUs get them, and the
// products that run in pieces of output rows to keep oneDNN's scratchpad within the plan.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/half_gemm.h"
#include "backend/registry.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace memtune {
namespace {

// Whether /proc/cpuinfo's flags list `flag`.
bool cpu_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) return (line + " ").find(" " + flag + " ") != std::string::npos;
  return false;
}

// bfloat16 products run on oneDNN exactly where the CPU has bfloat16 instructions (AVX512-BF16
// or AMX-BF16) and ONEDNN_MAX_CPU_ISA does not cap them away; elsewhere --bf16 keeps float32
// arithmetic. Says plainly which this machine is.
TEST(CpuSixteenBitProducts, Bfloat16KernelsExactlyWhereTheCpuHasBfloat16Instructions) {
  const bool hardware = cpu_has("avx512_bf16") || cpu_has("amx_bf16");
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::string isa = cap ? cap : "ALL";
  const bool capped_below = isa == "SSE41" || isa == "AVX" || isa == "AVX2" || isa == "AVX2_VNNI" ||
                            isa == "AVX512_CORE" || isa == "AVX512_CORE_VNNI";
  const std::string kernel = backend_named("cpu").sixteen_bit_products(DType::BF16);
  std::printf("CPU bfloat16 instructions: %s; ONEDNN_MAX_CPU_ISA=%s; bfloat16 products: %s\n",
              hardware ? "yes" : "no", isa.c_str(), kernel.empty() ? "none (float32 arithmetic)" : kernel.c_str());
  EXPECT_EQ(!kernel.empty(), hardware && !capped_below) << kernel;
  if (!kernel.empty() && cpu_has("amx_bf16") && !capped_below && isa != "AVX512_CORE_BF16") {
    EXPECT_NE(kernel.find("amx"), std::string::npos) << "a CPU with AMX tiles should run them: " << kernel;
  }
}

// A product whose primitive wants more scratchpad than allowed runs in pieces of output rows,
// and both agree with float64 sums of the exact products (not bit for bit: a primitive made for
// fewer rows may block K differently).
TEST(CpuSixteenBitProducts, AProductOverItsScratchpadRunsInPiecesAndBothAgreeWithExactSums) {
  if (cpu::half_gemm_kernel(DType::BF16).empty()) GTEST_SKIP() << "no bfloat16 products on this CPU";
  const int64_t M = 300, N = 64, K = 2000;
  Rng rng(7);
  std::vector<uint16_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
  for (auto& v : a) v = f32_to_bf16(static_cast<float>(rng.normal()));
  for (auto& v : b) v = f32_to_bf16(static_cast<float>(rng.normal()));
  std::vector<float> whole(static_cast<size_t>(M * N)), pieces(whole.size());
  // A transposed A (as the weight gradient's dout^T), which oneDNN copies per thread.
  const cpu::HalfMatrix At{a.data(), 1, M}, B{b.data(), N, 1};
  EXPECT_EQ(cpu::half_gemm(DType::BF16, M, N, K, At, B, whole.data(), N, false), M);
  const int64_t rows = cpu::half_gemm(DType::BF16, M, N, K, At, B, pieces.data(), N, false, 4096);
  EXPECT_LT(rows, M) << "a 4 KiB scratchpad should not hold a " << M << "-row primitive's";
  double worst = 0, worst_pieces = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(bf16_to_f32(a[k * M + i])) * bf16_to_f32(b[k * N + j]);
      worst = std::max(worst, std::abs(s - whole[i * N + j]));
      worst_pieces = std::max(worst_pieces, std::abs(s - pieces[i * N + j]));
    }
  EXPECT_LT(worst, 1e-3);
  EXPECT_LT(worst_pieces, 1e-3);
}

TEST(CpuSixteenBitProducts, RoundingRowsInPlaceLeavesEachRowsValuesInItsFirstHalf) {
  const int64_t rows = 5, n = 203, stride = 211;
  Rng rng(3);
  std::vector<float> x(static_cast<size_t>(rows * stride)), original;
  for (float& v : x) v = static_cast<float>(rng.normal());
  original = x;
  cpu::round_rows_in_place(x.data(), rows, n, stride, DType::BF16, 0.5f);
  const auto* h = reinterpret_cast<const uint16_t*>(x.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(h[r * 2 * stride + i], f32_to_bf16(original[r * stride + i] * 0.5f)) << r << ", " << i;
}

}  // namespace
}  // namespace memtune

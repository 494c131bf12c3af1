// The cpu backend's 16-bit products (backend/cpu/half_gemm.h): which CPUs get them, and the
// products that run in pieces of output rows to keep oneDNN's scratchpad within the plan.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/half_gemm.h"
#include "backend/cpu/ops.h"
#include "backend/registry.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "support/numeric.h"

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

// The ISA oneDNN is capped to (ONEDNN_MAX_CPU_ISA), "ALL" when uncapped.
std::string onednn_cap() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  return cap ? cap : "ALL";
}

// Whether this CPU, as oneDNN is allowed to use it, has bfloat16 instructions: read from
// /proc/cpuinfo and the cap, not from the code under test.
bool bfloat16_instructions_allowed() {
  const std::string isa = onednn_cap();
  const bool capped_below = isa == "SSE41" || isa == "AVX" || isa == "AVX2" || isa == "AVX2_VNNI" ||
                            isa == "AVX512_CORE" || isa == "AVX512_CORE_VNNI";
  return (cpu_has("avx512_bf16") || cpu_has("amx_bf16")) && !capped_below;
}

// bfloat16 products run on oneDNN exactly where the CPU has bfloat16 instructions (AVX512-BF16
// or AMX-BF16) and ONEDNN_MAX_CPU_ISA does not cap them away; elsewhere --bf16 keeps float32
// arithmetic (the model tests check that arithmetic there). Says plainly which this machine is.
TEST(CpuSixteenBitProducts, Bfloat16KernelsExactlyWhereTheCpuHasBfloat16Instructions) {
  const bool hardware = cpu_has("avx512_bf16") || cpu_has("amx_bf16");
  const std::string isa = onednn_cap();
  const bool capped_below = hardware && !bfloat16_instructions_allowed();
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
// A CPU without bfloat16 instructions (or oneDNN capped below them) has no 16-bit product to
// split: the one skip of these tests, taken only where /proc/cpuinfo or the cap says so. It stays
// a skip where every test is required, since the machine decides it, not a missing install; a
// CPU that has the instructions and no kernel fails the test above.
TEST(CpuSixteenBitProducts, AProductOverItsScratchpadRunsInPiecesAndBothAgreeWithExactSums) {
  if (!bfloat16_instructions_allowed())
    GTEST_SKIP() << "this CPU has no bfloat16 instructions oneDNN may use (ONEDNN_MAX_CPU_ISA=" << onednn_cap() << ")";
  ASSERT_FALSE(cpu::half_gemm_kernel(DType::BF16).empty()) << "bfloat16 instructions and no kernel";
  const int64_t M = 300, N = 64, K = 2000;
  Rng rng(7);
  std::vector<uint16_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
  for (auto& v : a) v = f32_to_bf16(static_cast<float>(rng.normal()));
  for (auto& v : b) v = f32_to_bf16(static_cast<float>(rng.normal()));
  std::vector<float> whole(static_cast<size_t>(M * N)), pieces(whole.size());
  // A transposed A (as the weight gradient's dout^T), which oneDNN copies per thread.
  const cpu::HalfMatrix At{a.data(), 1, M}, B{b.data(), N, 1};
  EXPECT_EQ(cpu::half_gemm(ProductFamily::Layers, DType::BF16, M, N, K, At, B, whole.data(), N, false), M);
  const int64_t rows = cpu::half_gemm(ProductFamily::Layers, DType::BF16, M, N, K, At, B, pieces.data(), N, false, 4096);
  EXPECT_LT(rows, M) << "a 4 KiB scratchpad should not hold a " << M << "-row primitive's";
  std::vector<double> exact(whole.size());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(bf16_to_f32(a[k * M + i])) * bf16_to_f32(b[k * N + j]);
      exact[static_cast<size_t>(i * N + j)] = s;
    }
  // Sums of 2000 products of order 1 (|sum| ~ 45) in float32: a few ulps of the partial sums.
  EXPECT_TRUE(testing_support::close(whole, exact, testing_support::absolute_tolerance(1e-3)));
  EXPECT_TRUE(testing_support::close(pieces, exact, testing_support::absolute_tolerance(1e-3)));
}

// The 16-bit head's layout (ops.h: HeadProducts): asked for by MEMTUNE_HEAD_PRODUCTS, otherwise
// dense exactly where oneDNN runs a dense slice on the tile unit (AMX), which a CPU with AMX
// tiles and an uncapped oneDNN does; a bad value names the variable and its choices on every
// CPU. Without bfloat16 instructions there are no 16-bit products, so no dense layout either,
// even when asked for.
TEST(CpuSixteenBitProducts, TheHeadsLayoutIsChosenFromTheKernelOrAskedFor) {
  const bool instructions = bfloat16_instructions_allowed();
  Backend& cpu = backend_named("cpu");
  ASSERT_EQ(setenv("MEMTUNE_HEAD_PRODUCTS", "dense", 1), 0);
  EXPECT_EQ(cpu.head_product_slice(DType::BF16), instructions ? cpu::kDenseHeadSliceRows : 0);
  ASSERT_EQ(setenv("MEMTUNE_HEAD_PRODUCTS", "strided", 1), 0);
  EXPECT_EQ(cpu.head_product_slice(DType::BF16), 0);
  ASSERT_EQ(setenv("MEMTUNE_HEAD_PRODUCTS", "sideways", 1), 0);
  for (const DType operands : {DType::BF16, DType::F32}) {
    try {
      cpu.head_product_slice(operands);
      ADD_FAILURE() << "an unknown layout was taken for " << dtype_torch_name(operands);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("MEMTUNE_HEAD_PRODUCTS"), std::string::npos) << e.what();
    }
  }
  unsetenv("MEMTUNE_HEAD_PRODUCTS");
  const std::string dense =
      instructions ? cpu::half_gemm_kernel(DType::BF16, 256, cpu::kDenseHeadSliceRows, 1024, cpu::kDenseHeadSliceRows)
                   : "no kernel";
  std::printf("a dense head slice runs on %s: the head's products are %s\n", dense.c_str(),
              cpu.head_product_slice(DType::BF16) ? "dense" : "strided");
  EXPECT_EQ(cpu.head_product_slice(DType::BF16), cpu::tile_unit_kernel(dense) ? cpu::kDenseHeadSliceRows : 0);
  if (cpu_has("amx_bf16") && onednn_cap() == "ALL") {
    EXPECT_TRUE(cpu::tile_unit_kernel(dense)) << dense;
  }
  EXPECT_EQ(cpu.head_product_slice(DType::F32), 0);
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

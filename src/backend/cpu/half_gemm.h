// Matrix products with 16-bit operands (bfloat16 / float16) and float32 accumulation, through
// oneDNN's matmul (Debian's libdnnl): oneDNN picks the CPU's matrix unit by itself (AMX tiles,
// AVX512-BF16 / AVX512-FP16 instructions); ONEDNN_MAX_CPU_ISA caps what it may use. This is the
// arithmetic of mixed precision (--bf16 in training, a bfloat16 model's prefill: docs/architecture.md).
//
// Primitives are made once per shape and kept (a bounded cache). Their scratchpad is ours: one
// buffer of kHalfGemmScratchpadBytes that every product shares (a term of the process
// prediction), and a product whose primitive would want more runs in pieces of its output rows
// that fit it, so oneDNN never allocates inside a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "backend/products.h"
#include "core/dtype.h"

namespace memtune::cpu {

constexpr size_t kHalfGemmScratchpadBytes = size_t{16} << 20;

// A 16-bit matrix in host memory: element (i, j) at data + i * row_stride + j * col_stride
// (elements, not bytes), so a transposed view or a row padded to a longer stride needs no copy.
struct HalfMatrix {
  const void* data;
  int64_t row_stride, col_stride;
};

// The kernel oneDNN runs 16-bit products of `dtype` with on this CPU (its implementation name,
// e.g. "brg:avx512_core_amx_bf16"), or empty when it has no native 16-bit kernel here (no
// AVX512-BF16 / AMX, or the ISA capped below them: oneDNN would then emulate them slower than
// float32 runs). Asked once per dtype and remembered.
const std::string& half_gemm_kernel(DType dtype);

// C[M, N] = A[M, K] @ B[K, N] (accumulate: C += A @ B), A and B of `dtype` (BF16 or F16), C
// float32 row-major with leading dimension ldc. Only where half_gemm_kernel(dtype) is not empty.
// Returns the output rows one primitive computed (M, or fewer where the scratchpad a primitive
// for M rows wants exceeds scratchpad_limit, at most kHalfGemmScratchpadBytes). The call is
// counted under `family` with the implementation name of the primitive oneDNN made (products.h).
int64_t half_gemm(ProductFamily family, DType dtype, int64_t M, int64_t N, int64_t K, HalfMatrix A, HalfMatrix B,
                  float* C, int64_t ldc, bool accumulate, size_t scratchpad_limit = kHalfGemmScratchpadBytes);

// The implementation oneDNN picks for C[M, N] = A[M, K] @ B[K, N] with dense row-major operands
// and C of leading dimension ldc (asked once per shape, remembered with the primitive).
const std::string& half_gemm_kernel(DType dtype, int64_t M, int64_t N, int64_t K, int64_t ldc);

// Whether a oneDNN implementation name is a matrix-tile unit's (AMX): where the layout of a
// product decides whether oneDNN may use the tile unit at all, the cpu backend lays the product
// out for it (ops.cpp, the LM head; quantized_ops.cpp, prefill).
bool tile_unit_kernel(const std::string& implementation);

// Rounds each of `rows` float32 rows of n values (row stride `stride` floats) to `dtype` in
// place: row r's 16-bit values take the first half of its own bytes, so the result is a 16-bit
// matrix with row stride 2 * stride elements. Rows run in parallel, each front to back.
void round_rows_in_place(float* rows, int64_t count, int64_t n, int64_t stride, DType dtype, float scale);
// The same rounding into another buffer: rows of n values (row stride `stride` floats) x scale
// into `out` (row stride out_stride 16-bit values).
void round_rows(const float* rows, int64_t count, int64_t n, int64_t stride, uint16_t* out, int64_t out_stride,
                DType dtype, float scale);

}  // namespace memtune::cpu

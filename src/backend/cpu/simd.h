// Vector types and small helpers the cpu kernels share (GCC / Clang vector extensions: 16
// float32 lanes, one AVX-512 register or two AVX2 ones).
#pragma once

#include <cstdint>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "core/dtype.h"

namespace memtune::cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

// The sum of the 16 lanes by halving (4 adds of shrinking vectors): a lane-by-lane loop is a chain
// of 15 dependent adds, which on the short rows of a small model's hidden size can cost more than
// streaming the row itself (docs/benchmarks.md).
inline float hsum(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Keeps a vector in registers where the compiler would fold its load into every instruction that
// uses it (GCC does so even with registers to spare): the loop then loads it once, not once per
// use, and loads no longer bound it (as they bound the 8-row bfloat16 decode kernel, whose input
// vectors each serve several FMAs; figures: docs/benchmarks.md). Only with AVX-512, where the 16
// lanes are one register.
template <class Vector>  // a 64-byte vector: f32x16, u32x16
inline void keep_in_register(Vector& v) {
  static_assert(sizeof(Vector) == 64);
#ifdef __AVX512F__
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// One float16 as float32: one instruction with F16C, the portable conversion otherwise.
inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

}  // namespace memtune::cpu

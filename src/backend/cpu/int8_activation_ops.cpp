// Quantized products of many rows with int8 activations (int8_activations.h) on the cpu backend:
// integer dot products of the weight's codes with the rounded input, AVX2's vpmaddubsw (unsigned
// 8-bit x signed 8-bit, pairs summed into 16 bits) and vpmaddwd.
//
// Over a group g of the weight and its activation blocks a (scale d_a, int8 input q):
//   sum_k x_k s_g (c_k - z_g) = s_g (sum_a d_a sum_{k in a} q_k c_k - z_g sum_a d_a sum_{k in a} q_k)
// with c the codes. 4-bit codes (0..15) go to vpmaddubsw as they are: a pair of products is at
// most 2 x 15 x 127 = 3810, so the 16-bit sums of four 32-input steps (a 128-input block) cannot
// overflow, and vpmaddwd widens them once per block. 8-bit codes are shifted to signed (c - 128,
// with z - 128) and multiplied as |c - 128| by the input with c - 128's sign (at most 2 x 128 x
// 127 per pair: no saturation), widened every step.
//
// Where the CPU has VNNI (AVX-512 VNNI with VL, or AVX-VNNI), vpdpbusd does a step's products and
// their 32-bit sums in one instruction (four products per lane, no saturation): the same integer
// sums, so the same result to the bit.
//
// Layout: the input is rounded in row chunks into scratch (int8 rows, a scale per block, and per
// group the sum_a d_a sum q for the zero term). Each task takes 16 output rows and first unpacks
// their codes into bytes in the same order as the input (4-bit: per 32 inputs the even ones, then
// the odd ones, as a 16-byte load yields them by low and high nibbles), then runs every input row
// against them, 4 input rows x 2 output rows at a time.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/ops.h"
#include "backend/cpu/simd.h"
#include "backend/int8_activations.h"
#include "core/error.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace memtune::cpu {

#ifdef __AVX2__
namespace {

constexpr int64_t kTileRows = 16;   // output rows a task unpacks and runs
constexpr int kMaxTileThreads = 16;  // threads with a tile in scratch
constexpr int MR = 4, NR = 2;  // input rows x output rows of the micro-kernel
constexpr int MR8 = 2, NR8 = 4;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
// Unsigned x signed bytes, pairs summed into 16 bits (at most 2 x 255 x 127: callers keep below
// saturation), then widened to 32.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// What every task reads: the rounded input of a chunk of rows.
struct RoundedInput {
  const int8_t* q;     // [rows, in], 4-bit layout: each 32 inputs as their even then odd ones
  const float* scale;  // [rows, in / block]
  const float* zsum;   // [rows, groups]: sum over the group's blocks of scale * sum q
  int64_t rows;
};

// One tile of output rows: codes as bytes in the input's order (8-bit: c - 128), their scales and
// scale * zero (zero - 128 for 8 bits) per group as float32.
struct Tile {
  int8_t* codes;  // [kTileRows, in]
  float* scale;   // [kTileRows, groups]
  float* scaled_zero;
};

size_t tile_bytes(const QuantizedWeight& w) {
  return static_cast<size_t>(kTileRows * w.in + 2 * kTileRows * w.groups * 4);
}

void round_rows(const float* x, const QuantizedWeight& w, int64_t block, int64_t rows, int8_t* q, float* scale,
                float* zsum) {
  const int64_t in = w.in, blocks = in / block, per_group = w.group_size / block;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    int8_t* qn = q + n * in;
    alignas(32) int8_t plain[128];
    float block_sum_scaled = 0.0f;
    for (int64_t a = 0; a < blocks; ++a) {
      const float d = round_block_to_int8(x + n * in + a * block, block, plain);
      scale[n * blocks + a] = d;
      int32_t sum = 0;
      for (int64_t i = 0; i < block; ++i) sum += plain[i];
      block_sum_scaled += d * static_cast<float>(sum);
      if ((a + 1) % per_group == 0) {
        zsum[n * w.groups + a / per_group] = block_sum_scaled;
        block_sum_scaled = 0.0f;
      }
      int8_t* dst = qn + a * block;
      if (w.bits == 8) {
        std::memcpy(dst, plain, static_cast<size_t>(block));
        continue;
      }
      for (int64_t s = 0; s < block; s += 32)
        for (int i = 0; i < 16; ++i) {
          dst[s + i] = plain[s + 2 * i];
          dst[s + 16 + i] = plain[s + 2 * i + 1];
        }
    }
  }
}

void unpack_tile(const QuantizedWeight& w, int64_t o0, int64_t rows, const Tile& t) {
  const uint32_t* codes = w.codes.as<const uint32_t>();
  const uint16_t* scales = w.scales.as<const uint16_t>();
  const uint16_t* zeros = w.zeros.as<const uint16_t>();
  const int64_t in = w.in;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = o0 + r;
    int8_t* dst = t.codes + r * in;
    if (w.bits == 8) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(codes + o * (in / 4));  // bytes in input order
      for (int64_t k = 0; k < in; ++k) dst[k] = static_cast<int8_t>(src[k] ^ 0x80u);
    } else {  // 32 inputs = 16 bytes: byte i holds inputs 2i (low nibble) and 2i + 1
      const uint8_t* src = reinterpret_cast<const uint8_t*>(codes + o * (in / 8));
      for (int64_t s = 0; s < in; s += 32)
        for (int i = 0; i < 16; ++i) {
          const uint8_t b = src[s / 2 + i];
          dst[s + i] = static_cast<int8_t>(b & 0x0f);
          dst[s + 16 + i] = static_cast<int8_t>(b >> 4);
        }
    }
    const float shift = w.bits == 8 ? 128.0f : 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = half_to_float(scales[o * w.groups + g]);
      t.scale[r * w.groups + g] = s;
      t.scaled_zero[r * w.groups + g] = s * (half_to_float(zeros[o * w.groups + g]) - shift);
    }
  }
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Input rows n0 .. n0 + M - 1 against tile rows r0 .. r0 + R - 1.
template <int Bits, int M, int R>
void micro(float* out, int64_t OC, const RoundedInput& x, int64_t n0, const Tile& t, int64_t o0, int64_t r0,
           const QuantizedWeight& w, int64_t block, const float* bias) {
  const int64_t in = w.in, blocks = in / block, per_group = w.group_size / block;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  const int8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = t.codes + (r0 + r) * in;
  const int8_t* xrow[M];
  for (int m = 0; m < M; ++m) xrow[m] = x.q + (n0 + m) * in;
  for (int64_t a = 0; a < blocks; ++a) {
    const int64_t g = a / per_group;
    __m256i acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
    for (int64_t k = a * block; k < (a + 1) * block; k += 32) {
      __m256i wv[R], wabs[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[r] + k));
        if constexpr (Bits == 8) wabs[r] = _mm256_abs_epi8(wv[r]);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow[m] + k));
        for (int r = 0; r < R; ++r) {
          if constexpr (Bits == 8)
            acc[m][r] = dot_u8s8(acc[m][r], wabs[r], _mm256_sign_epi8(xv, wv[r]));
          else if constexpr (kVnni)
            acc[m][r] = dot_u8s8(acc[m][r], wv[r], xv);
          else  // 16-bit sums, widened once per block
            acc[m][r] = _mm256_add_epi16(acc[m][r], _mm256_maddubs_epi16(wv[r], xv));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float d = x.scale[(n0 + m) * blocks + a];
      for (int r = 0; r < R; ++r) {
        const __m256i sums = Bits == 8 || kVnni ? acc[m][r] : _mm256_madd_epi16(acc[m][r], ones);
        const __m256 f = _mm256_set1_ps(d * t.scale[(r0 + r) * w.groups + g]);
        total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), f, total[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float zero_term = 0.0f;
      const float* sz = t.scaled_zero + (r0 + r) * w.groups;
      const float* zs = x.zsum + (n0 + m) * w.groups;
      for (int64_t g = 0; g < w.groups; ++g) zero_term += sz[g] * zs[g];
      const int64_t o = o0 + r0 + r;
      out[(n0 + m) * OC + o] = hsum8(total[m][r]) - zero_term + (bias ? bias[o] : 0.0f);
    }
}

// Input rows n0 .. n0 + M - 1 against every row of the tile, R at a time: the M input rows (a few
// KB) and the tile's codes stay in L1 while the pairs run.
template <int Bits, int M>
void rows_against_tile(float* out, int64_t OC, const RoundedInput& x, int64_t n0, const Tile& t, int64_t o0,
                       int64_t rows, const QuantizedWeight& w, int64_t block, const float* bias) {
  constexpr int R = Bits == 8 ? NR8 : NR;
  int64_t r = 0;
  for (; r + R <= rows; r += R) micro<Bits, M, R>(out, OC, x, n0, t, o0, r, w, block, bias);
  for (; r < rows; ++r) micro<Bits, M, 1>(out, OC, x, n0, t, o0, r, w, block, bias);
}

template <int Bits>
void tile_task(float* out, const RoundedInput& x, const QuantizedWeight& w, int64_t block, const float* bias,
               int64_t o0, const Tile& t) {
  const int64_t rows = std::min(kTileRows, w.out - o0);
  unpack_tile(w, o0, rows, t);
  constexpr int M = Bits == 8 ? MR8 : MR;
  int64_t n = 0;
  for (; n + M <= x.rows; n += M) rows_against_tile<Bits, M>(out, w.out, x, n, t, o0, rows, w, block, bias);
  switch (x.rows - n) {
    case 3: return rows_against_tile<Bits, 3>(out, w.out, x, n, t, o0, rows, w, block, bias);
    case 2: return rows_against_tile<Bits, 2>(out, w.out, x, n, t, o0, rows, w, block, bias);
    case 1: return rows_against_tile<Bits, 1>(out, w.out, x, n, t, o0, rows, w, block, bias);
    default: return;
  }
}

}  // namespace

size_t int8_activation_scratch_bytes(int64_t rows, const QuantizedWeight& w) {
  const int64_t block = int8_activation_block(w);
  return static_cast<size_t>(rows * (w.in + 4 * (w.in / block) + 4 * w.groups)) +
         static_cast<size_t>(kMaxTileThreads) * tile_bytes(w);
}

void quantized_matmul_int8_activations(float* out, const float* inp, const QuantizedWeight& w, const float* bias,
                                       int64_t N, void* scratch, size_t scratch_bytes) {
  const int64_t block = int8_activation_block(w);
  MT_ASSERT(block > 0 && (w.bits == 4 || w.bits == 8), "int8 activations for 4- or 8-bit weights in blocks");
  const int64_t in = w.in, per_row = in + 4 * (in / block) + 4 * w.groups;
  const size_t tiles = static_cast<size_t>(kMaxTileThreads) * tile_bytes(w);
  MT_ASSERT(scratch_bytes >= tiles + static_cast<size_t>(MR * per_row), "int8 activation scratch");
  // Rows rounded at once: as many as the scratch holds next to the tiles.
  const int64_t chunk = std::min<int64_t>(N, static_cast<int64_t>((scratch_bytes - tiles) / static_cast<size_t>(per_row)));
  std::byte* base = static_cast<std::byte*>(scratch);
  std::byte* tile_base = base + static_cast<size_t>(chunk * per_row);
  const int threads = std::min(omp_get_max_threads(), kMaxTileThreads);
  const int64_t tasks = (w.out + kTileRows - 1) / kTileRows;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    int8_t* q = reinterpret_cast<int8_t*>(base);
    float* scale = reinterpret_cast<float*>(base + rows * in);
    float* zsum = scale + rows * (in / block);
    round_rows(inp + n0 * in, w, block, rows, q, scale, zsum);
    const RoundedInput x{q, scale, zsum, rows};
    float* y = out + n0 * w.out;
#pragma omp parallel num_threads(threads)
    {
      std::byte* mine = tile_base + static_cast<size_t>(omp_get_thread_num()) * tile_bytes(w);
      const Tile t{reinterpret_cast<int8_t*>(mine), reinterpret_cast<float*>(mine + kTileRows * in),
                   reinterpret_cast<float*>(mine + kTileRows * in) + kTileRows * w.groups};
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tasks; ++task) {
        if (w.bits == 8)
          tile_task<8>(y, x, w, block, bias, task * kTileRows, t);
        else
          tile_task<4>(y, x, w, block, bias, task * kTileRows, t);
      }
    }
  }
}

bool int8_activation_kernels() { return true; }

#else  // no AVX2: quantized products keep float32 inputs

size_t int8_activation_scratch_bytes(int64_t, const QuantizedWeight&) { return 0; }
void quantized_matmul_int8_activations(float*, const float*, const QuantizedWeight&, const float*, int64_t, void*,
                                       size_t) {
  MT_ASSERT(false, "int8 activations need AVX2");
}
bool int8_activation_kernels() { return false; }

#endif

}  // namespace memtune::cpu

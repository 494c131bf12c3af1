// Quantized products of many rows with int8 activations (int8_activations.h) on the cpu backend:
// integer dot products of the weight's codes with the rounded input.
//
// Over a group g of the weight and its activation blocks a (scale d_a, int8 input q):
//   sum_k x_k s_g (c_k - z_g) = sum_a d_a s_g sum_{k in a} q_k c_k - s_g z_g sum_a d_a sum_{k in a} q_k
// with c the codes: integer sums per block, one float multiply-add per block, and the zero term
// once per group.
//
// Layout: output rows, not inputs, run along a register's lanes. Each task unpacks the codes of
// kTileRows output rows into bytes, interleaved per 4 inputs: for inputs 4i .. 4i + 3, row j's four
// codes are the int32 at (i * kTileRows + j). One vector load then holds the same four inputs of L
// consecutive rows (L = 16 with AVX-512, 8 with AVX2), and an input row's four rounded values,
// broadcast to every lane, multiply it with one vpdpbusd (unsigned codes x signed input, four
// products summed into each int32 lane). The sums land per output row, so the scales are vectors
// too (a tile's scales per group are L consecutive floats) and nothing is summed across lanes.
// The micro-kernel keeps M input rows x R vectors of outputs in registers over the whole input.
//
// Without VNNI (AVX2 only), vpmaddubsw + vpmaddwd give the same integer sums: 4-bit codes go as
// they are (a pair of products is at most 2 x 15 x 127, far below the 16-bit limit); 8-bit codes
// are stored shifted to signed (c - 128, with z - 128) and multiplied as |c - 128| by the input
// with c - 128's sign (at most 2 x 128 x 127 per pair: no saturation).
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

constexpr int64_t kTileRows = 32;    // output rows a task unpacks and runs
constexpr int kMaxTileThreads = 16;  // threads with a tile in scratch

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
// 16 output rows per register, 32 registers: 4 input rows x 2 registers of outputs, each with an
// int32 block sum and a float32 total.
struct Vec {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  static constexpr int M = 4, R = 2;
  static I zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static I broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  // In asm: with the intrinsic, GCC 12 copies each accumulator to another register and back
  // around every vpdpbusd (two moves per product in the inner loop).
  static I dot(I acc, I codes, I x) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
    return acc;
  }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm512_maskz_cvtepi32_ps(0xffff, v); }  // (GCC 12 warns on the unmasked form)
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#else
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#else
constexpr bool kVnni = false;
// Unsigned x signed bytes, pairs summed into 16 bits (callers keep below saturation), then four
// products summed into 32 bits.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
// 8 output rows per register, 16 registers: 2 input rows x 2 registers of outputs.
struct Vec {
  using I = __m256i;
  using F = __m256;
  static constexpr int L = 8;
  static constexpr int M = 2, R = 2;
  static I zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I dot(I acc, I codes, I x) { return dot_u8s8(acc, codes, x); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif
static_assert(kTileRows % (Vec::L * Vec::R) == 0, "a tile is whole passes of the micro-kernel");

// 8-bit codes as they are where vpdpbusd multiplies them (unsigned), shifted to signed otherwise.
constexpr int kShift8 = kVnni ? 0 : 128;

// What every task reads: the rounded input of a chunk of rows.
struct RoundedInput {
  const int8_t* q;     // [rows, in]
  const float* scale;  // [rows, in / block]
  const float* zsum;   // [rows, groups]: sum over the group's blocks of scale * sum q
};

// One tile of output rows: codes interleaved per 4 inputs (see the top), scales and scale * zero
// per group as float32, [groups, kTileRows]. Rows past the weight's end are zero.
struct Tile {
  int8_t* codes;  // [in / 4, kTileRows, 4]
  float* scale;   // [groups, kTileRows]
  float* scaled_zero;
};

// One input row rounded: its int8 values, a scale per block and a zero-term sum per group.
int64_t rounded_row_bytes(const QuantizedWeight& w, int64_t block) {
  return w.in + 4 * (w.in / block) + 4 * w.groups;
}

size_t tile_bytes(const QuantizedWeight& w) {
  return static_cast<size_t>(kTileRows * w.in + 2 * kTileRows * w.groups * 4);
}

void round_rows(const float* x, const QuantizedWeight& w, int64_t block, int64_t rows, int8_t* q, float* scale,
                float* zsum) {
  const int64_t in = w.in, blocks = in / block, per_group = w.group_size / block;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    alignas(64) int8_t plain[128];
    float block_sum_scaled = 0.0f;
    for (int64_t a = 0; a < blocks; ++a) {
      const float d = round_block_to_int8(x + n * in + a * block, block, plain);
      std::memcpy(q + n * in + a * block, plain, static_cast<size_t>(block));
      scale[n * blocks + a] = d;
      int32_t sum = 0;
      for (int64_t i = 0; i < block; ++i) sum += plain[i];
      block_sum_scaled += d * static_cast<float>(sum);
      if ((a + 1) % per_group == 0) {
        zsum[n * w.groups + a / per_group] = block_sum_scaled;
        block_sum_scaled = 0.0f;
      }
    }
  }
}

// The codes of inputs s .. s + 31 of row o as 32 bytes in input order (8-bit: shifted by kShift8).
inline __m256i row_codes(const QuantizedWeight& w, int64_t o, int64_t s) {
  const uint8_t* row = reinterpret_cast<const uint8_t*>(w.codes.as<const uint32_t>()) + o * (w.in * w.bits / 8);
  if (w.bits == 8)
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + s)),
                            _mm256_set1_epi8(static_cast<char>(kShift8)));
  // 32 inputs = 16 bytes: byte i holds inputs 2i (low nibble) and 2i + 1
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + s / 2)), low = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

// Rows as 8 x 8 int32 (row k: its 8 quads) to quads (vector i: quad i of the 8 rows).
inline void transpose8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]);      // quads 0, 1 | 4, 5 of rows k, k + 1
    t[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);  // quads 2, 3 | 6, 7
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);          // quad 0 | 4 of rows k .. k + 3
    u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);      // 1 | 5
    u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);  // 2 | 6
    u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);  // 3 | 7
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

void unpack_tile(const QuantizedWeight& w, int64_t o0, int64_t rows, const Tile& t) {
  const uint16_t* scales = w.scales.as<const uint16_t>();
  const uint16_t* zeros = w.zeros.as<const uint16_t>();
  int32_t* dst = reinterpret_cast<int32_t*>(t.codes);  // [in / 4, kTileRows]
  // 8 rows x 32 inputs at a time, turned so that each quad's 8 rows are one store.
  for (int64_t r0 = 0; r0 < kTileRows; r0 += 8)
    for (int64_t s = 0; s < w.in; s += 32) {
      __m256i v[8];
      for (int k = 0; k < 8; ++k) v[k] = r0 + k < rows ? row_codes(w, o0 + r0 + k, s) : _mm256_setzero_si256();
      transpose8(v);
      for (int i = 0; i < 8; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (s / 4 + i) * kTileRows + r0), v[i]);
    }
  const float shift = w.bits == 8 ? static_cast<float>(kShift8) : 0.0f;
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t o = o0 + r;
      const float s = r < rows ? half_to_float(scales[o * w.groups + g]) : 0.0f;
      t.scale[g * kTileRows + r] = s;
      t.scaled_zero[g * kTileRows + r] = r < rows ? s * (half_to_float(zeros[o * w.groups + g]) - shift) : 0.0f;
    }
}

// Input rows n0 .. n0 + M - 1 against tile rows r0 .. r0 + R * L - 1 (of which `valid` exist).
template <int Bits, int M, int R>
void micro(float* out, int64_t OC, const RoundedInput& x, int64_t n0, const Tile& t, int64_t o0, int64_t r0,
           int64_t valid, const QuantizedWeight& w, int64_t block, const float* bias) {
  using V = Vec;
  constexpr int L = V::L;
  const int64_t in = w.in, blocks = in / block, per_group = w.group_size / block;
  typename V::F total[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = V::fzero();
  const int8_t* xrow[M];
  for (int m = 0; m < M; ++m) xrow[m] = x.q + (n0 + m) * in;
  const int8_t* codes = t.codes + r0 * 4;
  int64_t a = 0;
  for (int64_t g = 0; g < w.groups; ++g) {
    const float* gs = t.scale + g * kTileRows + r0;
    for (int64_t b = 0; b < per_group; ++b, ++a) {
      typename V::I acc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = V::zero();
      for (int64_t k = a * block; k < (a + 1) * block; k += 4) {
        const int8_t* c = codes + k * kTileRows;
        typename V::I wv[R];
        for (int r = 0; r < R; ++r) wv[r] = V::load(c + r * L * 4);
        for (int m = 0; m < M; ++m) {
          const typename V::I xv = V::broadcast4(xrow[m] + k);
          for (int r = 0; r < R; ++r) {
            if constexpr (Bits == 8 && !kVnni)
              acc[m][r] = V::dot(acc[m][r], _mm256_abs_epi8(wv[r]), _mm256_sign_epi8(xv, wv[r]));
            else
              acc[m][r] = V::dot(acc[m][r], wv[r], xv);
          }
        }
      }
      typename V::F s[R];
      for (int r = 0; r < R; ++r) s[r] = V::fload(gs + r * L);
      for (int m = 0; m < M; ++m) {
        const typename V::F d = V::set1(x.scale[(n0 + m) * blocks + a]);
        for (int r = 0; r < R; ++r) total[m][r] = V::fmadd(V::cvt(acc[m][r]), V::mul(d, s[r]), total[m][r]);
      }
    }
    const float* sz = t.scaled_zero + g * kTileRows + r0;
    for (int r = 0; r < R; ++r) {
      const typename V::F z = V::fload(sz + r * L);
      for (int m = 0; m < M; ++m) total[m][r] = V::fnmadd(V::set1(x.zsum[(n0 + m) * w.groups + g]), z, total[m][r]);
    }
  }
  const int64_t o = o0 + r0;
  for (int m = 0; m < M; ++m) {
    float* y = out + (n0 + m) * OC + o;
    for (int r = 0; r < R; ++r) {
      const int64_t lanes = std::min<int64_t>(L, valid - r * L);
      if (lanes <= 0) break;
      typename V::F v = total[m][r];
      if (lanes == L) {
        if (bias) v = V::add(v, V::fload(bias + o + r * L));
        V::store(y + r * L, v);
        continue;
      }
      alignas(64) float lane[L];
      V::store(lane, v);
      for (int64_t i = 0; i < lanes; ++i) y[r * L + i] = lane[i] + (bias ? bias[o + r * L + i] : 0.0f);
    }
  }
}

// Input rows [n_begin, n_end) against the tile's `rows` rows, M input rows at a time: the M rows
// stay in L1 while the tile streams past.
template <int Bits>
void rows_against_tile(float* out, int64_t OC, const RoundedInput& x, int64_t n_begin, int64_t n_end, const Tile& t,
                       int64_t o0, int64_t rows, const QuantizedWeight& w, int64_t block, const float* bias) {
  constexpr int M = Vec::M, R = Vec::R, W = Vec::L * Vec::R;
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    const int64_t valid = std::min<int64_t>(W, rows - r0);
    int64_t n = n_begin;
    for (; n + M <= n_end; n += M) micro<Bits, M, R>(out, OC, x, n, t, o0, r0, valid, w, block, bias);
    for (; n < n_end; ++n) micro<Bits, 1, R>(out, OC, x, n, t, o0, r0, valid, w, block, bias);
  }
}

}  // namespace

size_t int8_activation_scratch_bytes(int64_t rows, const QuantizedWeight& w) {
  return static_cast<size_t>(rows * rounded_row_bytes(w, int8_activation_block(w))) +
         static_cast<size_t>(kMaxTileThreads) * tile_bytes(w);
}

void quantized_matmul_int8_activations(float* out, const float* inp, const QuantizedWeight& w, const float* bias,
                                       int64_t N, void* scratch, size_t scratch_bytes) {
  const int64_t block = int8_activation_block(w);
  MT_ASSERT(block > 0 && (w.bits == 4 || w.bits == 8), "int8 activations for 4- or 8-bit weights in blocks");
  const int64_t in = w.in, per_row = rounded_row_bytes(w, block);
  const int threads = std::min(omp_get_max_threads(), kMaxTileThreads);
  const size_t tiles = static_cast<size_t>(threads) * tile_bytes(w);
  MT_ASSERT(scratch_bytes >= int8_activation_scratch_bytes(Vec::M, w), "int8 activation scratch");
  // Rows rounded at once: as many as the scratch holds next to this run's tiles.
  const int64_t chunk =
      std::min<int64_t>(N, static_cast<int64_t>((scratch_bytes - tiles) / static_cast<size_t>(per_row)));
  std::byte* base = static_cast<std::byte*>(scratch);
  std::byte* tile_base = base + static_cast<size_t>(chunk * per_row);
  const int64_t tiles_out = (w.out + kTileRows - 1) / kTileRows;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    int8_t* q = reinterpret_cast<int8_t*>(base);
    float* scale = reinterpret_cast<float*>(base + rows * in);
    float* zsum = scale + rows * (in / block);
    round_rows(inp + n0 * in, w, block, rows, q, scale, zsum);
    const RoundedInput x{q, scale, zsum};
    float* y = out + n0 * w.out;
    // Where there are fewer tiles than threads, each tile's input rows split between tasks (each
    // unpacks the tile again).
    const int64_t splits = std::clamp<int64_t>((threads + tiles_out - 1) / tiles_out, 1, (rows + Vec::M - 1) / Vec::M);
    const int64_t per_split = (rows + splits - 1) / splits;
#pragma omp parallel num_threads(threads)
    {
      std::byte* mine = tile_base + static_cast<size_t>(omp_get_thread_num()) * tile_bytes(w);
      const Tile t{reinterpret_cast<int8_t*>(mine), reinterpret_cast<float*>(mine + kTileRows * in),
                   reinterpret_cast<float*>(mine + kTileRows * in) + kTileRows * w.groups};
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < tiles_out * splits; ++task) {
        const int64_t o0 = task / splits * kTileRows, tile_rows = std::min(kTileRows, w.out - o0);
        const int64_t n_begin = task % splits * per_split, n_end = std::min(rows, n_begin + per_split);
        if (n_begin >= n_end) continue;
        unpack_tile(w, o0, tile_rows, t);
        if (w.bits == 8)
          rows_against_tile<8>(y, w.out, x, n_begin, n_end, t, o0, tile_rows, w, block, bias);
        else
          rows_against_tile<4>(y, w.out, x, n_begin, n_end, t, o0, tile_rows, w, block, bias);
      }
    }
  }
}

// Decoding (at most kInt8ActivationRows rows, int8_activations.h: rounds_decode_layout): the
// codes are read as stored, 128 inputs (one activation block, within one group) at a time. 4-bit:
// 64 bytes whose low nibbles are inputs 8i + 2j and high nibbles 8i + 2j + 1 (byte 4i + j), so the
// rounded input is stored in that order, low half then high half, and two vpdpbusd give each
// lane's sum over inputs 8i .. 8i + 7; 8-bit: two loads of 64 codes in input order. Per block one
// float multiply-add by scale x activation scale; the zero term once per group.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

constexpr int64_t kDecodeBlock = 128;

// One rounded input row: [in] int8 (4 bits: each block permuted as above), a scale per block, a
// zero-term sum per group.
int64_t decode_row_bytes(const QuantizedWeight& w) {
  return w.in + 4 * (w.in / kDecodeBlock) + 4 * w.groups;
}

template <int Bits>
void decode_rows(float* out, const std::byte* prepared, const QuantizedWeight& w, const float* bias, int64_t N,
                 int64_t o0, int64_t o1) {
  const int64_t in = w.in, blocks = in / kDecodeBlock, per_group = w.group_size / kDecodeBlock;
  const int64_t row_bytes = decode_row_bytes(w), code_bytes = in * Bits / 8;
  const auto* codes = reinterpret_cast<const uint8_t*>(w.codes.as<const uint32_t>());
  const uint16_t* scales = w.scales.as<const uint16_t>();
  const uint16_t* zeros = w.zeros.as<const uint16_t>();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = codes + o * code_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(row + 8 * code_bytes), _MM_HINT_T0);
    for (int64_t n = 0; n < N; ++n) {
      const std::byte* x = prepared + n * row_bytes;
      const auto* q = reinterpret_cast<const int8_t*>(x);
      const float* d = reinterpret_cast<const float*>(x + in);
      const float* zsum = d + blocks;
      __m512 total = _mm512_setzero_ps();
      float zero_term = 0.0f;
      for (int64_t g = 0, a = 0; g < w.groups; ++g) {
        const float s = half_to_float(scales[o * w.groups + g]);
        zero_term += s * half_to_float(zeros[o * w.groups + g]) * zsum[g];
        for (int64_t b = 0; b < per_group; ++b, ++a) {
          __m512i acc = _mm512_setzero_si512();
          const int8_t* xa = q + a * kDecodeBlock;
          if constexpr (Bits == 4) {
            const __m512i c = _mm512_loadu_si512(row + a * kDecodeBlock / 2);
            acc = Vec::dot(acc, _mm512_and_si512(c, low), _mm512_loadu_si512(xa));
            acc = Vec::dot(acc, _mm512_and_si512(_mm512_srli_epi16(c, 4), low), _mm512_loadu_si512(xa + 64));
          } else {
            acc = Vec::dot(acc, _mm512_loadu_si512(row + a * kDecodeBlock), _mm512_loadu_si512(xa));
            acc = Vec::dot(acc, _mm512_loadu_si512(row + a * kDecodeBlock + 64), _mm512_loadu_si512(xa + 64));
          }
          total = _mm512_fmadd_ps(Vec::cvt(acc), _mm512_set1_ps(s * d[a]), total);
        }
      }
      out[n * w.out + o] = _mm512_reduce_add_ps(total) - zero_term + (bias ? bias[o] : 0.0f);
    }
  }
}

}  // namespace

bool int8_decode_kernels() { return true; }

size_t int8_decode_prepared_bytes(const QuantizedWeight& w, int64_t rows) {
  return static_cast<size_t>(rows * decode_row_bytes(w));
}

void int8_decode_prepare(const float* inp, const QuantizedWeight& w, int64_t N, void* prepared) {
  MT_ASSERT(rounds_decode_layout(w), "int8 decoding takes 4- or 8-bit codes in blocks of 128 within groups");
  const int64_t in = w.in, blocks = in / kDecodeBlock, per_group = w.group_size / kDecodeBlock;
  for (int64_t n = 0; n < N; ++n) {
    std::byte* x = static_cast<std::byte*>(prepared) + n * decode_row_bytes(w);
    auto* q = reinterpret_cast<int8_t*>(x);
    float* d = reinterpret_cast<float*>(x + in);
    float* zsum = d + blocks;
    std::fill(zsum, zsum + w.groups, 0.0f);
    for (int64_t a = 0; a < blocks; ++a) {
      alignas(64) int8_t plain[kDecodeBlock];
      d[a] = round_block_to_int8(inp + n * in + a * kDecodeBlock, kDecodeBlock, plain);
      int32_t sum = 0;
      for (int64_t i = 0; i < kDecodeBlock; ++i) sum += plain[i];
      zsum[a / per_group] += d[a] * static_cast<float>(sum);
      int8_t* y = q + a * kDecodeBlock;
      if (w.bits == 4) {  // byte 4i + j: input 8i + 2j (low half) and 8i + 2j + 1 (high half)
        for (int64_t b = 0; b < 64; ++b) {
          const int64_t k = 8 * (b / 4) + 2 * (b % 4);
          y[b] = plain[k];
          y[64 + b] = plain[k + 1];
        }
      } else {
        std::copy(plain, plain + kDecodeBlock, y);
      }
    }
  }
}

void int8_decode_rows(float* out, const void* prepared, const QuantizedWeight& w, const float* bias, int64_t N,
                      int64_t o0, int64_t o1) {
  const auto* x = static_cast<const std::byte*>(prepared);
  if (w.bits == 4)
    decode_rows<4>(out, x, w, bias, N, o0, o1);
  else
    decode_rows<8>(out, x, w, bias, N, o0, o1);
}
#endif

bool int8_activation_kernels() {
  return true;
}
const char* int8_activation_kernel() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "memtune int8 x int8 (AVX512-VNNI)";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
  return "memtune int8 x int8 (AVX-VNNI)";
#else
  return "memtune int8 x int8 (AVX2)";
#endif
}

#else  // no AVX2: quantized products keep float32 inputs

size_t int8_activation_scratch_bytes(int64_t, const QuantizedWeight&) {
  return 0;
}
void quantized_matmul_int8_activations(float*, const float*, const QuantizedWeight&, const float*, int64_t, void*,
                                       size_t) {
  MT_ASSERT(false, "int8 activations need AVX2");
}
bool int8_activation_kernels() {
  return false;
}
const char* int8_activation_kernel() { return ""; }

#endif

// Without AVX512-VNNI, decoding keeps float32 inputs (int8_decode is never set).
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
bool int8_decode_kernels() { return false; }
size_t int8_decode_prepared_bytes(const QuantizedWeight&, int64_t) { return 0; }
void int8_decode_prepare(const float*, const QuantizedWeight&, int64_t, void*) {
  MT_ASSERT(false, "int8 decoding needs AVX512-VNNI");
}
void int8_decode_rows(float*, const void*, const QuantizedWeight&, const float*, int64_t, int64_t, int64_t) {
  MT_ASSERT(false, "int8 decoding needs AVX512-VNNI");
}
#endif

}  // namespace memtune::cpu

// Matmuls with weight-only quantized weights (backend.h: QuantizedWeight) on the cpu backend.
//
// Few rows (decoding): the codes are read directly. Over a group, sum_k x_k s (q_k - z) =
// s (sum_k x_k q_k - z sum_k x_k), so the inner loop only turns codes into floats and multiplies
// them with the input; the sum of the input over each group is formed once per call. Sixteen
// int32 words of a row hold 16 x (32 / bits) consecutive inputs; field j of those words is the
// inputs 16 c + ... at stride 32 / bits, so the input is first permuted the same way (into the
// caller's scratch) and every field becomes one contiguous vector of 16 codes against one
// contiguous vector of 16 inputs (8-bit codes need no permutation: their bytes are already in
// input order). Inputs past the last whole chunk, groups that do not hold whole chunks, and
// act-order g_idx take a plain per-element loop.
//
// Many rows (prefill, training): kQuantizedTileRows output rows are dequantized into scratch and
// multiplied with OpenBLAS, so no float32 copy of the whole weight exists; or, where the weight
// asks for int8 activations (int8_activations.h), integer dot products (int8_activation_ops.cpp).
#include <cblas.h>
// GCC 12 reports its own _mm512_undefined_* placeholders as maybe-uninitialized where the
// intrinsics are inlined, so the warning is off for the whole file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backend/cpu/half_gemm.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/parallel.h"
#include "backend/cpu/simd.h"
#include "backend/int8_activations.h"
#include "backend/products.h"
#include "core/dtype.h"
#include "core/error.h"

namespace memtune::cpu {
namespace {

struct Layout {
  const uint32_t* codes;
  const uint16_t* scales;
  const uint16_t* zeros;
  const int32_t* g_idx;  // null: k / group_size
  int bits;
  int64_t in, out, group_size, groups;

  explicit Layout(const QuantizedWeight& w)
      : codes(w.codes.as<const uint32_t>()),
        scales(w.scales.as<const uint16_t>()),
        zeros(w.zeros.as<const uint16_t>()),
        g_idx(w.g_idx ? w.g_idx.i32() : nullptr),
        bits(w.bits),
        in(w.in),
        out(w.out),
        group_size(w.group_size),
        groups(w.groups) {}
  int per_word() const { return 32 / bits; }
  int64_t chunk() const { return 16 * per_word(); }  // inputs held by 16 words
  int64_t group(int64_t k) const { return g_idx ? g_idx[k] : k / group_size; }
  uint32_t code(int64_t n, int64_t k) const {
    const uint32_t word = codes[n * (in / per_word()) + k / per_word()];
    return (word >> (bits * (k % per_word()))) & ((1u << bits) - 1u);
  }
  float weight(int64_t n, int64_t k) const {
    const int64_t g = n * groups + group(k);
    return half_to_float(scales[g]) * (static_cast<float>(code(n, k)) - half_to_float(zeros[g]));
  }
  // The chunked path: whole chunks never straddle a group.
  bool chunked() const { return !g_idx && group_size % chunk() == 0; }
};

// The 16 codes of field j of the 16 words at `words`, as floats. 8-bit codes are bytes in input
// order in memory (word r holds inputs 4r .. 4r + 3, lowest byte first), so field j is simply
// bytes 16j .. 16j + 15 (one zero-extending load and a conversion; the input is not permuted for
// 8 bits). 4-bit codes: the shifted words index a table of the 16 values (vpermps reads only an
// index's low 4 bits: no mask, no conversion). Exact either way.
template <int Bits>
inline f32x16 codes_as_floats(const uint32_t* words, int j) {
  if constexpr (Bits == 8) {
    const uint8_t* at = reinterpret_cast<const uint8_t*>(words) + 16 * j;
#ifdef __AVX512F__
    return reinterpret_cast<f32x16>(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))));
#else
    u8x16 bytes;
    std::memcpy(&bytes, at, sizeof bytes);
    return __builtin_convertvector(__builtin_convertvector(bytes, u32x16), f32x16);
#endif
  } else {
    u32x16 w;
    std::memcpy(&w, words, sizeof w);
    keep_in_register(w);  // one load for the 8 fields, not a load folded into each shift
    const u32x16 shifted = w >> static_cast<uint32_t>(Bits * j);
#ifdef __AVX512F__
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return reinterpret_cast<f32x16>(_mm512_permutexvar_ps(reinterpret_cast<__m512i>(shifted), table));
#else
    return __builtin_convertvector(shifted & ((1u << Bits) - 1u), f32x16);
#endif
  }
}

// Whether the chunked path reads its input permuted (4 bits) or in input order (8 bits).
constexpr bool permuted_input(int bits) { return bits != 8; }

// Rows input rows (xp: permuted chunk by chunk where permuted_input; xsum: their sums per group
// over whole chunks) against output rows o .. o + WR - 1: each input vector loaded once serves the
// WR weight rows (one or two input rows would otherwise load an input vector per FMA).
template <int Bits, int Rows, int WR>
void chunked_block(float* out, int64_t OC, const float* xp, const float* xsum, const Layout& w, const float* bias,
                   int64_t o) {
  constexpr int P = 32 / Bits;
  constexpr int64_t K = 16 * P;
  const int64_t in = w.in, full = in / K, per_group = w.group_size / K;
  const uint32_t* rows[WR];
  for (int r = 0; r < WR; ++r) rows[r] = w.codes + (o + r) * (in / P);
  // Per lane until the end of the row: s * sum(x q) of every group, then one horizontal sum.
  // A independent accumulators per (row, input row) when there are few, so consecutive fields'
  // FMAs do not wait on each other's latency.
  constexpr int A = Rows * WR <= 2 ? 4 : Rows * WR <= 4 ? 2 : 1;
  f32x16 total[WR][Rows] = {};
  float zero_terms[WR][Rows] = {};  // sum over groups of s * z * sum(x)
  for (int64_t g = 0; g * per_group < full; ++g) {
    f32x16 acc[WR][Rows][A] = {};
    const int64_t c_end = std::min(full, (g + 1) * per_group);
    for (int64_t c = g * per_group; c < c_end; ++c) {
      for (int r = 0; r < WR; ++r)
        __builtin_prefetch(rows[r] + c * 16 + 1024 * WR);  // rows follow each other: cache lines ahead
#pragma GCC unroll 8  // GCC keeps some instances' fields in a loop, their vectors on the stack
      for (int j = 0; j < P; ++j) {
        f32x16 q[WR];
        for (int r = 0; r < WR; ++r) q[r] = codes_as_floats<Bits>(rows[r] + c * 16, j);
        for (int m = 0; m < Rows; ++m) {
          f32x16 x;
          std::memcpy(&x, xp + m * in + c * K + j * 16, sizeof x);
          if constexpr (WR > 1) keep_in_register(x);  // loaded once for its WR products
          for (int r = 0; r < WR; ++r) acc[r][m][j % A] += x * q[r];
        }
      }
    }
    for (int r = 0; r < WR; ++r) {
      const float s = half_to_float(w.scales[(o + r) * w.groups + g]);
      const float sz = s * half_to_float(w.zeros[(o + r) * w.groups + g]);
      for (int m = 0; m < Rows; ++m) {
        f32x16 sum = acc[r][m][0];
        for (int a = 1; a < A; ++a) sum += acc[r][m][a];
        total[r][m] += s * sum;
        zero_terms[r][m] += sz * xsum[m * w.groups + g];
      }
    }
  }
  for (int r = 0; r < WR; ++r) {
    float tail[Rows] = {};
    for (int64_t k = full * K; k < in; ++k) {  // past the last whole chunk: in input order
      const float wk = w.weight(o + r, k);
      for (int m = 0; m < Rows; ++m) tail[m] += xp[m * in + k] * wk;
    }
    for (int m = 0; m < Rows; ++m)
      out[m * OC + o + r] = hsum(total[r][m]) - zero_terms[r][m] + tail[m] + (bias ? bias[o + r] : 0.0f);
  }
}

// Up to 4 input rows go against two weight rows at once (their accumulators fit the registers).
template <int Bits, int WR>
void chunked_rows(float* out, int64_t OC, const float* xp, const float* xsum, const Layout& w, const float* bias,
                  int64_t rows, int64_t o) {
  switch (rows) {
    case 8: return chunked_block<Bits, 8, 1>(out, OC, xp, xsum, w, bias, o);
    case 7: return chunked_block<Bits, 7, 1>(out, OC, xp, xsum, w, bias, o);
    case 6: return chunked_block<Bits, 6, 1>(out, OC, xp, xsum, w, bias, o);
    case 5: return chunked_block<Bits, 5, 1>(out, OC, xp, xsum, w, bias, o);
    case 4: return chunked_block<Bits, 4, WR>(out, OC, xp, xsum, w, bias, o);
    case 3: return chunked_block<Bits, 3, WR>(out, OC, xp, xsum, w, bias, o);
    case 2: return chunked_block<Bits, 2, WR>(out, OC, xp, xsum, w, bias, o);
    case 1: return chunked_block<Bits, 1, WR>(out, OC, xp, xsum, w, bias, o);
    default: MT_ASSERT(false, "chunked_rows takes 1 to 8 rows");
  }
}

// Output rows a task takes at once. One input row goes against them one weight row after the
// other (4 accumulators), so each thread reads one sequential stream of codes; two input rows go
// against 4 weight rows at a time. Over cold weights the hardware prefetcher keeps one stream per
// thread going far better than 8 interleaved ones, as for the bfloat16 one-row kernel (ops.cpp);
// 4-bit codes gain less, being bound more by their arithmetic than by their bytes. Figures:
// docs/benchmarks.md.
constexpr int64_t kOutputsPerTask = 8;

// Output rows o .. o + count - 1 (count <= kOutputsPerTask) against all input rows, 8 at a time.
template <int Bits>
void chunked_outputs(float* out, int64_t OC, const float* xp, const float* xsum, const Layout& w, const float* bias,
                     int64_t N, int64_t o, int64_t count) {
  for (int64_t n0 = 0; n0 < N; n0 += 8) {
    const int64_t rows = std::min<int64_t>(8, N - n0);
    float* y = out + n0 * OC;
    const float* x = xp + n0 * w.in;
    const float* xs = xsum + n0 * w.groups;
    if (count == kOutputsPerTask && rows == 2) {  // 2 x 8 accumulators would not fit
      chunked_block<Bits, 2, kOutputsPerTask / 2>(y, OC, x, xs, w, bias, o);
      chunked_block<Bits, 2, kOutputsPerTask / 2>(y, OC, x, xs, w, bias, o + kOutputsPerTask / 2);
    } else if (rows >= 2 && rows <= 4) {
      int64_t r = 0;
      for (; r + 2 <= count; r += 2) chunked_rows<Bits, 2>(y, OC, x, xs, w, bias, rows, o + r);
      if (r < count) chunked_rows<Bits, 1>(y, OC, x, xs, w, bias, rows, o + r);
    } else {  // one weight row after the other (one input row: one sequential stream per thread)
      for (int64_t r = 0; r < count; ++r) chunked_rows<Bits, 1>(y, OC, x, xs, w, bias, rows, o + r);
    }
  }
}

// The per-element path: any groups, any g_idx.
void plain_row(float* out, int64_t OC, const float* inp, int64_t N, const Layout& w, const float* bias, int64_t o) {
  constexpr int64_t kRows = 16;
  for (int64_t n0 = 0; n0 < N; n0 += kRows) {
    const int64_t rows = std::min(kRows, N - n0);
    float total[kRows] = {};
    for (int64_t k = 0; k < w.in; ++k) {
      const float wk = w.weight(o, k);
      for (int64_t m = 0; m < rows; ++m) total[m] += inp[(n0 + m) * w.in + k] * wk;
    }
    for (int64_t m = 0; m < rows; ++m) out[(n0 + m) * OC + o] = total[m] + (bias ? bias[o] : 0.0f);
  }
}

// Scratch: the permuted input [N, in], then its sums per group [N, groups] (chunked layouts only).
void prepare_input(const float* inp, const Layout& w, int64_t N, float* scratch) {
  if (!w.chunked()) return;
  const int P = w.per_word();
  const int64_t in = w.in, K = w.chunk(), full = in / K, per_group = w.group_size / K;
  float* xp = scratch;
  float* xsum = scratch + N * in;
  for (int64_t m = 0; m < N; ++m) {
    const float* x = inp + m * in;
    float* y = xp + m * in;
    if (permuted_input(w.bits)) {
      for (int64_t c = 0; c < full; ++c)
        for (int j = 0; j < P; ++j)
          for (int lane = 0; lane < 16; ++lane) y[c * K + j * 16 + lane] = x[c * K + lane * P + j];
      std::copy(x + full * K, x + in, y + full * K);
    } else {
      std::copy(x, x + in, y);
    }
    for (int64_t g = 0; g < w.groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * per_group * K; k < std::min(full, (g + 1) * per_group) * K; ++k) s += x[k];
      xsum[m * w.groups + g] = s;
    }
  }
}

// A task: 2 x kOutputsPerTask output rows (the per-element path: 16 rows).
constexpr int64_t kTaskOutputs = 2 * kOutputsPerTask;

void run_task(float* out, const float* inp, const float* prepared, const Layout& w, const float* bias, int64_t N,
              int64_t t) {
  const int64_t OC = w.out, end = std::min(OC, (t + 1) * kTaskOutputs);
  if (!w.chunked()) {
    for (int64_t o = t * kTaskOutputs; o < end; ++o) plain_row(out, OC, inp, N, w, bias, o);
    return;
  }
  const float* xsum = prepared + N * w.in;
  for (int64_t o = t * kTaskOutputs; o < end; o += kOutputsPerTask) {
    const int64_t count = std::min(kOutputsPerTask, OC - o);
    if (w.bits == 4)
      chunked_outputs<4>(out, OC, prepared, xsum, w, bias, N, o, count);
    else
      chunked_outputs<8>(out, OC, prepared, xsum, w, bias, N, o, count);
  }
}

// Inputs k0 .. k0 + n of output row o as float32 into y (k0 and n whole words): each word's codes
// as floats, then each group's scale and zero applied to its run of inputs.
void dequantize_piece(float* y, const Layout& w, int64_t o, int64_t k0, int64_t n) {
  const int P = w.per_word();
  const uint32_t mask = (1u << w.bits) - 1u;
  const uint32_t* words = w.codes + o * (w.in / P) + k0 / P;
  for (int64_t c = 0; c < n / P; ++c)
    for (int j = 0; j < P; ++j) y[c * P + j] = static_cast<float>((words[c] >> (w.bits * j)) & mask);
  for (int64_t i = 0; i < n;) {
    const int64_t g = w.group(k0 + i);
    const int64_t run = w.g_idx ? 1 : std::min(n - i, (g + 1) * w.group_size - (k0 + i));
    const float s = half_to_float(w.scales[o * w.groups + g]), z = half_to_float(w.zeros[o * w.groups + g]);
    for (int64_t e = i; e < i + run; ++e) y[e] = s * (y[e] - z);
    i += run;
  }
}

// Output rows o0 .. o0 + rows of the weight as float32 [rows, in].
void dequantize_rows(float* tile, const Layout& w, int64_t o0, int64_t rows) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) dequantize_piece(tile + r * w.in, w, o0 + r, 0, w.in);
}

// The same rows as bfloat16 [rows, in] (the float32 values rounded to nearest even), a piece of a
// row at a time through a float32 buffer on the stack.
void dequantize_rows_bf16(uint16_t* tile, const Layout& w, int64_t o0, int64_t rows) {
  constexpr int64_t kPiece = 256;  // a multiple of every per_word()
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float y[kPiece];
    for (int64_t k0 = 0; k0 < w.in; k0 += kPiece) {
      const int64_t n = std::min(kPiece, w.in - k0);
      dequantize_piece(y, w, o0 + r, k0, n);
      convert_from_f32(y, tile + r * w.in + k0, DType::BF16, static_cast<size_t>(n));
    }
  }
}

// Products of many rows with bfloat16 operands (int8_activations.h: rounds_to_bfloat16) through
// oneDNN, which runs them on the CPU's matrix unit (AMX tiles, AVX512-BF16). The float32 tile
// scratch (kQuantizedTileRows x in floats) holds a tile of kTile weight rows widened to bfloat16,
// a block of input rows rounded to bfloat16 and the block's dense [rows, kTile] output, which is
// copied into place (a tile-unit kernel takes no output that is a slice of a wider one).
void quantized_matmul_bf16(float* out, const float* inp, const QuantizedWeight& weight, const float* bias, int64_t N,
                           float* scratch) {
  constexpr int64_t kTile = kQuantizedTileRows / 2;
  const Layout w(weight);
  const int64_t OC = w.out, C = w.in;
  // Bytes: tile 2 kTile C, input block 2 R C, output block 4 R kTile, within 4 kQuantizedTileRows C.
  const int64_t budget = 4 * kQuantizedTileRows * C - 2 * kTile * C;
  const int64_t R = std::max<int64_t>(1, budget / (2 * C + 4 * kTile));
  auto* tile = reinterpret_cast<uint16_t*>(scratch);
  uint16_t* x16 = tile + kTile * C;
  auto* block = reinterpret_cast<float*>(x16 + R * C);
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    const int64_t rows = std::min(R, N - n0);
    convert_from_f32(inp + n0 * C, x16, DType::BF16, static_cast<size_t>(rows * C));
    for (int64_t o0 = 0; o0 < OC; o0 += kTile) {
      const int64_t t = std::min(kTile, OC - o0);
      dequantize_rows_bf16(tile, w, o0, t);
      half_gemm(ProductFamily::Prefill, DType::BF16, rows, t, C, {x16, C, 1}, {tile, 1, C}, block, t, false);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + (n0 + r) * OC + o0;
        const float* src = block + r * t;
        for (int64_t o = 0; o < t; ++o) dst[o] = src[o] + (bias ? bias[o0 + o] : 0.0f);
      }
    }
  }
}

}  // namespace

void QuantizedSkinny::prepare(const float* in, float* scratch) {
  inp = in;
  prepared = scratch;
  if (rounds_activations(*weight, N))
    int8_decode_prepare(in, *weight, N, scratch);
  else
    prepare_input(in, Layout(*weight), N, scratch);
}

int64_t QuantizedSkinny::tasks() const { return (weight->out + kTaskOutputs - 1) / kTaskOutputs; }

void QuantizedSkinny::run(int64_t task) const {
  if (rounds_activations(*weight, N))
    return int8_decode_rows(out, prepared, *weight, bias, N, task * kTaskOutputs,
                            std::min(weight->out, (task + 1) * kTaskOutputs));
  run_task(out, inp, prepared, Layout(*weight), bias, N, task);
}

bool same_input_layout(const QuantizedWeight& a, const QuantizedWeight& b) {
  const Layout x(a), y(b);
  return x.chunked() && y.chunked() && x.bits == y.bits && x.in == y.in && x.group_size == y.group_size &&
         a.int8_activations == b.int8_activations && a.int8_decode == b.int8_decode &&
         a.bf16_products == b.bf16_products;
}

void quantized_matmul_forward(float* out, const float* inp, const QuantizedWeight& weight, const float* bias,
                              int64_t N, float* scratch) {
  const Layout w(weight);
  if (N <= kSixteenBitWeightRows) {
    QuantizedSkinny m{out, &weight, bias, N, nullptr, nullptr};
    m.prepare(inp, scratch);
    parallel_for_balanced(m.tasks(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) m.run(t);
    });
    return;
  }
  if (rounds_to_bfloat16(weight, N)) return quantized_matmul_bf16(out, inp, weight, bias, N, scratch);
  if (rounds_activations(weight, N) && int8_activation_kernels()) {
    const ProductTimer timer(ProductFamily::Prefill, int8_activation_kernel(), 2.0 * static_cast<double>(N) * w.out * w.in);
    return quantized_matmul_int8_activations(out, inp, weight, bias, N, scratch,
                                             static_cast<size_t>(kQuantizedTileRows * w.in) * sizeof(float));
  }
  const int64_t OC = w.out, C = w.in;
  for (int64_t o0 = 0; o0 < OC; o0 += kQuantizedTileRows) {
    const int64_t rows = std::min(kQuantizedTileRows, OC - o0);
    dequantize_rows(scratch, w, o0, rows);
    const ProductTimer timer(ProductFamily::Prefill, blas_kernel(), 2.0 * static_cast<double>(N) * rows * C);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(rows),
                static_cast<int>(C), 1.0f, inp, static_cast<int>(C), scratch, static_cast<int>(C), 0.0f, out + o0,
                static_cast<int>(OC));
  }
  if (!bias) return;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) out[n * OC + o] += bias[o];
}

void dequantize_weight_rows(float* out, const QuantizedWeight& weight, int64_t o0, int64_t rows) {
  dequantize_rows(out, Layout(weight), o0, rows);
}

void quantized_matmul_backward_input(float* dinp, const float* dout, const QuantizedWeight& weight, int64_t N,
                                     float* scratch) {
  const Layout w(weight);
  const int64_t OC = w.out, C = w.in;
  for (int64_t o0 = 0; o0 < OC; o0 += kQuantizedTileRows) {
    const int64_t rows = std::min(kQuantizedTileRows, OC - o0);
    dequantize_rows(scratch, w, o0, rows);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N), static_cast<int>(C),
                static_cast<int>(rows), 1.0f, dout + o0, static_cast<int>(OC), scratch, static_cast<int>(C), 1.0f,
                dinp, static_cast<int>(C));
  }
}

}  // namespace memtune::cpu

// CPU implementations of the ops in ops.h. See that header for conventions.
#include "backend/cpu/ops.h"
#include "backend/cpu/half_gemm.h"
#include "backend/cpu/parallel.h"
#include "backend/cpu/simd.h"

#include <cblas.h>
#include <fmt/format.h>
// GCC 12 reports its own _mm512_undefined_* placeholders as maybe-uninitialized where the
// intrinsics are inlined, so the warning is off for the whole file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

namespace memtune::cpu {

// Element-wise work below this many elements runs on the calling thread: opening a parallel
// region costs more than a decode step's norm, RoPE, residual add or SwiGLU over one token takes,
// and a decode step runs ~16 of them per layer (figures: docs/benchmarks.md).
constexpr int64_t kParallelMinElements = 32768;

// What OpenBLAS reports it runs: its own choice for this CPU, or OPENBLAS_CORETYPE's.
const char* blas_kernels() { return openblas_get_corename(); }

const std::string& blas_kernel() {
  static const std::string name = fmt::format("OpenBLAS sgemm ({})", blas_kernels());
  return name;
}

namespace {
double product_flops(int64_t M, int64_t N, int64_t K) { return 2.0 * static_cast<double>(M) * N * K; }
}  // namespace

// Sums rows of x[N, C] (float32, or 16-bit widened) into acc[C] (+=), parallel over column
// blocks so no two threads write the same element.
template <class Element>
static void column_sum_accumulate(float* acc, const Element* x, int64_t N, int64_t C, DType dtype = DType::F32) {
  constexpr int64_t kBlock = 64;
  int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const Element* row = x + n * C;
      if constexpr (std::is_same_v<Element, float>) {
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) acc[c] += row[c];
      } else {
        for (int64_t c = c0; c < c1; ++c) acc[c] += dtype == DType::BF16 ? bf16_to_f32(row[c]) : f16_to_f32(row[c]);
      }
    }
  }
}

void column_sums_accumulate(float* acc, const void* x, DType dtype, int64_t N, int64_t C) {
  if (dtype == DType::F32) return column_sum_accumulate(acc, static_cast<const float*>(x), N, C);
  column_sum_accumulate(acc, static_cast<const uint16_t*>(x), N, C, dtype);
}

void add_bias(float* out, const float* bias, int64_t N, int64_t OC) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* row = out + n * OC;
#pragma omp simd
    for (int64_t o = 0; o < OC; ++o) row[o] += bias[o];
  }
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC) {
  if (N == 0) return;
  {
    const ProductTimer timer(ProductFamily::Layers, blas_kernel(), product_flops(N, OC, C));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC);
  }
  if (bias) add_bias(out, bias, N, OC);
}

void matmul_accumulate(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                       float scale) {
  if (N == 0) return;
  const ProductTimer timer(ProductFamily::Layers, blas_kernel(), product_flops(N, OC, C));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, scale, inp, C, weight, C, 1.0f, out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, float scale) {
  if (N == 0) return;
  if (dinp) {
    const ProductTimer timer(ProductFamily::Layers, blas_kernel(), product_flops(N, C, OC));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, scale, dout, OC, weight, C, 1.0f, dinp, C);
  }
  if (dweight) {
    const ProductTimer timer(ProductFamily::Layers, blas_kernel(), product_flops(OC, C, N));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, scale, dout, OC, inp, C, 1.0f, dweight, C);
  }
  if (dbias) {
    MT_ASSERT(scale == 1.0f, "scaled bias gradients are not needed");
    column_sum_accumulate(dbias, dout, N, OC);
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C > kParallelMinElements)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
    float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[n] = r;
    float* y = out + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C) {
  // y = w * x * r, r = (mean(x^2) + eps)^-1/2
  // dx = r * (dy * w) - x * r^3 / C * sum(dy * w * x);  dw += dy * x * r
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float r = rstd[n];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) dot += dy[c] * weight[c] * x[c];
    float k = dot * r * r * r / static_cast<float>(C);
    float* dx = dinp + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dx[c] += r * dy[c] * weight[c] - k * x[c];
  }
  if (!dweight) return;
  constexpr int64_t kBlock = 64;
  int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float r = rstd[n];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dweight[c] += dy[c] * x[c] * r;
    }
  }
}

// Rotates each head's (x_i, x_{i+hd/2}) pair by +angle (forward) or -angle (backward). Angles are
// computed in float32 exactly as Hugging Face does: inv_freq = 1 / theta^(2i/hd), angle = pos * inv_freq.
static void rope_rotate(float* x, const int32_t* positions, int64_t N, int64_t heads, int64_t hd,
                        const float* inv_freq, float direction) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) if (N * heads * hd > kParallelMinElements)
  for (int64_t n = 0; n < N; ++n) {
    float pos = static_cast<float>(positions[n]);
    for (int64_t i = 0; i < half; ++i) {
      float angle = pos * inv_freq[i];
      float c = std::cos(angle), s = direction * std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x + n * heads * hd + h * hd;
        float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * c - x2 * s;
        head[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim, const float* inv_freq) {
  rope_rotate(x, positions, N, heads, head_dim, inv_freq, 1.0f);
}

void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t heads, int64_t head_dim,
                   const float* inv_freq) {
  rope_rotate(dx, positions, N, heads, head_dim, inv_freq, -1.0f);
}

namespace {
constexpr int64_t kKeyBlock = 64;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One query row's attention over keys first..last (inclusive) by online softmax over blocks of
// kKeyBlock keys: writes the output row and returns the log-sum-exp. key(j) and value(j) give
// row j of the head's keys and values as float32.
template <class Key, class Value>
float attend_row(float* out, const float* q, int64_t first, int64_t last, int64_t hd, float scale, Key key,
                 Value value) {
  float acc[kMaxAttentionHeadDim], scores[kKeyBlock];
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
  std::fill(acc, acc + hd, 0.0f);
  for (int64_t j0 = first; j0 <= last; j0 += kKeyBlock) {
    const int64_t j1 = std::min(last + 1, j0 + kKeyBlock);
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t j = j0; j < j1; ++j) {
      scores[j - j0] = dot(q, key(j), hd) * scale;
      block_max = std::max(block_max, scores[j - j0]);
    }
    const float new_m = std::max(m, block_max);
    const float correction = std::exp(m - new_m);
    l *= correction;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) acc[d] *= correction;
    for (int64_t j = j0; j < j1; ++j) {
      const float p = std::exp(scores[j - j0] - new_m);
      l += p;
      const float* vj = value(j);
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) acc[d] += p * vj[d];
    }
    m = new_m;
  }
  const float inv_l = 1.0f / l;
#pragma omp simd
  for (int64_t d = 0; d < hd; ++d) out[d] = acc[d] * inv_l;
  return m + std::log(l);
}
}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const int32_t* cu_seqlens, int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t hd) {
  MT_ASSERT(hd <= kMaxAttentionHeadDim && Hq % Hkv == 0);
  const int64_t qd = Hq * hd, kvd = Hkv * hd, group = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // One task per (sequence, query head); each query row runs an online softmax over key blocks.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
      const int64_t g = h / group;
      const auto key = [&](int64_t j) { return k + j * kvd + g * hd; };
      const auto value = [&](int64_t j) { return v + j * kvd + g * hd; };
      for (int64_t i = begin; i < end; ++i)
        lse[i * Hq + h] = attend_row(out + i * qd + h * hd, q + i * qd + h * hd, begin, i, hd, scale, key, value);
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const int32_t* cu_seqlens, int64_t num_seqs,
                        int64_t Hq, int64_t Hkv, int64_t hd) {
  MT_ASSERT(hd <= kMaxAttentionHeadDim && Hq % Hkv == 0);
  const int64_t qd = Hq * hd, kvd = Hkv * hd, group = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // One task per (sequence, KV head): it owns dk/dv of that head and dq of the query heads of its
  // group, so no two tasks write the same element.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
      for (int64_t j = begin; j < end; ++j) {
        std::fill(dk + j * kvd + g * hd, dk + j * kvd + (g + 1) * hd, 0.0f);
        std::fill(dv + j * kvd + g * hd, dv + j * kvd + (g + 1) * hd, 0.0f);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = begin; i < end; ++i) {
          const float* qi = q + i * qd + h * hd;
          const float* doi = dout + i * qd + h * hd;
          float* dqi = dq + i * qd + h * hd;
          std::fill(dqi, dqi + hd, 0.0f);
          const float Di = dot(doi, out + i * qd + h * hd, hd);
          const float lse_i = lse[i * Hq + h];
          for (int64_t j = begin; j <= i; ++j) {
            const float* kj = k + j * kvd + g * hd;
            const float* vj = v + j * kvd + g * hd;
            const float p = std::exp(dot(qi, kj, hd) * scale - lse_i);
            const float dp = dot(doi, vj, hd);
            const float ds = p * (dp - Di) * scale;
            float* dkj = dk + j * kvd + g * hd;
            float* dvj = dv + j * kvd + g * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) {
              dqi[d] += ds * kj[d];
              dkj[d] += ds * qi[d];
              dvj[d] += p * doi[d];
            }
          }
        }
      }
    }
  }
}

namespace {

// How a weight is stored, as a template argument: the inner loop then holds no branch and no
// call, and its accumulators stay in registers.
enum class Stored { F32, BF16, F16 };

template <Stored S>
using StoredType = std::conditional_t<S == Stored::F32, float, uint16_t>;

// 16 weights as float32 lanes.
template <Stored S>
inline f32x16 load16(const StoredType<S>* w) {
  if constexpr (S == Stored::F32) {
    f32x16 v;
    std::memcpy(&v, w, sizeof v);
    return v;
  } else if constexpr (S == Stored::BF16) {
#ifdef __AVX512F__
    // One zero-extending load and one shift (the generic vector conversion compiles to five
    // instructions: two half-width extensions and a merge).
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    return reinterpret_cast<f32x16>(_mm512_slli_epi32(wide, 16));
#else
    u16x16 h;
    std::memcpy(&h, w, sizeof h);
    return reinterpret_cast<f32x16>(__builtin_convertvector(h, u32x16) << 16);
#endif
  } else {
    f32x16 v;
    for (int i = 0; i < 16; ++i) v[i] = f16_to_f32(w[i]);
    return v;
  }
}
template <Stored S>
inline float widen(StoredType<S> w) {
  if constexpr (S == Stored::F32)
    return w;
  else if constexpr (S == Stored::BF16)
    return bf16_to_f32(w);
  else
    return f16_to_f32(w);
}

// Rows (up to 8) input rows against WR consecutive weight rows: every 16 columns each weight
// vector is loaded (and widened) once and each input vector once, and Rows x WR x U independent
// accumulators take the products (U > 1 when few, so the loop never waits on one chain).
template <int Rows, int WR, Stored S>
void skinny_block(float* out, const float* inp, const StoredType<S>* w, const float* bias, int64_t C, int64_t OC,
                  int64_t o) {
  constexpr int U = Rows * WR <= 2 ? 4 : Rows * WR <= 8 ? 2 : 1;
  f32x16 acc[Rows][WR][U] = {};
  int64_t c = 0;
  for (; c + 16 * U <= C; c += 16 * U) {
    if constexpr (WR > 1)
      for (int j = 0; j < WR; ++j) __builtin_prefetch(w + j * C + c + 2048);
    for (int u = 0; u < U; ++u) {
      f32x16 wv[WR];
      for (int j = 0; j < WR; ++j) wv[j] = load16<S>(w + j * C + c + 16 * u);
      for (int n = 0; n < Rows; ++n) {
        f32x16 x;
        std::memcpy(&x, inp + n * C + c + 16 * u, sizeof x);
        if constexpr (WR > 1) keep_in_register(x);  // loaded once for its WR products
        for (int j = 0; j < WR; ++j) acc[n][j][u] += x * wv[j];
      }
    }
  }
  for (; c + 16 <= C; c += 16)
    for (int j = 0; j < WR; ++j) {
      const f32x16 wv = load16<S>(w + j * C + c);
      for (int n = 0; n < Rows; ++n) {
        f32x16 x;
        std::memcpy(&x, inp + n * C + c, sizeof x);
        acc[n][j][0] += x * wv;
      }
    }
  for (int n = 0; n < Rows; ++n)
    for (int j = 0; j < WR; ++j) {
      f32x16 sum = acc[n][j][0];
      for (int u = 1; u < U; ++u) sum += acc[n][j][u];
      float s = hsum(sum);
      for (int64_t k = c; k < C; ++k) s += inp[n * C + k] * widen<S>(w[j * C + k]);
      out[n * OC + o + j] = s + (bias ? bias[o + j] : 0.0f);
    }
}

// All input rows against weight rows o..o+WR-1, kMax input rows at a time.
template <int WR, Stored S>
void skinny_rows(float* out, const float* inp, const StoredType<S>* w, const float* bias, int64_t N, int64_t C,
                 int64_t OC, int64_t o) {
  constexpr int kMax = WR >= 4 ? 4 : 8;  // Rows x WR accumulators within the register file
  int64_t n = 0;
  for (; n + kMax <= N; n += kMax) skinny_block<kMax, WR, S>(out + n * OC, inp + n * C, w, bias, C, OC, o);
  float* y = out + n * OC;
  const float* x = inp + n * C;
  switch (N - n) {
    case 7: if constexpr (kMax > 7) skinny_block<7, WR, S>(y, x, w, bias, C, OC, o); break;
    case 6: if constexpr (kMax > 6) skinny_block<6, WR, S>(y, x, w, bias, C, OC, o); break;
    case 5: if constexpr (kMax > 5) skinny_block<5, WR, S>(y, x, w, bias, C, OC, o); break;
    case 4: if constexpr (kMax > 4) skinny_block<4, WR, S>(y, x, w, bias, C, OC, o); break;
    case 3: skinny_block<3, WR, S>(y, x, w, bias, C, OC, o); break;
    case 2: skinny_block<2, WR, S>(y, x, w, bias, C, OC, o); break;
    case 1: skinny_block<1, WR, S>(y, x, w, bias, C, OC, o); break;
    default: break;
  }
}

// With one or two input rows the weights are the whole cost: every weight row once, in order (one
// sequential stream per thread, which runs near the memory bandwidth where several weight rows
// side by side do not). With more, several weight rows share each input vector loaded (the input
// rows of a wide layer live in L2, not L1), where one weight row at a time would load every input
// vector again for each weight row. For 16-bit weights three rows go against all 8 input rows
// at once (24 accumulators), so each weight vector is widened once for all of them rather than
// once per 4 input rows; float32 weights need no widening and keep four rows against 4 input rows
// at a time. Figures: docs/benchmarks.md.
// Tasks of output rows: 16 rows each with one or two input rows, 8 blocks of WR rows with more
// (the last task also takes the rows past the last whole block).
template <Stored S>
constexpr int64_t kBlockRows = S == Stored::F32 ? 4 : 3;
constexpr int64_t kRowsPerTask = 16, kBlocksPerTask = 8;

template <Stored S>
int64_t skinny_task_count(int64_t N, int64_t OC) {
  if (N <= 2) return (OC + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t blocks = OC / kBlockRows<S>;
  return std::max<int64_t>(1, (blocks + kBlocksPerTask - 1) / kBlocksPerTask);
}

template <Stored S>
void skinny_task(const SkinnyMatmul& m, int64_t t) {
  const auto* w = static_cast<const StoredType<S>*>(m.weight);
  const int64_t N = m.N, C = m.C, OC = m.OC;
  if (N <= 2) {
    for (int64_t o = t * kRowsPerTask; o < std::min(OC, (t + 1) * kRowsPerTask); ++o)
      skinny_rows<1, S>(m.out, m.inp, w + o * C, m.bias, N, C, OC, o);
    return;
  }
  constexpr int64_t WR = kBlockRows<S>;
  const int64_t blocks = OC / WR;
  for (int64_t b = t * kBlocksPerTask; b < std::min(blocks, (t + 1) * kBlocksPerTask); ++b)
    skinny_rows<WR, S>(m.out, m.inp, w + b * WR * C, m.bias, N, C, OC, b * WR);
  if (t == skinny_task_count<S>(N, OC) - 1)
    for (int64_t o = blocks * WR; o < OC; ++o) skinny_rows<1, S>(m.out, m.inp, w + o * C, m.bias, N, C, OC, o);
}

}  // namespace

int64_t SkinnyMatmul::tasks() const {
  switch (dtype) {
    case DType::F32: return skinny_task_count<Stored::F32>(N, OC);
    case DType::BF16: return skinny_task_count<Stored::BF16>(N, OC);
    case DType::F16: return skinny_task_count<Stored::F16>(N, OC);
    case DType::I32: break;
  }
  MT_ASSERT(false, "matmul_skinny needs a floating weight");
  return 0;
}

void SkinnyMatmul::run(int64_t task) const {
  switch (dtype) {
    case DType::F32: return skinny_task<Stored::F32>(*this, task);
    case DType::BF16: return skinny_task<Stored::BF16>(*this, task);
    case DType::F16: return skinny_task<Stored::F16>(*this, task);
    case DType::I32: break;
  }
  MT_ASSERT(false, "matmul_skinny needs a floating weight");
}

void matmul_skinny(float* out, const float* inp, const void* weight, DType dt, const float* bias, int64_t N,
                   int64_t C, int64_t OC) {
  const SkinnyMatmul m{out, inp, weight, dt, bias, N, C, OC};
  parallel_for_balanced(m.tasks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) m.run(t);
  });
}

void kv_cache_write(void* k_cache, void* v_cache, DType dt, const float* k, const float* v, const int32_t* slots,
                    int64_t N, int64_t kvd) {
  const size_t row_bytes = static_cast<size_t>(kvd) * dtype_size(dt);
#pragma omp parallel for schedule(static) if (N * kvd > kParallelMinElements)
  for (int64_t n = 0; n < N; ++n) {
    const size_t at = static_cast<size_t>(slots[n]) * row_bytes;
    convert_from_f32(k + n * kvd, static_cast<std::byte*>(k_cache) + at, dt, static_cast<size_t>(kvd));
    convert_from_f32(v + n * kvd, static_cast<std::byte*>(v_cache) + at, dt, static_cast<size_t>(kvd));
  }
}

namespace {

// The most query rows (positions x the query heads of one kv head) a paged-attention task holds
// online-softmax state for, on its stack.
constexpr int64_t kPagedTaskRows = 32;
constexpr int64_t kKeyTile = 16;  // keys per tile: one f32x16 of scores per query row

// Widens key rows j0..j0+n-1 of one kv head through the block table, and prefetches the next
// tile's rows below prefetch_until. Keys transposed (kt[d * 16 + t]: a query's 16 scores are hd
// broadcast FMAs, no horizontal sum), values as rows (vt[t * hd + d]).
void widen_key_tile(float* kt, float* vt, const void* k_cache, const void* v_cache, DType dt, const int32_t* table,
                    int64_t block_size, int64_t kvd, int64_t offset, int64_t hd, int64_t j0, int64_t n,
                    int64_t prefetch_until) {
  const size_t elem = dtype_size(dt), row_bytes = static_cast<size_t>(hd) * elem;
  auto slot = [&](int64_t j) {
    return static_cast<size_t>((int64_t{table[j / block_size]} * block_size + j % block_size) * kvd + offset) * elem;
  };
  for (int64_t t = 0; t < n; ++t) {
    const int64_t j = j0 + t;
    const size_t at = slot(j);
    const auto* kb = static_cast<const std::byte*>(k_cache) + at;
    const auto* vb = static_cast<const std::byte*>(v_cache) + at;
    if (t + kKeyTile < prefetch_until - j0) {  // the next tile's rows, while this one is computed
      const size_t next = slot(j + kKeyTile);
      for (size_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(static_cast<const std::byte*>(k_cache) + next + line);
        __builtin_prefetch(static_cast<const std::byte*>(v_cache) + next + line);
      }
    }
    float* v = vt + t * hd;
    if (dt == DType::F32) {
      const auto* k = reinterpret_cast<const float*>(kb);
      for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + t] = k[d];
      std::memcpy(v, vb, static_cast<size_t>(hd) * sizeof(float));
    } else {
      const auto* k = reinterpret_cast<const uint16_t*>(kb);
      const auto* vs = reinterpret_cast<const uint16_t*>(vb);
      if (dt == DType::BF16) {
        for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + t] = bf16_to_f32(k[d]);
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) v[d] = bf16_to_f32(vs[d]);
      } else {
        for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + t] = half_to_float(k[d]);
        for (int64_t d = 0; d < hd; ++d) v[d] = half_to_float(vs[d]);
      }
    }
  }
  for (int64_t t = n; t < kKeyTile; ++t)  // lanes past the last key: finite, and masked by position
    for (int64_t d = 0; d < hd; ++d) kt[d * kKeyTile + t] = 0.0f;
}

}  // namespace

void paged_attention_forward(float* out, const float* q, const void* k_cache, const void* v_cache, DType dt,
                             const int32_t* block_tables, int64_t max_blocks, const int32_t* cu_seqlens,
                             const int32_t* context_lens, int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t hd,
                             int64_t block_size) {
  MT_ASSERT(hd <= kMaxAttentionHeadDim && Hq % Hkv == 0 && Hq / Hkv <= kPagedTaskRows);
  const int64_t qd = Hq * hd, kvd = Hkv * hd, group = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // A task is (sequence, kv head, a few consecutive query positions): its rows are those
  // positions times the query heads sharing the kv head, so each key and value is read and widened
  // once for all of them (GQA: 7 query heads per kv head in Qwen2.5-0.5B) instead of once per head.
  const int64_t positions_per_task = kPagedTaskRows / group;
  int64_t max_chunks = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    max_chunks = std::max(max_chunks, (cu_seqlens[s + 1] - cu_seqlens[s] + positions_per_task - 1) / positions_per_task);
#pragma omp parallel for collapse(3) schedule(dynamic, 1)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t chunk = 0; chunk < max_chunks; ++chunk) {
        const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1], ctx = context_lens[s];
        const int64_t i0 = begin + chunk * positions_per_task;
        if (i0 >= end) continue;
        const int64_t i1 = std::min(end, i0 + positions_per_task), rows = (i1 - i0) * group;
        auto position = [&](int64_t r) { return ctx - (end - begin) + (i0 + r / group - begin); };
        auto row_offset = [&](int64_t r) { return (i0 + r / group) * qd + (g * group + r % group) * hd; };
        alignas(64) float kt[kMaxAttentionHeadDim * kKeyTile], vt[kKeyTile * kMaxAttentionHeadDim];
        alignas(64) float acc[kPagedTaskRows * kMaxAttentionHeadDim];
        float m[kPagedTaskRows], l[kPagedTaskRows];
        std::fill(acc, acc + rows * hd, 0.0f);
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        const int64_t last = position(rows - 1);
        const int32_t* table = block_tables + s * max_blocks;
        for (int64_t j0 = 0; j0 <= last; j0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, last + 1 - j0);
          widen_key_tile(kt, vt, k_cache, v_cache, dt, table, block_size, kvd, g * hd, hd, j0, n, last + 1);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = position(r);
            if (pos < j0) continue;
            const float* qr = q + row_offset(r);
            f32x16 part[4] = {};  // four chains, so the FMAs do not wait on each other
            int64_t d = 0;
            for (; d + 4 <= hd; d += 4)
              for (int64_t u = 0; u < 4; ++u) {
                f32x16 k;
                std::memcpy(&k, kt + (d + u) * kKeyTile, sizeof k);
                part[u] += qr[d + u] * k;
              }
            for (; d < hd; ++d) {
              f32x16 k;
              std::memcpy(&k, kt + d * kKeyTile, sizeof k);
              part[0] += qr[d] * k;
            }
            const f32x16 sc = (part[0] + part[1]) + (part[2] + part[3]);
            alignas(64) float p[kKeyTile];
            float tile_max = -std::numeric_limits<float>::infinity();
            for (int64_t t = 0; t < kKeyTile; ++t) {
              p[t] = j0 + t <= pos ? sc[t] * scale : -std::numeric_limits<float>::infinity();
              tile_max = std::max(tile_max, p[t]);
            }
            const float new_m = std::max(m[r], tile_max);
            const float correction = fast_exp(m[r] - new_m);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < kKeyTile; ++t) {
              p[t] = j0 + t <= pos ? fast_exp(p[t] - new_m) : 0.0f;
              sum += p[t];
            }
            l[r] = l[r] * correction + sum;
            m[r] = new_m;
            float* a = acc + r * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) a[d] *= correction;
            const int64_t valid = std::min(n, pos + 1 - j0);
            for (int64_t t = 0; t < valid; ++t) {
              const float pt = p[t];
              const float* v = vt + t * hd;
#pragma omp simd
              for (int64_t d = 0; d < hd; ++d) a[d] += pt * v[d];
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float inv_l = 1.0f / l[r];
          float* o = out + row_offset(r);
          const float* a = acc + r * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) o[d] = a[d] * inv_l;
        }
      }
    }
  }
}

void gather_rows(float* out, const float* inp, const int32_t* index, int64_t R, int64_t C) {
  for (int64_t r = 0; r < R; ++r) std::copy_n(inp + int64_t{index[r]} * C, C, out + r * C);
}

void combine_rows(float* out, const float* inp, const int32_t* rows, int64_t K, const float* weights, int64_t N,
                  int64_t C, int64_t R) {
  for (int64_t i = 0; rows && i < N * K; ++i)
    MT_ASSERT(rows[i] >= 0 && rows[i] < R, "combine_rows: a row outside the input");
#pragma omp parallel for schedule(static) if (N * K * C > kParallelMinElements)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = rows ? rows[n * K + k] : n;
      const float* x = inp + r * C;
      const float w = weights[r];
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += w * x[c];
    }
  }
}

void combine_rows_backward(float* dinp, float* dweights, const float* inp, const float* dout, const int32_t* tokens,
                           const float* weights, int64_t R, int64_t C, int64_t N) {
  for (int64_t r = 0; tokens && r < R; ++r)
    MT_ASSERT(tokens[r] >= 0 && tokens[r] < N, "combine_rows_backward: a token outside the output");
#pragma omp parallel for schedule(static) if (R * C > kParallelMinElements)
  for (int64_t r = 0; r < R; ++r) {
    const float* g = dout + (tokens ? int64_t{tokens[r]} : r) * C;
    const float* x = inp + r * C;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) dot += x[c] * g[c];
    dweights[r] = dot;
    const float w = weights[r];
    float* d = dinp + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) d[c] = w * g[c];
  }
}

void swiglu_forward(float* h, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    h[i] = g / (1.0f + fast_exp(-g)) * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dh, const float* gate, const float* up, int64_t n) {
  // silu(g) = g * sig(g); silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + fast_exp(-g));
    dgate[i] += dh[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    dup[i] += dh[i] * g * sig;
  }
}

void embedding_forward(float* out, const int32_t* ids, const void* table, DType table_dtype, int64_t N, int64_t D) {
  const auto* bytes = static_cast<const std::byte*>(table);
  const size_t row_bytes = static_cast<size_t>(D) * dtype_size(table_dtype);
#pragma omp parallel for schedule(static) if (N * D > kParallelMinElements)
  for (int64_t n = 0; n < N; ++n) convert_to_f32(bytes + ids[n] * row_bytes, table_dtype, out + n * D, D);
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t D) {
  // Repeated ids make rows collide, so split the work by columns, not tokens.
  constexpr int64_t kBlock = 64;
  int64_t blocks = (D + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t c0 = b * kBlock, c1 = std::min(D, c0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      float* row = dtable + static_cast<int64_t>(ids[n]) * D;
      const float* d = dout + n * D;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) row[c] += d[c];
    }
  }
}

void dropout_forward(float* out, const float* x, int64_t n, uint64_t key, float p) {
  const float scale = 1.0f / (1.0f - p);
  const uint64_t threshold = static_cast<uint64_t>(static_cast<double>(p) * 16777216.0);  // p in 24-bit units
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = mix64(key + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
    out[i] = (z >> 40) >= threshold ? x[i] * scale : 0.0f;
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

double scale_and_sum_squares(float* x, float s, int64_t n) {
  double sumsq = 0.0;
#pragma omp parallel for simd reduction(+ : sumsq) schedule(static) if (n > kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) {
    x[i] *= s;
    sumsq += static_cast<double>(x[i]) * x[i];
  }
  return sumsq;
}

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step) {
  const AdamWConfig& c = step.config;
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const double bias1 = 1.0 - std::pow(c.beta1, static_cast<double>(step.t));
  const double bias2 = 1.0 - std::pow(c.beta2, static_cast<double>(step.t));
  const float step_size = static_cast<float>(step.learning_rate / bias1);
  const float inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  const float eps = static_cast<float>(c.eps);
  const float keep = step.decay ? static_cast<float>(1.0 - step.learning_rate * c.weight_decay) : 1.0f;
  const float grad_scale = step.grad_scale;
#pragma omp parallel for simd schedule(static) if (n > kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(v[i]) * inv_sqrt_bias2 + eps;
    param[i] = param[i] * keep - step_size * m[i] / denom;
  }
}

namespace {

// The LM head's weight as float32 slices of vocabulary rows: the weight itself when it is
// float32, otherwise each slice widened (or dequantized, a packed head) into the workspace right
// before use.
inline constexpr int64_t kF32HeadSliceRows = 4096;

class HeadSlices {
 public:
  explicit HeadSlices(const LmHeadArgs& a) : a_(a), V_(a.vocab()), D_(a.hidden_size()) {
    MT_ASSERT(in_place() || (a.weight_slice && a.weight_slice.rows() > 0), "a 16-bit or packed head needs a slice buffer");
  }
  bool in_place() const { return !a_.quantized && a_.weight.dtype == DType::F32; }
  // A float32 head is read in place, but still a slice at a time: OpenBLAS packs a whole operand
  // into buffers of its own per thread, beyond the plan (a [vocab, hidden] gradient GEMM would
  // pack about the whole head once per thread; docs/benchmarks.md), a slice keeps that to a
  // slice's worth.
  int64_t slice_rows() const {
    return in_place() ? std::min<int64_t>(V_, kF32HeadSliceRows) : a_.weight_slice.rows();
  }
  const float* slice(int64_t v0, int64_t v1) const {
    if (in_place()) return a_.weight.as<const float>() + v0 * D_;
    if (a_.quantized) {
      dequantize_weight_rows(a_.weight_slice.as<float>(), *a_.quantized, v0, v1 - v0);
      return a_.weight_slice.as<float>();
    }
    const auto* bytes = a_.weight.as<const std::byte>() + v0 * D_ * dtype_size(a_.weight.dtype);
    convert_to_f32(bytes, a_.weight.dtype, a_.weight_slice.as<float>(), static_cast<size_t>((v1 - v0) * D_));
    return a_.weight_slice.as<float>();
  }

 private:
  const LmHeadArgs& a_;
  int64_t V_, D_;
};

}  // namespace

// The 16-bit head's products in their strided layout run over slices of this many vocabulary
// rows (the logits product; the backward products take the whole chunk). Measured
// (docs/benchmarks.md): for the whole vocabulary oneDNN 2.6 picks its brgemm kernel, at 250
// GFLOP/s against 330-365 for slices of 4096-32768 rows, which get its jit gemm (AVX512-BF16).
inline constexpr int64_t kHalfHeadSliceRows = 16384;

HeadProducts head_products(DType operands) {
  // The switch is read before anything decides, so a bad value is an error on every CPU.
  const char* env = std::getenv("MEMTUNE_HEAD_PRODUCTS");
  const std::string asked = env && *env ? env : "auto";
  if (asked != "auto" && asked != "dense" && asked != "strided")
    throw Error(fmt::format("MEMTUNE_HEAD_PRODUCTS: expected auto, dense or strided, got '{}'", asked));
  if (operands == DType::F32 || half_gemm_kernel(operands).empty()) return HeadProducts::Strided;
  if (asked == "dense") return HeadProducts::Dense;
  if (asked == "strided") return HeadProducts::Strided;
  // A representative slice: the hidden size does not change which unit oneDNN runs it on.
  return tile_unit_kernel(half_gemm_kernel(operands, 256, kDenseHeadSliceRows, 1024, kDenseHeadSliceRows))
             ? HeadProducts::Dense
             : HeadProducts::Strided;
}

namespace {

// The 16-bit head's products, strided: each vocabulary slice's logits written in place into the
// [m, V] chunk (leading dimension V), the loss's gradient rounded in place (each row's 16-bit
// values in the first half of its own bytes, a row stride of 2V) where both backward products read it.
void half_head_strided(const LmHeadArgs& a, int64_t m, const uint16_t* rows16, float* logits, bool backward) {
  const int64_t V = a.vocab(), D = a.hidden_size();
  const DType half = a.operands;
  const auto* w = a.weight.as<const uint16_t>();
  if (!backward) {
    for (int64_t v0 = 0; v0 < V; v0 += kHalfHeadSliceRows) {
      const int64_t v1 = std::min(V, v0 + kHalfHeadSliceRows);
      half_gemm(ProductFamily::HeadForward, half, m, v1 - v0, D, {rows16, D, 1}, {w + v0 * D, 1, D}, logits + v0, V,
                false);
    }
    return;
  }
  round_rows_in_place(logits, m, V, V, half, a.grad_scale);
  half_gemm(ProductFamily::HeadInputGradient, half, m, D, V, {logits, 2 * V, 1}, {w, D, 1}, a.drows.as<float>(), D,
            false);
  if (a.dweight)
    half_gemm(ProductFamily::HeadWeightGradient, half, V, D, m, {logits, 1, 2 * V}, {rows16, D, 1},
              a.dweight.as<float>(), D, true);
}

// The same products, dense: every operand and output of a product is a dense matrix, which some
// kernels need (oneDNN's tile-unit kernels refuse a slice of a wider output). The logits of a
// vocabulary slice are computed into the product slice buffer [m, S] and copied into the chunk;
// the loss's gradient is rounded a slice at a time into that buffer, where both backward products
// read it (d(hidden rows) summed over the slices).
void half_head_dense(const LmHeadArgs& a, int64_t m, const uint16_t* rows16, float* logits, bool backward) {
  const int64_t V = a.vocab(), D = a.hidden_size(), S = a.product_slice.cols();
  MT_ASSERT(a.product_slice.rows() >= m && S > 0, "dense head products need the product slice buffer");
  const DType half = a.operands;
  const auto* w = a.weight.as<const uint16_t>();
  float* slice = a.product_slice.as<float>();
  auto* slice16 = a.product_slice.as<uint16_t>();
  for (int64_t v0 = 0; v0 < V; v0 += S) {
    const int64_t n = std::min(S, V - v0);
    if (!backward) {
      half_gemm(ProductFamily::HeadForward, half, m, n, D, {rows16, D, 1}, {w + v0 * D, 1, D}, slice, n, false);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < m; ++r) std::memcpy(logits + r * V + v0, slice + r * n, static_cast<size_t>(n) * 4);
      continue;
    }
    round_rows(logits + v0, m, n, V, slice16, n, half, a.grad_scale);
    half_gemm(ProductFamily::HeadInputGradient, half, m, D, n, {slice16, n, 1}, {w + v0 * D, D, 1},
              a.drows.as<float>(), D, v0 > 0);
    if (a.dweight)
      half_gemm(ProductFamily::HeadWeightGradient, half, n, D, m, {slice16, 1, n}, {rows16, D, 1},
                a.dweight.as<float>() + v0 * D, D, true);
  }
}

}  // namespace

// With 16-bit operands (LmHeadArgs::operands: mixed precision) the hidden rows are rounded as
// they are gathered (into the first half of the float32 rows buffer) and the head is read in place
// as stored; d(logits) x grad_scale is rounded to 16 bits where the backward products read it
// (half_head_strided / half_head_dense). Logits and gradients accumulate in float32 either way.
LossSum lm_head_loss(const LmHeadArgs& a) {
  const int64_t chunk_rows = a.logits.rows(), V = a.vocab(), D = a.hidden_size(), N = a.hidden.rows();
  MT_ASSERT(chunk_rows > 0);
  const bool backward = static_cast<bool>(a.dhidden);
  const DType half = a.operands;
  MT_ASSERT(half == DType::F32 || (!a.quantized && a.weight.dtype == half),
            "16-bit head products need the head stored in that dtype");
  std::optional<HeadSlices> head;
  if (half == DType::F32) head.emplace(a);
  const auto half_products = half == DType::F32 ? nullptr
                             : a.product_slice  ? half_head_dense
                                                : half_head_strided;
  const int64_t S = head ? head->slice_rows() : V;
  const float* hidden = a.hidden.as<const float>();
  const int32_t* targets = a.targets.as<const int32_t>();
  float* logits = a.logits.as<float>();
  float* rows = a.rows.as<float>();
  auto* rows16 = a.rows.as<uint16_t>();
  float* drows = a.drows.as<float>();
  int32_t* positions = a.positions.as<int32_t>();
  int32_t* row_targets = a.row_targets.as<int32_t>();
  float* dhidden = a.dhidden.as<float>();
  float* dweight = a.dweight.as<float>();
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] == kIgnoreIndex) continue;
    MT_ASSERT(targets[n] >= 0 && targets[n] < V, "target id out of range");
    positions[count++] = static_cast<int32_t>(n);
  }
  if (backward) std::fill(dhidden, dhidden + N * D, 0.0f);

  double total = 0.0;
  for (int64_t c0 = 0; c0 < count; c0 += chunk_rows) {
    const int64_t m = std::min(chunk_rows, count - c0);
    const int32_t* pos = positions + c0;
    if (head) {
      for (int64_t r = 0; r < m; ++r) std::copy_n(hidden + pos[r] * D, D, rows + r * D);
      for (int64_t v0 = 0; v0 < V; v0 += S) {
        const int64_t v1 = std::min(V, v0 + S);
        const float* w = head->slice(v0, v1);
        const ProductTimer timer(ProductFamily::HeadForward, blas_kernel(), product_flops(m, v1 - v0, D));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, v1 - v0, D, 1.0f, rows, D, w, D, 0.0f, logits + v0, V);
      }
    } else {  // logits[m, V] = rows[m, D] @ W[V, D]^T
      for (int64_t r = 0; r < m; ++r)
        convert_from_f32(hidden + pos[r] * D, rows16 + r * D, half, static_cast<size_t>(D));
      half_products(a, m, rows16, logits, false);
    }

    for (int64_t r = 0; r < m; ++r) row_targets[r] = targets[pos[r]];
    if (a.observer) {
      RowStats* stats = a.row_stats.as<RowStats>() + c0;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < m; ++r) stats[r] = row_stats(logits + r * V, V, row_targets[r]);
      a.observer->observe_rows({stats, row_targets, pos, m});
      if (a.observer->needs_logits()) a.observer->observe({logits, row_targets, pos, m, V});
    }
    total += a.loss->chunk(logits, row_targets, m, V, backward);
    if (!backward) continue;
    // drows = dlogits @ W and dW += dlogits^T @ rows (float32: one vocabulary slice at a time).
    if (head) {
      for (int64_t v0 = 0; v0 < V; v0 += S) {
        const int64_t v1 = std::min(V, v0 + S);
        const float* w = head->slice(v0, v1);
        {
          const ProductTimer timer(ProductFamily::HeadInputGradient, blas_kernel(), product_flops(m, D, v1 - v0));
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, D, v1 - v0, a.grad_scale, logits + v0, V, w, D,
                      v0 == 0 ? 0.0f : 1.0f, drows, D);
        }
        if (dweight) {
          const ProductTimer timer(ProductFamily::HeadWeightGradient, blas_kernel(), product_flops(v1 - v0, D, m));
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v1 - v0, D, m, a.grad_scale, logits + v0, V, rows, D,
                      1.0f, dweight + v0 * D, D);
        }
      }
    } else {
      half_products(a, m, rows16, logits, true);
    }
    for (int64_t r = 0; r < m; ++r) std::copy_n(drows + r * D, D, dhidden + pos[r] * D);
  }
  return LossSum{total, count};
}

}  // namespace memtune::cpu

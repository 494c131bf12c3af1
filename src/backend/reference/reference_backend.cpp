// Reference implementations of backend.h. Each op opens an Access scope, which makes the
// backend's memory readable and writable for the duration of the call and inaccessible again
// when the outermost scope closes.
#include "backend/reference/reference_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/int8_activations.h"
#include "core/labels.h"
#include "core/rng.h"

namespace memtune {
namespace {

double element(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32:
      return t.as<const float>()[i];
    case DType::BF16:
      return bf16_to_f32(t.as<const uint16_t>()[i]);
    case DType::F16:
      return f16_to_f32(t.as<const uint16_t>()[i]);
    case DType::I32:
      return t.as<const int32_t>()[i];
  }
  return 0;
}

// v rounded to a 16-bit dtype (as a 16-bit operand is), or v itself for F32.
double rounded(float v, DType dtype) {
  if (dtype == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (dtype == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

class ReferenceBackend final : public Backend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string sixteen_bit_products(DType dtype) const override {
    return dtype == DType::BF16 || dtype == DType::F16 ? "exact products summed in float64" : "";
  }

  void* allocate(size_t bytes) override {
    void* p = map_host_pages(bytes);
    regions_.push_back({p, bytes});
    if (depth_ == 0) protect(regions_.back(), PROT_NONE);
    return p;
  }
  void deallocate(void* base, size_t bytes) override {
    munmap(base, bytes);
    std::erase_if(regions_, [&](const Region& r) { return r.base == base; });
  }
  bool host_addressable() const override { return false; }
  bool memory_in_host_pages() const override { return true; }
  // The cpu backend's split, so that a model plans and computes the same paths on both and the
  // comparisons between them compare like with like; the formulas need no scratch.
  int64_t stored_weight_rows() const override { return cpu_backend().stored_weight_rows(); }
  size_t quantized_scratch_elems(int64_t in) const override { return cpu_backend().quantized_scratch_elems(in); }
  size_t quantized_scratch_used(int64_t, int64_t) const override { return 0; }

  void copy_to_device(const Tensor& dst, const void* src) override {
    Access a(*this);
    std::memcpy(dst.data, src, dst.bytes());
  }
  void copy_to_host(void* dst, const Tensor& src) override {
    Access a(*this);
    std::memcpy(dst, src.data, src.bytes());
  }
  void copy(const Tensor& dst, const Tensor& src) override {
    Access a(*this);
    MT_ASSERT(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy between views of different size or dtype");
    std::memmove(dst.data, src.data, src.bytes());
  }
  void convert(const Tensor& dst, const Tensor& src) override {
    Access a(*this);
    MT_ASSERT(dst.numel() == src.numel(), "convert between views of different sizes");
    for (int64_t i = 0; i < src.numel(); ++i) store(dst, i, element(src, i));
  }
  void fill(const Tensor& dst, float value) override {
    Access a(*this);
    std::fill_n(dst.f32(), dst.numel(), value);
  }
  void fill_bytes(void* device, unsigned char byte, size_t bytes) override {
    Access a(*this);
    std::memset(device, byte, bytes);
  }

  void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& w, const Tensor& bias) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols(), OC = w.rows();
    MT_ASSERT(w.cols() == C && out.rows() == N && out.cols() == OC);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = bias ? bias.f32()[o] : 0.0;
        for (int64_t c = 0; c < C; ++c) s += element(inp, n * C + c) * element(w, o * C + c);
        out.f32()[n * OC + o] = static_cast<float>(s);
      }
  }
  // Quantized weights: each element dequantized from its code, scale and zero as the layout's
  // formula says (backend.h: QuantizedWeight); scratch is not needed.
  void quantized_matmul_forward(const Tensor& out, const Tensor& inp, const QuantizedWeight& w, const Tensor& bias,
                                const Tensor&) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols(), OC = w.out;
    MT_ASSERT(w.in == C && out.rows() == N && out.cols() == OC);
    // With int8 activations or bfloat16 operands, the operands as rounded (int8_activations.h), then
    // the same float64 sums.
    std::vector<float> rounded;
    const float* x = inp.f32();
    const bool bf16 = rounds_to_bfloat16(w, N);
    if (bf16) {  // bfloat16 operands: the input and each dequantized weight rounded, exact sums
      rounded.resize(static_cast<size_t>(N * C));
      for (int64_t i = 0; i < N * C; ++i) rounded[static_cast<size_t>(i)] = static_cast<float>(::memtune::rounded(x[i], DType::BF16));
      x = rounded.data();
    } else if (rounds_activations(w, N)) {
      const int64_t block = int8_activation_block(w);
      rounded.resize(static_cast<size_t>(N * C));
      std::vector<int8_t> q(static_cast<size_t>(block));
      for (int64_t b = 0; b < N * C; b += block) {
        const float d = round_block_to_int8(x + b, block, q.data());
        for (int64_t i = 0; i < block; ++i) rounded[static_cast<size_t>(b + i)] = d * static_cast<float>(q[i]);
      }
      x = rounded.data();
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = bias ? element(bias, o) : 0.0;
        for (int64_t c = 0; c < C; ++c) {
          const double wv = dequantized(w, o, c);
          s += double(x[n * C + c]) * (bf16 ? ::memtune::rounded(static_cast<float>(wv), DType::BF16) : wv);
        }
        out.f32()[n * OC + o] = static_cast<float>(s);
      }
  }
  bool takes_int8_activations() const override { return true; }
  // As the cpu backend of this build decides (its decoding kernels need AVX512-VNNI), so the two
  // compute decoding's products with the same operands.
  bool takes_int8_decode_activations() const override { return cpu_backend().takes_int8_decode_activations(); }
  std::string bf16_quantized_products() const override { return "exact products summed in float64"; }
  void quantized_matmul_backward_input(const Tensor& dinp, const Tensor& dout, const QuantizedWeight& w,
                                       const Tensor&) override {
    Access a(*this);
    const int64_t N = dout.rows(), C = w.in, OC = w.out;
    MT_ASSERT(dout.cols() == OC && dinp.rows() == N && dinp.cols() == C);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double s = 0.0;
        for (int64_t o = 0; o < OC; ++o) s += double(dout.f32()[n * OC + o]) * dequantized(w, o, c);
        dinp.f32()[n * C + c] += static_cast<float>(s);
      }
  }
  void matmul_accumulate(const Tensor& out, const Tensor& inp, const Tensor& w, float scale) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols(), OC = w.rows();
    MT_ASSERT(w.cols() == C && out.rows() == N && out.cols() == OC);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = 0.0;
        for (int64_t c = 0; c < C; ++c) s += double(inp.f32()[n * C + c]) * w.f32()[o * C + c];
        out.f32()[n * OC + o] += static_cast<float>(scale * s);
      }
  }
  void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& w, float scale) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols(), OC = w.rows();
    MT_ASSERT(w.cols() == C && dout.rows() == N && dout.cols() == OC);
    // 16-bit operands (mixed precision) are read as stored: their products are exact in float64.
    MT_ASSERT(dout.dtype == DType::F32 || (w.dtype == dout.dtype && (!dweight || inp.dtype == dout.dtype)));
    auto dy = [&](int64_t i) { return element(dout, i); };
    if (dinp)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) {
          double s = 0.0;
          for (int64_t o = 0; o < OC; ++o) s += dy(n * OC + o) * element(w, o * C + c);
          dinp.f32()[n * C + c] += static_cast<float>(scale * s);
        }
    if (dweight)
      for (int64_t o = 0; o < OC; ++o)
        for (int64_t c = 0; c < C; ++c) {
          double s = 0.0;
          for (int64_t n = 0; n < N; ++n) s += dy(n * OC + o) * element(inp, n * C + c);
          dweight.f32()[o * C + c] += static_cast<float>(scale * s);
        }
    if (dbias)
      for (int64_t o = 0; o < OC; ++o) {
        double s = 0.0;
        for (int64_t n = 0; n < N; ++n) s += dy(n * OC + o);
        dbias.f32()[o] += static_cast<float>(scale * s);
      }
  }

  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& w, float eps) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols();
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp.f32() + n * C;
      double ms = 0.0;
      for (int64_t c = 0; c < C; ++c) ms += double(x[c]) * x[c];
      const double r = 1.0 / std::sqrt(ms / double(C) + eps);
      rstd.f32()[n] = static_cast<float>(r);
      for (int64_t c = 0; c < C; ++c) out.f32()[n * C + c] = static_cast<float>(x[c] * r * w.f32()[c]);
    }
  }
  void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& rstd) override {
    Access a(*this);
    const int64_t N = inp.rows(), C = inp.cols();
    // y_c = w_c x_c r, r = (mean(x^2) + eps)^(-1/2):  dx_c = r (w_c dy_c - x_c r^2 mean_k(w_k dy_k x_k)).
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp.f32() + n * C;
      const float* dy = dout.f32() + n * C;
      const double r = rstd.f32()[n];
      double dot = 0.0;
      for (int64_t c = 0; c < C; ++c) dot += double(w.f32()[c]) * dy[c] * x[c];
      for (int64_t c = 0; c < C; ++c)
        dinp.f32()[n * C + c] += static_cast<float>(r * (w.f32()[c] * dy[c] - x[c] * r * r * dot / double(C)));
      if (dweight)
        for (int64_t c = 0; c < C; ++c) dweight.f32()[c] += static_cast<float>(double(dy[c]) * x[c] * r);
    }
  }

  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) override {
    rope(x, positions, inv_freq, 1.0);
  }
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) override {
    rope(dx, positions, inv_freq, -1.0);
  }

  // float16 operands (sixteen_bit_attention): q, k, v and dout rounded as the kernels load them,
  // the probabilities rounded before they multiply v (relative to the row's final maximum; a
  // FlashAttention kernel rounds them relative to its running maximum, within one rounding of
  // these), and ds rounded before it multiplies k and q; products summed in float64.
  std::string sixteen_bit_attention(DType dtype) const override {
    return dtype == DType::F16 ? "float16 operands rounded as loaded, exact products summed in float64" : "";
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    Access a(*this);
    const Heads h(q, k, hd);
    const Operand r{operands};
    for_each_query(cu_seqlens, [&](int64_t t, int64_t begin) {
      for (int64_t head = 0; head < h.q; ++head) {
        const std::vector<double> s = scores(q, k, h, t, begin, head, r);
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        std::vector<double> p;
        for (double x : s) {
          sum += std::exp(x - m);
          p.push_back(r(static_cast<float>(std::exp(x - m))));
        }
        lse.f32()[t * h.q + head] = static_cast<float>(m + std::log(sum));
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0.0;
          for (int64_t j = begin; j <= t; ++j) o += p[j - begin] * r(v.f32()[h.kv_index(j, head, d)]);
          out.f32()[h.q_index(t, head, d)] = static_cast<float>(o / sum);
        }
      }
    });
  }
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                          const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    Access a(*this);
    const Heads h(q, k, hd);
    const Operand r{operands};
    // p_j = exp(s_j - lse); ds_j = p_j (dout.v_j - dout.out) / sqrt(hd); dq += ds_j k_j; dk_j += ds_j q;
    // dv_j += p_j dout.
    std::vector<double> gq(dq.numel(), 0.0), gk(dk.numel(), 0.0), gv(dv.numel(), 0.0);
    const double scale = 1.0 / std::sqrt(double(hd));
    for_each_query(cu_seqlens, [&](int64_t t, int64_t begin) {
      for (int64_t head = 0; head < h.q; ++head) {
        const std::vector<double> s = scores(q, k, h, t, begin, head, r);
        double dot_out = 0.0;
        for (int64_t d = 0; d < hd; ++d)
          dot_out += double(dout.f32()[h.q_index(t, head, d)]) * out.f32()[h.q_index(t, head, d)];
        for (int64_t j = begin; j <= t; ++j) {
          const double p = std::exp(s[j - begin] - lse.f32()[t * h.q + head]);
          double dp = 0.0;
          for (int64_t d = 0; d < hd; ++d)
            dp += r(dout.f32()[h.q_index(t, head, d)]) * r(v.f32()[h.kv_index(j, head, d)]);
          const double ds = r(static_cast<float>(p * (dp - dot_out) * scale)), pr = r(static_cast<float>(p));
          for (int64_t d = 0; d < hd; ++d) {
            gq[h.q_index(t, head, d)] += ds * r(k.f32()[h.kv_index(j, head, d)]);
            gk[h.kv_index(j, head, d)] += ds * r(q.f32()[h.q_index(t, head, d)]);
            gv[h.kv_index(j, head, d)] += pr * r(dout.f32()[h.q_index(t, head, d)]);
          }
        }
      }
    });
    for (size_t i = 0; i < gq.size(); ++i) dq.f32()[i] = static_cast<float>(gq[i]);
    for (size_t i = 0; i < gk.size(); ++i) dk.f32()[i] = static_cast<float>(gk[i]);
    for (size_t i = 0; i < gv.size(); ++i) dv.f32()[i] = static_cast<float>(gv[i]);
  }

  void kv_cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v,
                      const Tensor& slots) override {
    Access a(*this);
    const int64_t C = k.cols();
    const size_t elem = dtype_size(k_cache.dtype);
    for (int64_t n = 0; n < k.rows(); ++n)
      for (int64_t c = 0; c < C; ++c) {
        const size_t at = (static_cast<size_t>(slots.i32()[n]) * C + c) * elem;
        convert_from_f32(&k.f32()[n * C + c], k_cache.as<std::byte>() + at, k_cache.dtype, 1);
        convert_from_f32(&v.f32()[n * C + c], v_cache.as<std::byte>() + at, v_cache.dtype, 1);
      }
  }
  void paged_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_tables, const Tensor& cu_seqlens, const Tensor& context_lens,
                               int64_t hd, int64_t block_size) override {
    Access a(*this);
    const int64_t Hq = q.cols() / hd, Hkv = k_cache.cols() / hd, kvd = k_cache.cols();
    for (int64_t s = 0; s + 1 < cu_seqlens.numel(); ++s) {
      const int64_t begin = cu_seqlens.i32()[s], end = cu_seqlens.i32()[s + 1];
      // The cache position of token j of this sequence, from its block table.
      auto slot = [&](int64_t j) {
        return int64_t{block_tables.i32()[s * block_tables.cols() + j / block_size]} * block_size + j % block_size;
      };
      for (int64_t t = begin; t < end; ++t) {
        const int64_t position = context_lens.i32()[s] - (end - begin) + (t - begin);
        for (int64_t head = 0; head < Hq; ++head) {
          const int64_t g = head / (Hq / Hkv);
          std::vector<double> w;
          for (int64_t j = 0; j <= position; ++j) {
            double dot = 0.0;
            for (int64_t d = 0; d < hd; ++d)
              dot += double(q.f32()[(t * Hq + head) * hd + d]) * element(k_cache, slot(j) * kvd + g * hd + d);
            w.push_back(dot / std::sqrt(double(hd)));
          }
          const double m = *std::max_element(w.begin(), w.end());
          double sum = 0.0;
          for (double& x : w) sum += (x = std::exp(x - m));
          for (int64_t d = 0; d < hd; ++d) {
            double o = 0.0;
            for (int64_t j = 0; j <= position; ++j) o += w[j] / sum * element(v_cache, slot(j) * kvd + g * hd + d);
            out.f32()[(t * Hq + head) * hd + d] = static_cast<float>(o);
          }
        }
      }
    }
  }
  void gather_rows(const Tensor& out, const Tensor& inp, const Tensor& index) override {
    Access a(*this);
    for (int64_t r = 0; r < out.rows(); ++r)
      for (int64_t c = 0; c < out.cols(); ++c) out.f32()[r * out.cols() + c] = inp.f32()[index.i32()[r] * inp.cols() + c];
  }
  bool computes_mixture_of_experts() const override { return true; }
  void combine_rows(const Tensor& out, const Tensor& inp, const Tensor& rows, const Tensor& weights) override {
    Access a(*this);
    const int64_t N = out.rows(), C = out.cols(), K = rows ? rows.cols() : 1;
    MT_ASSERT(inp.cols() == C && weights.numel() == inp.rows() && (rows ? rows.rows() == N : inp.rows() == N));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = rows ? rows.i32()[n * K + k] : n;
        MT_ASSERT(r >= 0 && r < inp.rows(), "combine_rows: a row outside the input");
        for (int64_t c = 0; c < C; ++c)
          out.f32()[n * C + c] += static_cast<float>(double(weights.f32()[r]) * inp.f32()[r * C + c]);
      }
  }
  bool trains_mixture_of_experts() const override { return true; }
  void combine_rows_backward(const Tensor& dinp, const Tensor& dweights, const Tensor& inp, const Tensor& dout,
                             const Tensor& tokens, const Tensor& weights) override {
    Access a(*this);
    const int64_t R = inp.rows(), C = inp.cols();
    MT_ASSERT(dinp.numel() == inp.numel() && dout.cols() == C && dweights.numel() == R && weights.numel() == R &&
              (tokens ? tokens.numel() == R : dout.rows() == R));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = tokens ? tokens.i32()[r] : r;
      MT_ASSERT(t >= 0 && t < dout.rows(), "combine_rows_backward: a token outside the output");
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += double(inp.f32()[r * C + c]) * dout.f32()[t * C + c];
      dweights.f32()[r] = static_cast<float>(dot);
      for (int64_t c = 0; c < C; ++c)
        dinp.f32()[r * C + c] = static_cast<float>(double(weights.f32()[r]) * dout.f32()[t * C + c]);
    }
  }
  void swiglu_forward(const Tensor& h, const Tensor& gate, const Tensor& up) override {
    Access a(*this);
    for (int64_t i = 0; i < h.numel(); ++i) {
      const double g = gate.f32()[i];
      h.f32()[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up.f32()[i]);
    }
  }
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dh, const Tensor& gate,
                       const Tensor& up) override {
    Access a(*this);
    for (int64_t i = 0; i < dh.numel(); ++i) {
      const double g = gate.f32()[i], sig = 1.0 / (1.0 + std::exp(-g));
      dgate.f32()[i] += static_cast<float>(dh.f32()[i] * up.f32()[i] * sig * (1.0 + g * (1.0 - sig)));
      dup.f32()[i] += static_cast<float>(dh.f32()[i] * g * sig);
    }
  }
  void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) override {
    Access a(*this);
    const int64_t D = table.cols();
    for (int64_t n = 0; n < ids.numel(); ++n)
      for (int64_t d = 0; d < D; ++d) out.f32()[n * D + d] = static_cast<float>(element(table, ids.i32()[n] * D + d));
  }
  void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& ids) override {
    Access a(*this);
    const int64_t D = dtable.cols();
    for (int64_t n = 0; n < ids.numel(); ++n)
      for (int64_t d = 0; d < D; ++d) dtable.f32()[ids.i32()[n] * D + d] += dout.f32()[n * D + d];
  }
  void dropout_forward(const Tensor& out, const Tensor& x, uint64_t key, float p) override {
    Access a(*this);
    // The mask is part of the contract (backward regenerates it from the key): element i is kept
    // when the top 24 bits of splitmix64(key + i * golden) are at least p * 2^24.
    const uint64_t threshold = static_cast<uint64_t>(static_cast<double>(p) * 16777216.0);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const uint64_t z = mix64(key + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
      out.f32()[i] = (z >> 40) >= threshold ? static_cast<float>(x.f32()[i] / (1.0 - p)) : 0.0f;
    }
  }
  void add_inplace(const Tensor& y, const Tensor& x) override {
    Access a(*this);
    for (int64_t i = 0; i < y.numel(); ++i) y.f32()[i] += x.f32()[i];
  }

  // RowStats with the log-sum-exp in float64, written out from the definitions.
  static RowStats reference_row_stats(const float* z, int64_t V, int32_t t) {
    RowStats s{.logsumexp = 0, .target_logit = z[t], .argmax = 0, .target_rank = 0};
    for (int64_t v = 1; v < V; ++v)
      if (z[v] > z[s.argmax]) s.argmax = static_cast<int32_t>(v);
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      sum += std::exp(double(z[v]) - z[s.argmax]);
      if (z[v] > z[t] || (z[v] == z[t] && v < t)) ++s.target_rank;
    }
    s.logsumexp = static_cast<float>(z[s.argmax] + std::log(sum));
    return s;
  }

  LossSum lm_head_loss(const LmHeadArgs& args) override {
    Access a(*this);
    const Tensor& W = args.weight;
    const int64_t N = args.hidden.rows(), D = args.hidden_size(), V = args.vocab(), chunk_rows = args.logits.rows();
    auto head = [&](int64_t v, int64_t d) {
      return args.quantized ? dequantized(*args.quantized, v, d) : element(W, v * D + d);
    };
    // Mixed precision: the hidden rows and the loss's gradient (times grad_scale) as rounded.
    const DType dt = args.operands;
    MT_ASSERT(dt == DType::F32 || (!args.quantized && W.dtype == dt));
    auto hidden = [&](int64_t n, int64_t d) { return rounded(args.hidden.f32()[n * D + d], dt); };
    auto dlogit = [&](const float* dlogits, int64_t i) {
      return dt == DType::F32 ? double(dlogits[i]) * args.grad_scale : rounded(dlogits[i] * args.grad_scale, dt);
    };
    MT_ASSERT(args.staging.logits && args.staging.targets && args.staging.positions,
              "the reference backend hands chunks to host code through staging buffers");
    int32_t* positions = args.positions.as<int32_t>();
    int64_t count = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = args.targets.i32()[n];
      if (t == kIgnoreIndex) continue;
      MT_ASSERT(t >= 0 && t < V, "target id out of range");
      positions[count++] = static_cast<int32_t>(n);
    }
    if (args.dhidden) std::fill_n(args.dhidden.f32(), N * D, 0.0f);
    double total = 0.0;
    float* logits = args.logits.f32();
    for (int64_t c0 = 0; c0 < count; c0 += chunk_rows) {
      const int64_t m = std::min(chunk_rows, count - c0);
      const int32_t* pos = positions + c0;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t v = 0; v < V; ++v) {
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d) s += hidden(pos[r], d) * head(v, d);
          logits[r * V + v] = static_cast<float>(s);
        }
      // Host code sees the chunk in host memory only, with the device memory locked meanwhile.
      std::copy_n(logits, m * V, args.staging.logits);
      int32_t* row_targets = args.staging.targets + c0;
      int32_t* row_positions = args.staging.positions + c0;
      for (int64_t r = 0; r < m; ++r) row_targets[r] = args.targets.i32()[pos[r]];
      std::copy_n(pos, m, row_positions);
      {
        Unlocked u(*this);
        if (args.observer) {
          RowStats* stats = args.staging.row_stats + c0;
          for (int64_t r = 0; r < m; ++r) stats[r] = reference_row_stats(args.staging.logits + r * V, V, row_targets[r]);
          args.observer->observe_rows({stats, row_targets, row_positions, m});
          if (args.observer->needs_logits())
            args.observer->observe({args.staging.logits, row_targets, row_positions, m, V});
        }
        total += args.loss->chunk(args.staging.logits, row_targets, m, V, static_cast<bool>(args.dhidden));
      }
      if (!args.dhidden) continue;
      const float* dlogits = args.staging.logits;  // d(sum)/d(logits), in host memory
      for (int64_t r = 0; r < m; ++r)
        for (int64_t d = 0; d < D; ++d) {
          double s = 0.0;
          for (int64_t v = 0; v < V; ++v) s += dlogit(dlogits, r * V + v) * head(v, d);
          args.dhidden.f32()[pos[r] * D + d] = static_cast<float>(s);
        }
      if (args.dweight)
        for (int64_t v = 0; v < V; ++v)
          for (int64_t d = 0; d < D; ++d) {
            double s = 0.0;
            for (int64_t r = 0; r < m; ++r) s += dlogit(dlogits, r * V + v) * hidden(pos[r], d);
            args.dweight.f32()[v * D + d] += static_cast<float>(s);
          }
    }
    return LossSum{total, count};
  }

  void sample_tokens(const SampleArgs& args) override {
    Access a(*this);
    sample_rows_on_host(args);
  }

  double scale_and_sum_squares(std::span<const Tensor> xs, float scale) override {
    Access a(*this);
    double sumsq = 0.0;
    for (const Tensor& x : xs)
      for (int64_t i = 0; i < x.numel(); ++i) {
        x.f32()[i] *= scale;
        sumsq += double(x.f32()[i]) * x.f32()[i];
      }
    return sumsq;
  }
  void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                    const AdamWStep& step) override {
    Access a(*this);
    const AdamWConfig& c = step.config;
    MT_ASSERT(param.numel() == grad.numel() && m.numel() == param.numel() && v.numel() == param.numel() && step.t >= 1);
    const double bias1 = 1.0 - std::pow(c.beta1, double(step.t)), bias2 = 1.0 - std::pow(c.beta2, double(step.t));
    for (int64_t i = 0; i < param.numel(); ++i) {
      const double g = double(grad.f32()[i]) * step.grad_scale;
      const double mi = c.beta1 * m.f32()[i] + (1.0 - c.beta1) * g;
      const double vi = c.beta2 * v.f32()[i] + (1.0 - c.beta2) * g * g;
      m.f32()[i] = static_cast<float>(mi);
      v.f32()[i] = static_cast<float>(vi);
      double p = param.f32()[i];
      if (step.decay) p *= 1.0 - step.learning_rate * c.weight_decay;
      p -= step.learning_rate * (mi / bias1) / (std::sqrt(vi / bias2) + c.eps);
      param.f32()[i] = static_cast<float>(p);
    }
  }

  void collective(const std::function<void()>& op) override {
    Access a(*this);
    op();
  }
  // A non-blocking collective left in flight could be served (by a peer's single-copy read)
  // while the memory is locked, so collectives complete inside collective().
  bool overlaps_collectives() const override { return false; }

 private:
  struct Region {
    void* base;
    size_t bytes;
  };
  static void protect(const Region& r, int prot) { MT_ASSERT(mprotect(r.base, r.bytes, prot) == 0, "mprotect failed"); }
  void set_access(int prot) {
    for (const Region& r : regions_) protect(r, prot);
  }
  // Nested scopes: the memory opens at the outermost entry and locks at the outermost exit.
  struct Access {
    explicit Access(ReferenceBackend& b) : b(b) {
      if (b.depth_++ == 0) b.set_access(PROT_READ | PROT_WRITE);
    }
    ~Access() {
      if (--b.depth_ == 0) b.set_access(PROT_NONE);
    }
    ReferenceBackend& b;
  };
  // Locks the memory again for a call into host code made from inside an op.
  struct Unlocked {
    explicit Unlocked(ReferenceBackend& b) : b(b), saved(b.depth_) {
      b.depth_ = 0;
      b.set_access(PROT_NONE);
    }
    ~Unlocked() {
      b.depth_ = saved;
      b.set_access(PROT_READ | PROT_WRITE);
    }
    ReferenceBackend& b;
    int saved;
  };

  static void store(const Tensor& t, int64_t i, double value) {
    switch (t.dtype) {
      case DType::F32:
        t.as<float>()[i] = static_cast<float>(value);
        return;
      case DType::BF16:
        t.as<uint16_t>()[i] = f32_to_bf16(static_cast<float>(value));
        return;
      case DType::F16:
        t.as<uint16_t>()[i] = f32_to_f16(static_cast<float>(value));
        return;
      case DType::I32:
        break;
    }
    MT_ASSERT(false, "convert takes floating dtypes");
  }

  static double dequantized(const QuantizedWeight& w, int64_t n, int64_t k) {
    const int per_word = 32 / w.bits;
    const uint32_t word = static_cast<uint32_t>(w.codes.i32()[n * (w.in / per_word) + k / per_word]);
    const uint32_t code = (word >> (w.bits * (k % per_word))) & ((1u << w.bits) - 1u);
    const int64_t g = w.g_idx ? w.g_idx.i32()[k] : k / w.group_size;
    const float scale = f16_to_f32(w.scales.as<const uint16_t>()[n * w.groups + g]);
    const float zero = f16_to_f32(w.zeros.as<const uint16_t>()[n * w.groups + g]);
    return scale * (static_cast<float>(code) - zero);  // the layout's formula, in float32 like the files' users
  }

  // Hugging Face's rotate-half RoPE; the angle pos * inv_freq is formed in float32 as
  // transformers forms it, the rotation itself in float64.
  void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, double direction) {
    Access a(*this);
    const int64_t half = inv_freq.numel(), hd = 2 * half, N = x.rows(), heads = x.cols() / hd;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < half; ++i) {
        // The angle as float32 (as Hugging Face computes it), its rotation in double.
        const double angle = static_cast<float>(static_cast<float>(positions.i32()[n]) * inv_freq.f32()[i]);
        const double c = std::cos(angle), s = direction * std::sin(angle);
        for (int64_t h = 0; h < heads; ++h) {
          float* e = x.f32() + n * heads * hd + h * hd;
          const double x1 = e[i], x2 = e[i + half];
          e[i] = static_cast<float>(x1 * c - x2 * s);
          e[i + half] = static_cast<float>(x2 * c + x1 * s);
        }
      }
  }

  struct Heads {
    Heads(const Tensor& q_, const Tensor& k_, int64_t hd_) : q(q_.cols() / hd_), kv(k_.cols() / hd_), hd(hd_) {}
    int64_t q, kv, hd;
    int64_t q_index(int64_t t, int64_t head, int64_t d) const { return (t * q + head) * hd + d; }
    int64_t kv_index(int64_t t, int64_t head, int64_t d) const { return (t * kv + head / (q / kv)) * hd + d; }
  };
  // Calls f(t, begin) for every token t of every sequence starting at begin.
  template <class F>
  static void for_each_query(const Tensor& cu_seqlens, F f) {
    for (int64_t s = 0; s + 1 < cu_seqlens.numel(); ++s)
      for (int64_t t = cu_seqlens.i32()[s]; t < cu_seqlens.i32()[s + 1]; ++t) f(t, cu_seqlens.i32()[s]);
  }
  // An attention operand as the products take it: float32 rounded to `dtype` (F32: as it is).
  struct Operand {
    DType dtype;
    double operator()(float x) const { return dtype == DType::F32 ? x : rounded(x, dtype); }
  };
  // q_t . k_j / sqrt(hd) for j = begin..t (causal), of the operands as r gives them.
  static std::vector<double> scores(const Tensor& q, const Tensor& k, const Heads& h, int64_t t, int64_t begin,
                                    int64_t head, const Operand& r) {
    std::vector<double> s;
    for (int64_t j = begin; j <= t; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < h.hd; ++d) dot += r(q.f32()[h.q_index(t, head, d)]) * r(k.f32()[h.kv_index(j, head, d)]);
      s.push_back(dot / std::sqrt(double(h.hd)));
    }
    return s;
  }

  std::vector<Region> regions_;
  int depth_ = 0;
};

}  // namespace

Backend& reference_backend() {
  static ReferenceBackend backend;
  return backend;
}

}  // namespace memtune

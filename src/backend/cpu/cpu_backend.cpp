// The cpu backend: checks each view's dtype and size, then calls the raw-pointer kernels.
#include "backend/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <array>
#include <cstring>

#include "backend/cpu/half_gemm.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/parallel.h"

namespace memtune {
namespace {

// Rows up to which a float32 matmul_forward runs the skinny kernel instead of sgemm.
constexpr int64_t kSkinnyRows = 8;

void check_quantized(const QuantizedWeight& w, const Tensor& scratch) {
  MT_ASSERT((w.bits == 4 || w.bits == 8) && w.in % (32 / w.bits) == 0 && w.group_size > 0 && w.groups > 0);
  MT_ASSERT(w.codes.dtype == DType::I32 && w.codes.numel() == w.out * (w.in / (32 / w.bits)));
  MT_ASSERT(w.scales.dtype == DType::F16 && w.scales.numel() == w.out * w.groups);
  MT_ASSERT(w.zeros.dtype == DType::F16 && w.zeros.numel() == w.out * w.groups);
  MT_ASSERT(!w.g_idx || (w.g_idx.dtype == DType::I32 && w.g_idx.numel() == w.in));
  MT_ASSERT(scratch.dtype == DType::F32 && scratch.numel() >= cpu::kQuantizedTileRows * w.in, "quantized matmul scratch");
}

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }

  void* allocate(size_t bytes) override { return map_host_pages(bytes); }
  void deallocate(void* base, size_t bytes) override { munmap(base, bytes); }
  bool host_addressable() const override { return true; }
  bool memory_in_host_pages() const override { return true; }
  int64_t stored_weight_rows() const override { return cpu::kSixteenBitWeightRows; }
  bool takes_int8_activations() const override { return cpu::int8_activation_kernels(); }
  bool takes_int8_decode_activations() const override { return cpu::int8_decode_kernels(); }
  // oneDNN's generated kernels and the scratchpad pages steps touch: about 1 MiB measured at 2
  // threads (docs/benchmarks.md); the scratchpad a primitive takes grows with threads, up to its
  // kHalfGemmScratchpadBytes, so half of that is counted.
  size_t sixteen_bit_runtime_bytes() const override { return cpu::kHalfGemmScratchpadBytes / 2; }
  std::string sixteen_bit_products(DType dtype) const override {
    const std::string& kernel = cpu::half_gemm_kernel(dtype);
    return kernel.empty() ? std::string() : "oneDNN " + kernel;
  }
  std::string bf16_quantized_products() const override {
    const std::string& kernel = cpu::half_gemm_kernel(DType::BF16);
    return kernel.empty() ? std::string() : "dequantized tiles on oneDNN " + kernel;
  }
  bool prefers_bf16_quantized_products() const override {
    return cpu::tile_unit_kernel(cpu::half_gemm_kernel(DType::BF16));
  }
  int64_t head_product_slice(DType operands) const override {
    return cpu::head_products(operands) == cpu::HeadProducts::Dense ? cpu::kDenseHeadSliceRows : 0;
  }
  size_t quantized_scratch_elems(int64_t in) const override {
    return static_cast<size_t>(cpu::kQuantizedTileRows * in);
  }
  // Few rows: the prepared input (its permutation and its sums per group) takes at most 2 x rows
  // x in; many rows: the tile.
  size_t quantized_scratch_used(int64_t rows, int64_t in) const override {
    return rows <= cpu::kSixteenBitWeightRows ? static_cast<size_t>(2 * rows * in) : quantized_scratch_elems(in);
  }

  void copy_to_device(const Tensor& dst, const void* src) override { std::memcpy(dst.data, src, dst.bytes()); }
  void copy_to_host(void* dst, const Tensor& src) override { std::memcpy(dst, src.data, src.bytes()); }
  void copy(const Tensor& dst, const Tensor& src) override {
    MT_ASSERT(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy between views of different size or dtype");
    std::memmove(dst.data, src.data, src.bytes());
  }
  void convert(const Tensor& dst, const Tensor& src) override {
    MT_ASSERT(dst.numel() == src.numel(), "convert between views of different sizes");
    const size_t n = static_cast<size_t>(src.numel());
    if (dst.dtype == DType::F32) {
      convert_to_f32(src.data, src.dtype, dst.as<float>(), n);
    } else {
      MT_ASSERT(src.dtype == DType::F32, "convert goes through float32");
      convert_from_f32(src.as<const float>(), dst.data, dst.dtype, n);
    }
  }
  void fill(const Tensor& dst, float value) override { std::fill_n(dst.f32(), dst.numel(), value); }
  void fill_bytes(void* device, unsigned char byte, size_t bytes) override { std::memset(device, byte, bytes); }

  void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) override {
    MT_ASSERT(inp.cols() == weight.cols() && out.cols() == weight.rows() && out.rows() == inp.rows());
    if (inp.dtype != DType::F32) {  // 16-bit operands: out = inp @ weight^T through oneDNN
      MT_ASSERT(weight.dtype == inp.dtype, "a 16-bit product takes both operands in one dtype");
      const int64_t N = inp.rows(), C = inp.cols(), OC = weight.rows();
      cpu::half_gemm(ProductFamily::Layers, inp.dtype, N, OC, C, {inp.data, C, 1}, {weight.data, 1, C}, out.f32(), OC, false);
      if (bias) cpu::add_bias(out.f32(), bias.f32(), N, OC);
      return;
    }
    // A few rows (decoding) read each weight once in the skinny kernel; OpenBLAS would pack the
    // whole weight first. 16-bit weights always take it (callers pass them only for few rows).
    if (weight.dtype != DType::F32 || inp.rows() <= kSkinnyRows) {
      cpu::matmul_skinny(out.f32(), inp.f32(), weight.data, weight.dtype, bias.f32(), inp.rows(), inp.cols(),
                         weight.rows());
      return;
    }
    cpu::matmul_forward(out.f32(), inp.f32(), weight.f32(), bias.f32(), inp.rows(), inp.cols(), weight.rows());
  }
  void quantized_matmul_forward(const Tensor& out, const Tensor& inp, const QuantizedWeight& weight,
                                const Tensor& bias, const Tensor& scratch) override {
    check_quantized(weight, scratch);
    MT_ASSERT(inp.cols() == weight.in && out.cols() == weight.out && out.rows() == inp.rows());
    cpu::quantized_matmul_forward(out.f32(), inp.f32(), weight, bias.f32(), inp.rows(), scratch.f32());
  }
  // Decoding's products as few parallel regions (one fork and join instead of one per product;
  // the small k / v products and each routed expert's no longer run alone). A pass takes members
  // while the scratch holds their prepared inputs: the quantized members of one input and one
  // layout read one. Members that would not take the skinny kernels (more rows of float32 weights;
  // 16-bit inputs, mixed precision's products on oneDNN) make the group run one by one.
  void matmul_forward_group(std::span<const GroupMember> group, const Tensor& inp, const Tensor& scratch) override {
    for (const GroupMember& m : group) {
      const Tensor& x = m.inp ? m.inp : inp;
      MT_ASSERT(m.out.rows() == x.rows(), "matmul_forward_group: a member's output rows differ from its input's");
      if (m.quantized) {
        check_quantized(*m.quantized, scratch);
        MT_ASSERT(x.cols() == m.quantized->in && m.out.cols() == m.quantized->out);
        if (x.rows() > cpu::kSixteenBitWeightRows || quantized_scratch_used(x.rows(), x.cols()) > size_t(scratch.numel()))
          return Backend::matmul_forward_group(group, inp, scratch);
      } else {
        MT_ASSERT(x.cols() == m.weight.cols() && m.out.cols() == m.weight.rows());
        if (x.dtype != DType::F32 || (m.weight.dtype == DType::F32 && x.rows() > kSkinnyRows))
          return Backend::matmul_forward_group(group, inp, scratch);
      }
    }
    constexpr size_t kMaxMembers = 32;
    std::array<cpu::SkinnyMatmul, kMaxMembers> floats{};
    std::array<cpu::QuantizedSkinny, kMaxMembers> quantized{};
    std::array<int64_t, kMaxMembers + 1> first{};
    for (size_t begin = 0; begin < group.size();) {
      size_t n = 0, used = 0;  // members in this pass; scratch floats its prepared inputs take
      const cpu::QuantizedSkinny* prepared = nullptr;  // the last prepared input
      for (; begin + n < group.size() && n < kMaxMembers; ++n) {
        const GroupMember& m = group[begin + n];
        const Tensor& x = m.inp ? m.inp : inp;
        if (m.quantized) {
          cpu::QuantizedSkinny& q = quantized[n];
          q = {m.out.f32(), m.quantized, m.bias.f32(), x.rows(), nullptr, nullptr};
          if (prepared && prepared->inp == x.f32() && prepared->N == x.rows() &&
              cpu::same_input_layout(*prepared->weight, *m.quantized)) {
            q.inp = prepared->inp;
            q.prepared = prepared->prepared;
          } else {
            const size_t need = quantized_scratch_used(x.rows(), x.cols());
            if (used + need > size_t(scratch.numel())) break;  // the next pass prepares it
            q.prepare(x.f32(), scratch.f32() + used);
            used += need;
            prepared = &q;
          }
          first[n + 1] = first[n] + q.tasks();
        } else {
          floats[n] = {m.out.f32(), x.f32(),     m.weight.data, m.weight.dtype,
                       m.bias.f32(), x.rows(), x.cols(),      m.weight.rows()};
          first[n + 1] = first[n] + floats[n].tasks();
        }
      }
      const GroupMember* members = group.data() + begin;
      cpu::parallel_for_balanced(first[n], 1, [&](int64_t t0, int64_t t1) {
        size_t i = 0;
        for (int64_t t = t0; t < t1; ++t) {
          while (t >= first[i + 1]) ++i;
          if (members[i].quantized)
            quantized[i].run(t - first[i]);
          else
            floats[i].run(t - first[i]);
        }
      });
      begin += n;
    }
  }
  void quantized_matmul_backward_input(const Tensor& dinp, const Tensor& dout, const QuantizedWeight& weight,
                                       const Tensor& scratch) override {
    check_quantized(weight, scratch);
    MT_ASSERT(dinp.cols() == weight.in && dout.cols() == weight.out && dout.rows() == dinp.rows());
    cpu::quantized_matmul_backward_input(dinp.f32(), dout.f32(), weight, dout.rows(), scratch.f32());
  }
  void matmul_accumulate(const Tensor& out, const Tensor& inp, const Tensor& weight, float scale) override {
    MT_ASSERT(inp.cols() == weight.cols() && out.cols() == weight.rows() && out.rows() == inp.rows());
    cpu::matmul_accumulate(out.f32(), inp.f32(), weight.f32(), inp.rows(), inp.cols(), weight.rows(), scale);
  }
  void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight, float scale) override {
    MT_ASSERT(inp.cols() == weight.cols() && dout.cols() == weight.rows() && dout.rows() == inp.rows());
    if (dout.dtype != DType::F32) {  // 16-bit operands (inp is read only for dweight)
      const DType dt = dout.dtype;
      const int64_t N = dout.rows(), C = inp.cols(), OC = weight.rows();
      MT_ASSERT(scale == 1.0f && weight.dtype == dt && (!dweight || inp.dtype == dt),
                "a 16-bit backward product takes scale 1 and its operands in one dtype");
      if (dinp) cpu::half_gemm(ProductFamily::Layers, dt, N, C, OC, {dout.data, OC, 1}, {weight.data, C, 1}, dinp.f32(), C, true);
      if (dweight) cpu::half_gemm(ProductFamily::Layers, dt, OC, C, N, {dout.data, 1, OC}, {inp.data, C, 1}, dweight.f32(), C, true);
      if (dbias) cpu::column_sums_accumulate(dbias.f32(), dout.data, dt, N, OC);
      return;
    }
    cpu::matmul_backward(dinp.f32(), dweight.f32(), dbias.f32(), dout.f32(), inp.f32(), weight.f32(), inp.rows(), inp.cols(),
                         weight.rows(), scale);
  }
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       float eps) override {
    cpu::rmsnorm_forward(out.f32(), rstd.f32(), inp.f32(), weight.f32(), inp.rows(), inp.cols(), eps);
  }
  void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& rstd) override {
    cpu::rmsnorm_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), inp.rows(), inp.cols());
  }
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) override {
    const int64_t head_dim = 2 * inv_freq.numel();
    cpu::rope_forward(x.f32(), positions.i32(), x.rows(), x.cols() / head_dim, head_dim, inv_freq.f32());
  }
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) override {
    const int64_t head_dim = 2 * inv_freq.numel();
    cpu::rope_backward(dx.f32(), positions.i32(), dx.rows(), dx.cols() / head_dim, head_dim, inv_freq.f32());
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    MT_ASSERT(operands == DType::F32, "cpu attention keeps float32 operands (sixteen_bit_attention)");
    cpu::attention_forward(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), cu_seqlens.i32(), cu_seqlens.numel() - 1,
                           q.cols() / hd, k.cols() / hd, hd);
  }
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                          const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    MT_ASSERT(operands == DType::F32, "cpu attention keeps float32 operands (sixteen_bit_attention)");
    cpu::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(),
                            cu_seqlens.i32(), cu_seqlens.numel() - 1, q.cols() / hd, k.cols() / hd, hd);
  }
  void kv_cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v,
                      const Tensor& slots) override {
    MT_ASSERT(k_cache.dtype == v_cache.dtype && k_cache.cols() == k.cols() && v.numel() == k.numel() &&
              slots.numel() == k.rows());
    cpu::kv_cache_write(k_cache.data, v_cache.data, k_cache.dtype, k.f32(), v.f32(), slots.i32(), k.rows(), k.cols());
  }
  void paged_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_tables, const Tensor& cu_seqlens, const Tensor& context_lens,
                               int64_t hd, int64_t block_size) override {
    const int64_t S = cu_seqlens.numel() - 1;
    MT_ASSERT(out.numel() == q.numel() && context_lens.numel() >= S && block_tables.rows() >= S);
    cpu::paged_attention_forward(out.f32(), q.f32(), k_cache.data, v_cache.data, k_cache.dtype, block_tables.i32(),
                                 block_tables.cols(), cu_seqlens.i32(), context_lens.i32(), S, q.cols() / hd,
                                 k_cache.cols() / hd, hd, block_size);
  }
  void gather_rows(const Tensor& out, const Tensor& inp, const Tensor& index) override {
    MT_ASSERT(out.cols() == inp.cols() && index.numel() == out.rows());
    cpu::gather_rows(out.f32(), inp.f32(), index.i32(), out.rows(), out.cols());
  }
  bool computes_mixture_of_experts() const override { return true; }
  void combine_rows(const Tensor& out, const Tensor& inp, const Tensor& rows, const Tensor& weights) override {
    MT_ASSERT(inp.cols() == out.cols() && weights.numel() == inp.rows() &&
              (rows ? rows.rows() == out.rows() : inp.rows() == out.rows()));
    cpu::combine_rows(out.f32(), inp.f32(), rows ? rows.i32() : nullptr, rows ? rows.cols() : 1, weights.f32(),
                      out.rows(), out.cols(), inp.rows());
  }
  bool trains_mixture_of_experts() const override { return true; }
  void combine_rows_backward(const Tensor& dinp, const Tensor& dweights, const Tensor& inp, const Tensor& dout,
                             const Tensor& tokens, const Tensor& weights) override {
    const int64_t R = inp.rows();
    MT_ASSERT(dinp.numel() == inp.numel() && dout.cols() == inp.cols() && dweights.numel() == R &&
              weights.numel() == R && (tokens ? tokens.numel() == R : dout.rows() == R));
    cpu::combine_rows_backward(dinp.f32(), dweights.f32(), inp.f32(), dout.f32(), tokens ? tokens.i32() : nullptr,
                               weights.f32(), R, inp.cols(), dout.rows());
  }
  void swiglu_forward(const Tensor& h, const Tensor& gate, const Tensor& up) override {
    cpu::swiglu_forward(h.f32(), gate.f32(), up.f32(), h.numel());
  }
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dh, const Tensor& gate,
                       const Tensor& up) override {
    cpu::swiglu_backward(dgate.f32(), dup.f32(), dh.f32(), gate.f32(), up.f32(), dh.numel());
  }
  void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) override {
    cpu::embedding_forward(out.f32(), ids.i32(), table.data, table.dtype, ids.numel(), table.cols());
  }
  void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& ids) override {
    cpu::embedding_backward(dtable.f32(), dout.f32(), ids.i32(), ids.numel(), dtable.cols());
  }
  void dropout_forward(const Tensor& out, const Tensor& x, uint64_t key, float p) override {
    cpu::dropout_forward(out.f32(), x.f32(), x.numel(), key, p);
  }
  void add_inplace(const Tensor& y, const Tensor& x) override { cpu::add_inplace(y.f32(), x.f32(), y.numel()); }
  LossSum lm_head_loss(const LmHeadArgs& args) override { return cpu::lm_head_loss(args); }

  double scale_and_sum_squares(std::span<const Tensor> xs, float scale) override {
    double sum = 0.0;
    for (const Tensor& x : xs) sum += cpu::scale_and_sum_squares(x.f32(), scale, x.numel());
    return sum;
  }
  void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                    const AdamWStep& step) override {
    MT_ASSERT(param.numel() == grad.numel() && m.numel() == param.numel() && v.numel() == param.numel() && step.t >= 1);
    cpu::adamw_update(param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), step);
  }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace memtune

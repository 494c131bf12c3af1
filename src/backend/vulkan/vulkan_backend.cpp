// The vulkan backend (see vulkan_backend.h): the Backend interface over VulkanContext.
#include "backend/vulkan/vulkan_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>

#include "backend/vulkan/context.h"
#include "core/error.h"

namespace memtune {

namespace {

uint64_t address(const Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data);
}
uint64_t address(const void* p) {
  return reinterpret_cast<uint64_t>(p);
}
// Workgroups of a 1-D grid-stride shader (256 wide) for n elements: enough to fill a large GPU,
// within every device's dispatch limit.
uint32_t groups_for(int64_t n) {
  return static_cast<uint32_t>(std::clamp<int64_t>((n + 255) / 256, 1, 65535));
}
uint32_t u32(int64_t v) {
  MT_ASSERT(v >= 0 && v <= static_cast<int64_t>(UINT32_MAX), "vulkan: a size beyond 32 bits");
  return static_cast<uint32_t>(v);
}
uint32_t weight_dtype_code(DType d) {
  switch (d) {
    case DType::F32:
      return 0;
    case DType::BF16:
      return 1;
    case DType::F16:
      return 2;
    default:
      break;
  }
  throw Error(fmt::format("--backend vulkan: a weight of dtype {} in a float matmul", dtype_torch_name(d)));
}

class VulkanBackend final : public Backend {
 public:
  VulkanBackend() : ctx_(std::make_unique<VulkanContext>()) {}
  std::string_view name() const override { return "vulkan"; }

  void* allocate(size_t bytes) override { return reinterpret_cast<void*>(ctx_->allocate(bytes)); }
  void deallocate(void* base, size_t) override { ctx_->deallocate(address(base)); }
  bool host_addressable() const override { return false; }
  bool memory_in_host_pages() const override { return false; }
  // The tiled matmul reads 16-bit weights as stored for any number of rows: the model never
  // widens them into scratch.
  int64_t stored_weight_rows() const override { return INT64_MAX; }
  size_t quantized_scratch_elems(int64_t) const override { return 0; }
  size_t quantized_scratch_used(int64_t, int64_t) const override { return 0; }

  void copy_to_device(const Tensor& dst, const void* src) override { ctx_->upload(address(dst), src, dst.bytes()); }
  void copy_to_host(void* dst, const Tensor& src) override { ctx_->download(dst, address(src), src.bytes()); }
  void copy(const Tensor& dst, const Tensor& src) override {
    MT_ASSERT(dst.bytes() == src.bytes(), "copy of views of different sizes");
    ctx_->copy(address(dst), address(src), src.bytes());
  }
  void convert(const Tensor& dst, const Tensor& src) override {
    MT_ASSERT(dst.numel() == src.numel(), "convert of views of different sizes");
    if (dst.dtype == src.dtype) return copy(dst, src);
    uint32_t mode = 0;
    if (src.dtype == DType::F32 && dst.dtype == DType::BF16)
      mode = 0;
    else if (src.dtype == DType::F32 && dst.dtype == DType::F16)
      mode = 1;
    else if (src.dtype == DType::BF16 && dst.dtype == DType::F32)
      mode = 2;
    else if (src.dtype == DType::F16 && dst.dtype == DType::F32)
      mode = 3;
    else
      throw Error(
          fmt::format("--backend vulkan: convert {} -> {}", dtype_torch_name(src.dtype), dtype_torch_name(dst.dtype)));
    struct {
      uint64_t dst, src;
      uint32_t n, mode;
    } push{address(dst), address(src), u32(dst.numel()), mode};
    ctx_->dispatch("convert", push, groups_for(dst.numel()));
  }
  void fill(const Tensor& dst, float value) override {
    dst.f32();
    ctx_->fill_words(address(dst), std::bit_cast<uint32_t>(value), dst.bytes());
  }
  void fill_bytes(void* device, unsigned char byte, size_t bytes) override {
    ctx_->fill_words(address(device), 0x01010101u * byte, bytes);
  }

  void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) override {
    matmul(out, inp, weight, bias, false, 1.0f);
  }
  void matmul_accumulate(const Tensor& out, const Tensor& inp, const Tensor& weight, float scale) override {
    matmul(out, inp, weight, Tensor{}, true, scale);
  }
  void add_inplace(const Tensor& y, const Tensor& x) override {
    MT_ASSERT(y.numel() == x.numel(), "add_inplace of views of different sizes");
    struct {
      uint64_t y, x;
      uint32_t n;
    } push{address(y), address(x), u32(y.numel())};
    ctx_->dispatch("add_inplace", push, groups_for(y.numel()));
  }
  void swiglu_forward(const Tensor& h, const Tensor& gate, const Tensor& up) override {
    struct {
      uint64_t h, gate, up;
      uint32_t n;
    } push{address(h), address(gate), address(up), u32(h.numel())};
    ctx_->dispatch("swiglu", push, groups_for(h.numel()));
  }

  // Not yet on the device.
  void matmul_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       float) override {
    missing("matmul_backward");
  }
  void quantized_matmul_forward(const Tensor&, const Tensor&, const QuantizedWeight&, const Tensor&,
                                const Tensor&) override {
    missing("quantized_matmul_forward");
  }
  void quantized_matmul_backward_input(const Tensor&, const Tensor&, const QuantizedWeight&, const Tensor&) override {
    missing("quantized_matmul_backward_input");
  }
  void rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) override {
    missing("rmsnorm_forward");
  }
  void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&) override {
    missing("rmsnorm_backward");
  }
  void rope_forward(const Tensor&, const Tensor&, const Tensor&) override { missing("rope_forward"); }
  void rope_backward(const Tensor&, const Tensor&, const Tensor&) override { missing("rope_backward"); }
  void attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         int64_t) override {
    missing("attention_forward");
  }
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t) override {
    missing("attention_backward");
  }
  void kv_cache_write(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {
    missing("kv_cache_write");
  }
  void paged_attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, int64_t, int64_t) override {
    missing("paged_attention_forward");
  }
  void gather_rows(const Tensor&, const Tensor&, const Tensor&) override { missing("gather_rows"); }
  void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {
    missing("swiglu_backward");
  }
  void embedding_forward(const Tensor&, const Tensor&, const Tensor&) override { missing("embedding_forward"); }
  void embedding_backward(const Tensor&, const Tensor&, const Tensor&) override { missing("embedding_backward"); }
  void dropout_forward(const Tensor&, const Tensor&, uint64_t, float) override { missing("dropout_forward"); }
  LossSum lm_head_loss(const LmHeadArgs&) override { missing("lm_head_loss"); }
  double scale_and_sum_squares(const Tensor&, float) override { missing("scale_and_sum_squares"); }
  void adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWStep&) override {
    missing("adamw_update");
  }

 private:
  [[noreturn]] static void missing(const char* op) {
    throw Error(fmt::format("--backend vulkan: the op {} does not run on the device yet", op));
  }
  void matmul(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias, bool accumulate,
              float scale) {
    const int64_t N = inp.rows(), C = inp.cols(), OC = weight.rows();
    MT_ASSERT(weight.cols() == C && out.rows() == N && out.cols() == OC, "matmul shapes");
    inp.f32();
    out.f32();
    struct {
      uint64_t out, inp, w, bias;
      uint32_t N, OC, C, has_bias, wdtype, accumulate;
      float scale;
    } push{address(out),
           address(inp),
           address(weight),
           address(bias),
           u32(N),
           u32(OC),
           u32(C),
           bias ? 1u : 0u,
           weight_dtype_code(weight.dtype),
           accumulate ? 1u : 0u,
           scale};
    ctx_->dispatch("matmul", push, u32((OC + 15) / 16), u32((N + 15) / 16));
  }

  std::unique_ptr<VulkanContext> ctx_;
};

}  // namespace

Backend& vulkan_backend() {
  static VulkanBackend backend;
  return backend;
}

std::vector<std::string_view> implemented_vulkan_ops() {
  return {"copy_to_device", "copy_to_host",      "copy",        "convert",       "fill", "fill_bytes",
          "matmul_forward", "matmul_accumulate", "add_inplace", "swiglu_forward"};
}

}  // namespace memtune

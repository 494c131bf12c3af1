// The vulkan backend (see vulkan_backend.h): the Backend interface over VulkanContext.
#include "backend/vulkan/vulkan_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/int8_activations.h"
#include "backend/vulkan/context.h"
#include "backend/vulkan/device.h"
#include "core/console.h"
#include "core/error.h"
#include "core/labels.h"

namespace memtune {

namespace {

uint64_t address(const Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data);
}
uint64_t address(const void* p) {
  return reinterpret_cast<uint64_t>(p);
}
uint32_t u32(int64_t v) {
  MT_ASSERT(v >= 0 && v <= static_cast<int64_t>(UINT32_MAX), "vulkan: a size beyond 32 bits");
  return static_cast<uint32_t>(v);
}

// MEMTUNE_VULKAN_TARGET_PIECE_FIRST=1 (a test's debug ordering): the loss's second pass runs the
// pieces holding their row's target first, then the others, in two dispatches.
bool target_piece_first() {
  const char* v = std::getenv("MEMTUNE_VULKAN_TARGET_PIECE_FIRST");
  return v && std::string_view(v) == "1";
}

// MEMTUNE_VULKAN_COOPMAT2=0: attention's passes with float16 operands take the KHR shaders
// (attention_coopmat.comp and its backward passes) even where VK_NV_cooperative_matrix2's would
// run (a test compares both on one device).
bool coopmat2_off() {
  const char* v = std::getenv("MEMTUNE_VULKAN_COOPMAT2");
  return v && std::string_view(v) == "0";
}

// What a dispatch reads, or writes (and may read), for the context's barriers (context.h).
using Access = VulkanContext::Access;
Access reads(const Tensor& t) { return {address(t), t ? t.bytes() : 0, false}; }
Access writes(const Tensor& t) { return {address(t), t ? t.bytes() : 0, true}; }

std::optional<VulkanDeviceProfile>& absent_device() {
  static std::optional<VulkanDeviceProfile> profile;
  return profile;
}

class VulkanBackend final : public Backend {
 public:
  // The run's first lines name the device, its memory and the features used (stderr).
  VulkanBackend() : profile_(absent_device()) {
    if (profile_) {
      std::fprintf(stderr, "vulkan: no device opened; planning for one whose allocations hold at most %s, with %s of memory\n",
                   format_bytes(profile_->max_allocation_bytes).c_str(), format_bytes(profile_->heap_bytes).c_str());
      return;
    }
    ctx_ = std::make_unique<VulkanContext>();
    decision_ = ctx_->allocate(kDecisionBytes + kPartials * sizeof(float));
    partials_ = decision_ + kDecisionBytes;  // a step's decision, loss slots and partials: one read
    split_scratch_ = ctx_->allocate(kSplitScratchFloats * sizeof(float));
    tables_ = ctx_->allocate(2 * kTableEntries * kTableWords * sizeof(uint64_t));
    pending_steps_.reserve(VulkanContext::kReadbackSlots);
    if (const std::optional<VulkanMatrixShape> s = cooperative_product_shape(ctx_->info(), DType::F16))
      half_unit_ = vulkan_geometry::MatrixUnit{s->m, s->n, s->k, ctx_->info().subgroup_size,
                                               ctx_->info().shared_memory_bytes};
    if (const std::optional<VulkanMatrixShape> s = cooperative_int8_shape(ctx_->info()))
      int8_unit_ = vulkan_geometry::MatrixUnit{s->m, s->n, s->k, ctx_->info().subgroup_size,
                                               ctx_->info().shared_memory_bytes};
    if (const std::optional<VulkanMatrixShape> s = cooperative_flexible_shape(ctx_->info()))
      flexible_unit_ = vulkan_geometry::MatrixUnit{s->m, s->n, s->k, ctx_->info().subgroup_size,
                                                   ctx_->info().shared_memory_bytes};
    std::fprintf(stderr, "vulkan: device %d, %s\n", ctx_->info().index, describe_vulkan_device(ctx_->info()).c_str());
  }
  std::string_view name() const override { return "vulkan"; }
  // What grows after the context exists (the commands measure their startup with the backend
  // made, so the loader, the driver and its libraries are in the startup term): the pipelines,
  // compiled on first use: what a training step peaked above its prediction without this term,
  // rounded up (see docs/benchmarks.md).
  size_t runtime_bytes() const override { return size_t{24} << 20; }
  std::optional<DeviceCounters> device_counters() const override {
    if (!ctx_) return std::nullopt;
    const VulkanContext::Counters& c = ctx_->counters();
    return DeviceCounters{.dispatches = c.dispatches,
                          .submissions = c.submissions,
                          .waits = c.waits,
                          .overlapped_waits = c.overlapped_waits,
                          .barriers = c.barriers,
                          .replayed_dispatches = c.replayed_dispatches,
                          .replayed_command_buffers = c.replayed_command_buffers};
  }
  bool replay_commands(std::span<const int64_t> key) override { return ctx().replay(key); }
  void begin_commands(std::span<const int64_t> key) override { ctx().begin_commands(key); }
  void end_commands() override { ctx().end_commands(); }
  std::map<std::string, uint64_t> dispatches_by_shader() const override {
    return ctx_ ? ctx_->dispatches_by_shader() : std::map<std::string, uint64_t>{};
  }
  void time_mark(int i) override {
    if (i == 0) taken_marks_.clear();
    ctx().mark(i);
  }
  // A taken step's marks (take_step) while no series has started since, else the last series.
  std::vector<double> time_marks() override {
    if (!taken_marks_.empty()) return std::exchange(taken_marks_, {});
    return ctx().marks();
  }
  std::optional<DeviceMemoryFigures> device_memory_figures() const override {
    if (profile_)
      return DeviceMemoryFigures{.device = "given by --vulkan_max_allocation and --device_memory (not on this machine)",
                                 .heap_bytes = profile_->heap_bytes,
                                 .max_allocation_bytes = profile_->max_allocation_bytes};
    DeviceMemoryFigures f{.device = ctx().info().name,
                          .heap_bytes = ctx().info().device_heap_bytes(),
                          .max_allocation_bytes = ctx().info().max_allocation_bytes};
    if (const auto b = ctx().memory_budget()) {
      f.usage_bytes = b->usage_bytes;
      f.budget_bytes = b->budget_bytes;
    }
    return f;
  }
  // Data parallel: the trainer runs each collective on a host copy of the tensor (its planned
  // collective staging), after backward.
  bool overlaps_collectives() const override { return false; }

  void* allocate(size_t bytes) override { return reinterpret_cast<void*>(ctx().allocate(bytes)); }
  void deallocate(void* base, size_t) override { ctx().deallocate(address(base)); }
  bool host_addressable() const override { return false; }
  bool runs_cross_entropy() const override { return true; }
  bool memory_in_host_pages() const override { return false; }
  // A device planned for but absent (--vulkan_max_allocation) is a GPU with memory of its own.
  bool arena_in_host_memory() const override { return !profile_ && ctx().info().memory_is_host(); }
  // The tiled matmul reads 16-bit weights as stored for any number of rows; the model's default
  // split (16, as on cpu) also sets serve's --max_decode_step_tokens, so it is kept.
  int64_t stored_weight_rows() const override { return 16; }
  // float16 products on the device's matrix units where it has them (gemm_coopmat.comp); bfloat16
  // has no variant in this build.
  std::string sixteen_bit_products(DType dtype) const override {
    if (dtype != DType::F16 || !half_unit_) return {};
    return fmt::format("cooperative matrices {}x{}x{} on {} (gemm_coopmat.comp)", half_unit_->m, half_unit_->n,
                       half_unit_->k, ctx_->info().name);
  }
  // Attention's products on the same units (attention_coopmat.comp and its backward passes), for
  // head dimensions that divide into them (others keep the float32 shaders).
  std::string sixteen_bit_attention(DType dtype) const override {
    if (dtype != DType::F16 || !half_unit_) return {};
    return fmt::format("cooperative matrices {}x{}x{} ({}attention_coopmat.comp)", half_unit_->m, half_unit_->n,
                       half_unit_->k,
                       flexible_unit_ ? "on flexible ones, attention_coopmat2.comp and its backward passes; else " : "");
  }
  // Quantized products of many rows round their input to int8 where the device has int8 matrices
  // (quantized_matmul_int8_coopmat.comp); elsewhere they keep float32 inputs.
  bool takes_int8_activations() const override { return int8_unit_.has_value(); }
  size_t quantized_scratch_elems(int64_t) const override { return 0; }
  size_t quantized_scratch_used(int64_t, int64_t) const override { return 0; }

  void copy_to_device(const Tensor& dst, const void* src) override { ctx().upload(address(dst), src, dst.bytes()); }
  void copy_to_host(void* dst, const Tensor& src) override { ctx().download(dst, address(src), src.bytes()); }
  void copy(const Tensor& dst, const Tensor& src) override {
    MT_ASSERT(dst.bytes() == src.bytes(), "copy of views of different sizes");
    ctx().copy(address(dst), address(src), src.bytes());
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
    ctx().dispatch(vulkan_geometry::elementwise("convert", dst.numel(), 6), push, {reads(src), writes(dst)});
  }
  void fill(const Tensor& dst, float value) override {
    dst.f32();
    ctx().fill_words(address(dst), std::bit_cast<uint32_t>(value), dst.bytes());
  }
  // One dispatch over every tensor (fill_tensors.comp over the gradient norm's table: the same
  // tensors as the step's norm, so its upload is usually skipped).
  void fill_group(std::span<const Tensor> tensors, float value) override {
    auto entry = [&](size_t i) { return AdamWTensor{.grad = tensors[i]}; };
    for_each_table(tensors.size(), 0, entry, [&](uint64_t table, uint64_t total, uint32_t count) {
      struct {
        uint64_t table, total;
        uint32_t count;
        float value;
      } push{table, total, count, value};
      ctx().dispatch(vulkan_geometry::multi_tensor("fill_tensors", total, 4, 0, vulkan_geometry::kMaxGroups), push);
    });
  }
  void fill_bytes(void* device, unsigned char byte, size_t bytes) override {
    if (address(device) % 4 == 0 && bytes % 4 == 0) return ctx().fill_words(address(device), 0x01010101u * byte, bytes);
    const std::vector<unsigned char> host(bytes, byte);  // a ragged range: rare, through staging
    ctx().upload(address(device), host.data(), bytes);
  }

  void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) override {
    matmul(out, inp, weight, bias, false, 1.0f);
  }
  // Decoding's products of one input (q / k / v, gate / up) in one matvec.comp dispatch where
  // they are float weights of one dtype over at most kMatvecRows rows; otherwise one by one.
  void matmul_forward_group(std::span<const GroupMember> group, const Tensor& inp, const Tensor& scratch) override {
    if (!one_matvec(group, inp)) return Backend::matmul_forward_group(group, inp, scratch);
    matvec(group, inp, false, 1.0f);
  }
  // ... and gate / up with the activation after them in that same pass; over more rows (training),
  // in one gemm.comp pass (float32 operands) or gemm_coopmat.comp pass (float16 ones).
  void matmul_forward_group_swiglu(std::span<const GroupMember> gate_up, const Tensor& inp, const Tensor& scratch,
                                   const Tensor& h) override {
    MT_ASSERT(gate_up.size() == 2, "matmul_forward_group_swiglu takes gate and up");
    const GroupMember &gate = gate_up[0], &up = gate_up[1];
    const bool alike = !gate.quantized && !up.quantized && !gate.inp && !up.inp &&
                       gate.weight.dtype == up.weight.dtype && gate.weight.rows() == up.weight.rows();
    if (alike && one_matvec(gate_up, inp)) return matvec(gate_up, inp, false, 1.0f, h);
    const DType operands = inp.dtype;
    if (alike && gate.weight.dtype == operands && (operands == DType::F32 || (operands == DType::F16 && half_unit_)))
      return gemm_swiglu(gate, up, inp, h);
    Backend::matmul_forward_group_swiglu(gate_up, inp, scratch, h);
  }
  bool one_matvec(std::span<const GroupMember> group, const Tensor& inp) const {
    bool one = !group.empty() && group.size() <= kMatvecMembers && inp.rows() <= vulkan_geometry::kMatvecRows &&
               inp.dtype == DType::F32;
    for (const GroupMember& m : group)
      one = one && !m.quantized && !m.inp && m.weight.dtype == group.front().weight.dtype;
    return one;
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
    ctx().dispatch(vulkan_geometry::elementwise("add_inplace", y.numel(), 12), push, {reads(x), writes(y)});
  }
  void swiglu_forward(const Tensor& h, const Tensor& gate, const Tensor& up) override {
    struct {
      uint64_t h, gate, up;
      uint32_t n;
    } push{address(h), address(gate), address(up), u32(h.numel())};
    ctx().dispatch(vulkan_geometry::elementwise("swiglu", h.numel(), 12, 8), push,
                   {reads(gate), reads(up), writes(h)});
  }

  void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight, float scale) override {
    const int64_t N = inp.rows(), C = inp.cols(), OC = weight.rows();
    MT_ASSERT(weight.cols() == C && dout.rows() == N && dout.cols() == OC, "matmul_backward shapes");
    if (dout.dtype != DType::F32) {  // 16-bit operands: dout, the weight and (for dweight) inp
      MT_ASSERT(scale == 1.0f && weight.dtype == dout.dtype && (!dweight || inp.dtype == dout.dtype),
                "a 16-bit backward product takes scale 1 and its operands in one dtype");
      if (dinp) half_gemm(dinp, dout, weight, N, C, OC, /*a_m=*/OC, /*a_k=*/1, /*b_k=*/C, /*b_n=*/1, 1.0f);
      if (dweight) half_gemm(dweight, dout, inp, OC, C, N, /*a_m=*/1, /*a_k=*/OC, /*b_k=*/C, /*b_n=*/1, 1.0f);
      if (dbias) column_sums(dbias, dout, Tensor{}, Tensor{}, N, OC, 1.0f);
      return;
    }
    if (dinp) {  // dinp[N, C] += scale dout[N, OC] @ W[OC, C] (W float32 or 16-bit)
      gemm(dinp, dout, weight, N, C, OC, /*a_m=*/OC, /*a_k=*/1, /*b_k=*/C, /*b_n=*/1, scale);
    }
    if (dweight)  // dweight[OC, C] += scale dout^T[OC, N] @ inp[N, C]
      gemm(dweight, dout, inp, OC, C, N, /*a_m=*/1, /*a_k=*/OC, /*b_k=*/C, /*b_n=*/1, scale);
    if (dbias) column_sums(dbias, dout, Tensor{}, Tensor{}, N, OC, scale);
  }
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& w, float eps) override {
    rmsnorm(out, rstd, inp, Tensor{}, w, eps);
  }
  void add_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& res, const Tensor& x, const Tensor& w,
                           float eps) override {
    MT_ASSERT(res.numel() == x.numel(), "add_rmsnorm_forward of views of different sizes");
    rmsnorm(out, rstd, res, x, w, eps);
  }
  void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& w, const Tensor& rstd) override {
    struct {
      uint64_t dinp, dout, inp, w, rstd;
      uint32_t N, C;
    } push{address(dinp), address(dout), address(inp), address(w), address(rstd), u32(inp.rows()), u32(inp.cols())};
    ctx().dispatch(vulkan_geometry::per_row("rmsnorm_backward", inp.rows(), inp.cols(), 12, 6), push,
                   {writes(dinp), reads(dout), reads(inp), reads(w), reads(rstd)});
    if (dweight) column_sums(dweight, dout, inp, rstd, inp.rows(), inp.cols(), 1.0f);
  }
  void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq) override {
    rope(x, Tensor{}, positions, inv_freq, 1.0f);
  }
  void rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq) override {
    rope(dx, Tensor{}, positions, inv_freq, -1.0f);
  }
  void rope_forward_pair(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq) override {
    rope(q, k, positions, inv_freq, 1.0f);
  }
  void rope_backward_pair(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                          const Tensor& inv_freq) override {
    rope(dq, dk, positions, inv_freq, -1.0f);
  }
  void kv_cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v,
                      const Tensor& slots) override {
    MT_ASSERT(k_cache.dtype == v_cache.dtype, "kv caches of one dtype");
    struct {
      uint64_t k_cache, v_cache, k, v, slots;
      uint32_t N, C, cdtype;
    } push{address(k_cache), address(v_cache), address(k),    address(v),
           address(slots),   u32(k.rows()),    u32(k.cols()), vulkan_geometry::dtype_code(k_cache.dtype)};
    ctx().dispatch(vulkan_geometry::elementwise("kv_cache_write", k.numel(), 2 * (4 + dtype_size(k_cache.dtype))), push,
                   {writes(k_cache), writes(v_cache), reads(k), reads(v), reads(slots)});
  }
  void gather_rows(const Tensor& out, const Tensor& inp, const Tensor& index) override { rows_op(out, inp, index, 0); }
  bool computes_mixture_of_experts() const override { return true; }
  void combine_rows(const Tensor& out, const Tensor& inp, const Tensor& rows, const Tensor& weights) override {
    MT_ASSERT(inp.cols() == out.cols() && weights.numel() == inp.rows() &&
              (rows ? rows.rows() == out.rows() : inp.rows() == out.rows()));
    rows_op(out, inp, rows, 2, weights);
  }
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dh, const Tensor& gate,
                       const Tensor& up) override {
    struct {
      uint64_t dgate, dup, dh, gate, up;
      uint32_t n;
    } push{address(dgate), address(dup), address(dh), address(gate), address(up), u32(dh.numel())};
    ctx().dispatch(vulkan_geometry::elementwise("swiglu_backward", dh.numel(), 20, 12), push,
                   {writes(dgate), writes(dup), reads(dh), reads(gate), reads(up)});
  }
  void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& table) override {
    embedding(table, out, ids, vulkan_geometry::dtype_code(table.dtype), 0,
              vulkan_geometry::elementwise("embedding", out.numel(), 4 + dtype_size(table.dtype), 0));
  }
  void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& ids) override {
    dtable.f32();
    embedding(dtable, dout, ids, 0, 1, vulkan_geometry::embedding_backward(ids.numel(), dtable.cols()));
  }
  void dropout_forward(const Tensor& out, const Tensor& x, uint64_t key, float p) override {
    struct {
      uint64_t out, x, key;
      uint32_t n, threshold;
      float scale;
    } push{
        address(out),     address(x), key, u32(x.numel()), static_cast<uint32_t>(static_cast<double>(p) * 16777216.0),
        1.0f / (1.0f - p)};
    ctx().dispatch(vulkan_geometry::elementwise("dropout", x.numel(), 8, 8), push, {writes(out), reads(x)});
  }
  // Sampling on the device (sample_penalties.comp, sample.comp): the rows' settings and the
  // penalty tokens go up with the step, R token ids come back.
  void sample_tokens(const SampleArgs& a) override {
    const auto R = static_cast<int64_t>(a.rows.size());
    if (R == 0) return;
    MT_ASSERT(a.device_rows.numel() >= R * kSampleRowWords && a.device_tokens.numel() >= R &&
                  a.device_penalties.numel() >= 3 * static_cast<int64_t>(a.penalties.size()),
              "vulkan: sampling needs its planned device buffers");
    const int64_t V = a.logits.cols();
    sample_words_.assign(static_cast<size_t>(R * kSampleRowWords), 0);
    penalty_words_.clear();
    for (int64_t r = 0; r < R; ++r) {
      const SampleRow& row = a.rows[static_cast<size_t>(r)];
      int32_t* w = sample_words_.data() + r * kSampleRowWords;
      auto f = [](double x) { return std::bit_cast<int32_t>(static_cast<float>(x)); };
      // The draw in float, kept below 1 so it never equals the kept mass.
      const float u = std::min(static_cast<float>(row.uniform), std::nextafter(1.0f, 0.0f));
      w[0] = f(row.temperature);
      w[1] = static_cast<int32_t>(std::clamp<int64_t>(row.top_k, -1, V));
      w[2] = f(row.top_p);
      w[3] = f(row.min_p);
      w[4] = f(row.repetition_penalty);
      w[5] = f(row.presence_penalty);
      w[6] = f(row.frequency_penalty);
      w[7] = std::bit_cast<int32_t>(u);
      w[8] = static_cast<int32_t>(row.penalty_begin);
      w[9] = static_cast<int32_t>(row.penalty_count);
      for (const PenaltyToken& t : a.penalties.subspan(row.penalty_begin, row.penalty_count))
        penalty_words_.insert(penalty_words_.end(), {t.id, t.output_count, static_cast<int32_t>(r)});
    }
    ctx().upload(address(a.device_rows), sample_words_.data(), sample_words_.size() * sizeof(int32_t));
    if (!penalty_words_.empty()) {
      ctx().upload(address(a.device_penalties), penalty_words_.data(), penalty_words_.size() * sizeof(int32_t));
      const auto n = static_cast<int64_t>(penalty_words_.size() / 3);
      struct {
        uint64_t logits, rows, entries;
        uint32_t n, V;
      } push{address(a.logits), address(a.device_rows), address(a.device_penalties), u32(n), u32(V)};
      ctx().dispatch(vulkan_geometry::elementwise("sample_penalties", n, 24), push,
                     {writes(a.logits), reads(a.device_rows), reads(a.device_penalties)});
    }
    struct {
      uint64_t logits, rows, tokens;
      uint32_t V;
    } push{address(a.logits), address(a.device_rows), address(a.device_tokens), u32(V)};
    ctx().dispatch(vulkan_geometry::sample(R, V), push,
                   {reads(a.logits), reads(a.device_rows), writes(a.device_tokens)});
    ctx().download(a.tokens.data(), address(a.device_tokens), static_cast<size_t>(R) * sizeof(int32_t));
  }

  // One dispatch over every tensor (scale_sum_squares.comp over a tensor table): each workgroup
  // writes the partial sum of its share of the chunks, and the partials come back in one download
  // with the step's deferred loss sums. The grid depends on the tensors only, so the same call
  // gives the same sum every run. Tables of more than kTableEntries tensors go in parts.
  double scale_and_sum_squares(std::span<const Tensor> xs, float scale) override {
    const uint32_t used = sum_squares_partials(xs, scale);
    if (used == kLossSlots && loss_slots_ == 0) return 0.0;
    ctx().download(partial_sums_.data(), partials_, used * sizeof(float));
    collect_loss_slots();
    return sum_of_partials(partial_sums_.data(), used);
  }
  void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                    const AdamWStep& step) override {
    const AdamWTensor one{param, grad, m, v, step.decay, {}};
    adamw_update_group(std::span(&one, 1), step);
  }
  // Every tensor in one dispatch (adamw.comp over a tensor table).
  void adamw_update_group(std::span<const AdamWTensor> tensors, const AdamWStep& step) override {
    adamw(tensors, step, 0);
  }

  // The decision needs float64 in a shader (step_decision.comp); without it the trainer waits
  // for each step's norm.
  bool decides_steps() const override { return ctx_ && ctx_->info().shader_float64; }
  void decide_and_update(std::span<const Tensor> grads, float scale, std::span<const AdamWTensor> tensors,
                         const DecidedStep& step) override {
    MT_ASSERT(decides_steps() && !decided_, "vulkan: a decided step before the last one was read");
    const uint32_t used = sum_squares_partials(grads, scale);
    const AdamWConstants a = adamw_constants(step.if_previous_skipped), b = adamw_constants(step.if_previous_counted);
    struct {
      uint64_t partials, decision;
      double max_norm;
      uint32_t n;
      AdamWConstants skipped, counted;
    } push{partials_ + kLossSlots * sizeof(float),
           decision_,
           step.max_grad_norm,
           used - kLossSlots,
           a,
           b};
    ctx().dispatch(vulkan_geometry::per_row("step_decision", 1, used - kLossSlots, 4, 1), push);
    adamw(tensors, step.if_previous_skipped, decision_);
    decided_ = used;
  }
  void read_step() override {
    MT_ASSERT(decided_ > 0 && pending_steps_.size() < VulkanContext::kReadbackSlots,
              "vulkan: read_step without a decided step, or with two unread");
    pending_steps_.push_back({ctx().read_later(decision_, kDecisionBytes + decided_ * sizeof(float)), decided_,
                              loss_slots_});
    loss_slots_ = 0;  // the next step's sums start again at slot 0, after this copy
    decided_ = 0;
  }
  StepReadback take_step() override {
    MT_ASSERT(!pending_steps_.empty(), "vulkan: take_step without a step read");
    const PendingStep p = pending_steps_.front();
    pending_steps_.erase(pending_steps_.begin());
    StepReadback r;
    const std::span<const std::byte> bytes = ctx().collect(p.read, r.marks);
    uint32_t counted = 0;
    std::memcpy(&counted, bytes.data(), sizeof counted);
    std::memcpy(partial_sums_.data(), bytes.data() + kDecisionBytes, p.partials * sizeof(float));
    r.counted = counted != 0;
    r.sum_squares = sum_of_partials(partial_sums_.data(), p.partials);
    for (uint32_t i = 0; i < p.loss_slots; ++i) r.loss_sum += partial_sums_[i];
    taken_marks_ = r.marks;  // what time_marks() returns until the next series starts
    return r;
  }

  void quantized_matmul_forward(const Tensor& out, const Tensor& inp, const QuantizedWeight& w, const Tensor& bias,
                                const Tensor&) override {
    MT_ASSERT(w.in == inp.cols() && out.rows() == inp.rows() && out.cols() == w.out, "quantized matmul shapes");
    quantized(out, inp, w, bias, 0);
  }
  void quantized_matmul_backward_input(const Tensor& dinp, const Tensor& dout, const QuantizedWeight& w,
                                       const Tensor&) override {
    MT_ASSERT(dout.cols() == w.out && dinp.rows() == dout.rows() && dinp.cols() == w.in, "quantized backward shapes");
    quantized(dinp, dout, w, Tensor{}, 1);
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    struct {
      uint64_t out, lse, q, k, v, cu;
      uint32_t N, S, Hq, Hkv;
      float scale;
    } push{address(out), address(lse), address(q), address(k), address(v), address(cu_seqlens),
           u32(q.rows()), u32(cu_seqlens.numel() - 1), u32(q.cols() / hd), u32(k.cols() / hd), attention_scale(hd)};
    const vulkan_geometry::Attention shape = attention_shape(q, k, cu_seqlens, hd);
    ctx().dispatch(attention_pass(vulkan_geometry::AttentionPass::Forward, shape, operands), push, {writes(out), writes(lse), reads(q), reads(k), reads(v), reads(cu_seqlens)});
  }
  // FlashAttention-2's two passes: dq by query tiles, dk and dv by key tiles.
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                          const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& cu_seqlens, int64_t hd, DType operands) override {
    using vulkan_geometry::AttentionPass;
    const vulkan_geometry::Attention shape = attention_shape(q, k, cu_seqlens, hd);
    // The key side first: where it is split over the group's query heads, its partial dk and dv
    // go to dq's memory (attention_key_splits) and are added in order before the dq pass.
    const VulkanDispatch key_pass = attention_pass(AttentionPass::Key, shape, operands);
    const uint32_t splits = key_pass.y / u32(shape.kv_heads);
    const uint64_t partial_bytes = static_cast<uint64_t>(dk.bytes());
    MT_ASSERT(splits == 1 || 2 * splits * partial_bytes <= dq.bytes(), "vulkan: the key side's partials beyond dq");
    struct {
      uint64_t dk, dv, dout, out, lse, q, k, v, cu;
      uint32_t N, S, Hq, Hkv;
      float scale;
      uint64_t partials;
      uint32_t head_splits;
    } key_side{address(dk), address(dv), address(dout), address(out), address(lse), address(q), address(k),
               address(v),  address(cu_seqlens), u32(q.rows()), u32(cu_seqlens.numel() - 1), u32(q.cols() / hd),
               u32(k.cols() / hd), attention_scale(hd), splits > 1 ? address(dq) : 0, splits};
    ctx().dispatch(key_pass, key_side,
                   {writes(dk), writes(dv), splits > 1 ? writes(dq) : Access{}, reads(dout), reads(out), reads(lse),
                    reads(q), reads(k), reads(v), reads(cu_seqlens)});
    const std::vector<VulkanDispatch> reduce = vulkan_geometry::attention_key_reduce(shape, splits);
    for (size_t i = 0; i < reduce.size(); ++i) {
      const Tensor& to = i == 0 ? dk : dv;
      struct {
        uint64_t out, partials, bias;
        uint32_t n, Nc, splits, has_bias, accumulate;
        float alpha;
      } push{address(to), address(dq) + i * splits * partial_bytes, 0, u32(to.numel()), 1, splits, 0, 0, 1.0f};
      ctx().dispatch(reduce[i], push, {writes(to), {address(dq), 2 * splits * partial_bytes, false}});
    }
    struct {
      uint64_t dq, dout, out, lse, q, k, v, cu;
      uint32_t N, S, Hq, Hkv;
      float scale;
    } query_side{address(dq),    address(dout), address(out), address(lse), address(q), address(k), address(v),
                 address(cu_seqlens), u32(q.rows()), u32(cu_seqlens.numel() - 1), u32(q.cols() / hd),
                 u32(k.cols() / hd), attention_scale(hd)};
    ctx().dispatch(attention_pass(AttentionPass::Query, shape, operands), query_side,
                   {writes(dq), reads(dout), reads(out), reads(lse), reads(q), reads(k), reads(v), reads(cu_seqlens)});
  }
  // Split over the context where few query rows would leave the device idle (decoding), the
  // splits' partials in the backend's own scratch, merged by a second dispatch.
  void paged_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& block_tables, const Tensor& cu_seqlens, const Tensor& context_lens,
                               int64_t hd, int64_t block_size) override {
    const vulkan_geometry::PagedAttention shape{.rows = q.rows(),
                                                .q_heads = q.cols() / hd,
                                                .kv_heads = k_cache.cols() / hd,
                                                .head_dim = hd,
                                                .max_context = block_tables.cols() * block_size,
                                                .cache = k_cache.dtype};
    const vulkan_geometry::PagedSplit split = vulkan_geometry::paged_split(shape, kSplitScratchFloats);
    const std::vector<VulkanDispatch> dispatches = vulkan_geometry::paged_attention(shape, kSplitScratchFloats);
    struct {
      uint64_t out, q, k_cache, v_cache, tables, cu, context, partials;
      uint32_t N, S, Hq, Hkv, max_blocks, block_size, split_keys, splits;
      float scale;
    } push{address(out),
           address(q),
           address(k_cache),
           address(v_cache),
           address(block_tables),
           address(cu_seqlens),
           address(context_lens),
           split_scratch_,
           u32(q.rows()),
           u32(cu_seqlens.numel() - 1),
           u32(shape.q_heads),
           u32(shape.kv_heads),
           u32(block_tables.cols()),
           u32(block_size),
           split.split_keys,
           split.splits,
           attention_scale(hd)};
    ctx().dispatch(dispatches[0], push,
                   {writes(out), scratch(true), reads(q), reads(k_cache), reads(v_cache), reads(block_tables),
                    reads(cu_seqlens), reads(context_lens)});
    if (dispatches.size() < 2) return;
    struct {
      uint64_t out, partials;
      uint32_t rows, hd, splits;
    } merge{address(out), split_scratch_, u32(q.rows() * shape.q_heads), u32(hd), split.splits};
    ctx().dispatch(dispatches[1], merge, {writes(out), scratch(false)});
  }
  // The fused head on the device: each chunk's logits are computed here (16-bit heads read as
  // stored); cross-entropy runs on them (cross_entropy.comp), writing its gradient in place for
  // drows = dlogits @ W and dW += dlogits^T rows, and per-row losses come back once per call. A
  // custom loss, or an observer that needs logits, gets each chunk through host staging and its
  // gradient comes back. RowStats for observers are always computed on the device, back once.
  LossSum lm_head_loss(const LmHeadArgs& a) override {
    if (a.quantized)
      throw Error("--backend vulkan computes losses with a 16-bit or float32 LM head; a packed head (--lm_head_bits) "
                  "computes losses on --backend cpu, and decodes on vulkan");
    const HostChunkStaging& st = a.staging;
    MT_ASSERT(st.targets && st.positions && st.row_losses && (!a.observer || st.row_stats),
              "the vulkan backend hands values to host code through staging buffers");
    const int64_t N = a.hidden.rows(), D = a.weight.cols(), V = a.weight.rows(), chunk_rows = a.logits.rows();
    // The targets' positions, found on the host (from the caller's copy of the targets, or a
    // download into the staging that then holds them compacted in place).
    const int32_t* targets = a.host_targets.data();
    if (a.host_targets.empty()) {
      ctx().download(st.targets, address(a.targets), static_cast<size_t>(N) * sizeof(int32_t));
      targets = st.targets;
    }
    int64_t count = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = targets[n];
      if (t == kIgnoreIndex) continue;
      MT_ASSERT(t >= 0 && t < V, "target id out of range");
      st.positions[count] = static_cast<int32_t>(n);
      st.targets[count++] = t;
    }
    if (count > 0) ctx().upload(address(a.positions), st.positions, static_cast<size_t>(count) * sizeof(int32_t));
    const bool backward = static_cast<bool>(a.dhidden);
    // Mixed precision: the head's products on the matrix units, the head stored in that dtype.
    const bool half = a.operands != DType::F32;
    MT_ASSERT(!half || (a.weight.dtype == a.operands && half_unit_), "16-bit head products need the head stored in "
                                                                    "that dtype and the device's matrix units");
    const auto* cross_entropy = dynamic_cast<const CrossEntropyLoss*>(a.loss);
    const bool logits_to_host = !cross_entropy || (a.observer && a.observer->needs_logits());
    if (!logits_to_host) MT_ASSERT(a.row_losses.numel() >= count, "vulkan: no row_losses workspace");
    if (a.observer) MT_ASSERT(a.row_stats.numel() >= 4 * count, "vulkan: no row_stats workspace");
    if (backward) fill(a.dhidden, 0.0f);
    double total = 0.0;
    for (int64_t c0 = 0; c0 < count; c0 += chunk_rows) {
      const int64_t m = std::min(chunk_rows, count - c0);
      const Tensor pos = a.positions.flat_range(c0, m);
      const Tensor rows(a.rows.data, DType::F32, {m, D}), logits(a.logits.data, DType::F32, {m, V});
      rows_op(rows, a.hidden, pos, 0);
      if (half)  // logits = rows @ W^T, the rows rounded to 16 bits as the product loads them
        half_gemm(logits, rows, a.weight, m, V, D, /*a_m=*/D, /*a_k=*/1, /*b_k=*/1, /*b_n=*/D, 1.0f, false);
      else
        matmul(logits, rows, a.weight, Tensor{}, false, 1.0f);
      const uint32_t flags = (logits_to_host ? 0u : 1u | (backward ? 2u : 0u)) | (a.observer ? 4u : 0u);
      if (flags != 0) {
        const std::vector<VulkanDispatch> passes = vulkan_geometry::cross_entropy(m, V, kSplitScratchFloats);
        const uint32_t pieces = passes[0].x, piece = u32((V + pieces - 1) / pieces);
        struct {
          uint64_t logits, targets, positions, partials;
          uint32_t V, piece, pieces;
        } partials{address(logits), address(a.targets), address(pos), split_scratch_, u32(V), piece, pieces};
        ctx().dispatch(passes[0], partials, {reads(logits), reads(a.targets), reads(pos), scratch(true)});
        struct {
          uint64_t logits, targets, positions, losses, stats, partials;
          uint32_t V, piece, pieces, flags;
          float smoothing;
        } push{address(logits),
               address(a.targets),
               address(pos),
               logits_to_host ? 0 : address(a.row_losses.flat_range(c0, m)),
               a.observer ? address(a.row_stats.flat_range(4 * c0, 4 * m)) : 0,
               split_scratch_,
               u32(V),
               piece,
               pieces,
               flags,
               cross_entropy ? cross_entropy->label_smoothing() : 0.0f};
        const Tensor losses = logits_to_host ? Tensor{} : a.row_losses.flat_range(c0, m),
                     stats = a.observer ? a.row_stats.flat_range(4 * c0, 4 * m) : Tensor{};
        const std::initializer_list<Access> second = {writes(logits), reads(a.targets), reads(pos), writes(losses),
                                                      writes(stats), scratch(false)};
        if (target_piece_first()) {  // the order that exposes a read of the target's overwritten column
          push.flags = flags | 8u;
          ctx().dispatch(passes[1], push, second);
          push.flags = flags | 16u;
        }
        ctx().dispatch(passes[1], push, second);
      }
      if (logits_to_host) {
        if (!st.logits)
          throw Error("--backend vulkan: a custom loss or a metric that reads logits needs the host staging of a "
                      "logits chunk, which this model was planned without (ModelOptions::host_logits)");
        ctx().download(st.logits, address(logits), logits.bytes());
        const int32_t* row_targets = st.targets + c0;
        if (a.observer && a.observer->needs_logits())
          a.observer->observe({st.logits, row_targets, st.positions + c0, m, V});
        total += a.loss->chunk(st.logits, row_targets, m, V, backward);
        if (backward) ctx().upload(address(logits), st.logits, logits.bytes());  // now d(sum)/d(logits)
      }
      if (!backward) continue;
      const Tensor drows(a.drows.data, DType::F32, {m, D});
      fill(drows, 0.0f);
      if (half) {  // d(logits) x grad_scale rounded to 16 bits as loaded, the rows too
        half_gemm(drows, logits, a.weight, m, D, V, /*a_m=*/V, /*a_k=*/1, /*b_k=*/D, /*b_n=*/1, 1.0f, true, {},
                  a.grad_scale);
        if (a.dweight)
          half_gemm(a.dweight, logits, rows, V, D, m, /*a_m=*/1, /*a_k=*/V, /*b_k=*/D, /*b_n=*/1, 1.0f, true, {},
                    a.grad_scale);
      } else {
        gemm(drows, logits, a.weight, m, D, V, /*a_m=*/V, /*a_k=*/1, /*b_k=*/D, /*b_n=*/1, a.grad_scale);
        if (a.dweight)
          gemm(a.dweight, logits, rows, V, D, m, /*a_m=*/1, /*a_k=*/V, /*b_k=*/D, /*b_n=*/1, a.grad_scale);
      }
      rows_op(a.dhidden, drows, pos, 1);
    }
    if (!logits_to_host && count > 0 && a.defer_sum && !a.observer && loss_slots_ < kLossSlots) {
      // The sum stays on the device, in a slot of the partials buffer that the gradient norm's
      // download brings back (take_deferred_loss_sum).
      struct {
        uint64_t out, x;
        uint32_t n;
      } push{partials_ + loss_slots_ * sizeof(float), address(a.row_losses), u32(count)};
      ctx().dispatch(vulkan_geometry::per_row("loss_sum", 1, count, 4, 1), push,
                     {{partials_ + loss_slots_ * sizeof(float), sizeof(float), true}, reads(a.row_losses)});
      ++loss_slots_;
      return LossSum{0.0, count, true};
    }
    // The row losses and the observer's row statistics come back together: one wait.
    const size_t losses_bytes = !logits_to_host && count > 0 ? static_cast<size_t>(count) * sizeof(float) : 0,
                 stats_bytes = a.observer && count > 0 ? static_cast<size_t>(count) * sizeof(RowStats) : 0;
    ctx().download({{st.row_losses, address(a.row_losses), losses_bytes}, {st.row_stats, address(a.row_stats), stats_bytes}});
    if (losses_bytes)
      for (int64_t r = 0; r < count; ++r) total += st.row_losses[r];  // in row order: the same sum every run
    if (stats_bytes) a.observer->observe_rows({st.row_stats, st.targets, st.positions, count});
    return LossSum{total, count};
  }
  double take_deferred_loss_sum() override {
    if (loss_slots_ > 0) {  // not brought back by a gradient norm since: a wait of its own
      ctx().download(partial_sums_.data(), partials_, loss_slots_ * sizeof(float));
      collect_loss_slots();
    }
    const double sum = deferred_loss_;
    deferred_loss_ = 0.0;
    return sum;
  }

 private:
  // The tensor tables of the multi-tensor shaders (tensor_table.glsl) for n tensors, entry(i)
  // giving tensor i (its non-empty grads counted), in parts of at most kTableEntries: for each,
  // body(table address, elements, tensors). Table `which` (0: the gradient norm's, 1: AdamW's)
  // is uploaded, recorded into the command buffer (no wait), only when it differs from what the
  // device holds.
  template <class Entry, class Body>
  void for_each_table(size_t n, int which, const Entry& entry, const Body& body) {
    const uint64_t at = tables_ + static_cast<uint64_t>(which) * kTableEntries * kTableWords * sizeof(uint64_t);
    for (size_t begin = 0; begin < n; begin += kTableEntries) {
      std::vector<uint64_t>& words = table_words_;
      words.clear();
      uint64_t total = 0;
      for (size_t i = begin; i < std::min(n, begin + kTableEntries); ++i) {
        const AdamWTensor t = entry(i);
        if (t.grad.numel() == 0) continue;
        t.grad.f32();
        const auto count = static_cast<uint64_t>(t.grad.numel());
        if (t.storage)
          MT_ASSERT(t.storage.numel() == t.grad.numel() && t.storage.dtype != DType::F32, "adamw storage");
        words.insert(words.end(), {address(t.param), address(t.grad), address(t.m), address(t.v), total,
                                   count | (t.decay ? uint64_t{1} << 63 : 0), address(t.storage),
                                   t.storage ? vulkan_geometry::dtype_code(t.storage.dtype) : 0u});
        total += count;
      }
      if (words.empty()) continue;
      if (uploaded_tables_[which] != words) {
        ctx().upload(at, words.data(), words.size() * sizeof(uint64_t));
        uploaded_tables_[which] = words;
      }
      body(at, total, static_cast<uint32_t>(words.size() / kTableWords));
    }
  }
  // out[c] += alpha * sum over rows of a[n, c] (b and rstd absent), or of a[n, c] b[n, c] rstd[n]:
  // two passes through the scratch (column_partials.comp, column_finish.comp).
  void column_sums(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& rstd, int64_t rows, int64_t cols,
                   float alpha) {
    const vulkan_geometry::ColumnBlocks blocks = vulkan_geometry::column_blocks(rows, cols, kSplitScratchFloats);
    const std::vector<VulkanDispatch> d =
        vulkan_geometry::column_sums(rows, cols, b ? 8 : 4, kSplitScratchFloats);
    struct {
      uint64_t partials, a, b, rstd;
      uint32_t N, C, rows_per_block, mode;
    } partials{split_scratch_, address(a), address(b), address(rstd), u32(rows), u32(cols), blocks.rows_per_block,
               b ? 1u : (a.dtype == DType::F32 ? 0u : 1u + vulkan_geometry::dtype_code(a.dtype))};
    ctx().dispatch(d[0], partials, {scratch(true), reads(a), reads(b), reads(rstd)});
    struct {
      uint64_t out, partials;
      uint32_t C, blocks;
      float alpha;
    } finish{address(out), split_scratch_, u32(cols), blocks.blocks, alpha};
    ctx().dispatch(d[1], finish, {writes(out), scratch(false)});
  }
  // scale_sum_squares.comp over xs: the partial sums after the loss slots; returns the number of
  // floats from the start of the partials buffer that then matter (loss slots included).
  uint32_t sum_squares_partials(std::span<const Tensor> xs, float scale) {
    uint32_t used = kLossSlots;  // after the loss slots, which the same download brings back
    auto entry = [&](size_t i) { return AdamWTensor{.grad = xs[i]}; };
    for_each_table(xs.size(), 0, entry, [&](uint64_t table, uint64_t total, uint32_t count) {
      const VulkanDispatch d = vulkan_geometry::multi_tensor("scale_sum_squares", total, 8, 3, kPartialsPerCall);
      MT_ASSERT(used + d.x <= kPartials, "vulkan: more partial sums than the buffer holds");
      struct {
        uint64_t table, total, partials;
        uint32_t count;
        float scale;
      } push{table, total, partials_ + used * sizeof(float), count, scale};
      ctx().dispatch(d, push);
      used += d.x;
    });
    return used;
  }
  // The squared norm from the partials: added in order in float64 (step_decision.comp adds them
  // the same way).
  static double sum_of_partials(const float* partials, uint32_t used) {
    double total = 0.0;
    for (uint32_t i = kLossSlots; i < used; ++i) total += partials[i];
    return total;
  }
  // AdamW's per-step constants as float32, from the host's float64 arithmetic.
  struct AdamWConstants {
    float step_size, inv_sqrt_bias2, keep;
  };
  static AdamWConstants adamw_constants(const AdamWStep& step) {
    const AdamWConfig& c = step.config;
    const double bias1 = 1.0 - std::pow(c.beta1, static_cast<double>(step.t));
    const double bias2 = 1.0 - std::pow(c.beta2, static_cast<double>(step.t));
    return {static_cast<float>(step.learning_rate / bias1), static_cast<float>(1.0 / std::sqrt(bias2)),
            static_cast<float>(1.0 - step.learning_rate * c.weight_decay)};
  }
  // adamw.comp over the tensors: the constants of `step`, or those of a decision (its address:
  // step_decision.comp's; 0 for none).
  void adamw(std::span<const AdamWTensor> tensors, const AdamWStep& step, uint64_t decision) {
    const AdamWConfig& c = step.config;
    const AdamWConstants k = adamw_constants(step);
    auto entry = [&](size_t i) {
      MT_ASSERT(tensors[i].param.numel() == tensors[i].grad.numel(), "adamw of tensors of different sizes");
      return tensors[i];
    };
    for_each_table(tensors.size(), 1, entry, [&](uint64_t table, uint64_t total, uint32_t count) {
      struct {
        uint64_t table, total, decision;
        uint32_t count;
        float b1, b2, step_size, inv_sqrt_bias2, eps, keep, grad_scale;
      } push{table,
             total,
             decision,
             count,
             static_cast<float>(c.beta1),
             static_cast<float>(c.beta2),
             k.step_size,
             k.inv_sqrt_bias2,
             static_cast<float>(c.eps),
             k.keep,
             step.grad_scale};
      ctx().dispatch(vulkan_geometry::multi_tensor("adamw", total, 28, 16, vulkan_geometry::kMaxGroups), push);
    });
  }
  // The loss slots of the last download, summed in slot order into deferred_loss_.
  void collect_loss_slots() {
    for (uint32_t i = 0; i < loss_slots_; ++i) deferred_loss_ += partial_sums_[i];
    loss_slots_ = 0;
  }
  void matmul(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias, bool accumulate,
              float scale) {
    const int64_t N = inp.rows(), C = inp.cols(), OC = weight.rows();
    MT_ASSERT(weight.cols() == C && out.rows() == N && out.cols() == OC, "matmul shapes");
    if (inp.dtype != DType::F32)  // 16-bit operands (mixed precision) on the matrix units, any rows
      return half_gemm(out, inp, weight, N, OC, C, /*a_m=*/C, /*a_k=*/1, /*b_k=*/1, /*b_n=*/C, scale, accumulate, bias);
    if (N > vulkan_geometry::kMatvecRows)  // out = inp @ W^T: A(m, k) = inp[m C + k], B(k, n) = W[n C + k]
      return gemm(out, inp, weight, N, OC, C, /*a_m=*/C, /*a_k=*/1, /*b_k=*/1, /*b_n=*/C, scale, accumulate, bias);
    const GroupMember one{out, weight, bias, nullptr, Tensor{}};
    matvec(std::span(&one, 1), inp, accumulate, scale);
  }
  // matvec.comp: up to three products of one input of at most kMatvecRows rows in one dispatch,
  // the members' weights of one dtype; with `swiglu`, gate and up and then swiglu = silu(gate) * up.
  void matvec(std::span<const GroupMember> group, const Tensor& inp, bool accumulate, float scale,
              const Tensor& swiglu = {}) {
    MT_ASSERT(!group.empty() && group.size() <= kMatvecMembers, "matvec of one to three products");
    MT_ASSERT(!swiglu || (group.size() == 2 && !accumulate), "matvec's activation follows gate and up");
    const int64_t N = inp.rows(), C = inp.cols();
    inp.f32();
    bool vector_loads = C % 8 == 0 && address(inp) % 16 == 0;
    uint64_t out[kMatvecMembers] = {}, w[kMatvecMembers] = {}, bias[kMatvecMembers] = {};
    uint32_t oc[kMatvecMembers] = {}, has_bias = 0;
    std::vector<Access> accesses{reads(inp)};
    for (size_t i = 0; i < group.size(); ++i) {
      const GroupMember& m = group[i];
      m.out.f32();
      MT_ASSERT(m.weight.cols() == C && m.out.rows() == N && m.out.cols() == m.weight.rows() &&
                    m.weight.dtype == group[0].weight.dtype,
                "matvec: a member's shapes or weight dtype differ");
      vector_loads = vector_loads && address(m.weight) % 16 == 0;
      out[i] = address(m.out), w[i] = address(m.weight), bias[i] = address(m.bias);
      oc[i] = u32(m.weight.rows());
      if (m.bias) has_bias |= 1u << i;
      accesses.insert(accesses.end(), {writes(m.out), reads(m.weight), reads(m.bias)});
    }
    if (swiglu) {
      MT_ASSERT(swiglu.rows() == N && swiglu.cols() == oc[0] && oc[1] == oc[0], "matvec: the activation's shape");
      out[2] = address(swiglu);
      accesses.push_back(writes(swiglu));
    }
    struct {
      uint64_t out0, out1, out2, inp, w0, w1, w2, bias0, bias1, bias2;
      uint32_t N, OC0, OC1, OC2, C, has_bias, accumulate;
      float scale;
    } push{out[0], out[1], out[2], address(inp), w[0], w[1], w[2], bias[0], bias[1], bias[2], u32(N), oc[0], oc[1],
           oc[2], u32(C), has_bias, accumulate ? 1u : 0u, scale};
    // Each member starts at a workgroup of its own: the grid covers their columns rounded up.
    int64_t columns = 0;
    for (const uint32_t n : oc)
      columns += (n + vulkan_geometry::kMatvecOutputs - 1) / vulkan_geometry::kMatvecOutputs * vulkan_geometry::kMatvecOutputs;
    const VulkanDispatch d =
        swiglu ? vulkan_geometry::matvec_swiglu(N, oc[0], C, group[0].weight.dtype, vector_loads)
               : vulkan_geometry::matvec(N, columns, C, group[0].weight.dtype, vector_loads);
    ctx().dispatch(d.shader, d.constants, std::as_bytes(std::span(&push, 1)), d.x, d.y, d.z, d.flops, d.bytes,
                   accesses);
  }
  static constexpr size_t kMatvecMembers = 3;

  // rmsnorm.comp: out = rmsnorm(inp), or with `add` inp += add first (the same pass).
  void rmsnorm(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& add, const Tensor& w, float eps) {
    struct {
      uint64_t out, rstd, inp, w, add;
      uint32_t N, C;
      float eps;
    } push{address(out), address(rstd), address(inp), address(w), address(add), u32(inp.rows()), u32(inp.cols()), eps};
    ctx().dispatch(vulkan_geometry::rmsnorm(inp.rows(), inp.cols(), static_cast<bool>(add)), push,
                   {writes(out), writes(rstd), add ? writes(inp) : reads(inp), reads(w), reads(add)});
  }
  // out[M, Nc] (+)= alpha A @ B (+ bias), A float32 and B float32 or 16-bit, both given by
  // strides (gemm.comp; split over K through the scratch where the geometry says so).
  void gemm(const Tensor& out, const Tensor& a, const Tensor& b, int64_t M, int64_t Nc, int64_t K, int64_t a_m,
            int64_t a_k, int64_t b_k, int64_t b_n, float alpha, bool accumulate = true, const Tensor& bias = {}) {
    a.f32();
    const uint32_t vectors = vulkan_geometry::gemm_vector_loads(a_m, a_k, M, K, address(a), DType::F32) |
                             (vulkan_geometry::gemm_vector_loads(b_n, b_k, Nc, K, address(b), b.dtype) << 1);
    product(vulkan_geometry::gemm(M, Nc, K, b.dtype, kSplitScratchFloats), out, a, b, M, Nc, K, a_m, a_k, b_k, b_n,
            alpha, accumulate, bias, vectors, 1.0f);
  }
  // out[M, Nc] (+)= alpha A @ B (+ bias) with float16 operands on the device's matrix units
  // (gemm_coopmat.comp), A and B given by strides; a float32 operand is rounded to float16 as it
  // is loaded, A times a_scale first. Split over K as gemm().
  void half_gemm(const Tensor& out, const Tensor& a, const Tensor& b, int64_t M, int64_t Nc, int64_t K, int64_t a_m,
                 int64_t a_k, int64_t b_k, int64_t b_n, float alpha, bool accumulate = true, const Tensor& bias = {},
                 float a_scale = 1.0f) {
    MT_ASSERT(half_unit_ && (a.dtype == DType::F32 || a.dtype == DType::F16) &&
                  (b.dtype == DType::F32 || b.dtype == DType::F16),
              "vulkan: 16-bit products need the device's float16 cooperative matrices (sixteen_bit_products)");
    product(vulkan_geometry::gemm_coopmat(M, Nc, K, *half_unit_, a.dtype, b.dtype, kSplitScratchFloats), out, a, b, M,
            Nc, K, a_m, a_k, b_k, b_n, alpha, accumulate, bias, 0, a_scale);
  }
  // gemm.comp's and gemm_coopmat.comp's push constants (the two share their block).
  struct ProductPush {
    uint64_t out, a, b, bias;
    uint32_t M, Nc, K, a_m, a_k, b_k, b_n, has_bias, accumulate, k_split, partial, vectors;
    float alpha, a_scale;
    uint64_t out2 = 0, b2 = 0, bias2 = 0, h = 0;  // the SWIGLU pass's (gemm_swiglu)
  };
  // gate = inp @ Wg^T (+ bias), up = inp @ Wu^T (+ bias) and h = silu(gate) * up over any rows, in
  // one pass of gemm.comp (float32 operands) or gemm_coopmat.comp (float16 ones), their SWIGLU
  // variant: each workgroup's tile of gate, then the same tile of up and the activation.
  void gemm_swiglu(const GroupMember& gate, const GroupMember& up, const Tensor& inp, const Tensor& h) {
    const int64_t N = inp.rows(), C = inp.cols(), I = gate.weight.rows();
    for (const Tensor* t : {&gate.out, &up.out, &h}) {
      t->f32();
      MT_ASSERT(t->rows() == N && t->cols() == I, "vulkan: gate, up and h are [rows, intermediate]");
    }
    MT_ASSERT(gate.weight.cols() == C && up.weight.cols() == C && up.weight.rows() == I, "vulkan: gate and up shapes");
    const bool half = inp.dtype != DType::F32;
    // 128-bit loads where the input and both weights allow them (float32 only, as gemm()).
    const uint32_t vectors =
        half ? 0u
             : vulkan_geometry::gemm_vector_loads(C, 1, N, C, address(inp), DType::F32) |
                   ((vulkan_geometry::gemm_vector_loads(C, 1, I, C, address(gate.weight), gate.weight.dtype) &
                     vulkan_geometry::gemm_vector_loads(C, 1, I, C, address(up.weight), up.weight.dtype))
                    << 1);
    const ProductPush push{.out = address(gate.out),
                           .a = address(inp),
                           .b = address(gate.weight),
                           .bias = address(gate.bias),
                           .M = u32(N),
                           .Nc = u32(I),
                           .K = u32(C),
                           .a_m = u32(C),
                           .a_k = 1,
                           .b_k = 1,
                           .b_n = u32(C),
                           .has_bias = (gate.bias ? 1u : 0u) | (up.bias ? 2u : 0u),
                           .accumulate = 0,
                           .k_split = u32(std::max<int64_t>(C, 1)),
                           .partial = 0,
                           .vectors = vectors,
                           .alpha = 1.0f,
                           .a_scale = 1.0f,
                           .out2 = address(up.out),
                           .b2 = address(up.weight),
                           .bias2 = address(up.bias),
                           .h = address(h)};
    ctx().dispatch(half ? vulkan_geometry::gemm_coopmat_swiglu(N, I, C, *half_unit_, inp.dtype, gate.weight.dtype)
                        : vulkan_geometry::gemm_swiglu(N, I, C, gate.weight.dtype),
                   push,
                   {writes(gate.out), writes(up.out), writes(h), reads(inp), reads(gate.weight), reads(up.weight),
                    reads(gate.bias), reads(up.bias)});
  }
  // One product's dispatches as the geometry gave them (gemm.comp or gemm_coopmat.comp), then
  // gemm_reduce.comp where K was split.
  void product(const std::vector<VulkanDispatch>& d, const Tensor& out, const Tensor& a, const Tensor& b, int64_t M,
               int64_t Nc, int64_t K, int64_t a_m, int64_t a_k, int64_t b_k, int64_t b_n, float alpha, bool accumulate,
               const Tensor& bias, uint32_t vectors, float a_scale) {
    out.f32();
    const vulkan_geometry::GemmSplit split = vulkan_geometry::gemm_split(M, Nc, K, kSplitScratchFloats);
    const bool partial = d.size() > 1;
    const ProductPush push{partial ? split_scratch_ : address(out),
           address(a),
           address(b),
           address(bias),
           u32(M),
           u32(Nc),
           u32(K),
           u32(a_m),
           u32(a_k),
           u32(b_k),
           u32(b_n),
           bias ? 1u : 0u,
           accumulate ? 1u : 0u,
           split.k_split,
           partial ? 1u : 0u,
           vectors,
           alpha,
           a_scale};
    ctx().dispatch(d[0], push, {partial ? scratch(true) : writes(out), reads(a), reads(b), reads(bias)});
    if (!partial) return;
    struct {
      uint64_t out, partials, bias;
      uint32_t n, Nc, splits, has_bias, accumulate;
      float alpha;
    } reduce{address(out), split_scratch_, address(bias), u32(M * Nc), u32(Nc), split.splits, bias ? 1u : 0u,
             accumulate ? 1u : 0u, alpha};
    ctx().dispatch(d[1], reduce, {writes(out), scratch(false), reads(bias)});
  }
  // mode 0: out[r] = inp[index[r]]; mode 1: out[index[r]] = inp[r]; mode 2: combine_rows (rows
  // of float32 matrices; gather_rows.comp).
  void rows_op(const Tensor& out, const Tensor& inp, const Tensor& index, uint32_t mode, const Tensor& weights = {}) {
    const Tensor& rows = mode == 1 ? inp : out;
    const uint32_t K = mode == 2 && index ? u32(index.cols()) : 1u;
    struct {
      uint64_t out, inp, index, weights;
      uint32_t R, C, mode, K, has_index;
    } push{address(out),     address(inp),     address(index), address(weights),
           u32(rows.rows()), u32(rows.cols()), mode,           K,
           index ? 1u : 0u};
    ctx().dispatch(vulkan_geometry::elementwise("gather_rows", rows.numel(), 8 + 8 * K, 0), push,
                   {writes(out), reads(inp), reads(index), reads(weights)});
  }
  void quantized(const Tensor& out, const Tensor& inp, const QuantizedWeight& w, const Tensor& bias, uint32_t mode) {
    MT_ASSERT(w.bits == 4 || w.bits == 8 || w.bits == 2, "quantized weights of 2, 4 or 8 bits");
    struct {
      uint64_t out, inp, codes, scales, zeros, g_idx, bias;
      uint32_t N, IN, OUT, bits, group_size, groups, has_g_idx, bdtype, mode;
    } push{address(out),
           address(inp),
           address(w.codes),
           address(w.scales),
           address(w.zeros),
           address(w.g_idx),
           address(bias),
           u32(inp.rows()),
           u32(w.in),
           u32(w.out),
           static_cast<uint32_t>(w.bits),
           u32(w.group_size),
           u32(w.groups),
           w.g_idx ? 1u : 0u,
           bias ? vulkan_geometry::dtype_code(bias.dtype) : 0u,
           mode};
    // Many rows with int8 activations asked for: on the int8 matrix units.
    const bool int8 = mode == 0 && int8_unit_ && rounds_activations(w, inp.rows());
    ctx().dispatch(int8 ? vulkan_geometry::quantized_matmul_int8_coopmat(inp.rows(), w.in, w.out, w.bits,
                                                                         int8_activation_block(w), *int8_unit_)
                        : vulkan_geometry::quantized_matmul(inp.rows(), mode == 0 ? w.in : w.out,
                                                            mode == 0 ? w.out : w.in, static_cast<int>(w.bits)),
                   push,
                   {writes(out), reads(inp), reads(w.codes), reads(w.scales), reads(w.zeros), reads(w.g_idx),
                    reads(bias)});
  }
  // 1 / sqrt(head_dim), after checking head_dim against what the shaders hold per thread.
  static vulkan_geometry::Attention attention_shape(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens,
                                                   int64_t hd) {
    return {.tokens = q.rows(), .sequences = cu_seqlens.numel() - 1, .q_heads = q.cols() / hd,
            .kv_heads = k.cols() / hd, .head_dim = hd};
  }
  // An attention pass's dispatch: on the matrix units where float16 operands are asked for and a
  // tile of the pass takes this head dimension within the device's shared memory (on flexible
  // matrices, attention_coopmat2.glsl's shaders, where the device has them), else the float32
  // shader.
  VulkanDispatch attention_pass(vulkan_geometry::AttentionPass pass, const vulkan_geometry::Attention& shape,
                                DType operands) const {
    using vulkan_geometry::AttentionPass;
    MT_ASSERT(operands == DType::F32 || operands == DType::F16, "vulkan attention: float32 or float16 operands");
    if (operands == DType::F16 && flexible_unit_ && !coopmat2_off() &&
        vulkan_geometry::attention_coopmat2_tile(shape.head_dim, *flexible_unit_, pass) != 0)
      return vulkan_geometry::attention_coopmat2(shape, *flexible_unit_, pass);
    if (operands == DType::F16 && half_unit_ &&
        vulkan_geometry::attention_coopmat_tile(shape.head_dim, *half_unit_, pass) != 0)
      return vulkan_geometry::attention_coopmat(shape, *half_unit_, pass);
    return pass == AttentionPass::Forward ? vulkan_geometry::attention_forward(shape)
           : pass == AttentionPass::Query ? vulkan_geometry::attention_backward_dq(shape)
                                          : vulkan_geometry::attention_backward_dkv(shape);
  }
  static float attention_scale(int64_t hd) {
    MT_ASSERT(hd > 0 && hd <= kMaxAttentionHeadDim, "head_dim within kMaxAttentionHeadDim");
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  }
  // x's heads, then y's where given (the same rows: q and k), in one dispatch.
  void rope(const Tensor& x, const Tensor& y, const Tensor& positions, const Tensor& inv_freq, float direction) {
    const int64_t half = inv_freq.numel(), heads = x.cols() / (2 * half), y_heads = y ? y.cols() / (2 * half) : 0;
    MT_ASSERT(!y || y.rows() == x.rows(), "rope: a pair of tensors of the same rows");
    struct {
      uint64_t x, y, positions, inv_freq;
      uint32_t N, half_dim, heads, y_heads;
      float direction;
    } push{address(x), y ? address(y) : address(x), address(positions), address(inv_freq), u32(x.rows()), u32(half),
           u32(heads), u32(y_heads), direction};
    ctx().dispatch(vulkan_geometry::elementwise("rope", x.rows() * half * (heads + y_heads), 16, 6), push,
                   {writes(x), writes(y), reads(positions), reads(inv_freq)});
  }
  void embedding(const Tensor& table, const Tensor& rows, const Tensor& ids, uint32_t tdtype, uint32_t mode,
                 const VulkanDispatch& geometry) {
    struct {
      uint64_t table, rows, ids;
      uint32_t N, D, tdtype, mode;
    } push{address(table), address(rows), address(ids), u32(ids.numel()), u32(table.cols()), tdtype, mode};
    ctx().dispatch(geometry, push, {mode == 0 ? reads(table) : writes(table), mode == 0 ? writes(rows) : reads(rows),
                                    reads(ids)});
  }

  // Partial sums of scale_and_sum_squares, one float per workgroup, at most kPartialsPerCall per
  // table of tensors, in the backend's own small buffer and its host copy, after kLossSlots
  // floats for deferred loss sums (one per lm_head_loss call of a step).
  static constexpr uint32_t kPartials = 1u << 18, kPartialsPerCall = 8192, kLossSlots = 1024;
  // The multi-tensor shaders' tables: two of kTableEntries entries of kTableWords 64-bit words
  // (tensor_table.glsl's TABLE_WORDS; 64 KiB each, so an upload is recorded into the command
  // buffer).
  static constexpr size_t kTableEntries = 1024, kTableWords = 8;
  uint64_t tables_ = 0;
  std::vector<uint64_t> table_words_, uploaded_tables_[2];
  uint32_t loss_slots_ = 0;    // loss slots written since the last download of them
  double deferred_loss_ = 0;   // their sum, once downloaded, until take_deferred_loss_sum()
  // The device's context; an Error on a backend that only plans.
  VulkanContext& ctx() const {
    if (!ctx_)
      throw Error("--backend vulkan: this process plans for an absent device (--vulkan_max_allocation) and runs "
                  "nothing on it");
    return *ctx_;
  }
  std::optional<VulkanDeviceProfile> profile_;
  std::unique_ptr<VulkanContext> ctx_;
  // The split scratch as a dispatch's access: the split work writes it, its second pass reads it.
  Access scratch(bool write) const { return {split_scratch_, kSplitScratchFloats * sizeof(float), write}; }
  // The device's float16 matrix units (cooperative_product_shape), where gemm_coopmat.comp runs.
  std::optional<vulkan_geometry::MatrixUnit> half_unit_;
  // Its int8 ones (cooperative_int8_shape), where quantized_matmul_int8_coopmat.comp runs.
  std::optional<vulkan_geometry::MatrixUnit> int8_unit_;
  // The granularity of its flexible float16 matrices (cooperative_flexible_shape), where
  // attention_coopmat2.glsl's shaders run attention's passes.
  std::optional<vulkan_geometry::MatrixUnit> flexible_unit_;
  uint64_t partials_ = 0;
  // step_decision.comp's output (tensor_table.glsl's Decision), just before the partials.
  static constexpr size_t kDecisionBytes = 32;
  uint64_t decision_ = 0;
  uint32_t decided_ = 0;  // the partials that matter for a decided step not yet read (0: none)
  struct PendingStep {
    VulkanContext::PendingRead read;
    uint32_t partials = 0, loss_slots = 0;
  };
  std::vector<PendingStep> pending_steps_;  // read, not yet taken, oldest first
  std::vector<double> taken_marks_;         // the last taken step's marks, until a series starts
  // vulkan_geometry::kScratchFloats: the partials of split-K products, of paged attention's
  // context splits and of the loss's row pieces.
  static constexpr int64_t kSplitScratchFloats = vulkan_geometry::kScratchFloats;
  uint64_t split_scratch_ = 0;
  std::vector<float> partial_sums_ = std::vector<float>(kPartials);
  std::vector<int32_t> sample_words_, penalty_words_;  // sample_tokens' uploads
};

}  // namespace

Backend& vulkan_backend() {
  static VulkanBackend backend;
  return backend;
}

void plan_for_absent_vulkan_device(const VulkanDeviceProfile& profile) {
  absent_device() = profile;
}

bool vulkan_backend_available() {
  if (absent_device()) return true;  // a plan for a device that is not here needs none
  static const bool available = [] {
#if defined(__SANITIZE_ADDRESS__)
    return false;  // a sanitizer build: Mesa's drivers keep allocations to exit, which LeakSanitizer reports
#endif
    const VulkanDevices found = vulkan_devices();
    return std::any_of(found.devices.begin(), found.devices.end(),
                       [](const VulkanDeviceInfo& d) { return d.usable(); });
  }();
  return available;
}

}  // namespace memtune

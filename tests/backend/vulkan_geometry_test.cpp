// The vulkan backend's dispatch geometry at real models' shapes, without a GPU: every dispatch of
// a training step and of a decode step, as src/backend/vulkan/geometry.cpp computes it for the
// backend, for Qwen2.5-0.5B (full fine-tuning, 8 x 512 tokens), Qwen2.5-7B (LoRA rank 16 at
// 1 x 2048 tokens with gradient checkpointing) and Qwen2.5-7B decoding at batch 1 and 32 with a
// 4096-token context. Every dispatch of real work (over 1 GFLOP, or 64 MiB of traffic) must
// launch at least 4 x 132 workgroups: four per multiprocessor of an H100 / H200. The lists follow
// the model's own sequence of ops (src/model/decoder.cpp); TrainCliTest.EveryCommandRunsOnVulkan*
// checks that every shader a real run dispatched on lavapipe is in them.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/vulkan/geometry.h"
#include "support/vulkan_geometry_cases.h"

namespace memtune {
namespace {

namespace g = vulkan_geometry;
using Dispatches = std::vector<VulkanDispatch>;

struct Model {
  std::string name;
  int64_t D, I, Hq, Hkv, hd, V, L;
  bool qk_norm = false;  // Qwen3: RMSNorm over each head of q and k, before RoPE
};
const Model kQwen05B{"Qwen2.5-0.5B", 896, 4864, 14, 2, 64, 151936, 24};
const Model kQwen7B{"Qwen2.5-7B", 3584, 18944, 28, 4, 128, 152064, 28};
const Model kQwen72B{"Qwen2.5-72B", 8192, 29568, 64, 8, 128, 152064, 80};
const Model kQwen3_06B{"Qwen3-0.6B", 1024, 3072, 16, 8, 128, 151936, 28, true};

struct Training {
  int64_t tokens = 0, sequences = 1, lora_rank = 0;  // rank 0: full fine-tuning
  bool checkpointing = false;
  DType weights = DType::F32;
  int64_t loss_workspace_bytes = int64_t{192} << 20;  // the default --loss_workspace_bytes
};

void add(Dispatches& to, const Dispatches& more) { to.insert(to.end(), more.begin(), more.end()); }
void add(Dispatches& to, const VulkanDispatch& d) { to.push_back(d); }

// A linear layer [out, in] over N rows: forward, and its backward (dinp; dweight when trained;
// the bias gradient when trained and present); LoRA's two products beside it.
struct Linear {
  int64_t in, out;
  bool bias;
};
void linear_forward(Dispatches& d, const Training& t, int64_t N, const Linear& l) {
  // 16-bit weights are widened for more rows than the backend reads stored (16).
  if (t.weights != DType::F32 && N > 16) add(d, g::elementwise("convert", l.in * l.out, 6));
  const DType w = N > 16 ? DType::F32 : t.weights;
  if (N <= g::kMatvecRows)
    add(d, g::matvec(N, l.out, l.in, w, true));
  else
    add(d, g::gemm(N, l.out, l.in, w, g::kScratchFloats));
  if (t.lora_rank > 0) {
    add(d, g::elementwise("dropout", N * l.in, 8, 8));  // LoRA's dropout on its input
    add(d, g::gemm(N, t.lora_rank, l.in, DType::F32, g::kScratchFloats));
    add(d, g::gemm(N, l.out, t.lora_rank, DType::F32, g::kScratchFloats));
  }
}
void linear_backward(Dispatches& d, const Training& t, int64_t N, const Linear& l) {
  const int64_t r = t.lora_rank;
  if (r > 0) {
    add(d, g::gemm(N, r, l.out, DType::F32, g::kScratchFloats));  // du += dy @ B
    add(d, g::gemm(l.out, r, N, DType::F32, g::kScratchFloats));  // dB += dy^T @ u
    add(d, g::gemm(N, l.in, r, DType::F32, g::kScratchFloats));   // dxd = du @ A
    add(d, g::gemm(r, l.in, N, DType::F32, g::kScratchFloats));   // dA += du^T @ xd
    add(d, g::elementwise("dropout", N * l.in, 8, 8));            // dxd through the same mask
    add(d, g::elementwise("add_inplace", N * l.in, 12));          // dx += dxd
  }
  if (t.weights != DType::F32) add(d, g::elementwise("convert", l.in * l.out, 6));
  add(d, g::gemm(N, l.in, l.out, DType::F32, g::kScratchFloats));  // dx += dy @ W
  if (r > 0) return;                                               // the base is frozen
  add(d, g::gemm(l.out, l.in, N, DType::F32, g::kScratchFloats));  // dW += dy^T @ x
  if (l.bias) add(d, g::column_sums(N, l.out, 4, g::kScratchFloats));
}

struct Layer {
  Linear q, k, v, o, gate, up, down;
};
Layer layer_of(const Model& m) {
  return {{m.D, m.Hq * m.hd, true},  {m.D, m.Hkv * m.hd, true}, {m.D, m.Hkv * m.hd, true}, {m.Hq * m.hd, m.D, false},
          {m.D, m.I, false},         {m.D, m.I, false},         {m.I, m.D, false}};
}

// One layer's forward over N rows; `attention` is what runs between RoPE and o_proj (packed
// causal attention in training, the KV cache's write and paged attention in decoding).
// Generation fuses the add that ends a layer with the next layer's input norm (one rmsnorm pass
// with the residual add): layer `index` of a `chained` run, as decoder.cpp's layer_forward.
void layer_forward(Dispatches& d, const Model& m, const Training& t, int64_t N, const Dispatches& attention,
                   bool chained = false, int64_t index = 0) {
  const Layer l = layer_of(m);
  const bool input_normed = chained && index > 0, norm_next = chained && index + 1 < m.L;
  if (!input_normed) add(d, g::rmsnorm(N, m.D, false));
  // Decoding's q / k / v and gate / up run as one matvec each (matmul_forward_group).
  const bool grouped = N <= g::kMatvecRows && t.lora_rank == 0;
  if (grouped)
    add(d, g::matvec(N, l.q.out + l.k.out + l.v.out, m.D, t.weights, true));
  else
    for (const Linear& x : {l.q, l.k, l.v}) linear_forward(d, t, N, x);
  if (m.qk_norm) {
    add(d, g::rmsnorm(N * m.Hq, m.hd, false));
    add(d, g::rmsnorm(N * m.Hkv, m.hd, false));
  }
  add(d, g::elementwise("rope", N * (m.Hq + m.Hkv) * m.hd / 2, 16, 6));  // q and k in one dispatch
  add(d, attention);
  linear_forward(d, t, N, l.o);
  add(d, g::rmsnorm(N, m.D, true));  // the residual add and the norm in one pass
  // The activation in gate and up's pass (matmul_forward_group_swiglu): decoding's matvec, or
  // the GEMM where the weights are read as stored (float32) and no adapter adds to gate or up.
  if (grouped) {
    add(d, g::matvec_swiglu(N, m.I, m.D, t.weights, true));
  } else if (t.weights == DType::F32 && t.lora_rank == 0) {
    add(d, g::gemm_swiglu(N, m.I, m.D, DType::F32));
  } else {
    linear_forward(d, t, N, l.gate);
    linear_forward(d, t, N, l.up);
    add(d, g::elementwise("swiglu", N * m.I, 12, 8));
  }
  linear_forward(d, t, N, l.down);
  if (norm_next)
    add(d, g::rmsnorm(N, m.D, true));
  else
    add(d, g::elementwise("add_inplace", N * m.D, 12));
}
void layer_forward(Dispatches& d, const Model& m, const Training& t) {
  layer_forward(d, m, t, t.tokens, {g::attention_forward({t.tokens, t.sequences, m.Hq, m.Hkv, m.hd})});
}

void layer_backward(Dispatches& d, const Model& m, const Training& t) {
  const int64_t N = t.tokens;
  const Layer l = layer_of(m);
  const bool norms = t.lora_rank == 0;
  const g::Attention a{N, t.sequences, m.Hq, m.Hkv, m.hd};
  linear_backward(d, t, N, l.down);
  add(d, g::elementwise("swiglu_backward", N * m.I, 20, 12));
  linear_backward(d, t, N, l.gate);
  linear_backward(d, t, N, l.up);
  add(d, g::per_row("rmsnorm_backward", N, m.D, 12, 6));
  if (norms) add(d, g::column_sums(N, m.D, 8, g::kScratchFloats));
  linear_backward(d, t, N, l.o);
  add(d, g::attention_backward_dq(a));
  add(d, g::attention_backward_dkv(a));
  add(d, g::attention_key_reduce(a, g::attention_key_splits(a, g::attention_tiles(m.hd, true).rows)));
  add(d, g::elementwise("rope", N * (m.Hq + m.Hkv) * m.hd / 2, 16, 6));  // q and k in one dispatch
  if (m.qk_norm)
    for (const int64_t heads : {m.Hq, m.Hkv}) {
      add(d, g::per_row("rmsnorm_backward", N * heads, m.hd, 12, 6));
      if (norms) add(d, g::column_sums(N * heads, m.hd, 8, g::kScratchFloats));
    }
  for (const Linear& x : {l.q, l.k, l.v}) linear_backward(d, t, N, x);
  add(d, g::per_row("rmsnorm_backward", N, m.D, 12, 6));
  if (norms) add(d, g::column_sums(N, m.D, 8, g::kScratchFloats));
}

Dispatches training_step(const Model& m, const Training& t) {
  Dispatches d;
  const int64_t N = t.tokens;
  add(d, g::elementwise("embedding", N * m.D, 4 + dtype_size(t.weights), 0));
  for (int64_t l = 0; l < m.L; ++l) layer_forward(d, m, t);
  add(d, g::rmsnorm(N, m.D, false));
  // The fused head, chunk by chunk (src/model/decoder_plan.cpp sizes the chunk).
  const int64_t chunk = std::clamp<int64_t>(t.loss_workspace_bytes / ((m.V + 2 * m.D) * 4), 1, N);
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    add(d, g::elementwise("gather_rows", rows * m.D, 8, 0));
    add(d, g::gemm(rows, m.V, m.D, t.weights, g::kScratchFloats));  // the head read as stored
    add(d, g::cross_entropy(rows, m.V, g::kScratchFloats));
    add(d, g::gemm(rows, m.D, m.V, t.weights, g::kScratchFloats));
    add(d, g::elementwise("gather_rows", rows * m.D, 8, 0));
    if (t.lora_rank == 0) add(d, g::gemm(m.V, m.D, rows, DType::F32, g::kScratchFloats));
  }
  add(d, g::per_row("loss_sum", 1, N, 4, 1));  // the step's loss sum, left on the device
  add(d, g::per_row("rmsnorm_backward", N, m.D, 12, 6));
  if (t.lora_rank == 0) add(d, g::column_sums(N, m.D, 8, g::kScratchFloats));
  for (int64_t l = m.L - 1; l >= 0; --l) {
    if (t.checkpointing) layer_forward(d, m, t);
    layer_backward(d, m, t);
  }
  if (t.lora_rank == 0) add(d, g::embedding_backward(N, m.D));
  // The optimizer: the gradient norm and AdamW, tensor by tensor.
  const Layer l = layer_of(m);
  std::vector<int64_t> tensors;
  for (int64_t i = 0; i < m.L; ++i)
    for (const Linear& x : {l.q, l.k, l.v, l.o, l.gate, l.up, l.down}) {
      if (t.lora_rank > 0) {
        tensors.push_back(t.lora_rank * x.in);
        tensors.push_back(x.out * t.lora_rank);
      } else {
        tensors.push_back(x.in * x.out);
        if (x.bias) tensors.push_back(x.out);
      }
    }
  if (t.lora_rank == 0) tensors.push_back(m.V * m.D);
  uint64_t total = 0;  // every tensor in one dispatch each (up to 1024 tensors per table)
  for (const int64_t n : tensors) total += static_cast<uint64_t>(n);
  add(d, g::multi_tensor("fill_tensors", total, 4, 0, g::kMaxGroups));  // the gradients zeroed
  add(d, g::multi_tensor("scale_sum_squares", total, 8, 3, 8192));
  // The step decided on the device: one workgroup over the norm's partial sums.
  add(d, g::per_row("step_decision", 1, g::multi_tensor("scale_sum_squares", total, 8, 3, 8192).x, 4, 1));
  add(d, g::multi_tensor("adamw", total, 28, 16, g::kMaxGroups));
  return d;
}

// One decode step: `batch` sequences, one new token each, at `context` tokens (16-bit weights
// read as stored up to 16 rows, widened beyond), then the last rows' logits and sampling; or,
// with `prefill`, one sequence's `batch` prompt tokens at once, the last one's logits sampled.
Dispatches decode_step(const Model& m, int64_t batch, int64_t context, DType weights, bool prefill = false) {
  Dispatches d;
  const Training t{.tokens = batch, .weights = weights};
  add(d, g::elementwise("embedding", batch * m.D, 4 + dtype_size(weights), 0));
  Dispatches attention = {g::elementwise("kv_cache_write", batch * m.Hkv * m.hd, 2 * (4 + dtype_size(weights)))};
  add(attention, g::paged_attention({.rows = batch,
                                     .q_heads = m.Hq,
                                     .kv_heads = m.Hkv,
                                     .head_dim = m.hd,
                                     .max_context = context,
                                     .context = context,
                                     .cache = weights},
                                    g::kScratchFloats));
  for (int64_t i = 0; i < m.L; ++i) layer_forward(d, m, t, batch, attention, true, i);
  const int64_t sampled = prefill ? 1 : batch;
  add(d, g::elementwise("gather_rows", sampled * m.D, 8, 0));
  add(d, g::rmsnorm(sampled, m.D, false));
  linear_forward(d, Training{.tokens = sampled, .weights = weights}, sampled, {m.D, m.V, false});
  add(d, g::sample(sampled, m.V));
  return d;
}

struct Case {
  std::string name;
  Dispatches dispatches;
};
std::vector<Case> real_cases() {
  return {{"Qwen2.5-0.5B full fine-tuning, 8 x 512 tokens",
           training_step(kQwen05B, {.tokens = 8 * 512, .sequences = 8})},
          {"Qwen2.5-7B LoRA r16, 1 x 2048 tokens, checkpointing, bf16 base",
           training_step(kQwen7B, {.tokens = 2048, .lora_rank = 16, .checkpointing = true, .weights = DType::BF16})},
          {"Qwen2.5-7B decode, batch 1, 4096-token context, bf16", decode_step(kQwen7B, 1, 4096, DType::BF16)},
          {"Qwen2.5-7B decode, batch 32, 4096-token context, bf16", decode_step(kQwen7B, 32, 4096, DType::BF16)}};
}

// Shapes at the edge of one dispatch's grid (65,535 workgroups along each dimension): Qwen3's
// per-head norms at 4,096 tokens x 16 heads (65,536 rows), and what plans for a 72B model make.
std::vector<Case> grid_cases() {
  return {{"Qwen3-0.6B full fine-tuning, 1 x 4096 tokens", training_step(kQwen3_06B, {.tokens = 4096})},
          {"Qwen2.5-72B LoRA r16, 8 x 4096 tokens, checkpointing, bf16 base",
           training_step(kQwen72B, {.tokens = 8 * 4096, .sequences = 8, .lora_rank = 16, .checkpointing = true,
                                    .weights = DType::BF16})},
          {"Qwen2.5-72B prefill of 131072 tokens, bf16", decode_step(kQwen72B, 131072, 131072, DType::BF16, true)},
          {"Qwen2.5-72B decode, batch 256, 32768-token context, bf16", decode_step(kQwen72B, 256, 32768, DType::BF16)}};
}

TEST(VulkanGeometry, EveryDispatchOfRealModelsFitsTheGrid) {
  std::vector<Case> cases = real_cases();
  for (Case& c : grid_cases()) cases.push_back(std::move(c));
  int64_t at_the_limit = 0;  // dispatches whose rows go beyond one dimension (the check is not vacuous)
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    for (const VulkanDispatch& d : c.dispatches) {
      EXPECT_LE(d.x, g::kMaxGroups) << d.shader;
      EXPECT_LE(d.y, g::kMaxGroups) << d.shader;
      EXPECT_LE(d.z, g::kMaxGroups) << d.shader;
      at_the_limit += d.x == g::kMaxGroups || d.y == g::kMaxGroups;
    }
  }
  EXPECT_GT(at_the_limit, 0);
}

bool real_work(const VulkanDispatch& d) { return d.flops > 1e9 || d.bytes > 64.0 * (1 << 20); }

TEST(VulkanGeometry, EveryLargeDispatchOfRealModelsFillsALargeGpu) {
  for (const Case& c : real_cases()) {
    SCOPED_TRACE(c.name);
    int64_t large = 0;
    for (const VulkanDispatch& d : c.dispatches) {
      if (!real_work(d)) continue;
      ++large;
      EXPECT_GE(d.workgroups(), g::kFillWorkgroups)
          << d.shader << " (" << d.x << " x " << d.y << " x " << d.z << " workgroups) does " << d.flops / 1e9
          << " GFLOP over " << d.bytes / (1 << 20) << " MiB";
    }
    EXPECT_GT(large, 0) << "no dispatch of real work: the check would prove nothing";
  }
}

// The table docs/architecture.md carries ("The vulkan backend's shaders"): per case, the largest
// dispatch of a shader (by FLOPs plus bytes), its workgroups exactly, its GFLOP and MiB as rounded
// there.
TEST(VulkanGeometry, TheLargestDispatchesAreThoseTheDocsList) {
  struct Row {
    size_t case_index;
    const char* shader;
    uint64_t workgroups;
    double gflop, gflop_step, mib, mib_step;
  };
  const Row rows[] = {{0, "gemm", 616, 89.0, 0.1, 711, 1},
                      {0, "attention", 1792, 3.8, 0.1, 32, 1},
                      {0, "attention_backward_dq", 1792, 5.6, 0.1, 60, 1},
                      {0, "attention_backward_dkv", 2048, 7.5, 0.1, 50, 1},
                      {0, "cross_entropy", 6213, 0.1, 0.1, 379, 1},
                      {1, "gemm", 3564, 344, 1, 1227, 1},
                      {1, "attention", 1792, 30.1, 0.1, 64, 1},
                      {1, "attention_backward_dq", 1792, 45.1, 0.1, 120, 1},
                      {1, "attention_backward_dkv", 2048, 60.2, 0.1, 100, 1},
                      {1, "cross_entropy", 6004, 0.1, 0.1, 367, 1},
                      {2, "matvec", 38016, 1.1, 0.1, 1040, 1},
                      {2, "paged_attention", 128, 0.06, 0.01, 8, 1},
                      {3, "matvec", 38016, 34.9, 0.1, 2098, 1},
                      {3, "paged_attention", 1152, 1.9, 0.1, 257, 1}};
  const std::vector<Case> cases = real_cases();
  for (const Row& row : rows) {
    SCOPED_TRACE(fmt::format("{}: {}", cases[row.case_index].name, row.shader));
    const VulkanDispatch* largest = nullptr;
    for (const VulkanDispatch& d : cases[row.case_index].dispatches)
      if (std::string(d.shader) == row.shader && (!largest || d.flops + d.bytes > largest->flops + largest->bytes))
        largest = &d;
    ASSERT_NE(largest, nullptr);
    EXPECT_EQ(largest->workgroups(), row.workgroups);
    EXPECT_NEAR(largest->flops / 1e9, row.gflop, row.gflop_step / 2);
    EXPECT_NEAR(largest->bytes / (1 << 20), row.mib, row.mib_step / 2);
  }
}

}  // namespace

std::set<std::string> vulkan_geometry_listed_shaders() {
  std::set<std::string> listed;
  for (const Case& c : real_cases())
    for (const VulkanDispatch& d : c.dispatches) listed.insert(d.shader);
  return listed;
}

}  // namespace memtune

namespace memtune {
namespace {

// Attention on the matrix units takes, per pass, the largest tile of 64, 32 and 16 rows whose
// shared memory fits the device's: on lavapipe (8 x 8 x 8, subgroups of 8, 32 KiB) and on an
// NVIDIA GPU (16 x 16 x 16, subgroups of 32, the 48 KiB its Vulkan driver reports), at Qwen's head
// dimensions (the dK/dV pass at head_dim 128 takes 32 keys in 48 KiB: its S^T and dP^T share one
// float32 array); where the head dimension does not divide into the unit, 0: the float32 shaders
// run.
TEST(VulkanGeometry, AttentionOnTheMatrixUnitsTakesTheLargestTileThatFits) {
  namespace g = vulkan_geometry;
  using g::AttentionPass;
  const g::MatrixUnit lavapipe{8, 8, 8, 8, 32768}, nvidia{16, 16, 16, 32, 49152};
  struct Case {
    const g::MatrixUnit& unit;
    int64_t hd;
    uint32_t forward, query, key;
  };
  for (const Case& c : {Case{lavapipe, 64, 32, 32, 32}, Case{lavapipe, 128, 16, 16, 16}, Case{lavapipe, 16, 32, 32, 32},
                        Case{nvidia, 64, 32, 32, 32}, Case{nvidia, 128, 32, 32, 32}, Case{nvidia, 16, 0, 0, 0},
                        Case{nvidia, 96, 32, 32, 32}}) {
    SCOPED_TRACE(fmt::format("{}x{}x{}, head_dim {}", c.unit.m, c.unit.n, c.unit.k, c.hd));
    const std::array<std::pair<AttentionPass, uint32_t>, 3> passes = {
        {{AttentionPass::Forward, c.forward}, {AttentionPass::Query, c.query}, {AttentionPass::Key, c.key}}};
    for (const auto& [pass, tile] : passes) {
      EXPECT_EQ(g::attention_coopmat_tile(c.hd, c.unit, pass), tile);
      if (tile == 0) continue;
      EXPECT_LE(g::attention_coopmat_shared_bytes(c.hd, tile, c.unit, pass), c.unit.shared_bytes);
      if (tile < 64) {
        EXPECT_GT(g::attention_coopmat_shared_bytes(c.hd, 2 * tile, c.unit, pass), c.unit.shared_bytes);
      }
      const VulkanDispatch d = g::attention_coopmat({4096, 8, 14, 2, c.hd}, c.unit, pass);
      EXPECT_EQ(d.x, 4096 / tile);
      // The key side split over the group's 7 query heads: 3 shares (half the group at most), its
      // 256 or 512 workgroups being too few to fill a GPU twice.
      EXPECT_EQ(d.y, pass == AttentionPass::Key ? 2u * 3u : 14u);
      EXPECT_EQ(d.constants[1], tile);
      EXPECT_EQ(d.constants.back(), 4 * c.unit.subgroup);
    }
  }
}

// The passes on flexible subgroup matrices (attention_coopmat2.glsl) take four subgroups of one
// granule of rows each: 32 rows on lavapipe's granularity of 8, 64 with a granularity of 16 (at
// head_dim 128 within 48 KiB, and the forward and dq passes, whose one array holds the subgroups'
// rows once and then each key-side tile, within 32 KiB too; dk-dv streams q and dout in two); none
// where the head dimension is no multiple of the granularity or the pass's arrays do not fit.
TEST(VulkanGeometry, AttentionOnFlexibleMatricesTakesOneGranuleOfRowsPerSubgroup) {
  namespace g = vulkan_geometry;
  using g::AttentionPass;
  const g::MatrixUnit lavapipe{8, 8, 8, 8, 32768}, sixteen{16, 16, 16, 32, 49152}, small{16, 16, 16, 32, 32768};
  struct Case {
    const g::MatrixUnit& unit;
    int64_t hd;
    uint32_t forward, query, key;
  };
  for (const Case& c : {Case{lavapipe, 64, 32, 32, 32}, Case{lavapipe, 128, 32, 32, 32}, Case{lavapipe, 16, 32, 32, 32},
                        Case{sixteen, 64, 64, 64, 64}, Case{sixteen, 128, 64, 64, 64}, Case{sixteen, 256, 64, 64, 0},
                        Case{sixteen, 24, 0, 0, 0}, Case{lavapipe, 20, 0, 0, 0}, Case{small, 128, 64, 64, 0}}) {
    for (const auto& [pass, tile] : {std::pair{AttentionPass::Forward, c.forward}, std::pair{AttentionPass::Query, c.query},
                                    std::pair{AttentionPass::Key, c.key}}) {
      SCOPED_TRACE(fmt::format("granularity {}, {} bytes, head_dim {}, pass {}", c.unit.m, c.unit.shared_bytes, c.hd,
                               static_cast<int>(pass)));
      EXPECT_EQ(g::attention_coopmat2_tile(c.hd, c.unit, pass), tile);
      const uint32_t bytes = g::attention_coopmat2_shared_bytes(c.hd, 4 * c.unit.m, c.unit, pass);
      if (c.hd % c.unit.n == 0) {
        EXPECT_EQ(bytes <= c.unit.shared_bytes, tile != 0) << bytes;
      }
      if (tile == 0) continue;
      const g::Attention a{4096, 8, 14, 2, c.hd};
      const VulkanDispatch d = g::attention_coopmat2(a, c.unit, pass);
      EXPECT_STREQ(d.shader, pass == AttentionPass::Forward ? "attention_coopmat2"
                             : pass == AttentionPass::Query ? "attention_backward_dq_coopmat2"
                                                            : "attention_backward_dkv_coopmat2");
      EXPECT_EQ(d.x, 4096 / tile);
      EXPECT_EQ(d.y, pass == AttentionPass::Key ? 2 * g::attention_key_splits(a, tile) : 14u);
      EXPECT_EQ(d.constants, (std::vector<uint32_t>{uint32_t(c.hd), tile, c.unit.subgroup, c.unit.n, c.unit.k,
                                                    4 * c.unit.subgroup}));
      // FLOPs and bytes as the float32 pass counts them.
      const VulkanDispatch scalar = pass == AttentionPass::Forward ? g::attention_forward(a)
                                    : pass == AttentionPass::Query ? g::attention_backward_dq(a)
                                                                   : g::attention_backward_dkv(a);
      EXPECT_EQ(d.flops, scalar.flops);
      EXPECT_EQ(d.bytes, scalar.bytes);
    }
  }
}

}  // namespace
}  // namespace memtune

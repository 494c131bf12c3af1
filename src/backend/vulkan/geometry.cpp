// The vulkan backend's dispatch geometry (see geometry.h).
#include "backend/vulkan/geometry.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "core/error.h"

namespace memtune::vulkan_geometry {

namespace {

uint32_t ceil_div(int64_t a, int64_t b) {
  const int64_t q = (a + b - 1) / b;
  MT_ASSERT(q >= 0 && q <= int64_t{UINT32_MAX}, "vulkan: a grid beyond 32 bits");
  return static_cast<uint32_t>(q);
}
}  // namespace

uint32_t dtype_code(DType d) {
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
  throw Error(fmt::format("--backend vulkan: a tensor of dtype {} where a float one belongs", dtype_torch_name(d)));
}

namespace {
// Causal (query, key) pairs of `tokens` packed in `sequences` of equal length.
double causal_pairs(const Attention& a) {
  const double length = static_cast<double>(a.tokens) / static_cast<double>(std::max<int64_t>(a.sequences, 1));
  return static_cast<double>(a.sequences) * length * (length + 1) / 2;
}

}  // namespace

VulkanDispatch elementwise(const char* shader, int64_t n, double bytes_per_element, double flops_per_element) {
  return {.shader = shader,
          .constants = {},
          .x = std::clamp<uint32_t>(ceil_div(n, 256), 1, kMaxGroups),
          .flops = flops_per_element * static_cast<double>(n),
          .bytes = bytes_per_element * static_cast<double>(n)};
}

VulkanDispatch multi_tensor(const char* shader, uint64_t total, double bytes_per_element, double flops_per_element,
                            uint32_t max_groups) {
  const double n = static_cast<double>(total);
  return {.shader = shader,
          .constants = {},
          .x = static_cast<uint32_t>(std::clamp<uint64_t>((total + 4095) / 4096, 1, max_groups)),
          .flops = flops_per_element * n,
          .bytes = bytes_per_element * n};
}

VulkanDispatch per_row(const char* shader, int64_t rows, int64_t cols, double bytes_per_element,
                       double flops_per_element) {
  const double n = static_cast<double>(rows) * static_cast<double>(cols);
  const auto x = static_cast<uint32_t>(std::clamp<int64_t>(rows, 1, kMaxGroups));
  return {.shader = shader, .constants = {}, .x = x, .y = ceil_div(std::max<int64_t>(rows, 1), x),
          .flops = flops_per_element * n, .bytes = bytes_per_element * n};
}

VulkanDispatch sample(int64_t rows, int64_t vocab) {
  MT_ASSERT(rows <= kMaxGroups, "vulkan: more rows to sample than one dispatch takes");
  return per_row("sample", rows, vocab, 8, 4);
}

VulkanDispatch rmsnorm(int64_t rows, int64_t cols, bool add) {
  return add ? per_row("rmsnorm", rows, cols, 20, 5) : per_row("rmsnorm", rows, cols, 8, 4);
}

VulkanDispatch embedding_backward(int64_t rows, int64_t cols) {
  const double n = static_cast<double>(rows) * static_cast<double>(cols);
  // Each row reads the ids before it (an owner those after it too), its dout row, and its table row.
  return {.shader = "embedding",
          .constants = {},
          .x = std::max<uint32_t>(1, ceil_div(cols, 256)),
          .y = static_cast<uint32_t>(std::clamp<int64_t>(rows, 1, kMaxGroups)),
          .flops = n,
          .bytes = 12 * n};
}

ColumnBlocks column_blocks(int64_t rows, int64_t cols, int64_t scratch_floats) {
  // Blocks of at least 16 rows, at most 1024 of them, as many as the scratch holds partials for.
  const int64_t most = std::clamp<int64_t>(scratch_floats / std::max<int64_t>(cols, 1), 1, 1024);
  const int64_t per = std::max<int64_t>(16, (rows + most - 1) / most);
  return {static_cast<uint32_t>(per), std::max<uint32_t>(1, ceil_div(rows, per))};
}

std::vector<VulkanDispatch> column_sums(int64_t rows, int64_t cols, double bytes_per_element, int64_t scratch_floats) {
  const ColumnBlocks b = column_blocks(rows, cols, scratch_floats);
  const double n = static_cast<double>(rows) * static_cast<double>(cols);
  return {{.shader = "column_partials",
           .constants = {},
           .x = ceil_div(cols, 256),
           .y = b.blocks,
           .flops = 2 * n,
           .bytes = bytes_per_element * n},
          elementwise("column_finish", cols, 4.0 * (b.blocks + 2), b.blocks)};
}

VulkanDispatch quantized_matmul(int64_t rows, int64_t inner, int64_t outputs, int bits) {
  const double r = static_cast<double>(rows), in = static_cast<double>(inner), out = static_cast<double>(outputs);
  return {.shader = "quantized_matmul",
          .constants = {},
          .x = ceil_div(outputs, 16),
          .y = ceil_div(rows, 16),
          .flops = 2 * r * in * out,
          .bytes = in * out * bits / 8.0 + 4 * r * (in + out)};
}

VulkanDispatch quantized_matmul_int8_coopmat(int64_t rows, int64_t inner, int64_t outputs, int bits, int64_t block,
                                             const MatrixUnit& unit) {
  MT_ASSERT((block == 32 || block == 64 || block == 128) && block % unit.k == 0 && kInt8Tile / 2 % unit.m == 0 &&
                kInt8Tile / 2 % unit.n == 0,
            "quantized_matmul_int8_coopmat: a block of 32, 64 or 128 and a unit of its tile's quarters");
  const double r = static_cast<double>(rows), in = static_cast<double>(inner), out = static_cast<double>(outputs);
  VulkanDispatch d{.shader = "quantized_matmul_int8_coopmat",
                   .constants = {kInt8Tile, unit.subgroup, unit.m, unit.n, unit.k, 4 * unit.subgroup,
                                 static_cast<uint32_t>(block)},
                   .x = ceil_div(outputs, kInt8Tile),
                   .y = ceil_div(rows, kInt8Tile),
                   .flops = 2 * r * in * out,
                   // The input read twice per column tile (its scale, then its rounding), the codes once per row tile.
                   .bytes = ceil_div(rows, kInt8Tile) * in * out * bits / 8.0 +
                            8 * r * in * ceil_div(outputs, kInt8Tile) + 4 * r * out};
  MT_ASSERT(d.x <= kMaxGroups && d.y <= kMaxGroups, "vulkan: a product beyond one dispatch's grid");
  return d;
}

uint32_t cross_entropy_pieces(int64_t rows, int64_t vocab, int64_t scratch_floats) {
  const int64_t fit = scratch_floats / (kCrossEntropyPartials * std::max<int64_t>(rows, 1));
  MT_ASSERT(fit >= 1, "vulkan: more logits rows than the cross-entropy scratch holds");
  return static_cast<uint32_t>(std::clamp<int64_t>((vocab + kCrossEntropyPiece - 1) / kCrossEntropyPiece, 1, fit));
}

std::vector<VulkanDispatch> cross_entropy(int64_t rows, int64_t vocab, int64_t scratch_floats) {
  MT_ASSERT(rows <= kMaxGroups, "vulkan: more logits rows than one dispatch takes");
  const uint32_t pieces = cross_entropy_pieces(rows, vocab, scratch_floats);
  const double n = static_cast<double>(rows) * static_cast<double>(vocab);
  const auto y = static_cast<uint32_t>(std::max<int64_t>(rows, 1));
  return {{.shader = "cross_entropy_partials", .constants = {}, .x = pieces, .y = y, .flops = 4 * n, .bytes = 4 * n},
          {.shader = "cross_entropy", .constants = {}, .x = pieces, .y = y, .flops = 3 * n, .bytes = 8 * n}};
}

GemmSplit gemm_split(int64_t M, int64_t N, int64_t K, int64_t scratch_floats) {
  const auto tiles = [&](int64_t t) { return uint64_t{ceil_div(M, t)} * ceil_div(N, t); };
  for (const int64_t tile : {128, 64})
    if (tiles(tile) >= kFillWorkgroups) return {static_cast<uint32_t>(tile), 1, static_cast<uint32_t>(std::max<int64_t>(K, 1))};
  // Splits of at least kMinSplitK, enough for the device, as many as the scratch holds.
  constexpr int64_t kMinSplitK = 256;
  const int64_t splits = std::min({static_cast<int64_t>((kFillWorkgroups + tiles(32) - 1) / tiles(32)),
                                   K / kMinSplitK, scratch_floats / std::max<int64_t>(M * N, 1)});
  if (splits < 2) return {32, 1, static_cast<uint32_t>(std::max<int64_t>(K, 1))};
  const int64_t k_split = ((K + splits - 1) / splits + 15) / 16 * 16;  // whole 16-wide steps
  return {32, ceil_div(K, k_split), static_cast<uint32_t>(k_split)};
}

std::vector<VulkanDispatch> gemm(int64_t M, int64_t N, int64_t K, DType b, int64_t scratch_floats) {
  const GemmSplit s = gemm_split(M, N, K, scratch_floats);
  const double m = static_cast<double>(M), n = static_cast<double>(N), k = static_cast<double>(K);
  std::vector<VulkanDispatch> d{{.shader = "gemm",
                                 .constants = {s.tile, dtype_code(b), 0u},
                                 .x = ceil_div(N, s.tile),
                                 .y = ceil_div(M, s.tile),
                                 .z = s.splits,
                                 .flops = 2 * m * n * k,
                                 .bytes = 4 * m * k + static_cast<double>(dtype_size(b)) * k * n + 4 * m * n * s.splits}};
  MT_ASSERT(d[0].x <= kMaxGroups && d[0].y <= kMaxGroups, "vulkan: a product beyond one dispatch's grid");
  if (s.splits > 1) d.push_back(elementwise("gemm_reduce", M * N, 4.0 * (s.splits + 2), s.splits));
  return d;
}

std::vector<VulkanDispatch> gemm_coopmat(int64_t M, int64_t N, int64_t K, const MatrixUnit& unit, DType a, DType b,
                                         int64_t scratch_floats) {
  GemmSplit s = gemm_split(M, N, K, scratch_floats);
  s.tile = std::min<uint32_t>(s.tile, 64);  // a quarter of 64 x 64 holds 2 x 2 (16) or 4 x 4 (8) matrices
  MT_ASSERT((unit.m == 8 || unit.m == 16) && unit.n == unit.m && unit.subgroup >= 1 &&
                s.tile * 32 % (4 * unit.subgroup) == 0,
            "gemm_coopmat takes square matrices of 8 or 16, its K step staged evenly by four subgroups");
  const double m = static_cast<double>(M), n = static_cast<double>(N), k = static_cast<double>(K);
  std::vector<VulkanDispatch> d{{.shader = "gemm_coopmat",
                                 .constants = {s.tile, unit.subgroup, unit.m, unit.n, unit.k, 4 * unit.subgroup,
                                               dtype_code(a), dtype_code(b), 0u},
                                 .x = ceil_div(N, s.tile),
                                 .y = ceil_div(M, s.tile),
                                 .z = s.splits,
                                 .flops = 2 * m * n * k,
                                 .bytes = static_cast<double>(dtype_size(a)) * m * k +
                                          static_cast<double>(dtype_size(b)) * k * n + 4 * m * n * s.splits}};
  MT_ASSERT(d[0].x <= kMaxGroups && d[0].y <= kMaxGroups, "vulkan: a product beyond one dispatch's grid");
  if (s.splits > 1) d.push_back(elementwise("gemm_reduce", M * N, 4.0 * (s.splits + 2), s.splits));
  return d;
}

namespace {
// A product's grid (unsplit) turned into gate / up / activation's pass: its last constant 1, each
// workgroup computing up's tile after gate's, and the work of both.
VulkanDispatch swiglu_pass(VulkanDispatch d, int64_t M, int64_t I, int64_t K, DType a, DType b) {
  const double m = static_cast<double>(M), i = static_cast<double>(I), k = static_cast<double>(K);
  d.constants.back() = 1u;
  d.flops = 4 * m * i * k + 6 * m * i;
  d.bytes = 2.0 * (static_cast<double>(dtype_size(a)) * m * k + static_cast<double>(dtype_size(b)) * k * i) +
            4 * m * i * 4;  // gate written and read back, up and h written
  return d;
}
}  // namespace

// Never split over K: the activation takes whole sums.
VulkanDispatch gemm_swiglu(int64_t M, int64_t I, int64_t K, DType b) {
  return swiglu_pass(gemm(M, I, K, b, /*scratch_floats=*/0).front(), M, I, K, DType::F32, b);
}
VulkanDispatch gemm_coopmat_swiglu(int64_t M, int64_t I, int64_t K, const MatrixUnit& unit, DType a, DType b) {
  return swiglu_pass(gemm_coopmat(M, I, K, unit, a, b, /*scratch_floats=*/0).front(), M, I, K, a, b);
}

uint32_t gemm_vector_loads(int64_t line_stride, int64_t k_stride, int64_t lines, int64_t K, uint64_t address,
                           DType dtype) {
  // A vector holds `width` values along the contiguous dimension, which their count divides.
  const auto fits = [&](int64_t width, uint64_t align) {
    if (address % align != 0) return false;
    if (k_stride == 1) return line_stride % width == 0 && K % width == 0;
    return line_stride == 1 && k_stride % width == 0 && lines % width == 0;
  };
  switch (dtype) {
    case DType::F32:
      return fits(4, 16);
    case DType::BF16:  // eight along K, or four along the lines (of two rows of K)
      return k_stride == 1 ? fits(8, 16) : fits(4, 8);
    default:
      return 0;
  }
}

VulkanDispatch matvec(int64_t rows, int64_t OC, int64_t C, DType w, bool vector_loads) {
  MT_ASSERT(rows <= kMatvecRows, "matvec takes at most kMatvecRows rows");
  const uint32_t groups = ceil_div(OC, kMatvecOutputs), x = std::min(groups, kMaxGroups);
  const double r = static_cast<double>(rows), oc = static_cast<double>(OC), c = static_cast<double>(C);
  return {.shader = "matvec",
          .constants = {dtype_code(w), vector_loads ? 1u : 0u, 0u},
          .x = x,
          .y = ceil_div(groups, x),
          .flops = 2 * r * oc * c,
          .bytes = static_cast<double>(dtype_size(w)) * oc * c + 4 * r * (c + oc)};
}

VulkanDispatch matvec_swiglu(int64_t rows, int64_t I, int64_t C, DType w, bool vector_loads) {
  // matvec's grid over gate's columns, each workgroup taking up's too.
  VulkanDispatch d = matvec(rows, I, C, w, vector_loads);
  const double r = static_cast<double>(rows), i = static_cast<double>(I), c = static_cast<double>(C);
  d.constants.back() = 1u;
  d.flops = 4 * r * i * c + 6 * r * i;
  d.bytes = 2.0 * static_cast<double>(dtype_size(w)) * i * c + 4 * r * (c + 3 * i);
  return d;
}

AttentionTiles attention_tiles(int64_t head_dim, bool key_side) {
  AttentionTiles t;
  t.lanes = head_dim > 128 ? 8 : 4;
  if (head_dim <= 0 || head_dim > 256 || head_dim % t.lanes != 0)
    throw Error(fmt::format("--backend vulkan: head_dim {} (the attention shaders take a multiple of 4 up to 128, "
                            "or of 8 up to 256)",
                            head_dim));
  // Two tiles of TILE x head_dim floats in shared memory: 16 KiB at most (every device has 32).
  t.tile = head_dim <= 64 ? 32 : head_dim <= 128 ? 16 : 8;
  // The query side: 128 invocations, 32 or 16 rows. The key side: 8 keys per workgroup, so that
  // few kv heads still give many workgroups (its rows each see many queries), each key over 8
  // lanes where the head dimension divides into them (every usable device's subgroups hold 8):
  // 64 invocations a workgroup, twice the warps a GPU keeps resident at 32, and half the registers
  // per invocation.
  if (key_side && head_dim % 8 == 0) t.lanes = 8;
  t.threads = key_side ? 8 * t.lanes : 128;
  t.rows = t.threads / t.lanes;
  return t;
}

uint32_t attention_key_splits(const Attention& a, uint32_t rows) {
  const int64_t group = a.q_heads / std::max<int64_t>(a.kv_heads, 1);
  const int64_t workgroups = std::max<int64_t>(ceil_div(a.tokens, rows) * a.kv_heads, 1);
  const int64_t wanted = (2 * static_cast<int64_t>(kFillWorkgroups) + workgroups - 1) / workgroups;
  return static_cast<uint32_t>(std::clamp<int64_t>(std::min(group / 2, wanted), 1, group));
}

std::vector<VulkanDispatch> attention_key_reduce(const Attention& a, uint32_t splits) {
  if (splits < 2) return {};
  const VulkanDispatch one = elementwise("gemm_reduce", a.tokens * a.kv_heads * a.head_dim, 4.0 * (splits + 1), splits);
  return {one, one};  // dk, then dv
}

namespace {
// A pass over tiles of `rows` query (or, for the key side, key) rows per head. Its FLOPs per
// (query, key) pair and dimension, and the float32 tensors of the query side and of the key side
// it moves, whichever shader runs it (the matrix units' stage float16 copies in shared memory):
//   forward: q, out; k, v. FLOPs: q.k and p.v.
//   dq: q, dout, out, dq; k, v. FLOPs: q.k, dout.v, ds k.
//   dk, dv: q, dout, out; k, v, dk, dv. FLOPs: q.k, dout.v, p dout, ds q.
VulkanDispatch attention_pass(const char* shader, const Attention& a, std::vector<uint32_t> constants, uint32_t rows,
                              AttentionPass pass) {
  const bool key_side = pass == AttentionPass::Key;
  const double flops_per_pair = pass == AttentionPass::Forward ? 4 : pass == AttentionPass::Query ? 6 : 8;
  const double q_side_tensors = pass == AttentionPass::Forward ? 2 : pass == AttentionPass::Query ? 4 : 3;
  const double kv_side_tensors = key_side ? 4 : 2;
  const double hd = static_cast<double>(a.head_dim), n = static_cast<double>(a.tokens);
  VulkanDispatch d{
      .shader = shader,
      .constants = std::move(constants),
      .x = ceil_div(a.tokens, rows),
      .y = static_cast<uint32_t>(key_side ? a.kv_heads * attention_key_splits(a, rows) : a.q_heads),
      .flops = flops_per_pair * causal_pairs(a) * hd * static_cast<double>(a.q_heads),
      .bytes = 4 * n * hd *
               (q_side_tensors * static_cast<double>(a.q_heads) + kv_side_tensors * static_cast<double>(a.kv_heads))};
  MT_ASSERT(d.x <= kMaxGroups, "vulkan: more tokens than one attention dispatch takes");
  return d;
}
VulkanDispatch attention_dispatch(const char* shader, const Attention& a, AttentionPass pass) {
  const AttentionTiles t = attention_tiles(a.head_dim, pass == AttentionPass::Key);
  return attention_pass(shader, a, {static_cast<uint32_t>(a.head_dim), t.lanes, t.tile, t.threads}, t.rows, pass);
}
}  // namespace

VulkanDispatch attention_forward(const Attention& a) {
  return attention_dispatch("attention", a, AttentionPass::Forward);
}
VulkanDispatch attention_backward_dq(const Attention& a) {
  return attention_dispatch("attention_backward_dq", a, AttentionPass::Query);
}
VulkanDispatch attention_backward_dkv(const Attention& a) {
  return attention_dispatch("attention_backward_dkv", a, AttentionPass::Key);
}

uint32_t attention_coopmat_shared_bytes(int64_t head_dim, uint32_t tile, const MatrixUnit& unit, AttentionPass pass) {
  const uint64_t b = tile, h = static_cast<uint64_t>(head_dim) + 8, s = b + 4, t = b + 8;
  if (b * s < 4 * uint64_t{unit.m} * unit.n) return UINT32_MAX;  // the scores' array stages the output
  switch (pass) {
    case AttentionPass::Forward:  // q, k / v (float16); scores, output (float32); p (float16); m, l, begin
      return static_cast<uint32_t>(2 * (2 * b * h) + 4 * b * s + 2 * b * t + 4 * b * (h - 4) + 3 * 4 * b);
    case AttentionPass::Query:  // q, dout, k, v; s, dp; ds; lse, D, begin
      return static_cast<uint32_t>(4 * (2 * b * h) + 2 * (4 * b * s) + 2 * b * t + 3 * 4 * b);
    case AttentionPass::Key:  // k, v, q, dout; s then dp (one array); p, ds; lse, D, end
      return static_cast<uint32_t>(4 * (2 * b * h) + 4 * b * s + 2 * (2 * b * t) + 3 * 4 * b);
  }
  return 0;
}

uint32_t attention_coopmat_tile(int64_t head_dim, const MatrixUnit& unit, AttentionPass pass) {
  if (head_dim <= 0 || head_dim > 256 || head_dim % unit.k != 0 || head_dim / 2 % unit.n != 0) return 0;
  for (const uint32_t tile : {64u, 32u, 16u})
    if (tile / 2 % unit.m == 0 && tile / 2 % unit.n == 0 && tile % unit.k == 0 &&
        attention_coopmat_shared_bytes(head_dim, tile, unit, pass) <= unit.shared_bytes)
      return tile;
  return 0;
}

// FLOPs and tensors as the float32 passes count them (attention_pass).
VulkanDispatch attention_coopmat(const Attention& a, const MatrixUnit& unit, AttentionPass pass) {
  const uint32_t tile = attention_coopmat_tile(a.head_dim, unit, pass);
  MT_ASSERT(tile != 0, "attention_coopmat for a head dimension no tile takes");
  const std::vector<uint32_t> c{static_cast<uint32_t>(a.head_dim), tile, unit.subgroup, unit.m, unit.n, unit.k,
                                4 * unit.subgroup};
  switch (pass) {
    case AttentionPass::Forward:
      return attention_pass("attention_coopmat", a, c, tile, pass);
    case AttentionPass::Query:
      return attention_pass("attention_backward_dq_coopmat", a, c, tile, pass);
    case AttentionPass::Key:
      break;
  }
  return attention_pass("attention_backward_dkv_coopmat", a, c, tile, pass);
}

uint32_t attention_coopmat2_shared_bytes(int64_t head_dim, uint32_t tile, const MatrixUnit& granularity,
                                         AttentionPass pass) {
  // The float16 tiles (forward and dq: one array, which stages the subgroups' rows once, then
  // holds the key and value tiles; dk-dv: two, for each query tile's q and dout), the output stage
  // and per row: forward, its sequence's start; dq, lse, D and the start; dk-dv, lse, D and the end.
  const uint64_t b = tile, h = static_cast<uint64_t>(head_dim) + 8;
  const uint64_t arrays = pass == AttentionPass::Key ? 2 : 1, per_row = pass == AttentionPass::Forward ? 1 : 3;
  return static_cast<uint32_t>(arrays * (2 * b * h) + 4 * b * granularity.n + per_row * 4 * b);
}

uint32_t attention_coopmat2_tile(int64_t head_dim, const MatrixUnit& granularity, AttentionPass pass) {
  const auto hd = static_cast<uint32_t>(head_dim);
  if (head_dim <= 0 || head_dim > 256 || hd % granularity.k != 0 || hd % granularity.n != 0) return 0;
  // A subgroup's rows are one row of the device's granules (16 on NVIDIA: FlashAttention-2's 16
  // rows a warp); rows of two granules gave wrong rows past the first 8 on Mesa 26's lavapipe
  // (not narrowed down to the driver or the shader).
  const uint32_t tile = 4 * granularity.m;
  const bool fits = tile <= 64 && tile % granularity.n == 0 && tile % granularity.k == 0 &&
                    attention_coopmat2_shared_bytes(head_dim, tile, granularity, pass) <= granularity.shared_bytes;
  return fits ? tile : 0;
}

VulkanDispatch attention_coopmat2(const Attention& a, const MatrixUnit& granularity, AttentionPass pass) {
  const uint32_t tile = attention_coopmat2_tile(a.head_dim, granularity, pass);
  MT_ASSERT(tile != 0, "attention_coopmat2 for a head dimension no tile takes");
  const std::vector<uint32_t> c{static_cast<uint32_t>(a.head_dim), tile, granularity.subgroup, granularity.n,
                                granularity.k, 4 * granularity.subgroup};
  switch (pass) {
    case AttentionPass::Forward:
      return attention_pass("attention_coopmat2", a, c, tile, pass);
    case AttentionPass::Query:
      return attention_pass("attention_backward_dq_coopmat2", a, c, tile, pass);
    case AttentionPass::Key:
      break;
  }
  return attention_pass("attention_backward_dkv_coopmat2", a, c, tile, pass);
}

uint32_t paged_attention_heads(const PagedAttention& a) {
  const int64_t group = std::max<int64_t>(a.q_heads / std::max<int64_t>(a.kv_heads, 1), 1);
  return std::min(std::bit_ceil(static_cast<uint32_t>(group)), attention_tiles(a.head_dim, false).rows);
}

uint32_t paged_attention_chunks(const PagedAttention& a) {
  const int64_t group = std::max<int64_t>(a.q_heads / std::max<int64_t>(a.kv_heads, 1), 1);
  return ceil_div(group, paged_attention_heads(a));
}

PagedSplit paged_split(const PagedAttention& a, int64_t scratch_floats) {
  // Partials per query head; workgroups per (row, kv head, chunk of its query heads).
  const int64_t rows = a.rows * a.q_heads, max_context = std::max<int64_t>(a.max_context, 1);
  const int64_t groups = std::max<int64_t>(a.rows * a.kv_heads * paged_attention_chunks(a), 1);
  // Splits of at least kMinSplitKeys keys, enough of them to give the device 2 x kFillWorkgroups,
  // as many as the scratch holds partials for.
  constexpr int64_t kMinSplitKeys = 128;
  int64_t splits = std::min({(2 * static_cast<int64_t>(kFillWorkgroups) + groups - 1) / groups,
                             (max_context + kMinSplitKeys - 1) / kMinSplitKeys,
                             scratch_floats / (rows * (a.head_dim + 2))});
  splits = std::max<int64_t>(splits, 1);
  const int64_t split_keys = (max_context + splits - 1) / splits;
  return {ceil_div(max_context, split_keys), static_cast<uint32_t>(split_keys)};
}

std::vector<VulkanDispatch> paged_attention(const PagedAttention& a, int64_t scratch_floats) {
  const AttentionTiles t = attention_tiles(a.head_dim, false);
  const PagedSplit s = paged_split(a, scratch_floats);
  const uint32_t x = static_cast<uint32_t>(a.kv_heads) * paged_attention_chunks(a) * s.splits;
  const double hd = static_cast<double>(a.head_dim), rows = static_cast<double>(a.rows);
  const double context = static_cast<double>(a.context > 0 ? a.context : a.max_context);
  MT_ASSERT(uint64_t{s.splits} * a.kv_heads * paged_attention_chunks(a) <= kMaxGroups,
            "vulkan: more heads x splits than one dispatch takes");
  const auto y = static_cast<uint32_t>(std::clamp<int64_t>(a.rows, 1, kMaxGroups));  // rows beyond: over z
  std::vector<VulkanDispatch> d{
      {.shader = "paged_attention",
       .constants = {static_cast<uint32_t>(a.head_dim), t.lanes, t.tile, t.threads, dtype_code(a.cache),
                     paged_attention_heads(a)},
       .x = x,
       .y = y,
       .z = ceil_div(std::max<int64_t>(a.rows, 1), y),
       .flops = 4 * rows * static_cast<double>(a.q_heads) * context * hd,
       // Each row's keys and values (a row per sequence when decoding), q and out.
       .bytes = rows * (context * static_cast<double>(a.kv_heads) * hd * 2 * static_cast<double>(dtype_size(a.cache)) +
                        8 * static_cast<double>(a.q_heads) * hd)}};
  if (s.splits > 1)
    d.push_back(elementwise("paged_attention_merge", a.rows * a.q_heads * a.head_dim,
                            4.0 * (1 + s.splits) + 8.0 * s.splits / hd, 3.0 * s.splits));
  return d;
}

}  // namespace memtune::vulkan_geometry

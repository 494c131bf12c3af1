// The shape of every dispatch of the vulkan backend as a pure function of the op's shapes: which
// shader, its specialization constants (head dimension, tile, dtype), its workgroup grid, and the
// arithmetic and memory traffic it is written for. The backend dispatches exactly what these
// return; tests/backend/vulkan_geometry_test.cpp computes them for real models' shapes (no GPU
// needed) and checks that every large dispatch fills a large GPU. docs/architecture.md has the
// table.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace memtune {

struct VulkanDispatch {
  const char* shader = "";
  std::vector<uint32_t> constants;  // constant_id 0, 1, ...
  uint32_t x = 1, y = 1, z = 1;     // workgroups
  double flops = 0, bytes = 0;      // by design: arithmetic and memory traffic (each operand read once)
  uint64_t workgroups() const { return uint64_t{x} * y * z; }
};

namespace vulkan_geometry {

// The shaders' numbering of a float storage dtype (0 float32, 1 bfloat16, 2 float16); an Error
// naming the dtype for any other.
uint32_t dtype_code(DType d);

// A large GPU's streaming multiprocessors (132 on an H100 / H200) four times over: a dispatch of
// real work (over 1 GFLOP or 64 MiB of traffic) launches at least this many workgroups.
constexpr uint64_t kFillWorkgroups = 4 * 132;
// The most workgroups along x (and y) any device takes (Vulkan's guaranteed minimum).
constexpr uint32_t kMaxGroups = 65535;
// The backend's scratch for the partials of split work (split-K products, context splits of
// paged attention, the pieces of the loss's rows), one op at a time: 8 MiB of floats, allocated
// with the device (so in the startup the process prediction measures), enough to split the LM
// head's input gradient of a 0.5B model (327 rows x 896 over K = 151936) in two.
constexpr int64_t kScratchFloats = int64_t{1} << 21;

// A 1-D grid-stride shader (256 wide) over n elements moving bytes_per_element.
VulkanDispatch elementwise(const char* shader, int64_t n, double bytes_per_element, double flops_per_element = 1);
// A multi-tensor shader (adamw.comp, scale_sum_squares.comp) over `total` elements of a table of
// tensors: a workgroup per chunk of 4096 elements, at most max_groups (then each takes several).
VulkanDispatch multi_tensor(const char* shader, uint64_t total, double bytes_per_element, double flops_per_element,
                            uint32_t max_groups);
// A shader with one workgroup per row (rmsnorm, rmsnorm_backward, loss_sum, step_decision): x
// rows, and beyond kMaxGroups rows a y as well (folded_row() in common.glsl).
VulkanDispatch per_row(const char* shader, int64_t rows, int64_t cols, double bytes_per_element,
                       double flops_per_element = 2);
// sample.comp: one workgroup per row of logits (no loop: at most kMaxGroups rows).
VulkanDispatch sample(int64_t rows, int64_t vocab);

// rmsnorm.comp over `rows` rows of `cols`: a workgroup per row; with the residual add before it
// (`add`), the row and the addend read, the sum written back, then normalized.
VulkanDispatch rmsnorm(int64_t rows, int64_t cols, bool add);

// The embedding gradient (embedding.comp, mode 1): `rows` token rows scattered into the table's
// rows by id, a workgroup per (256 columns, token row), the row owning its id's sum where it is
// the id's first; deterministic without atomics on floats.
VulkanDispatch embedding_backward(int64_t rows, int64_t cols);
// Column sums (a bias gradient, RMSNorm's weight gradient) in two passes: blocks of rows, a
// workgroup per (256 columns, block) writing partials into the scratch (column_partials.comp),
// then the blocks added in order per column (column_finish.comp).
struct ColumnBlocks {
  uint32_t rows_per_block = 1, blocks = 1;
};
ColumnBlocks column_blocks(int64_t rows, int64_t cols, int64_t scratch_floats);
std::vector<VulkanDispatch> column_sums(int64_t rows, int64_t cols, double bytes_per_element, int64_t scratch_floats);

// out[M, N] (+)= A[M, K] @ B[K, N], A float32, B float32 or 16-bit (gemm.comp). Output tiles of
// 128 x 128 or 64 x 64 where those alone fill the device, else 32 x 32; where even those leave it idle and K
// is long (LoRA's rank-16 products, k/v weight gradients), K splits over workgroups into a
// scratch of `scratch_floats`, and gemm_reduce.comp adds the splits in order.
struct GemmSplit {
  uint32_t tile = 64, splits = 1, k_split = 0;
};
GemmSplit gemm_split(int64_t M, int64_t N, int64_t K, int64_t scratch_floats);
std::vector<VulkanDispatch> gemm(int64_t M, int64_t N, int64_t K, DType b, int64_t scratch_floats);
// The MLP's gate and up over many rows (I columns each, over K), and h = silu(gate) * up, in one
// gemm.comp pass (Backend::matmul_forward_group_swiglu): gemm's grid over gate's columns,
// unsplit, its last constant (SWIGLU) 1; gemm's constants are tile, B's dtype code, 0.
VulkanDispatch gemm_swiglu(int64_t M, int64_t I, int64_t K, DType b);
// The same product with 16-bit operands on the device's matrix units (gemm_coopmat.comp): A and B
// float16 (or float32, rounded as loaded), a workgroup of four subgroups per 64 x 64 output tile
// (32 x 32 where gemm_split would take 32), each subgroup a quarter of it as unit-shaped
// cooperative matrices; split-K as gemm(). Constants: tile, subgroup size, m, n, k, workgroup size,
// A's and B's dtype codes, and 0 (the activation pass's constant, below).
struct MatrixUnit {
  uint32_t m = 16, n = 16, k = 16, subgroup = 32;
  uint32_t shared_bytes = 32768;  // a workgroup's shared memory on the device
};
std::vector<VulkanDispatch> gemm_coopmat(int64_t M, int64_t N, int64_t K, const MatrixUnit& unit, DType a, DType b,
                                         int64_t scratch_floats);
// The same pass with float16 operands on the device's matrix units (gemm_coopmat.comp).
VulkanDispatch gemm_coopmat_swiglu(int64_t M, int64_t I, int64_t K, const MatrixUnit& unit, DType a, DType b);
// gemm.comp's `vectors` bit for one operand: 1 where it may load it 128 bits at a time. The
// operand's strides along its output dimension (m of A, n of B) and along K, in elements, its
// number of lines (M or N), K, and the address of its first element: float32 four values along
// whichever stride is 1, bfloat16 eight along K or four along the lines (two rows of K at once),
// float16 never; only where the vectors' width divides the contiguous dimension, so that no
// vector crosses the operand's end.
uint32_t gemm_vector_loads(int64_t line_stride, int64_t k_stride, int64_t lines, int64_t K, uint64_t address,
                           DType dtype);
// out[rows, OC] (+)= inp[rows, C] @ W[OC, C]^T for at most kMatvecRows rows (matvec.comp): a
// workgroup per kMatvecOutputs output columns, vector loads where C and the addresses allow.
constexpr int64_t kMatvecRows = 32, kMatvecOutputs = 4;
VulkanDispatch matvec(int64_t rows, int64_t OC, int64_t C, DType w, bool vector_loads);
// The MLP's gate and up (I columns each, over C) and then h = silu(gate) * up, in one matvec.comp
// pass (Backend::matmul_forward_group_swiglu).
VulkanDispatch matvec_swiglu(int64_t rows, int64_t I, int64_t C, DType w, bool vector_loads);

// Products with GPTQ / AWQ codes (quantized_matmul.comp, 16 x 16 tiles): `outputs` columns of
// `rows` rows over `inner`.
VulkanDispatch quantized_matmul(int64_t rows, int64_t inner, int64_t outputs, int bits);
// The same product, out = inp @ W^T, with the input rounded to int8 per block of `block` inputs
// (int8_activations.h) on the device's int8 matrix units (quantized_matmul_int8_coopmat.comp): a
// workgroup of four subgroups per kInt8Tile x kInt8Tile outputs, each block's integer products
// exact in int32, scaled into float32 once per block. Constants: tile, subgroup, m, n, k,
// workgroup size, block.
constexpr uint32_t kInt8Tile = 32;
VulkanDispatch quantized_matmul_int8_coopmat(int64_t rows, int64_t inner, int64_t outputs, int bits, int64_t block,
                                             const MatrixUnit& unit);

// Cross-entropy over a logits chunk of `rows` x `vocab` (cross_entropy_partials.comp, then
// cross_entropy.comp): rows split into pieces of kCrossEntropyPiece columns, a workgroup per
// (piece, row) in each pass, kCrossEntropyPartials per (row, piece) in a scratch of `scratch_floats`.
constexpr int64_t kCrossEntropyPiece = 8192, kCrossEntropyPartials = 6;
uint32_t cross_entropy_pieces(int64_t rows, int64_t vocab, int64_t scratch_floats);
std::vector<VulkanDispatch> cross_entropy(int64_t rows, int64_t vocab, int64_t scratch_floats);

// Packed causal attention: `tokens` in `sequences` (equal lengths, for the FLOP count).
struct Attention {
  int64_t tokens = 0, sequences = 1, q_heads = 0, kv_heads = 0, head_dim = 0;
};
// The tiling of the attention shaders for a head dimension (attention_common.glsl): LANES
// invocations per row, TILE rows per shared-memory tile, ROWS rows per workgroup. An Error for a
// head dimension they do not take.
struct AttentionTiles {
  uint32_t lanes = 4, tile = 32, rows = 32, threads = 128;
};
AttentionTiles attention_tiles(int64_t head_dim, bool key_side);
VulkanDispatch attention_forward(const Attention& a);
VulkanDispatch attention_backward_dq(const Attention& a);
VulkanDispatch attention_backward_dkv(const Attention& a);
// The key side over `rows` keys a workgroup split over the GQA group's query heads where its
// (token tiles x kv heads) workgroups would leave a GPU idle: enough splits for twice
// kFillWorkgroups, at most half the group (the splits' partial dk and dv, [splits][2][N, kv_dim],
// are written into dq's memory, which the dq pass overwrites after them; its N x q_dim floats hold
// group / 2 splits). Then gemm_reduce adds the splits in order into dk and into dv.
uint32_t attention_key_splits(const Attention& a, uint32_t rows);
std::vector<VulkanDispatch> attention_key_reduce(const Attention& a, uint32_t splits);
// The same three passes on the device's matrix units (shaders/coopmat/attention_coopmat.glsl,
// float16 operands): a workgroup of four subgroups per tile of `tile` query (or key) rows, the
// tile the largest of 64, 32 and 16 whose shared memory fits the unit's and whose quarters are
// whole unit matrices; 0 where none fits or head_dim does not divide into the unit (the float32
// shaders then run). Constants: head_dim, tile, subgroup, m, n, k, workgroup size.
enum class AttentionPass { Forward, Query, Key };
uint32_t attention_coopmat_tile(int64_t head_dim, const MatrixUnit& unit, AttentionPass pass);
// The shared memory the pass's shader declares at that tile (its arrays, as they are written).
uint32_t attention_coopmat_shared_bytes(int64_t head_dim, uint32_t tile, const MatrixUnit& unit, AttentionPass pass);
VulkanDispatch attention_coopmat(const Attention& a, const MatrixUnit& unit, AttentionPass pass);
// The same three passes on VK_NV_cooperative_matrix2's subgroup matrices of flexible size
// (shaders/coopmat/attention_coopmat2.glsl): a workgroup of four subgroups per tile of `tile`
// query (or key) rows, each subgroup a quarter of its rows with the whole head dimension, its
// operand rows and its results in registers. `granularity` is the device's flexible shape (m, n,
// k: what the rows, the columns and the inner dimension of every matrix must be multiples of),
// its subgroup size and shared memory. The tile is four subgroups of m rows each where the pass's
// arrays fit the shared memory and the head dimension is a multiple of n and k; else 0
// (attention_coopmat then runs). Constants: head_dim, tile, subgroup, the output matrices' width
// (n), the inner dimension of a product over the head dimension (k), workgroup size.
uint32_t attention_coopmat2_tile(int64_t head_dim, const MatrixUnit& granularity, AttentionPass pass);
uint32_t attention_coopmat2_shared_bytes(int64_t head_dim, uint32_t tile, const MatrixUnit& granularity,
                                         AttentionPass pass);
VulkanDispatch attention_coopmat2(const Attention& a, const MatrixUnit& granularity, AttentionPass pass);

// New queries over a paged KV cache: `rows` query tokens, keys up to max_context (the block
// table's width), split over the context so that few rows still fill the device, within the
// backend's scratch of `scratch_floats` for the splits' partials. One dispatch, or two with the
// merge (paged_attention_merge.comp).
struct PagedAttention {
  int64_t rows = 0, q_heads = 0, kv_heads = 0, head_dim = 0, max_context = 0, context = 0;
  DType cache = DType::F32;
};
struct PagedSplit {
  uint32_t splits = 1, split_keys = 0;
};
// A workgroup per (kv head, chunk of `heads` of its query heads, split, query row), so each key
// and value is read once for the GQA group: heads is the group rounded up to a power of two, at
// most the workgroup's rows, which are heads x key phases (attention_tiles' query side).
uint32_t paged_attention_heads(const PagedAttention& a);
uint32_t paged_attention_chunks(const PagedAttention& a);
PagedSplit paged_split(const PagedAttention& a, int64_t scratch_floats);
std::vector<VulkanDispatch> paged_attention(const PagedAttention& a, int64_t scratch_floats);

}  // namespace vulkan_geometry

}  // namespace memtune

// Weight-only quantized linear layers as Qwen's published checkpoints store them, packed into
// int32 words, with float16 scales per group of input rows. W below is [in, out]: the transpose
// of the Hugging Face weight [out, in].
//
// GPTQ (quant_method "gptq", bits 4 or 8; AutoGPTQ / transformers layout):
//   qweight int32 [in * bits / 32, out]   word r of column n holds input rows r * (32 / bits) + j
//                                         at bit offset bits * j, lowest first
//   qzeros  int32 [groups, out * bits / 32] word c of row g holds output columns c * (32 / bits) + j
//                                         at bits * j; each stored as zero - 1
//   scales  fp16  [groups, out]
//   g_idx   int32 [in]                    the group of each input row (k / group_size unless act-order)
//   W[k, n] = scales[g[k], n] * (q[k, n] - (qzeros[g[k], n] + 1))
// AWQ (quant_method "awq", version "gemm", 4 bits, zero_point):
//   qweight int32 [in, out / 8]           nibble i of word c holds output column 8 c + kAwqOrder[i]
//   qzeros  int32 [groups, out / 8]       the same interleave, zeros as they are
//   scales  fp16  [groups, out]
//   W[k, n] = scales[k / group_size, n] * (q[k, n] - z[k / group_size, n])
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace memtune {

inline constexpr std::array<int, 8> kAwqOrder = {0, 2, 4, 6, 1, 3, 5, 7};

struct GptqPacked {
  std::span<const int32_t> qweight, qzeros, g_idx;
  std::span<const uint16_t> scales;  // float16 bits
};
struct AwqPacked {
  std::span<const int32_t> qweight, qzeros;
  std::span<const uint16_t> scales;
};

// The float32 weights [in, out] of a packed layer (a reference for the kernels and for `dump`).
// An Error when a span's size does not match the shape, bits is not 4 or 8, or a g_idx entry is
// outside [0, groups).
void gptq_dequantize(const GptqPacked& packed, int bits, int64_t in, int64_t out, int64_t groups, std::span<float> w);
void awq_dequantize(const AwqPacked& packed, int64_t in, int64_t out, int64_t group_size, std::span<float> w);

// Writers: integer codes q [in, out] and zeros [groups, out] (each below 2^bits) into the words
// above. qzeros gets GPTQ's zero - 1 in `bits` bits, so a GPTQ zero must be 1 .. 2^bits - 1 to
// read back (a stored 0 - 1 = all ones reads as 2^bits, as in AutoGPTQ's files).
void gptq_pack(std::span<const uint8_t> q, std::span<const uint8_t> zeros, int bits, int64_t in, int64_t out,
               int64_t groups, std::span<int32_t> qweight, std::span<int32_t> qzeros);
void awq_pack(std::span<const uint8_t> q, std::span<const uint8_t> zeros, int64_t in, int64_t out, int64_t groups,
              std::span<int32_t> qweight, std::span<int32_t> qzeros);

// A quantized linear layer as memtune holds it (backend.h: QuantizedWeight), W being [out, in]
// as in the Hugging Face weight. One layout for both formats, so one kernel reads either:
//   codes  int32 [out, in * bits / 32]  word k / (32 / bits) of row n holds input k at bit
//                                        offset bits * (k % (32 / bits)): GPTQ's qweight transposed
//   scales f16 [out, groups], zeros f16 [out, groups] (the zero point as a value: GPTQ's stored + 1)
//   g_idx  int32 [in], empty when input k belongs to group k / group_size (no act-order)
//   W[n, k] = scales[n, g(k)] * (code(n, k) - zeros[n, g(k)])
struct QuantizedLayer {
  int bits = 4;
  int64_t in = 0, out = 0, group_size = 0, groups = 0;
  std::vector<int32_t> codes;
  std::vector<uint16_t> scales, zeros;
  std::vector<int32_t> g_idx;
};
// Bytes memtune holds for a layer of this shape (what the planner counts).
int64_t quantized_layer_bytes(int bits, int64_t in, int64_t out, int64_t groups, bool with_g_idx);

// From a file's tensors (sizes checked as by the dequantizers). group_size < 0 means one group.
QuantizedLayer gptq_to_layer(const GptqPacked& packed, int bits, int64_t in, int64_t out, int64_t groups,
                             int64_t group_size);
QuantizedLayer awq_to_layer(const AwqPacked& packed, int64_t in, int64_t out, int64_t group_size);
// The float32 weights [out, in] of a layer (dump, tests).
std::vector<float> dequantize_layer(const QuantizedLayer& layer);
// Back to a file's tensors: GPTQ qweight [in * bits / 32, out], qzeros, scales [groups, out] and
// g_idx (k / group_size when the layer has none); AWQ (4 bits, no g_idx) qweight [in, out / 8],
// qzeros, scales.
struct PackedTensors {
  std::vector<int32_t> qweight, qzeros, g_idx;
  std::vector<uint16_t> scales;
};
PackedTensors layer_to_gptq(const QuantizedLayer& layer);
PackedTensors layer_to_awq(const QuantizedLayer& layer);

}  // namespace memtune

// Weight-only quantization of a float checkpoint (`memtune quantize`): round-to-nearest, and the
// GPTQ algorithm (Frantar et al. 2022: each layer's weights quantized column by column, the
// rounding error of a column spread over the columns not yet quantized through the inverse
// Hessian of the layer's calibration inputs). Writes the GPTQ or AWQ file layout
// (io/quantized.h) that Qwen's published checkpoints use.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "io/quantized.h"
#include "model/config.h"

namespace memtune {

struct QuantizeOptions {
  // The file format (quant method gptq: symmetric, zero 2^(bits-1); awq: 4 bits with zero points),
  // bits, group_size, desc_act (act-order: columns taken by decreasing Hessian diagonal, GPTQ only)
  // and lm_head_bits (GPTQ: the LM head packed too, rounded to nearest; a tied head is untied).
  QuantConfig target;
  bool gptq = false;           // the GPTQ algorithm; false: round to nearest
  double damp_percent = 0.01;  // added to the Hessian's diagonal, as a fraction of its mean
  // Hessians (in x in float32 per distinct layer input) are collected for as many layers per pass
  // over the calibration data as fit in this many bytes.
  size_t hessian_budget_bytes = size_t{1} << 30;
};

// Rounds W [out, in] (row-major, the Hugging Face orientation) to the nearest code, group by group.
QuantizedLayer quantize_rtn(std::span<const float> w, int64_t out, int64_t in, const QuantConfig& target);
// GPTQ with H = sum of x x^T over the layer's calibration inputs [in, in] (modified in place).
QuantizedLayer quantize_gptq(std::span<const float> w, int64_t out, int64_t in, const QuantConfig& target,
                             std::vector<float>& hessian, double damp_percent);

struct QuantizeSummary {
  int64_t layers = 0;
  int64_t calibration_tokens = 0;
  int passes = 0;             // passes over the calibration data (GPTQ)
  int64_t unreached_layers = 0;  // GPTQ: experts' layers no calibration token reached, rounded to nearest
  size_t float_bytes = 0;     // the quantized layers' weights as the source stored them
  size_t packed_bytes = 0;    // ... and as written (qweight, qzeros, scales, g_idx)
  double mean_squared_error = 0;  // of the dequantized weights against the source, over all layers
};

// Quantizes the model in model_dir into out_dir (config.json with its quantization_config and
// model.safetensors; the other tensors copied as stored). Round-to-nearest reads one tensor at a
// time; GPTQ runs `calibration` (token sequences) through the float model on `backend`.
QuantizeSummary quantize_model(const std::string& model_dir, const std::string& out_dir, const QuantizeOptions& options,
                               const std::vector<std::vector<int32_t>>& calibration, Backend& backend);

}  // namespace memtune

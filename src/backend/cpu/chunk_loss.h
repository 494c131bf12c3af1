// The extension point for token-level losses. The fused LM head hands a loss one chunk of
// logits at a time ([rows, V], only positions that have a target) with the target of each row;
// the loss returns the SUM of its per-row losses and, when asked, overwrites the chunk with
// d(sum)/d(logits). It never sees the whole logits matrix, and it never normalizes: the trainer
// divides once by num_items_in_batch (one item = one target token). To write a custom loss,
// derive from ChunkLoss (see examples/focal_loss for a complete one with its gradient test).
#pragma once

#include <cstdint>

namespace memtune::cpu {

class ChunkLoss {
 public:
  virtual ~ChunkLoss() = default;
  // logits: [rows, V], row r's target is targets[r] (never ignore_index here). Returns the sum
  // over rows; when `gradient` is true, logits is overwritten with d(sum)/d(logits).
  virtual double chunk(float* logits, const int32_t* targets, int64_t rows, int64_t V, bool gradient) const = 0;
};

// Cross-entropy with PyTorch's label smoothing: per token (1-eps)*nll + eps*mean_v(-log p_v).
class CrossEntropyLoss final : public ChunkLoss {
 public:
  explicit CrossEntropyLoss(float label_smoothing = 0.0f) : label_smoothing_(label_smoothing) {}
  double chunk(float* logits, const int32_t* targets, int64_t rows, int64_t V, bool gradient) const override;

 private:
  float label_smoothing_;
};

// One chunk of logits as the fused LM head produced it, for read-only observers (streaming
// metrics): row r is the prediction at token positions[r] of the batch, whose target is
// targets[r]. Valid only during the call; an observer keeps what it needs, never the chunk.
struct LogitsChunk {
  const float* logits;  // [rows, V]
  const int32_t* targets;
  const int32_t* positions;
  int64_t rows, V;
};

class ChunkObserver {
 public:
  virtual ~ChunkObserver() = default;
  virtual void observe(const LogitsChunk& chunk) = 0;
};

// log(sum_v exp(z_v)) of one row in a single streaming pass (block max and sum merged online);
// also returns sum_v z_v when `sum_out` is given. Shared by losses and metrics.
float row_logsumexp(const float* z, int64_t V, float* sum_out = nullptr);

}  // namespace memtune::cpu

// The extension point for token-level losses. The fused LM head hands a loss one chunk of
// logits at a time ([rows, V], only positions that have a target) with the target of each row;
// the loss returns the SUM of its per-row losses and, when asked, overwrites the chunk with
// d(sum)/d(logits). It never sees the whole logits matrix, and it never normalizes: the trainer
// divides once by num_items_in_batch (one item = one target token). To write a custom loss,
// derive from ChunkLoss (see examples/focal_loss for a complete one with its gradient test).
//
// Losses and observers are host code: they read and write host memory. Backends whose memory
// the host can address (cpu) hand them the chunk in place; the others (reference, and a GPU
// backend) copy the chunk into a planned host staging buffer, call them there, and copy a
// loss's gradient back: two transfers of rows x V floats per chunk (docs/architecture.md).
#pragma once

#include <bit>
#include <cstdint>

namespace memtune {

// exp(x) to ~2e-7 relative error, branch-free and inline so loops over it vectorize:
// exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-7 Taylor polynomial on r.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// What a loss returns for a micro-batch: the SUM of its items' losses and the COUNT of items.
struct LossSum {
  double sum = 0;
  int64_t count = 0;
  // The sum stayed on the device (LmHeadArgs::defer_sum): `sum` is 0 here, and
  // Backend::take_deferred_loss_sum() gives it after the step's next read of the device.
  bool deferred = false;
};

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
  float label_smoothing() const { return label_smoothing_; }

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

// What the built-in metrics need of one logits row (eval_loss and perplexity come from the loss
// sum). It is computed where the logits are, on the device for a GPU backend, so 16 bytes per
// row cross to the host instead of V floats.
struct RowStats {
  float logsumexp = 0;     // log sum_v exp(z_v)
  float target_logit = 0;  // z_target
  int32_t argmax = 0;      // the first maximum, as torch.argmax
  int32_t target_rank = 0; // tokens scoring above the target, plus equal ones with a lower id
};
static_assert(sizeof(RowStats) == 16, "a device backend writes RowStats as four 32-bit words");
// The statistics of `rows` rows, in the order the chunks produced them.
struct RowStatsChunk {
  const RowStats* stats;
  const int32_t* targets;
  const int32_t* positions;
  int64_t rows;
};
// One row's statistics on the host (backends whose logits are in host memory).
RowStats row_stats(const float* z, int64_t V, int32_t target);

// Observers see the statistics of every row (observe_rows) and, when needs_logits() says so,
// the logits chunks themselves (observe). Full logits are for custom metrics: a device backend
// copies each chunk into host staging for them, rows x V floats, which is what the statistics
// avoid. The default asks for logits, so an observer written against observe() alone works.
class ChunkObserver {
 public:
  virtual ~ChunkObserver() = default;
  virtual bool needs_logits() const { return true; }
  virtual void observe(const LogitsChunk&) {}
  virtual void observe_rows(const RowStatsChunk&) {}
};

// log(sum_v exp(z_v)) of one row in a single streaming pass (block max and sum merged online);
// also returns sum_v z_v when `sum_out` is given. Shared by losses and metrics.
float row_logsumexp(const float* z, int64_t V, float* sum_out = nullptr);

}  // namespace memtune

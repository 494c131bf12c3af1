// The memory plan: every buffer the engine will touch on the compute device, declared before
// anything is allocated (name, category, bytes, lifetime). Lifetimes are closed intervals over
// the ordered phases of a step. The planner assigns each buffer an offset so that buffers whose
// lifetimes overlap never share bytes; the arena then allocates exactly `peak_bytes()`.
//
// Invariant the engine keeps: lifetimes form a laminar family (any two are nested or disjoint).
// For such families the first-fit placement below, taken longest-lived first, is optimal, so the
// extent of the placement equals the largest sum of live bytes over phases: the planned peak is
// both what is allocated and what is live. `finalize()` checks that equality.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/console.h"  // format_bytes

namespace memtune {

enum class Category {
  Weights,           // parameters as stored (float32 / bfloat16), frozen or trainable
  TrainableParams,   // float32 master copies of trainable parameters stored in lower precision
  Gradients,         // float32 gradients of trainable parameters
  OptimizerState,    // AdamW moments
  Batch,             // token ids, positions, targets, sequence boundaries of a micro-batch
  SavedActivations,  // kept from forward for backward
  RecomputeScratch,  // one layer's activations rebuilt in backward (gradient checkpointing)
  Working,           // per-op temporaries: activation gradients, weight dtype conversion
  LossWorkspace,     // fused LM head: logits chunk and its row buffers (inference: the last rows' logits)
  KvCache,           // inference: the paged key/value cache of every layer
  kCount
};
constexpr size_t kNumCategories = static_cast<size_t>(Category::kCount);
std::string_view category_name(Category c);

// Phases of one training step, in order. Forward runs the decoder stack; Loss runs the final
// norm and the fused LM head + loss (chunked logits); Backward runs the stack in reverse;
// Optimizer updates the trainable parameters.
enum class Phase { Forward, Loss, Backward, Optimizer, kCount };
constexpr size_t kNumPhases = static_cast<size_t>(Phase::kCount);
std::string_view phase_name(Phase p);

using BufferId = uint32_t;

struct BufferDecl {
  std::string name;
  Category category;
  size_t bytes;         // as requested
  size_t padded_bytes;  // rounded up to kAlignment; what the plan counts
  Phase first, last;    // live in [first, last]
  size_t offset = 0;    // assigned by finalize()
  bool live_in(Phase p) const { return first <= p && p <= last; }
};

class MemoryPlan {
 public:
  static constexpr size_t kAlignment = 64;

  BufferId declare(std::string name, Category category, size_t bytes, Phase first, Phase last);
  // Shorthand for buffers live in every phase (parameters, gradients, optimizer state, the batch).
  BufferId declare_persistent(std::string name, Category category, size_t bytes) {
    return declare(std::move(name), category, bytes, Phase::Forward, Phase::Optimizer);
  }
  // Assigns offsets; after this no more declarations are accepted.
  void finalize();
  bool finalized() const { return finalized_; }

  const std::vector<BufferDecl>& buffers() const { return buffers_; }
  const BufferDecl& buffer(BufferId id) const { return buffers_.at(id); }
  // Sum of padded bytes live in a phase, optionally restricted to one category.
  size_t live_bytes(Phase p) const;
  size_t live_bytes(Phase p, Category c) const;
  // The planned peak: max over phases of live bytes. Equal to the placement's extent.
  size_t peak_bytes() const { return peak_bytes_; }
  Phase peak_phase() const { return peak_phase_; }

  // A human-readable table: bytes per category and phase, and the peak; with `evaluation`, one
  // more column: that (evaluation-only) plan's bytes per category at its own peak.
  std::string summary(const MemoryPlan* evaluation = nullptr) const { return summary(evaluation, Phase::Optimizer); }
  // Only the phases up to `last` (an inference model runs forward and loss only).
  std::string summary(const MemoryPlan* evaluation, Phase last) const;

 private:
  std::vector<BufferDecl> buffers_;
  size_t peak_bytes_ = 0;
  Phase peak_phase_ = Phase::Forward;
  bool finalized_ = false;
};

// The plan's extent [0, peak_bytes) cut into consecutive segments of at most `limit` bytes, each
// cut where no buffer crosses it, as few as the placement allows (greedy from the start): the
// allocations of a device whose single allocation is limited (Vulkan's maxMemoryAllocationSize).
// An Error naming the limit and the stretch of buffers that no cut can split below it.
struct PlanSegment {
  size_t offset = 0, bytes = 0;
};
std::vector<PlanSegment> plan_segments(const MemoryPlan& plan, size_t limit);

// "24GiB", "24 GB", "1.5e9", "512MiB" (binary and decimal units); an Error naming `flag`.
size_t parse_bytes(const std::string& text, std::string_view flag);

}  // namespace memtune

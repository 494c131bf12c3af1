#include "memory/plan.h"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string_view>
#include <utility>

#include "core/console.h"
#include "core/error.h"

namespace memtune {

std::string_view category_name(Category c) {
  static constexpr std::array<std::string_view, kNumCategories> names = {
      "weights",           "trainable_params",  "gradients", "optimizer_state", "batch",
      "saved_activations", "recompute_scratch", "working",   "loss_workspace",
      "kv_cache"};
  return names[static_cast<size_t>(c)];
}

std::string_view phase_name(Phase p) {
  static constexpr std::array<std::string_view, kNumPhases> names = {"forward", "loss", "backward", "optimizer"};
  return names[static_cast<size_t>(p)];
}

BufferId MemoryPlan::declare(std::string name, Category category, size_t bytes, Phase first, Phase last) {
  MT_ASSERT(!finalized_, "declare after finalize: " + name);
  MT_ASSERT(first <= last, name);
  size_t padded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  buffers_.push_back(BufferDecl{std::move(name), category, bytes, padded, first, last});
  return static_cast<BufferId>(buffers_.size() - 1);
}

void MemoryPlan::finalize() {
  MT_ASSERT(!finalized_);
  // Laminar check: two lifetimes either nest or are disjoint.
  std::vector<std::pair<Phase, Phase>> spans;
  for (const auto& b : buffers_) spans.emplace_back(b.first, b.last);
  std::sort(spans.begin(), spans.end());
  spans.erase(std::unique(spans.begin(), spans.end()), spans.end());
  for (const auto& [f1, l1] : spans)
    for (const auto& [f2, l2] : spans) {
      bool nested = (f1 <= f2 && l2 <= l1) || (f2 <= f1 && l1 <= l2);
      bool disjoint = l1 < f2 || l2 < f1;
      MT_ASSERT(nested || disjoint, "buffer lifetimes must nest or be disjoint");
    }

  // Longest lifetime first, then earliest start, then largest; first fit among conflicts.
  std::vector<BufferId> order(buffers_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](BufferId a, BufferId b) {
    const auto &x = buffers_[a], &y = buffers_[b];
    auto lx = static_cast<int>(x.last) - static_cast<int>(x.first);
    auto ly = static_cast<int>(y.last) - static_cast<int>(y.first);
    if (lx != ly) return lx > ly;
    if (x.first != y.first) return x.first < y.first;
    return x.padded_bytes > y.padded_bytes;
  });
  // The bytes the placed buffers of each distinct lifetime occupy, as [begin, end) intervals
  // merged where they touch: lifetimes are few, and a lifetime's buffers stack into one interval,
  // so a buffer's conflicts are a handful of intervals however many buffers were placed (a
  // mixture of experts declares hundreds of thousands).
  std::vector<std::map<size_t, size_t>> occupied(spans.size());
  std::vector<std::pair<size_t, size_t>> taken;  // [begin, end) occupied in conflicting lifetimes
  size_t extent = 0;
  for (BufferId id : order) {
    auto& b = buffers_[id];
    taken.clear();
    for (size_t j = 0; j < spans.size(); ++j)
      if (b.first <= spans[j].second && spans[j].first <= b.last)
        taken.insert(taken.end(), occupied[j].begin(), occupied[j].end());
    std::sort(taken.begin(), taken.end());
    size_t offset = 0;
    for (const auto& [begin, end] : taken) {
      if (offset + b.padded_bytes <= begin) break;
      offset = std::max(offset, end);
    }
    b.offset = offset;
    extent = std::max(extent, offset + b.padded_bytes);
    if (b.padded_bytes == 0) continue;
    std::map<size_t, size_t>& own =
        occupied[static_cast<size_t>(std::lower_bound(spans.begin(), spans.end(), std::pair(b.first, b.last)) -
                                     spans.begin())];
    size_t lo = offset, hi = offset + b.padded_bytes;
    auto it = own.upper_bound(lo);
    if (it != own.begin() && std::prev(it)->second >= lo) {
      --it;
      lo = it->first;
      hi = std::max(hi, it->second);
      it = own.erase(it);
    }
    for (; it != own.end() && it->first <= hi; it = own.erase(it)) hi = std::max(hi, it->second);
    own.emplace(lo, hi);
  }

  peak_bytes_ = 0;
  for (size_t p = 0; p < kNumPhases; ++p) {
    size_t live = live_bytes(static_cast<Phase>(p));
    if (live > peak_bytes_) {
      peak_bytes_ = live;
      peak_phase_ = static_cast<Phase>(p);
    }
  }
  MT_ASSERT(extent == peak_bytes_, fmt::format("placement extent {} != live peak {}", extent, peak_bytes_));
  finalized_ = true;
}

size_t MemoryPlan::live_bytes(Phase p) const {
  size_t total = 0;
  for (const auto& b : buffers_)
    if (b.live_in(p)) total += b.padded_bytes;
  return total;
}

size_t MemoryPlan::live_bytes(Phase p, Category c) const {
  size_t total = 0;
  for (const auto& b : buffers_)
    if (b.live_in(p) && b.category == c) total += b.padded_bytes;
  return total;
}

std::string MemoryPlan::summary(const MemoryPlan* evaluation, Phase last) const {
  const size_t shown = static_cast<size_t>(last) + 1;
  std::string out = fmt::format("{:<20}", "category");
  for (size_t p = 0; p < shown; ++p) out += fmt::format("{:>14}", phase_name(static_cast<Phase>(p)));
  if (evaluation) out += fmt::format("{:>14}", "evaluation");
  out += "\n";
  const Phase eval_peak = evaluation ? evaluation->peak_phase() : Phase::Forward;
  for (size_t c = 0; c < kNumCategories; ++c) {
    auto cat = static_cast<Category>(c);
    size_t any = evaluation ? evaluation->live_bytes(eval_peak, cat) : 0;
    for (size_t p = 0; p < kNumPhases; ++p) any += live_bytes(static_cast<Phase>(p), cat);
    if (any == 0) continue;
    out += fmt::format("{:<20}", category_name(cat));
    for (size_t p = 0; p < shown; ++p)
      out += fmt::format("{:>14}", format_bytes(live_bytes(static_cast<Phase>(p), cat)));
    if (evaluation) out += fmt::format("{:>14}", format_bytes(evaluation->live_bytes(eval_peak, cat)));
    out += "\n";
  }
  out += fmt::format("{:<20}", "total");
  for (size_t p = 0; p < shown; ++p) out += fmt::format("{:>14}", format_bytes(live_bytes(static_cast<Phase>(p))));
  if (evaluation) out += fmt::format("{:>14}", format_bytes(evaluation->peak_bytes()));
  out += fmt::format("\npeak {} ({} bytes) in phase {}, {} buffers\n", format_bytes(peak_bytes_), peak_bytes_,
                     phase_name(peak_phase_), buffers_.size());
  return out;
}

// "24GiB", "24 GB", "1.5e9", "512MiB": binary and decimal units.
std::vector<PlanSegment> plan_segments(const MemoryPlan& plan, size_t limit) {
  const size_t extent = plan.peak_bytes();
  if (extent == 0) return {};
  if (extent <= limit) return {{0, extent}};
  // The offsets a cut may take: where every buffer starting before has ended.
  std::vector<const BufferDecl*> by_offset;
  for (const BufferDecl& b : plan.buffers()) by_offset.push_back(&b);
  std::sort(by_offset.begin(), by_offset.end(), [](const BufferDecl* a, const BufferDecl* b) { return a->offset < b->offset; });
  std::vector<size_t> cuts;
  size_t reach = 0;
  for (const BufferDecl* b : by_offset) {
    if (b->offset >= reach && b->offset > 0) cuts.push_back(b->offset);
    reach = std::max(reach, b->offset + b->padded_bytes);
  }
  cuts.push_back(extent);
  auto unsplittable = [&](size_t from, size_t to) {
    return Error(fmt::format("the arena's buffers from offset {} to {} ({}) cannot be split into allocations of at "
                             "most {} (the device's limit on one allocation): plan less, e.g. a smaller micro-batch or "
                             "--loss_workspace_bytes",
                             from, to, format_bytes(to - from), format_bytes(limit)));
  };
  std::vector<PlanSegment> segments;
  size_t start = 0, last_cut = 0;
  for (const size_t c : cuts) {
    if (c - start > limit) {
      if (last_cut == start) throw unsplittable(start, c);
      segments.push_back({start, last_cut - start});
      start = last_cut;
      if (c - start > limit) throw unsplittable(start, c);
    }
    last_cut = c;
  }
  segments.push_back({start, extent - start});
  return segments;
}

size_t parse_bytes(const std::string& text, std::string_view flag) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw Error(fmt::format("{} \"{}\": expected a size such as 24GiB or 16GB", flag, text));
  }
  if (!std::isfinite(value) || value <= 0)
    throw Error(fmt::format("{} \"{}\": expected a positive size such as 24GiB or 16GB", flag, text));
  std::string unit = text.substr(pos);
  unit.erase(0, unit.find_first_not_of(' '));
  const std::pair<const char*, double> units[] = {
      {"", 1},     {"B", 1},    {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, factor] : units)
    if (unit == name) return static_cast<size_t>(std::llround(value * factor));
  throw Error(fmt::format("{} \"{}\": unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", flag, text));
}

}  // namespace memtune

// MemoryPlan placement and Arena lifetime enforcement.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/registry.h"
#include "core/error.h"
#include "memory/arena.h"
#include "memory/plan.h"

namespace memtune {
namespace {

TEST(MemoryPlan, LaminarLifetimesPackToTheLivePeak) {
  MemoryPlan plan;
  plan.declare_persistent("weights", Category::Weights, 1000);
  plan.declare("saved", Category::SavedActivations, 640, Phase::Forward, Phase::Backward);
  plan.declare("fwd_scratch", Category::Working, 300, Phase::Forward, Phase::Forward);
  plan.declare("dnormed", Category::Working, 100, Phase::Loss, Phase::Backward);
  plan.declare("logits", Category::LossWorkspace, 5000, Phase::Loss, Phase::Loss);
  plan.declare("bwd_scratch", Category::Working, 2000, Phase::Backward, Phase::Backward);
  plan.finalize();
  // padded: weights 1024, saved 640, fwd 320, dnormed 128, logits 5056, bwd 2048
  EXPECT_EQ(plan.live_bytes(Phase::Forward), 1024u + 640 + 320);
  EXPECT_EQ(plan.live_bytes(Phase::Loss), 1024u + 640 + 128 + 5056);
  EXPECT_EQ(plan.live_bytes(Phase::Backward), 1024u + 640 + 128 + 2048);
  EXPECT_EQ(plan.live_bytes(Phase::Optimizer), 1024u);
  EXPECT_EQ(plan.peak_bytes(), 1024u + 640 + 128 + 5056);
  EXPECT_EQ(plan.peak_phase(), Phase::Loss);
  // Buffers live at the same time never overlap.
  const auto& b = plan.buffers();
  for (size_t i = 0; i < b.size(); ++i)
    for (size_t j = i + 1; j < b.size(); ++j) {
      const bool together = b[i].first <= b[j].last && b[j].first <= b[i].last;
      const bool disjoint_bytes =
          b[i].offset + b[i].padded_bytes <= b[j].offset || b[j].offset + b[j].padded_bytes <= b[i].offset;
      if (together) {
        EXPECT_TRUE(disjoint_bytes) << b[i].name << " / " << b[j].name;
      }
    }
  // The logits workspace reuses bytes of the forward scratch.
  EXPECT_LT(b[4].offset, b[2].offset + b[2].padded_bytes);
}

// A device that limits one allocation: the plan is cut where no buffer crosses, each piece within
// the limit, as few as possible; a stretch no cut can bring under the limit is refused.
TEST(MemoryPlan, SegmentsCutWhereNoBufferCrossesWithinTheLimit) {
  MemoryPlan plan;
  for (int i = 0; i < 6; ++i) plan.declare_persistent("w" + std::to_string(i), Category::Weights, 1000);
  plan.declare("saved", Category::SavedActivations, 640, Phase::Forward, Phase::Backward);
  plan.declare("fwd", Category::Working, 300, Phase::Forward, Phase::Forward);
  plan.declare("logits", Category::LossWorkspace, 2500, Phase::Loss, Phase::Loss);
  plan.declare("bwd", Category::Working, 2000, Phase::Backward, Phase::Backward);
  plan.finalize();
  EXPECT_EQ(plan_segments(plan, plan.peak_bytes()).size(), 1u);
  const size_t limit = 3100;
  const std::vector<PlanSegment> segments = plan_segments(plan, limit);
  ASSERT_GT(segments.size(), 1u);
  size_t at = 0;
  for (const PlanSegment& s : segments) {
    EXPECT_EQ(s.offset, at);
    EXPECT_LE(s.bytes, limit);
    at += s.bytes;
    for (const BufferDecl& b : plan.buffers())  // no buffer crosses the segment's start
      EXPECT_FALSE(b.offset < s.offset && s.offset < b.offset + b.padded_bytes) << b.name << " at " << s.offset;
  }
  EXPECT_EQ(at, plan.peak_bytes());
  // Greedy: no two neighbours would fit in one allocation.
  for (size_t i = 0; i + 1 < segments.size(); ++i) EXPECT_GT(segments[i].bytes + segments[i + 1].bytes, limit);
  try {
    plan_segments(plan, 2000);  // the 2560-byte logits buffer alone is larger
    FAIL() << "a buffer larger than the limit was split";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1.95 KiB"), std::string::npos) << e.what();
  }
}

TEST(Arena, ACutArenaHandsOutEveryBufferInsideOneAllocation) {
  MemoryPlan plan;
  std::vector<BufferId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(plan.declare_persistent("w" + std::to_string(i), Category::Weights, 4096));
  plan.finalize();
  Arena arena(plan, nullptr, 8192);
  ASSERT_EQ(arena.segments().size(), 3u);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto* p = static_cast<std::byte*>(arena.raw(ids[i]));
    const BufferDecl& b = plan.buffer(ids[i]);
    bool inside = false;
    for (const Arena::Segment& s : arena.segments())
      inside |= p >= s.base && p + b.padded_bytes <= s.base + s.bytes && p - s.base == static_cast<std::ptrdiff_t>(b.offset - s.offset);
    EXPECT_TRUE(inside) << b.name;
    std::memset(p, static_cast<int>(i + 1), b.padded_bytes);  // every byte is writable
  }
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(*static_cast<unsigned char*>(arena.raw(ids[i])), i + 1);
}

TEST(MemoryPlan, CrossingLifetimesAreRefused) {
  MemoryPlan plan;
  plan.declare("a", Category::Working, 64, Phase::Forward, Phase::Loss);
  plan.declare("b", Category::Working, 64, Phase::Loss, Phase::Backward);
  EXPECT_THROW(plan.finalize(), InternalError);
}

TEST(Arena, RefusesBuffersOutsideTheirLifetimeAndTracksHighWater) {
  MemoryPlan plan;
  const BufferId w = plan.declare_persistent("w", Category::Weights, 128);
  const BufferId f = plan.declare("f", Category::Working, 256, Phase::Forward, Phase::Forward);
  const BufferId l = plan.declare("l", Category::LossWorkspace, 64, Phase::Loss, Phase::Loss);
  plan.finalize();
  Arena arena(plan, nullptr);
  EXPECT_EQ(arena.capacity_bytes(), 384u);
  arena.raw(w);
  EXPECT_EQ(arena.high_water_bytes(), 128u);
  arena.raw(f);
  EXPECT_EQ(arena.high_water_bytes(), 384u);
  EXPECT_THROW(arena.raw(l), InternalError);
  arena.enter_phase(Phase::Loss);
  EXPECT_THROW(arena.raw(f), InternalError);
  EXPECT_NO_THROW(arena.raw(l));
}

TEST(Arena, PoisonsBuffersWhenTheirLifetimeEnds) {
  MemoryPlan plan;
  const BufferId f = plan.declare("f", Category::Working, 16, Phase::Forward, Phase::Forward);
  const BufferId keep = plan.declare_persistent("keep", Category::Weights, 16);
  plan.finalize();
  Arena arena(plan, nullptr);
  arena.set_poison_on_release(true);
  float* stale = static_cast<float*>(arena.raw(f));
  float* kept = static_cast<float*>(arena.raw(keep));
  stale[0] = 1.0f;
  kept[0] = 2.0f;
  arena.enter_phase(Phase::Loss);
  EXPECT_TRUE(std::isnan(stale[0]));
  EXPECT_EQ(kept[0], 2.0f);
}

TEST(Arena, DeviceArenaPoisonsThroughItsBackend) {
  MemoryPlan plan;
  const BufferId f = plan.declare("f", Category::Working, 16, Phase::Forward, Phase::Forward);
  plan.finalize();
  Backend& be = backend_named("reference");
  Arena arena(plan, &be);
  arena.set_poison_on_release(true);
  const Tensor t = arena.f32(f, {4});
  be.fill(t, 1.0f);
  arena.enter_phase(Phase::Loss);
  EXPECT_TRUE(std::isnan(download_f32(be, t)[0]));
}

}  // namespace
}  // namespace memtune

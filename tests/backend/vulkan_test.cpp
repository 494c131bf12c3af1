// The vulkan backend's ops by family, each on the same inputs as the reference backend (the op
// harness, tests/backend/ops_test.cpp, also runs every op on it with finite differences), on whatever Vulkan device this machine has (Mesa's lavapipe in CI; tiny
// shapes, since lavapipe is slow). Without a usable device the tests are skipped, or fail where
// every test is required (MEMTUNE_REQUIRE_ALL_TESTS: CI installs lavapipe).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/registry.h"
#include "backend/vulkan/context.h"
#include "backend/vulkan/device.h"
#include "backend/vulkan/geometry.h"
#include "backend/vulkan/shaders.h"
#include "backend/vulkan/vulkan_backend.h"
#include "core/error.h"
#include "core/rng.h"
#include "memory/arena.h"
#include "data/synthetic_tokenizer.h"
#include "support/test_util.h"
#include "support/numeric.h"

namespace memtune {
namespace {

std::vector<float> randn(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(rng.normal());
  return v;
}

class VulkanOps : public ::testing::Test {
 protected:
  void SetUp() override {
    const VulkanDevices found = vulkan_devices();
    bool usable = false;
    for (const VulkanDeviceInfo& d : found.devices) usable |= d.usable();
    if (!usable) {
      SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device (" + found.problem + "): install mesa-vulkan-drivers");
    }
  }
  void TearDown() override {
    for (auto [be, p, n] : allocations_) be->deallocate(p, n);
  }
  // A float32 (or 16-bit) tensor in `be`'s memory holding `values` (converted to dtype).
  Tensor make(Backend& be, DType dtype, std::initializer_list<int64_t> shape, const std::vector<float>& values = {}) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
    void* p = be.allocate(bytes);
    allocations_.push_back({&be, p, bytes});
    Tensor t(p, dtype, shape);
    if (!values.empty()) upload_f32(be, t, values);
    return t;
  }
  Backend& vk() { return vulkan_backend(); }
  Backend& ref() { return backend_named("reference"); }
  // out = x @ w^T + b with w [OC, C] in `dtype`, and (float32 w) prior + 0.5 x @ w^T: {out, acc}.
  std::vector<std::vector<float>> linear_products(Backend& be, DType dtype, int64_t N, int64_t C, int64_t OC,
                                                  const std::vector<float>& x, const std::vector<float>& w,
                                                  const std::vector<float>& b, const std::vector<float>& prior) {
    const Tensor tx = make(be, DType::F32, {N, C}, x), tw = make(be, dtype, {OC, C}, w),
                 tb = make(be, DType::F32, {OC}, b), out = make(be, DType::F32, {N, OC}),
                 acc = make(be, DType::F32, {N, OC}, prior);
    be.matmul_forward(out, tx, tw, tb);
    if (dtype == DType::F32) be.matmul_accumulate(acc, tx, tw, 0.5f);
    return {download_f32(be, out), download_f32(be, acc)};
  }

 private:
  struct Held {
    Backend* be;
    void* p;
    size_t n;
  };
  std::vector<Held> allocations_;
};

// |got - want| <= tolerance x (1 + |want|) at every element; equal infinities allowed, NaN never.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, float tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    ASSERT_TRUE(testing_support::close_scalar(got[i], want[i],
                                              testing_support::absolute_tolerance(tolerance * (1.0 + std::abs(want[i])))))
        << "element " << i;
  }
}

TEST_F(VulkanOps, TheBackendIsRegisteredWhereADeviceIsUsable) {
  const std::vector<std::string_view> names = backend_list();
  EXPECT_NE(std::find(names.begin(), names.end(), "vulkan"), names.end());
  EXPECT_EQ(&backend_named("vulkan"), &vk());
  EXPECT_EQ(vk().name(), "vulkan");
  EXPECT_FALSE(vk().host_addressable());
  EXPECT_FALSE(vk().memory_in_host_pages());
}

// The staging buffer's memory type: host-visible and coherent, cached where the device offers
// that (the host reads downloads from it), from the types the buffer allows. No device needed.
TEST(VulkanMemory, StagingTakesACachedHostTypeWhereThereIsOne) {
  constexpr VkMemoryPropertyFlags local = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                                  host = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                                  cached = VK_MEMORY_PROPERTY_HOST_CACHED_BIT;
  VkPhysicalDeviceMemoryProperties m{};
  // A discrete GPU's usual list: device-local, host write-combined, host cached, BAR (both).
  for (VkMemoryPropertyFlags f : {local, host, host | cached, local | host}) m.memoryTypes[m.memoryTypeCount++].propertyFlags = f;
  EXPECT_EQ(choose_memory_type(m, 0xF, host, cached), 2);
  EXPECT_EQ(choose_memory_type(m, 0xF, host), 1);              // nothing preferred: the first that fits
  EXPECT_EQ(choose_memory_type(m, 0xB, host, cached), 1);      // the buffer cannot use type 2
  EXPECT_EQ(choose_memory_type(m, 0x1, host, cached), -1);     // only device-local allowed
  EXPECT_EQ(choose_memory_type(m, 0xF, local), 0);
  // Which devices' memory is the machine's RAM (counted in the process prediction).
  VulkanDeviceInfo d;
  for (const auto& [type, host_memory] : {std::pair{"discrete GPU", false}, {"integrated GPU", true}, {"CPU", true},
                                          {"virtual GPU", false}}) {
    d.type = type;
    EXPECT_EQ(d.memory_is_host(), host_memory) << type;
  }
}

// What the backend needs of a device, one requirement at a time (no device needed): gemm.comp's
// 128 x 128 tiles take 25 KiB of shared memory, so a device with Vulkan's minimum of 16 KiB is
// refused rather than failing at its first large product.
TEST(VulkanDevice, UsableOnlyWithEverythingTheShadersNeed) {
  VulkanDeviceInfo d;
  d.buffer_device_address = d.shader_int64 = d.storage_16bit = d.subgroup_shuffle = true;
  d.subgroup_size = 32;
  d.shared_memory_bytes = 49152;
  EXPECT_TRUE(d.usable());
  d.shared_memory_bytes = 16384;
  EXPECT_FALSE(d.usable());
  d.shared_memory_bytes = 32768;
  EXPECT_TRUE(d.usable());
  d.subgroup_size = 4;
  EXPECT_FALSE(d.usable());
  d.subgroup_size = 8;
  d.subgroup_shuffle = false;
  EXPECT_FALSE(d.usable());
}

// The push-constant block's size as the SPIR-V declares it, which every dispatch checks its C++
// struct against: rmsnorm has five addresses, two uints and a float (52 bytes).
TEST(VulkanShaders, PushConstantBlocksAreReadFromTheSpirv) {
  EXPECT_EQ(vulkan_push_constant_bytes(vulkan_shader("rmsnorm")), 52u);
  EXPECT_EQ(vulkan_push_constant_bytes(vulkan_shader("rmsnorm_backward")), 48u);  // 5 addresses, N, C
  EXPECT_TRUE(vulkan_shader("no_such_shader").empty());
  // The members that may hold addresses (what a dispatch's stated ranges are checked against):
  // rmsnorm's five buffer references, not N, C or eps; dropout's two and its 64-bit key.
  EXPECT_EQ(vulkan_push_constant_address_offsets(vulkan_shader("rmsnorm")), (std::vector<uint32_t>{0, 8, 16, 24, 32}));
  EXPECT_EQ(vulkan_push_constant_address_offsets(vulkan_shader("dropout")), (std::vector<uint32_t>{0, 8, 16}));
}

// Transfers larger than the staging buffer, at offsets inside an allocation, and device copies.
TEST_F(VulkanOps, TransfersAndCopiesRoundTripEveryByte) {
  const int64_t n = (int64_t{12} << 20) / 4 + 13;  // 12 MiB + 13 floats: two staging slices and a tail
  const std::vector<float> values = randn(n, 1);
  const DeviceCounters before = *vk().device_counters();
  const Tensor t = make(vk(), DType::F32, {n}, values);
  // The upload: four slices through the staging buffer's 4 MiB halves, each submitted at once;
  // the host waits only to refill a half whose copy may still run (slices 3 and 4), not at the end.
  const DeviceCounters uploaded = *vk().device_counters();
  EXPECT_GE(uploaded.submissions - before.submissions, 4u);
  EXPECT_LE(uploaded.waits - before.waits, 2u);
  EXPECT_EQ(download_f32(vk(), t), values);
  const Tensor inner = t.flat_range(1000, 777);
  EXPECT_EQ(download_f32(vk(), inner), std::vector<float>(values.begin() + 1000, values.begin() + 1777));
  const Tensor u = make(vk(), DType::F32, {777});
  vk().copy(u, inner);
  EXPECT_EQ(download_f32(vk(), u), download_f32(vk(), inner));
  vk().fill(u, 2.5f);
  EXPECT_EQ(download_f32(vk(), u), std::vector<float>(777, 2.5f));
  vk().fill_bytes(u.data, 0, u.bytes());
  EXPECT_EQ(download_f32(vk(), u), std::vector<float>(777, 0.0f));
  // A fresh allocation is zero-filled, as the interface promises.
  EXPECT_EQ(download_f32(vk(), make(vk(), DType::F32, {33})), std::vector<float>(33, 0.0f));
}

// Several ranges in one download: those that fit the staging buffer together cost one wait; a
// range is cut where the buffer is full, and every byte arrives (a context of its own: the
// ranges' addresses are its allocations).
TEST_F(VulkanOps, DownloadsOfSeveralRangesShareWaitsAndArriveWhole) {
  VulkanContext ctx;
  const size_t big = size_t{6} << 20, small = 4 * 1000 + 12;
  std::vector<std::vector<std::byte>> in;
  std::vector<uint64_t> at;
  for (const size_t n : {big, big - 4, small}) {
    std::vector<std::byte> bytes(n);
    Rng rng(n);
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng.next_u64());
    at.push_back(ctx.allocate(n));
    ctx.upload(at.back(), bytes.data(), n);
    in.push_back(std::move(bytes));
  }
  std::vector<std::vector<std::byte>> out;
  for (const auto& b : in) out.emplace_back(b.size());
  auto waits = [&] { return ctx.counters().waits; };
  uint64_t before = waits();
  ctx.download({{out[2].data(), at[2], small}, {out[0].data(), at[0], 1000}});  // both fit: one wait
  EXPECT_EQ(waits() - before, 1u);
  EXPECT_TRUE(std::equal(out[0].begin(), out[0].begin() + 1000, in[0].begin()));
  EXPECT_EQ(out[2], in[2]);
  before = waits();
  ctx.download({{out[0].data(), at[0], big}, {out[1].data(), at[1], big - 4}, {out[2].data(), at[2], small}});
  EXPECT_EQ(waits() - before, 2u) << "12 MiB through the 8 MiB staging buffer: cut once";
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(out[i], in[i]) << "range " << i;
}

// Narrowing equals the reference bit for bit in both 16-bit types, float16 subnormals and the ties
// between them included; widening is exact for every one of the 65536 float16 and bfloat16 words.
TEST_F(VulkanOps, ConvertRoundsToSixteenBitsAsTheReferenceDoes) {
  std::vector<float> values = randn(1000, 2);
  values.insert(values.end(), {0.0f, -0.0f, 1e-40f, 65504.0f, 65519.0f, 65520.0f, 1e30f, -1e-8f, 3.14159265f,
                               INFINITY, -INFINITY, std::nanf("")});
  // float16 subnormals (multiples of 2^-24 below 2^-14), the halfway points between them, and
  // the edges: 2^-25 (a tie that rounds to zero), 3 x 2^-25 (a tie that rounds up to 2 x 2^-24).
  for (const int m : {1, 2, 3, 511, 512, 1023})
    for (const float half : {0.0f, 0.5f, 0.25f})
      values.push_back(std::ldexp(float(m) + half, -24)), values.push_back(-std::ldexp(float(m) + half, -24));
  values.insert(values.end(), {std::ldexp(1.0f, -25), std::ldexp(3.0f, -25), std::ldexp(1.0f, -14),
                               std::ldexp(1023.5f, -24), 1e-6f, -6.1e-5f, 5.96e-8f, 2.9e-8f});
  const int64_t n = static_cast<int64_t>(values.size());
  for (const DType dtype : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_torch_name(dtype));
    const Tensor vx = make(vk(), DType::F32, {n}, values), rx = make(ref(), DType::F32, {n}, values);
    const Tensor vh = make(vk(), dtype, {n}), rh = make(ref(), dtype, {n});
    vk().convert(vh, vx);
    ref().convert(rh, rx);
    std::vector<uint16_t> vbits(static_cast<size_t>(n)), rbits(static_cast<size_t>(n));
    vk().copy_to_host(vbits.data(), vh);
    ref().copy_to_host(rbits.data(), rh);
    for (size_t i = 0; i < vbits.size(); ++i)
      ASSERT_EQ(vbits[i], rbits[i]) << "value " << values[i] << " (index " << i << ")";  // round to nearest even
    // Widening every 16-bit word: the same float32 bits as the reference.
    std::vector<uint16_t> words(65536);
    for (size_t i = 0; i < words.size(); ++i) words[i] = static_cast<uint16_t>(i);
    const Tensor vw = make(vk(), dtype, {65536}), rw = make(ref(), dtype, {65536});
    vk().copy_to_device(vw, words.data());
    ref().copy_to_device(rw, words.data());
    const Tensor vf = make(vk(), DType::F32, {65536}), rf = make(ref(), DType::F32, {65536});
    vk().convert(vf, vw);
    ref().convert(rf, rw);
    std::vector<uint32_t> vwide(65536), rwide(65536);
    vk().copy_to_host(vwide.data(), vf);
    ref().copy_to_host(rwide.data(), rf);
    for (size_t i = 0; i < vwide.size(); ++i) {
      const auto is_nan = [](uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; };
      if (is_nan(rwide[i])) {  // any NaN (which payload bits a NaN keeps is the hardware's)
        ASSERT_TRUE(is_nan(vwide[i])) << std::hex << "word 0x" << i << ": 0x" << vwide[i];
        continue;
      }
      ASSERT_EQ(vwide[i], rwide[i]) << std::hex << "word 0x" << i << ": 0x" << vwide[i] << ", want 0x" << rwide[i];
    }
  }
}

// out = inp @ W^T + bias for float32 and 16-bit weights, shapes that are no multiple of gemm.comp's
// 64 x 64 output tile or of its 16-wide steps over C; matmul_accumulate (float32 weights) adds
// scale * product. 7 rows take matvec.comp (an invocation per output), 37 and 130 gemm.comp
// (130 x 67: three tiles down, two across, each with a ragged edge).
TEST_F(VulkanOps, MatmulEqualsTheReferenceForEveryWeightDtype) {
  for (const auto [N, C, OC] : {std::array<int64_t, 3>{7, 37, 19}, {37, 37, 19}, {130, 70, 67}})
  for (const DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const std::vector<float> x = randn(N * C, 3), w = randn(OC * C, 4), b = randn(OC, 5), prior = randn(N * OC, 6);
    SCOPED_TRACE(fmt::format("{} rows, {}", N, dtype_torch_name(dtype)));
    const auto got = linear_products(vk(), dtype, N, C, OC, x, w, b, prior),
               want = linear_products(ref(), dtype, N, C, OC, x, w, b, prior);
    expect_close(got[0], want[0], 1e-5f);
    expect_close(got[1], want[1], 1e-5f);
  }
}

// Elementwise ops, recorded one after another without a wait in between: each reads what the
// previous one wrote (the barriers between dispatches).
// The residual add and the norm in one dispatch compute what the two ops compute one after the
// other, bit for bit; rows wider than a workgroup, so each invocation reads back several columns.
TEST_F(VulkanOps, TheResidualAddAndNormInOneDispatchEqualTheTwoOpsBitForBit) {
  const int64_t N = 5, D = 700;
  const std::vector<float> r = randn(N * D, 81), x = randn(N * D, 82), w = randn(D, 83);
  auto run = [&](bool fused, uint64_t expected_dispatches) {
    Backend& be = vk();
    const Tensor res = make(be, DType::F32, {N, D}, r), tx = make(be, DType::F32, {N, D}, x),
                 tw = make(be, DType::F32, {D}, w), out = make(be, DType::F32, {N, D}), rstd = make(be, DType::F32, {N});
    const uint64_t before = be.device_counters()->dispatches;
    if (fused) be.add_rmsnorm_forward(out, rstd, res, tx, tw, 1e-6f);
    else be.Backend::add_rmsnorm_forward(out, rstd, res, tx, tw, 1e-6f);  // add_inplace, then rmsnorm
    EXPECT_EQ(be.device_counters()->dispatches - before, expected_dispatches);
    return std::vector{download_f32(be, res), download_f32(be, out), download_f32(be, rstd)};
  };
  EXPECT_EQ(run(true, 1), run(false, 2));
}

TEST_F(VulkanOps, ElementwiseOpsChainedInOneSubmission) {
  const int64_t n = 70000;  // more elements than one row of workgroups covers at once
  const std::vector<float> g = randn(n, 7), u = randn(n, 8), x = randn(n, 9);
  auto run = [&](Backend& be) {
    const Tensor tg = make(be, DType::F32, {n}, g), tu = make(be, DType::F32, {n}, u), tx = make(be, DType::F32, {n}, x),
                 h = make(be, DType::F32, {n});
    be.swiglu_forward(h, tg, tu);
    be.add_inplace(h, tx);
    be.add_inplace(h, h);
    return download_f32(be, h);
  };
  expect_close(run(vk()), run(ref()), 1e-5f);
}

// The rest of the layer's ops and the optimizer's, each run on both backends from the same
// inputs (gradient buffers start non-zero: the accumulating ops must add).
struct Inputs {
  int64_t N = 9, C = 40, OC = 23, heads = 2, hd = 8, V = 31;
};

// Both backward products through gemm.comp's strides (dout @ W, dout^T @ inp), at the small
// shape, at one with several ragged 64 x 64 tiles in every dimension, and at one whose sizes let
// every operand load 128 bits at a time (float32 along K and along the lines); the input gradient
// against a bfloat16 weight (a frozen base) too, read as pairs of rows.
TEST_F(VulkanOps, LinearBackwardEqualsTheReference) {
  for (const Inputs s : {Inputs{}, Inputs{.N = 70, .C = 81, .OC = 131}, Inputs{.N = 70, .C = 84, .OC = 132}})
  for (const DType dtype : {DType::F32, DType::BF16}) {
  SCOPED_TRACE(fmt::format("{} x {} x {}, {}", s.N, s.C, s.OC, dtype_torch_name(dtype)));
  // dinp = dout @ W: A along K, B along its lines; dweight = dout^T @ inp: both along their
  // lines. Vectors where 4 divides the contiguous dimension (dout's OC, W's and inp's C).
  EXPECT_EQ(vulkan_geometry::gemm_vector_loads(s.OC, 1, s.N, s.OC, 0, DType::F32), s.OC % 4 == 0 ? 1u : 0u);
  EXPECT_EQ(vulkan_geometry::gemm_vector_loads(1, s.C, s.C, s.OC, 0, dtype), s.C % 4 == 0 ? 1u : 0u);
  EXPECT_EQ(vulkan_geometry::gemm_vector_loads(1, s.OC, s.OC, s.N, 0, DType::F32), s.OC % 4 == 0 ? 1u : 0u);
  const std::vector<float> x = randn(s.N * s.C, 11), w = randn(s.OC * s.C, 12), dy = randn(s.N * s.OC, 13),
                           gx = randn(s.N * s.C, 14), gw = randn(s.OC * s.C, 15), gb = randn(s.OC, 16);
  const bool frozen = dtype != DType::F32;
  auto run = [&](Backend& be) {
    const Tensor tx = make(be, DType::F32, {s.N, s.C}, x), tw = make(be, dtype, {s.OC, s.C}, w),
                 tdy = make(be, DType::F32, {s.N, s.OC}, dy), dx = make(be, DType::F32, {s.N, s.C}, gx),
                 dw = frozen ? Tensor{} : make(be, DType::F32, {s.OC, s.C}, gw),
                 db = frozen ? Tensor{} : make(be, DType::F32, {s.OC}, gb);
    be.matmul_backward(dx, dw, db, tdy, tx, tw, 0.75f);
    std::vector<std::vector<float>> got{download_f32(be, dx)};
    if (!frozen) got.insert(got.end(), {download_f32(be, dw), download_f32(be, db)});
    return got;
  };
  const auto v = run(vk()), r = run(ref());
  for (size_t i = 0; i < v.size(); ++i) expect_close(v[i], r[i], 2e-5f);
  }
}

TEST_F(VulkanOps, NormRopeSwigluEmbeddingGatherDropoutAndCacheEqualTheReference) {
  const Inputs s;
  const int64_t D = s.heads * s.hd;
  const std::vector<float> x = randn(s.N * D, 21), w = randn(D, 22), dy = randn(s.N * D, 23), g0 = randn(s.N * D, 24),
                           gw0 = randn(D, 25), table = randn(s.V * D, 26), up = randn(s.N * D, 27);
  std::vector<float> inv_freq(static_cast<size_t>(s.hd / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / s.hd);
  const std::vector<int32_t> positions = {0, 1, 2, 3, 0, 1, 7, 100, 4000}, ids = {3, 0, 30, 3, 3, 17, 0, 29, 5},
                             rows = {8, 0, 3}, slots = {5, 2, 0, 7, 9, 11, 1, 3, 4};
  auto ints = [&](Backend& be, const std::vector<int32_t>& v) {
    const Tensor t = make(be, DType::I32, {static_cast<int64_t>(v.size())});
    be.copy_to_device(t, v.data());
    return t;
  };
  for (const DType store : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_torch_name(store));
    auto run = [&](Backend& be) {
      std::vector<std::vector<float>> got;
      const Tensor tx = make(be, DType::F32, {s.N, D}, x), tw = make(be, DType::F32, {D}, w),
                   out = make(be, DType::F32, {s.N, D}), rstd = make(be, DType::F32, {s.N}),
                   tdy = make(be, DType::F32, {s.N, D}, dy), dx = make(be, DType::F32, {s.N, D}, g0),
                   dw = make(be, DType::F32, {D}, gw0);
      be.rmsnorm_forward(out, rstd, tx, tw, 1e-6f);
      be.rmsnorm_backward(dx, dw, tdy, tx, tw, rstd);
      got.push_back(download_f32(be, out));
      got.push_back(download_f32(be, rstd));
      got.push_back(download_f32(be, dx));
      got.push_back(download_f32(be, dw));
      // The residual add and the norm after it (one pass on the device): res += x, then its norm.
      const Tensor res = make(be, DType::F32, {s.N, D}, dy), normed = make(be, DType::F32, {s.N, D}),
                   rstd_res = make(be, DType::F32, {s.N});
      be.add_rmsnorm_forward(normed, rstd_res, res, tx, tw, 1e-6f);
      for (const Tensor& t : {res, normed, rstd_res}) got.push_back(download_f32(be, t));
      const Tensor pos = ints(be, positions), freq = make(be, DType::F32, {s.hd / 2}, inv_freq);
      be.rope_forward(out, pos, freq);
      got.push_back(download_f32(be, out));
      be.rope_backward(out, pos, freq);
      got.push_back(download_f32(be, out));
      const Tensor tup = make(be, DType::F32, {s.N, D}, up), h = make(be, DType::F32, {s.N, D}),
                   dgate = make(be, DType::F32, {s.N, D}, g0), dup = make(be, DType::F32, {s.N, D}, g0);
      be.swiglu_forward(h, tx, tup);
      be.swiglu_backward(dgate, dup, tdy, tx, tup);
      got.push_back(download_f32(be, h));
      got.push_back(download_f32(be, dgate));
      got.push_back(download_f32(be, dup));
      const Tensor ttable = make(be, store, {s.V, D}, table), emb = make(be, DType::F32, {s.N, D}),
                   tid = ints(be, ids), dtable = make(be, DType::F32, {s.V, D}, table);
      be.embedding_forward(emb, tid, ttable);
      be.embedding_backward(dtable, tdy, tid);
      got.push_back(download_f32(be, emb));
      got.push_back(download_f32(be, dtable));
      const Tensor gathered = make(be, DType::F32, {3, D});
      be.gather_rows(gathered, tx, ints(be, rows));
      got.push_back(download_f32(be, gathered));
      const Tensor dropped = make(be, DType::F32, {s.N, D});
      be.dropout_forward(dropped, tx, 0xabcdef12345ull, 0.3f);
      got.push_back(download_f32(be, dropped));
      const Tensor kc = make(be, store, {12, D}), vc = make(be, store, {12, D});
      be.kv_cache_write(kc, vc, tx, tup, ints(be, slots));
      got.push_back(download_f32(be, kc));
      got.push_back(download_f32(be, vc));
      return got;
    };
    const auto v = run(vk()), r = run(ref());
    ASSERT_EQ(v.size(), r.size());
    for (size_t i = 0; i < v.size(); ++i) {
      SCOPED_TRACE(i);
      expect_close(v[i], r[i], 2e-5f);
    }
  }
}

TEST_F(VulkanOps, SamplingOnTheDeviceChoosesTheHostSamplersTokens) {
  // The same logits, settings and draws: the device's bisection thresholds and id-order walk
  // against the host sampler's sort in float64. Random logits have no ties, and no draw here
  // falls within float32 rounding of a boundary, so every token must agree.
  const int64_t R = 5, V = 1000;
  std::vector<float> logits = randn(R * V, 36);
  for (float& x : logits) x *= 3.0f;
  std::vector<PenaltyToken> penalties;
  for (int64_t r = 0; r < R; ++r)
    for (int32_t i = 0; i < 12; ++i) penalties.push_back({static_cast<int32_t>((r * 97 + i * 31) % V), i % 3});
  struct Setting {
    double temperature;
    int64_t top_k;
    double top_p, min_p, repetition, presence, frequency;
  };
  const std::vector<Setting> settings = {{0, 0, 1, 0, 1, 0, 0},       {0, 0, 1, 0, 1.3, 0.5, 0.2},
                                         {1.0, 0, 1, 0, 1, 0, 0},     {0.7, 5, 1, 0, 1, 0, 0},
                                         {1.2, 0, 0.9, 0, 1, 0, 0},   {0.8, 0, 1, 0.05, 1, 0, 0},
                                         {0.9, 40, 0.8, 0.02, 1.2, 0.3, 0.1}, {1.0, 1, 1, 0, 1, 0, 0}};
  const Tensor dev_logits = make(vk(), DType::F32, {R, V});
  const Tensor dev_rows = make(vk(), DType::I32, {R * kSampleRowWords});
  const Tensor dev_pen = make(vk(), DType::I32, {3 * static_cast<int64_t>(penalties.size())});
  const Tensor dev_tokens = make(vk(), DType::I32, {R});
  SamplerScratch scratch(V);
  Rng rng(37);
  int64_t checked = 0;
  for (const Setting& st : settings)
    for (int draw = 0; draw < 40; ++draw) {
      std::vector<SampleRow> rows;
      for (int64_t r = 0; r < R; ++r)
        rows.push_back({.temperature = st.temperature,
                        .top_k = st.top_k,
                        .top_p = st.top_p,
                        .min_p = st.min_p,
                        .repetition_penalty = st.repetition,
                        .presence_penalty = st.presence,
                        .frequency_penalty = st.frequency,
                        .penalty_begin = static_cast<uint32_t>(r * 12),
                        .penalty_count = st.repetition != 1 || st.presence != 0 ? 12u : 0u,
                        .uniform = rng.uniform()});
      upload_f32(vk(), dev_logits, logits);
      std::vector<int32_t> tokens(R, -1);
      vk().sample_tokens({.logits = dev_logits,
                          .rows = rows,
                          .penalties = penalties,
                          .tokens = tokens,
                          .device_rows = dev_rows,
                          .device_penalties = dev_pen,
                          .device_tokens = dev_tokens});
      for (int64_t r = 0; r < R; ++r) {
        const int32_t want = sample_row(logits.data() + r * V, 1, rows[r], penalties, scratch);
        ASSERT_EQ(tokens[r], want) << "setting " << (&st - settings.data()) << " draw " << draw << " row " << r;
        ++checked;
      }
      if (st.temperature == 0) break;  // greedy ignores the draw
    }
  EXPECT_GT(checked, 1000);
}

TEST_F(VulkanOps, AnArenaCutIntoSeveralAllocationsWorksAcrossThem) {
  // Three device allocations (a limit of two buffers each): ops read one and write another.
  MemoryPlan plan;
  std::vector<BufferId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(plan.declare_persistent("t" + std::to_string(i), Category::Working, 4096));
  plan.finalize();
  Arena arena(plan, &vk(), 8192);
  ASSERT_EQ(arena.segments().size(), 3u);
  std::vector<Tensor> t;
  for (size_t i = 0; i < ids.size(); ++i) {
    t.push_back(arena.f32(ids[i], {1024}));
    upload_f32(vk(), t.back(), std::vector<float>(1024, static_cast<float>(i + 1)));
  }
  vk().add_inplace(t[4], t[0]);  // third allocation += first
  vk().add_inplace(t[2], t[1]);  // second += first
  vk().copy(t[0], t[3]);         // first = second
  const std::vector<float> want = {4, 2, 5, 4, 6};
  for (size_t i = 0; i < t.size(); ++i)
    for (const float x : download_f32(vk(), t[i])) ASSERT_EQ(x, want[i]) << "buffer " << i;
}

// An optimizer step's results: the gradient norm's sum of squares, then param, m and v.
using OptimizerResult = std::tuple<double, std::vector<float>, std::vector<float>, std::vector<float>>;
void expect_same_update(const OptimizerResult& got, const OptimizerResult& want) {
  EXPECT_NEAR(std::get<0>(got), std::get<0>(want), 1e-5 * std::get<0>(want));
  expect_close(std::get<1>(got), std::get<1>(want), 1e-5f);
  expect_close(std::get<2>(got), std::get<2>(want), 1e-5f);
  expect_close(std::get<3>(got), std::get<3>(want), 1e-5f);
}

TEST_F(VulkanOps, OneGradientNormOverManyTensorsEqualsTheReference) {
  // 300 tensors of different sizes in one call: each tensor's partial sums land beside the
  // others' and come back together; every tensor is scaled.
  const std::vector<float> values = randn(300 * 700, 35);
  auto run = [&](Backend& be) {
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < 300; ++i) {
      const auto n = 1 + (i * 37) % 700;
      parts.push_back(make(be, DType::F32, {n}, std::vector<float>(values.begin() + i * 700, values.begin() + i * 700 + n)));
    }
    const double sumsq = be.scale_and_sum_squares(parts, 0.25f);
    std::vector<float> scaled;
    for (const Tensor& t : parts)
      for (const float x : download_f32(be, t)) scaled.push_back(x);
    return std::pair{sumsq, scaled};
  };
  const auto [vs, vx] = run(vk());
  const auto [rs, rx] = run(ref());
  EXPECT_NEAR(vs, rs, 1e-5 * rs);
  expect_close(vx, rx, 0.0f);
}

TEST_F(VulkanOps, GradientNormAndAdamWEqualTheReference) {
  const int64_t n = 300001;  // more than one workgroup's share per partial sum
  const std::vector<float> g = randn(n, 31), p0 = randn(n, 32), m0 = randn(n, 33);
  std::vector<float> v0 = randn(n, 34);
  for (float& x : v0) x = x * x;
  for (const bool decay : {true, false}) {
    auto run = [&](Backend& be) {
      const Tensor tg = make(be, DType::F32, {n}, g), tp = make(be, DType::F32, {n}, p0),
                   tm = make(be, DType::F32, {n}, m0), tv = make(be, DType::F32, {n}, v0);
      const double sumsq = be.scale_and_sum_squares(std::span(&tg, 1), 0.5f);
      AdamWStep step;
      step.t = 3;
      step.learning_rate = 1e-3;
      step.config = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
      step.decay = decay;
      step.grad_scale = 0.8f;
      be.adamw_update(tp, tg, tm, tv, step);
      return OptimizerResult{sumsq, download_f32(be, tp), download_f32(be, tm), download_f32(be, tv)};
    };
    const OptimizerResult got = run(vk());
    expect_same_update(got, run(ref()));
    // The same run twice gives the same bits (no atomics in the reduction).
    EXPECT_EQ(std::get<0>(run(vk())), std::get<0>(got));
  }
}

TEST_F(VulkanOps, AdamWRoundsEachUpdatedMasterIntoItsSixteenBitStorage) {
  // Three tensors in one update: a bfloat16 weight, a float16 weight (their float32 masters
  // updated and rounded in the same pass) and a float32 value with no storage. The storage must
  // hold exactly what convert() makes of the updated master, on the device as on the reference.
  const int64_t n = 5003;
  for (Backend* be : {&vk(), &ref()}) {
    SCOPED_TRACE(be->name());
    std::vector<Backend::AdamWTensor> ts;
    for (int i = 0; i < 3; ++i) {
      const Tensor storage = i < 2 ? make(*be, i == 0 ? DType::BF16 : DType::F16, {n}, randn(n, 80 + i)) : Tensor{};
      ts.push_back({make(*be, DType::F32, {n}, randn(n, 70 + i)), make(*be, DType::F32, {n}, randn(n, 73 + i)),
                    make(*be, DType::F32, {n}, std::vector<float>(n, 0.0f)),
                    make(*be, DType::F32, {n}, std::vector<float>(n, 0.0f)), i != 1, storage});
    }
    const std::vector<float> third_before = download_f32(*be, ts[2].param);
    be->adamw_update_group(ts, AdamWStep{.t = 2, .learning_rate = 1e-2, .config = {.weight_decay = 0.1}});
    for (int i = 0; i < 2; ++i) {
      const Tensor want = make(*be, ts[i].storage.dtype, {n});
      be->convert(want, ts[i].param);
      std::vector<std::byte> a(ts[i].storage.bytes()), b(want.bytes());
      be->copy_to_host(a.data(), ts[i].storage);
      be->copy_to_host(b.data(), want);
      EXPECT_EQ(a, b) << "tensor " << i;
    }
    EXPECT_NE(download_f32(*be, ts[2].param), third_before);
  }
}

TEST_F(VulkanOps, StepsDecidedOnTheDeviceEqualTheHostsDecisions) {
  // Four steps decided on the device, read late (two read and untaken at once), against the same
  // steps decided on the host: step 0 clipped, step 1 with a NaN gradient (skipped: nothing
  // changes), step 2 after a skip (the device must take the first candidate), step 3 after an
  // update (the second). The host's own path is the oracle: the same bits.
  if (!vk().decides_steps()) SKIP_OR_FAIL_WHERE_REQUIRED("this device has no float64 in shaders");
  const int64_t n0 = 70001, n1 = 513;
  struct Step {
    std::vector<float> g0, g1;
    AdamWStep skipped, counted;
  };
  auto adam = [](int64_t t, double lr) {
    return AdamWStep{.t = t, .learning_rate = lr, .config = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}};
  };
  std::vector<Step> steps;
  for (int k = 0; k < 4; ++k) steps.push_back({randn(n0, 40 + k), randn(n1, 50 + k), adam(1, 1e-3), adam(1, 1e-3)});
  steps[1].g1[7] = std::numeric_limits<float>::quiet_NaN();
  steps[1].counted = adam(2, 2e-3);
  steps[2].skipped = adam(2, 3e-3);
  steps[2].counted = adam(3, 4e-3);
  steps[3].skipped = adam(2, 5e-3);
  steps[3].counted = adam(3, 6e-3);
  const double max_norm = 50.0;  // below step 0's norm (about 265): clipped
  const std::vector<float> p0 = randn(n0, 60), p1 = randn(n1, 61);
  struct State {
    Tensor g[2], p[2], m[2], v[2];
  };
  auto state = [&] {
    State s;
    for (int i = 0; i < 2; ++i) {
      const int64_t n = i ? n1 : n0;
      s.g[i] = make(vk(), DType::F32, {n});
      s.p[i] = make(vk(), DType::F32, {n}, i ? p1 : p0);
      s.m[i] = make(vk(), DType::F32, {n}, std::vector<float>(static_cast<size_t>(n), 0.0f));
      s.v[i] = make(vk(), DType::F32, {n}, std::vector<float>(static_cast<size_t>(n), 0.0f));
    }
    return s;
  };
  auto tensors = [](const State& s) {
    return std::vector<Backend::AdamWTensor>{{s.p[0], s.g[0], s.m[0], s.v[0], true, {}},
                                             {s.p[1], s.g[1], s.m[1], s.v[1], false, {}}};
  };
  const float scale = 0.5f;
  // The host deciding: the norm comes back before the update.
  State h = state();
  std::vector<double> host_sumsq;
  bool previous_counted = false;
  for (const Step& st : steps) {
    upload_f32(vk(), h.g[0], st.g0);
    upload_f32(vk(), h.g[1], st.g1);
    const double sumsq = vk().scale_and_sum_squares(std::span(h.g, 2), scale);
    host_sumsq.push_back(sumsq);
    const double norm = std::sqrt(sumsq);
    const bool counted = std::isfinite(norm);
    if (counted) {
      AdamWStep a = previous_counted ? st.counted : st.skipped;
      a.grad_scale = static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
      vk().adamw_update_group(tensors(h), a);
    }
    previous_counted = counted;
  }
  EXPECT_TRUE(std::isnan(host_sumsq[1]));
  EXPECT_GT(std::sqrt(host_sumsq[0]), max_norm);
  // The device deciding, read late.
  State d = state();
  std::vector<Backend::StepReadback> got;
  for (size_t k = 0; k < steps.size(); ++k) {
    upload_f32(vk(), d.g[0], steps[k].g0);
    upload_f32(vk(), d.g[1], steps[k].g1);
    vk().decide_and_update(std::span(d.g, 2), scale, tensors(d), {max_norm, steps[k].skipped, steps[k].counted});
    vk().read_step();
    if (k >= 1) got.push_back(vk().take_step());
  }
  got.push_back(vk().take_step());
  ASSERT_EQ(got.size(), 4u);
  for (size_t k = 0; k < 4; ++k) {
    SCOPED_TRACE(k);
    EXPECT_EQ(got[k].counted, k != 1);
    if (k == 1)
      EXPECT_TRUE(std::isnan(got[k].sum_squares));
    else
      EXPECT_EQ(got[k].sum_squares, host_sumsq[k]);
    EXPECT_EQ(got[k].loss_sum, 0.0);
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(i);
    for (const auto& [a, b] : {std::pair{d.p[i], h.p[i]}, std::pair{d.m[i], h.m[i]}, std::pair{d.v[i], h.v[i]}}) {
      const std::vector<float> x = download_f32(vk(), a), y = download_f32(vk(), b);
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0);
    }
  }
  // A mutation check of the oracle's reach: the parameters moved (the steps were not all skipped).
  EXPECT_NE(download_f32(vk(), d.p[0]), p0);
}

TEST_F(VulkanOps, AnArenaBeyondOneAllocationIsRefusedNamingTheLimit) {
  const VulkanDevices found = vulkan_devices();
  const VulkanDeviceInfo& d = choose_vulkan_device(found, std::nullopt);
  const std::string error =
      testing_support::error_of([&] { vk().allocate(static_cast<size_t>(d.max_allocation_bytes) + (1 << 20)); });
  EXPECT_CONTAINS(error, "more than one allocation may hold");
  EXPECT_CONTAINS(error, d.name);
}

}  // namespace
}  // namespace memtune

namespace memtune {
namespace {

Tensor ints_on(Backend& be, std::vector<std::tuple<Backend*, void*, size_t>>& held, const std::vector<int32_t>& v,
               std::initializer_list<int64_t> shape) {
  void* p = be.allocate(std::max<size_t>(v.size() * sizeof(int32_t), 64));
  held.push_back({&be, p, std::max<size_t>(v.size() * sizeof(int32_t), 64)});
  Tensor t(p, DType::I32, shape);
  be.copy_to_device(t, v.data());
  return t;
}

// FlashAttention-2's tiling at the head dimensions real models use, each a pipeline of its own
// (64: 4 lanes, tiles of 32; 96 and 128: tiles of 16; 256: 8 lanes, tiles of 8; the key side
// always 8 lanes, 64 invocations), over three
// packed sequences whose borders fall inside query and key tiles (33, 1 and 36 tokens), with
// three query heads per kv head (the key side in one pass) and four (split over two shares of the
// group's heads, added by gemm_reduce): forward (out, lse) and backward (dq, dk, dv) equal the
// reference, and a second run gives the same bits.
TEST_F(VulkanOps, FlashAttentionAtRealHeadDimensionsEqualsTheReferenceBitForBitEveryRun) {
  const int64_t N = 70, Hkv = 2;
  const std::vector<int32_t> cu = {0, 33, 34, 70};
  for (const int64_t Hq : {6, 8})
  for (const int64_t hd : {64, 96, 128, 256}) {
    SCOPED_TRACE(fmt::format("{} query heads, head_dim {}", Hq, hd));
    EXPECT_EQ(vulkan_geometry::attention_key_splits({N, 3, Hq, Hkv, hd}, 8), Hq == 8 ? 2u : 1u);
    EXPECT_EQ(vulkan_geometry::attention_tiles(hd, true).lanes, 8u);
    EXPECT_EQ(vulkan_geometry::attention_tiles(hd, true).threads, 64u);
    const std::vector<float> q = randn(N * Hq * hd, 21), k = randn(N * Hkv * hd, 22), v = randn(N * Hkv * hd, 23),
                             dout = randn(N * Hq * hd, 24);
    auto run = [&](Backend& be) {
      std::vector<std::tuple<Backend*, void*, size_t>> held;
      const Tensor tq = make(be, DType::F32, {N, Hq * hd}, q), tk = make(be, DType::F32, {N, Hkv * hd}, k),
                   tv = make(be, DType::F32, {N, Hkv * hd}, v), tdout = make(be, DType::F32, {N, Hq * hd}, dout),
                   out = make(be, DType::F32, {N, Hq * hd}), lse = make(be, DType::F32, {N, Hq}),
                   dq = make(be, DType::F32, {N, Hq * hd}), dk = make(be, DType::F32, {N, Hkv * hd}),
                   dv = make(be, DType::F32, {N, Hkv * hd}), tcu = ints_on(be, held, cu, {4});
      be.attention_forward(out, lse, tq, tk, tv, tcu, hd);
      be.attention_backward(dq, dk, dv, tdout, out, lse, tq, tk, tv, tcu, hd);
      std::vector r{download_f32(be, out), download_f32(be, lse), download_f32(be, dq), download_f32(be, dk),
                    download_f32(be, dv)};
      for (auto [b, p, n] : held) b->deallocate(p, n);
      return r;
    };
    const auto got = run(vk()), again = run(vk()), want = run(ref());
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(names[i]);
      expect_close(got[i], want[i], 2e-5f);
      EXPECT_EQ(0, std::memcmp(got[i].data(), again[i].data(), got[i].size() * sizeof(float)));
    }
  }
}

// Decoding at a long context: the keys are split over workgroups (several splits, merged by a
// second pass) and the result equals the reference, for float32 and bfloat16 caches. Three
// sequences in a block table 1024 keys wide, scattered blocks: 700 tokens (one new), 5 (one new)
// and 300 (three new: a prefill chunk's rows, each at its own position). A workgroup serves a kv
// head's whole GQA group (each key read once for it): groups of 4 (head_dim 128), 7 (Qwen2.5-0.5B's
// 14 / 2, head_dim 64), 64 (two chunks of 32 query heads) and 1 (head_dim 256: 8 lanes a row).
TEST_F(VulkanOps, PagedAttentionSplitOverALongContextEqualsTheReference) {
  const int64_t block = 16, max_blocks = 64;
  const std::vector<int32_t> context = {700, 5, 300}, fresh = {1, 1, 3};
  // Blocks handed out from the top of a 120-block cache, so every table is scattered.
  std::vector<int32_t> tables(3 * max_blocks, 0), slots, cu = {0};
  int32_t next = 119;
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t b = 0; b * block < context[s]; ++b) tables[s * max_blocks + b] = next--;
    for (int32_t j = 0; j < context[s]; ++j)
      slots.push_back(tables[s * max_blocks + j / block] * static_cast<int32_t>(block) + j % block);
    cu.push_back(cu.back() + fresh[s]);
  }
  const int64_t T = static_cast<int64_t>(slots.size()), Q = cu.back(), cache_rows = 120 * block;
  for (const auto [Hq, Hkv, hd, chunks] : {std::array<int64_t, 4>{8, 2, 128, 1}, {14, 2, 64, 1}, {64, 1, 64, 2},
                                           {4, 4, 256, 1}}) {
    SCOPED_TRACE(fmt::format("{} query heads over {} kv heads, head_dim {}", Hq, Hkv, hd));
    const int64_t kvd = Hkv * hd;
    const vulkan_geometry::PagedAttention shape{
        .rows = Q, .q_heads = Hq, .kv_heads = Hkv, .head_dim = hd, .max_context = max_blocks * block};
    const vulkan_geometry::PagedSplit split = vulkan_geometry::paged_split(shape, vulkan_geometry::kScratchFloats);
    ASSERT_GT(split.splits, 1u);
    ASSERT_EQ(vulkan_geometry::paged_attention_chunks(shape), chunks);
    const std::vector<VulkanDispatch> d = vulkan_geometry::paged_attention(shape, vulkan_geometry::kScratchFloats);
    ASSERT_EQ(d.size(), 2u);
    EXPECT_EQ(d[0].x, Hkv * chunks * split.splits);
    const std::vector<float> q = randn(Q * Hq * hd, 31), k = randn(T * kvd, 32), v = randn(T * kvd, 33);
    for (const DType cache : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(dtype_torch_name(cache));
      auto run = [&](Backend& be) {
        std::vector<std::tuple<Backend*, void*, size_t>> held;
        const Tensor tq = make(be, DType::F32, {Q, Hq * hd}, q), tk = make(be, DType::F32, {T, kvd}, k),
                     tv = make(be, DType::F32, {T, kvd}, v), kc = make(be, cache, {cache_rows, kvd}),
                     vc = make(be, cache, {cache_rows, kvd}), out = make(be, DType::F32, {Q, Hq * hd});
        const Tensor tslots = ints_on(be, held, slots, {T}), ttables = ints_on(be, held, tables, {3, max_blocks}),
                     tcu = ints_on(be, held, cu, {4}), tctx = ints_on(be, held, context, {3});
        be.kv_cache_write(kc, vc, tk, tv, tslots);
        be.paged_attention_forward(out, tq, kc, vc, ttables, tcu, tctx, hd, block);
        auto r = download_f32(be, out);
        for (auto [b, p, n] : held) b->deallocate(p, n);
        return r;
      };
      expect_close(run(vk()), run(ref()), 2e-5f);
    }
  }
}

// More rows than one grid dimension takes (65,535 workgroups: Qwen3's per-head q/k norm at 4,096
// tokens x 16 heads has 65,536): the norms' rows continue over y, paged attention's over z;
// every row equals the reference.
// 65,600 rows of 8 (the norms); 4,100 sequences of 16 new tokens each, one block apiece, head
// dimension 64 (attention).
TEST_F(VulkanOps, NormRowsBeyondOneGridDimensionAreAllComputed) {
  const int64_t N = 65600, C = 8;
  ASSERT_EQ(vulkan_geometry::rmsnorm(N, C, false).x, vulkan_geometry::kMaxGroups);
  ASSERT_EQ(vulkan_geometry::rmsnorm(N, C, false).y, 2u);
  const std::vector<float> x = randn(N * C, 51), w = randn(C, 52), dy = randn(N * C, 53), add = randn(N * C, 54);
  auto norms = [&](Backend& be) {
    const Tensor tx = make(be, DType::F32, {N, C}, x), tw = make(be, DType::F32, {C}, w),
                 out = make(be, DType::F32, {N, C}), rstd = make(be, DType::F32, {N}),
                 tdy = make(be, DType::F32, {N, C}, dy), dx = make(be, DType::F32, {N, C}, add),
                 dw = make(be, DType::F32, {C}), res = make(be, DType::F32, {N, C}, x),
                 tadd = make(be, DType::F32, {N, C}, add), normed = make(be, DType::F32, {N, C}),
                 rstd_res = make(be, DType::F32, {N});
    be.rmsnorm_forward(out, rstd, tx, tw, 1e-6f);
    be.rmsnorm_backward(dx, dw, tdy, tx, tw, rstd);
    be.add_rmsnorm_forward(normed, rstd_res, res, tadd, tw, 1e-6f);
    return std::vector{download_f32(be, out), download_f32(be, rstd), download_f32(be, dx), download_f32(be, dw),
                       download_f32(be, res), download_f32(be, normed), download_f32(be, rstd_res)};
  };
  const auto got = norms(vk()), want = norms(ref());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(fmt::format("norm output {}", i));
    expect_close(got[i], want[i], i == 3 ? 1e-4f : 2e-5f);  // dw: a sum over 65,600 rows
  }
}
TEST_F(VulkanOps, QueryRowsBeyondOneGridDimensionAreAllAttended) {

  const int64_t block = 16, S = 4100, Q = S * block, hd = 64;
  const vulkan_geometry::PagedAttention shape{.rows = Q, .q_heads = 1, .kv_heads = 1, .head_dim = hd, .max_context = block};
  const VulkanDispatch paged = vulkan_geometry::paged_attention(shape, vulkan_geometry::kScratchFloats).at(0);
  ASSERT_EQ(paged.y, vulkan_geometry::kMaxGroups);
  ASSERT_EQ(paged.z, 2u);
  std::vector<int32_t> tables(S), slots(Q), cu(S + 1), context(S, static_cast<int32_t>(block));
  for (int32_t s = 0; s < S; ++s) {
    tables[s] = static_cast<int32_t>(S - 1 - s);  // scattered: from the top of the cache
    cu[s + 1] = static_cast<int32_t>((s + 1) * block);
    for (int32_t j = 0; j < block; ++j) slots[s * block + j] = tables[s] * static_cast<int32_t>(block) + j;
  }
  const std::vector<float> q = randn(Q * hd, 55), k = randn(Q * hd, 56), v = randn(Q * hd, 57);
  auto attention = [&](Backend& be) {
    std::vector<std::tuple<Backend*, void*, size_t>> held;
    const Tensor tq = make(be, DType::F32, {Q, hd}, q), tk = make(be, DType::F32, {Q, hd}, k),
                 tv = make(be, DType::F32, {Q, hd}, v), kc = make(be, DType::F32, {Q, hd}),
                 vc = make(be, DType::F32, {Q, hd}), out = make(be, DType::F32, {Q, hd});
    const Tensor tslots = ints_on(be, held, slots, {Q}), ttables = ints_on(be, held, tables, {S, 1}),
                 tcu = ints_on(be, held, cu, {S + 1}), tctx = ints_on(be, held, context, {S});
    be.kv_cache_write(kc, vc, tk, tv, tslots);
    be.paged_attention_forward(out, tq, kc, vc, ttables, tcu, tctx, hd, block);
    auto r = download_f32(be, out);
    for (auto [b, p, n] : held) b->deallocate(p, n);
    return r;
  };
  expect_close(attention(vk()), attention(ref()), 2e-5f);
}

// Where the context puts a barrier (VulkanContext::needs_barrier): before a command that reads
// what one since the last barrier wrote, writes what one wrote or read, or states nothing (or
// after such a command); never between readers of one range or commands on disjoint ranges.
TEST(VulkanBarriers, OnlyWhereACommandMeetsAnEarlierWrite) {
  using A = VulkanContext::Access;
  const std::vector<A> pending = {{1000, 100, false}, {2000, 100, true}};
  auto needs = [&](std::vector<A> next, bool unstated = false, bool pending_unstated = false) {
    return VulkanContext::needs_barrier(pending, pending_unstated, next, unstated);
  };
  EXPECT_FALSE(needs({{1000, 100, false}}));             // read after read
  EXPECT_TRUE(needs({{1050, 10, true}}));                // write after read
  EXPECT_TRUE(needs({{2099, 1, false}}));                // read after write (its last byte)
  EXPECT_TRUE(needs({{1990, 20, true}}));                // write after write, overlapping
  EXPECT_FALSE(needs({{2100, 50, true}, {0, 1000, true}}));  // disjoint: touching ends only
  EXPECT_FALSE(needs({{3000, 8, false}, {1000, 8, false}}));
  EXPECT_TRUE(needs({}, /*unstated=*/true));             // states nothing
  EXPECT_TRUE(needs({{5000, 4, false}}, false, /*pending_unstated=*/true));
  EXPECT_FALSE(VulkanContext::needs_barrier({}, false, {}, /*unstated=*/true));  // nothing since the last
}

// A dispatch handed a device address it does not state is refused before it is recorded: its
// shader could read or write memory no barrier orders.
TEST_F(VulkanOps, ADispatchHandedAnAddressItDoesNotStateIsRefused) {
  VulkanContext ctx;
  const uint64_t y = ctx.allocate(1024), x = ctx.allocate(1024);
  struct {
    uint64_t y, x;
    uint32_t n;
  } push{y, x, 256};
  const VulkanDispatch d = vulkan_geometry::elementwise("add_inplace", 256, 12);
  EXPECT_THROW(ctx.dispatch(d, push, {{y, 1024, true}}), InternalError);
  EXPECT_NO_THROW(ctx.dispatch(d, push, {{y, 1024, true}, {x, 1024, false}}));
  ctx.flush();
  ctx.deallocate(x);
  ctx.deallocate(y);
}

// Commands recorded under a key run again over the memory as it is when they are replayed, with
// the counts of their first run; another key, or any key after memory is freed, has nothing to
// replay; nothing reaches host memory while commands are recorded; and the check mode refuses a key
// whose commands differ from its recording.
TEST_F(VulkanOps, RecordedCommandsRunAgainOverTheMemoryAsItIsNow) {
  VulkanContext ctx;
  ctx.set_reuse(VulkanContext::Reuse::On);
  const uint32_t n = 300;
  const size_t bytes = n * sizeof(float);
  const uint64_t y = ctx.allocate(bytes), x = ctx.allocate(bytes);
  const std::vector<float> a = randn(n, 1), b = randn(n, 2), c = randn(n, 3);
  struct {
    uint64_t y, x;
    uint32_t n;
  } push{y, x, n};
  const VulkanDispatch add = vulkan_geometry::elementwise("add_inplace", n, 12);
  auto y_plus_x_twice = [&] {
    ctx.dispatch(add, push, {{y, bytes, true}, {x, bytes, false}});
    ctx.dispatch(add, push, {{y, bytes, true}, {x, bytes, false}});
  };
  auto download = [&] {
    std::vector<float> out(n);
    ctx.download(out.data(), y, bytes);
    return out;
  };
  auto expect = [&](const std::vector<float>& got, const std::vector<float>& x1, const std::vector<float>& x2) {
    for (uint32_t i = 0; i < n; ++i) {
      float want = a[i];
      for (const float v : {x1[i], x1[i], x2[i], x2[i]}) want += v;  // the shader's order of additions
      ASSERT_EQ(got[i], want) << i;
    }
  };
  const std::vector<float> zeros(n, 0.0f);
  const std::vector<int64_t> key = {7, n};
  ctx.upload(y, a.data(), bytes);
  ctx.upload(x, b.data(), bytes);
  const VulkanContext::Counters first = ctx.counters();
  ctx.begin_commands(key);
  y_plus_x_twice();
  EXPECT_THROW(ctx.upload(x, c.data(), bytes), InternalError);
  EXPECT_THROW(ctx.download(std::vector<float>(n).data(), y, bytes), InternalError);
  ctx.end_commands();
  expect(download(), b, zeros);
  const VulkanContext::Counters second = ctx.counters();
  ctx.upload(x, c.data(), bytes);
  ASSERT_TRUE(ctx.replay(key));
  expect(download(), b, c);
  const VulkanContext::Counters third = ctx.counters();
  EXPECT_EQ(third.dispatches - second.dispatches, 2u);
  EXPECT_EQ(third.dispatches - second.dispatches, second.dispatches - first.dispatches);
  EXPECT_EQ(third.barriers - second.barriers, second.barriers - first.barriers);
  EXPECT_EQ(third.replayed_dispatches - second.replayed_dispatches, 2u);
  EXPECT_EQ(third.replayed_command_buffers - second.replayed_command_buffers, 1u);
  EXPECT_EQ(second.replayed_dispatches, 0u);
  EXPECT_FALSE(ctx.replay(std::vector<int64_t>{8, n}));
  ctx.deallocate(ctx.allocate(256));
  EXPECT_FALSE(ctx.replay(key));
  ctx.set_reuse(VulkanContext::Reuse::Check);
  ctx.begin_commands(key);
  y_plus_x_twice();
  ctx.end_commands();
  EXPECT_FALSE(ctx.replay(key));  // the check records every time
  ctx.begin_commands(key);
  y_plus_x_twice();
  EXPECT_NO_THROW(ctx.end_commands());
  ctx.begin_commands(key);
  y_plus_x_twice();
  ctx.dispatch(add, push, {{y, bytes, true}, {x, bytes, false}});
  EXPECT_THROW(ctx.end_commands(), InternalError);
  ctx.flush();
  ctx.deallocate(x);
  ctx.deallocate(y);
}

// The cooperative-matrix variants (gemm_coopmat.comp), on a device whose VK_KHR_cooperative_matrix
// has float16 x float16 -> float32 in subgroup scope (Mesa 26's lavapipe: 8 x 8 x 8; CI runs these
// in the Debian sid root of scripts/coopmat-root.sh). Elsewhere they say why they cannot run
// (a build without the shader, a device without the extension): a skip, or a failure where every
// test is required, so the release tests on a device without them exclude VulkanCoopmat.
class VulkanCoopmat : public VulkanOps {
 protected:
  void SetUp() override {
    VulkanOps::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    std::string why = "no usable Vulkan device";
    for (const VulkanDeviceInfo& d : vulkan_devices().devices)
      if (d.usable() && cooperative_product_shape(d, DType::F16, &why)) return;
    SKIP_OR_FAIL_WHERE_REQUIRED("no float16 cooperative-matrix products here: " + why);
  }
};

// `memtune devices` names the shapes the driver reports and the kernel each family takes; the
// backend offers float16 products (so --fp16 is mixed precision) and no bfloat16 ones (no variant).
TEST_F(VulkanCoopmat, TheDeviceListsItsShapesAndTheKernelsThatUseThem) {
  const VulkanDevices found = vulkan_devices();
  const nlohmann::json j = vulkan_device_json(choose_vulkan_device(found, std::nullopt));
  ASSERT_FALSE(j.at("cooperative_matrix_shapes").empty());
  bool f16 = false;
  for (const auto& s : j.at("cooperative_matrix_shapes"))
    f16 |= s.at("a") == "float16" && s.at("b") == "float16" && s.at("result") == "float32" && s.at("scope") == "subgroup";
  EXPECT_TRUE(f16);
  const std::string kernel = j.at("kernels").at("float16 products (--fp16)");
  EXPECT_NE(kernel.find("gemm_coopmat.comp"), std::string::npos) << kernel;
  EXPECT_NE(vk().sixteen_bit_products(DType::F16).find("cooperative matrices"), std::string::npos);
  EXPECT_TRUE(vk().sixteen_bit_products(DType::BF16).empty());
}

// float16 products against the reference's exact products of the same float16 operands (summed
// in float64): forward with and without a bias, and backward (dinp, dweight, and the bias gradient of
// the float16 output gradient), at a ragged 32 x 32-tile shape, a 64 x 64-tile shape and a
// split-K shape; a second run gives the same bits.
TEST_F(VulkanCoopmat, FloatSixteenProductsEqualTheReferenceInEveryTilingAndRepeatBitForBit) {
  struct Shape {
    int64_t N, C, OC;
    uint32_t tile, splits;
  };
  for (const Shape& sh : {Shape{37, 96, 80, 32, 1}, Shape{1536, 40, 1472, 64, 1}, Shape{24, 2048, 40, 32, 8}}) {
    const auto [N, C, OC, tile, splits] = sh;
    SCOPED_TRACE(fmt::format("{} x {} over {}", N, OC, C));
    const vulkan_geometry::GemmSplit split = vulkan_geometry::gemm_split(N, OC, C, vulkan_geometry::kScratchFloats);
    ASSERT_EQ(std::min<uint32_t>(split.tile, 64), tile);
    ASSERT_EQ(split.splits, splits);
    const std::vector<float> x = randn(N * C, 61), w = randn(OC * C, 62), b = randn(OC, 63), dy = randn(N * OC, 64),
                             prior = randn(N * OC, 65);
    auto run = [&](Backend& be) {
      const Tensor tx = make(be, DType::F16, {N, C}, x), tw = make(be, DType::F16, {OC, C}, w),
                   tb = make(be, DType::F32, {OC}, b), out = make(be, DType::F32, {N, OC}),
                   plain = make(be, DType::F32, {N, OC}, prior), tdy = make(be, DType::F16, {N, OC}, dy),
                   dx = make(be, DType::F32, {N, C}, std::vector<float>(x.size(), 0.25f)),
                   dw = make(be, DType::F32, {OC, C}), db = make(be, DType::F32, {OC});
      be.matmul_forward(out, tx, tw, tb);
      be.matmul_forward(plain, tx, tw, Tensor{});
      be.matmul_backward(dx, dw, db, tdy, tx, tw, 1.0f);
      return std::vector{download_f32(be, out), download_f32(be, plain), download_f32(be, dx), download_f32(be, dw),
                         download_f32(be, db)};
    };
    const auto got = run(vk()), again = run(vk()), want = run(ref());
    const char* names[] = {"out", "out without a bias", "dinp", "dweight", "dbias"};
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(names[i]);
      expect_close(got[i], want[i], 5e-5f);  // float32 accumulation in the units' order: 2e-5 measured
      EXPECT_EQ(0, std::memcmp(got[i].data(), again[i].data(), got[i].size() * sizeof(float)));
    }
  }
}

// The MLP's gate and up over many rows of float16 operands (mixed-precision training) in one
// gemm_coopmat.comp pass that also writes h = silu(gate) * up (matmul_forward_group_swiglu): gate,
// up and h are the bits of the two products and swiglu.comp after them where those run unsplit
// (a ragged 32-tile shape, a 64-tile one), and within the products' bound where the products
// alone would split K (the pass never does); with and without biases; against the reference's
// products of the same float16 operands; one dispatch, no swiglu or gemm_reduce pass.
TEST_F(VulkanCoopmat, GateUpAndTheActivationInOnePassEqualTheProductsThenSwiglu) {
  struct Shape {
    int64_t N, C, I;
  };
  const auto count = [](const std::map<std::string, uint64_t>& m, const char* shader) {
    const auto it = m.find(shader);
    return it == m.end() ? uint64_t{0} : it->second;
  };
  for (const Shape& sh : {Shape{37, 96, 80}, Shape{1536, 40, 1472}, Shape{24, 2048, 40}})
    for (const bool bias : {false, true}) {
      const auto [N, C, I] = sh;
      SCOPED_TRACE(fmt::format("{} x {} over {}, {}", N, I, C, bias ? "biases" : "no biases"));
      const bool split = vulkan_geometry::gemm_split(N, I, C, vulkan_geometry::kScratchFloats).splits > 1;
      ASSERT_EQ(split, C == 2048);
      const std::vector<float> x = randn(N * C, 71), wg = randn(I * C, 72), wu = randn(I * C, 73),
                               bg = randn(I, 74), bu = randn(I, 75);
      // gate, up and h: in one pass (fused) or one by one (apart)
      auto run = [&](Backend& be, bool fused) {
        const Tensor tx = make(be, DType::F16, {N, C}, x), tg = make(be, DType::F16, {I, C}, wg),
                     tu = make(be, DType::F16, {I, C}, wu), tbg = bias ? make(be, DType::F32, {I}, bg) : Tensor{},
                     tbu = bias ? make(be, DType::F32, {I}, bu) : Tensor{}, h = make(be, DType::F32, {N, I});
        const std::array<GroupMember, 2> gate_up{GroupMember{make(be, DType::F32, {N, I}), tg, tbg, nullptr, Tensor{}},
                                                 GroupMember{make(be, DType::F32, {N, I}), tu, tbu, nullptr, Tensor{}}};
        if (fused) {
          be.matmul_forward_group_swiglu(gate_up, tx, Tensor{}, h);
        } else {
          for (const GroupMember& m : gate_up) be.matmul_forward(m.out, tx, m.weight, m.bias);
          be.swiglu_forward(h, gate_up[0].out, gate_up[1].out);
        }
        return std::vector{download_f32(be, gate_up[0].out), download_f32(be, gate_up[1].out), download_f32(be, h)};
      };
      const std::map<std::string, uint64_t> before = vk().dispatches_by_shader();
      const auto fused = run(vk(), true);
      const std::map<std::string, uint64_t> after = vk().dispatches_by_shader();
      EXPECT_EQ(count(after, "gemm_coopmat"), count(before, "gemm_coopmat") + 1);
      EXPECT_EQ(count(after, "swiglu"), count(before, "swiglu"));
      EXPECT_EQ(count(after, "gemm_reduce"), count(before, "gemm_reduce"));
      const auto apart = run(vk(), false), want = run(ref(), false);
      const char* names[] = {"gate", "up", "h"};
      for (size_t i = 0; i < fused.size(); ++i) {
        SCOPED_TRACE(names[i]);
        if (!split) {
          EXPECT_EQ(fused[i], apart[i]);
        }
        if (i == 2) continue;
        if (split) expect_close(fused[i], apart[i], 5e-5f);
        expect_close(fused[i], want[i], 5e-5f);
      }
      // h = silu(g) u within what gate's and up's bound carries through it: |silu'| <= 1.1.
      for (const auto* other : {&apart, &want})
        for (size_t e = 0; e < fused[2].size(); ++e) {
          const double g = std::abs((*other)[0][e]), u = std::abs((*other)[1][e]);
          ASSERT_NEAR(fused[2][e], (*other)[2][e], 5e-5 * (1.1 * (1 + g) * u + (1 + g) * (1 + u))) << "h, element " << e;
        }
    }
}

// FlashAttention-2 with its products on the matrix units (attention_coopmat.comp and its backward
// passes): float16 operands asked for at head dimensions 64 (tiles of 32 / 32 / 32 rows on
// lavapipe) and 128 (16 / 16 / 16), three packed sequences whose borders fall inside tiles, three
// query heads per kv head and four (the dk/dv pass split over two shares of them). Forward (out,
// lse) and backward (dq, dk, dv) equal the reference at the same float16 rounding points; a
// second run gives the same bits; and the rounding is there: the float32 reference is further
// away than the bound. On a device with VK_NV_cooperative_matrix2's flexible matrices (Mesa 26's
// lavapipe has them) head_dim 64 runs twice: on those (attention_coopmat2.glsl's three passes, the
// softmax and the scores' gradient on the matrices, the results in registers; tiles of 32 rows),
// and with MEMTUNE_VULKAN_COOPMAT2=0 on the KHR shaders; head_dim 128 runs on the KHR shaders
// only (their tiles of 16 rows): the flexible passes' code differs between the two head
// dimensions only in its specialization constants, and lavapipe takes minutes to compile them at
// 128 (TrainCliTest's --fp16 run takes them at head_dim 16). The dispatch counts say which ran.
TEST_F(VulkanCoopmat, FlashAttentionOnTheMatrixUnitsEqualsTheReferenceAtFloat16RoundingPoints) {
  const int64_t N = 77, Hkv = 2;
  const std::vector<int32_t> cu = {0, 33, 34, 77};
  ASSERT_FALSE(vk().sixteen_bit_attention(DType::F16).empty());
  EXPECT_TRUE(vk().sixteen_bit_attention(DType::BF16).empty());
  const bool flexible = vk().sixteen_bit_attention(DType::F16).find("attention_coopmat2") != std::string::npos;
  for (const int64_t Hq : {6, 8})
  for (const int64_t hd : {64, 128}) {
    SCOPED_TRACE(fmt::format("{} query heads, head_dim {}", Hq, hd));
    EXPECT_EQ(vulkan_geometry::attention_key_splits({N, 3, Hq, Hkv, hd}, 16), Hq == 8 ? 2u : 1u);
    const std::vector<float> q = randn(N * Hq * hd, 71), k = randn(N * Hkv * hd, 72), v = randn(N * Hkv * hd, 73),
                             dout = randn(N * Hq * hd, 74);
    auto run = [&](Backend& be, DType operands) {
      std::vector<std::tuple<Backend*, void*, size_t>> held;
      const Tensor tq = make(be, DType::F32, {N, Hq * hd}, q), tk = make(be, DType::F32, {N, Hkv * hd}, k),
                   tv = make(be, DType::F32, {N, Hkv * hd}, v), tdout = make(be, DType::F32, {N, Hq * hd}, dout),
                   out = make(be, DType::F32, {N, Hq * hd}), lse = make(be, DType::F32, {N, Hq}),
                   dq = make(be, DType::F32, {N, Hq * hd}), dk = make(be, DType::F32, {N, Hkv * hd}),
                   dv = make(be, DType::F32, {N, Hkv * hd}), tcu = ints_on(be, held, cu, {4});
      be.attention_forward(out, lse, tq, tk, tv, tcu, hd, operands);
      be.attention_backward(dq, dk, dv, tdout, out, lse, tq, tk, tv, tcu, hd, operands);
      std::vector r{download_f32(be, out), download_f32(be, lse), download_f32(be, dq), download_f32(be, dk),
                    download_f32(be, dv)};
      for (auto [b, p, n] : held) b->deallocate(p, n);
      return r;
    };
    // The passes' shaders: where the device has flexible matrices, coopmat2's run first.
    const std::vector<std::string> khr = {"attention_coopmat", "attention_backward_dq_coopmat",
                                          "attention_backward_dkv_coopmat"},
                                   flexible_passes = {"attention_coopmat2", "attention_backward_dq_coopmat2",
                                                      "attention_backward_dkv_coopmat2"};
    std::vector<bool> variants = {false};
    if (flexible && hd == 64) variants.insert(variants.begin(), true);
    const auto want = run(ref(), DType::F16), exact = run(ref(), DType::F32);
    for (const bool on_flexible : variants) {
      const std::string forward = on_flexible ? "attention_coopmat2" : "attention_coopmat";
      SCOPED_TRACE(forward);
      if (!on_flexible && flexible) {  // (and head_dim 128 takes the KHR shaders too)
        ASSERT_EQ(setenv("MEMTUNE_VULKAN_COOPMAT2", "0", 1), 0);
      }
      const std::map<std::string, uint64_t> before = vk().dispatches_by_shader();
      const auto got = run(vk(), DType::F16), again = run(vk(), DType::F16);
      std::map<std::string, uint64_t> ran = vk().dispatches_by_shader();
      unsetenv("MEMTUNE_VULKAN_COOPMAT2");
      for (auto& [shader, count] : ran) count -= before.count(shader) ? before.at(shader) : 0;
      for (const std::string& shader : on_flexible ? flexible_passes : khr) EXPECT_EQ(ran[shader], 2u) << shader;
      for (const std::string& shader : on_flexible ? khr : flexible_passes) EXPECT_EQ(ran[shader], 0u) << shader;
      const char* names[] = {"out", "lse", "dq", "dk", "dv"};
      for (size_t i = 0; i < got.size(); ++i) {
        SCOPED_TRACE(names[i]);
        const testing_support::Difference rounded = testing_support::difference(got[i], want[i]),
                                          unrounded = testing_support::difference(got[i], exact[i]);
        std::printf("%s, head_dim %ld %s: %s from the float16 reference, %s from the float32 one\n", forward.c_str(),
                    long(hd), names[i],
                    rounded.describe().c_str(), unrounded.describe().c_str());
        // A few float16 roundings (2^-11) apart, within 1e-3 of (1 + |want|): up to 1.3e-3 measured
        // (dq at head_dim 128, |want| 1.5). The float32 reference is 1.3e-3 to 3.1e-3 away (lse:
        // 4.8e-7 against 5.5e-4), where float32 operands come within 2e-5 of it
        // (FlashAttentionAtRealHeadDimensions...): the rounding is there.
        expect_close(got[i], want[i], 1e-3f);
        EXPECT_GT(unrounded.worst, 1e-4);
        EXPECT_EQ(0, std::memcmp(got[i].data(), again[i].data(), got[i].size() * sizeof(float)));
      }
    }
  }
  if (!flexible)
    SKIP_OR_FAIL_WHERE_REQUIRED("no attention on VK_NV_cooperative_matrix2's flexible matrices here: " +
                                vk().sixteen_bit_attention(DType::F16));
}

// Quantized products of many rows with int8 activations on the int8 matrix units
// (quantized_matmul_int8_coopmat.comp): 4-bit codes in groups of 64 (blocks of 64) and 8-bit in
// groups of 128 (blocks of 128), 45 rows and 70 outputs (ragged 32 x 32 tiles), with and without
// a bias, equal the reference's products of the same rounded input (int8_activations.h) and
// repeat bit for bit; 16 rows (decoding) keep float32 inputs and the scalar shader.
TEST_F(VulkanCoopmat, QuantizedProductsOfManyRowsTakeTheInt8Units) {
  std::string why;
  bool int8 = false;
  for (const VulkanDeviceInfo& d : vulkan_devices().devices) int8 |= d.usable() && cooperative_int8_shape(d, &why);
  ASSERT_TRUE(int8) << why;
  ASSERT_TRUE(vk().takes_int8_activations());
  const int64_t IN = 256, OUT = 70;
  for (const auto [bits, group, N] : {std::array<int64_t, 3>{4, 64, 45}, {8, 128, 45}, {4, 64, 16}}) {
    SCOPED_TRACE(fmt::format("{}-bit codes, groups of {}, {} rows", bits, group, N));
    const int64_t per_word = 32 / bits, groups = IN / group;
    Rng rng(90 + bits + N);
    std::vector<int32_t> codes(static_cast<size_t>(OUT * IN / per_word), 0);
    for (int64_t n = 0; n < OUT; ++n)
      for (int64_t k = 0; k < IN; ++k) {
        const auto q = static_cast<uint32_t>(rng.uniform() * double(1 << bits)) & ((1u << bits) - 1u);
        auto& word = codes[static_cast<size_t>(n * (IN / per_word) + k / per_word)];
        word = static_cast<int32_t>(static_cast<uint32_t>(word) | (q << (bits * (k % per_word))));
      }
    std::vector<float> scales, zeros;
    for (int64_t i = 0; i < OUT * groups; ++i) {
      scales.push_back(static_cast<float>(0.005 + 0.02 * rng.uniform()));
      zeros.push_back(std::floor(static_cast<float>(rng.uniform() * double(1 << bits))));
    }
    const std::vector<float> x = randn(N * IN, 91), b = randn(OUT, 92);
    auto run = [&](Backend& be) {
      QuantizedWeight w;
      w.codes = make(be, DType::I32, {OUT, IN / per_word});
      be.copy_to_device(w.codes, codes.data());
      w.scales = make(be, DType::F16, {OUT, groups}, scales);
      w.zeros = make(be, DType::F16, {OUT, groups}, zeros);
      w.bits = static_cast<int>(bits);
      w.in = IN;
      w.out = OUT;
      w.group_size = group;
      w.groups = groups;
      w.int8_activations = true;
      const Tensor tx = make(be, DType::F32, {N, IN}, x), tb = make(be, DType::F32, {OUT}, b),
                   with_bias = make(be, DType::F32, {N, OUT}), plain = make(be, DType::F32, {N, OUT});
      be.quantized_matmul_forward(with_bias, tx, w, tb, Tensor{});
      be.quantized_matmul_forward(plain, tx, w, Tensor{}, Tensor{});
      return std::vector{download_f32(be, with_bias), download_f32(be, plain)};
    };
    const std::map<std::string, uint64_t> before = vk().dispatches_by_shader();
    const auto got = run(vk()), again = run(vk()), want = run(ref());
    const std::map<std::string, uint64_t> after = vk().dispatches_by_shader();
    const auto count = [](const std::map<std::string, uint64_t>& m, const char* shader) {
      const auto it = m.find(shader);
      return it == m.end() ? uint64_t{0} : it->second;
    };
    const uint64_t on_units = count(after, "quantized_matmul_int8_coopmat") - count(before, "quantized_matmul_int8_coopmat");
    EXPECT_EQ(on_units, N > 16 ? 4u : 0u);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(testing_support::close(got[i], want[i], testing_support::relative_tolerance(1e-5))) << i;
      EXPECT_EQ(0, std::memcmp(got[i].data(), again[i].data(), got[i].size() * sizeof(float)));
    }
  }
}

// Products large enough for gemm.comp's bigger tiles (smaller ones take 32 x 32 to give the
// device more workgroups), for every weight dtype: 1536 x 1472 outputs over K = 20 take 64 x 64
// tiles, 2945 x 2689 over K = 24 take 128 x 128 with a ragged edge each way (float32 and
// bfloat16 weights there: float16 takes float32's tile). K = 20 lets float32 operands load 128
// bits at a time, K = 24 bfloat16 weights too (eight values along K); both take several K steps.
TEST_F(VulkanOps, LargeProductsTakeTheBigTilesAndEqualTheReference) {
  ASSERT_EQ(vulkan_geometry::gemm_split(70, 131, 20, vulkan_geometry::kScratchFloats).tile, 32u);
  for (const auto [N, C, OC, tile] : {std::array<int64_t, 4>{1536, 20, 1472, 64}, {2945, 24, 2689, 128}}) {
    ASSERT_EQ(vulkan_geometry::gemm_split(N, OC, C, vulkan_geometry::kScratchFloats).tile, tile);
    const std::vector<float> x = randn(N * C, 41), w = randn(OC * C, 42), b = randn(OC, 43), prior = randn(N * OC, 44);
    for (const DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      if (tile == 128 && dtype == DType::F16) continue;
      SCOPED_TRACE(fmt::format("{} x {} over {}, {}", N, OC, C, dtype_torch_name(dtype)));
      // out = inp @ W^T: A and B both along K.
      EXPECT_EQ(vulkan_geometry::gemm_vector_loads(C, 1, N, C, 0, DType::F32), 1u);
      EXPECT_EQ(vulkan_geometry::gemm_vector_loads(C, 1, OC, C, 0, dtype),
                dtype == DType::F32 || (dtype == DType::BF16 && C % 8 == 0) ? 1u : 0u);
      const auto got = linear_products(vk(), dtype, N, C, OC, x, w, b, prior),
                 want = linear_products(ref(), dtype, N, C, OC, x, w, b, prior);
      expect_close(got[0], want[0], 1e-5f);
      expect_close(got[1], want[1], 1e-5f);
    }
  }
}

// The optimizer's multi-tensor dispatches over more tensors than one table holds (1024): 1500
// tensors of 1 to 300 elements, views into four allocations, weight decay on every other one.
// The gradient norm (with the scaling) and AdamW over all of them in one call equal the
// reference's tensor-by-tensor updates.
TEST_F(VulkanOps, TheOptimizerOverMoreTensorsThanOneTableEqualsTheReference) {
  const int64_t count = 1500;
  std::vector<int64_t> sizes, offsets = {0};
  for (int64_t i = 0; i < count; ++i) {
    sizes.push_back(1 + (i * 37) % 300);
    offsets.push_back(offsets.back() + sizes.back());
  }
  const int64_t total = offsets.back();
  const std::vector<float> g = randn(total, 61), p0 = randn(total, 62), m0 = randn(total, 63);
  std::vector<float> v0 = randn(total, 64);
  for (float& x : v0) x = x * x;
  auto run = [&](Backend& be) {
    const Tensor all[4] = {make(be, DType::F32, {total}, g), make(be, DType::F32, {total}, p0),
                           make(be, DType::F32, {total}, m0), make(be, DType::F32, {total}, v0)};
    auto view = [&](int k, int64_t i) {
      return Tensor(static_cast<char*>(all[k].data) + offsets[static_cast<size_t>(i)] * sizeof(float), DType::F32,
                    {sizes[static_cast<size_t>(i)]});
    };
    std::vector<Tensor> grads;
    std::vector<Backend::AdamWTensor> tensors;
    for (int64_t i = 0; i < count; ++i) {
      grads.push_back(view(0, i));
      tensors.push_back({view(1, i), view(0, i), view(2, i), view(3, i), i % 2 == 0, {}});
    }
    const double sumsq = be.scale_and_sum_squares(grads, 0.5f);
    AdamWStep step;
    step.t = 2;
    step.learning_rate = 1e-2;
    step.config = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    step.grad_scale = 0.7f;
    be.adamw_update_group(tensors, step);
    return OptimizerResult{sumsq, download_f32(be, all[1]), download_f32(be, all[2]), download_f32(be, all[3])};
  };
  expect_same_update(run(vk()), run(ref()));
}

// A group of tensors filled by one dispatch per table of 1024 (fill_tensors.comp): 1500 views of
// 1 to 300 floats with a gap of one float after each; every view holds the value, every gap what
// it held, as the reference leaves them; two dispatches in all.
TEST_F(VulkanOps, AGroupOfTensorsIsFilledByOneDispatchPerTable) {
  const int64_t count = 1500;
  std::vector<int64_t> sizes, offsets = {0};
  for (int64_t i = 0; i < count; ++i) {
    sizes.push_back(1 + (i * 37) % 300);
    offsets.push_back(offsets.back() + sizes.back() + 1);
  }
  const std::vector<float> before = randn(offsets.back(), 81);
  auto run = [&](Backend& be, uint64_t* dispatches) {
    const Tensor all = make(be, DType::F32, {offsets.back()}, before);
    std::vector<Tensor> views;
    for (int64_t i = 0; i < count; ++i) views.push_back(all.flat_range(offsets[i], sizes[i]));
    const uint64_t first = be.device_counters() ? be.device_counters()->dispatches : 0;
    be.fill_group(views, -2.5f);
    if (dispatches) *dispatches = be.device_counters()->dispatches - first;
    return download_f32(be, all);
  };
  uint64_t dispatches = 0;
  const std::vector<float> got = run(vk(), &dispatches), want = run(ref(), nullptr);
  EXPECT_EQ(dispatches, 2u);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
  for (int64_t i = 0; i < count; ++i) {
    EXPECT_EQ(want[offsets[i]], -2.5f);
    EXPECT_EQ(want[offsets[i + 1] - 1], before[offsets[i + 1] - 1]);
  }
}

// Column sums in two passes over blocks of rows: RMSNorm's weight gradient and a bias gradient
// over 300 rows (19 blocks of 16), added into what the gradients held; the reference's, and the
// same bits twice.
TEST_F(VulkanOps, ColumnSumsOverManyRowsEqualTheReference) {
  const int64_t N = 300, D = 40, OC = 23;
  ASSERT_GT(vulkan_geometry::column_blocks(N, D, vulkan_geometry::kScratchFloats).blocks, 10u);
  const std::vector<float> x = randn(N * D, 71), w = randn(D, 72), dy = randn(N * D, 73), gw0 = randn(D, 74),
                           dout = randn(N * OC, 75), gb0 = randn(OC, 76), wl = randn(OC * D, 77);
  auto run = [&](Backend& be) {
    const Tensor tx = make(be, DType::F32, {N, D}, x), tw = make(be, DType::F32, {D}, w),
                 out = make(be, DType::F32, {N, D}), rstd = make(be, DType::F32, {N}),
                 tdy = make(be, DType::F32, {N, D}, dy), dx = make(be, DType::F32, {N, D}),
                 dw = make(be, DType::F32, {D}, gw0), tdout = make(be, DType::F32, {N, OC}, dout),
                 twl = make(be, DType::F32, {OC, D}, wl), db = make(be, DType::F32, {OC}, gb0);
    be.rmsnorm_forward(out, rstd, tx, tw, 1e-6f);
    be.rmsnorm_backward(dx, dw, tdy, tx, tw, rstd);
    be.matmul_backward(Tensor{}, Tensor{}, db, tdout, tx, twl, 0.5f);
    return std::vector{download_f32(be, dw), download_f32(be, db)};
  };
  const auto got = run(vk()), again = run(vk()), want = run(ref());
  for (size_t i = 0; i < got.size(); ++i) {
    expect_close(got[i], want[i], 2e-5f);
    EXPECT_EQ(got[i], again[i]);
  }
}

// The embedding gradient with a workgroup per (256 columns, token): 600 tokens over 50 ids (so
// most rows find their id earlier, some over more than 256 earlier rows) into 300-wide rows (two
// column blocks, the second ragged), added into what the table held; the reference's, and the
// same bits twice.
TEST_F(VulkanOps, TheEmbeddingGradientOverManyRepeatedIdsEqualsTheReference) {
  const int64_t N = 600, D = 300, V = 50;
  std::vector<int32_t> ids(static_cast<size_t>(N));
  // ids 0-36 in the first half, 37-49 in the second: there an id's first row is beyond 256.
  for (int64_t n = 0; n < N; ++n)
    ids[static_cast<size_t>(n)] = static_cast<int32_t>(n < 300 ? (n * n + 7 * n) % 37 : 37 + n % 13);
  const std::vector<float> dout = randn(N * D, 91), table0 = randn(V * D, 92);
  auto run = [&](Backend& be) {
    const Tensor tids = make(be, DType::I32, {N}), tdout = make(be, DType::F32, {N, D}, dout),
                 dtable = make(be, DType::F32, {V, D}, table0);
    be.copy_to_device(tids, ids.data());
    be.embedding_backward(dtable, tdout, tids);
    return download_f32(be, dtable);
  };
  const auto got = run(vk()), again = run(vk()), want = run(ref());
  expect_close(got, want, 2e-5f);
  EXPECT_EQ(got, again);
}

// Split-K: 70 x 16 outputs over K = 5000 would be 3 workgroups of 32 x 32 tiles; K splits over
// workgroups into the scratch and a second pass adds the splits in order, with the bias (forward)
// or into what is there (accumulate). Equal to the reference, the same bits every run.
TEST_F(VulkanOps, ASkinnyProductWithALongInnerDimensionSplitsKAndEqualsTheReference) {
  const int64_t N = 70, C = 5000, OC = 16;
  ASSERT_GT(vulkan_geometry::gemm_split(N, OC, C, vulkan_geometry::kScratchFloats).splits, 4u);
  const std::vector<float> x = randn(N * C, 51), w = randn(OC * C, 52), b = randn(OC, 53), prior = randn(N * OC, 54);
  for (const DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_torch_name(dtype));
    auto run = [&](Backend& be) { return linear_products(be, dtype, N, C, OC, x, w, b, prior); };
    const auto got = run(vk()), again = run(vk()), want = run(ref());
    // Sums of 5000 products of N(0, 1) values cancel to far below their terms: the error is
    // float32's on the terms, so it is measured against the largest output.
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(testing_support::close(got[i], want[i], {1e-9, 2e-6}));
      EXPECT_EQ(got[i], again[i]);
    }
  }
}

}  // namespace
}  // namespace memtune

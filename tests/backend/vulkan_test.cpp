// The vulkan backend's ops so far (implemented_vulkan_ops), each on the same inputs as the
// reference backend, on whatever Vulkan device this machine has (Mesa's lavapipe in CI; tiny
// shapes, since lavapipe is slow). Without a usable device the tests are skipped, or fail where
// every test is required (MEMTUNE_REQUIRE_ALL_TESTS: CI installs lavapipe).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/vulkan/device.h"
#include "backend/vulkan/vulkan_backend.h"
#include "core/rng.h"
#include "data/synthetic_tokenizer.h"
#include "support/test_util.h"

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
      const std::string why = "no usable Vulkan device (" + found.problem + "): install mesa-vulkan-drivers";
      if (testing_support::all_tests_required()) FAIL() << why;
      GTEST_SKIP() << why;
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

 private:
  struct Held {
    Backend* be;
    void* p;
    size_t n;
  };
  std::vector<Held> allocations_;
};

void expect_close(const std::vector<float>& got, const std::vector<float>& want, float tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;  // infinities included
    ASSERT_NEAR(got[i], want[i], tolerance * (1.0f + std::abs(want[i]))) << "element " << i;
  }
}

TEST_F(VulkanOps, TheDeviceAndItsOpsAreNamed) {
  const std::vector<std::string_view> ops = implemented_vulkan_ops();
  EXPECT_NE(std::find(ops.begin(), ops.end(), "matmul_forward"), ops.end());
  EXPECT_EQ(vk().name(), "vulkan");
  EXPECT_FALSE(vk().host_addressable());
  // An op that does not run on the device yet says so, naming itself.
  const Tensor x = make(vk(), DType::F32, {4});
  EXPECT_CONTAINS(testing_support::error_of([&] { vk().rope_forward(x, x, x); }), "rope_forward");
}

// Transfers larger than the staging buffer, at offsets inside an allocation, and device copies.
TEST_F(VulkanOps, TransfersAndCopiesRoundTripEveryByte) {
  const int64_t n = (int64_t{12} << 20) / 4 + 13;  // 12 MiB + 13 floats: two staging slices and a tail
  const std::vector<float> values = randn(n, 1);
  const Tensor t = make(vk(), DType::F32, {n}, values);
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

TEST_F(VulkanOps, ConvertRoundsToSixteenBitsAsTheReferenceDoes) {
  std::vector<float> values = randn(1000, 2);
  values.insert(values.end(), {0.0f, -0.0f, 1e-40f, 65504.0f, 1e30f, -1e-8f, 3.14159265f});
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
    if (dtype == DType::BF16) {
      EXPECT_EQ(vbits, rbits);  // round to nearest even, bit for bit
    } else {
      for (size_t i = 0; i < vbits.size(); ++i)  // float16: the GPU's packHalf may flush denormals
        EXPECT_NEAR(static_cast<int>(vbits[i]), static_cast<int>(rbits[i]), (rbits[i] & 0x7c00) == 0 ? 1024 : 0) << i;
    }
    const Tensor back = make(vk(), DType::F32, {n});
    vk().convert(back, vh);
    const Tensor ref_back = make(ref(), DType::F32, {n});
    ref().convert(ref_back, rh);
    expect_close(download_f32(vk(), back), download_f32(ref(), ref_back), 1e-3f);
  }
}

// out = inp @ W^T + bias for float32 and 16-bit weights, shapes that are no multiple of the
// 16 x 16 tile; matmul_accumulate (float32 weights) adds scale * product.
TEST_F(VulkanOps, MatmulEqualsTheReferenceForEveryWeightDtype) {
  const int64_t N = 7, C = 37, OC = 19;
  const std::vector<float> x = randn(N * C, 3), w = randn(OC * C, 4), b = randn(OC, 5), prior = randn(N * OC, 6);
  for (const DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_torch_name(dtype));
    auto run = [&](Backend& be) {
      const Tensor tx = make(be, DType::F32, {N, C}, x), tw = make(be, dtype, {OC, C}, w),
                   tb = make(be, DType::F32, {OC}, b), out = make(be, DType::F32, {N, OC}),
                   acc = make(be, DType::F32, {N, OC}, prior);
      be.matmul_forward(out, tx, tw, tb);
      if (dtype == DType::F32) be.matmul_accumulate(acc, tx, tw, 0.5f);
      return std::pair{download_f32(be, out), download_f32(be, acc)};
    };
    const auto [v_out, v_acc] = run(vk());
    const auto [r_out, r_acc] = run(ref());
    expect_close(v_out, r_out, 1e-5f);
    expect_close(v_acc, r_acc, 1e-5f);
  }
}

// Elementwise ops, recorded one after another without a wait in between: each reads what the
// previous one wrote (the barriers between dispatches).
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

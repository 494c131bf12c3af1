// The Vulkan devices of this machine, as the loader reports them: what `memtune devices` lists
// and what `--backend vulkan` chooses from. Only the facts memtune plans and runs with: memory
// heaps and the limits on one allocation and one storage-buffer binding, and the features the
// shaders use (16-bit storage, 64-bit integers, buffer device addresses, the subgroup size,
// shared memory, cooperative matrices, the memory-budget extension, timestamps).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"

namespace memtune {

// A Vulkan structure with its sType set and every other member zero.
template <class T, class Type>
T vk_struct(Type type) {
  T t{};
  t.sType = type;
  return t;
}

struct VulkanHeap {
  uint64_t bytes = 0;
  bool device_local = false;
};

// One product shape VK_KHR_cooperative_matrix reports: A [m, k] x B [k, n] + C [m, n] into a
// result [m, n], component types by name ("float16", "bfloat16", "float32", "sint8", ...), in a
// scope ("subgroup", "workgroup", ...).
struct VulkanMatrixShape {
  uint32_t m = 0, n = 0, k = 0;
  std::string a, b, c, result, scope;
};

struct VulkanDeviceInfo {
  int index = 0;
  std::string name, type, driver, driver_info, api_version;  // type: discrete GPU | integrated GPU | CPU | ...
  int type_rank = 0;  // what --backend vulkan prefers: discrete 0, integrated 1, virtual 2, other 3, CPU 4
  std::vector<VulkanHeap> heaps;
  uint64_t max_allocation_bytes = 0, max_storage_buffer_range = 0;
  uint32_t subgroup_size = 0, shared_memory_bytes = 0;
  bool storage_16bit = false, shader_int64 = false, buffer_device_address = false;
  bool shader_float64 = false;  // float64 in shaders: training steps decided on the device (step_decision.comp)
  bool subgroup_shuffle = false;  // subgroupShuffleXor in compute shaders
  bool memory_budget = false, cooperative_matrix = false, timestamps = false;
  uint32_t api = 0;  // the device's Vulkan version (VK_MAKE_API_VERSION)
  // VK_KHR_cooperative_matrix with its feature on, and the shapes it reports; float16 arithmetic
  // in shaders (shaderFloat16), which float16 matrices need.
  bool khr_cooperative_matrix = false, shader_float16 = false;
  bool shader_int8 = false;  // 8-bit integer arithmetic in shaders (shaderInt8), which int8 matrices need
  // Vulkan 1.3's subgroup size control with full subgroups in compute: a pipeline can require its
  // subgroup size (gemm_coopmat.comp's four subgroups per workgroup need subgroup_size exactly).
  bool subgroup_size_control = false;
  std::vector<VulkanMatrixShape> matrix_shapes;
  // VK_NV_cooperative_matrix2 with the features attention_coopmat2.glsl uses on (flexible
  // dimensions, reductions, conversions, per-element operations), the largest flexible dimension,
  // and the flexible shapes it reports (m, n, k: the granularities every dimension is a multiple of).
  bool nv_cooperative_matrix2 = false;
  uint32_t flexible_max_dimension = 0;
  std::vector<VulkanMatrixShape> flexible_shapes;
  float timestamp_period_ns = 0;  // nanoseconds per timestamp tick
  // What the backend needs: buffer device addresses, 64-bit integers and 16-bit storage for its
  // memory, and subgroups of at least 8 invocations that shuffle (the attention shaders split a
  // row's head dimension over 4 or 8 neighbouring invocations and sum across them), and 32 KiB of
  // shared memory per workgroup (gemm.comp's 128 x 128 tiles take 25 KiB).
  bool usable() const {
    return buffer_device_address && shader_int64 && storage_16bit && subgroup_shuffle && subgroup_size >= 8 &&
           shared_memory_bytes >= kSharedMemoryBytes;
  }
  static constexpr uint32_t kSharedMemoryBytes = 32768;
  // The largest device-local heap.
  uint64_t device_heap_bytes() const;
  // True when the device's memory is the machine's RAM (a CPU implementation such as lavapipe, an
  // integrated GPU): its allocations count against the host. A discrete GPU's do not.
  bool memory_is_host() const { return type == "CPU" || type == "integrated GPU"; }
};

struct VulkanDevices {
  std::vector<VulkanDeviceInfo> devices;
  std::string loader_version;  // the instance version the loader offers, e.g. "1.3.239"
  std::string problem;         // why there are none (no loader, no driver), empty otherwise
};

// The shape gemm_coopmat.comp multiplies 16-bit `operands` with on this device (float32
// accumulation, subgroup scope, a square m x n of 8 or 16 and k of 8, 16 or 32; the largest), or
// none: the build has no cooperative-matrix shader, the device lacks VK_KHR_cooperative_matrix,
// Vulkan 1.3 or float16 arithmetic, or reports no such shape (lavapipe has float16 only; bfloat16
// has no variant in this build). `why` (when given) says which.
std::optional<VulkanMatrixShape> cooperative_product_shape(const VulkanDeviceInfo& d, DType operands,
                                                           std::string* why = nullptr);
// The int8 x int8 -> int32 shape the quantized products of many rows with int8 activations take
// (quantized_matmul_int8_coopmat.comp: subgroup scope, a square m x n of 8 or 16, k of 8, 16 or
// 32; the largest), or none, `why` saying why (as cooperative_product_shape, with 8-bit integer
// arithmetic in place of float16).
std::optional<VulkanMatrixShape> cooperative_int8_shape(const VulkanDeviceInfo& d, std::string* why = nullptr);
// The granularity of the float16 x float16 -> float32 subgroup matrices of flexible size that
// attention's passes with float16 operands take (attention_coopmat2.glsl's shaders), where the
// build has the shaders, the device has what cooperative_product_shape asks for float16 and
// VK_NV_cooperative_matrix2's flexible dimensions (up to 256 at least), reductions, conversions and
// per-element operations; or none, `why` saying why.
std::optional<VulkanMatrixShape> cooperative_flexible_shape(const VulkanDeviceInfo& d, std::string* why = nullptr);
// Which kernel each family of products and attention takes on this device, for `memtune
// devices` (name, then the kernel and shape, or why not).
std::vector<std::pair<std::string, std::string>> vulkan_kernel_variants(const VulkanDeviceInfo& d);

// Asks the Vulkan loader (libvulkan) once per call; never throws.
VulkanDevices vulkan_devices();

// The device --backend vulkan takes: `requested` (--vulkan_device), else MEMTUNE_VULKAN_DEVICE,
// else the first discrete GPU, else an integrated one, else anything else, a CPU implementation
// (lavapipe) last; among devices the backend cannot use (no buffer device address), none. An
// Error naming the flag or variable and the devices there are when the request cannot be met.
const VulkanDeviceInfo& choose_vulkan_device(const VulkanDevices& found, std::optional<int> requested);

// One device in a few lines (name, type, driver; heaps and limits; features), for the run's
// first lines and `memtune devices`.
std::string describe_vulkan_device(const VulkanDeviceInfo& d);
nlohmann::json vulkan_device_json(const VulkanDeviceInfo& d);

}  // namespace memtune

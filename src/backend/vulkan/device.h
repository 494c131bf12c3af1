// The Vulkan devices of this machine, as the loader reports them: what `memtune devices` lists
// and what `--backend vulkan` chooses from. Only the facts memtune plans and runs with: memory
// heaps and the limits on one allocation and one storage-buffer binding, and the features the
// shaders use (16-bit storage, 64-bit integers, buffer device addresses, the subgroup size,
// shared memory, cooperative matrices, the memory-budget extension, timestamps).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

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

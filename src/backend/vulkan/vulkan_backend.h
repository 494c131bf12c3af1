// The vulkan backend: the Backend interface on a Vulkan compute device (a GPU of any vendor, or
// Mesa's lavapipe on the CPU), its memory and submissions in VulkanContext, its ops in the
// shaders of shaders/ (one per op or op family, named as the cpu backend's ops).
//
// Every op runs on the device and is tested against the reference backend, op by op in the op
// harness (tests/backend/ops_test.cpp) and per op family in tests/backend/vulkan_test.cpp.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace memtune {

// The process-wide vulkan backend on the device choose_vulkan_device picks (opened on first use;
// an Error when this machine has no usable Vulkan device).
Backend& vulkan_backend();

// A device that is not on this machine, for `memtune plan --backend vulkan --vulkan_max_allocation
// B --device_memory M`: from then on the vulkan backend answers the planning questions (allocation
// segments, staging, runtime bytes) for a device whose one allocation holds at most
// max_allocation_bytes and whose memory is heap_bytes, opens no device, and refuses every op.
// Call before the first vulkan_backend().
struct VulkanDeviceProfile {
  uint64_t max_allocation_bytes = 0, heap_bytes = 0;
};
void plan_for_absent_vulkan_device(const VulkanDeviceProfile& profile);

// Whether this machine has a Vulkan device the backend can use (asked once). An AddressSanitizer
// build says no: Mesa's drivers keep allocations to process exit, which LeakSanitizer would report
// in every test process.
bool vulkan_backend_available();

}  // namespace memtune

// The vulkan backend: the Backend interface on a Vulkan compute device (a GPU of any vendor, or
// Mesa's lavapipe on the CPU), its memory and submissions in VulkanContext, its ops in the
// shaders of shaders/ (one per op or op family, named as the cpu backend's ops).
//
// Every op runs on the device and is tested against the reference backend, op by op in the op
// harness (tests/backend/ops_test.cpp) and per op family in tests/backend/vulkan_test.cpp.
#pragma once

#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace memtune {

// The process-wide vulkan backend on the device choose_vulkan_device picks (opened on first use;
// an Error when this machine has no usable Vulkan device).
Backend& vulkan_backend();

// Whether this machine has a Vulkan device the backend can use (asked once). An AddressSanitizer
// build says no: Mesa's drivers keep allocations to process exit, which LeakSanitizer would report
// in every test process.
bool vulkan_backend_available();

}  // namespace memtune

// The vulkan backend: the Backend interface on a Vulkan compute device (a GPU of any vendor, or
// Mesa's lavapipe on the CPU), its memory and submissions in VulkanContext, its ops in the
// shaders of shaders/ (one per op or op family, named as the cpu backend's ops).
//
// Being built op by op: the ops listed in implemented_vulkan_ops() run on the device and are
// tested against the reference backend (tests/backend/vulkan_test.cpp); every other op throws an
// Error naming itself. It joins the backend registry (--backend vulkan) once every op runs.
#pragma once

#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace memtune {

// The process-wide vulkan backend on the device choose_vulkan_device picks (opened on first use;
// an Error when this machine has no usable Vulkan device).
Backend& vulkan_backend();

// The ops the vulkan backend runs so far.
std::vector<std::string_view> implemented_vulkan_ops();

}  // namespace memtune

// The shaders that the dispatch lists of tests/backend/vulkan_geometry_test.cpp hold (a training
// step of Qwen2.5-0.5B and of Qwen2.5-7B with LoRA, decode steps of Qwen2.5-7B): a real run's
// shaders must all be among them, or the geometry check would not see them.
#pragma once

#include <set>
#include <string>

namespace memtune {

std::set<std::string> vulkan_geometry_listed_shaders();

}  // namespace memtune

// The compute shaders of the vulkan backend: src/backend/vulkan/shaders/NAME.comp, compiled to
// SPIR-V by glslc when memtune is built and embedded in the binary (cmake/embed_spirv.cmake), so
// no shader file is read at run time.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace memtune {

// The SPIR-V words of shaders/NAME.comp; empty when there is no such shader.
std::span<const uint32_t> vulkan_shader(std::string_view name);

}  // namespace memtune

// The compute shaders of the vulkan backend: src/backend/vulkan/shaders/NAME.comp, compiled to
// SPIR-V by glslc when memtune is built and embedded in the binary (cmake/embed_spirv.cmake), so
// no shader file is read at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace memtune {

// The SPIR-V words of shaders/NAME.comp; empty when there is no such shader.
std::span<const uint32_t> vulkan_shader(std::string_view name);

// The bytes of a shader's push-constant block (its last member's offset plus size, from the
// SPIR-V's own decorations), 0 when it has none. The C++ struct a dispatch pushes must match it:
// the same members, so the same size up to the struct's padding to 8 bytes.
size_t vulkan_push_constant_bytes(std::span<const uint32_t> code);
// The byte offsets of the push-constant members that can hold a device address: buffer
// references and 64-bit integers (what VulkanContext::dispatch checks against the ranges a
// dispatch states; padding and 32-bit members are never read as addresses).
std::vector<uint32_t> vulkan_push_constant_address_offsets(std::span<const uint32_t> code);

}  // namespace memtune

// What the backend reads back from a shader's SPIR-V: the size of its push-constant block.
#include "backend/vulkan/shaders.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "core/error.h"

namespace memtune {

namespace {

// The push-constant block read from SPIR-V: each member's byte offset and size, and whether it can
// hold an address (a physical-storage-buffer pointer or a 64-bit integer).
struct PushMember {
  uint32_t offset = 0;
  size_t bytes = 0;
  bool address = false;
};
std::vector<PushMember> push_members(std::span<const uint32_t> code) {
  // SPIR-V: a 5-word header, then instructions whose first word is (word count << 16) | opcode.
  enum : uint32_t {
    kOpTypeInt = 21, kOpTypeFloat = 22, kOpTypeVector = 23, kOpTypeStruct = 30, kOpTypePointer = 32,
    kOpVariable = 59, kOpMemberDecorate = 72, kDecorationOffset = 35, kStoragePushConstant = 9,
    kStoragePhysicalBuffer = 5349,
  };
  std::map<uint32_t, size_t> scalar_bytes;                   // type id -> size (ints, floats, vectors, addresses)
  std::map<uint32_t, bool> holds_address;                    // type id -> a pointer or a 64-bit integer
  std::map<uint32_t, std::vector<uint32_t>> struct_members;  // struct id -> member type ids
  std::map<uint32_t, uint32_t> pointee;                      // push-constant pointer type id -> struct id
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> offsets;  // (struct, member) -> byte offset
  uint32_t block = 0;
  MT_ASSERT(code.size() > 5, "vulkan: a shader of no instructions");
  for (size_t at = 5; at < code.size();) {
    const uint32_t words = code[at] >> 16, op = code[at] & 0xffffu;
    MT_ASSERT(words > 0 && at + words <= code.size(), "vulkan: malformed SPIR-V");
    const uint32_t* w = &code[at];
    if (op == kOpTypeInt || op == kOpTypeFloat) scalar_bytes[w[1]] = w[2] / 8;
    if (op == kOpTypeInt && w[2] == 64) holds_address[w[1]] = true;
    if (op == kOpTypeVector && scalar_bytes.count(w[2])) scalar_bytes[w[1]] = scalar_bytes[w[2]] * w[3];
    if (op == kOpTypeStruct) struct_members[w[1]].assign(w + 2, w + words);
    if (op == kOpTypePointer && w[2] == kStoragePhysicalBuffer) scalar_bytes[w[1]] = 8, holds_address[w[1]] = true;
    if (op == kOpTypePointer && w[2] == kStoragePushConstant) pointee[w[1]] = w[3];
    if (op == kOpVariable && w[3] == kStoragePushConstant) block = pointee.at(w[1]);
    if (op == kOpMemberDecorate && w[3] == kDecorationOffset) offsets[{w[1], w[2]}] = w[4];
    at += words;
  }
  std::vector<PushMember> members;
  if (block == 0) return members;
  const std::vector<uint32_t>& types = struct_members.at(block);
  for (uint32_t m = 0; m < types.size(); ++m) {
    const auto size = scalar_bytes.find(types[m]);
    MT_ASSERT(size != scalar_bytes.end(), "vulkan: a push-constant member of a type this reader does not size");
    members.push_back({offsets.at({block, m}), size->second, holds_address.count(types[m]) > 0});
  }
  return members;
}

}  // namespace

size_t vulkan_push_constant_bytes(std::span<const uint32_t> code) {
  size_t end = 0;
  for (const PushMember& m : push_members(code)) end = std::max(end, size_t{m.offset} + m.bytes);
  return end;
}

std::vector<uint32_t> vulkan_push_constant_address_offsets(std::span<const uint32_t> code) {
  std::vector<uint32_t> out;
  for (const PushMember& m : push_members(code))
    if (m.address) out.push_back(m.offset);
  return out;
}

}  // namespace memtune

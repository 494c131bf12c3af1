// What the backend reads back from a shader's SPIR-V: the size of its push-constant block.
#include "backend/vulkan/shaders.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "core/error.h"

namespace memtune {

size_t vulkan_push_constant_bytes(std::span<const uint32_t> code) {
  // SPIR-V: a 5-word header, then instructions whose first word is (word count << 16) | opcode.
  enum : uint32_t {
    kOpTypeInt = 21, kOpTypeFloat = 22, kOpTypeVector = 23, kOpTypeStruct = 30, kOpTypePointer = 32,
    kOpVariable = 59, kOpMemberDecorate = 72, kDecorationOffset = 35, kStoragePushConstant = 9,
    kStoragePhysicalBuffer = 5349,
  };
  std::map<uint32_t, size_t> scalar_bytes;                   // type id -> size (ints, floats, vectors, addresses)
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
    if (op == kOpTypeVector && scalar_bytes.count(w[2])) scalar_bytes[w[1]] = scalar_bytes[w[2]] * w[3];
    if (op == kOpTypeStruct) struct_members[w[1]].assign(w + 2, w + words);
    if (op == kOpTypePointer && w[2] == kStoragePhysicalBuffer) scalar_bytes[w[1]] = 8;
    if (op == kOpTypePointer && w[2] == kStoragePushConstant) pointee[w[1]] = w[3];
    if (op == kOpVariable && w[3] == kStoragePushConstant) block = pointee.at(w[1]);
    if (op == kOpMemberDecorate && w[3] == kDecorationOffset) offsets[{w[1], w[2]}] = w[4];
    at += words;
  }
  if (block == 0) return 0;
  size_t end = 0;
  const std::vector<uint32_t>& members = struct_members.at(block);
  for (uint32_t m = 0; m < members.size(); ++m) {
    const auto size = scalar_bytes.find(members[m]);
    MT_ASSERT(size != scalar_bytes.end(), "vulkan: a push-constant member of a type this reader does not size");
    end = std::max(end, size_t{offsets.at({block, m})} + size->second);
  }
  return end;
}

}  // namespace memtune

// One Vulkan device opened for compute (see context.h).
#include "backend/vulkan/context.h"

#include "backend/vulkan/cooperative_matrix.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/vulkan/cooperative_matrix.h"
#include "backend/vulkan/shaders.h"
#include "core/console.h"
#include "core/error.h"

namespace memtune {

namespace {

void check(VkResult r, const char* what) {
  if (r != VK_SUCCESS) throw Error(fmt::format("--backend vulkan: {} failed (VkResult {})", what, static_cast<int>(r)));
}

}  // namespace

VulkanContext::VulkanContext(std::optional<int> requested_device) {
  const VulkanDevices found = vulkan_devices();
  info_ = choose_vulkan_device(found, requested_device);

  auto app = vk_struct<VkApplicationInfo>(VK_STRUCTURE_TYPE_APPLICATION_INFO);
  app.pApplicationName = "memtune";
  // Vulkan 1.3 where the device has it: the cooperative-matrix shaders are SPIR-V 1.6.
  app.apiVersion = info_.api >= VK_API_VERSION_1_3 ? VK_API_VERSION_1_3 : VK_API_VERSION_1_2;
  auto instance_info = vk_struct<VkInstanceCreateInfo>(VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO);
  instance_info.pApplicationInfo = &app;
  check(vkCreateInstance(&instance_info, nullptr, &instance_), "vkCreateInstance");
  uint32_t count = 0;
  vkEnumeratePhysicalDevices(instance_, &count, nullptr);
  std::vector<VkPhysicalDevice> devices(count);
  vkEnumeratePhysicalDevices(instance_, &count, devices.data());
  MT_ASSERT(static_cast<uint32_t>(info_.index) < count, "the Vulkan device list changed");
  physical_ = devices[static_cast<size_t>(info_.index)];

  vkGetPhysicalDeviceQueueFamilyProperties(physical_, &count, nullptr);
  std::vector<VkQueueFamilyProperties> families(count);
  vkGetPhysicalDeviceQueueFamilyProperties(physical_, &count, families.data());
  bool found_compute = false;
  for (uint32_t i = 0; i < count && !found_compute; ++i)
    if (families[i].queueFlags & VK_QUEUE_COMPUTE_BIT) queue_family_ = i, found_compute = true;
  if (!found_compute) throw Error(fmt::format("--backend vulkan: {} has no compute queue", info_.name));

  const float priority = 1.0f;
  auto queue_info = vk_struct<VkDeviceQueueCreateInfo>(VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO);
  queue_info.queueFamilyIndex = queue_family_;
  queue_info.queueCount = 1;
  queue_info.pQueuePriorities = &priority;
  auto f11 = vk_struct<VkPhysicalDeviceVulkan11Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES);
  f11.storageBuffer16BitAccess = VK_TRUE;
  auto f12 = vk_struct<VkPhysicalDeviceVulkan12Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES);
  f12.bufferDeviceAddress = VK_TRUE;
  f12.pNext = &f11;
  auto features = vk_struct<VkPhysicalDeviceFeatures2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2);
  features.features.shaderInt64 = VK_TRUE;
  features.pNext = &f12;
  // 16-bit integer arithmetic in shaders (the uint16_t words of bfloat16 storage).
  auto supported = vk_struct<VkPhysicalDeviceFeatures2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2);
  vkGetPhysicalDeviceFeatures2(physical_, &supported);
  features.features.shaderInt16 = supported.features.shaderInt16;
  features.features.shaderFloat64 = supported.features.shaderFloat64;
  auto device_info = vk_struct<VkDeviceCreateInfo>(VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO);
  device_info.pNext = &features;
  device_info.queueCreateInfoCount = 1;
  device_info.pQueueCreateInfos = &queue_info;
  // The device's own usage and budget figures (memory.json), where the driver has them.
  std::vector<const char*> extensions;
  if (info_.memory_budget) extensions.push_back("VK_EXT_memory_budget");
  // Cooperative matrices and float16 arithmetic where gemm_coopmat.comp will run.
  auto matrices = vk_struct<VkPhysicalDeviceCooperativeMatrixFeaturesKHR>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR);
  auto f13 = vk_struct<VkPhysicalDeviceVulkan13Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES);
  // And 8-bit integer arithmetic where quantized_matmul_int8_coopmat.comp will.
  const bool half_matrices = cooperative_product_shape(info_, DType::F16).has_value();
  const bool int8_matrices = cooperative_int8_shape(info_).has_value();
  if (half_matrices || int8_matrices) {
    extensions.push_back(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME);
    matrices.cooperativeMatrix = VK_TRUE;
    f13.subgroupSizeControl = VK_TRUE;
    f13.computeFullSubgroups = VK_TRUE;
    f13.pNext = &matrices;
    f11.pNext = &f13;
    f12.shaderFloat16 = half_matrices ? VK_TRUE : VK_FALSE;
    f12.shaderInt8 = int8_matrices ? VK_TRUE : VK_FALSE;
  }
  // VK_NV_cooperative_matrix2's flexible dimensions, reductions, conversions and per-element
  // operations where attention_coopmat2.glsl's shaders will run.
  auto matrices2 = vk_struct<VkPhysicalDeviceCooperativeMatrix2FeaturesNV>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV);
  if (cooperative_flexible_shape(info_)) {  // implies half_matrices: `matrices` is in the chain
    extensions.push_back(VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME);
    matrices2.cooperativeMatrixFlexibleDimensions = VK_TRUE;
    matrices2.cooperativeMatrixReductions = VK_TRUE;
    matrices2.cooperativeMatrixConversions = VK_TRUE;
    matrices2.cooperativeMatrixPerElementOperations = VK_TRUE;
    matrices.pNext = &matrices2;
  }
  device_info.enabledExtensionCount = static_cast<uint32_t>(extensions.size());
  device_info.ppEnabledExtensionNames = extensions.data();
  check(vkCreateDevice(physical_, &device_info, nullptr, &device_), "vkCreateDevice");
  vkGetDeviceQueue(device_, queue_family_, 0, &queue_);

  auto pool_info = vk_struct<VkCommandPoolCreateInfo>(VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO);
  pool_info.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  pool_info.queueFamilyIndex = queue_family_;
  check(vkCreateCommandPool(device_, &pool_info, nullptr, &pool_), "vkCreateCommandPool");

  VkPushConstantRange range{VK_SHADER_STAGE_COMPUTE_BIT, 0, 128};
  auto layout_info = vk_struct<VkPipelineLayoutCreateInfo>(VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO);
  layout_info.pushConstantRangeCount = 1;
  layout_info.pPushConstantRanges = &range;
  check(vkCreatePipelineLayout(device_, &layout_info, nullptr, &layout_), "vkCreatePipelineLayout");

  // Timestamps for the phase timings, where the compute queue has them.
  const uint32_t valid_bits = families[queue_family_].timestampValidBits;
  if (info_.timestamps && valid_bits > 0) {
    auto query_info = vk_struct<VkQueryPoolCreateInfo>(VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO);
    query_info.queryType = VK_QUERY_TYPE_TIMESTAMP;
    query_info.queryCount = Backend::kTimeMarks;
    check(vkCreateQueryPool(device_, &query_info, nullptr, &timestamps_), "vkCreateQueryPool");
    timestamp_mask_ = valid_bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << valid_bits) - 1;
  }

  // Host-visible staging: planned host memory of kTransferBytes, as the host backends stage. The
  // host reads downloads out of it, so a cached type is taken where the device has one (uncached
  // write-combined memory reads at a small fraction of the speed).
  staging_ = make_buffer(kTransferBytes, VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                         VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                         VK_MEMORY_PROPERTY_HOST_CACHED_BIT);
  check(vkMapMemory(device_, staging_.memory, 0, kTransferBytes, 0, &staging_host_), "vkMapMemory");
  readback_ = make_buffer(kReadbackSlots * kSlotBytes, VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                          VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                          VK_MEMORY_PROPERTY_HOST_CACHED_BIT);
  void* readback = nullptr;
  check(vkMapMemory(device_, readback_.memory, 0, kReadbackSlots * kSlotBytes, 0, &readback), "vkMapMemory");
  readback_host_ = static_cast<std::byte*>(readback);
  const char* profile = std::getenv("MEMTUNE_VULKAN_PROFILE");
  profile_ = profile && std::string(profile) == "1";
  const char* reuse = std::getenv("MEMTUNE_VULKAN_REUSE");
  const std::string reuse_value = reuse ? reuse : "";
  reuse_ = profile_ || reuse_value == "0" ? Reuse::Off : reuse_value == "check" ? Reuse::Check : Reuse::On;
  if (profile_ && timestamps_) {
    auto query_info = vk_struct<VkQueryPoolCreateInfo>(VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO);
    query_info.queryType = VK_QUERY_TYPE_TIMESTAMP;
    query_info.queryCount = 2;
    check(vkCreateQueryPool(device_, &query_info, nullptr, &profile_queries_), "vkCreateQueryPool");
  }
}

VulkanContext::~VulkanContext() {
  if (device_) vkDeviceWaitIdle(device_);
  for (auto& [key, r] : recordings_) release(r);
  release(building_);
  for (const auto& [shader, e] : profile_entries_)
    std::fprintf(stderr,
                 "vulkan profile: %-24s %.6g s in %lld dispatches, %llu workgroups, %.6g GFLOP, %.6g GB: %.6g "
                 "GFLOP/s, %.6g GB/s\n",
                 shader.c_str(), e.seconds, static_cast<long long>(e.dispatches),
                 static_cast<unsigned long long>(e.workgroups), e.flops / 1e9, e.bytes / 1e9,
                 e.seconds > 0 ? e.flops / e.seconds / 1e9 : 0.0, e.seconds > 0 ? e.bytes / e.seconds / 1e9 : 0.0);
  if (profile_queries_) vkDestroyQueryPool(device_, profile_queries_, nullptr);
  for (auto& [name, p] : pipelines_) {
    vkDestroyPipeline(device_, p.pipeline, nullptr);
    vkDestroyShaderModule(device_, p.module, nullptr);
  }
  for (auto& [address, a] : allocations_) destroy(a);
  if (readback_.memory) {
    vkUnmapMemory(device_, readback_.memory);
    destroy(readback_);
  }
  if (staging_.memory) {
    vkUnmapMemory(device_, staging_.memory);
    destroy(staging_);
  }
  if (timestamps_) vkDestroyQueryPool(device_, timestamps_, nullptr);
  if (layout_) vkDestroyPipelineLayout(device_, layout_, nullptr);
  for (const Batch& b : batches_) vkDestroyFence(device_, b.fence, nullptr);
  if (pool_) vkDestroyCommandPool(device_, pool_, nullptr);
  if (device_) vkDestroyDevice(device_, nullptr);
  if (instance_) vkDestroyInstance(instance_, nullptr);
}

int choose_memory_type(const VkPhysicalDeviceMemoryProperties& memory, uint32_t allowed, VkMemoryPropertyFlags wanted,
                       VkMemoryPropertyFlags preferred) {
  for (const VkMemoryPropertyFlags flags : {wanted | preferred, wanted})
    for (uint32_t i = 0; i < memory.memoryTypeCount && i < 32; ++i)
      if ((allowed & (1u << i)) && (memory.memoryTypes[i].propertyFlags & flags) == flags) return static_cast<int>(i);
  return -1;
}

uint32_t VulkanContext::memory_type(uint32_t allowed, VkMemoryPropertyFlags wanted,
                                    VkMemoryPropertyFlags preferred) const {
  VkPhysicalDeviceMemoryProperties memory{};
  vkGetPhysicalDeviceMemoryProperties(physical_, &memory);
  const int type = choose_memory_type(memory, allowed, wanted, preferred);
  if (type < 0)
    throw Error(fmt::format("--backend vulkan: {} has no memory type with properties {:#x}", info_.name, wanted));
  return static_cast<uint32_t>(type);
}

VulkanContext::Allocation VulkanContext::make_buffer(size_t bytes, VkBufferUsageFlags usage,
                                                     VkMemoryPropertyFlags properties,
                                                     VkMemoryPropertyFlags preferred) {
  Allocation a;
  a.bytes = bytes;
  auto buffer_info = vk_struct<VkBufferCreateInfo>(VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO);
  buffer_info.size = bytes;
  buffer_info.usage = usage;
  buffer_info.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  check(vkCreateBuffer(device_, &buffer_info, nullptr, &a.buffer), "vkCreateBuffer");
  VkMemoryRequirements needs{};
  vkGetBufferMemoryRequirements(device_, a.buffer, &needs);
  auto flags = vk_struct<VkMemoryAllocateFlagsInfo>(VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO);
  flags.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
  auto memory_info = vk_struct<VkMemoryAllocateInfo>(VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO);
  memory_info.pNext = (usage & VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT) ? &flags : nullptr;
  memory_info.allocationSize = needs.size;
  memory_info.memoryTypeIndex = memory_type(needs.memoryTypeBits, properties, preferred);
  if (const VkResult r = vkAllocateMemory(device_, &memory_info, nullptr, &a.memory); r != VK_SUCCESS) {
    vkDestroyBuffer(device_, a.buffer, nullptr);
    throw Error(fmt::format("--backend vulkan: {} refused an allocation of {} (VkResult {}): the device's heap is {}",
                            info_.name, format_bytes(bytes), static_cast<int>(r),
                            format_bytes(info_.device_heap_bytes())));
  }
  check(vkBindBufferMemory(device_, a.buffer, a.memory, 0), "vkBindBufferMemory");
  return a;
}

void VulkanContext::destroy(Allocation& a) {
  vkDestroyBuffer(device_, a.buffer, nullptr);
  vkFreeMemory(device_, a.memory, nullptr);
  a = {};
}

uint64_t VulkanContext::allocate(size_t bytes) {
  assert_not_recording("an allocation");
  bytes = std::max<size_t>((bytes + 255) / 256 * 256, 256);
  if (bytes > info_.max_allocation_bytes)
    throw Error(fmt::format("--backend vulkan: an arena of {} is more than one allocation may hold on {} ({})",
                            format_bytes(bytes), info_.name, format_bytes(info_.max_allocation_bytes)));
  // What the device can still give: its budget less this process's usage where the driver says,
  // else the device-local heap less what this context holds.
  uint64_t free_bytes = 0;
  std::string what;
  if (const auto b = memory_budget()) {
    free_bytes = b->budget_bytes > b->usage_bytes ? b->budget_bytes - b->usage_bytes : 0;
    what = fmt::format("the driver's memory budget leaves {}", format_bytes(free_bytes));
  } else {
    const uint64_t heap = info_.device_heap_bytes();
    free_bytes = heap > allocated_bytes_ ? heap - allocated_bytes_ : 0;
    what = fmt::format("the device-local heap of {} has {} left", format_bytes(heap), format_bytes(free_bytes));
  }
  if (bytes > free_bytes)
    throw Error(fmt::format("--backend vulkan: an arena of {} does not fit on {}: {} (a smaller plan: memtune plan "
                            "--fit --device_memory auto)",
                            format_bytes(bytes), info_.name, what));
  Allocation a = make_buffer(bytes,
                             VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT |
                                 VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                             VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
  auto address_info = vk_struct<VkBufferDeviceAddressInfo>(VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO);
  address_info.buffer = a.buffer;
  const uint64_t address = vkGetBufferDeviceAddress(device_, &address_info);
  allocations_[address] = a;
  allocated_bytes_ += bytes;
  fill_words(address, 0, bytes);
  return address;
}

void VulkanContext::deallocate(uint64_t address) {
  const auto it = allocations_.find(address);
  MT_ASSERT(it != allocations_.end(), "vulkan: freeing memory that was not allocated");
  flush();
  release_recordings();  // their addresses may be reused
  allocated_bytes_ -= it->second.bytes;
  destroy(it->second);
  allocations_.erase(it);
}

std::pair<const VulkanContext::Allocation*, size_t> VulkanContext::locate(uint64_t address, size_t bytes) const {
  auto it = allocations_.upper_bound(address);
  MT_ASSERT(it != allocations_.begin(), "vulkan: an address outside the device's allocations");
  --it;
  const size_t offset = address - it->first;
  MT_ASSERT(offset + bytes <= it->second.bytes, "vulkan: a range beyond its allocation");
  return {&it->second, offset};
}

std::optional<VulkanContext::MemoryBudget> VulkanContext::memory_budget() const {
  // A CPU implementation's memory is this process's, measured by its RSS: Mesa 26's lavapipe
  // has the extension, but its usage figure does not move when memory is allocated.
  if (!info_.memory_budget || info_.type == "CPU") return std::nullopt;
  auto budget = vk_struct<VkPhysicalDeviceMemoryBudgetPropertiesEXT>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT);
  auto props = vk_struct<VkPhysicalDeviceMemoryProperties2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2);
  props.pNext = &budget;
  vkGetPhysicalDeviceMemoryProperties2(physical_, &props);
  // The device-local heaps together (the arena's memory type is device-local).
  MemoryBudget b;
  for (uint32_t h = 0; h < props.memoryProperties.memoryHeapCount; ++h) {
    if (!(props.memoryProperties.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)) continue;
    b.usage_bytes += budget.heapUsage[h];
    b.budget_bytes += budget.heapBudget[h];
  }
  return b;
}

VkCommandBuffer VulkanContext::primary() {
  if (!recording_) {
    // A command buffer the device is done with (its fence signalled, checked without waiting),
    // or a new one: recording never waits for the device.
    size_t free = batches_.size();
    for (size_t i = 0; i < batches_.size(); ++i)
      if (!batches_[i].in_flight) {
        free = i;
        break;
      }
    if (free == batches_.size()) {
      Batch b;
      auto command_info = vk_struct<VkCommandBufferAllocateInfo>(VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO);
      command_info.commandPool = pool_;
      command_info.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
      command_info.commandBufferCount = 1;
      check(vkAllocateCommandBuffers(device_, &command_info, &b.commands), "vkAllocateCommandBuffers");
      auto fence_info = vk_struct<VkFenceCreateInfo>(VK_STRUCTURE_TYPE_FENCE_CREATE_INFO);
      check(vkCreateFence(device_, &fence_info, nullptr, &b.fence), "vkCreateFence");
      batches_.push_back(b);
    }
    current_ = free;
    auto begin = vk_struct<VkCommandBufferBeginInfo>(VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO);
    begin.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
    check(vkBeginCommandBuffer(batches_[current_].commands, &begin), "vkBeginCommandBuffer");
    recording_ = true;
    recorded_ = 0;
  }
  return batches_[current_].commands;
}

VkCommandBuffer VulkanContext::recording() {
  VkCommandBuffer open = primary();
  if (!recording_key_) return open;
  // Between begin_commands and end_commands: a secondary command buffer of the recording, which
  // the primary executes where it ends.
  if (!chunk_open_) {
    VkCommandBuffer chunk = VK_NULL_HANDLE;
    auto command_info = vk_struct<VkCommandBufferAllocateInfo>(VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO);
    command_info.commandPool = pool_;
    command_info.level = VK_COMMAND_BUFFER_LEVEL_SECONDARY;
    command_info.commandBufferCount = 1;
    check(vkAllocateCommandBuffers(device_, &command_info, &chunk), "vkAllocateCommandBuffers");
    building_.chunks.push_back(chunk);
    const auto inheritance =
        vk_struct<VkCommandBufferInheritanceInfo>(VK_STRUCTURE_TYPE_COMMAND_BUFFER_INHERITANCE_INFO);
    auto begin = vk_struct<VkCommandBufferBeginInfo>(VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO);
    begin.pInheritanceInfo = &inheritance;
    check(vkBeginCommandBuffer(chunk, &begin), "vkBeginCommandBuffer");
    chunk_open_ = true;
  }
  return building_.chunks.back();
}

void VulkanContext::close_chunk() {
  if (!chunk_open_) return;
  chunk_open_ = false;
  VkCommandBuffer chunk = building_.chunks.back();
  check(vkEndCommandBuffer(chunk), "vkEndCommandBuffer");
  vkCmdExecuteCommands(primary(), 1, &chunk);
}

void VulkanContext::barrier(bool host) {
  ++counters_.barriers;
  note({.kind = Command::Barrier, .a = host});
  auto b = vk_struct<VkMemoryBarrier>(VK_STRUCTURE_TYPE_MEMORY_BARRIER);
  b.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
  b.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                    VK_ACCESS_TRANSFER_WRITE_BIT | (host ? VK_ACCESS_HOST_READ_BIT : 0);
  vkCmdPipelineBarrier(
      recording(), VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
      VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | (host ? VK_PIPELINE_STAGE_HOST_BIT : 0),
      0, 1, &b, 0, nullptr, 0, nullptr);
  pending_.clear();
  pending_unstated_ = false;
}

bool VulkanContext::needs_barrier(std::span<const Access> pending, bool pending_unstated,
                                  std::span<const Access> accesses, bool unstated) {
  if (pending_unstated) return true;
  if (unstated) return !pending.empty();
  for (const Access& a : accesses)
    for (const Access& p : pending)
      if ((a.write || p.write) && a.address < p.address + p.bytes && p.address < a.address + a.bytes) return true;
  return false;
}

void VulkanContext::order(std::span<const Access> accesses) {
  const bool unstated = accesses.empty();
  if (needs_barrier(pending_, pending_unstated_, accesses, unstated)) barrier();
  if (unstated) pending_unstated_ = true;
  for (const Access& a : accesses)
    if (a.bytes > 0) pending_.push_back(a);
}

void VulkanContext::check_stated(std::span<const std::byte> push, std::span<const uint32_t> offsets,
                                 std::span<const Access> accesses) const {
  for (const uint32_t at : offsets) {
    if (at + 8 > push.size()) continue;
    uint64_t word = 0;
    std::memcpy(&word, push.data() + at, 8);
    if (word == 0) continue;
    auto it = allocations_.upper_bound(word);
    if (it == allocations_.begin()) continue;
    --it;
    if (word >= it->first + it->second.bytes) continue;  // not in this context's memory
    const bool stated = std::any_of(accesses.begin(), accesses.end(), [&](const Access& a) {
      return word >= a.address && (word < a.address + a.bytes || (a.bytes == 0 && word == a.address));
    });
    MT_ASSERT(stated, fmt::format("vulkan: a dispatch is handed device address {:#x} (push constant bytes {}..{}) "
                                  "in no range it states",
                                  word, at, at + 8));
  }
}

void VulkanContext::submit() {
  close_chunk();
  if (!recording_) return;
  Batch& b = batches_[current_];
  check(vkEndCommandBuffer(b.commands), "vkEndCommandBuffer");
  recording_ = false;
  auto info = vk_struct<VkSubmitInfo>(VK_STRUCTURE_TYPE_SUBMIT_INFO);
  info.commandBufferCount = 1;
  info.pCommandBuffers = &b.commands;
  check(vkQueueSubmit(queue_, 1, &info, b.fence), "vkQueueSubmit");
  b.in_flight = true;
  b.submission = ++counters_.submissions;
}

void VulkanContext::finished(Batch& b) {
  check(vkResetFences(device_, 1, &b.fence), "vkResetFences");
  check(vkResetCommandBuffer(b.commands, 0), "vkResetCommandBuffer");
  b.in_flight = false;
}

void VulkanContext::retire(size_t batch, uint64_t submission) {
  Batch& b = batches_[batch];
  if (!b.in_flight || b.submission != submission) return;  // a flush already saw it through
  check(vkWaitForFences(device_, 1, &b.fence, VK_TRUE, UINT64_MAX), "vkWaitForFences");
  ++counters_.waits;
  if (counters_.submissions > submission) ++counters_.overlapped_waits;
  finished(b);
}

void VulkanContext::flush() {
  assert_not_recording("a wait for the device");
  submit();
  std::vector<VkFence>& fences = fence_list_;
  fences.clear();
  for (const Batch& b : batches_)
    if (b.in_flight) fences.push_back(b.fence);
  if (fences.empty()) return;
  check(vkWaitForFences(device_, static_cast<uint32_t>(fences.size()), fences.data(), VK_TRUE, UINT64_MAX),
        "vkWaitForFences");
  ++counters_.waits;
  for (Batch& b : batches_)
    if (b.in_flight) finished(b);
  marks_pending_ = false;
}

bool VulkanContext::Command::operator==(const Command& o) const {
  return kind == o.kind && object == o.object && buffer == o.buffer && a == o.a && b == o.b && c == o.c &&
         push_bytes == o.push_bytes && std::memcmp(push, o.push, push_bytes) == 0;
}

void VulkanContext::assert_not_recording(const char* what) const {
  MT_ASSERT(!recording_key_, fmt::format("vulkan: {} between begin_commands and end_commands (recorded commands "
                                         "read device memory only)",
                                         what));
}

void VulkanContext::wait_through(uint64_t submission) {
  if (recording_ && submission > counters_.submissions) submit();  // still open
  for (size_t i = 0; i < batches_.size(); ++i)
    if (batches_[i].in_flight && batches_[i].submission <= submission) retire(i, batches_[i].submission);
}

void VulkanContext::release(Recording& r) {
  if (r.user_submission != 0) wait_through(r.user_submission);
  if (!r.chunks.empty())
    vkFreeCommandBuffers(device_, pool_, static_cast<uint32_t>(r.chunks.size()), r.chunks.data());
  r = {};
}

void VulkanContext::release_recordings() {
  for (auto& [key, r] : recordings_) release(r);
  recordings_.clear();
}

void VulkanContext::begin_commands(std::span<const int64_t> key) {
  assert_not_recording("begin_commands");
  if (reuse_ == Reuse::Off) return;  // recorded as any other commands
  recording_key_.emplace(key.begin(), key.end());
  building_ = {};
  at_recording_start_ = counters_;
  // The first command recorded waits for everything before it, whatever that was when it is replayed.
  pending_.clear();
  pending_unstated_ = true;
}

void VulkanContext::end_commands() {
  if (reuse_ == Reuse::Off) return;
  MT_ASSERT(recording_key_, "vulkan: end_commands without begin_commands");
  close_chunk();  // executed by the open primary, which goes on with what follows
  Recording& built = building_;
  built.user_submission = counters_.submissions + 1;
  built.dispatches = counters_.dispatches - at_recording_start_.dispatches;
  built.barriers = counters_.barriers - at_recording_start_.barriers;
  built.last_use = ++recording_uses_;
  const std::vector<int64_t> key = std::move(*recording_key_);
  recording_key_.reset();
  // What the commands after them are ordered against, after each replay too.
  built.pending_after = pending_;
  built.unstated_after = pending_unstated_;
  const auto it = recordings_.find(key);
  if (it != recordings_.end()) {
    const std::vector<Command>& was = it->second.commands;
    if (reuse_ == Reuse::Check) {
      const size_t n = std::min(was.size(), built.commands.size());
      size_t i = 0;
      while (i < n && was[i] == built.commands[i]) ++i;
      std::string what = "the end of one of them";
      if (i < n) {
        const Command &now = built.commands[i], &then = was[i];
        what = fmt::format("kind {} then {}", static_cast<uint32_t>(now.kind), static_cast<uint32_t>(then.kind));
        if (now.kind == Command::Dispatch && then.kind == Command::Dispatch) {
          for (const auto& [k, p] : pipelines_)
            if (&p == now.object) what = "a dispatch of " + k.shader;
          size_t at = 0;
          while (at < now.push_bytes && now.push[at] == then.push[at]) ++at;
          what += fmt::format(", grid {}x{}x{} then {}x{}x{}, push constants from byte {}", now.a, now.b, now.c, then.a,
                              then.b, then.c, at);
        }
      }
      const size_t recorded = built.commands.size(), first = was.size();
      if (i != first || i != recorded) release(built);
      MT_ASSERT(i == first && i == recorded,
                fmt::format("vulkan: a repeated key's commands differ from its earlier recording at command {} ({} "
                            "now, {} then: {})",
                            i, recorded, first, what));
    }
    release(it->second);
    recordings_.erase(it);
  }
  if (recordings_.size() >= kKeptRecordings) {
    auto oldest = recordings_.begin();
    for (auto r = recordings_.begin(); r != recordings_.end(); ++r)
      if (r->second.last_use < oldest->second.last_use) oldest = r;
    release(oldest->second);
    recordings_.erase(oldest);
  }
  recordings_.emplace(key, std::move(built));
  built = {};
}

bool VulkanContext::replay(std::span<const int64_t> key) {
  assert_not_recording("replay");
  if (reuse_ != Reuse::On) return false;
  const auto it = recordings_.find(key);
  if (it == recordings_.end()) return false;
  Recording& r = it->second;
  r.last_use = ++recording_uses_;
  // A command buffer runs once at a time: the primaries that last executed these finish first (a
  // decoding step waits for its tokens, so they are done by then).
  wait_through(r.user_submission);
  vkCmdExecuteCommands(primary(), static_cast<uint32_t>(r.chunks.size()), r.chunks.data());
  r.user_submission = counters_.submissions + 1;
  counters_.replayed_command_buffers += r.chunks.size();
  counters_.dispatches += r.dispatches;
  counters_.replayed_dispatches += r.dispatches;
  counters_.barriers += r.barriers;
  for (const auto& [p, n] : r.by_pipeline) p->dispatches += n;
  pending_ = r.pending_after;
  pending_unstated_ = r.unstated_after;
  // The device starts once a primary holds kSubmitEvery dispatches, as when they are recorded.
  recorded_ += static_cast<uint32_t>(std::min<uint64_t>(r.dispatches, kSubmitEvery));
  if (recorded_ >= kSubmitEvery) submit();
  return true;
}

std::map<std::string, uint64_t> VulkanContext::dispatches_by_shader() const {
  std::map<std::string, uint64_t> by_shader;
  for (const auto& [key, p] : pipelines_)
    if (p.dispatches > 0) by_shader[key.shader] += p.dispatches;
  return by_shader;
}

void VulkanContext::mark(int i) {
  assert_not_recording("a time mark");
  if (!timestamps_) return;
  MT_ASSERT(i >= 0 && i < Backend::kTimeMarks, "vulkan: a time mark out of range");
  if (i == 0) marked_ = 0;  // a new series
  VkCommandBuffer c = recording();
  vkCmdResetQueryPool(c, timestamps_, static_cast<uint32_t>(i), 1);
  vkCmdWriteTimestamp(c, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, timestamps_, static_cast<uint32_t>(i));
  marked_ |= 1u << i;
  marks_pending_ = true;
}

uint32_t VulkanContext::series_length() const {
  uint32_t n = 0;
  while (n < static_cast<uint32_t>(Backend::kTimeMarks) && (marked_ >> n & 1u)) ++n;
  return n;
}

std::vector<double> VulkanContext::marks() {
  const uint32_t n = series_length();
  marked_ = 0;
  if (n == 0) return {};
  // A wait of its own only when a mark's work may not have finished: marks that an earlier wait
  // (a download) saw through are read as they are.
  if (marks_pending_) flush();
  std::vector<uint64_t> ticks(n);
  check(vkGetQueryPoolResults(device_, timestamps_, 0, n, n * sizeof(uint64_t), ticks.data(), sizeof(uint64_t),
                              VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT),
        "vkGetQueryPoolResults");
  return seconds_since_first(ticks.data(), n);
}

std::vector<double> VulkanContext::seconds_since_first(const uint64_t* ticks, uint32_t n) const {
  std::vector<double> seconds(n);
  for (uint32_t i = 0; i < n; ++i)
    seconds[i] = static_cast<double>((ticks[i] - ticks[0]) & timestamp_mask_) * info_.timestamp_period_ns * 1e-9;
  return seconds;
}

VulkanContext::PendingRead VulkanContext::read_later(uint64_t src, size_t bytes) {
  MT_ASSERT(bytes <= kReadbackBytes, "vulkan: a pending read larger than its slot");
  assert_not_recording("a read");
  PendingRead r{.slot = next_readback_, .bytes = bytes, .marks = series_length()};
  next_readback_ = (next_readback_ + 1) % kReadbackSlots;
  const VkDeviceSize at = r.slot * kSlotBytes;
  VkCommandBuffer c = recording();
  if (r.marks > 0)  // the series goes with the read (a query copy waits for its timestamps)
    vkCmdCopyQueryPoolResults(c, timestamps_, 0, r.marks, readback_.buffer, at, sizeof(uint64_t),
                              VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT);
  marked_ = 0;
  if (bytes > 0) {
    const auto [a, offset] = locate(src, bytes);
    order({{src, bytes, false}});
    const VkBufferCopy region{offset, at + kMarkBytes, bytes};
    vkCmdCopyBuffer(recording(), a->buffer, readback_.buffer, 1, &region);
  }
  barrier(/*host=*/true);
  r.batch = current_;
  submit();
  r.submission = batches_[r.batch].submission;
  return r;
}

std::span<const std::byte> VulkanContext::collect(const PendingRead& read, std::vector<double>& marks) {
  submit();  // what was recorded since runs while the host waits
  retire(read.batch, read.submission);
  const std::byte* slot = readback_host_ + read.slot * kSlotBytes;
  uint64_t ticks[Backend::kTimeMarks];
  std::memcpy(ticks, slot, sizeof ticks);
  marks = read.marks ? seconds_since_first(ticks, read.marks) : std::vector<double>{};
  return {slot + kMarkBytes, read.bytes};
}

void VulkanContext::upload(uint64_t dst, const void* src, size_t bytes) {
  assert_not_recording("an upload");
  const auto [a, offset] = locate(dst, bytes);
  if (bytes <= kRecordedUploadBytes && bytes % 4 == 0 && offset % 4 == 0) {
    // Small: the bytes go into the command buffer itself, so nothing waits (a step's batch).
    if (bytes == 0) return;
    order({{dst, bytes, true}});
    vkCmdUpdateBuffer(recording(), a->buffer, offset, bytes, src);
    return;
  }
  // Slices of half the staging buffer, the halves in turn, each copy submitted at once: the host
  // fills one half while the device copies out of the other. Work recorded after the upload is
  // ordered after its copies by their barriers, and the source is copied before this returns, so
  // nothing waits at the end.
  constexpr size_t kHalf = kTransferBytes / 2;
  for (size_t done = 0; done < bytes; done += kHalf) {
    const size_t n = std::min(kHalf, bytes - done);
    StagingHalf& half = staging_halves_[next_half_];
    if (half.submission != 0) retire(half.batch, half.submission);
    const size_t at = next_half_ * kHalf;
    std::memcpy(static_cast<std::byte*>(staging_host_) + at, static_cast<const std::byte*>(src) + done, n);
    const VkBufferCopy region{at, offset + done, n};
    order({{dst + done, n, true}});
    vkCmdCopyBuffer(recording(), staging_.buffer, a->buffer, 1, &region);
    const size_t batch = current_;
    submit();
    half = {batch, batches_[batch].submission};
    next_half_ ^= 1;
  }
}

void VulkanContext::download(void* dst, uint64_t src, size_t bytes) {
  download({{dst, src, bytes}});
}

void VulkanContext::download(std::initializer_list<Range> ranges) {
  assert_not_recording("a download");
  size_t at = 0;  // where the next piece goes in the staging buffer
  auto read_staged = [&] {
    barrier(/*host=*/true);
    flush();
    for (const StagedPiece& p : staged_) std::memcpy(p.dst, static_cast<const std::byte*>(staging_host_) + p.at, p.bytes);
    staged_.clear();
    at = 0;
  };
  for (const Range& r : ranges) {
    if (r.bytes == 0) continue;
    const auto [a, offset] = locate(r.src, r.bytes);
    for (size_t done = 0; done < r.bytes;) {
      if (at == kTransferBytes) read_staged();
      const size_t n = std::min(r.bytes - done, kTransferBytes - at);
      const VkBufferCopy region{offset + done, at, n};
      order({{r.src + done, n, false}});
      vkCmdCopyBuffer(recording(), a->buffer, staging_.buffer, 1, &region);
      staged_.push_back({static_cast<std::byte*>(r.dst) + done, at, n});
      done += n;
      at = std::min(kTransferBytes, (at + n + 15) / 16 * 16);
    }
  }
  if (!staged_.empty()) read_staged();
}

void VulkanContext::copy(uint64_t dst, uint64_t src, size_t bytes) {
  if (bytes == 0) return;
  const auto [to, to_offset] = locate(dst, bytes);
  const auto [from, from_offset] = locate(src, bytes);
  const VkBufferCopy region{from_offset, to_offset, bytes};
  order({{src, bytes, false}, {dst, bytes, true}});
  vkCmdCopyBuffer(recording(), from->buffer, to->buffer, 1, &region);
  note({.kind = Command::Copy, .object = from->buffer, .buffer = to->buffer, .a = from_offset, .b = to_offset,
        .c = bytes});
}

void VulkanContext::fill_words(uint64_t dst, uint32_t word, size_t bytes) {
  if (bytes == 0) return;
  const auto [a, offset] = locate(dst, bytes);
  MT_ASSERT(offset % 4 == 0 && bytes % 4 == 0, "vulkan: a fill of whole 4-byte words");
  order({{dst, bytes, true}});
  vkCmdFillBuffer(recording(), a->buffer, offset, bytes, word);
  note({.kind = Command::Fill, .buffer = a->buffer, .a = offset, .b = bytes, .c = word});
}

VulkanContext::Pipeline& VulkanContext::pipeline(std::string_view shader, std::span<const uint32_t> constants) {
  const auto it = pipelines_.find(PipelineKeyView{shader, constants});
  if (it != pipelines_.end()) return it->second;
  const std::span<const uint32_t> code = vulkan_shader(shader);
  MT_ASSERT(!code.empty(), "vulkan: no embedded shader of that name");
  Pipeline p;
  p.push_bytes = vulkan_push_constant_bytes(code);
  p.address_offsets = vulkan_push_constant_address_offsets(code);
  auto module_info = vk_struct<VkShaderModuleCreateInfo>(VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO);
  module_info.codeSize = code.size_bytes();
  module_info.pCode = code.data();
  check(vkCreateShaderModule(device_, &module_info, nullptr, &p.module), "vkCreateShaderModule");
  auto pipeline_info = vk_struct<VkComputePipelineCreateInfo>(VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO);
  pipeline_info.stage = vk_struct<VkPipelineShaderStageCreateInfo>(VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO);
  pipeline_info.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  pipeline_info.stage.module = p.module;
  pipeline_info.stage.pName = "main";
  std::vector<VkSpecializationMapEntry> entries;
  for (uint32_t i = 0; i < constants.size(); ++i)
    entries.push_back({i, static_cast<uint32_t>(i * sizeof(uint32_t)), sizeof(uint32_t)});
  const VkSpecializationInfo specialization{static_cast<uint32_t>(entries.size()), entries.data(),
                                            constants.size_bytes(), constants.data()};
  if (!constants.empty()) pipeline_info.stage.pSpecializationInfo = &specialization;
  // The cooperative-matrix shaders divide a workgroup into subgroups of exactly the device's
  // subgroup_size (a driver may otherwise pick another size per pipeline).
  auto subgroup_size = vk_struct<VkPipelineShaderStageRequiredSubgroupSizeCreateInfo>(
      VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO);
  if (shader.find("_coopmat") != std::string_view::npos) {
    subgroup_size.requiredSubgroupSize = info_.subgroup_size;
    pipeline_info.stage.pNext = &subgroup_size;
    pipeline_info.stage.flags = VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT;
  }
  pipeline_info.layout = layout_;
  check(vkCreateComputePipelines(device_, VK_NULL_HANDLE, 1, &pipeline_info, nullptr, &p.pipeline),
        "vkCreateComputePipelines");
  return pipelines_.emplace(PipelineKey{std::string(shader), {constants.begin(), constants.end()}}, p).first->second;
}

void VulkanContext::dispatch(std::string_view shader, std::span<const uint32_t> constants,
                             std::span<const std::byte> push, uint32_t groups_x, uint32_t groups_y, uint32_t groups_z,
                             double flops, double bytes, std::span<const Access> accesses) {
  MT_ASSERT(push.size() <= 128, "vulkan: push constants of at most 128 bytes");
  if (groups_x == 0 || groups_y == 0 || groups_z == 0) return;
  Pipeline& p = pipeline(shader, constants);
  // The C++ push struct and the shader's block agree (a member missing or added on one side
  // fails here, at every dispatch of that shader, not as wrong numbers).
  MT_ASSERT(push.size() >= p.push_bytes && push.size() <= (p.push_bytes + 7) / 8 * 8,
            fmt::format("vulkan: {} pushes {} bytes of constants; shaders/{}.comp declares {}", shader, push.size(),
                        shader, p.push_bytes));
  if (!accesses.empty()) check_stated(push, p.address_offsets, accesses);
  if (profile_) flush();  // time this dispatch alone
  const auto start = std::chrono::steady_clock::now();
  order(accesses);
  VkCommandBuffer c = recording();
  if (profile_queries_) {
    vkCmdResetQueryPool(c, profile_queries_, 0, 2);
    vkCmdWriteTimestamp(c, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, profile_queries_, 0);
  }
  vkCmdBindPipeline(c, VK_PIPELINE_BIND_POINT_COMPUTE, p.pipeline);
  vkCmdPushConstants(c, layout_, VK_SHADER_STAGE_COMPUTE_BIT, 0, static_cast<uint32_t>(push.size()), push.data());
  vkCmdDispatch(c, groups_x, groups_y, groups_z);
  if (profile_queries_) vkCmdWriteTimestamp(c, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, profile_queries_, 1);
  ++counters_.dispatches;
  ++p.dispatches;
  if (recording_key_) {
    // The bytes the shader declares (a C++ struct's padding after them is no part of the command).
    Command command{.kind = Command::Dispatch, .object = &p, .a = groups_x, .b = groups_y, .c = groups_z,
                    .push_bytes = static_cast<uint32_t>(p.push_bytes)};
    std::memcpy(command.push, push.data(), p.push_bytes);
    note(command);
    ++building_.by_pipeline[&p];
  }
  // The device starts on what is recorded while the host records the rest of the step.
  if (++recorded_ >= kSubmitEvery) submit();
  if (profile_) {
    flush();
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (profile_queries_) {
      uint64_t ticks[2] = {0, 0};
      check(vkGetQueryPoolResults(device_, profile_queries_, 0, 2, sizeof(ticks), ticks, sizeof(uint64_t),
                                  VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT),
            "vkGetQueryPoolResults");
      seconds = static_cast<double>((ticks[1] - ticks[0]) & timestamp_mask_) * info_.timestamp_period_ns * 1e-9;
    }
    ProfileEntry& e = profile_entries_[std::string(shader)];
    e.seconds += seconds;
    e.flops += flops;
    e.bytes += bytes;
    e.workgroups += uint64_t{groups_x} * groups_y * groups_z;
    ++e.dispatches;
  }
}

}  // namespace memtune

// The Vulkan devices of this machine (see device.h).
#include "backend/vulkan/device.h"

#include "backend/vulkan/geometry.h"

#include <vulkan/vulkan.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "backend/vulkan/cooperative_matrix.h"
#include "backend/vulkan/shaders.h"
#include "core/console.h"
#include "core/error.h"

namespace memtune {

namespace {

std::string component_name(VkComponentTypeKHR t) {
  switch (t) {
    case VK_COMPONENT_TYPE_FLOAT16_KHR: return "float16";
    case VK_COMPONENT_TYPE_FLOAT32_KHR: return "float32";
    case VK_COMPONENT_TYPE_FLOAT64_KHR: return "float64";
    case VK_COMPONENT_TYPE_SINT8_KHR: return "sint8";
    case VK_COMPONENT_TYPE_SINT16_KHR: return "sint16";
    case VK_COMPONENT_TYPE_SINT32_KHR: return "sint32";
    case VK_COMPONENT_TYPE_SINT64_KHR: return "sint64";
    case VK_COMPONENT_TYPE_UINT8_KHR: return "uint8";
    case VK_COMPONENT_TYPE_UINT16_KHR: return "uint16";
    case VK_COMPONENT_TYPE_UINT32_KHR: return "uint32";
    case VK_COMPONENT_TYPE_UINT64_KHR: return "uint64";
    case VK_COMPONENT_TYPE_BFLOAT16_KHR: return "bfloat16";
    default: return fmt::format("type {}", static_cast<int>(t));
  }
}
std::string scope_name(VkScopeKHR s) {
  switch (s) {
    case VK_SCOPE_DEVICE_KHR: return "device";
    case VK_SCOPE_WORKGROUP_KHR: return "workgroup";
    case VK_SCOPE_SUBGROUP_KHR: return "subgroup";
    case VK_SCOPE_QUEUE_FAMILY_KHR: return "queue family";
    default: return fmt::format("scope {}", static_cast<int>(s));
  }
}

std::string version_text(uint32_t v) {
  return fmt::format("{}.{}.{}", VK_API_VERSION_MAJOR(v), VK_API_VERSION_MINOR(v), VK_API_VERSION_PATCH(v));
}

// vulkan13: the instance was made for Vulkan 1.3 (its structures may be chained where the device has it).
VulkanDeviceInfo read_device(VkInstance instance, VkPhysicalDevice pd, int index, bool vulkan13) {
  VulkanDeviceInfo d;
  d.index = index;
  VkPhysicalDeviceProperties props{};
  vkGetPhysicalDeviceProperties(pd, &props);
  d.name = props.deviceName;
  d.api_version = version_text(props.apiVersion);
  d.api = props.apiVersion;
  switch (props.deviceType) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU:
      d.type = "discrete GPU", d.type_rank = 0;
      break;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU:
      d.type = "integrated GPU", d.type_rank = 1;
      break;
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU:
      d.type = "virtual GPU", d.type_rank = 2;
      break;
    case VK_PHYSICAL_DEVICE_TYPE_CPU:
      d.type = "CPU", d.type_rank = 4;
      break;
    default:
      d.type = "other", d.type_rank = 3;
      break;
  }
  d.max_storage_buffer_range = props.limits.maxStorageBufferRange;
  d.shared_memory_bytes = props.limits.maxComputeSharedMemorySize;
  d.timestamps = props.limits.timestampComputeAndGraphics == VK_TRUE;
  d.timestamp_period_ns = props.limits.timestampPeriod;

  uint32_t count = 0;
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &count, nullptr);
  std::vector<VkExtensionProperties> extensions(count);
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &count, extensions.data());
  auto has = [&](const char* name) {
    return std::any_of(extensions.begin(), extensions.end(),
                       [&](const VkExtensionProperties& e) { return std::strcmp(e.extensionName, name) == 0; });
  };
  d.memory_budget = has("VK_EXT_memory_budget");
  d.cooperative_matrix = has("VK_NV_cooperative_matrix") || has("VK_KHR_cooperative_matrix");

  VkPhysicalDeviceMemoryProperties memory{};
  vkGetPhysicalDeviceMemoryProperties(pd, &memory);
  for (uint32_t h = 0; h < memory.memoryHeapCount; ++h)
    d.heaps.push_back(
        {memory.memoryHeaps[h].size, (memory.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) != 0});

  if (props.apiVersion < VK_API_VERSION_1_2) return d;  // the backend needs Vulkan 1.2: not usable
  auto driver = vk_struct<VkPhysicalDeviceDriverProperties>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES);
  auto maintenance =
      vk_struct<VkPhysicalDeviceMaintenance3Properties>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES);
  auto subgroup = vk_struct<VkPhysicalDeviceSubgroupProperties>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES);
  auto size_control = vk_struct<VkPhysicalDeviceSubgroupSizeControlProperties>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES);
  maintenance.pNext = &driver;
  if (vulkan13 && props.apiVersion >= VK_API_VERSION_1_3) driver.pNext = &size_control;
  subgroup.pNext = &maintenance;
  auto props2 = vk_struct<VkPhysicalDeviceProperties2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2);
  props2.pNext = &subgroup;
  vkGetPhysicalDeviceProperties2(pd, &props2);
  d.driver = driver.driverName;
  d.driver_info = driver.driverInfo;
  d.max_allocation_bytes = maintenance.maxMemoryAllocationSize;
  d.subgroup_size = subgroup.subgroupSize;
  d.subgroup_shuffle = (subgroup.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) != 0 &&
                       (subgroup.supportedOperations & VK_SUBGROUP_FEATURE_SHUFFLE_BIT) != 0;

  auto f11 = vk_struct<VkPhysicalDeviceVulkan11Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES);
  auto f12 = vk_struct<VkPhysicalDeviceVulkan12Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES);
  auto f13 = vk_struct<VkPhysicalDeviceVulkan13Features>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES);
  auto matrices = vk_struct<VkPhysicalDeviceCooperativeMatrixFeaturesKHR>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR);
  f11.pNext = &f12;
  void** tail = &f12.pNext;
  if (vulkan13 && props.apiVersion >= VK_API_VERSION_1_3) {
    *tail = &f13;
    tail = &f13.pNext;
  }
  auto matrices2 = vk_struct<VkPhysicalDeviceCooperativeMatrix2FeaturesNV>(
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV);
  if (has(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME)) {
    *tail = &matrices;
    tail = &matrices.pNext;
    if (has(VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME)) *tail = &matrices2;
  }
  auto features = vk_struct<VkPhysicalDeviceFeatures2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2);
  features.pNext = &f11;
  vkGetPhysicalDeviceFeatures2(pd, &features);
  d.shader_float16 = f12.shaderFloat16 == VK_TRUE;
  d.shader_int8 = f12.shaderInt8 == VK_TRUE;
  d.subgroup_size_control = f13.subgroupSizeControl == VK_TRUE && f13.computeFullSubgroups == VK_TRUE &&
                            (size_control.requiredSubgroupSizeStages & VK_SHADER_STAGE_COMPUTE_BIT) != 0 &&
                            d.subgroup_size >= size_control.minSubgroupSize &&
                            d.subgroup_size <= size_control.maxSubgroupSize;
  d.khr_cooperative_matrix = matrices.cooperativeMatrix == VK_TRUE;
  const auto shapes = reinterpret_cast<PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR>(
      vkGetInstanceProcAddr(instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"));
  if (d.khr_cooperative_matrix && shapes) {
    uint32_t n = 0;
    shapes(pd, &n, nullptr);
    std::vector<VkCooperativeMatrixPropertiesKHR> list(
        n, vk_struct<VkCooperativeMatrixPropertiesKHR>(VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR));
    shapes(pd, &n, list.data());
    for (const VkCooperativeMatrixPropertiesKHR& s : list)
      d.matrix_shapes.push_back({s.MSize, s.NSize, s.KSize, component_name(s.AType), component_name(s.BType),
                                 component_name(s.CType), component_name(s.ResultType), scope_name(s.scope)});
  }
  d.nv_cooperative_matrix2 = d.khr_cooperative_matrix && matrices2.cooperativeMatrixFlexibleDimensions == VK_TRUE &&
                             matrices2.cooperativeMatrixReductions == VK_TRUE &&
                             matrices2.cooperativeMatrixConversions == VK_TRUE &&
                             matrices2.cooperativeMatrixPerElementOperations == VK_TRUE;
  const auto flexible = reinterpret_cast<PFN_vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV>(
      vkGetInstanceProcAddr(instance, "vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV"));
  if (d.nv_cooperative_matrix2 && flexible) {
    auto limits = vk_struct<VkPhysicalDeviceCooperativeMatrix2PropertiesNV>(
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_PROPERTIES_NV);
    auto limits2 = vk_struct<VkPhysicalDeviceProperties2>(VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2);
    limits2.pNext = &limits;
    vkGetPhysicalDeviceProperties2(pd, &limits2);
    d.flexible_max_dimension = limits.cooperativeMatrixFlexibleDimensionsMaxDimension;
    uint32_t n = 0;
    flexible(pd, &n, nullptr);
    std::vector<VkCooperativeMatrixFlexibleDimensionsPropertiesNV> list(
        n, vk_struct<VkCooperativeMatrixFlexibleDimensionsPropertiesNV>(
               VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV));
    flexible(pd, &n, list.data());
    for (const VkCooperativeMatrixFlexibleDimensionsPropertiesNV& s : list)
      d.flexible_shapes.push_back({s.MGranularity, s.NGranularity, s.KGranularity, component_name(s.AType),
                                   component_name(s.BType), component_name(s.CType), component_name(s.ResultType),
                                   scope_name(s.scope)});
  }
  d.storage_16bit = f11.storageBuffer16BitAccess == VK_TRUE;
  d.shader_int64 = features.features.shaderInt64 == VK_TRUE;
  d.shader_float64 = features.features.shaderFloat64 == VK_TRUE;
  d.buffer_device_address = f12.bufferDeviceAddress == VK_TRUE;
  return d;
}

}  // namespace

uint64_t VulkanDeviceInfo::device_heap_bytes() const {
  uint64_t largest = 0;
  for (const VulkanHeap& h : heaps)
    if (h.device_local) largest = std::max(largest, h.bytes);
  return largest;
}

VulkanDevices vulkan_devices() {
  VulkanDevices out;
  uint32_t loader = 0;
  if (vkEnumerateInstanceVersion(&loader) != VK_SUCCESS) {
    out.problem = "the Vulkan loader (libvulkan) does not answer";
    return out;
  }
  out.loader_version = version_text(loader);
  auto app = vk_struct<VkApplicationInfo>(VK_STRUCTURE_TYPE_APPLICATION_INFO);
  app.pApplicationName = "memtune";
  app.apiVersion = loader >= VK_API_VERSION_1_3 ? VK_API_VERSION_1_3 : VK_API_VERSION_1_2;
  auto info = vk_struct<VkInstanceCreateInfo>(VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO);
  info.pApplicationInfo = &app;
  VkInstance instance = VK_NULL_HANDLE;
  if (const VkResult r = vkCreateInstance(&info, nullptr, &instance); r != VK_SUCCESS) {
    out.problem = fmt::format(
        "no Vulkan driver (vkCreateInstance: {}); on Debian, mesa-vulkan-drivers provides "
        "lavapipe, a Vulkan device on the CPU",
        static_cast<int>(r));
    return out;
  }
  uint32_t count = 0;
  vkEnumeratePhysicalDevices(instance, &count, nullptr);
  std::vector<VkPhysicalDevice> devices(count);
  vkEnumeratePhysicalDevices(instance, &count, devices.data());
  for (uint32_t i = 0; i < count; ++i)
    out.devices.push_back(read_device(instance, devices[i], static_cast<int>(i), app.apiVersion >= VK_API_VERSION_1_3));
  vkDestroyInstance(instance, nullptr);
  if (out.devices.empty()) out.problem = "the Vulkan loader lists no device";
  return out;
}

const VulkanDeviceInfo& choose_vulkan_device(const VulkanDevices& found, std::optional<int> requested) {
  std::string source = "--vulkan_device";
  if (!requested) {
    if (const char* env = std::getenv("MEMTUNE_VULKAN_DEVICE"); env && *env) {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (*end != '\0') throw Error(fmt::format("MEMTUNE_VULKAN_DEVICE=\"{}\": expected a device index", env));
      requested = static_cast<int>(v);
      source = "MEMTUNE_VULKAN_DEVICE";
    }
  }
  if (found.devices.empty()) throw Error(fmt::format("--backend vulkan: {}", found.problem));
  if (requested) {
    if (*requested < 0 || *requested >= static_cast<int>(found.devices.size()))
      throw Error(fmt::format("{} {}: this machine has Vulkan devices 0 to {} (memtune devices lists them)", source,
                              *requested, found.devices.size() - 1));
    const VulkanDeviceInfo& d = found.devices[static_cast<size_t>(*requested)];
    if (!d.usable())
      throw Error(
          fmt::format("{} {}: {} lacks what the backend needs (Vulkan 1.2 with buffer device addresses, "
                      "64-bit integers, 16-bit storage, subgroups of 8 with shuffles and 32 KiB of shared memory)",
                      source, *requested, d.name));
    return d;
  }
  const VulkanDeviceInfo* best = nullptr;
  for (const VulkanDeviceInfo& d : found.devices)
    if (d.usable() && (!best || d.type_rank < best->type_rank)) best = &d;
  if (!best)
    throw Error(
        "--backend vulkan: no Vulkan device has buffer device addresses, 64-bit integers, 16-bit storage, "
        "subgroups of 8 with shuffles and 32 KiB of shared memory (memtune devices lists them)");
  return *best;
}

namespace {
// The largest subgroup-scope shape of operand x operand -> result (accumulated in result) the
// device reports, a square m x n of 8 or 16 and k of 8, 16 or 32, where the build has `shader` and
// the device VK_KHR_cooperative_matrix, Vulkan 1.3, the arithmetic the types need (`arithmetic`,
// named so) and subgroup size control; or none, `why` saying why.
std::optional<VulkanMatrixShape> matrix_shape(const VulkanDeviceInfo& d, const char* shader, bool arithmetic,
                                              const char* arithmetic_name, const char* operand, const char* result,
                                              std::string* why) {
  auto no = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (vulkan_shader(shader).empty())
    return no("built without a shader compiler that knows GL_KHR_cooperative_matrix (scripts/coopmat-root.sh)");
  if (!d.khr_cooperative_matrix) return no("the device has no VK_KHR_cooperative_matrix");
  if (d.api < VK_API_VERSION_1_3) return no("the device is not Vulkan 1.3");
  if (!arithmetic) return no(fmt::format("the device has no {} arithmetic in shaders", arithmetic_name));
  if (!d.subgroup_size_control) return no("the device cannot require a compute pipeline's subgroup size");
  const VulkanMatrixShape* best = nullptr;
  for (const VulkanMatrixShape& s : d.matrix_shapes) {
    const bool fits = s.a == operand && s.b == operand && s.c == result && s.result == result &&
                      s.scope == "subgroup" && s.m == s.n && (s.m == 8 || s.m == 16) &&
                      (s.k == 8 || s.k == 16 || s.k == 32);
    if (fits && (!best || s.m * s.n * s.k > best->m * best->n * best->k)) best = &s;
  }
  if (!best) return no(fmt::format("the device reports no subgroup {} x {} -> {} shape of 8 or 16", operand, operand, result));
  return *best;
}
}  // namespace

std::optional<VulkanMatrixShape> cooperative_product_shape(const VulkanDeviceInfo& d, DType operands,
                                                           std::string* why) {
  if (operands != DType::F16) {
    if (why) *why = fmt::format("this build has no {} cooperative-matrix variant", dtype_torch_name(operands));
    return std::nullopt;
  }
  return matrix_shape(d, "gemm_coopmat", d.shader_float16, "float16", "float16", "float32", why);
}

std::optional<VulkanMatrixShape> cooperative_int8_shape(const VulkanDeviceInfo& d, std::string* why) {
  return matrix_shape(d, "quantized_matmul_int8_coopmat", d.shader_int8, "8-bit integer", "sint8", "sint32", why);
}

std::optional<VulkanMatrixShape> cooperative_flexible_shape(const VulkanDeviceInfo& d, std::string* why) {
  auto no = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (vulkan_shader("attention_coopmat2").empty())
    return no("built without a shader compiler that knows GL_NV_cooperative_matrix2 (scripts/coopmat-root.sh)");
  if (!cooperative_product_shape(d, DType::F16, why)) return std::nullopt;
  if (!d.nv_cooperative_matrix2)
    return no("the device has no VK_NV_cooperative_matrix2 with flexible dimensions, reductions, conversions and "
              "per-element operations");
  if (d.flexible_max_dimension < 256) return no("the device's flexible matrices stop short of 256");
  for (const VulkanMatrixShape& s : d.flexible_shapes)
    if (s.a == "float16" && s.b == "float16" && s.c == "float32" && s.result == "float32" && s.scope == "subgroup" &&
        s.m > 0 && s.n > 0 && s.k > 0 && s.m <= 16 && s.n <= 16 && s.k <= 32)
      return s;
  return no("the device reports no flexible subgroup float16 x float16 -> float32 shape of granularity 16 or less");
}

std::vector<std::pair<std::string, std::string>> vulkan_kernel_variants(const VulkanDeviceInfo& d) {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("float32 products", "register-tiled float32 FMAs (gemm.comp; matvec.comp up to 32 rows)");
  for (const DType dt : {DType::F16, DType::BF16}) {
    std::string why;
    const std::optional<VulkanMatrixShape> s = cooperative_product_shape(d, dt, &why);
    out.emplace_back(fmt::format("{} products (--{})", dtype_torch_name(dt), dt == DType::F16 ? "fp16" : "bf16"),
                     s ? fmt::format("cooperative matrices {}x{}x{} (gemm_coopmat.comp)", s->m, s->n, s->k)
                       : fmt::format("float32 arithmetic of the widened operands: {}", why));
  }
  out.emplace_back("attention", "float32 FMAs (attention.comp, attention_backward_dq.comp, attention_backward_dkv.comp)");
  {
    std::string why;
    const std::optional<VulkanMatrixShape> s = cooperative_product_shape(d, DType::F16, &why);
    std::string text = fmt::format("float32 FMAs, as attention: {}", why);
    if (s) {
      // The tiles (forward / dq / dk and dv) the device's shared memory gives Qwen's head dimensions.
      const vulkan_geometry::MatrixUnit unit{s->m, s->n, s->k, d.subgroup_size, d.shared_memory_bytes};
      // "head_dim 64: F / Q / K, head_dim 128: ..." for a family's tile function.
      const auto tiles_of = [](auto tile) {
        using vulkan_geometry::AttentionPass;
        std::string tiles;
        for (const int64_t hd : {64, 128})
          tiles += fmt::format("{}head_dim {}: {} / {} / {}", tiles.empty() ? "" : ", ", hd,
                               tile(hd, AttentionPass::Forward), tile(hd, AttentionPass::Query),
                               tile(hd, AttentionPass::Key));
        return tiles;
      };
      const std::string tiles = tiles_of([&](int64_t hd, vulkan_geometry::AttentionPass pass) {
        return vulkan_geometry::attention_coopmat_tile(hd, unit, pass);
      });
      text = fmt::format("cooperative matrices {}x{}x{} (attention_coopmat.comp, attention_backward_dq_coopmat.comp, "
                         "attention_backward_dkv_coopmat.comp); tiles of forward / dq / dk-dv rows at {} (0: float32 "
                         "FMAs)",
                         s->m, s->n, s->k, tiles);
      std::string why2;
      if (const std::optional<VulkanMatrixShape> f = cooperative_flexible_shape(d, &why2)) {
        const vulkan_geometry::MatrixUnit granularity{f->m, f->n, f->k, d.subgroup_size, d.shared_memory_bytes};
        const std::string flexible_tiles = tiles_of([&](int64_t hd, vulkan_geometry::AttentionPass pass) {
          return vulkan_geometry::attention_coopmat2_tile(hd, granularity, pass);
        });
        text += fmt::format("; before those, on flexible subgroup matrices of granularity {}x{}x{} "
                            "(VK_NV_cooperative_matrix2: attention_coopmat2.comp, attention_backward_dq_coopmat2.comp, "
                            "attention_backward_dkv_coopmat2.comp), tiles of forward / dq / dk-dv rows at {} (0: the "
                            "KHR shader)",
                            f->m, f->n, f->k, flexible_tiles);
      } else {
        text += fmt::format("; no flexible matrices: {}", why2);
      }
    }
    out.emplace_back("attention (--fp16)", text);
  }
  {
    std::string why;
    const std::optional<VulkanMatrixShape> s = cooperative_int8_shape(d, &why);
    out.emplace_back("quantized products of many rows (--quantized_activations int8)",
                     s ? fmt::format("cooperative matrices {}x{}x{} int8 x int8 -> int32, activations rounded per "
                                     "block as loaded (quantized_matmul_int8_coopmat.comp)",
                                     s->m, s->n, s->k)
                       : fmt::format("float32 FMAs of the dequantized codes, float32 inputs "
                                     "(quantized_matmul.comp): {}",
                                     why));
  }
  out.emplace_back("decode attention", "float32 FMAs, split over the context (paged_attention.comp)");
  return out;
}

std::string describe_vulkan_device(const VulkanDeviceInfo& d) {
  std::string heaps;
  for (size_t h = 0; h < d.heaps.size(); ++h)
    heaps += fmt::format("{}heap {} {}{}", h ? ", " : "", h, format_bytes(d.heaps[h].bytes),
                         d.heaps[h].device_local ? " device-local" : "");
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  return fmt::format(
      "{} ({}; {} {}, Vulkan {})\n  memory: {}; one allocation up to {}, one storage binding up to {}\n"
      "  features: 16-bit storage {}, 64-bit integers {}, 64-bit floats {}, buffer device address {}, subgroup {}{}, "
      "shared memory {}, "
      "cooperative matrix {}, memory budget {}, timestamps {}",
      d.name, d.type, d.driver, d.driver_info, d.api_version, heaps, format_bytes(d.max_allocation_bytes),
      format_bytes(d.max_storage_buffer_range), yes(d.storage_16bit), yes(d.shader_int64), yes(d.shader_float64),
      yes(d.buffer_device_address),
      d.subgroup_size, d.subgroup_shuffle ? " with shuffles" : " without shuffles", format_bytes(d.shared_memory_bytes), yes(d.cooperative_matrix), yes(d.memory_budget),
      yes(d.timestamps)) +
         [&] {
           auto list = [](const std::vector<VulkanMatrixShape>& shapes) {
             std::string out;
             for (const VulkanMatrixShape& s : shapes)
               out += fmt::format("{}{}x{}x{} {} x {} -> {}", out.empty() ? "" : ", ", s.m, s.n, s.k, s.a, s.b,
                                  s.result);
             return out;
           };
           std::string text = d.matrix_shapes.empty() ? "" : "\n  cooperative matrix shapes: " + list(d.matrix_shapes);
           if (!d.flexible_shapes.empty())
             text += fmt::format("\n  flexible matrix granularities (VK_NV_cooperative_matrix2, up to {}): {}",
                                 d.flexible_max_dimension, list(d.flexible_shapes));
           for (const auto& [family, kernel] : vulkan_kernel_variants(d)) text += fmt::format("\n  {}: {}", family, kernel);
           return text;
         }();
}

namespace {
nlohmann::json shapes_json(const std::vector<VulkanMatrixShape>& shapes) {
  nlohmann::json list = nlohmann::json::array();
  for (const VulkanMatrixShape& s : shapes)
    list.push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"a", s.a}, {"b", s.b}, {"c", s.c}, {"result", s.result},
                    {"scope", s.scope}});
  return list;
}
}  // namespace

nlohmann::json vulkan_device_json(const VulkanDeviceInfo& d) {
  nlohmann::json heaps = nlohmann::json::array();
  for (const VulkanHeap& h : d.heaps) heaps.push_back({{"bytes", h.bytes}, {"device_local", h.device_local}});
  return {{"index", d.index},
          {"name", d.name},
          {"type", d.type},
          {"driver", d.driver},
          {"driver_info", d.driver_info},
          {"api_version", d.api_version},
          {"heaps", heaps},
          {"device_heap_bytes", d.device_heap_bytes()},
          {"max_allocation_bytes", d.max_allocation_bytes},
          {"max_storage_buffer_range", d.max_storage_buffer_range},
          {"subgroup_size", d.subgroup_size},
          {"subgroup_shuffle", d.subgroup_shuffle},
          {"shared_memory_bytes", d.shared_memory_bytes},
          {"storage_16bit", d.storage_16bit},
          {"shader_int64", d.shader_int64},
          {"shader_float64", d.shader_float64},
          {"buffer_device_address", d.buffer_device_address},
          {"cooperative_matrix", d.cooperative_matrix},
          {"cooperative_matrix_shapes", shapes_json(d.matrix_shapes)},
          {"cooperative_matrix2", d.nv_cooperative_matrix2},
          {"flexible_matrix_max_dimension", d.flexible_max_dimension},
          {"flexible_matrix_granularities", shapes_json(d.flexible_shapes)},
          {"kernels",
           [&] {
             nlohmann::json kernels = nlohmann::json::object();
             for (const auto& [family, kernel] : vulkan_kernel_variants(d)) kernels[family] = kernel;
             return kernels;
           }()},
          {"memory_budget", d.memory_budget},
          {"timestamps", d.timestamps},
          {"usable", d.usable()}};
}

}  // namespace memtune

// VK_KHR_cooperative_matrix's types, for Vulkan headers older than the extension (Debian 12's
// 1.3.239 has none of it): the values are the registry's, so a newer header's definitions win.
#pragma once

#include <vulkan/vulkan.h>

#ifndef VK_KHR_cooperative_matrix
#define VK_KHR_cooperative_matrix 1
#define VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME "VK_KHR_cooperative_matrix"
constexpr VkStructureType VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR =
    static_cast<VkStructureType>(1000506000);
constexpr VkStructureType VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR = static_cast<VkStructureType>(1000506001);
enum VkComponentTypeKHR {
  VK_COMPONENT_TYPE_FLOAT16_KHR = 0,
  VK_COMPONENT_TYPE_FLOAT32_KHR = 1,
  VK_COMPONENT_TYPE_FLOAT64_KHR = 2,
  VK_COMPONENT_TYPE_SINT8_KHR = 3,
  VK_COMPONENT_TYPE_SINT16_KHR = 4,
  VK_COMPONENT_TYPE_SINT32_KHR = 5,
  VK_COMPONENT_TYPE_SINT64_KHR = 6,
  VK_COMPONENT_TYPE_UINT8_KHR = 7,
  VK_COMPONENT_TYPE_UINT16_KHR = 8,
  VK_COMPONENT_TYPE_UINT32_KHR = 9,
  VK_COMPONENT_TYPE_UINT64_KHR = 10,
  VK_COMPONENT_TYPE_BFLOAT16_KHR = 1000141000,
  VK_COMPONENT_TYPE_MAX_ENUM_KHR = 0x7FFFFFFF
};
enum VkScopeKHR {
  VK_SCOPE_DEVICE_KHR = 1,
  VK_SCOPE_WORKGROUP_KHR = 2,
  VK_SCOPE_SUBGROUP_KHR = 3,
  VK_SCOPE_QUEUE_FAMILY_KHR = 5,
  VK_SCOPE_MAX_ENUM_KHR = 0x7FFFFFFF
};
struct VkCooperativeMatrixPropertiesKHR {
  VkStructureType sType;
  void* pNext;
  uint32_t MSize, NSize, KSize;
  VkComponentTypeKHR AType, BType, CType, ResultType;
  VkBool32 saturatingAccumulation;
  VkScopeKHR scope;
};
struct VkPhysicalDeviceCooperativeMatrixFeaturesKHR {
  VkStructureType sType;
  void* pNext;
  VkBool32 cooperativeMatrix;
  VkBool32 cooperativeMatrixRobustBufferAccess;
};
typedef VkResult(VKAPI_PTR* PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR)(
    VkPhysicalDevice physicalDevice, uint32_t* pPropertyCount, VkCooperativeMatrixPropertiesKHR* pProperties);
#endif

// VK_NV_cooperative_matrix2's features, properties and flexible-dimension shapes (attention's
// passes on subgroup matrices of flexible size, shaders/coopmat/attention_coopmat2.glsl), for
// headers older than it (the registry's values and layouts).
#ifndef VK_NV_cooperative_matrix2
#define VK_NV_cooperative_matrix2 1
#define VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME "VK_NV_cooperative_matrix2"
constexpr VkStructureType VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV =
    static_cast<VkStructureType>(1000593000);
constexpr VkStructureType VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV =
    static_cast<VkStructureType>(1000593001);
constexpr VkStructureType VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_PROPERTIES_NV =
    static_cast<VkStructureType>(1000593002);
struct VkPhysicalDeviceCooperativeMatrix2FeaturesNV {
  VkStructureType sType;
  void* pNext;
  VkBool32 cooperativeMatrixWorkgroupScope;
  VkBool32 cooperativeMatrixFlexibleDimensions;
  VkBool32 cooperativeMatrixReductions;
  VkBool32 cooperativeMatrixConversions;
  VkBool32 cooperativeMatrixPerElementOperations;
  VkBool32 cooperativeMatrixTensorAddressing;
  VkBool32 cooperativeMatrixBlockLoads;
};
struct VkPhysicalDeviceCooperativeMatrix2PropertiesNV {
  VkStructureType sType;
  void* pNext;
  uint32_t cooperativeMatrixWorkgroupScopeMaxWorkgroupSize;
  uint32_t cooperativeMatrixFlexibleDimensionsMaxDimension;
  uint32_t cooperativeMatrixWorkgroupScopeReservedSharedMemory;
};
struct VkCooperativeMatrixFlexibleDimensionsPropertiesNV {
  VkStructureType sType;
  void* pNext;
  uint32_t MGranularity, NGranularity, KGranularity;
  VkComponentTypeKHR AType, BType, CType, ResultType;
  VkBool32 saturatingAccumulation;
  VkScopeKHR scope;
  uint32_t workgroupInvocations;
};
typedef VkResult(VKAPI_PTR* PFN_vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV)(
    VkPhysicalDevice physicalDevice, uint32_t* pPropertyCount, VkCooperativeMatrixFlexibleDimensionsPropertiesNV* pProperties);
#endif

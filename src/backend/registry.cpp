// The backends of this build, by name.
#include "backend/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/reference/reference_backend.h"
#include "backend/vulkan/vulkan_backend.h"
#include "core/error.h"

namespace memtune {
namespace {

// The registry: every backend of this build, by name, in the order flags list them.
struct NamedBackend {
  std::string_view name;
  Backend& (*get)();
};
constexpr NamedBackend kBackends[] = {
    {"cpu", cpu_backend}, {"reference", reference_backend}, {"vulkan", vulkan_backend}};

}  // namespace

Backend& backend_named(std::string_view name) {
  for (const NamedBackend& b : kBackends)
    if (b.name == name) return b.get();
  throw Error(fmt::format("--backend: unknown backend \"{}\" (expected one of: {})", name, backend_names()));
}

std::vector<std::string_view> backend_list() {
  std::vector<std::string_view> names;
  for (const NamedBackend& b : kBackends)
    if (b.name != "vulkan" || vulkan_backend_available()) names.push_back(b.name);
  return names;
}

Backend& default_backend() {
  return cpu_backend();
}

std::string backend_names() {
  std::vector<std::string_view> names;
  for (const NamedBackend& b : kBackends) names.push_back(b.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace memtune

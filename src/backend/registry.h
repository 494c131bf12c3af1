// The registry: the backends of this build by name. Its own file, so the interface (backend.h)
// includes no implementation; this is the one place that names cpu/, reference/ and vulkan/.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace memtune {

// The backends of this build by name ("cpu", "reference", "vulkan"); an Error listing them
// otherwise (and for vulkan, one naming the problem when this machine has no usable device).
// Backends are process-wide: one instance each, created on first use.
Backend& backend_named(std::string_view name);
Backend& default_backend();  // cpu
// Every backend this machine can run ("cpu", "reference", and "vulkan" where a Vulkan device is
// usable): what tests run on.
std::vector<std::string_view> backend_list();
// "cpu, reference, vulkan" (every backend of the build): for flag help and error messages.
std::string backend_names();

}  // namespace memtune

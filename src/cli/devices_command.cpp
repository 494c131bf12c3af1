// `memtune devices`: the Vulkan devices of this machine with their memory and features, and the
// one `--backend vulkan` would take (what nvidia-smi and vulkaninfo --summary tell, in one screen).
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "backend/vulkan/device.h"
#include "backend/vulkan/vulkan_backend.h"
#include "cli/commands.h"
#include "core/error.h"

namespace memtune::cli {

Action add_devices(CLI::App& app) {
  struct Args {
    bool json = false;
    std::optional<int> vulkan_device;
  };
  auto a = std::make_shared<Args>();
  app.add_flag("--json", a->json, "print the devices as JSON");
  app.add_option("--vulkan_device", a->vulkan_device, "the device index --backend vulkan should take (to check it)");
  return [a] {
    const VulkanDevices found = vulkan_devices();
    std::optional<int> chosen;
    std::string why_none;
    try {
      chosen = choose_vulkan_device(found, a->vulkan_device).index;
    } catch (const Error& e) {
      if (a->vulkan_device) throw;
      why_none = e.what();
    }
    if (chosen && !vulkan_backend_available()) {  // a sanitizer build leaves the backend out
      chosen.reset();
      why_none = "this build of memtune has no vulkan backend (a sanitizer build)";
    }
    if (a->json) {
      nlohmann::json out = {{"loader_version", found.loader_version},
                            {"devices", nlohmann::json::array()},
                            {"backend_vulkan_device", chosen ? nlohmann::json(*chosen) : nlohmann::json(nullptr)},
                            {"vulkan_backend_built", vulkan_backend_available()}};
      for (const VulkanDeviceInfo& d : found.devices) out["devices"].push_back(vulkan_device_json(d));
      if (!found.problem.empty()) out["problem"] = found.problem;
      std::cout << out.dump(2) << "\n";
      return;
    }
    if (found.devices.empty()) {
      std::cout << fmt::format("no Vulkan device: {}\n", found.problem);
      return;
    }
    std::cout << fmt::format("Vulkan devices (loader {}):\n", found.loader_version);
    for (const VulkanDeviceInfo& d : found.devices)
      std::cout << fmt::format("[{}] {}\n", d.index, describe_vulkan_device(d));
    if (chosen)
      std::cout << fmt::format("--backend vulkan takes device {} ({}){}\n", *chosen,
                               found.devices[static_cast<size_t>(*chosen)].name,
                               found.devices[static_cast<size_t>(*chosen)].type == "CPU"
                                   ? ": a Vulkan implementation on the CPU, for tests, slower than --backend cpu"
                                   : "");
    else
      std::cout << why_none << "\n";
  };
}

}  // namespace memtune::cli

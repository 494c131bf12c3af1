// `memtune report DIR`: regenerates DIR/report.html from the run files in DIR; and the record of
// a subcommand's arguments that train and eval write next to their outputs.
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "report/report.h"

namespace memtune::cli {

nlohmann::json arguments_json(const CLI::App& app) {
  nlohmann::json out = nlohmann::json::object();
  for (const CLI::Option* opt : app.get_options()) {
    const std::string name = opt->get_name();
    if (name.empty() || name == "--help" || name == "--config") continue;
    std::string value = opt->count() > 0 ? opt->as<std::string>() : opt->get_default_str();
    if (opt->count() > 0 && opt->get_expected_max() > 1) {
      value.clear();
      for (const std::string& r : opt->results()) value += (value.empty() ? "" : ",") + r;
    }
    if (opt->count() > 0 && opt->get_type_size() == 0) value = "true";  // a flag that was given
    if (value.empty()) continue;
    out[name.substr(name.find_first_not_of('-'))] = value;
  }
  return out;
}

Action add_report(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  app.add_option("dir", *dir, "a train or eval output_dir")->required()->check(CLI::ExistingDirectory);
  return [dir] { std::cout << fmt::format("wrote {}\n", write_report(*dir).string()); };
}

}  // namespace memtune::cli

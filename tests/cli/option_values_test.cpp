// Every option of every command that takes a floating-point value refuses nan and inf, whatever
// type name it declares: the test walks the app main() parses, finds the floating-point options
// by what they accept (a fraction, but not a word), and feeds each "nan", "inf" and "-inf".
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace memtune::cli {
namespace {

// Whether the option takes `value`: its validators and its conversion into the bound variable.
bool accepts(CLI::Option* option, const std::string& value) {
  option->clear();
  try {
    option->add_result(value);
    option->run_callback();
  } catch (const std::exception&) {
    option->clear();
    return false;
  }
  option->clear();
  return true;
}

void walk(CLI::App* app, const std::string& path, std::vector<std::string>& floating, std::vector<std::string>& wrong) {
  for (CLI::Option* option : app->get_options()) {
    if (option->get_type_size() == 0 || option->get_name().empty() || option->get_name() == "--help") continue;
    const std::string name = path + " " + option->get_name();
    if (accepts(option, "frobnicate")) continue;                           // text: a word is a value
    if (accepts(option, "true") && accepts(option, "false")) continue;  // a flag's value
    bool fraction = false;
    for (const char* v : {"0.5", "1.5", "0.05", "100.5"}) fraction = fraction || accepts(option, v);
    if (!fraction) continue;  // integers, choices
    floating.push_back(name);
    for (const char* v : {"nan", "inf", "-inf", "NaN", "infinity", "1e999"})
      if (accepts(option, v)) wrong.push_back(name + " " + v);
  }
  for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; }))
    walk(sub, path + " " + sub->get_name(), floating, wrong);
}

TEST(OptionValues, EveryFloatingPointOptionOfEveryCommandRefusesNanAndInf) {
  CommandLine line;
  std::vector<std::string> floating, wrong;
  walk(&line.app(), "memtune", floating, wrong);
  EXPECT_TRUE(wrong.empty()) << "accepted: " << ::testing::PrintToString(wrong);
  // The walk found the floating-point flags (a walk that found none would prove nothing).
  for (const char* known : {"memtune train --learning_rate", "memtune generate --temperature", "memtune chat --top_p",
                            "memtune serve --shutdown_timeout", "memtune quantize --damp_percent",
                            "memtune generate --memory_fraction"})
    EXPECT_NE(std::find(floating.begin(), floating.end(), known), floating.end()) << known << " not found among "
                                                                                   << ::testing::PrintToString(floating);
  EXPECT_GT(floating.size(), 40u);
}

}  // namespace
}  // namespace memtune::cli

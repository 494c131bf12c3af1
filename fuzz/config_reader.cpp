// libFuzzer harness for the --config reader: drives memtune::parse_config_text
// (src/options/config_file.h) on arbitrary bytes, as YAML and as JSON, and then
// memtune::prepare_arguments on `memtune train --config FILE` so the key classification and the
// flag text built from the values run too. Every input must end in a result or a memtune::Error.
// Seeds: tests/fuzz-seeds/config_reader/ (scripts/fuzz.sh reads tests/fuzz-seeds/<target>/).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "options/arguments.h"
#include "options/config_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const char* name : {"fuzz.yaml", "fuzz.json"}) {
    memtune::fuzz::refusals_are_errors([&] { memtune::parse_config_text(text, name); });
  }
  const std::filesystem::path path = memtune::fuzz::scratch_dir() / "config.yaml";
  memtune::fuzz::write_bytes(path, text);
  // The command's options are built once: prepare_arguments only reads them.
  static CLI::App app;
  static CLI::App* const train = [] {
    CLI::App* command = app.add_subcommand("train");
    static memtune::TrainingArguments args;
    memtune::add_training_arguments(*command, args, memtune::ArgumentsFor::Plan);
    return command;
  }();
  memtune::fuzz::refusals_are_errors([&] { memtune::prepare_arguments({"train", "--config", path.string()}, 1, *train, true); });
  return 0;
}

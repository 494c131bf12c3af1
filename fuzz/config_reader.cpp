// libFuzzer harness for the --config reader: drives memtune::parse_config_text
// (src/train/config_file.h) on arbitrary bytes, as YAML and as JSON, and then
// memtune::prepare_arguments on `memtune train --config FILE` so the key classification and the
// flag text built from the values run too. Every input must end in a result or a memtune::Error.
// Seeds: tests/fuzz-seeds/config_reader/ (scripts/fuzz.sh reads tests/fuzz-seeds/<target>/).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "train/arguments.h"
#include "train/config_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const char* name : {"fuzz.yaml", "fuzz.json"}) {
    try {
      memtune::parse_config_text(text, name);
    } catch (const memtune::Error&) {
    }
  }
  static const std::string path = "/tmp/memtune_config_fuzz_" + std::to_string(getpid()) + ".yaml";
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  CLI::App app;
  CLI::App* train = app.add_subcommand("train");
  memtune::TrainingArguments args;
  memtune::add_training_arguments(*train, args, memtune::ArgumentsFor::Plan);
  try {
    memtune::prepare_arguments({"train", "--config", path}, 1, *train, true);
  } catch (const memtune::Error&) {
  }
  return 0;
}

// Command lines and config files from Hugging Face, ms-swift and LLaMA-Factory, made into memtune
// flags before CLI11 parses them. Three things happen here:
//  - a boolean flag takes a value the way Hugging Face's parser does: `--bf16`, `--bf16 true`,
//    `--bf16=False`, `--packing 0`;
//  - `--config FILE` (train, plan, eval) reads a JSON object or a YAML mapping: a Hugging Face
//    TrainingArguments dump, an ms-swift or LLaMA-Factory YAML, or memtune's own keys;
//  - every key that is not a memtune flag is classified: accepted and ignored (it does not change
//    the result: logging, hub, dataloader workers, ...; one notice line lists them), refused
//    when its value asks for something memtune cannot honour (deepspeed, fsdp, torch_compile,
//    quantization, ...; the message names memtune's equivalent), or unknown (an Error naming the
//    file and the key). A null value means "not set"; the command line overrides the file.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace memtune {

// The keys of a config file in file order, values as JSON (a YAML plain scalar becomes a bool
// or null where YAML says so, otherwise stays the text written). Errors (naming `name` and the
// line): a syntax error, a top level that is not a mapping/object, a duplicate key.
using ConfigEntries = std::vector<std::pair<std::string, nlohmann::json>>;
ConfigEntries parse_config_text(const std::string& text, const std::string& name);  // JSON if it starts with '{'
ConfigEntries read_config_file(const std::string& path);

// What the command line becomes: `args` for CLI11 (without the program name) and the keys
// accepted and ignored, for the one notice line.
struct PreparedArguments {
  std::vector<std::string> args;
  std::vector<std::string> ignored;
};

// argv without the program name; argv[0, command_at) names the subcommand `command` (e.g.
// "train", or "data stats"). With `compatible` (train, plan, eval) a --config file is expanded
// right after the subcommand name, and Hugging Face / ms-swift / LLaMA-Factory keys that are not
// memtune flags are classified, from the file and the command line alike.
PreparedArguments prepare_arguments(const std::vector<std::string>& argv, size_t command_at, const CLI::App& command,
                                    bool compatible);

// The notice line for keys accepted and ignored ("" when there are none).
std::string ignored_keys_notice(const std::vector<std::string>& ignored);

}  // namespace memtune

// `memtune train`: registers Hugging Face's training arguments and runs the training.
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "options/arguments.h"
#include "train/run.h"

namespace memtune::cli {

Action add_train(CLI::App& app, const TrainingHooks& hooks) {
  auto args = std::make_shared<TrainingArguments>();
  add_training_arguments(app, *args);
  return [args, &app, &hooks] { run_training(*args, std::cout, arguments_json(app), hooks); };
}

}  // namespace memtune::cli

// memtune_state.json of a training checkpoint, read as --resume_from_checkpoint reads it: the
// saved run's identity compared with this run's, then the position. The first byte says whether
// a changed training file is accepted.
#include <nlohmann/json.hpp>

#include "core/json_reader.h"
#include "fuzz_support.h"
#include "train/training_checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  if (size == 0) return 0;
  const RunIdentity now{.global_batch_size = 8,
                        .seed = 42,
                        .data_seed = 42,
                        .max_length = 2048,
                        .packing = false,
                        .train_data_fingerprint = "fnv1a64:0123456789abcdef"};
  fuzz::refusals_are_errors([&] {
    const nlohmann::json doc = parse_json(fuzz::text_of(data + 1, size - 1), "memtune_state.json");
    const SavedPosition p = read_saved_position(JsonReader(doc, "memtune_state.json"), now, (data[0] & 1) != 0);
    if (p.global_step < 0 || p.epoch < 0 || p.batches_in_epoch < 0 || p.optimizer_steps < 0) std::abort();
  });
  return 0;
}

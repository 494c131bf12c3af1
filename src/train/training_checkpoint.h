// Training checkpoints, one job: the checkpoint-{step} directories of an output_dir (listing,
// rotation), the optimizer state they carry, and the identity of the run that saved them. optimizer.safetensors holds,
// per trainable, its AdamW moments (exp_avg., exp_avg_sq.) and, for 16-bit weights, the float32 master (master.),
// always as whole tensors: a checkpoint does not depend on the world size or ZeRO stage that
// wrote it, and each rank reads back the part it keeps.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/json_reader.h"
#include "distributed/communicator.h"
#include "memory/arena.h"
#include "model/parameters.h"

namespace memtune {

// The checkpoint-{N} directories of output_dir, oldest first.
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::filesystem::path& output_dir);

// What an earlier run (or a model) left in output_dir that a new run would overwrite or mix with:
// checkpoint-*, tmp-checkpoint-*, run_args.json, trainer_state.json, log.jsonl, memory.json(l),
// report.html, and model or adapter files. Names, sorted; empty when none (or no directory).
std::vector<std::string> earlier_run_outputs(const std::filesystem::path& output_dir);
// Removes them (--overwrite_output_dir); anything else in the directory stays.
void remove_earlier_run_outputs(const std::filesystem::path& output_dir);

// Keeps at most `limit` checkpoints: the oldest go first, but never `keep` (the best
// checkpoint) nor the newest (with a limit of 1 and a best that is not the newest, two remain,
// as in Hugging Face).
void rotate_checkpoints(const std::filesystem::path& output_dir, int64_t limit, const std::string& keep);
// Removes a checkpoint directory so that a kill at any moment leaves it whole or gone: it is first
// renamed to a tmp-checkpoint-* name (one atomic step; a starting run clears those), then deleted.
void remove_checkpoint(const std::filesystem::path& dir);

// Every rank calls it (with ZeRO-1 the shards are gathered on rank 0); rank 0 writes `file`.
void write_optimizer_state(ModelParameters& params, Arena& arena, Communicator& comm,
                           const std::filesystem::path& file);
// Restores this rank's part of the moments and masters (masters are first set from the loaded
// weights, then overwritten by the saved float32 values).
void read_optimizer_state(ModelParameters& params, Arena& arena, const std::filesystem::path& file);

// What decides which examples a run's steps see and how they are grouped. It is saved in every
// checkpoint's memtune_state.json; a run that resumes must have the same, or its steps would not
// continue the saved run's (a different data order, batches or truncation). The world size
// itself may change: only the global batch counts.
struct RunIdentity {
  int64_t global_batch_size = 0;  // per-device batch x gradient accumulation x world size
  uint64_t seed = 0;
  uint64_t data_seed = 0;
  int64_t max_length = 0;
  bool packing = false;
  std::string train_data_fingerprint;  // file_fingerprint of the training file
};

// The fields of memtune_state.json that hold the identity.
nlohmann::json run_identity_json(const RunIdentity& identity);

// Compares the identity saved in `state` (a checkpoint's memtune_state.json) with this run's: an
// Error listing every field that differs, "field: saved X, now Y", or naming a field the file
// lacks. With ignore_data_mismatch, a different training file is accepted (the other fields are
// still compared).
void check_resume_compatible(const JsonReader& state, const RunIdentity& now, bool ignore_data_mismatch);

// Where a checkpoint's run stood: its memtune_state.json, beside trainer_state.json.
struct SavedPosition {
  int64_t global_step = 0;
  int64_t optimizer_steps = 0;  // steps that updated the weights (absent in old files: global_step)
  std::optional<double> loss_scale;
  int64_t good_steps = 0;
  int64_t epoch = 0;
  int64_t batches_in_epoch = 0;
  int64_t num_input_tokens_seen = 0;
};

// Reads a parsed memtune_state.json (`state` names the file): first checks that the saved run is
// the one resuming (check_resume_compatible), then the position; every problem is an Error naming
// the file and the field.
SavedPosition read_saved_position(const JsonReader& state, const RunIdentity& now, bool ignore_data_mismatch);

// A 64-bit FNV-1a hash of a file's bytes, "fnv1a64:<16 hex digits>"; an Error naming the file
// when it cannot be read.
std::string file_fingerprint(const std::filesystem::path& path);

}  // namespace memtune

// Training checkpoints, one job: the checkpoint-{step} directories of an output_dir (listing,
// rotation) and the optimizer state they carry. optimizer.safetensors holds, per trainable, its
// AdamW moments (exp_avg., exp_avg_sq.) and, for 16-bit weights, the float32 master (master.),
// always as whole tensors: a checkpoint does not depend on the world size or ZeRO stage that
// wrote it, and each rank reads back the part it keeps.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "memory/arena.h"
#include "model/parameters.h"

namespace memtune {

// The checkpoint-{N} directories of output_dir, oldest first.
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::filesystem::path& output_dir);

// Keeps at most `limit` checkpoints: the oldest go first, but never `keep` (the best
// checkpoint) nor the newest (with a limit of 1 and a best that is not the newest, two remain,
// as in Hugging Face).
void rotate_checkpoints(const std::filesystem::path& output_dir, int64_t limit, const std::string& keep);

// Every rank calls it (with ZeRO-1 the shards are gathered on rank 0); rank 0 writes `file`.
void write_optimizer_state(ModelParameters& params, Arena& arena, Communicator& comm,
                           const std::filesystem::path& file);
// Restores this rank's part of the moments and masters (masters are first set from the loaded
// weights, then overwritten by the saved float32 values).
void read_optimizer_state(ModelParameters& params, Arena& arena, const std::filesystem::path& file);

}  // namespace memtune

// Sizing an inference model (generate, chat, serve, plan --inference, evaluation by generation):
// it plans Decoders to learn what fits, so it sits above the model, beside the rest of a
// command's model setup.
#pragma once

#include "backend/backend.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/kv_cache.h"

namespace memtune {

// The options of an inference model for these limits. Without a budget the pool holds
// max_num_seqs sequences of max_model_len; with one, as many blocks as fit after everything
// else the plan holds. Errors name the flag: limits that are not positive, max_model_len beyond
// max_position_embeddings, max_num_batched_tokens below max_num_seqs, a budget that cannot hold
// the model plus one sequence of max_model_len.
ModelOptions inference_model_options(const ModelConfig& config, const InferenceLimits& limits, Backend* backend,
                                     bool allocate = true);

}  // namespace memtune

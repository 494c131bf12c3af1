// Evaluation by generation (`memtune eval --predict_with_generate`): each example's prompt is
// everything before its last answer (the tokens whose labels are not -100 at the end of the
// conversation; for text + label data, the label), the answer is generated greedily, and the
// text is compared with the reference after stripping whitespace at both ends:
//   exact_match               generated == reference
//   label_accuracy_generated  the candidate label the generation names (equal to it, or the
//                             longest candidate it starts with) is the reference; candidates are
//                             --labels or the distinct references. This is how classification with
//                             a chat model is usually measured, beside label scoring (eval/classification.h).
#pragma once

#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/dataset.h"
#include "generate/generator.h"
#include "model/kv_cache.h"

namespace memtune {

// The generation metrics a --metrics list names; an Error naming any other metric.
struct GenerationMetrics {
  bool exact_match = false, label_accuracy = false;
};
GenerationMetrics parse_generation_metrics(const std::string& list);
// Training with --predict_with_generate: the generation metrics of the list, and the rest (token
// metrics for the forward pass that runs too; eval_loss is always reported). An Error when the
// list names no generation metric.
struct GenerationMetricSplit {
  GenerationMetrics generation;
  std::string token_metrics;  // comma-separated, possibly empty
};
GenerationMetricSplit split_generation_metrics(const std::string& list);

// An example split at its last answer: prompt = ids[0, answer_begin), answer = the answer's ids
// (its closing <|im_end|> / eos included). An Error when the example has no answer.
struct PromptAndAnswer {
  std::span<const int32_t> prompt, answer;
};
PromptAndAnswer split_at_last_answer(std::span<const int32_t> ids, std::span<const int32_t> labels);

// What generating an evaluation set takes: max_new_tokens (given, or the longest answer + 8) and
// an inference model's limits for the longest prompt plus that, batch_size sequences at a time.
// An Error naming `source` and the example when one has no answer.
struct GenerationEvalShape {
  int64_t max_new_tokens = 0;
  InferenceLimits limits;
};
GenerationEvalShape generation_eval_shape(const Dataset& data, int64_t batch_size, int64_t max_new_tokens,
                                          const std::string& source);

struct GenerationEvalResult {
  int64_t examples = 0;                          // generated here (this rank's share)
  int64_t exact_matches = 0, label_matches = 0;  // among them
  double exact_match = 0, label_accuracy_generated = 0;
  std::vector<std::string> references, predictions, predicted_labels;  // of the examples generated here
  GenerationStats stats;
  // Fractions from the counts (after a data-parallel sum of examples and matches).
  void finish();
};

// Generates the examples of `data` on an inference model (Generator) with greedy decoding,
// stop_ids and max_new_tokens, and scores the metrics. Under data parallelism rank r generates
// examples r, r + W, ...; the candidate labels are the same on every rank (--labels, or the
// distinct references of the whole set), and the counts are to be summed before finish().
GenerationEvalResult evaluate_by_generation(Decoder& model, const Tokenizer& tokenizer, const Dataset& data,
                                            const GenerationMetrics& metrics, std::vector<std::string> labels,
                                            int64_t max_new_tokens, const std::vector<int32_t>& stop_ids,
                                            int rank = 0, int world_size = 1);

// --save_predictions: {"index", "prediction", "reference", "exact_match" (, "predicted_label")}.
void write_generation_predictions(std::ostream& out, const GenerationEvalResult& result);
nlohmann::json generation_eval_to_json(const GenerationEvalResult& result, const GenerationMetrics& metrics);

}  // namespace memtune

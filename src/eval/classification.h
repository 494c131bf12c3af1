// Classification evaluation without generation. A `text` + `label` record is a one-turn chat
// whose answer is the label; the predicted label is the candidate whose whole answer (every
// token of it, and <|im_end|>) has the highest log-probability after the prompt. Exact for
// multi-token labels: each candidate is scored as its own sequence (prompt + candidate), so a
// later token of a candidate is conditioned on that candidate's earlier tokens. The scores are
// sums streamed from the fused LM head's logits chunks; host memory is one double per candidate.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/batcher.h"
#include "data/dataset.h"
#include "memory/process_memory.h"
#include "model/decoder.h"

namespace memtune {

class Communicator;
class Tokenizer;

// The eval file's examples, each written once per candidate label, in file order:
// candidates.example(i * num_labels + k) is example i answered with labels[k].
struct ClassificationSet {
  std::vector<std::string> labels;  // candidates: --labels, else the file's labels sorted
  std::vector<int> truth;           // per example, index into labels
  Dataset candidates;
};

// True when a --metrics list asks for classification metrics (label_accuracy, macro_f1).
bool wants_classification_metrics(const std::string& metrics);

ClassificationSet build_classification_set(const std::string& path, const Tokenizer& tokenizer,
                                           const DataOptions& options, std::vector<std::string> labels);

struct ClassificationResult {
  double label_accuracy = 0, macro_f1 = 0;
  double eval_loss = 0;  // token mean over the true answers
  int64_t examples = 0;
  std::vector<int> predicted;                   // per example, index into labels
  std::vector<std::vector<int64_t>> confusion;  // [true][predicted]
  std::vector<double> candidate_logp;           // [example * num_labels + k]: log p(answer k)
  std::vector<int64_t> candidate_tokens;        // answer tokens scored for that candidate
  HeapAllocations heap_during_batches;          // measured, batches after the first: should be none
};

// Scores every candidate sequence (the batcher must iterate `set.candidates` in order).
// With a communicator, each rank scores its share (the batcher's rank split) and the scores are
// summed over ranks, so every rank returns the whole result.
ClassificationResult evaluate_classification(Decoder& model, Batcher& batcher, const ClassificationSet& set,
                                             Communicator* comm = nullptr);

// --save_predictions: one JSON line per example {"index", "label", "predicted", "loss",
// "scores" {label: log-probability}}.
void write_classification_predictions(std::ostream& out, const ClassificationResult& result,
                                      const ClassificationSet& set);

nlohmann::json classification_to_json(const ClassificationResult& result, const std::vector<std::string>& labels);

}  // namespace memtune

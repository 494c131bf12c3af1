// The evaluation data of a command, set up in one place for `memtune eval` and for evaluation
// during `memtune train`: label_accuracy / macro_f1 make it classification (every candidate label
// scored as its own sequence), any other metric makes it token data; either way with the batcher
// that walks it in order (this rank's share under data parallelism).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/batcher.h"
#include "data/dataset.h"
#include "eval/classification.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

class EvalData {
 public:
  // `labels`: classification candidates (empty: the file's own labels). batch.shuffle is forced off.
  EvalData(const std::string& file, const Tokenizer& tokenizer, const DataOptions& options, bool classification,
           const std::vector<std::string>& labels, BatchOptions batch);
  EvalData(const EvalData&) = delete;
  EvalData& operator=(const EvalData&) = delete;

  bool classification() const { return classification_; }
  const ClassificationSet& classification_set() const { return set_; }
  Batcher& batcher() { return *batcher_; }
  // Token data (not classification): every example, in file order, on every rank.
  const Dataset& tokens() const { return tokens_; }

 private:
  bool classification_;
  ClassificationSet set_;
  Dataset tokens_;
  std::unique_ptr<Batcher> batcher_;  // over set_.candidates or tokens_
};

}  // namespace memtune

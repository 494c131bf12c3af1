#include "eval/eval_data.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtune {

EvalData::EvalData(const std::string& file, const Tokenizer& tokenizer, const DataOptions& options, bool classification,
                   const std::vector<std::string>& labels, BatchOptions batch)
    : classification_(classification) {
  if (classification_) {
    set_ = build_classification_set(file, tokenizer, options, labels);
  } else {
    tokens_ = load_dataset(file, tokenizer, options);
    if (tokens_.empty()) throw Error(fmt::format("{}: no example to evaluate", file));
  }
  batch.shuffle = false;
  batcher_ = std::make_unique<Batcher>(classification_ ? set_.candidates : tokens_, batch);
  batcher_->start_epoch(0);
}

}  // namespace memtune

#include "eval/classification.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backend/chunk_loss.h"
#include "core/error.h"
#include "core/jsonl.h"
#include "data/formats.h"
#include "distributed/communicator.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

using nlohmann::json;

bool wants_classification_metrics(const std::string& metrics) {
  std::stringstream in(metrics);
  for (std::string name; std::getline(in, name, ',');)
    if (name == "label_accuracy" || name == "macro_f1") return true;
  return false;
}

ClassificationSet build_classification_set(const std::string& path, const Tokenizer& tokenizer,
                                           const DataOptions& options, std::vector<std::string> labels) {
  JsonlReader reader{std::filesystem::path(path)};
  std::vector<json> records;
  JsonlLine line;
  while (reader.next_line(line)) {
    std::string problem;
    std::optional<json> record = parse_json_line(line.text, problem);
    if (!record || !record->is_object() || !record->contains("text") || !record->contains("label"))
      reader.bad_line(line.number, "expected a classification record {\"text\": ..., \"label\": ...}");
    records.push_back(std::move(*record));
  }
  if (records.empty()) throw Error(fmt::format("{}: no example to evaluate", path));
  if (labels.empty()) {
    std::set<std::string> seen;
    for (const json& r : records) seen.insert(label_text(r["label"]));
    labels.assign(seen.begin(), seen.end());
  }
  ClassificationSet set;
  set.labels = labels;
  std::stringstream expanded;
  for (const json& r : records) {
    const std::string truth = label_text(r["label"]);
    const auto it = std::find(labels.begin(), labels.end(), truth);
    if (it == labels.end()) throw Error(fmt::format("{}: label \"{}\" is not among the candidate labels", path, truth));
    set.truth.push_back(static_cast<int>(it - labels.begin()));
    for (const std::string& candidate : labels) {
      json copy = r;
      copy["label"] = candidate;
      expanded << copy.dump() << "\n";
    }
  }
  DataOptions o = options;
  o.format = DataFormat::Classification;
  o.train_on_prompt = false;  // the score is the answer's log-probability only
  o.skip_bad_lines = false;
  // A long prompt is cut from the left so every candidate's answer stays whole.
  if (o.truncation_strategy != TruncationStrategy::Left) o.truncation_strategy = TruncationStrategy::Left;
  set.candidates = load_dataset(expanded, path, tokenizer, o);
  if (set.candidates.size() != records.size() * labels.size())
    throw Error(fmt::format("{}: {} of {} candidate sequences have no answer token left (max_length too small?)", path,
                            records.size() * labels.size() - set.candidates.size(), records.size() * labels.size()));
  return set;
}

namespace {

// Sums log p(target) per sequence over the whole run; a batch's sequences are numbered from its
// first_sequence (its position among all ranks' sequences).
class SequenceScores final : public ChunkObserver {
 public:
  explicit SequenceScores(size_t sequences) : logp_(sequences, 0.0), tokens_(sequences, 0) {}
  void start_batch(std::span<const int32_t> cu_seqlens, int64_t first_sequence) {
    cu_.assign(cu_seqlens.begin(), cu_seqlens.end());
    first_ = static_cast<size_t>(first_sequence);
  }
  // Data parallel: each rank scored its own sequences; the sums make every rank see all.
  void allreduce(Communicator& comm) {
    comm.allreduce_sum(logp_);
    comm.allreduce_sum(tokens_);
  }
  bool needs_logits() const override { return false; }
  void observe_rows(const RowStatsChunk& c) override {
    for (int64_t r = 0; r < c.rows; ++r) {
      const size_t seq =
          first_ + static_cast<size_t>(std::upper_bound(cu_.begin(), cu_.end(), c.positions[r]) - cu_.begin() - 1);
      logp_.at(seq) += static_cast<double>(c.stats[r].target_logit) - c.stats[r].logsumexp;
      ++tokens_.at(seq);
    }
  }
  const std::vector<double>& logp() const {
    return logp_;
  }
  const std::vector<int64_t>& tokens() const {
    return tokens_;
  }

 private:
  std::vector<double> logp_;
  std::vector<int64_t> tokens_;
  std::vector<int32_t> cu_;
  size_t first_ = 0;
};

}  // namespace

ClassificationResult evaluate_classification(Decoder& model, Batcher& batcher, const ClassificationSet& set,
                                             Communicator* comm) {
  const size_t K = set.labels.size(), N = set.truth.size();
  SequenceScores scores(set.candidates.size());
  model.set_observer(&scores);
  MicroBatch mb;
  StepAllocations heap;
  try {
    batcher.start_epoch(0);
    while (batcher.next(mb)) {
      if (mb.input_ids.empty()) continue;
      scores.start_batch(mb.cu_seqlens, mb.first_sequence);
      heap.begin();
      model.forward_loss({mb.input_ids, mb.labels, mb.cu_seqlens});
      heap.end();
    }
  } catch (...) {
    model.set_observer(nullptr);
    throw;
  }
  model.set_observer(nullptr);
  if (comm && comm->world_size() > 1) scores.allreduce(*comm);

  ClassificationResult r;
  r.heap_during_batches = heap.total();
  r.examples = static_cast<int64_t>(N);
  r.confusion.assign(K, std::vector<int64_t>(K, 0));
  double true_logp = 0;
  int64_t true_tokens = 0, correct = 0;
  for (size_t i = 0; i < N; ++i) {
    int best = 0;
    for (size_t k = 1; k < K; ++k)
      if (scores.logp()[i * K + k] > scores.logp()[i * K + best]) best = static_cast<int>(k);
    r.predicted.push_back(best);
    ++r.confusion[set.truth[i]][best];
    correct += best == set.truth[i];
    true_logp += scores.logp()[i * K + set.truth[i]];
    true_tokens += scores.tokens()[i * K + set.truth[i]];
  }
  r.candidate_logp = scores.logp();
  r.candidate_tokens = scores.tokens();
  r.label_accuracy = static_cast<double>(correct) / static_cast<double>(N);
  r.eval_loss = -true_logp / static_cast<double>(std::max<int64_t>(1, true_tokens));
  // Macro F1 over the labels that occur as truth or prediction (scikit-learn's default set).
  double f1_sum = 0;
  int present = 0;
  for (size_t k = 0; k < K; ++k) {
    int64_t tp = r.confusion[k][k], fp = 0, fn = 0;
    for (size_t j = 0; j < K; ++j)
      if (j != k) {
        fp += r.confusion[j][k];
        fn += r.confusion[k][j];
      }
    if (tp + fp + fn == 0) continue;
    ++present;
    f1_sum += 2.0 * static_cast<double>(tp) / static_cast<double>(2 * tp + fp + fn);
  }
  r.macro_f1 = present ? f1_sum / present : 0.0;
  return r;
}

void write_classification_predictions(std::ostream& out, const ClassificationResult& r, const ClassificationSet& set) {
  const size_t K = set.labels.size();
  for (size_t i = 0; i < set.truth.size(); ++i) {
    json scores = json::object();
    for (size_t k = 0; k < K; ++k) scores[set.labels[k]] = r.candidate_logp[i * K + k];
    const size_t t = i * K + static_cast<size_t>(set.truth[i]);
    out << json{{"index", i},
                {"label", set.labels[static_cast<size_t>(set.truth[i])]},
                {"predicted", set.labels[static_cast<size_t>(r.predicted[i])]},
                {"loss", -r.candidate_logp[t] / static_cast<double>(std::max<int64_t>(1, r.candidate_tokens[t]))},
                {"scores", scores}}
               .dump()
        << "\n";
  }
}

json classification_to_json(const ClassificationResult& r, const std::vector<std::string>& labels) {
  return {{"label_accuracy", r.label_accuracy}, {"macro_f1", r.macro_f1}, {"eval_loss", r.eval_loss},
          {"eval_examples", r.examples},        {"labels", labels},       {"confusion_matrix", r.confusion}};
}

}  // namespace memtune

// Evaluation by generation (see generation_eval.h).
#include "eval/generation_eval.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/labels.h"

namespace memtune {

namespace {

std::string strip(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return std::string(s);
}

}  // namespace

namespace {
GenerationMetricSplit split_metric_list(const std::string& list) {
  GenerationMetricSplit split;
  std::stringstream in(list);
  std::string name;
  while (std::getline(in, name, ',')) {
    name = strip(name);
    if (name == "exact_match")
      split.generation.exact_match = true;
    else if (name == "label_accuracy_generated")
      split.generation.label_accuracy = true;
    else if (!name.empty())
      split.token_metrics += (split.token_metrics.empty() ? "" : ",") + name;
  }
  return split;
}
void require_generation_metric(const GenerationMetrics& m) {
  if (!m.exact_match && !m.label_accuracy)
    throw Error("--predict_with_generate needs --metrics exact_match and/or label_accuracy_generated");
}
}  // namespace

GenerationMetricSplit split_generation_metrics(const std::string& list) {
  const GenerationMetricSplit split = split_metric_list(list);
  require_generation_metric(split.generation);
  return split;
}

GenerationMetrics parse_generation_metrics(const std::string& list) {
  const GenerationMetricSplit split = split_metric_list(list);
  if (!split.token_metrics.empty())
    throw Error(fmt::format("--metrics {}: with --predict_with_generate the metrics are exact_match and "
                            "label_accuracy_generated",
                            split.token_metrics.substr(0, split.token_metrics.find(','))));
  require_generation_metric(split.generation);
  return split.generation;
}

PromptAndAnswer split_at_last_answer(std::span<const int32_t> ids, std::span<const int32_t> labels) {
  size_t end = labels.size();
  while (end > 0 && labels[end - 1] == kIgnoreIndex) --end;
  if (end == 0) throw Error("an example has no answer (no token with a label) to compare a generation with");
  size_t begin = end;
  while (begin > 0 && labels[begin - 1] != kIgnoreIndex) --begin;
  if (begin == 0) throw Error("an example's answer has no prompt before it");
  return {ids.subspan(0, begin), ids.subspan(begin, end - begin)};
}

GenerationEvalShape generation_eval_shape(const Dataset& data, int64_t batch_size, int64_t max_new_tokens,
                                          const std::string& source) {
  if (data.empty()) throw Error(fmt::format("{}: no examples to evaluate", source));
  int64_t longest_prompt = 0, longest_answer = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    try {
      const PromptAndAnswer split = split_at_last_answer(data.input_ids(i), data.labels(i));
      longest_prompt = std::max<int64_t>(longest_prompt, static_cast<int64_t>(split.prompt.size()));
      longest_answer = std::max<int64_t>(longest_answer, static_cast<int64_t>(split.answer.size()));
    } catch (const Error& e) {
      throw Error(fmt::format("{}: example {}: {}", source, i, e.what()));
    }
  }
  GenerationEvalShape shape;
  shape.max_new_tokens = max_new_tokens > 0 ? max_new_tokens : longest_answer + 8;
  const int64_t seqs = std::min<int64_t>(batch_size, static_cast<int64_t>(data.size()));
  shape.limits = {.max_model_len = longest_prompt + shape.max_new_tokens,
                  .max_num_seqs = seqs,
                  .max_num_batched_tokens = std::max<int64_t>(512, seqs),
                  .block_size = 16};
  return shape;
}

void GenerationEvalResult::finish() {
  if (examples <= 0) return;
  exact_match = static_cast<double>(exact_matches) / static_cast<double>(examples);
  label_accuracy_generated = static_cast<double>(label_matches) / static_cast<double>(examples);
}

GenerationEvalResult evaluate_by_generation(Decoder& model, const Tokenizer& tokenizer, const Dataset& data,
                                            const GenerationMetrics& metrics, std::vector<std::string> labels,
                                            int64_t max_new_tokens, const std::vector<int32_t>& stop_ids, int rank,
                                            int world_size) {
  GenerationEvalResult r;
  std::vector<GenerationRequest> requests;
  std::vector<std::string> all_references;
  for (size_t i = 0; i < data.size(); ++i) {
    PromptAndAnswer split;
    try {
      split = split_at_last_answer(data.input_ids(i), data.labels(i));
    } catch (const Error& e) {
      throw Error(fmt::format("example {}: {}", i, e.what()));
    }
    all_references.push_back(strip(tokenizer.decode(split.answer, /*skip_special_tokens=*/true)));
    if (static_cast<int>(i % static_cast<size_t>(world_size)) != rank) continue;
    GenerationRequest q;
    q.prompt_ids.assign(split.prompt.begin(), split.prompt.end());
    q.max_new_tokens = max_new_tokens;
    q.sampling.temperature = 0;
    q.stop_ids = stop_ids;
    requests.push_back(std::move(q));
    r.references.push_back(all_references.back());
  }
  if (labels.empty()) {
    const std::set<std::string> distinct(all_references.begin(), all_references.end());
    labels.assign(distinct.begin(), distinct.end());
  }
  Generator generator(model, &tokenizer);
  const std::vector<GenerationResult> out = generator.generate(requests);
  r.stats = generator.stats();
  r.examples = static_cast<int64_t>(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string prediction = strip(out[i].text);
    r.predictions.push_back(prediction);
    r.exact_matches += prediction == r.references[i];
    if (!metrics.label_accuracy) continue;
    // The candidate named: equal to the generation, else the longest one it starts with.
    std::string named;
    for (const std::string& label : labels)
      if (prediction == label || (prediction.starts_with(label) && label.size() > named.size())) named = label;
    r.predicted_labels.push_back(named);
    r.label_matches += !named.empty() && named == r.references[i];
  }
  r.finish();
  return r;
}

void write_generation_predictions(std::ostream& out, const GenerationEvalResult& r) {
  for (size_t i = 0; i < r.predictions.size(); ++i) {
    nlohmann::json line = {{"index", i},
                           {"prediction", r.predictions[i]},
                           {"reference", r.references[i]},
                           {"exact_match", r.predictions[i] == r.references[i]}};
    if (!r.predicted_labels.empty()) line["predicted_label"] = r.predicted_labels[i];
    out << line.dump() << "\n";
  }
}

nlohmann::json generation_eval_to_json(const GenerationEvalResult& r, const GenerationMetrics& metrics) {
  nlohmann::json j = {{"eval_examples", r.examples},
                      {"prefill_tokens_per_second", r.stats.prefill_tokens_per_second()},
                      {"decode_tokens_per_second", r.stats.decode_tokens_per_second()}};
  if (metrics.exact_match) j["exact_match"] = r.exact_match;
  if (metrics.label_accuracy) j["label_accuracy_generated"] = r.label_accuracy_generated;
  return j;
}

}  // namespace memtune

// The run report and the memory files behind it: report.html's content from known files, its
// conventions (1-2-5 axis ticks, units for people, grouped final metrics, the loss after
// warm-up), the memory timeline against the plan, `memtune report DIR`, planned == measured peak
// across training and evaluation configurations, optimizer offload, and the report rendered by a
// real browser (headless Chromium).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/console.h"
#include "core/error.h"
#include "data/synthetic_tokenizer.h"
#include "report/report.h"
#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Result = testing_support::CommandResult;

Result run(const std::string& args) {
  return testing_support::run_memtune(args);
}

using testing_support::read_json;
using testing_support::read_jsonl;
using testing_support::read_text;

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t pos = text.find(part); pos != std::string::npos; pos = text.find(part, pos + 1)) ++n;
  return n;
}

TEST(Report, RendersChartsTablesAndArgumentsFromTheRunFiles) {
  const fs::path dir = testing_support::make_temp_dir("report_unit");
  {
    std::ofstream log(dir / "log.jsonl");
    for (int s = 1; s <= 3; ++s)
      log << json{{"step", s},
                  {"loss", 4.0 - s},
                  {"learning_rate", 1e-3},
                  {"grad_norm", 0.5 * s},
                  {"tokens_per_second", 100.0 * s}}
                 .dump()
          << "\n";
    log << json{{"step", 3}, {"eval_loss", 1.5}, {"eval_label_accuracy", 0.75}}.dump() << "\n";
    log << "{\"step\": 4, \"loss\"";  // torn last line of a killed run: skipped
    std::ofstream timeline(dir / "memory.jsonl");
    for (const char* phase : {"forward", "loss"})
      timeline << json{{"step", 1},
                       {"stage", "train"},
                       {"phase", phase},
                       {"bytes", {{"weights", 1000}, {"gradients", 500}}},
                       {"rss_bytes", 4000}}
                      .dump()
               << "\n";
    std::ofstream(dir / "memory.json") << json{
        {"arena_bytes", 1600},
        {"arena_high_water_bytes", 1600},
        {"process_predicted_peak_bytes", 4500},
        {"process_plan", {{"peak_stage", "running"}}},
        {"peak_phase", "loss"},
        {"table",
         {{"forward", {{"weights", 1000}}},
          {"loss", {{"weights", 1000}}}}}}.dump();
    std::ofstream(dir / "run_args.json") << json{{"train_file", "a<b>.jsonl"}, {"learning_rate", "1e-3"}}.dump();
  }
  const std::string html = render_report(dir);
  for (const char* id : {"loss", "eval_metrics", "learning_rate", "grad_norm", "tokens_per_second", "memory"})
    EXPECT_CONTAINS(html, std::string("data-chart=\"") + id + "\"");
  // Loss chart: training loss (3 points) and eval_loss (1 point); the torn line is not a point.
  EXPECT_CONTAINS(html, "data-points=\"3\"");
  EXPECT_CONTAINS(html, "eval_label_accuracy");
  // Memory: one stacked area per category in use, the arena's size drawn across, and the
  // measured process RSS as a line.
  EXPECT_EQ(count(html, "class=\"series area\""), 2u);
  EXPECT_CONTAINS(html, "arena (planned)");
  EXPECT_EQ(count(html, "class=\"rss\""), 1u);
  // The process total predicted before the run, as a line beside the measured RSS.
  EXPECT_EQ(count(html, "class=\"predicted\""), 1u);
  EXPECT_CONTAINS(html, "process (predicted) 4.39 KiB");
  EXPECT_CONTAINS(html, "process predicted before the run <b>4.39 KiB</b> (peak stage running)");
  // Arguments are escaped, and nothing is loaded from the network.
  EXPECT_CONTAINS(html, "a&lt;b&gt;.jsonl");
  EXPECT_EQ(html.find("http://"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);

  // A long run is thinned by whole steps: every phase of a kept step stays, so the loss phase's
  // workspace (only live there) is still drawn.
  {
    std::ofstream timeline(dir / "memory.jsonl");
    for (int step = 1; step <= 1000; ++step)
      for (const char* phase : {"forward", "loss", "backward", "optimizer"}) {
        json bytes = {{"weights", 1000}};
        if (std::string(phase) == "loss") bytes["loss_workspace"] = 700;
        timeline << json{{"step", step}, {"stage", "train"}, {"phase", phase}, {"bytes", bytes}}.dump() << "\n";
      }
  }
  const std::string thinned = render_report(dir);
  EXPECT_CONTAINS(thinned, "loss_workspace");
  EXPECT_EQ(count(thinned, "class=\"series area\""), 2u);
  // The plan table lists phases in step order.
  const size_t plan = thinned.find("class=\"plan\"");
  ASSERT_NE(plan, std::string::npos);
  EXPECT_LT(thinned.find("<th>forward</th>", plan), thinned.find("<th>loss</th>", plan));

  const fs::path empty = testing_support::make_temp_dir("report_empty");
  EXPECT_CONTAINS(testing_support::error_of([&] { render_report(empty); }), "no run files");
  const Result r = run("report " + empty.string());
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "no run files");
  EXPECT_FALSE(fs::exists(empty / "report.html"));
  fs::remove_all(dir);
  fs::remove_all(empty);
}

// The page's text as a reader sees it: the tags (and attributes such as title) left out.
std::string page_text(const std::string& html) {
  return std::regex_replace(html, std::regex("<[^>]*>"), " ");
}

// Whether text shows the whole number n as such, with or without digit groups ("1,234").
bool shows_number(std::string text, size_t n) {
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());
  return text.find(std::to_string(n)) != std::string::npos;
}

// The part of html from `from` up to the next `to` (or the end).
std::string section(const std::string& html, const std::string& from, const std::string& to) {
  const size_t begin = html.find(from);
  if (begin == std::string::npos) return "";
  const size_t end = html.find(to, begin + from.size());
  return html.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// Whether step is 1, 2 or 5 x 10^k.
bool one_two_five(double step) {
  const double decade = std::pow(10.0, std::floor(std::log10(step) + 1e-9));
  const double mantissa = step / decade;
  return std::fabs(mantissa - 1) < 1e-9 || std::fabs(mantissa - 2) < 1e-9 || std::fabs(mantissa - 5) < 1e-9;
}

TEST(ReportTicks, OneTwoFiveStepsCoverTheRangeInThreeToTenTicks) {
  const AxisTicks example = nice_ticks(0.7354, 9.384);
  EXPECT_EQ(example.step, 2);
  EXPECT_EQ(example.values, (std::vector<double>{0, 2, 4, 6, 8, 10}));
  for (const double lo : {-3.7, 0.0, 0.0012, 0.7354, 5.0, 123.4, 9.9e5})
    for (const double span : {2e-5, 0.003, 0.37, 1.0, 8.65, 47.0, 999.0, 1.2e6}) {
      const double hi = lo + span;
      const AxisTicks t = nice_ticks(lo, hi);
      const std::string what = fmt::format("{}..{}: step {}", lo, hi, t.step);
      EXPECT_TRUE(one_two_five(t.step)) << what;
      EXPECT_GE(t.values.size(), 3u) << what;
      EXPECT_LE(t.values.size(), 8u) << what;
      ASSERT_FALSE(t.values.empty()) << what;
      EXPECT_LE(t.values.front(), lo + 1e-9 * std::fabs(lo)) << what;
      EXPECT_GE(t.values.back(), hi - 1e-9 * std::fabs(hi)) << what;
      for (size_t i = 0; i < t.values.size(); ++i) {
        // Every tick is a whole multiple of the step, one step after the other.
        const double k = t.values[i] / t.step;
        EXPECT_NEAR(k, std::round(k), 1e-6) << what;
        if (i > 0) {
          EXPECT_NEAR(t.values[i] - t.values[i - 1], t.step, 1e-9 * t.step + 1e-9 * std::fabs(hi)) << what;
        }
      }
      // The data fills more than half of the axis.
      EXPECT_GT(span / (t.values.back() - t.values.front()), 0.5) << what;
    }
  // Steps: whole numbers only.
  EXPECT_EQ(nice_ticks(1, 4, 11, true).values, (std::vector<double>{1, 2, 3, 4}));
  const AxisTicks steps = nice_ticks(1, 450, 11, true);
  EXPECT_EQ(steps.step, 50);
  EXPECT_EQ(steps.values.front(), 0);
  EXPECT_EQ(steps.values.back(), 450);
  // One value: an axis around it.
  const AxisTicks one = nice_ticks(3, 3);
  EXPECT_LT(one.values.front(), 3);
  EXPECT_GT(one.values.back(), 3);
}

TEST(ReportTicks, LabelsHaveNoMoreDigitsThanTheStepNeeds) {
  std::vector<std::string> labels;
  const AxisTicks t = nice_ticks(0.7354, 9.384);
  for (const double v : t.values) labels.push_back(tick_label(v, t.step));
  EXPECT_EQ(labels, (std::vector<std::string>{"0", "2", "4", "6", "8", "10"}));
  EXPECT_EQ(tick_label(0.5, 0.5), "0.5");
  EXPECT_EQ(tick_label(1.0, 0.5), "1");
  EXPECT_EQ(tick_label(1.5, 0.5), "1.5");
  EXPECT_EQ(tick_label(0.1 * 3, 0.1), "0.3");  // 0.30000000000000004
  EXPECT_EQ(tick_label(-0.0, 1), "0");
  EXPECT_EQ(tick_label(1200, 200), "1200");
  EXPECT_EQ(tick_label(0.0003, 1e-4), "0.0003");
  EXPECT_EQ(tick_label(4e-5, 2e-5), "4e-5");
  EXPECT_EQ(tick_label(1.2e-4, 2e-5), "1.2e-4");
  // Over many ranges: no label carries more decimals than its step.
  for (const double span : {0.003, 0.37, 8.65, 47.0})
    for (const double lo : {0.7354, 1.23456, 17.1}) {
      const AxisTicks r = nice_ticks(lo, lo + span);
      const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(r.step) + 1e-9)));
      for (const double v : r.values) {
        const std::string label = tick_label(v, r.step);
        const size_t point = label.find('.');
        EXPECT_LE(point == std::string::npos ? 0 : static_cast<int>(label.size() - point - 1), decimals)
            << label << " step " << r.step;
        EXPECT_NEAR(std::stod(label), v, 1e-9 + 1e-9 * std::fabs(v)) << label;
      }
    }
}

TEST(ReportUnits, BytesSecondsRatesAndCountsForPeople) {
  EXPECT_EQ(metric_text("memory_arena_bytes", 380279744), "362.66 MiB");
  EXPECT_EQ(metric_text("arena_bytes", 5.0 * 1024 * 1024 * 1024), "5.00 GiB");
  EXPECT_EQ(metric_text("comm_payload_bytes", 0), "0 B");
  EXPECT_EQ(format_seconds(26.416663682), "26.4 s");
  EXPECT_EQ(format_seconds(63.2), "1 min 3 s");
  EXPECT_EQ(format_seconds(0.0523), "52.3 ms");
  EXPECT_EQ(format_seconds(3725), "1 h 2 min");
  EXPECT_EQ(format_seconds(2.5), "2.5 s");
  EXPECT_EQ(metric_text("eval_runtime", 26.416663682), "26.4 s");
  EXPECT_EQ(metric_text("elapsed_seconds", 63.2), "1 min 3 s");
  EXPECT_EQ(metric_text("tokens_per_second", 5213.4), "5,213 tokens/s");
  EXPECT_EQ(metric_text("eval_samples_per_second", 18.17), "18.2 samples/s");
  EXPECT_EQ(metric_text("num_input_tokens_seen", 1234567), "1,234,567");
  EXPECT_EQ(metric_text("eval_examples", 480), "480");
  EXPECT_EQ(metric_text("loss", 0.4582485112650641), "0.4582");
}

TEST(ReportMetrics, FinalMetricsAreGroupedAndShownInUnitsForPeople) {
  EXPECT_EQ(metric_group("memory_arena_bytes"), "Memory");
  EXPECT_EQ(metric_group("process_peak_rss_bytes", true), "Memory");
  EXPECT_EQ(metric_group("eval_runtime"), "Speed");
  EXPECT_EQ(metric_group("tokens_per_second"), "Speed");
  EXPECT_EQ(metric_group("forward_seconds"), "Speed");
  EXPECT_EQ(metric_group("eval_label_accuracy"), "Evaluation");
  EXPECT_EQ(metric_group("macro_f1", true), "Evaluation");
  EXPECT_EQ(metric_group("loss"), "Training");
  EXPECT_EQ(metric_group("some_new_key"), "Training");

  const fs::path dir = testing_support::make_temp_dir("report_metrics");
  {
    std::ofstream log(dir / "log.jsonl");
    log << json{{"step", 450},
                {"loss", 0.41},
                {"epoch", 2.0},
                {"num_input_tokens_seen", 1234567},
                {"memory_arena_bytes", 380279744},
                {"memory_rss_bytes", 450000000},
                {"tokens_per_second", 5213.4},
                {"elapsed_seconds", 63.2},
                {"forward_seconds", 0.0523},
                {"phase_clock", "host"},
                {"some_new_key", "kept"}}
               .dump()
        << "\n";
    log << json{{"step", 450}, {"eval_loss", 0.309}, {"eval_label_accuracy", 0.79375}, {"eval_runtime", 26.416663682}}
               .dump()
        << "\n";
  }
  const std::string html = render_report(dir);
  const std::string metrics = section(html, "<h2>Final metrics</h2>", "<h2>");
  ASSERT_FALSE(metrics.empty()) << html;
  // The groups' headings, in this order, each before the keys it holds.
  const size_t training = metrics.find("<h3>Training</h3>"), evaluation = metrics.find("<h3>Evaluation</h3>"),
               memory = metrics.find("<h3>Memory</h3>"), speed = metrics.find("<h3>Speed</h3>");
  ASSERT_NE(speed, std::string::npos) << metrics;
  EXPECT_LT(training, evaluation);
  EXPECT_LT(evaluation, memory);
  EXPECT_LT(memory, speed);
  auto at = [&](const std::string& key) { return metrics.find("<th>" + key + "</th>"); };
  for (const char* key : {"loss", "epoch", "num_input_tokens_seen", "some_new_key"}) {
    EXPECT_GT(at(key), training) << key;
    EXPECT_LT(at(key), evaluation) << key;
  }
  for (const char* key : {"eval_loss", "eval_label_accuracy"}) {
    EXPECT_GT(at(key), evaluation) << key;
    EXPECT_LT(at(key), memory) << key;
  }
  for (const char* key : {"memory_arena_bytes", "memory_rss_bytes"}) {
    EXPECT_GT(at(key), memory) << key;
    EXPECT_LT(at(key), speed) << key;
  }
  for (const char* key : {"eval_runtime", "tokens_per_second", "elapsed_seconds", "forward_seconds", "phase_clock"}) {
    EXPECT_GT(at(key), speed) << key;
    EXPECT_NE(at(key), std::string::npos) << key;
  }
  // Bytes in binary units, the exact count on hover and never as a bare number in the text.
  const std::string text = page_text(html);
  EXPECT_FALSE(shows_number(text, 380279744)) << text;
  EXPECT_FALSE(shows_number(text, 450000000)) << text;
  EXPECT_CONTAINS(metrics, R"(<td title="380279744 bytes">362.66 MiB</td>)");
  EXPECT_CONTAINS(text, "429.15 MiB");
  // Timings in seconds for people, rates and counts readable, unknown keys kept.
  EXPECT_CONTAINS(metrics, ">26.4 s</td>");
  EXPECT_CONTAINS(metrics, ">1 min 3 s</td>");
  EXPECT_CONTAINS(metrics, ">52.3 ms</td>");
  EXPECT_CONTAINS(metrics, ">5,213 tokens/s</td>");
  EXPECT_CONTAINS(metrics, ">1,234,567</td>");
  EXPECT_CONTAINS(metrics, "<th>some_new_key</th><td>kept</td>");
  fs::remove_all(dir);
}

// The y coordinates of the first series drawn in chart `id`, and its plot area's top and bottom.
struct PlottedSeries {
  std::vector<double> y;
  double top = 0, bottom = 0;
};
PlottedSeries plotted(const std::string& html, const std::string& id) {
  PlottedSeries p;
  const std::string chart = section(html, "data-chart=\"" + id + "\"", "</figure>");
  std::smatch m;
  if (std::regex_search(chart, m, std::regex(R"re(data-plot-top="([0-9.]+)" data-plot-bottom="([0-9.]+)")re")))
    p.top = std::stod(m[1]), p.bottom = std::stod(m[2]);
  if (!std::regex_search(chart, m, std::regex(R"re(class="series"[^>]* d="([^"]*)")re"))) return p;
  const std::string d = m[1];
  const std::regex point(R"re((-?[0-9.]+),(-?[0-9.]+))re");
  for (auto it = std::sregex_iterator(d.begin(), d.end(), point); it != std::sregex_iterator(); ++it)
    p.y.push_back(std::stod((*it)[2]));
  return p;
}

// The value-axis labels of chart `id`, top to bottom as written.
std::vector<std::string> value_labels(const std::string& html, const std::string& id) {
  const std::string chart = section(html, "data-chart=\"" + id + "\"", "</figure>");
  std::vector<std::string> out;
  const std::regex label(R"re(<text class="tick" x="[0-9.]+" y="[0-9.]+" text-anchor="end">([^<]*)</text>)re");
  for (auto it = std::sregex_iterator(chart.begin(), chart.end(), label); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[1]);
  return out;
}

TEST(Report, LossAfterWarmUpFillsItsPanelWhenTheFirstLossDwarfsTheRest) {
  const fs::path dir = testing_support::make_temp_dir("report_warmup");
  auto write_log = [&](double first) {
    std::ofstream log(dir / "log.jsonl");
    log << json{{"step", 1}, {"loss", first}}.dump() << "\n";
    for (int s = 2; s <= 100; ++s)
      log << json{{"step", s}, {"loss", 1.2 - 0.4 * (s - 2) / 98.0 + 0.03 * std::sin(s)}}.dump() << "\n";
  };
  write_log(12);
  const std::string html = render_report(dir);
  // The loss chart itself: ticks 0, 2, ..., 12, and the later losses squeezed into its bottom.
  EXPECT_EQ(value_labels(html, "loss"), (std::vector<std::string>{"0", "2", "4", "6", "8", "10", "12"}));
  const PlottedSeries whole = plotted(html, "loss");
  ASSERT_EQ(whole.y.size(), 100u);
  ASSERT_GT(whole.bottom, whole.top);
  const auto [whole_lo, whole_hi] = std::minmax_element(whole.y.begin() + 10, whole.y.end());
  EXPECT_LT((*whole_hi - *whole_lo) / (whole.bottom - whole.top), 0.1);
  // The panel after warm-up: from step 11 (after the first tenth), spanning most of its height.
  ASSERT_NE(html.find("data-chart=\"loss_after_warmup\""), std::string::npos);
  const PlottedSeries later = plotted(html, "loss_after_warmup");
  EXPECT_EQ(later.y.size(), 90u);
  ASSERT_GE(later.y.size(), 90u);
  ASSERT_GT(later.bottom, later.top);
  const auto [lo, hi] = std::minmax_element(later.y.end() - 90, later.y.end());  // steps 11..100
  EXPECT_GT((*hi - *lo) / (later.bottom - later.top), 0.5);
  for (const std::string& label : value_labels(html, "loss_after_warmup"))
    EXPECT_LE(label.size(), 3u) << label;  // "0.8", "0.9", ...: a 1-2-5 step's digits only

  // Without a warm-up spike the loss chart is readable as it is: no second panel.
  write_log(1.2);
  EXPECT_EQ(render_report(dir).find("data-chart=\"loss_after_warmup\""), std::string::npos);
  fs::remove_all(dir);
}

class RunFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("report_cli_test");
    ASSERT_EQ(run("init-model --preset tiny --seed 1 --out " + path("model")).status, 0);
    ASSERT_EQ(run("init-model --preset tiny --seed 1 --torch_dtype bfloat16 --out " + path("model16")).status, 0);
    testing_support::write_synthetic_tokenizer(dir_ / "model");
    testing_support::write_synthetic_tokenizer(dir_ / "model16");
    std::ofstream data(dir_ / "train.jsonl"), cls(dir_ / "cls.jsonl");
    const char* words[] = {"red", "green", "blue", "cyan"};
    for (int i = 0; i < 16; ++i) {
      // Very different lengths, so micro-batches differ from one another.
      const std::string prompt = "colour " + std::string(static_cast<size_t>(1 + (i * 7) % 23), 'x');
      data << json{{"messages",
                    {{{"role", "user"}, {"content", prompt}}, {{"role", "assistant"}, {"content", words[i % 4]}}}}}
                  .dump()
           << "\n";
      cls << json{{"text", prompt}, {"label", words[i % 4]}}.dump() << "\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  Result train(const std::string& out, const std::string& flags, const std::string& model = "model") const {
    return run("train --model_name_or_path " + path(model) + " --train_file " + path("train.jsonl") + " --output_dir " +
               path(out) + " --logging_steps 1 --save_strategy no --seed 3 " + flags);
  }
  fs::path dir_;
};

TEST_F(RunFilesTest, TimelineFollowsThePlanAndTheReportIsRefreshedAtEvaluation) {
  const Result r =
      train("run", "--tuner_type full --max_steps 4 --per_device_train_batch_size 4 --eval_file " + path("cls.jsonl") +
                       " --eval_strategy steps --eval_steps 2 --metrics label_accuracy");
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path out = dir_ / "run";
  EXPECT_CONTAINS(r.output, (out / "report.html").string());
  const json memory = read_json(out / "memory.json");
  const auto timeline = read_jsonl(out / "memory.jsonl");
  // Four phases per training step, two per evaluation (after steps 2 and 4).
  ASSERT_EQ(timeline.size(), 4u * 4 + 2 * 2);
  size_t train_records = 0, eval_records = 0;
  for (const json& t : timeline) {
    const std::string phase = t["phase"];
    size_t sum = 0;
    for (const auto& [category, bytes] : t["bytes"].items()) sum += bytes.get<size_t>();
    EXPECT_EQ(sum, t["arena_used_bytes"].get<size_t>());
    // Every byte a step or an evaluation used was planned for that phase, and a training step
    // uses every buffer the plan declares for it.
    EXPECT_LE(t["arena_used_bytes"].get<size_t>(), memory["phases"][phase].get<size_t>()) << t.dump();
    if (t["stage"] == "train") {
      ++train_records;
      EXPECT_EQ(t["bytes"], memory["table"][phase]) << t.dump();
    } else {
      ++eval_records;
      EXPECT_EQ(t["bytes"]["weights"], memory["table"][phase]["weights"]);
    }
  }
  EXPECT_EQ(train_records, 16u);
  EXPECT_EQ(eval_records, 4u);
  const json args = read_json(out / "run_args.json");
  EXPECT_EQ(args["max_steps"], "4");
  EXPECT_EQ(args["tuner_type"], "full");
  const std::string html = read_text(out / "report.html");
  for (const char* id : {"loss", "eval_metrics", "learning_rate", "grad_norm", "memory"})
    EXPECT_CONTAINS(html, std::string("data-chart=\"") + id + "\"");
  // `memtune report DIR` regenerates the same file from the same inputs.
  fs::remove(out / "report.html");
  const Result again = run("report " + out.string());
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_EQ(read_text(out / "report.html"), html);
}

// The arena hands out exactly its plan (arena_bytes == arena_high_water_bytes), and the figures
// measured from outside the plan hold for training and evaluation, full and LoRA, with and
// without checkpointing, at different batch sizes and lengths: no heap allocation inside a step
// or an evaluation batch after the first, the arena's resident pages within the arena and
// within the process's peak RSS, and every timeline line sampled.
void expect_measured_figures(const json& m, const std::vector<json>& timeline, const std::string& name) {
  EXPECT_EQ(m["heap_allocations_during_steps"]["count"], 0) << name << m.dump();
  EXPECT_EQ(m["heap_allocations_during_steps"]["bytes"], 0) << name;
  const size_t resident = m["arena_resident_bytes"].get<size_t>();
  EXPECT_GT(resident, 0u) << name;
  EXPECT_LE(resident, m["arena_bytes"].get<size_t>() + 4095) << name;
  // The arena is committed when made: every planned page is resident, whatever the batches met.
  EXPECT_GE(resident + 4095, m["arena_bytes"].get<size_t>()) << name;
  // The whole process was predicted before the run; the matrix test holds it to the measurement.
  EXPECT_GT(m["process_predicted_peak_bytes"].get<size_t>(), m["arena_bytes"].get<size_t>()) << name;
  EXPECT_GT(m["process_peak_rss_bytes"].get<size_t>(), resident) << name;
  ASSERT_FALSE(timeline.empty()) << name;
  for (const json& line : timeline) {
    EXPECT_GT(line["rss_bytes"].get<size_t>(), line["arena_resident_bytes"].get<size_t>()) << name << line.dump();
    EXPECT_LE(line["rss_bytes"].get<size_t>(), m["process_peak_rss_bytes"].get<size_t>()) << name << line.dump();
  }
}

TEST_F(RunFilesTest, ArenaHandsOutItsPlanAndMeasuredFiguresHoldAcrossEightConfigurations) {
  struct Config {
    std::string name, flags;
  };
  const std::vector<Config> training = {
      {"full", "--tuner_type full --per_device_train_batch_size 4 --max_length 256"},
      {"full_ckpt", "--tuner_type full --per_device_train_batch_size 2 --max_length 200 --gradient_checkpointing"},
      {"lora", "--tuner_type lora --lora_rank 4 --per_device_train_batch_size 3 --max_length 256"},
      {"lora_ckpt",
       "--tuner_type lora --lora_rank 8 --per_device_train_batch_size 8 --max_length 180 --gradient_checkpointing"},
  };
  std::map<std::string, size_t> peaks;
  for (const Config& c : training) {
    const Result r = train(c.name, c.flags + " --max_steps 2");
    ASSERT_EQ(r.status, 0) << c.name << r.output;
    const json m = read_json(dir_ / c.name / "memory.json");
    EXPECT_EQ(m["arena_bytes"], m["arena_high_water_bytes"]) << c.name;
    expect_measured_figures(m, read_jsonl(dir_ / c.name / "memory.jsonl"), c.name);
    peaks[c.name] = m["arena_bytes"];
  }
  const std::vector<Config> evaluation = {
      {"eval_b1", "--per_device_eval_batch_size 1 --max_length 256"},
      {"eval_b8", "--per_device_eval_batch_size 8 --max_length 200"},
      {"eval_lora", "--per_device_eval_batch_size 4 --adapter " + path("lora")},
      {"eval_cls", "--per_device_eval_batch_size 5 --metrics label_accuracy,macro_f1 --eval_file " + path("cls.jsonl")},
  };
  for (const Config& c : evaluation) {
    const std::string file = c.name == "eval_cls" ? "" : " --eval_file " + path("train.jsonl");
    const Result r =
        run("eval --model_name_or_path " + path("model") + file + " --output_dir " + path(c.name) + " " + c.flags);
    ASSERT_EQ(r.status, 0) << c.name << r.output;
    const json m = read_json(dir_ / c.name / "memory.json");
    EXPECT_EQ(m["arena_bytes"], m["arena_high_water_bytes"]) << c.name;
    EXPECT_TRUE(fs::exists(dir_ / c.name / "eval_results.json"));
    EXPECT_TRUE(fs::exists(dir_ / c.name / "report.html"));
    EXPECT_EQ(read_jsonl(dir_ / c.name / "memory.jsonl").size(), 2u);
    expect_measured_figures(m, read_jsonl(dir_ / c.name / "memory.jsonl"), c.name);
    peaks[c.name] = m["arena_bytes"];
  }
  EXPECT_LT(peaks["eval_b1"], peaks["full"]);
  EXPECT_LT(peaks["lora"], peaks["full"]);
}

// --optim_offload: the same training, bit for bit, with AdamW state and float32 masters moved
// out of the device plan into the host plan.
TEST_F(RunFilesTest, OptimizerOffloadTrainsIdenticallyAndMovesExactlyTheOptimizerBytes) {
  for (const std::string model : {"model", "model16"}) {
    const std::string flags = "--tuner_type full --max_steps 3 --per_device_train_batch_size 4 --learning_rate 1e-3";
    const Result a = train(model + "_device", flags, model),
                 b = train(model + "_host", flags + " --optim_offload", model);
    ASSERT_EQ(a.status, 0) << a.output;
    ASSERT_EQ(b.status, 0) << b.output;
    EXPECT_EQ(read_text(dir_ / (model + "_device") / "model.safetensors"),
              read_text(dir_ / (model + "_host") / "model.safetensors"));
    const json on_device = read_json(dir_ / (model + "_device") / "memory.json");
    const json offloaded = read_json(dir_ / (model + "_host") / "memory.json");
    EXPECT_EQ(offloaded["arena_bytes"], offloaded["arena_high_water_bytes"]);
    EXPECT_EQ(on_device["host_arena_bytes"], 0);
    EXPECT_EQ(offloaded["categories"]["optimizer_state"], 0);
    EXPECT_GT(offloaded["host_arena_bytes"].get<size_t>(), 0u);
    size_t moved = on_device["categories"]["optimizer_state"].get<size_t>();
    if (model == "model16") moved += on_device["categories"]["trainable_params"].get<size_t>();  // the masters
    EXPECT_EQ(offloaded["host_arena_bytes"].get<size_t>(), moved);
    EXPECT_EQ(on_device["arena_bytes"].get<size_t>() - offloaded["arena_bytes"].get<size_t>(), moved);
  }
  // The planner sees the same split.
  const Result p = run("plan --json --model " + path("model16") + " --tuner_type full --optim_offload");
  ASSERT_EQ(p.status, 0) << p.output;
  const json plan = json::parse(p.output);
  EXPECT_EQ(plan["categories"]["optimizer_state"], 0);
  EXPECT_EQ(plan["host_arena_bytes"].get<size_t>(),
            read_json(dir_ / "model16_host" / "memory.json")["host_arena_bytes"].get<size_t>());
}

// The report as a browser renders it in a wide window: every chart is laid out across the
// content's width with non-empty plotted data, and the final metrics show their groups' headings
// with bytes in binary units.
TEST_F(RunFilesTest, ReportRendersInHeadlessChromium) {
  const Result r = train("run", "--tuner_type lora --max_steps 4 --per_device_train_batch_size 4 --eval_file " +
                                    path("train.jsonl") + " --eval_strategy steps --eval_steps 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path report = dir_ / "run" / "report.html";
  const Result browser = testing_support::run_command(
      "chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --window-size=1600,1000 "
      "--user-data-dir=" +
      path("chromium") + " --dump-dom file://" + report.string() + " 2>/dev/null");
  ASSERT_EQ(browser.status, 0) << "headless chromium failed (scripts/install-deps.sh installs it): " << browser.output;
  const std::string open = "<pre id=\"render-check\" hidden=\"\">";
  const size_t begin = browser.output.find(open);
  ASSERT_NE(begin, std::string::npos) << browser.output.substr(0, 2000);
  const size_t end = browser.output.find("</pre>", begin);
  const json check = json::parse(browser.output.substr(begin + open.size(), end - begin - open.size()));
  std::map<std::string, json> charts;
  for (const json& c : check["charts"]) charts[c["id"]] = c;
  const double content = check["content_width"].get<double>();
  EXPECT_GT(content, 1000) << check.dump();  // the wide window, where two charts side by side would fit
  for (const char* id : {"loss", "learning_rate", "grad_norm", "tokens_per_second", "memory"}) {
    ASSERT_TRUE(charts.count(id)) << id << " missing: " << check.dump();
    const json& c = charts[id];
    EXPECT_GE(c["width"].get<double>(), 0.9 * content) << id << ": charts span the content's width";
    EXPECT_GE(c["figure_width"].get<double>(), 0.95 * content) << id;
    EXPECT_GT(c["height"].get<double>(), 100) << id;
    EXPECT_GE(c["series"].get<int>(), 1) << id;
    EXPECT_GE(c["points"].get<int>(), 2) << id;
    EXPECT_GT(c["data_width"].get<double>(), 50) << id;  // the data spans the plot, not a dot
  }
  EXPECT_GT(charts["loss"]["data_height"].get<double>(), 10);
  EXPECT_GT(charts["memory"]["data_height"].get<double>(), 10);
  EXPECT_EQ(check["metric_groups"], json::array({"Training", "Evaluation", "Memory", "Speed"})) << check.dump();
  // The arena's size as the run logged it: in MiB/KiB on the page, never the bare byte count.
  size_t arena = 0;
  for (const json& record : read_jsonl(dir_ / "run" / "log.jsonl"))
    if (record.contains("memory_arena_bytes")) arena = record["memory_arena_bytes"];
  ASSERT_GT(arena, 0u);
  const std::string text = check["metrics_text"];
  EXPECT_CONTAINS(text, format_bytes(arena));
  EXPECT_FALSE(shows_number(text, arena)) << text;
}

}  // namespace
}  // namespace memtune

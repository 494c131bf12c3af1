// The run report and the memory files behind it: report.html's content from known files, the
// memory timeline against the plan, `memtune report DIR`, planned == measured peak across
// training and evaluation configurations, optimizer offload, and the report rendered by a real
// browser (headless Chromium).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

// The report as a browser renders it: every chart is laid out with non-empty plotted data.
TEST_F(RunFilesTest, ReportRendersInHeadlessChromium) {
  const Result r = train("run", "--tuner_type lora --max_steps 4 --per_device_train_batch_size 4 --eval_file " +
                                    path("train.jsonl") + " --eval_strategy steps --eval_steps 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path report = dir_ / "run" / "report.html";
  const Result browser = testing_support::run_command(
      "chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir=" + path("chromium") +
      " --dump-dom file://" + report.string() + " 2>/dev/null");
  ASSERT_EQ(browser.status, 0) << "headless chromium failed (scripts/install-deps.sh installs it): " << browser.output;
  const std::string open = "<pre id=\"render-check\" hidden=\"\">";
  const size_t begin = browser.output.find(open);
  ASSERT_NE(begin, std::string::npos) << browser.output.substr(0, 2000);
  const size_t end = browser.output.find("</pre>", begin);
  const json check = json::parse(browser.output.substr(begin + open.size(), end - begin - open.size()));
  std::map<std::string, json> charts;
  for (const json& c : check["charts"]) charts[c["id"]] = c;
  for (const char* id : {"loss", "learning_rate", "grad_norm", "tokens_per_second", "memory"}) {
    ASSERT_TRUE(charts.count(id)) << id << " missing: " << check.dump();
    const json& c = charts[id];
    EXPECT_GT(c["width"].get<double>(), 100) << id;
    EXPECT_GT(c["height"].get<double>(), 100) << id;
    EXPECT_GE(c["series"].get<int>(), 1) << id;
    EXPECT_GE(c["points"].get<int>(), 2) << id;
    EXPECT_GT(c["data_width"].get<double>(), 50) << id;  // the data spans the plot, not a dot
  }
  EXPECT_GT(charts["loss"]["data_height"].get<double>(), 10);
  EXPECT_GT(charts["memory"]["data_height"].get<double>(), 10);
}

}  // namespace
}  // namespace memtune

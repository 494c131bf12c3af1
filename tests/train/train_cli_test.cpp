// `memtune train` as a user runs it: outputs in Hugging Face's formats, log records, the memory
// report, bit-identical resume, checkpoint rotation, checkpoints a kill in mid-save leaves loadable,
// config files and argument errors.
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backend/registry.h"
#include "data/synthetic_tokenizer.h"
#include "io/safetensors.h"
#include "support/run_command.h"
#include "support/test_util.h"
#include "support/vulkan_geometry_cases.h"
#include "support/numeric.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Result = testing_support::CommandResult;
Result run(const std::string& args) {
  return testing_support::run_memtune(args);
}

using testing_support::read_jsonl;
class TrainCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("train_cli_test");
    ASSERT_EQ(run("init-model --preset tiny --seed 1 --out " + path("model")).status, 0);
    testing_support::write_synthetic_tokenizer(dir_ / "model");
    std::ofstream data(dir_ / "train.jsonl");
    const char* words[] = {"red", "green", "blue", "cyan", "amber", "teal", "gold", "plum"};
    for (int i = 0; i < 12; ++i)
      data << json{{"messages",
                    {{{"role", "user"}, {"content", std::string("colour ") + std::to_string(i)}},
                     {{"role", "assistant"}, {"content", words[i % 8]}}}}}
                  .dump()
           << "\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string base_flags(const std::string& out) const {
    return "train --model_name_or_path " + path("model") + " --train_file " + path("train.jsonl") + " --output_dir " +
           path(out) + " --per_device_train_batch_size 4 --logging_steps 1 --lr_scheduler_type constant";
  }
  fs::path dir_;
};

TEST_F(TrainCliTest, FullFineTuningWritesHuggingFaceOutputsLogsAndMemoryReport) {
  const Result r = run(base_flags("full") + " --tuner_type full --max_steps 4 --save_steps 2 --learning_rate 3e-3");
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path out = dir_ / "full";
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.json", "memory.json",
                        "log.jsonl", "checkpoint-2/optimizer.safetensors", "checkpoint-4/trainer_state.json"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  const auto logs = read_jsonl(out / "log.jsonl");
  ASSERT_EQ(logs.size(), 4u);
  for (const char* key : {"loss", "grad_norm", "learning_rate", "epoch", "num_input_tokens_seen", "tokens_per_second",
                          "memory_arena_bytes", "memory_rss_bytes", "step", "forward_seconds", "loss_seconds",
                          "backward_seconds"})
    EXPECT_TRUE(logs[0].contains(key)) << key;
  EXPECT_EQ(logs[0]["phase_clock"], "host");  // cpu computes as it is called
  EXPECT_LT(logs[3]["loss"].get<double>(), logs[0]["loss"].get<double>());
  const json state = json::parse(std::ifstream(out / "trainer_state.json"));
  EXPECT_EQ(state["global_step"], 4);
  EXPECT_EQ(state["log_history"].size(), 4u);
  for (const char* key : {"epoch", "max_steps", "logging_steps", "save_steps", "train_batch_size", "num_train_epochs",
                          "num_input_tokens_seen", "best_metric", "best_global_step", "best_model_checkpoint"})
    EXPECT_TRUE(state.contains(key)) << key;
  const json memory = json::parse(std::ifstream(out / "memory.json"));
  EXPECT_EQ(memory["arena_bytes"], memory["arena_high_water_bytes"]);
  EXPECT_GT(memory["categories"]["optimizer_state"].get<size_t>(), 0u);
  // Which kernel ran each family of products (backend/products.h): float32 training runs them on
  // OpenBLAS; the head's three products are one m x V x D product each per chunk, so their work
  // is equal, and every family took time.
  std::map<std::string, json> products;
  for (const json& p : memory["products"]) products[p["family"].get<std::string>()] = p;
  for (const char* family : {"layers", "head_forward", "head_weight_gradient", "head_input_gradient"}) {
    ASSERT_TRUE(products.count(family)) << family << " in " << memory["products"].dump();
    const json& p = products[family];
    EXPECT_TRUE(p["kernel"].get<std::string>().starts_with("OpenBLAS sgemm (")) << p.dump();
    EXPECT_GT(p["calls"].get<int64_t>(), 0) << family;
    EXPECT_GT(p["gflop"].get<double>(), 0.0) << family;
    EXPECT_GT(p["seconds"].get<double>(), 0.0) << family;
  }
  EXPECT_DOUBLE_EQ(products["head_weight_gradient"]["gflop"].get<double>(), products["head_forward"]["gflop"].get<double>());
  EXPECT_DOUBLE_EQ(products["head_input_gradient"]["gflop"].get<double>(), products["head_forward"]["gflop"].get<double>());
}

TEST_F(TrainCliTest, LoraWritesAPeftAdapter) {
  const Result r = run(base_flags("lora") + " --max_steps 2 --lora_rank 4 --target_modules q_proj,v_proj --bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  const json cfg = json::parse(std::ifstream(dir_ / "lora/adapter_config.json"));
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["target_modules"], json({"q_proj", "v_proj"}));
  SafetensorsFile f(path("lora/adapter_model.safetensors"));
  EXPECT_EQ(f.tensors().size(), 2u * 2 * 2);
  EXPECT_NE(f.find("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"), nullptr);
  EXPECT_FALSE(fs::exists(dir_ / "lora/model.safetensors"));

  // The merged checkpoint computes what base + adapter compute. The adapter must change the
  // output for this to mean anything (PEFT's B starts at zero): a larger learning rate, and the
  // base model's logits as the control that a merge which dropped the adapter would match.
  const Result trained = run(base_flags("strong") + " --max_steps 4 --lora_rank 4 --learning_rate 0.05");
  ASSERT_EQ(trained.status, 0) << trained.output;
  ASSERT_EQ(run("merge --model " + path("model") + " --adapter " + path("strong") + " --out " + path("merged")).status,
            0);
  std::ofstream(dir_ / "in.json") << R"({"input_ids": [[5, 17, 200, 3, 99, 42]]})";
  auto logits_of = [&](const std::string& flags, const std::string& file) {
    const Result r = run("dump " + flags + " --input " + path("in.json") + " --out " + path(file));
    EXPECT_EQ(r.status, 0) << r.output;
    SafetensorsFile d(path(file));
    const auto bytes = d.data(*d.find("logits"));
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  };
  auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    return testing_support::difference(a, b).worst;  // NaN where a value is not finite: every bound fails
  };
  const auto base = logits_of("--model " + path("model"), "base.safetensors");
  const auto adapted = logits_of("--model " + path("model") + " --adapter " + path("strong"), "a.safetensors");
  const auto merged = logits_of("--model " + path("merged"), "m.safetensors");
  ASSERT_EQ(merged.size(), adapted.size());
  EXPECT_GT(max_diff(base, adapted), 0.05) << "the adapter hardly changes the logits: the test could not fail";
  EXPECT_TRUE(testing_support::close(merged, adapted, testing_support::absolute_tolerance(1e-4)));
}

TEST_F(TrainCliTest, ResumeContinuesBitIdentically) {
  // Uninterrupted: 6 steps. Interrupted: 3 steps (checkpoint-3), then resume to 6.
  const std::string flags = " --tuner_type lora --lora_dropout 0.1 --save_steps 3 --learning_rate 2e-3";
  ASSERT_EQ(run(base_flags("a") + flags + " --max_steps 6").status, 0);
  ASSERT_EQ(run(base_flags("b") + flags + " --max_steps 3").status, 0);
  const Result r = run(base_flags("b") + flags + " --max_steps 6 --resume_from_checkpoint last");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos);
  const auto a = read_jsonl(dir_ / "a/log.jsonl"), b = read_jsonl(dir_ / "b/log.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 3; i < 6; ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"].dump(), b[i]["loss"].dump()) << "step " << a[i]["step"];
    EXPECT_EQ(a[i]["grad_norm"].dump(), b[i]["grad_norm"].dump());
  }
}

TEST_F(TrainCliTest, ResumeRefusesARunThatDiffersFromTheSavedOne) {
  const std::string flags = " --tuner_type lora --save_steps 2 --max_steps 4";
  ASSERT_EQ(run(base_flags("r") + flags + " --max_steps 2").status, 0);
  const std::string checkpoint = " --resume_from_checkpoint " + path("r/checkpoint-2");
  // Every field that differs is listed, saved vs now.
  Result r = run(base_flags("r") + flags + checkpoint + " --seed 7 --max_length 1024");
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, path("r/checkpoint-2/memtune_state.json") + ": cannot resume");
  EXPECT_CONTAINS(r.output, "seed: saved 42, now 7");
  EXPECT_CONTAINS(r.output, "max_length: saved 2048, now 1024");
  EXPECT_EQ(r.output.find("packing:"), std::string::npos) << r.output;
  r = run(base_flags("r") + flags + checkpoint + " --per_device_train_batch_size 2 --packing");
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "global_batch_size: saved 4, now 2");
  EXPECT_CONTAINS(r.output, "packing: saved false, now true");
  // The same global batch from another split (2 x 2 accumulation) resumes.
  r = run(base_flags("r") + flags + checkpoint + " --per_device_train_batch_size 2 --gradient_accumulation_steps 2");
  EXPECT_EQ(r.status, 0) << r.output;

  // A changed training file is a different run too.
  std::ofstream(dir_ / "train.jsonl", std::ios::app)
      << R"({"messages": [{"role": "user", "content": "one more"}, {"role": "assistant", "content": "red"}]})"
      << "\n";
  r = run(base_flags("r") + flags + checkpoint);
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "train_data_fingerprint: saved \"fnv1a64:");
  // Unless the user accepts the changed data knowingly.
  r = run(base_flags("r") + flags + checkpoint + " --ignore_data_mismatch");
  EXPECT_EQ(r.status, 0) << r.output;

  // A state file without a field is the user's error, naming the file and the field.
  const fs::path state = dir_ / "r/checkpoint-2/memtune_state.json";
  json doc = json::parse(std::ifstream(state));
  doc.erase("seed");
  std::ofstream(state) << doc.dump();
  r = run(base_flags("r") + flags + checkpoint);
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, state.string() + ": missing required field \"seed\"");
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
}

TEST_F(TrainCliTest, MaxLengthAboveTheModelsPositionsIsRefused) {
  const Result r = run(base_flags("long") + " --max_steps 1 --max_length 4096");  // tiny: 2048 positions
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "--max_length 4096 exceeds max_position_embeddings 2048");
  EXPECT_CONTAINS(r.output, path("model") + "/config.json");
  // A user who knows better says so explicitly.
  const Result allowed = run(base_flags("long_ok") + " --max_steps 1 --max_length 4096 --ignore_max_position_embeddings");
  EXPECT_EQ(allowed.status, 0) << allowed.output;
}

using testing_support::run_shell;

// The newest checkpoint-N of an output directory (0 if none).
int64_t newest_checkpoint(const fs::path& dir) {
  int64_t newest = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (const std::string name = e.path().filename().string(); name.starts_with("checkpoint-"))
      newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
  return newest;
}

// The schedule is constant in these tests, so a resumed run may stop earlier than planned.
TEST_F(TrainCliTest, CtrlCSavesACheckpointAndResumes) {
  const std::string train =
      testing_support::memtune_binary() + " " + base_flags("int") + " --max_steps 100000 --save_steps 100000";
  const Result r = run_shell(dir_, train +
                                       " > int.out 2>&1 & pid=$!; n=0; while [ ! -s int/log.jsonl ] && [ $n -lt 3000 ]; do "
                                       "sleep 0.02; n=$((n+1)); done; kill -INT $pid; wait $pid; echo rc=$?");
  EXPECT_CONTAINS(r.output, "rc=130");
  const int64_t saved = newest_checkpoint(dir_ / "int");
  ASSERT_GT(saved, 0) << "Ctrl-C must leave a checkpoint";
  const Result resumed = run(base_flags("int") + " --max_steps " + std::to_string(saved + 2) +
                             " --save_steps 100000 --resume_from_checkpoint last");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_EQ(json::parse(std::ifstream(dir_ / "int/trainer_state.json"))["global_step"], saved + 2);
}

// A `memtune train` running in the background (its output to a file); killed and reaped when the
// object goes, however the test ends.
class BackgroundTraining {
 public:
  BackgroundTraining(const fs::path& dir, const std::string& command, const fs::path& log) {
    // exec: the shell's pid becomes the trainer's, so a signal to pid() reaches the trainer.
    const std::string script = "cd '" + dir.string() + "' && exec " + command + " > '" + log.string() + "' 2>&1";
    const char* argv[] = {"sh", "-c", script.c_str(), nullptr};
    if (::posix_spawn(&pid_, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), environ) != 0) pid_ = -1;
  }
  BackgroundTraining(const BackgroundTraining&) = delete;
  BackgroundTraining& operator=(const BackgroundTraining&) = delete;
  ~BackgroundTraining() {
    if (pid_ > 0 && !status_) kill_and_reap();
  }
  pid_t pid() const { return pid_; }
  // The wait status once the process has ended, without waiting.
  std::optional<int> ended() {
    int status = 0;
    if (!status_ && ::waitpid(pid_, &status, WNOHANG) == pid_) status_ = status;
    return status_;
  }
  // SIGKILL (if it still runs), then its wait status.
  int kill_and_reap() {
    if (!status_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      status_ = status;
    }
    return *status_;
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

// A save writes checkpoint-N under the name tmp-checkpoint-N and renames it once complete (a run
// that starts clears what a crash left). Each round starts training (resuming from the newest
// checkpoint after the first), lets four saves complete (beyond --save_total_limit 3, so the
// oldest are rotated away), and sends SIGKILL the moment inotify reports the fifth save's
// tmp-checkpoint-N created. That directory still there once the process is dead proves the kill
// landed inside the save: only the save's end (the rename) or its failure removes it. A kill that
// came after the rename proves nothing, so rounds go on until one landed (at least three rounds;
// the round limit and the wait limit only turn a hang into a failure). After every kill, every
// checkpoint left loads: training resumes from each and takes a step.
TEST_F(TrainCliTest, KillDuringSavesLeavesLoadableCheckpoints) {
  const fs::path out = dir_ / "kill";
  fs::create_directories(out);  // watched from before the trainer starts
  const std::string flags = " --save_steps 1 --save_total_limit 3";
  const std::string train = testing_support::memtune_binary() + " " + base_flags("kill") + flags + " --max_steps 100000";
  int kills = 0, kills_during_a_save = 0;
  for (int round = 0; kills < 3 || (kills_during_a_save == 0 && round < 20); ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const int64_t resumed_from = newest_checkpoint(out);
    const int64_t killed_save = resumed_from + 5;
    const int watch = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    ASSERT_GE(watch, 0) << std::strerror(errno);
    ASSERT_GE(::inotify_add_watch(watch, out.c_str(), IN_CREATE | IN_MOVED_TO), 0) << std::strerror(errno);
    const fs::path log = dir_ / ("kill_" + std::to_string(round) + ".out");
    BackgroundTraining training(dir_, train + (resumed_from > 0 ? " --resume_from_checkpoint last" : ""), log);
    ASSERT_GT(training.pid(), 0);
    // Waits for the save's temporary directory, or for its final one appearing without it; wakes
    // each second only to see whether the trainer ended on its own.
    const std::string killed_tmp = "tmp-checkpoint-" + std::to_string(killed_save);
    const std::string killed_final = "checkpoint-" + std::to_string(killed_save);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(5);
    bool killed = false, final_first = false;
    while (!killed && !final_first && !training.ended() && std::chrono::steady_clock::now() < give_up) {
      pollfd ready{.fd = watch, .events = POLLIN, .revents = 0};
      if (::poll(&ready, 1, 1000) <= 0) continue;
      alignas(inotify_event) char events[4096];
      const ssize_t n = ::read(watch, events, sizeof events);
      for (ssize_t at = 0; at < n && !killed && !final_first;) {
        const auto* e = reinterpret_cast<const inotify_event*>(events + at);
        if (e->len > 0 && killed_tmp == e->name && (e->mask & IN_CREATE)) {
          ::kill(training.pid(), SIGKILL);
          killed = true;
        }
        final_first = e->len > 0 && killed_final == e->name;
        at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
      }
    }
    ::close(watch);
    const int status = training.kill_and_reap();
    ASSERT_TRUE(killed) << (final_first ? killed_final + " appeared without " + killed_tmp + " before it"
                                        : "no " + killed_tmp + " appeared")
                        << " (the trainer " << (WIFSIGNALED(status) ? "was still running" : "ended on its own")
                        << "):\n"
                        << testing_support::read_text(log);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << testing_support::read_text(log);
    ++kills;
    if (fs::exists(out / killed_tmp)) {
      ++kills_during_a_save;
      EXPECT_FALSE(fs::exists(out / ("checkpoint-" + std::to_string(killed_save))))
          << "the save the kill cut short left its checkpoint under the final name";
    }
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string name = e.path().filename().string();
      if (!name.starts_with("checkpoint-")) continue;
      const int64_t step = std::stoll(name.substr(11));
      fs::remove_all(dir_ / "loaded");
      const Result loaded = run(base_flags("loaded") + " --save_strategy no --resume_from_checkpoint " +
                                e.path().string() + " --max_steps " + std::to_string(step + 1));
      ASSERT_EQ(loaded.status, 0) << name << " left by the kill does not load:\n" << loaded.output;
      EXPECT_EQ(testing_support::read_json(dir_ / "loaded/trainer_state.json")["global_step"], step + 1) << name;
    }
  }
  EXPECT_GT(kills_during_a_save, 0) << "none of " << kills << " kills landed while a save was in progress";
  // The run goes on from the newest checkpoint, clearing what the interrupted saves left.
  const int64_t saved = newest_checkpoint(out);
  const Result resumed =
      run(base_flags("kill") + flags + " --max_steps " + std::to_string(saved + 2) + " --resume_from_checkpoint last");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_EQ(json::parse(std::ifstream(out / "trainer_state.json"))["global_step"], saved + 2);
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_FALSE(e.path().filename().string().starts_with("tmp-checkpoint-")) << e.path() << " left after resuming";
}

// Every command that computes runs on the reference backend (whose memory the process cannot
// touch outside the backend's calls, so a stray host access would crash) and agrees with cpu.
TEST_F(TrainCliTest, EveryCommandRunsOnTheReferenceBackendAndAgreesWithCpu) {
  const std::string eval_flags = " --eval_file " + path("train.jsonl") + " --eval_strategy steps --eval_steps 2";
  for (const char* backend : {"cpu", "reference"}) {
    const std::string b = std::string(" --backend ") + backend;
    const Result full = run(base_flags(std::string("full_") + backend) + b +
                            " --tuner_type full --max_steps 2 --save_steps 1 --learning_rate 3e-3 --bf16" + eval_flags);
    ASSERT_EQ(full.status, 0) << full.output;
    const Result resumed = run(base_flags(std::string("full_") + backend) + b +
                               " --tuner_type full --max_steps 3 --save_steps 1 --learning_rate 3e-3 --bf16 "
                               "--resume_from_checkpoint last");
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    const Result lora = run(base_flags(std::string("lora_") + backend) + b +
                            " --max_steps 2 --lora_rank 4 --lora_dropout 0.1 --learning_rate 5e-3");
    ASSERT_EQ(lora.status, 0) << lora.output;
    ASSERT_EQ(run("merge" + b + " --model " + path("model") + " --adapter " + path(std::string("lora_") + backend) +
                  " --out " + path(std::string("merged_") + backend))
                  .status,
              0);
    std::ofstream(dir_ / "in.json") << R"({"input_ids": [[5, 17, 200, 3, 99, 42]]})";
    ASSERT_EQ(run("dump" + b + " --model " + path(std::string("merged_") + backend) + " --input " + path("in.json") +
                  " --out " + path(std::string("dump_") + backend + ".safetensors"))
                  .status,
              0);
    const Result eval =
        run("eval" + b + " --model_name_or_path " + path(std::string("full_") + backend) + " --eval_file " +
            path("train.jsonl") + " --json --metrics eval_loss,token_accuracy,top5_accuracy");
    ASSERT_EQ(eval.status, 0) << eval.output;
    std::ofstream(dir_ / (std::string("eval_") + backend + ".json")) << eval.output.substr(eval.output.find('{'));
  }
  auto logs = [&](const std::string& out) { return read_jsonl(dir_ / out / "log.jsonl"); };
  const auto lc = logs("full_cpu"), lr = logs("full_reference");
  ASSERT_EQ(lc.size(), lr.size());
  // --bf16: the reference rounds the products' operands to bfloat16 always; the cpu where it has
  // bfloat16 kernels (then both round at the same points), float32 arithmetic elsewhere (a CPU
  // without AVX512-BF16 or AMX), which bfloat16's rounding (2^-8) bounds: 1.5e-4 measured on an
  // AVX2-only AMD EPYC.
  const double bound = backend_named("cpu").sixteen_bit_products(DType::BF16).empty() ? 2e-3 : 1e-4;
  for (size_t i = 0; i < lc.size(); ++i)
    for (const char* key : {"loss", "eval_loss"}) {
      if (!lc[i].contains(key)) continue;
      EXPECT_NEAR(lr[i][key].get<double>(), lc[i][key].get<double>(), bound * lc[i][key].get<double>()) << key;
    }
  EXPECT_EQ(read_jsonl(dir_ / "lora_reference" / "log.jsonl").size(), 2u);
  const json ec = json::parse(std::ifstream(dir_ / "eval_cpu.json")),
             er = json::parse(std::ifstream(dir_ / "eval_reference.json"));
  EXPECT_NEAR(er["eval_loss"].get<double>(), ec["eval_loss"].get<double>(), 1e-4 * ec["eval_loss"].get<double>());
  EXPECT_EQ(er["token_accuracy"], ec["token_accuracy"]);
  auto loss_of = [&](const std::string& file) {
    SafetensorsFile d(path(file));
    float v;
    std::memcpy(&v, d.data(*d.find("loss")).data(), 4);
    return v;
  };
  EXPECT_NEAR(loss_of("dump_reference.safetensors"), loss_of("dump_cpu.safetensors"), 1e-3);
  const Result bad = run(base_flags("bad") + " --backend tpu --max_steps 1");
  EXPECT_EQ(bad.status, 1);
  EXPECT_CONTAINS(bad.output, "--backend");
}

// The same commands on a Vulkan device (lavapipe in CI): training equals cpu step by step and
// resumes bit-identically on the device, eval, greedy generation and a merged adapter equal cpu.
// MEMTUNE_VULKAN_PROFILE=1: per shader, device seconds, dispatches, workgroups, and the FLOPs
// and bytes by design (src/backend/vulkan/geometry.cpp) with the rates they make, for a greedy
// generation (matvec for the projections and the head, paged attention) on the device. ("OnVulkan"
// in the name: the sanitizer run leaves it out, as Mesa's drivers keep allocations to exit.)
TEST_F(TrainCliTest, ProfileOnVulkanGivesEachShadersWorkByDesignAndItsRates) {
  if (run("devices --json").output.find("\"backend_vulkan_device\": null") != std::string::npos) {
    SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device: " + run("devices").output);
  }
  std::ofstream(dir_ / "p.jsonl") << R"({"prompt_ids": [5, 17, 200, 3]})" << "\n";
  const Result r = testing_support::run_command("MEMTUNE_VULKAN_PROFILE=1 " + testing_support::memtune_binary() +
                                                " generate --backend vulkan --model " + path("model") + " --input " +
                                                path("p.jsonl") + " --max_new_tokens 3 --temperature 0 --ignore_eos");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::regex line(R"(vulkan profile: (\S+)\s+(\S+) s in (\d+) dispatches, (\d+) workgroups, (\S+) GFLOP, )"
                        R"((\S+) GB: (\S+) GFLOP/s, (\S+) GB/s)");
  std::map<std::string, std::array<double, 7>> by_shader;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it)
    for (size_t k = 0; k < 7; ++k) by_shader[(*it)[1]][k] = std::stod((*it)[k + 2]);
  for (const char* shader : {"matvec", "paged_attention", "rmsnorm", "sample"}) {
    SCOPED_TRACE(shader);
    ASSERT_TRUE(by_shader.count(shader)) << r.output;
    const auto& [seconds, dispatches, workgroups, gflop, gb, gflop_s, gb_s] = by_shader[shader];
    EXPECT_GT(seconds, 0.0);
    EXPECT_GE(dispatches, 3.0);  // a prefill and two decode steps at least
    EXPECT_GE(workgroups, dispatches);
    EXPECT_GT(gb, 0.0);
    EXPECT_NEAR(gb_s, gb / seconds, 1e-4 * gb_s);
    EXPECT_NEAR(gflop_s, gflop / seconds, 1e-4 * gflop_s + 1e-12);
  }
  EXPECT_GT(by_shader["matvec"][3], 0.0);
}

// Decoding steps of the same sequences, sampled rows and adapters run the commands recorded at the
// first of them again (MEMTUNE_VULKAN_REUSE, default on): requests of several lengths, sampled with
// penalties, two at a time (so the batch changes), give the same tokens with reuse off, on and
// checked (every step recorded and compared with the first recording, command by command), with the
// same dispatches, barriers and submissions per step; on, the host records only sampling's.
TEST_F(TrainCliTest, DecodingStepsReplayTheirRecordedCommandsOnVulkan) {
  if (run("devices --json").output.find("\"backend_vulkan_device\": null") != std::string::npos)
    SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device: " + run("devices").output);
  std::ofstream(dir_ / "p.jsonl") << R"({"prompt_ids": [5]})" << "\n"
                                  << R"({"prompt_ids": [5, 17, 200, 3, 9]})" << "\n"
                                  << R"({"prompt_ids": [8, 1, 2, 3, 4, 5, 6, 7, 9]})" << "\n";
  std::map<std::string, nlohmann::json> outputs, work;
  for (const std::string mode : {"0", "1", "check"}) {
    const Result r = testing_support::run_command(
        "MEMTUNE_VULKAN_REUSE=" + mode + " " + testing_support::memtune_binary() + " generate --backend vulkan --model " +
        path("model") + " --input " + path("p.jsonl") + " --output " + path("reuse_" + mode + ".jsonl") +
        " --max_new_tokens 4 --temperature 0.8 --top_p 0.9 --repetition_penalty 1.1 --seed 3 --ignore_eos "
        "--max_num_seqs 2 --json");
    ASSERT_EQ(r.status, 0) << mode << ": " << r.output;
    work[mode] = nlohmann::json::parse(r.output.substr(r.output.rfind("\n{") + 1))["device_work"]["decode_step"];
    outputs[mode] = read_jsonl(dir_ / ("reuse_" + mode + ".jsonl"));
    ASSERT_EQ(outputs[mode].size(), 3u);
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(outputs["1"][i]["token_ids"], outputs["0"][i]["token_ids"]) << i;
    EXPECT_EQ(outputs["check"][i]["token_ids"], outputs["0"][i]["token_ids"]) << i;
  }
  for (const char* count : {"dispatches", "barriers", "submissions"})
    for (const char* mode : {"1", "check"}) EXPECT_EQ(work[mode][count], work["0"][count]) << count << " " << mode;
  EXPECT_EQ(work["0"]["replayed_dispatches"]["max"], 0);
  EXPECT_EQ(work["check"]["replayed_dispatches"]["max"], 0);
  const nlohmann::json& on = work["1"];
  EXPECT_GT(on["replayed_dispatches"]["mean"].get<double>(), 0.0) << on.dump();
  // The step that replays most leaves the host sampling's dispatches (penalties, then the draw).
  EXPECT_GE(on["replayed_dispatches"]["max"].get<int64_t>() + 2, on["dispatches"]["max"].get<int64_t>()) << on.dump();
  EXPECT_GE(on["replayed_command_buffers"]["max"].get<int64_t>(), 1) << on.dump();
}

// A bfloat16 model's norm weights and biases are widened to float32 once per load, not at every
// use: generating five tokens on vulkan runs one convert per 1-D parameter in all (the device's
// profile counts the dispatches), and the plan holds them in one persistent buffer instead of
// per-phase scratch. Generation equals cpu's.
TEST_F(TrainCliTest, AFrozenBfloat16BaseWidensItsVectorsOncePerLoadOnVulkan) {
  if (run("devices --json").output.find("\"backend_vulkan_device\": null") != std::string::npos)
    SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device: " + run("devices").output);
  ASSERT_EQ(run("init-model --preset tiny --seed 3 --torch_dtype bfloat16 --out " + path("bf16")).status, 0);
  testing_support::write_synthetic_tokenizer(dir_ / "bf16");
  int64_t vectors = 0, elements = 0;
  const SafetensorsFile model(path("bf16/model.safetensors"));
  for (const TensorInfo& t : model.tensors())
    if (t.shape.size() == 1) {
      ++vectors;
      elements += t.numel();
    }
  ASSERT_GE(vectors, 5);  // two layers' norms and q/k/v biases, the final norm
  std::ofstream(dir_ / "p.jsonl") << R"({"prompt_ids": [5, 17, 200, 3]})" << "\n";
  const std::string flags = " --model " + path("bf16") + " --input " + path("p.jsonl") +
                            " --max_new_tokens 5 --temperature 0 --ignore_eos";
  const Result r = testing_support::run_command("MEMTUNE_VULKAN_PROFILE=1 " + testing_support::memtune_binary() +
                                                " generate --backend vulkan --output " + path("v.jsonl") + flags);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::regex line(R"(vulkan profile: convert\s+\S+ s in (\d+) dispatches)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, line)) << r.output;
  EXPECT_EQ(std::stoll(m[1]), vectors) << r.output;
  ASSERT_EQ(run("generate --backend cpu --output " + path("c.jsonl") + flags).status, 0);
  EXPECT_EQ(read_jsonl(dir_ / "v.jsonl").at(0)["output_ids"], read_jsonl(dir_ / "c.jsonl").at(0)["output_ids"]);
  // The plan's only working memory outside the steps' phases: the widened vectors.
  const Result plan = run("plan --inference --backend vulkan --json --model " + path("bf16"));
  ASSERT_EQ(plan.status, 0) << plan.output;
  const nlohmann::json j = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  EXPECT_EQ(j["table"]["optimizer"]["working"].get<int64_t>(), 4 * elements) << j.dump();
}

// --fp16 on a device with float16 cooperative matrices (gemm_coopmat.comp): mixed precision, as
// the arithmetic: line says, no float32 copy of a weight in the plan, and full fine-tuning steps
// whose losses equal the reference backend's (the same float16 operands, exact products summed
// in float64) to float32 rounding. Where the device has no such products: skipped, or failed
// where every test is required (the release tests on Debian 12's lavapipe exclude VulkanCoopmat;
// scripts/coopmat-root.sh runs them on Mesa 26's).
TEST_F(TrainCliTest, VulkanCoopmatFloat16MixedPrecisionTrainsAsTheReference) {
  const Result devices = run("devices --json");
  if (devices.output.find("gemm_coopmat.comp") == std::string::npos)
    SKIP_OR_FAIL_WHERE_REQUIRED("no float16 cooperative-matrix products on this machine's Vulkan device:\n" +
                                run("devices").output);
  ASSERT_EQ(run("init-model --preset tiny --seed 1 --torch_dtype float16 --out " + path("model16")).status, 0);
  testing_support::write_synthetic_tokenizer(dir_ / "model16");
  const std::string flags = " --model_name_or_path " + path("model16") + " --train_file " + path("train.jsonl") +
                            " --per_device_train_batch_size 4 --logging_steps 1 --lr_scheduler_type constant"
                            " --tuner_type full --fp16 --max_steps 6 --learning_rate 1e-3";
  const Result plan = run("plan --backend vulkan" + flags);
  ASSERT_EQ(plan.status, 0) << plan.output;
  EXPECT_CONTAINS(plan.output, "arithmetic: mixed precision: the linear layers', the LM head's and attention's "
                               "products take float16 operands with float32 accumulation (cooperative matrices");
  EXPECT_CONTAINS(plan.output, "attention: cooperative matrices");
  std::map<std::string, std::vector<double>> losses;
  for (const std::string backend : {"reference", "vulkan"}) {
    // On vulkan with the device's profile: the products and attention's three passes ran on the
    // matrix units, and no float32 product or attention shader did; the MLP's activation ran in
    // its gate and up's pass (no swiglu.comp).
    const Result r = testing_support::run_command(std::string(backend == "vulkan" ? "MEMTUNE_VULKAN_PROFILE=1 " : "") +
                                                  testing_support::memtune_binary() +
                                 " train --backend " + backend + " --output_dir " + path("fp16_" + backend) + flags);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_CONTAINS(r.output, "arithmetic: mixed precision");
    if (backend == "vulkan") {
      // Attention's passes on flexible matrices where the device has them (attention_coopmat2.glsl).
      const bool flexible = devices.output.find("attention_coopmat2.comp") != std::string::npos;
      const std::string on = flexible ? "2" : "", off = flexible ? "" : "2";
      for (const std::string shader : {std::string("gemm_coopmat"), "attention_coopmat" + on,
                                       "attention_backward_dq_coopmat" + on, "attention_backward_dkv_coopmat" + on})
        EXPECT_CONTAINS(r.output, fmt::format("vulkan profile: {} ", shader));
      for (const std::string shader :
           {std::string("gemm"), std::string("attention"), std::string("attention_backward_dq"),
            std::string("attention_backward_dkv"), "attention_coopmat" + off, "attention_backward_dq_coopmat" + off,
            "attention_backward_dkv_coopmat" + off, std::string("swiglu")})
        EXPECT_EQ(r.output.find(fmt::format("vulkan profile: {} ", shader)), std::string::npos) << shader;
    }
    // A step's loss, or -1 where dynamic loss scaling skipped it (the first steps overflow float16
    // at the initial scale of 65536, as under Hugging Face's GradScaler).
    for (const auto& rec : read_jsonl(dir_ / ("fp16_" + backend) / "log.jsonl"))
      if (rec.contains("loss") || rec.contains("skipped"))
        losses[backend].push_back(rec.contains("loss") ? rec["loss"].get<double>() : -1.0);
  }
  const auto &want = losses["reference"], &got = losses["vulkan"];
  ASSERT_EQ(want.size(), 6u);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_GT(std::count_if(want.begin(), want.end(), [](double l) { return l > 0; }), 2) << "too few steps trained";
  // 1.8e-6 and 1.2e-6 relative measured on Mesa 26's lavapipe.
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-5 * std::abs(want[i])) << "step " << i + 1;
}

TEST_F(TrainCliTest, EveryCommandRunsOnVulkanAndAgreesWithCpu) {
  if (run("devices --json").output.find("\"backend_vulkan_device\": null") != std::string::npos ||
      run("devices --json").status != 0) {
    SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device: " + run("devices").output);
  }
  for (const char* backend : {"cpu", "vulkan"}) {
    const std::string b = std::string(" --backend ") + backend;
    Result r = run(base_flags(std::string("lora_") + backend) + b +
                   " --max_steps 4 --lora_rank 4 --learning_rate 5e-3 --gradient_accumulation_steps 2");
    ASSERT_EQ(r.status, 0) << r.output;
    r = run(base_flags(std::string("full_") + backend) + b + " --tuner_type full --bf16 --max_steps 4 --save_steps 2");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  auto losses = [&](const std::string& out) {
    std::vector<double> v;
    for (const auto& rec : read_jsonl(dir_ / out / "log.jsonl"))
      if (rec.contains("loss")) v.push_back(rec["loss"].get<double>());
    return v;
  };
  for (const char* run_name : {"lora", "full"}) {
    const auto c = losses(std::string(run_name) + "_cpu"), v = losses(std::string(run_name) + "_vulkan");
    ASSERT_EQ(c.size(), 4u);
    ASSERT_EQ(v.size(), c.size());
    for (size_t i = 0; i < c.size(); ++i) EXPECT_NEAR(v[i], c[i], 1e-4 * c[i]) << run_name << " step " << i + 1;
    // The phases of each logged step come from the device's timestamps: each took some time.
    // The device runs the steps one after another, each logged once it has finished (a step
    // later than the host recorded it), so the phases of the steps so far fit in the wall clock
    // since the run began.
    double phases = 0;
    for (const auto& rec : read_jsonl(dir_ / (std::string(run_name) + "_vulkan") / "log.jsonl")) {
      EXPECT_EQ(rec["phase_clock"], "device");
      for (const char* key : {"forward_seconds", "loss_seconds", "backward_seconds"}) {
        EXPECT_GT(rec[key].get<double>(), 0.0) << key;
        phases += rec[key].get<double>();
      }
      EXPECT_LT(phases, rec["elapsed_seconds"].get<double>()) << rec.dump();
    }
  }
  // Resume on the device from checkpoint-2: the same steps 3 and 4, bit for bit.
  fs::rename(dir_ / "full_vulkan", dir_ / "full_vulkan_whole");
  fs::create_directories(dir_ / "full_vulkan");
  fs::copy(dir_ / "full_vulkan_whole/checkpoint-2", dir_ / "full_vulkan/checkpoint-2", fs::copy_options::recursive);
  const Result resumed = run(base_flags("full_vulkan") + " --backend vulkan --tuner_type full --bf16 --max_steps 4 "
                             "--save_steps 2 --resume_from_checkpoint last");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const auto whole = losses("full_vulkan_whole"), again = losses("full_vulkan");
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[0], whole[2]);
  EXPECT_EQ(again[1], whole[3]);
  // eval and greedy generation of the trained model, and the adapter merged on the device.
  std::ofstream(dir_ / "p.jsonl") << R"({"prompt_ids": [5, 17, 200, 3]})" << "\n" << R"({"prompt_ids": [9]})" << "\n";
  std::map<std::string, json> eval;
  std::map<std::string, json> generated, generate_summary;
  for (const char* backend : {"cpu", "vulkan"}) {
    const std::string b = std::string(" --backend ") + backend;
    const Result e = run("eval" + b + " --model_name_or_path " + path("full_cpu") + " --eval_file " +
                         path("train.jsonl") + " --json --metrics eval_loss,token_accuracy,top5_accuracy" +
                         " --save_predictions " + path(std::string("pred_") + backend + ".jsonl"));
    ASSERT_EQ(e.status, 0) << e.output;
    eval[backend] = json::parse(e.output.substr(e.output.find("{\"")));
    const Result g = run("generate" + b + " --model " + path("model") + " --adapter " + path("lora_cpu") + " --input " +
                         path("p.jsonl") + " --max_new_tokens 8 --temperature 0 --ignore_eos --json --output " +
                         path(std::string("gen_") + backend + ".jsonl"));
    ASSERT_EQ(g.status, 0) << g.output;
    generate_summary[backend] = json::parse(g.output.substr(g.output.rfind("\n{") + 1));  // the last line
    generated[backend] = read_jsonl(dir_ / (std::string("gen_") + backend + ".jsonl"));
    // Sampling with every filter and penalty, chosen on the device for vulkan (token ids come
    // back, not logits): the same draws pick the same tokens as the host sampler on cpu.
    const Result s = run("generate" + b + " --model " + path("model") + " --input " + path("p.jsonl") +
                         " --max_new_tokens 12 --temperature 0.9 --top_k 50 --top_p 0.95 --min_p 0.01"
                         " --repetition_penalty 1.2 --presence_penalty 0.3 --seed 5 --ignore_eos --output " +
                         path(std::string("sampled_") + backend + ".jsonl"));
    ASSERT_EQ(s.status, 0) << s.output;
    generated[std::string("sampled_") + backend] = read_jsonl(dir_ / (std::string("sampled_") + backend + ".jsonl"));
    ASSERT_EQ(run("merge" + b + " --model " + path("model") + " --adapter " + path("lora_cpu") + " --out " +
                  path(std::string("merged_") + backend))
                  .status,
              0);
  }
  EXPECT_NEAR(eval["vulkan"]["eval_loss"].get<double>(), eval["cpu"]["eval_loss"].get<double>(),
              1e-4 * eval["cpu"]["eval_loss"].get<double>());
  EXPECT_EQ(eval["vulkan"]["token_accuracy"], eval["cpu"]["token_accuracy"]);
  EXPECT_EQ(eval["vulkan"]["top5_accuracy"], eval["cpu"]["top5_accuracy"]);
  // Predictions from the device's per-row statistics: the same argmax, the same per-sequence loss.
  const auto pred_cpu = read_jsonl(dir_ / "pred_cpu.jsonl"), pred_vulkan = read_jsonl(dir_ / "pred_vulkan.jsonl");
  ASSERT_EQ(pred_vulkan.size(), pred_cpu.size());
  for (size_t i = 0; i < pred_cpu.size(); ++i) {
    EXPECT_EQ(pred_vulkan[i]["argmax"], pred_cpu[i]["argmax"]) << i;
    EXPECT_NEAR(pred_vulkan[i]["loss"].get<double>(), pred_cpu[i]["loss"].get<double>(),
                1e-4 * pred_cpu[i]["loss"].get<double>());
  }
  // Greedy ids: the device's equal cpu's, or part from them only at a near tie: where they first
  // differ, cpu's own logits for the prompt and the ids before it (dump) hold the two tokens within
  // 1e-4 of the largest logit (float32 sums in another order, as on a GPU, may swap them).
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 200, 3}, {9}};
  auto greedy_agree = [&](size_t i) -> ::testing::AssertionResult {
    const auto a = generated["cpu"][i]["token_ids"].get<std::vector<int32_t>>(),
               b = generated["vulkan"][i]["token_ids"].get<std::vector<int32_t>>();
    if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tokens";
    size_t k = 0;
    while (k < a.size() && a[k] == b[k]) ++k;
    if (k == a.size()) return ::testing::AssertionSuccess();
    std::vector<int32_t> prefix = prompts[i];
    prefix.insert(prefix.end(), a.begin(), a.begin() + static_cast<std::ptrdiff_t>(k));
    std::ofstream(dir_ / "prefix.json") << json{{"input_ids", {prefix}}}.dump();
    const Result d = run("dump --model " + path("model") + " --adapter " + path("lora_cpu") + " --input " +
                         path("prefix.json") + " --out " + path("prefix.safetensors"));
    if (d.status != 0) return ::testing::AssertionFailure() << d.output;
    SafetensorsFile f(path("prefix.safetensors"));
    const auto bytes = f.data(*f.find("logits"));
    std::vector<float> z(bytes.size() / 4);
    std::memcpy(z.data(), bytes.data(), bytes.size());
    const size_t V = z.size() / prefix.size(), last = (prefix.size() - 1) * V;
    float scale = 0;
    for (size_t v = 0; v < V; ++v) scale = std::max(scale, std::abs(z[last + v]));
    const float gap = std::abs(z[last + static_cast<size_t>(a[k])] - z[last + static_cast<size_t>(b[k])]);
    if (gap <= 1e-4f * (scale + 1)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "token " << k << ": cpu " << a[k] << ", vulkan " << b[k]
                                         << ", cpu's logits " << gap << " apart (largest " << scale << ")";
  };
  // Sampled ids: the same draws choose the same tokens where the device computes as the host
  // does closely enough (lavapipe); on a GPU a draw near a boundary of the cumulative
  // probabilities may fall on the other side, so there only their count and range are checked.
  const std::string devices_out = run("devices --json").output;
  const json devices = json::parse(devices_out.substr(devices_out.find('{')));
  bool cpu_device = false;
  for (const json& d : devices["devices"])
    if (d["index"] == devices["backend_vulkan_device"]) cpu_device = d["type"] == "CPU";
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(greedy_agree(i)) << "request " << i;
    const auto sampled = generated["sampled_vulkan"][i]["token_ids"];
    EXPECT_EQ(sampled.size(), 12u);
    for (const auto& t : sampled) EXPECT_LT(t.get<int64_t>(), 512);
    if (cpu_device) {
      EXPECT_EQ(sampled, generated["sampled_cpu"][i]["token_ids"]) << i;
    }
  }
  // The device's own memory figures beside the plan: lavapipe has no VK_EXT_memory_budget, so
  // the process's RSS is the measurement; a GPU driver's usage must hold the arena.
  const json memory = json::parse(std::ifstream(dir_ / "full_vulkan_whole" / "memory.json"));
  ASSERT_TRUE(memory.contains("device")) << memory.dump();
  const json& device = memory["device"];
  EXPECT_GT(device["device_heap_bytes"].get<uint64_t>(), 0u);
  if (device.contains("device_usage_bytes")) {
    const json& u = device["device_usage_bytes"];
    EXPECT_GE(u["after_arena"].get<uint64_t>() - u["before_arena"].get<uint64_t>(), memory["arena_bytes"].get<uint64_t>());
    EXPECT_GE(u["peak"].get<uint64_t>(), u["after_arena"].get<uint64_t>());
  } else {
    EXPECT_TRUE(device["measurement"].get<std::string>().starts_with("process_peak_rss_bytes")) << device.dump();
  }
  EXPECT_FALSE(json::parse(std::ifstream(dir_ / "full_cpu" / "memory.json")).contains("device"));
  // What the host asked of the device, from the backend's own counters: per training step (4 of
  // them), per evaluation batch, per decode and prefill step of generation; none on cpu. A decode
  // step waits once (for its token ids); an evaluation batch once (the targets' row losses and
  // the row statistics come back together). A training step is decided on the device and read one step late: the host
  // records step N + 1, then waits for step N's norm, loss sums and timestamps (two micro-batches
  // in the LoRA run), so that wait leaves step N + 1 queued ("overlapped"); a step is read at
  // once only where the host must know it first: the last step, and a checkpoint (the full run
  // saves at step 2). So each step is read with one wait, and the units hold 0, 1 or 2 of them
  // (docs/architecture.md: the submission model).
  std::set<std::string> ran;
  auto work = [&](const json& w, const std::string& unit, int64_t units, uint64_t waits, uint64_t overlapped,
                  bool every_unit) {
    SCOPED_TRACE(w.dump());
    EXPECT_EQ(w["unit"], unit);
    EXPECT_EQ(w["units"], units);
    EXPECT_DOUBLE_EQ(w["waits"]["mean"].get<double>() * static_cast<double>(units), static_cast<double>(waits));
    EXPECT_DOUBLE_EQ(w["overlapped_waits"]["mean"].get<double>() * static_cast<double>(units),
                     static_cast<double>(overlapped));
    if (every_unit) {
      EXPECT_EQ(w["waits"]["max"].get<uint64_t>() * static_cast<uint64_t>(units), waits);
      EXPECT_EQ(w["waits"]["min"].get<uint64_t>() * static_cast<uint64_t>(units), waits);
    } else {
      EXPECT_LE(w["waits"]["max"].get<uint64_t>(), 2u);
    }
    // Work is submitted every 64 dispatches without a wait: the device starts on a step while the
    // host records the rest of it, and the step's one wait comes after several submissions.
    const uint64_t dispatches = w["dispatches"]["min"], submissions = w["submissions"]["min"];
    EXPECT_GE(submissions, std::max<uint64_t>(w["waits"]["min"].get<uint64_t>(), (dispatches + 63) / 64));
    EXPECT_GT(w["dispatches"]["min"].get<uint64_t>(), 10u);
    // Barriers only where a command meets what one since the last barrier wrote (context.h): the
    // independent commands of a layer (q / k / v, gate / up, a gradient's two products) share one.
    EXPECT_GT(w["barriers"]["min"].get<uint64_t>(), 0u);
    EXPECT_LT(w["barriers"]["mean"].get<double>(), w["dispatches"]["mean"].get<double>());
    for (const auto& [shader, n] : w["dispatches_by_shader"].items()) ran.insert(shader);
  };
  work(json::parse(std::ifstream(dir_ / "lora_vulkan" / "memory.json"))["device_work"], "training step", 4, 4, 3,
       false);
  work(json::parse(std::ifstream(dir_ / "full_vulkan_whole" / "memory.json"))["device_work"], "training step", 4, 4,
       2, false);
  EXPECT_TRUE(json::parse(std::ifstream(dir_ / "full_cpu" / "memory.json"))["device_work"].is_null());
  work(eval["vulkan"]["device_work"], "evaluation batch", 2, 2, 0, true);
  EXPECT_TRUE(eval["cpu"]["device_work"].is_null());
  work(generate_summary["vulkan"]["device_work"]["decode_step"], "decode step", 7, 7, 0, true);
  work(generate_summary["vulkan"]["device_work"]["prefill_step"], "prefill step", 1, 1, 0, true);
  EXPECT_TRUE(generate_summary["cpu"]["device_work"].is_null());
  // Every shader that ran is in the dispatch lists whose geometry is checked at real shapes.
  const std::set<std::string> listed = vulkan_geometry_listed_shaders();
  for (const std::string& shader : ran) EXPECT_TRUE(listed.count(shader)) << shader << " is not in the geometry lists";
  // The plan names the device and the allocation; --device_memory auto is the device's memory.
  const Result plan = run("plan --backend vulkan --json --device_memory auto --model_name_or_path " + path("model"));
  ASSERT_EQ(plan.status, 0) << plan.output;
  const json pj = json::parse(plan.output.substr(plan.output.find("{\"")));
  EXPECT_EQ(pj["device"]["device_heap_bytes"], device["device_heap_bytes"]);
  ASSERT_EQ(pj["device"]["allocations"].size(), 1u);  // lavapipe holds 2 GiB in one allocation
  EXPECT_EQ(pj["device"]["allocations"][0].get<uint64_t>(), pj["peak_bytes"].get<uint64_t>());
  EXPECT_TRUE(pj["device"]["fits"].get<bool>());
  EXPECT_GT(pj["device_memory_bytes"].get<uint64_t>(), 0u);
  EXPECT_LE(pj["device_memory_bytes"].get<uint64_t>(), device["device_heap_bytes"].get<uint64_t>());
  EXPECT_NE(pj["device_memory_source"].get<std::string>().find(device["name"].get<std::string>()), std::string::npos);
  SafetensorsFile mc(path("merged_cpu/model.safetensors")), mv(path("merged_vulkan/model.safetensors"));
  const TensorInfo* q = mv.find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  const auto a = mc.data(*mc.find("model.layers.0.self_attn.q_proj.weight")), v = mv.data(*q);
  ASSERT_EQ(a.size(), v.size());
  std::vector<float> x(a.size() / 4), y(v.size() / 4);
  std::memcpy(x.data(), a.data(), x.size() * 4);
  std::memcpy(y.data(), v.data(), y.size() * 4);
  EXPECT_TRUE(testing_support::close(y, x, testing_support::absolute_tolerance(1e-5)));
}

TEST_F(TrainCliTest, EvalStreamsMetricsForABaseModelAndAnAdapter) {
  ASSERT_EQ(run(base_flags("ad") + " --max_steps 3 --learning_rate 5e-3 --lora_rank 4").status, 0);
  auto eval = [&](const std::string& extra) {
    const Result r = run("eval --model_name_or_path " + path("model") + " --eval_file " + path("train.jsonl") +
                         " --json --metrics eval_loss,perplexity,token_accuracy,top5_accuracy" + extra);
    EXPECT_EQ(r.status, 0) << r.output;
    return json::parse(r.output.substr(r.output.find('{')));
  };
  const json base = eval(" --save_predictions " + path("pred.jsonl")),
             adapted = eval(" --adapter " + path("ad") + " --per_device_eval_batch_size 1");
  // Per-example predictions, streamed: their token-weighted loss is the eval loss.
  const auto preds = read_jsonl(dir_ / "pred.jsonl");
  ASSERT_EQ(preds.size(), 12u);
  double weighted = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < preds.size(); ++i) {
    EXPECT_EQ(preds[i]["index"], i);
    EXPECT_EQ(preds[i]["argmax"].size(), preds[i]["num_targets"].get<size_t>());
    weighted += preds[i]["loss"].get<double>() * preds[i]["num_targets"].get<double>();
    tokens += preds[i]["num_targets"].get<int64_t>();
  }
  EXPECT_EQ(tokens, base["eval_tokens"].get<int64_t>());
  EXPECT_NEAR(weighted / tokens, base["eval_loss"].get<double>(), 1e-6);
  for (const json* j : {&base, &adapted}) {
    for (const char* key : {"eval_loss", "perplexity", "token_accuracy", "top5_accuracy", "eval_tokens"})
      EXPECT_TRUE(j->contains(key)) << key;
    EXPECT_GT((*j)["arena_bytes"].get<size_t>(), 0u);
    EXPECT_GT((*j)["process_peak_rss_bytes"].get<size_t>(), (*j)["arena_bytes"].get<size_t>() / 2);
    EXPECT_EQ((*j)["eval_examples"], 12);
  }
  EXPECT_LT(adapted["eval_loss"].get<double>(), base["eval_loss"].get<double>()) << "the adapter was trained on it";
  const Result bad = run("eval --model_name_or_path " + path("model") + " --eval_file " + path("train.jsonl") +
                         " --metrics eval_loss,rouge");
  EXPECT_EQ(bad.status, 1);
  EXPECT_CONTAINS(bad.output, "rouge");
}

TEST_F(TrainCliTest, EvaluationDuringTrainingTracksAndLoadsTheBestCheckpoint) {
  // The eval loss falls as training goes; asking for the greatest one makes the best checkpoint
  // an early one, so keeping and loading it is visible.
  // (No dropout: the falling loss must not rest on the masks a seed happens to draw.)
  const Result r = run(base_flags("best") + " --max_steps 8 --learning_rate 0.003 --lora_dropout 0 --eval_file " +
                       path("train.jsonl") + " --eval_strategy steps --eval_steps 2 --save_steps 2 --save_total_limit 1"
                       " --load_best_model_at_end --greater_is_better true --metrics eval_loss,token_accuracy"
                       " --per_device_eval_batch_size 3");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto logs = read_jsonl(dir_ / "best/log.jsonl");
  std::vector<std::pair<int64_t, double>> evals;
  for (const auto& rec : logs)
    if (rec.contains("eval_loss")) {
      EXPECT_TRUE(rec.contains("eval_token_accuracy"));
      evals.emplace_back(rec["step"].get<int64_t>(), rec["eval_loss"].get<double>());
    }
  ASSERT_EQ(evals.size(), 4u);
  const auto best = *std::max_element(evals.begin(), evals.end(), [](auto a, auto b) { return a.second < b.second; });
  std::string seen;
  for (const auto& [step, loss] : evals) seen += " step " + std::to_string(step) + ": " + std::to_string(loss);
  ASSERT_NE(best.first, 8) << "the test needs a best checkpoint other than the last;" << seen;
  const json state = json::parse(std::ifstream(dir_ / "best/trainer_state.json"));
  EXPECT_EQ(state["best_global_step"], best.first);
  EXPECT_DOUBLE_EQ(state["best_metric"].get<double>(), best.second);
  const fs::path best_dir = dir_ / "best" / ("checkpoint-" + std::to_string(best.first));
  EXPECT_EQ(state["best_model_checkpoint"], best_dir.string());
  EXPECT_TRUE(fs::exists(best_dir)) << "save_total_limit keeps the best checkpoint";
  EXPECT_TRUE(fs::exists(dir_ / "best/checkpoint-8"));
  // The final adapter is the best checkpoint's.
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(dir_ / "best/adapter_model.safetensors"), bytes(best_dir / "adapter_model.safetensors"));
  EXPECT_CONTAINS(run(base_flags("x") + " --max_steps 2 --load_best_model_at_end").output, "--eval_strategy");
}

TEST_F(TrainCliTest, ClassificationMetricsDuringTraining) {
  {
    std::ofstream data(dir_ / "cls.jsonl");
    const char* texts[] = {"apple", "banana split", "car", "truck bed", "pear", "bus"};
    const char* labels[] = {"fruit", "fruit", "vehicle", "vehicle", "fruit", "vehicle"};
    for (int i = 0; i < 6; ++i) data << json{{"text", texts[i]}, {"label", labels[i]}}.dump() << "\n";
  }
  const Result r = run("train --model_name_or_path " + path("model") + " --train_file " + path("cls.jsonl") +
                       " --eval_file " + path("cls.jsonl") + " --output_dir " + path("cls") +
                       " --tuner_type full --learning_rate 3e-3 --lr_scheduler_type constant --max_steps 24"
                       " --per_device_train_batch_size 6 --logging_steps 8 --eval_strategy steps --eval_steps 8"
                       " --save_steps 8 --metrics label_accuracy,macro_f1 --metric_for_best_model label_accuracy");
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<json> evals;
  for (const auto& rec : read_jsonl(dir_ / "cls/log.jsonl"))
    if (rec.contains("eval_label_accuracy")) evals.push_back(rec);
  ASSERT_EQ(evals.size(), 3u);
  for (const auto& e : evals) {
    EXPECT_TRUE(e.contains("eval_macro_f1"));
    EXPECT_TRUE(e.contains("eval_loss"));
    EXPECT_EQ(e["eval_examples"], 6);
  }
  EXPECT_LT(evals.back()["eval_loss"].get<double>(), evals.front()["eval_loss"].get<double>())
      << "it trained on these six examples";
  double best = 0;
  for (const auto& e : evals) best = std::max(best, e["eval_label_accuracy"].get<double>());
  const json state = json::parse(std::ifstream(dir_ / "cls/trainer_state.json"));
  EXPECT_DOUBLE_EQ(state["best_metric"].get<double>(), best) << "label_accuracy: greater is better";
}

TEST_F(TrainCliTest, SaveTotalLimitKeepsTheNewest) {
  ASSERT_EQ(run(base_flags("rot") + " --max_steps 5 --save_steps 1 --save_total_limit 2").status, 0);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_ / "rot"))
    if (e.path().filename().string().find("checkpoint") != std::string::npos) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-4", "checkpoint-5"}));
}

// nan and inf are refused for every floating-point flag and config key, as are sizes and rates
// out of range, naming the flag, before anything is written.
TEST_F(TrainCliTest, NonFiniteAndOutOfRangeValuesAreRefusedNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"--learning_rate nan", "--learning_rate"},     {"--max_grad_norm inf", "--max_grad_norm"},
      {"--weight_decay -inf", "--weight_decay"},      {"--label_smoothing_factor nan", "--label_smoothing_factor"},
      {"--lora_dropout nan", "--lora_dropout"},       {"--num_train_epochs inf", "--num_train_epochs"},
      {"--learning_rate -1e-4", "--learning_rate"},   {"--max_steps 0", "--max_steps"},
      {"--max_steps -2", "--max_steps"},              {"--num_train_epochs -1", "--num_train_epochs"},
      {"--warmup_steps -3", "--warmup_steps"},        {"--save_total_limit -1", "--save_total_limit"},
      {"--eval_steps -1", "--eval_steps"},            {"--lora_alpha 0", "--lora_alpha"},
      {"--adam_beta2 1", "--adam_beta2"},             {"--host_memory 0", "--host_memory"}};
  for (const auto& [flags, name] : cases) {
    const std::string extra = std::string(flags).starts_with("--max_steps") || std::string(flags).starts_with("--num")
                                  ? ""
                                  : " --max_steps 1";
    const Result r = run(base_flags("bad") + extra + " " + flags);
    EXPECT_NE(r.status, 0) << flags << " was accepted:\n" << r.output;
    EXPECT_CONTAINS(r.output, name);
    EXPECT_FALSE(fs::exists(dir_ / "bad")) << flags << ": the output directory was written";
  }
  std::ofstream(dir_ / "nan.yaml") << "max_steps: 1\nlearning_rate: nan\n";
  const Result r = run(base_flags("bad") + " --config " + path("nan.yaml"));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "--learning_rate: expected a finite number, got nan");
}

// A run whose gradients stay non-finite (a learning rate that blows the weights up) stops with an
// error after 10 such steps in a row instead of saving a ruined model as a success.
TEST_F(TrainCliTest, TenNonFiniteStepsInARowStopTheRun) {
  const Result r = run(base_flags("diverged") +
                       " --tuner_type full --learning_rate 1e30 --max_grad_norm 0 --max_steps 40 --save_strategy no");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "the gradients of the last 10 steps were not finite");
  EXPECT_FALSE(fs::exists(dir_ / "diverged/model.safetensors")) << "the ruined weights were saved";
  // One run stopped at its first non-finite step: the steps before it had finite gradients.
  int skipped = 0;
  for (const auto& record : read_jsonl(dir_ / "diverged/log.jsonl")) skipped += record.contains("skipped");
  EXPECT_EQ(skipped, 9) << "the tenth skip stops the run before it is logged";
}

// Nothing is written into --output_dir before the run has passed its checks; a new run into a
// directory holding an earlier run's outputs is refused unless it resumes or overwrites them.
TEST_F(TrainCliTest, OutputDirHoldsOneRunsCoherentOutputs) {
  Result r = run(base_flags("out") + " --max_steps 2 --save_steps 1 --lora_rank 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string run_args = testing_support::read_text(dir_ / "out/run_args.json");
  // A run rejected at startup (no trainable example) leaves the directory as it was.
  r = run(base_flags("out") + " --max_steps 2 --max_length 1 --overwrite_output_dir");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_EQ(testing_support::read_text(dir_ / "out/run_args.json"), run_args);
  EXPECT_TRUE(fs::exists(dir_ / "out/checkpoint-2"));
  // A new run without --overwrite_output_dir is refused, naming what is there and the ways out.
  r = run(base_flags("out") + " --max_steps 1 --lora_rank 2");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "checkpoint-1, checkpoint-2");
  EXPECT_CONTAINS(r.output, "--overwrite_output_dir");
  EXPECT_EQ(testing_support::read_text(dir_ / "out/run_args.json"), run_args);
  // Resuming is the same run; overwriting replaces every output of the earlier one.
  r = run(base_flags("out") + " --max_steps 3 --save_steps 1 --lora_rank 2 --resume_from_checkpoint last");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "out/checkpoint-3"));
  std::ofstream(dir_ / "out/notes.txt") << "mine";
  r = run(base_flags("out") + " --max_steps 1 --save_strategy no --tuner_type full --overwrite_output_dir");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "out/checkpoint-1"));
  EXPECT_FALSE(fs::exists(dir_ / "out/adapter_model.safetensors")) << "the earlier run's adapter beside a full model";
  EXPECT_TRUE(fs::exists(dir_ / "out/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "out/notes.txt")) << "a file the runs did not write was removed";
  for (const auto& record : read_jsonl(dir_ / "out/log.jsonl")) {
    if (record.contains("step")) {
      EXPECT_LE(record["step"].get<int>(), 1) << "the earlier run's log was kept";
    }
  }
}

// A save that fails (here: a file-size limit, as a full disk would) leaves no tmp-checkpoint-N
// behind and names the file it could not write.
TEST_F(TrainCliTest, AFailedSaveRemovesItsPartialCheckpoint) {
  // The tiny model's float32 weights fit under 1 MiB, its optimizer state (twice the weights) does not.
  const Result r = testing_support::run_command(
      "trap '' XFSZ; ulimit -f 1024; " + testing_support::memtune_binary() + " " + base_flags("full") +
      " --tuner_type full --max_steps 1 --save_steps 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_CONTAINS(r.output, "optimizer.safetensors");
  for (const auto& e : fs::directory_iterator(dir_ / "full"))
    EXPECT_FALSE(e.path().filename().string().starts_with("tmp-checkpoint-")) << e.path();
  EXPECT_FALSE(fs::exists(dir_ / "full/checkpoint-1"));
}

TEST_F(TrainCliTest, ConfigFileAndArgumentErrors) {
  std::ofstream(dir_ / "run.json") << json{{"max_steps", 1}, {"lora_rank", 2}, {"learning_rate", 1e-3}}.dump();
  Result r = run(base_flags("cfg") + " --config " + path("run.json") + " --lora_rank 3");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(json::parse(std::ifstream(dir_ / "cfg/adapter_config.json"))["r"], 3) << "the flag overrides the file";
  std::ofstream(dir_ / "bad.yaml") << "max_steps: 1\nlearning_rat: 0.1\n";
  r = run(base_flags("bad") + " --config " + path("bad.yaml"));
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "learning_rat");
  r = run(base_flags("bad") + " --max_steps 1 --bf16 --fp16");
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "--bf16 and --fp16");
  r = run(base_flags("bad") + " --max_steps 1 --target_modules qkv");
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "qkv");
  std::ofstream(dir_ / "empty.jsonl") << json{{"text", ""}}.dump() << "\n";
  r = run("train --model_name_or_path " + path("model") + " --train_file " + path("empty.jsonl") + " --output_dir " +
          path("bad") + " --max_steps 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_CONTAINS(r.output, "empty.jsonl");
}

}  // namespace
}  // namespace memtune

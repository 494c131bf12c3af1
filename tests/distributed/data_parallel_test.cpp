// Data-parallel training as users launch it: `mpirun -np 2 memtune train ...` (Open MPI; the
// flags --allow-run-as-root --oversubscribe let it run as root on a small machine). Proves the
// loss normalization across ranks (2 ranks x batch 1 == 1 process x batch 2 == 1 process x
// batch 1 with twice the accumulation, on sequences of very different lengths), evaluation
// merged across ranks, checkpoints independent of the world size, per-rank plan == measured,
// and that a rank killed mid-run ends the job within a bounded time.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "io/safetensors.h"
#include "support/numeric.h"
#include "support/run_command.h"
#include "support/test_util.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Result = testing_support::CommandResult;

const std::string kMpirun = "mpirun --allow-run-as-root --oversubscribe -np ";

// A command's exit, with its output when it failed (an MPI launch's own messages included).
::testing::AssertionResult succeeded(const Result& r) {
  if (r.status == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "exit status " << r.status << ":\n" << r.output;
}

Result mpirun(int ranks, const std::string& args) {
  return testing_support::run_command(kMpirun + std::to_string(ranks) + " " + testing_support::memtune_binary() + " " + args);
}

// Largest |a - b| relative to the tensor's largest |b|, over every float32 tensor of two files;
// NaN (and a test failure) where either holds a non-finite value.
double max_relative_difference(const fs::path& a, const fs::path& b) {
  const SafetensorsFile fa(a.string()), fb(b.string());
  EXPECT_EQ(fa.tensors().size(), fb.tensors().size());
  double worst = 0;
  for (const TensorInfo& t : fb.tensors()) {
    const TensorInfo* u = fa.find(t.name);
    EXPECT_TRUE(u) << t.name;
    if (!u) continue;
    const auto da = fa.data(*u), db = fb.data(t);
    EXPECT_EQ(da.size(), db.size()) << t.name;
    std::vector<float> x(da.size() / 4), y(db.size() / 4);
    std::memcpy(x.data(), da.data(), da.size());
    std::memcpy(y.data(), db.data(), db.size());
    const testing_support::Difference d = testing_support::difference(x, y);
    if (!d.ok()) {  // NaN fails every bound the callers set, above or below
      ADD_FAILURE() << t.name << ": " << d.describe();
      return d.worst;
    }
    worst = std::max(worst, d.worst / std::max(d.scale, 1e-30));
  }
  return worst;
}

using testing_support::read_jsonl;
class DataParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_support::make_temp_dir("data_parallel_test");
    ASSERT_TRUE(succeeded(testing_support::run_memtune("init-model --preset tiny --seed 1 --out " + path("model"))));
    testing_support::write_synthetic_tokenizer(dir_ / "model");
    std::ofstream data(dir_ / "train.jsonl"), cls(dir_ / "cls.jsonl");
    const char* words[] = {"red", "green", "blue", "cyan"};
    for (int i = 0; i < 24; ++i) {
      // Lengths from a few tokens to ~20x that, spread so ranks get unequal token counts.
      const std::string prompt = "colour " + std::string(static_cast<size_t>(1 + (i * 37) % 61), 'x');
      const std::string answer = std::string(words[i % 4]) + std::string(static_cast<size_t>((i * 11) % 17), 'y');
      data << json{{"messages",
                    {{{"role", "user"}, {"content", prompt}}, {{"role", "assistant"}, {"content", answer}}}}}
                  .dump()
           << "\n";
      cls << json{{"text", prompt}, {"label", words[i % 4]}}.dump() << "\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }
  void two_ranks_equal_one_cpu_process(const std::string& backend);
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // adam_epsilon 1e-3: with the default 1e-8, AdamW turns a gradient that is exactly 0 in one
  // summation order and 1e-12 in another into updates of opposite full size, so runs that differ
  // only by float rounding would drift apart; with it, updates stay proportional to gradients.
  std::string train_args(const std::string& out, const std::string& flags) const {
    return "train --model_name_or_path " + path("model") + " --train_file " + path("train.jsonl") + " --output_dir " +
           path(out) + " --tuner_type full --learning_rate 3e-3 --lr_scheduler_type linear --warmup_steps 1" +
           " --logging_steps 1 --save_strategy no --seed 5 --adam_epsilon 1e-3 " + flags;
  }
  fs::path dir_;
};

TEST_F(DataParallelTest, TwoRanksEqualOneProcessWithTheSameGlobalBatch) {
  const std::string steps = " --max_steps 5";
  const Result two =
      mpirun(2, train_args("two", "--per_device_train_batch_size 1 --gradient_accumulation_steps 2" + steps));
  ASSERT_EQ(two.status, 0) << two.output;
  const Result one = testing_support::run_memtune(
      train_args("one", "--per_device_train_batch_size 2 --gradient_accumulation_steps 2" + steps));
  ASSERT_EQ(one.status, 0) << one.output;
  const Result acc = testing_support::run_memtune(
      train_args("acc", "--per_device_train_batch_size 1 --gradient_accumulation_steps 4" + steps));
  ASSERT_EQ(acc.status, 0) << acc.output;

  // The same parameters after 5 updates (float32 summation order differs across ranks).
  EXPECT_LT(max_relative_difference(dir_ / "two" / "model.safetensors", dir_ / "one" / "model.safetensors"), 2e-5);
  EXPECT_LT(max_relative_difference(dir_ / "acc" / "model.safetensors", dir_ / "one" / "model.safetensors"), 2e-5);
  // The updates were real: the trained model moved away from the initial one.
  EXPECT_GT(max_relative_difference(dir_ / "two" / "model.safetensors", dir_ / "model" / "model.safetensors"), 1e-3);

  // Logged values are global: the same loss (token mean over all ranks), tokens and grad norm.
  const auto a = read_jsonl(dir_ / "two" / "log.jsonl"), b = read_jsonl(dir_ / "one" / "log.jsonl");
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5 * b[i]["loss"].get<double>());
    EXPECT_NEAR(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>(),
                1e-4 * b[i]["grad_norm"].get<double>());
    EXPECT_EQ(a[i]["num_input_tokens_seen"], b[i]["num_input_tokens_seen"]);
  }
  // Rank 0 alone wrote the outputs, and its memory record covers both ranks, each planned ==
  // measured.
  const json memory = json::parse(std::ifstream(dir_ / "two" / "memory.json"));
  EXPECT_EQ(memory["world_size"], 2);
  ASSERT_EQ(memory["ranks"].size(), 2u);
  for (const json& r : memory["ranks"]) EXPECT_EQ(r["arena_bytes"], r["arena_high_water_bytes"]) << r.dump();
  EXPECT_EQ(json::parse(std::ifstream(dir_ / "two" / "run_args.json"))["world_size"], 2);
}

// A mixture of experts with transformers' auxiliary loss on: its term is a micro-batch's own, so
// two ranks of one-sequence micro-batches train as one process accumulating the same four.
TEST_F(DataParallelTest, AMixtureOfExpertsWithItsAuxiliaryLossTrainsOnTwoRanksAsInOneProcess) {
  ASSERT_TRUE(succeeded(testing_support::run_memtune(
      "init-model --preset tiny-qwen3-moe --seed 1 --set output_router_logits=true --set router_aux_loss_coef=0.3 "
      "--out " + path("moe"))));
  testing_support::write_synthetic_tokenizer(dir_ / "moe");
  auto args = [&](const std::string& out, const std::string& flags) {
    std::string a = train_args(out, flags + " --max_steps 3");
    a.replace(a.find(path("model")), path("model").size(), path("moe"));
    return a;
  };
  const Result two = mpirun(2, args("moe2", "--per_device_train_batch_size 1 --gradient_accumulation_steps 2"));
  ASSERT_EQ(two.status, 0) << two.output;
  const Result acc =
      testing_support::run_memtune(args("moe1", "--per_device_train_batch_size 1 --gradient_accumulation_steps 4"));
  ASSERT_EQ(acc.status, 0) << acc.output;
  EXPECT_LT(max_relative_difference(dir_ / "moe2" / "model.safetensors", dir_ / "moe1" / "model.safetensors"), 2e-5);
  EXPECT_GT(max_relative_difference(dir_ / "moe2" / "model.safetensors", dir_ / "moe" / "model.safetensors"), 1e-3);
  const auto a = read_jsonl(dir_ / "moe2" / "log.jsonl"), b = read_jsonl(dir_ / "moe1" / "log.jsonl");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5 * b[i]["loss"].get<double>());
}

// Two ranks on the reference backend (its memory locked outside its calls, collectives inside
// them; ZeRO-1 for the reduce-scatter and allgather paths) train like one cpu process.
// Two ranks on `backend`, plain and ZeRO-1, equal one cpu process with the same global batch.
void DataParallelTest::two_ranks_equal_one_cpu_process(const std::string& backend) {
  const std::string steps = " --max_steps 2", two = backend + "2", zero = backend + "2z", one = backend + "_cpu1";
  const std::string flags = "--backend " + backend + " --per_device_train_batch_size 1 --gradient_accumulation_steps 2";
  Result r = mpirun(2, train_args(two, flags + steps));
  ASSERT_EQ(r.status, 0) << r.output;
  r = mpirun(2, train_args(zero, flags + " --zero_stage 1" + steps));
  ASSERT_EQ(r.status, 0) << r.output;
  r = testing_support::run_memtune(train_args(one, "--per_device_train_batch_size 2 --gradient_accumulation_steps 2" + steps));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_LT(max_relative_difference(dir_ / two / "model.safetensors", dir_ / one / "model.safetensors"), 2e-5);
  EXPECT_LT(max_relative_difference(dir_ / zero / "model.safetensors", dir_ / one / "model.safetensors"), 2e-5);
}

TEST_F(DataParallelTest, TwoReferenceRanksEqualOneCpuProcess) { two_ranks_equal_one_cpu_process("reference"); }

// Data parallel on a device backend: MPI reads host memory, so each collective runs on a host copy
// of the tensor (the parameters' planned collective staging).
TEST_F(DataParallelTest, TwoVulkanRanksEqualOneCpuProcess) {
  const Result devices = testing_support::run_memtune("devices --json");
  if (devices.status != 0 || devices.output.find("\"backend_vulkan_device\": null") != std::string::npos) {
    SKIP_OR_FAIL_WHERE_REQUIRED("no usable Vulkan device: " + devices.output);
  }
  two_ranks_equal_one_cpu_process("vulkan");
}

TEST_F(DataParallelTest, EvaluationMergesAcrossRanks) {
  const std::string flags = "--per_device_train_batch_size 2 --max_steps 2 --eval_strategy steps --eval_steps 2";
  // Evaluation by generation: rank r generates examples r, r + 2, ...; the counts are summed.
  for (const std::string metrics :
       {"eval_loss,token_accuracy", "label_accuracy,macro_f1", "exact_match,eval_loss --predict_with_generate"}) {
    const std::string eval =
        " --metrics " + metrics + " --eval_file " + path(metrics[0] == 'l' ? "cls.jsonl" : "train.jsonl");
    const bool generates = metrics.find("generate") != std::string::npos;
    const std::string name = metrics[0] == 'l' ? "cls" : generates ? "gen" : "tok";
    ASSERT_TRUE(succeeded(mpirun(2, train_args(name + "2", flags + " --per_device_eval_batch_size 3" + eval))));
    ASSERT_TRUE(succeeded(testing_support::run_memtune(
        train_args(name + "1", "--per_device_train_batch_size 4 --max_steps 2 --eval_strategy steps --eval_steps 2 "
                               "--per_device_eval_batch_size 6" +
                                   eval))));
    const json e2 = read_jsonl(dir_ / (name + "2") / "log.jsonl").back(),
               e1 = read_jsonl(dir_ / (name + "1") / "log.jsonl").back();
    ASSERT_TRUE(e2.contains("eval_loss")) << e2.dump();
    EXPECT_NEAR(e2["eval_loss"].get<double>(), e1["eval_loss"].get<double>(), 1e-4);
    if (generates) {
      ASSERT_TRUE(e2.contains("eval_exact_match")) << e2.dump();
      EXPECT_EQ(e2["eval_generated_examples"], read_jsonl(dir_ / "train.jsonl").size());
    }
    for (const char* key :
         {"eval_token_accuracy", "eval_tokens", "eval_label_accuracy", "eval_macro_f1", "eval_examples",
          "eval_exact_match", "eval_generated_examples"})
      if (e1.contains(key)) {
        EXPECT_NEAR(e2[key].get<double>(), e1[key].get<double>(), 1e-9) << key;
      }
  }
}

TEST_F(DataParallelTest, CheckpointsResumeAcrossWorldSizes) {
  const std::string two = "--per_device_train_batch_size 1 --gradient_accumulation_steps 2 --max_steps 4";
  const std::string one = "--per_device_train_batch_size 2 --gradient_accumulation_steps 2 --max_steps 4";
  // Uninterrupted reference, single process.
  ASSERT_TRUE(succeeded(testing_support::run_memtune(train_args("ref", one))));
  // Saved with 2 ranks at step 2, resumed with 1 process.
  ASSERT_TRUE(succeeded(mpirun(2, train_args("a", two + " --save_strategy steps --save_steps 2"))));
  const Result r1 =
      testing_support::run_memtune(train_args("a", one + " --resume_from_checkpoint " + path("a/checkpoint-2")));
  ASSERT_EQ(r1.status, 0) << r1.output;
  EXPECT_LT(max_relative_difference(dir_ / "a" / "model.safetensors", dir_ / "ref" / "model.safetensors"), 2e-5);
  // Saved with 1 process, resumed with 2 ranks.
  ASSERT_TRUE(succeeded(testing_support::run_memtune(train_args("b", one + " --save_strategy steps --save_steps 2"))));
  const Result r2 = mpirun(2, train_args("b", two + " --resume_from_checkpoint " + path("b/checkpoint-2")));
  ASSERT_EQ(r2.status, 0) << r2.output;
  EXPECT_CONTAINS(r2.output, "resumed from");
  EXPECT_LT(max_relative_difference(dir_ / "b" / "model.safetensors", dir_ / "ref" / "model.safetensors"), 2e-5);
}

// ZeRO-1: the AdamW state (and float32 masters of 16-bit weights) is sharded over the ranks, the
// gradients reduce-scattered and the parameters allgathered; the training is the same.
TEST_F(DataParallelTest, ZeroStage1EqualsZeroStage0) {
  ASSERT_TRUE(succeeded(
      testing_support::run_memtune("init-model --preset tiny --seed 1 --torch_dtype bfloat16 --out " + path("model16"))));
  testing_support::write_synthetic_tokenizer(dir_ / "model16");
  for (const std::string model : {"model", "model16"}) {
    for (const std::string tuner : {"full", "lora"}) {
      std::string flags =
          "--per_device_train_batch_size 1 --gradient_accumulation_steps 2 --max_steps 4 --tuner_type " + tuner +
          " --save_strategy steps --save_steps 2";
      if (tuner == "lora") flags += " --lora_dropout 0";
      const std::string name = model + "_" + tuner;
      const Result z0 = mpirun(2, train_args(name + "_z0", flags) + " --model_name_or_path " + path(model));
      const Result z1 =
          mpirun(2, train_args(name + "_z1", flags) + " --model_name_or_path " + path(model) + " --zero_stage 1");
      ASSERT_EQ(z0.status, 0) << z0.output;
      ASSERT_EQ(z1.status, 0) << z1.output;
      const std::string weights = tuner == "lora" ? "adapter_model.safetensors" : "model.safetensors";
      if (model == "model") {
        EXPECT_LT(max_relative_difference(dir_ / (name + "_z1") / weights, dir_ / (name + "_z0") / weights), 2e-5)
            << name;
      } else {
        // 16-bit weights: the same float32 masters round to the same bfloat16 values (compared
        // through the checkpoints' float32 masters, which the optimizer state keeps).
        EXPECT_LT(max_relative_difference(dir_ / (name + "_z1") / "checkpoint-4" / "optimizer.safetensors",
                                          dir_ / (name + "_z0") / "checkpoint-4" / "optimizer.safetensors"),
                  2e-5)
            << name;
      }
      // Per rank: the plan is what was measured, and the optimizer state is halved.
      const json m0 = json::parse(std::ifstream(dir_ / (name + "_z0") / "memory.json"));
      const json m1 = json::parse(std::ifstream(dir_ / (name + "_z1") / "memory.json"));
      for (const json& r : m1["ranks"]) EXPECT_EQ(r["arena_bytes"], r["arena_high_water_bytes"]) << r.dump();
      const double state0 = m0["categories"]["optimizer_state"].get<double>();
      const double state1 = m1["categories"]["optimizer_state"].get<double>();
      EXPECT_NEAR(state1, state0 / 2, 64.0 * 200) << name;  // alignment padding of ~200 buffers
      EXPECT_LT(m1["arena_bytes"].get<size_t>(), m0["arena_bytes"].get<size_t>()) << name;
      // `memtune plan --world_size 2` accounts the same per-rank state as the run had.
      for (const std::string zero : {"0", "1"}) {
        const Result plan = testing_support::run_memtune("plan --json --model " + path(model) + " --tuner_type " +
                                                         tuner + " --world_size 2 --zero_stage " + zero);
        ASSERT_EQ(plan.status, 0) << plan.output;
        const json p = json::parse(plan.output);
        const json& run = zero == "1" ? m1 : m0;
        for (const char* category : {"weights", "trainable_params", "gradients", "optimizer_state"})
          EXPECT_EQ(p["categories"][category], run["categories"][category]) << name << " zero " << zero << category;
      }
    }
  }
  // A ZeRO-1 checkpoint holds the whole state: one process resumes it and ends where the ZeRO-0
  // run did.
  const Result resumed = testing_support::run_memtune(
      train_args("model_full_z1",
                 "--per_device_train_batch_size 2 --gradient_accumulation_steps 2 --max_steps 4 "
                 "--tuner_type full --resume_from_checkpoint " +
                     path("model_full_z1/checkpoint-2")));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_LT(max_relative_difference(dir_ / "model_full_z1" / "model.safetensors",
                                    dir_ / "model_full_z0" / "model.safetensors"),
            2e-5);
}

// An error on one rank only (rank 0 alone creates the output directory; here it cannot) stops
// the whole job with that rank's message instead of leaving the others waiting.
TEST_F(DataParallelTest, AnErrorOnOneRankStopsTheJob) {
  std::ofstream(dir_ / "a_file") << "not a directory";
  const auto start = std::chrono::steady_clock::now();
  const Result r =
      testing_support::run_command(kMpirun + "2 " + testing_support::memtune_binary() + " " + train_args("a_file/out", "--max_steps 2"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.status, 0);
  EXPECT_CONTAINS(r.output, "memtune: error on rank 0 of 2: --output_dir");
  EXPECT_CONTAINS(r.output, "a_file/out: cannot create the directory");
  EXPECT_LT(seconds, 60.0);
}

// The pid of the memtune process that is rank `rank` of the job writing to `output_dir`.
pid_t find_rank(int rank, const std::string& output_dir) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream cmdline(e.path() / "cmdline"), environ(e.path() / "environ");
    const std::string cmd{std::istreambuf_iterator<char>(cmdline), {}};
    const std::string env{std::istreambuf_iterator<char>(environ), {}};
    if (cmd.find(output_dir) == std::string::npos || cmd.find("mpirun") == 0) continue;
    if (env.find("OMPI_COMM_WORLD_RANK=" + std::to_string(rank) + '\0') != std::string::npos) return std::stoi(name);
  }
  return -1;
}

TEST_F(DataParallelTest, ARankKilledMidRunEndsTheJobWithinSixtySeconds) {
  const std::string out = path("killed");
  const std::string command = kMpirun + "2 " + testing_support::memtune_binary() + " " +
                              train_args("killed",
                                         "--per_device_train_batch_size 1 --max_steps 100000 "
                                         "--save_strategy steps --save_steps 3") +
                              " > " + path("killed.log") + " 2>&1; echo $? > " + path("killed.status");
  std::thread job([&] { testing_support::run_command(command); });
  // Wait until training runs (a few steps logged and a checkpoint written), then kill rank 1.
  pid_t victim = -1;
  for (int i = 0; i < 600 && victim < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (fs::exists(dir_ / "killed" / "checkpoint-3")) victim = find_rank(1, out);
  }
  ASSERT_GT(victim, 0) << "rank 1 not found";
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  job.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_LT(seconds, 60.0);
  std::ifstream status(dir_ / "killed.status");
  int code = 0;
  status >> code;
  EXPECT_NE(code, 0);
  // Every checkpoint-N left behind is complete (an interrupted save is only ever a tmp- dir).
  for (const auto& e : fs::directory_iterator(dir_ / "killed"))
    if (e.path().filename().string().starts_with("checkpoint-")) {
      EXPECT_TRUE(fs::exists(e.path() / "optimizer.safetensors")) << e.path();
      EXPECT_TRUE(fs::exists(e.path() / "memtune_state.json")) << e.path();
    }
}

}  // namespace
}  // namespace memtune

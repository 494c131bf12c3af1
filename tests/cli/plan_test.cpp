// `memtune plan`: published parameter counts of real-size presets planned without allocating,
// the arithmetic a run gets (and the dtype flags' help saying the same), the budget check, and
// the plan's peak equal to what a run of the same configuration measures.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "memory/plan.h"
#include "model/decoder.h"
#include "support/run_command.h"
#include "data/synthetic_tokenizer.h"
#include "backend/registry.h"
#include "support/test_util.h"

namespace memtune {
namespace {

using nlohmann::json;

json plan(const std::string& args) {
  const auto r = testing_support::run_memtune("plan --json " + args);
  EXPECT_EQ(r.status, 0) << r.output;
  return json::parse(r.output);
}

TEST(PlanCommand, RealSizePresetsArePlannedWithTheirPublishedParameterCounts) {
  EXPECT_EQ(plan("--preset qwen2.5-0.5b")["parameters"], 494032768);
  EXPECT_EQ(plan("--preset qwen2.5-7b")["parameters"], 7615616512);
  const json p72 = plan("--preset qwen2.5-72b --tuner_type full --bf16 --per_device_train_batch_size 1");
  EXPECT_EQ(p72["parameters"], 72706203648);
  EXPECT_EQ(p72["trainable_parameters"], 72706203648);
  // Full fine-tuning in bf16 storage: weights 2 bytes, masters + grads + two moments 16 bytes each.
  EXPECT_GT(p72["categories"]["optimizer_state"].get<double>(), 2 * 4 * 72e9);
  for (const char* key : {"peak_bytes", "categories", "phases", "training", "evaluation"})
    EXPECT_TRUE(p72.contains(key)) << key;
}

// The arithmetic a run gets: --bf16 is mixed precision where the cpu backend has bfloat16
// products (and its plan holds the rounded operands), float32 with the reason where it has none;
// --torch_dtype bfloat16 alone is 16-bit storage with float32 arithmetic.
TEST(PlanCommand, SaysWhichArithmeticTheRunGets) {
  const bool products = !backend_named("cpu").sixteen_bit_products(DType::BF16).empty();
  const json mixed = plan("--preset qwen2.5-0.5b --bf16 --max_length 512"),
             storage = plan("--preset qwen2.5-0.5b --torch_dtype bfloat16 --max_length 512");
  const std::string m = mixed["arithmetic"], s = storage["arithmetic"];
  if (products) {
    EXPECT_TRUE(m.starts_with("mixed precision: ") && m.find("oneDNN") != std::string::npos) << m;
    // The products' inputs and output gradients rounded to bfloat16 are working memory; the
    // head's float32 slice buffer is gone.
    EXPECT_GT(mixed["categories"]["working"].get<double>(), storage["categories"]["working"].get<double>());
  } else {
    EXPECT_TRUE(m.starts_with("float32, not mixed precision: the cpu backend has no bfloat16 products")) << m;
  }
  EXPECT_EQ(s, "float32 (bfloat16 storage, widened as it is read)");
  const auto vulkan = testing_support::run_memtune(
      "plan --preset qwen2.5-0.5b --bf16 --backend vulkan --vulkan_max_allocation 1GiB --device_memory 8GiB");
  ASSERT_EQ(vulkan.status, 0) << vulkan.output;
  EXPECT_CONTAINS(vulkan.output,
                  "\narithmetic: float32, not mixed precision: the vulkan backend has no bfloat16 products here");
}

// The help of one flag in a command's --help: its line and the lines that continue it.
std::string flag_help(const std::string& help, const std::string& flag) {
  size_t at = help.find("\n  " + flag + " ");
  if (at == std::string::npos) return {};
  std::string text;
  do {
    const size_t end = help.find('\n', at + 1);
    text += help.substr(at + 1, end - at - 1);
    at = end;
  } while (at != std::string::npos && help.compare(at + 1, 4, "    ") == 0);
  return text;
}

// What `train --help` says of --bf16, --fp16 and --torch_dtype is the arithmetic: line a run
// with the flag prints (plan's, from the same describe_arithmetic): --bf16's mixed precision on
// the reference backend (which always has bfloat16 products) and its float32 fallback on vulkan
// (which has none), the cpu backend taking one of the two; the others' float32 over 16-bit storage.
TEST(PlanCommand, DtypeFlagsHelpSaysTheArithmeticTheRunPrints) {
  const auto help = testing_support::run_memtune("train --help");
  ASSERT_EQ(help.status, 0) << help.output;
  const std::string bf16 = flag_help(help.output, "--bf16"), fp16 = flag_help(help.output, "--fp16"),
                    torch_dtype = flag_help(help.output, "--torch_dtype");
  ASSERT_FALSE(bf16.empty() || fp16.empty() || torch_dtype.empty()) << help.output;
  // The arithmetic: line `plan` prints, as the run prints it.
  auto arithmetic = [](const std::string& flags) {
    const auto r = testing_support::run_memtune("plan --preset tiny --max_length 64 " + flags);
    EXPECT_EQ(r.status, 0) << r.output;
    const size_t at = r.output.find("\narithmetic: ");
    if (at == std::string::npos) return "(no arithmetic: line in) " + r.output;
    const size_t start = at + 13;
    return r.output.substr(start, r.output.find('\n', start) - start);
  };

  // --bf16 where the backend has bfloat16 products: the line's claims word for word, the
  // products' and what stays float32.
  const std::string head = "mixed precision: ", mixed = arithmetic("--bf16 --backend reference");
  ASSERT_TRUE(mixed.starts_with(head)) << mixed;
  const size_t products_end = mixed.find(" ("), rest = mixed.find("); ");
  ASSERT_NE(rest, std::string::npos) << mixed;
  EXPECT_CONTAINS(bf16, "mixed precision");
  EXPECT_CONTAINS(bf16, mixed.substr(head.size(), products_end - head.size()));  // "... float32 accumulation"
  EXPECT_CONTAINS(bf16, mixed.substr(rest + 3));                                  // "norms, ... stay float32"
  // Where the backend has none: float32, not mixed precision, as the help says.
  const std::string fallback = arithmetic("--bf16 --backend vulkan --vulkan_max_allocation 1GiB --device_memory 8GiB");
  EXPECT_TRUE(fallback.starts_with("float32, not mixed precision: the vulkan backend has no bfloat16 products"))
      << fallback;
  EXPECT_CONTAINS(bf16, "float32, not mixed precision");
  EXPECT_CONTAINS(bf16, "no bfloat16 products (vulkan");
  const std::string cpu = arithmetic("--bf16");
  if (backend_named("cpu").sixteen_bit_products(DType::BF16).empty())
    EXPECT_TRUE(cpu.starts_with("float32, not mixed precision: the cpu backend has no bfloat16 products")) << cpu;
  else
    EXPECT_TRUE(cpu.starts_with(mixed.substr(0, products_end) + " (oneDNN ")) << cpu;

  // --fp16: the same over float16, with dynamic loss scaling; mixed precision on the reference
  // backend, float32 where the backend has no float16 products.
  const std::string half_mixed = arithmetic("--fp16 --backend reference");
  // The reference rounds attention's operands too (at the rounding points of vulkan's
  // cooperative-matrix attention, which it is the oracle of).
  EXPECT_TRUE(half_mixed.starts_with("mixed precision: the linear layers', the LM head's and attention's products "
                                     "take float16 operands with float32 accumulation"))
      << half_mixed;
  EXPECT_CONTAINS(fp16, "the linear layers' and the LM head's products take float16 operands with float32 accumulation");
  EXPECT_CONTAINS(fp16, "dynamic loss scaling");
  EXPECT_CONTAINS(fp16, "float32, not mixed precision, over the float16 weights");
  const std::string half_cpu = arithmetic("--fp16");
  if (backend_named("cpu").sixteen_bit_products(DType::F16).empty())
    EXPECT_EQ(half_cpu, "float32, not mixed precision: the cpu backend has no float16 products here (float16 storage)");
  else
    EXPECT_TRUE(half_cpu.starts_with("mixed precision: ")) << half_cpu;
  // --torch_dtype alone: float32 arithmetic over any storage, bfloat16 included.
  for (const std::string dtype : {"bfloat16", "float16"})
    EXPECT_EQ(arithmetic("--torch_dtype " + dtype), "float32 (" + dtype + " storage, widened as it is read)");
  EXPECT_EQ(arithmetic("--torch_dtype float32"), "float32");
  EXPECT_CONTAINS(torch_dtype, "float32 | bfloat16 | float16");
  EXPECT_CONTAINS(torch_dtype, "the arithmetic stays float32 (16-bit storage, widened as it is read)");
  EXPECT_CONTAINS(torch_dtype, "only --bf16 and --fp16 take 16-bit products");
}

TEST(PlanCommand, BudgetCheckAndCheckpointingLever) {
  const std::string base =
      "--preset qwen2.5-7b --bf16 --per_device_train_batch_size 1 --max_length 2048 "
      "--per_device_eval_batch_size 1 --device_memory 24GiB";
  const json plain = plan(base), ckpt = plan(base + " --gradient_checkpointing");
  EXPECT_FALSE(plain["fits"].get<bool>());
  EXPECT_TRUE(ckpt["fits"].get<bool>());
  EXPECT_LT(ckpt["categories"]["saved_activations"].get<double>(),
            plain["categories"]["saved_activations"].get<double>() / 10);
  // HF evaluation logits: batch x seq x vocab x 4 bytes.
  EXPECT_DOUBLE_EQ(plain["hf_eval_logits_bytes_per_batch"].get<double>(), 1.0 * 2048 * 152064 * 4);
  // The table: a column per training phase and one for evaluation, whose total is the
  // evaluation plan's peak.
  const auto text = testing_support::run_memtune("plan " + base);
  ASSERT_EQ(text.status, 0) << text.output;
  EXPECT_CONTAINS(text.output, "forward          loss      backward     optimizer    evaluation");
  const size_t total = text.output.find("\ntotal");
  ASSERT_NE(total, std::string::npos);
  const std::string total_line = text.output.substr(total + 1, text.output.find('\n', total + 1) - total - 1);
  EXPECT_TRUE(total_line.ends_with(format_bytes(plain["evaluation"]["peak_bytes"].get<size_t>()))) << total_line;
  const auto bad = testing_support::run_memtune("plan --preset qwen2.5-7b --device_memory '24 parsecs'");
  EXPECT_EQ(bad.status, 1);
  EXPECT_CONTAINS(bad.output, "parsecs");
}

// A plan for a Vulkan device that is not on this machine, from its limits: no device is opened,
// so this runs in every build. Where this machine has a device, the plan is the one made with it
// (the backend answers the planning questions the same way); only the limits differ.
TEST(PlanCommand, AnAbsentVulkanDeviceIsPlannedFromTheLimitsGiven) {
  const std::string base =
      "plan --json --backend vulkan --preset qwen2.5-0.5b --tuner_type full --per_device_train_batch_size 4 "
      "--max_length 1024";
  const auto r = testing_support::run_memtune(base + " --vulkan_max_allocation 1GiB --device_memory 24GiB");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_CONTAINS(r.output, "no device opened");
  auto last_line = [](const std::string& out) { return json::parse(out.substr(out.rfind('\n', out.size() - 2) + 1)); };
  const json p = last_line(r.output);
  const json& d = p["device"];
  EXPECT_EQ(d["max_allocation_bytes"].get<size_t>(), size_t{1} << 30);
  EXPECT_EQ(d["device_heap_bytes"].get<size_t>(), size_t{24} << 30);
  ASSERT_GE(d["allocations"].size(), 2u);
  size_t total = 0;
  for (const auto& a : d["allocations"]) {
    EXPECT_LE(a.get<size_t>(), size_t{1} << 30);
    total += a.get<size_t>();
  }
  EXPECT_GE(total, p["peak_bytes"].get<size_t>());
  EXPECT_TRUE(d["fits"].get<bool>());
  EXPECT_TRUE(p["fits"].get<bool>());
  // A discrete GPU's arena is the device's memory: the process prediction leaves it out (a full
  // fine-tune is not predicted at the machine's RAM).
  EXPECT_TRUE(p["process"]["terms"]["arena_on_device"].get<bool>());
  EXPECT_LT(p["process"]["process_peak_bytes"].get<size_t>(), p["peak_bytes"].get<size_t>());
  const auto devices = testing_support::run_memtune("devices --json");
  if (devices.status == 0 && devices.output.find("\"backend_vulkan_device\": null") == std::string::npos) {
    const auto here = testing_support::run_memtune(base);
    ASSERT_EQ(here.status, 0) << here.output;
    EXPECT_EQ(last_line(here.output)["peak_bytes"], p["peak_bytes"]);
    for (const char* term : {"host_arena_bytes", "compute_runtime_bytes"})
      EXPECT_EQ(last_line(here.output)["process"]["terms"][term], p["process"]["terms"][term]) << term;
    // lavapipe's (or an integrated GPU's) memory is this machine's RAM: counted.
    const json plan_here = last_line(here.output);
    const json& process_here = plan_here["process"];
    if (devices.output.find("\"type\": \"discrete GPU\"") == std::string::npos) {
      EXPECT_FALSE(process_here["terms"]["arena_on_device"].get<bool>());
      EXPECT_GT(process_here["process_peak_bytes"].get<size_t>(), p["peak_bytes"].get<size_t>());
    }
  }
  const auto on_cpu = testing_support::run_memtune("plan --preset tiny --vulkan_max_allocation 1GiB --device_memory 8GiB");
  EXPECT_EQ(on_cpu.status, 1);
  EXPECT_CONTAINS(on_cpu.output, "add --backend vulkan");
  const auto no_memory = testing_support::run_memtune("plan --preset tiny --backend vulkan --vulkan_max_allocation 1GiB");
  EXPECT_EQ(no_memory.status, 1);
  EXPECT_CONTAINS(no_memory.output, "--device_memory");
}

// --quantization plans the linear layers packed: 4 bits per weight plus a float16 scale and zero
// per group of 128 inputs and output, counted here from the shapes alone.
TEST(PlanCommand, QuantizationPlansPackedWeights) {
  const json f = plan("--preset qwen2.5-0.5b --bf16"), q = plan("--preset qwen2.5-0.5b --bf16 --quantization gptq-int4");
  const json q8 = plan("--preset qwen2.5-0.5b --bf16 --quantization gptq-int8");
  const double D = 896, I = 4864, kv = 128, V = 151936, L = 24;
  const double layer_in_out[][2] = {{D, D}, {D, kv}, {D, kv}, {D, D}, {D, I}, {D, I}, {I, D}};
  auto packed = [&](int bits) {
    double bytes = 0;
    for (const auto& s : layer_in_out) bytes += s[1] * s[0] * bits / 8 + s[1] * (s[0] / 128) * 4;
    return bytes;
  };
  double dense = 0;  // the float linear weights of the layers
  for (const auto& s : layer_in_out) dense += s[0] * s[1] * 2;
  const double rest = f["categories"]["weights"].get<double>() - L * dense;  // embeddings, norms, biases
  EXPECT_GT(rest, V * D * 2);
  EXPECT_EQ(q["categories"]["weights"].get<double>(), rest + L * packed(4));
  EXPECT_EQ(q8["categories"]["weights"].get<double>(), rest + L * packed(8));
  const auto bad = testing_support::run_memtune("plan --preset qwen2.5-0.5b --quantization gptq-int3");
  EXPECT_NE(bad.status, 0);
  EXPECT_CONTAINS(bad.output, "unknown quantization \"gptq-int3\" (known: gptq-int4, gptq-int8, awq)");
}

// ZeRO-1 over 3 ranks: rank r holds [n r / 3, n (r + 1) / 3) of each tensor, so the last rank
// has the largest shards; the plan is that rank's, not rank 0's (the smallest). Hidden size 98:
// each norm splits 32 / 33 / 33 elements, which the 64-byte padding does not hide.
TEST(PlanCommand, ZeroOnePlansTheRankWithTheLargestShards) {
  const auto dir = testing_support::make_temp_dir("plan_zero1");
  const auto made = testing_support::run_memtune("init-model --preset tiny --set hidden_size=98 --set "
                                                 "num_attention_heads=7 --set num_key_value_heads=7 --out " +
                                                 dir.string());
  ASSERT_EQ(made.status, 0) << made.output;
  ModelOptions o;
  o.allocate = false;
  o.max_tokens = 8 * 64;
  o.with_optimizer = true;
  o.zero_stage = 1;
  o.world_size = 3;
  const ModelConfig config = load_config_json((dir / "config.json").string());
  std::vector<size_t> peaks;
  for (int r = 0; r < 3; ++r) {
    o.rank = r;
    peaks.push_back(Decoder(config, o).plan().peak_bytes());
  }
  EXPECT_LT(peaks[0], peaks[2]);
  EXPECT_EQ(*std::max_element(peaks.begin(), peaks.end()), peaks[2]);
  const json p = plan("--model " + dir.string() + " --tuner_type full --world_size 3 --zero_stage 1 --max_length 64");
  EXPECT_EQ(p["peak_bytes"].get<size_t>(), peaks[2]);
  std::filesystem::remove_all(dir);
}

TEST(PlanCommand, FitSearchFindsConfigurationsWithinTheBudget) {
  const std::string base =
      "--preset qwen2.5-7b --bf16 --per_device_train_batch_size 4 --gradient_accumulation_steps 4 "
      "--max_length 2048 --per_device_eval_batch_size 1";
  const json asked = plan(base);
  const json fit = plan(base + " --fit --device_memory 24GiB");
  EXPECT_GT(asked["peak_bytes"].get<double>(), 24.0 * (1 << 30)) << "the configuration as asked must not fit";
  ASSERT_FALSE(fit["fit"].empty());
  double previous = 0;
  for (const auto& k : fit["fit"]) {
    EXPECT_LE(k["peak_bytes"].get<double>(), 24.0 * (1 << 30));
    EXPECT_GE(k["relative_step_time"].get<double>(), previous) << "ranked by estimated step time";
    previous = k["relative_step_time"].get<double>();
    // The effective batch (micro-batch x accumulation) stays 16.
    const std::string flags = k["flags"];
    const auto b = std::stoi(flags.substr(flags.find("batch_size ") + 11));
    const auto ga = std::stoi(flags.substr(flags.find("accumulation_steps ") + 19));
    EXPECT_EQ(b * ga, 16) << flags;
  }
  for (const auto& k : fit["fit"]) EXPECT_EQ(k["quantization"], "none") << "a float base fits: no 4-bit one is offered";
  // Below the bfloat16 weights (14.2 GiB) only a 4-bit base fits (QLoRA, 5.3 GiB of packed weights).
  const json quantized = plan(base + " --fit --device_memory 8GiB");
  ASSERT_FALSE(quantized["fit"].empty());
  for (const auto& k : quantized["fit"]) {
    EXPECT_EQ(k["quantization"], "gptq-int4");
    EXPECT_CONTAINS(k["flags"].get<std::string>(), "(on a gptq-int4 base: memtune quantize --bits 4)");
  }
  // A budget below even those: nothing fits, and the smallest footprint is reported.
  const json none = plan(base + " --fit --device_memory 5GiB");
  EXPECT_TRUE(none["fit"].empty());
  EXPECT_GT(none["smallest_peak_bytes"].get<double>(), 5.0 * (1 << 30));
  const auto text = testing_support::run_memtune("plan " + base + " --fit --device_memory 5GiB");
  EXPECT_CONTAINS(text.output, "nothing fits");
  EXPECT_EQ(testing_support::run_memtune("plan --preset tiny --fit").status, 1);
}

TEST(PlanCommand, OptimizerOffloadIsRefusedOnADeviceAndNotOfferedByFit) {
  // A device's optimizer cannot reach host memory: --optim_offload on vulkan is refused naming
  // the flag and the backend, and --fit never offers it there, while the same search on cpu does.
  const std::string shape = "--preset qwen2.5-0.5b --tuner_type full --per_device_train_batch_size 4 --max_length 1024";
  const std::string device = " --backend vulkan --vulkan_max_allocation 4GiB";
  const auto refused = testing_support::run_memtune("plan " + shape + device + " --device_memory 24GiB --optim_offload");
  EXPECT_EQ(refused.status, 1) << refused.output;
  EXPECT_CONTAINS(refused.output, "--optim_offload keeps AdamW's state");
  EXPECT_CONTAINS(refused.output, "--backend vulkan cannot update");
  auto offloaded = [](const json& fit) {
    int n = 0;
    for (const auto& k : fit["fit"]) n += k["flags"].get<std::string>().find("--optim_offload") != std::string::npos;
    return n;
  };
  const json host = plan(shape + " --fit --device_memory 10GiB");
  EXPECT_GT(offloaded(host), 0);
  const auto r = testing_support::run_memtune("plan --json " + shape + device + " --fit --device_memory 10GiB");
  ASSERT_EQ(r.status, 0) << r.output;
  const json on_device = json::parse(r.output.substr(r.output.find("{\"")));
  EXPECT_FALSE(on_device["fit"].empty());
  EXPECT_EQ(offloaded(on_device), 0);
}

TEST(PlanCommand, ThePlanIsWhatARunOfTheSameConfigurationMeasures) {
  for (const char* tuner : {"full", "lora"})
    for (bool checkpointing : {false, true}) {
      const json p = plan(std::string("--preset tiny --tuner_type ") + tuner +
                          " --per_device_train_batch_size 2 --max_length 32 --lora_rank 4" +
                          (checkpointing ? " --gradient_checkpointing" : ""));
      ModelOptions o;
      o.max_tokens = 64;
      o.with_optimizer = true;
      o.gradient_checkpointing = checkpointing;
      if (std::string(tuner) == "lora") {
        o.lora.rank = 4;
        o.lora.dropout = 0.05;  // memtune train's default, which plan takes from the same flags
        set_lora_targets(o.lora, {"all-linear"});
      }
      Decoder m(model_preset("tiny"), o);
      m.parameters().init_random(1);
      std::vector<int32_t> ids(64), cu = {0, 32, 64};
      for (int i = 0; i < 64; ++i) ids[i] = (i * 7) % 512;
      m.forward_backward({ids, ids, cu});
      m.arena().enter_phase(Phase::Optimizer);
      for (size_t i = 0; i < m.parameters().num_trainable(); ++i) m.parameters().adam_m(i), m.parameters().adam_v(i);
      EXPECT_EQ(p["peak_bytes"].get<size_t>(), m.plan().peak_bytes()) << tuner;
      EXPECT_EQ(m.arena().high_water_bytes(), m.plan().peak_bytes()) << tuner << " checkpointing " << checkpointing;
    }
}

// `plan` with a run's own flags and data: the micro-batch comes from the data exactly as the run
// sizes it (its largest micro-batch of tokens, its largest count of loss targets), so the plan's
// arena is the run's; the whole process is predicted, and host budgets are checked.
TEST(PlanCommand, WithTheRunsDataThePlanIsTheRunsAndTheProcessIsPredicted) {
  const auto dir = testing_support::make_temp_dir("plan_data_test");
  ASSERT_EQ(testing_support::run_memtune("init-model --preset tiny --seed 1 --out " + (dir / "model").string()).status,
            0);
  testing_support::write_synthetic_tokenizer(dir / "model");
  {
    std::ofstream data(dir / "train.jsonl");
    for (int i = 0; i < 8; ++i)
      data << json{{"messages",
                    {{{"role", "user"}, {"content", "short question number " + std::to_string(i * 37)}},
                     {{"role", "assistant"}, {"content", "a short answer"}}}}}
                  .dump()
           << "\n";
  }
  const std::string flags = "--model_name_or_path " + (dir / "model").string() + " --train_file " +
                            (dir / "train.jsonl").string() + " --output_dir " + (dir / "out").string() +
                            " --per_device_train_batch_size 2 --max_length 256 --max_steps 2 --save_strategy no";
  const json p = plan(flags);
  // Two short examples, not 2 x 256 tokens; far fewer loss targets than tokens.
  EXPECT_LT(p["micro_batch_tokens"].get<int64_t>(), 2 * 256);
  EXPECT_LT(p["micro_batch_targets"].get<int64_t>(), p["micro_batch_tokens"].get<int64_t>());
  const auto run = testing_support::run_memtune("train " + flags);
  ASSERT_EQ(run.status, 0) << run.output;
  std::ifstream in(dir / "out" / "memory.json");
  const json memory = json::parse(in);
  EXPECT_EQ(p["peak_bytes"], memory["arena_bytes"]);
  // The process: the arena plus what surrounds it, measured (startup, data) and modelled.
  const size_t process = p["process_peak_bytes"].get<size_t>();
  EXPECT_GT(process, p["peak_bytes"].get<size_t>() + p["process"]["terms"]["startup_bytes"].get<size_t>());
  EXPECT_TRUE(p["process"]["data_measured"].get<bool>());
  EXPECT_FALSE(p["cuda_fixed_costs"]["measured"].get<bool>());
  // Host budgets (the measured terms move by a few pages between processes, hence the margins):
  // below the prediction it does not fit, above it fits, and --fit keeps only what fits.
  const json low = plan(flags + " --host_memory " + std::to_string(process * 9 / 10));
  EXPECT_FALSE(low["fits_host"].get<bool>());
  const std::string high = std::to_string(process * 11 / 10);
  EXPECT_TRUE(plan(flags + " --host_memory " + high)["fits_host"].get<bool>());
  const json fit = plan(flags + " --host_memory " + high + " --fit");
  ASSERT_FALSE(fit["fit"].empty());
  for (const json& k : fit["fit"]) EXPECT_LE(k["process_peak_bytes"].get<size_t>(), process * 11 / 10) << k.dump();
  // A run with a budget below its prediction stops before allocating, with the numbers.
  const auto refused = testing_support::run_memtune("train " + flags + " --overwrite_output_dir --host_memory 1MiB");
  EXPECT_EQ(refused.status, 1);
  EXPECT_CONTAINS(refused.output, "--host_memory 1.00 MiB: the process is predicted to need");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace memtune

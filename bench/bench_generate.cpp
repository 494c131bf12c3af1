// Benchmark: generation on a Qwen2 checkpoint on the CPU, against the machine's limits measured
// in the same run: the memory read bandwidth (decoding reads every weight once per step, so
// batch-1 decode is bound by bandwidth / bytes of weights per token) and the sgemm ceiling at the
// prefill's shapes (prefill is a GEMM over the prompt). The batch-1 decode runs in --rounds
// rounds with a bandwidth sample before, between and after them; each round's limit takes the
// higher of its two adjacent samples, and the report gives the round with the median ratio (all
// rounds are in the JSON): the bandwidth of the machines this ran on moves by 2x within a minute.
// Usage: bench_generate --model DIR [--torch_dtype float32|bfloat16] [--prompt 128] [--new 128]
//        [--batches 1,8] [--rounds 5]
// A GPTQ / AWQ model reads its packed bytes per token (the row's dtype is then its quantization).
// Prints a human-readable report and one final JSON line (for scripts/bench-generate.sh).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "backend/cpu/ops.h"
#include "backend/products.h"
#include "backend/registry.h"
#include "core/error.h"
#include "core/rng.h"
#include "generate/generator.h"
#include "model/kv_cache.h"
#include "io/quantized.h"
#include "memory/process_memory.h"
#include "model/load.h"
#include "bench_util.h"
#include "options/command_setup.h"
#include "options/inference_options.h"

using namespace memtune;
using bench::Clock;
using bench::seconds_since;
using bench::sgemm_gflops;

// Bytes per second read from a buffer far larger than the caches, by all threads, each summing
// its share into 8 vector accumulators (so the loop is bound by loads, not by add latency); the
// best of 3 passes without and 3 with a software prefetch 4 KB ahead (which reads ~15% faster on
// the 2-core AMD EPYC, as the decode kernels' own prefetch does: without it the limit would be
// set below what decoding reaches).
//
// Its 1 GiB buffer would be the process's peak RSS (the probes run beside the loaded model), so the
// kernel's high-water mark is read before the buffer exists and reset to the current resident set
// once it is freed (/proc/self/clear_refs "5"); peak_rss_without_probes() is the run without it.
static size_t peak_rss_outside_probes = 0;

static size_t peak_rss_without_probes() { return std::max(peak_rss_outside_probes, peak_rss_bytes()); }

static double read_bandwidth() {
  peak_rss_outside_probes = peak_rss_without_probes();
  typedef float f32x16 __attribute__((vector_size(64)));
  const size_t n = size_t{1} << 24;  // 16 Mi vectors of 16 floats: 1 GiB
  std::vector<f32x16> buffer(n + 64);
  std::memset(buffer.data(), 0, buffer.size() * sizeof(f32x16));
  double best = 0;
  for (const size_t ahead : {size_t{0}, size_t{64}})
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      float total = 0;
#pragma omp parallel reduction(+ : total)
      {
        f32x16 acc[8] = {};
#pragma omp for schedule(static)
        for (size_t i = 0; i < n; i += 8) {
          if (ahead) __builtin_prefetch(&buffer[i + ahead]);
          for (int k = 0; k < 8; ++k) acc[k] += buffer[i + k];
        }
        for (int k = 0; k < 8; ++k)
          for (int j = 0; j < 16; ++j) total += acc[k][j];
      }
      const double s = seconds_since(t0);
      if (total != 0.0f) std::abort();  // the buffer is zero; the check keeps the loop
      best = std::max(best, n * sizeof(f32x16) / s);
    }
  std::vector<f32x16>().swap(buffer);  // the memory goes back to the kernel
  std::ofstream("/proc/self/clear_refs") << "5";
  return best;
}

int main(int argc, char** argv) {
  CLI::App app{"memtune generation benchmark"};
  std::string model_dir, dtype_name = "bfloat16";
  int64_t prompt = 128, new_tokens = 128;
  std::vector<int64_t> batches = {1, 8};
  int64_t rounds = 5;
  app.add_option("--model", model_dir)->required();
  app.add_option("--torch_dtype", dtype_name);
  app.add_option("--prompt", prompt);
  app.add_option("--new", new_tokens);
  app.add_option("--batches", batches)->delimiter(',');
  std::string quantized_activations = "auto";
  app.add_option("--quantized_activations", quantized_activations, "auto | int8 | bf16 | float (GPTQ / AWQ models)")
      ->check(CLI::IsMember({"auto", "int8", "bf16", "float"}));
  int lm_head_bits = 0;
  app.add_option("--lm_head_bits", lm_head_bits, "GPTQ / AWQ models: the LM head packed at load (4 | 8)")
      ->check(CLI::IsMember({0, 4, 8}));
  app.add_option("--rounds", rounds, "batch-1 decode rounds, each between two bandwidth samples")
      ->check(CLI::Range(int64_t{1}, int64_t{100}));
  CLI11_PARSE(app, argc, argv);
  try {
    const DType dtype = parse_dtype(dtype_name, "--torch_dtype");
    const ConfigChanges changes(dtype, lm_head_bits);
    const ModelConfig c = load_model_config(model_dir, changes);
    const int64_t D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, L = c.num_hidden_layers;
    const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
    // Each decoded token reads every decoder weight and the LM head once (the embedding: one row).
    const double layer_params = double(D) * (c.q_dim() + 2 * c.kv_dim()) + double(c.q_dim()) * D + 3.0 * D * I;
    double weight_bytes = (L * layer_params + double(V) * D) * dtype_size(dtype);
    if (c.moe.enabled())  // the routed experts a token reads: experts_per_token of each layer's
      weight_bytes = (double(model_active_parameter_count(c)) - (c.tie_word_embeddings ? 0.0 : double(V) * D)) *
                     dtype_size(dtype);
    if (const QuantConfig& q = c.quant; q.enabled()) {  // packed layers: codes, scales, zeros
      weight_bytes = q.lm_head_bits ? 0.0 : double(V) * D * dtype_size(dtype);
      for (const ParamSpec& s : model_parameter_specs(c))
        if (const int bits = packed_bits(c, s)) {
          // A routed expert's projection is read by the experts_per_token of num_experts it is.
          const double read = s.name.find(".mlp.experts.") == std::string::npos
                                  ? 1.0
                                  : double(c.moe.experts_per_token) / double(c.moe.num_experts);
          weight_bytes += read * double(quantized_layer_bytes(bits, s.shape[1], s.shape[0], q.groups(s.shape[1]),
                                                              q.desc_act && s.name != "lm_head.weight"));
        }
    }
    ModelOptions activations;  // what --quantized_activations resolves to on this CPU
    apply_quantized_activations(quantized_activations, activations, backend_named("cpu"));
    const std::string label =
        c.quant.enabled()
            ? quantization_name(c.quant) + (c.quant.lm_head_bits ? fmt::format(", {}-bit head", c.quant.lm_head_bits) : "") +
                  (activations.bf16_quantized_products ? ", bfloat16 products"
                   : activations.int8_activations     ? ", int8 activations"
                                                      : "")
            : dtype_name;
    const double bandwidth = read_bandwidth();
    const double ceiling =
        std::max({sgemm_gflops(prompt, I, D), sgemm_gflops(prompt, c.q_dim(), D), sgemm_gflops(prompt, D, I)});
    fmt::print(
        "{} threads; memory read bandwidth {:.1f} GB/s; sgemm ceiling at the prefill's shapes {:.1f} GFLOP/s "
        "(OpenBLAS {} kernels)\n",
        omp_get_max_threads(), bandwidth / 1e9, ceiling, cpu::blas_kernels());
    fmt::print("model: {} parameters, {}; {:.1f} MB of weights read per decoded token\n", model_parameter_count(c),
               label, weight_bytes / 1e6);

    const InferenceLimits limits{.max_model_len = prompt + new_tokens, .max_num_seqs = max_batch,
                                 .max_num_batched_tokens = prompt * max_batch, .block_size = 16};
    ModelOptions options = inference_model_options(c, limits, nullptr);
    options.int8_activations = activations.int8_activations;
    options.bf16_quantized_products = activations.bf16_quantized_products;
    const std::unique_ptr<Decoder> model = load_model(model_dir, options, "", changes);
    Generator generator(*model, nullptr);
    Rng rng(1);
    nlohmann::json decode = nlohmann::json::object(), rounds_json = nlohmann::json::array();
    double prefill_tps = 0, decode_bandwidth = bandwidth;
    for (const int64_t batch : batches) {
      std::vector<GenerationRequest> requests(static_cast<size_t>(batch));
      for (auto& r : requests) {
        for (int64_t t = 0; t < prompt; ++t) r.prompt_ids.push_back(static_cast<int32_t>(rng.next_u64() % V));
        r.max_new_tokens = new_tokens;
        r.sampling.temperature = 0;
      }
      if (batch != 1) {
        generator.generate(requests);
        const GenerationStats& st = generator.stats();
        decode[std::to_string(batch)] = st.decode_tokens_per_second();
        fmt::print("batch {}: prefill {:.1f} tokens/s, decode {:.1f} tokens/s\n", batch,
                   st.prefill_tokens_per_second(), st.decode_tokens_per_second());
        continue;
      }
      struct Round {
        double decode, prefill, bandwidth, ratio;
      };
      std::vector<Round> measured;
      double previous = read_bandwidth();
      for (int64_t i = 0; i < rounds; ++i) {
        generator.generate(requests);
        const GenerationStats& st = generator.stats();
        const double next = read_bandwidth(), adjacent = std::max(previous, next);
        const Round r{st.decode_tokens_per_second(), st.prefill_tokens_per_second(), adjacent,
                      st.decode_tokens_per_second() * weight_bytes / adjacent};
        measured.push_back(r);
        rounds_json.push_back({{"decode_tokens_per_s", r.decode},
                               {"memory_read_gb_per_s_before", previous / 1e9},
                               {"memory_read_gb_per_s_after", next / 1e9},
                               {"of_limit", r.ratio}});
        fmt::print("batch 1, round {}: decode {:.1f} tokens/s; bandwidth {:.1f} GB/s before, {:.1f} after: {:.0f}% "
                   "of the limit\n",
                   i + 1, r.decode, previous / 1e9, next / 1e9, 100 * r.ratio);
        previous = next;
      }
      std::sort(measured.begin(), measured.end(), [](const Round& a, const Round& b) { return a.ratio < b.ratio; });
      const Round& median = measured[measured.size() / 2];
      decode["1"] = median.decode;
      prefill_tps = median.prefill;
      decode_bandwidth = median.bandwidth;
      fmt::print("batch 1: prefill {:.1f} tokens/s, decode {:.1f} tokens/s (the median round of {}; {:.0f}-{:.0f}% "
                 "of the limit over the rounds)\n",
                 median.prefill, median.decode, rounds, 100 * measured.front().ratio, 100 * measured.back().ratio);
    }
    // Prefill FLOPs per token: the layers' matmuls, attention over the causal half on average,
    // and the head at the last position only.
    const double attention = 2.0 * c.head_dim() * c.num_attention_heads * double(prompt + 1);
    const double prefill_gflops = prefill_tps * (2.0 * L * layer_params + L * attention + 2.0 * V * D / prompt) / 1e9;
    const double limit = decode_bandwidth / weight_bytes;
    const double b1 = decode.value("1", 0.0);
    // The targets: 85% for float weights, 80% for int8 codes, 60% for int4 ones.
    const int target = !c.quant.enabled() ? 85 : c.quant.bits == 8 ? 80 : 60;
    fmt::print("batch-1 decode {:.1f} tokens/s = {:.0f}% of the bandwidth limit {:.1f} tokens/s (target >= {}%)\n", b1,
               100 * b1 / limit, limit, target);
    if (decode.contains("8"))
      fmt::print("batch-8 decode {:.1f} tokens/s = {:.2f}x batch 1 (target >= 5x)\n", decode["8"].get<double>(),
                 decode["8"].get<double>() / b1);
    fmt::print("prefill {:.1f} GFLOP/s = {:.0f}% of the sgemm ceiling (target >= 60%)\n", prefill_gflops,
               100 * prefill_gflops / ceiling);
    const nlohmann::json out = {{"torch_dtype", label},
                                {"prompt_tokens", prompt},
                                {"new_tokens", new_tokens},
                                {"memory_read_gb_per_s", decode_bandwidth / 1e9},
                                {"memory_read_gb_per_s_at_start", bandwidth / 1e9},
                                {"sgemm_ceiling_gflops", ceiling},
                                {"blas_kernels", cpu::blas_kernels()},
                                {"products", products_json()},
                                {"weight_bytes_per_token", weight_bytes},
                                {"decode_limit_tokens_per_s", limit},
                                {"decode_tokens_per_s", decode},
                                {"batch_1_rounds", rounds_json},
                                {"prefill_tokens_per_s", prefill_tps},
                                {"prefill_gflops", prefill_gflops},
                                {"arena_bytes", model->plan().peak_bytes()},
                                {"peak_rss_bytes", peak_rss_without_probes()}};
    fmt::print("{}\n", out.dump());
  } catch (const Error& e) {
    fmt::print(stderr, "bench_generate: error: {}\n", e.what());
    return 1;
  }
}

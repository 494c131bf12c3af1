// Benchmark: one training step (forward + fused LM-head loss + backward) of a Qwen2 checkpoint on
// the CPU, against the GEMM ceiling measured at the model's own shapes in the same run.
// Usage: bench_step --model DIR [--batch 4] [--seq 512] [--steps 3] [--loss_workspace_bytes N]
// Prints a human-readable report and one final JSON line (for scripts/bench.sh).
#include <cblas.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "backend/registry.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "model/load.h"
#include "bench_util.h"

using namespace memtune;
using bench::Clock;
using bench::seconds_since;
using bench::sgemm_gflops;

int main(int argc, char** argv) {
  CLI::App app{"memtune step benchmark"};
  std::string model_dir;
  int64_t batch = 4, seq = 512, steps = 3;
  size_t workspace = kDefaultLossWorkspaceBytes;
  bool checkpointing = false;
  std::string backend = "cpu";
  app.add_option("--model", model_dir)->required();
  app.add_option("--backend", backend, "cpu | reference | vulkan");
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--steps", steps);
  app.add_option("--loss_workspace_bytes", workspace);
  app.add_flag("--gradient_checkpointing", checkpointing);
  CLI11_PARSE(app, argc, argv);
  try {
    ModelOptions opt;
    opt.max_tokens = batch * seq;
    opt.loss_workspace_bytes = workspace;
    opt.gradient_checkpointing = checkpointing;
    opt.backend = &backend_named(backend);
    const std::unique_ptr<Decoder> loaded = load_model(model_dir, opt);
    Decoder& model = *loaded;
    const ModelConfig& c = model.config();
    const int64_t N = batch * seq, D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
    const int64_t chunk = model.loss_chunk_rows();

    fmt::print(
        "model: {} parameters, hidden {}, layers {}, vocab {}; batch {} x {} tokens; logits chunk {} rows; backend "
        "{}\n",
        model_parameter_count(c), D, c.num_hidden_layers, V, batch, seq, chunk, backend);
    fmt::print("GEMM ceiling (OpenBLAS sgemm at the model's shapes, {} kernels):\n", cpu::blas_kernels());
    struct Shape {
      const char* what;
      int64_t M, N, K;
      bool ta, tb;
    };
    const Shape shapes[] = {{"lm_head forward  [chunk,D]x[V,D]^T", chunk, V, D, false, true},
                            {"lm_head dhidden  [chunk,V]x[V,D]", chunk, D, V, false, false},
                            {"lm_head dweight  [chunk,V]^Tx[chunk,D]", V, D, chunk, true, false},
                            {"mlp up forward   [N,D]x[I,D]^T", N, I, D, false, true},
                            {"mlp down dweight [N,D]^Tx[N,I]", D, I, N, true, false}};
    double ceiling = 0;
    for (const auto& s : shapes) {
      const double g = sgemm_gflops(s.M, s.N, s.K, s.ta, s.tb);
      ceiling = std::max(ceiling, g);
      fmt::print("  {:<42} {:8.1f} GFLOP/s\n", s.what, g);
    }

    // Useful FLOPs of a step: matmuls (forward 2*m*n*k, backward twice that) and attention
    // (scores and values: 4*hd per query-key pair in forward, 8 in backward over the causal half).
    const int64_t qd = c.q_dim(), kvd = c.kv_dim();
    const double layer_matmul = 2.0 * N * (D * qd + 2 * D * kvd + qd * D + 3 * D * I);
    const double pairs = double(batch) * seq * (seq + 1) / 2.0;
    const double attention = 4.0 * c.head_dim() * c.num_attention_heads * pairs;
    const double head = 2.0 * (N - batch) * V * D;  // positions with a target
    const double flops = 3.0 * (c.num_hidden_layers * (layer_matmul + attention) + head);

    Rng rng(1234);
    std::vector<int32_t> ids(N), cu;
    for (auto& id : ids) id = static_cast<int32_t>(rng.next_u64() % V);
    for (int64_t b = 0; b <= batch; ++b) cu.push_back(static_cast<int32_t>(b * seq));
    const TokenBatch tb{ids, ids, cu};
    model.parameters().zero_grads();
    model.forward_backward(tb);  // warm-up
    auto t0 = Clock::now();
    double loss = 0;
    for (int64_t s = 0; s < steps; ++s) {
      auto r = model.forward_backward(tb);
      loss = r.sum / r.count;
    }
    const double sec = seconds_since(t0) / steps;
    const StepTimings& pt = model.last_step_timings();
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    const double tokens_per_s = N / sec;
    const double gflops = flops / sec / 1e9;
    fmt::print(
        "step: {:.3f} s, {:.0f} tokens/s, {:.1f} GFLOP/s achieved = {:.0f}% of the GEMM ceiling {:.1f}; loss {:.4f}\n",
        sec, tokens_per_s, gflops, 100.0 * gflops / ceiling, ceiling, loss);
    fmt::print("phases of the last step ({}): forward {:.3f} s, loss (LM head) {:.3f} s, backward {:.3f} s\n",
               pt.device ? "device timestamps" : "host clock", pt.forward, pt.loss, pt.backward);
    fmt::print("memory: arena {} (planned), process peak RSS {} (measured)\n", format_bytes(model.plan().peak_bytes()),
               format_bytes(size_t(ru.ru_maxrss) * 1024));
    fmt::print(
        "{{\"tokens_per_s\": {:.1f}, \"seconds_per_step\": {:.4f}, \"gflops\": {:.2f}, \"gemm_ceiling_gflops\": "
        "{:.2f}, "
        "\"arena_bytes\": {}, \"peak_rss_bytes\": {}, \"loss\": {:.5f}}}\n",
        tokens_per_s, sec, gflops, ceiling, model.plan().peak_bytes(), size_t(ru.ru_maxrss) * 1024, loss);
  } catch (const Error& e) {
    fmt::print(stderr, "bench_step: error: {}\n", e.what());
    return 1;
  }
  return 0;
}

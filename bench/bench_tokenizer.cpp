// Benchmark: tokenizer encoding throughput on a JSONL corpus (one JSON string per line), in MB/s
// of UTF-8 input (10^6 bytes per second), on one thread and on N threads (OpenMP over lines).
// Each measurement follows an untimed warm-up pass (regex JIT, per-thread piece caches) and
// repeats whole passes for at least a second.
// Usage: bench_tokenizer --tokenizer DIR --corpus FILE.jsonl [--threads N]
// Prints a human-readable report and one final JSON line (for scripts/bench-tokenizer.sh).
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

using namespace memtune;
using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

static std::vector<std::string> read_corpus(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("{}: cannot open", path));
  std::vector<std::string> texts;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::json v;
    try {
      v = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(fmt::format("{}:{}: not JSON: {}", path, n, e.what()));
    }
    if (!v.is_string()) throw Error(fmt::format("{}:{}: expected a JSON string", path, n));
    texts.push_back(v.get<std::string>());
  }
  return texts;
}

// Encodes every text once on `threads` threads; returns the number of tokens produced.
static int64_t encode_all(const Tokenizer& tokenizer, const std::vector<std::string>& texts, int threads) {
  int64_t tokens = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tokens)
  {
    std::vector<int32_t> ids;
#pragma omp for schedule(dynamic, 16)
    for (size_t i = 0; i < texts.size(); ++i) {
      ids.clear();
      tokenizer.encode(texts[i], ids);
      tokens += static_cast<int64_t>(ids.size());
    }
  }
  return tokens;
}

struct Throughput {
  double mb_per_s;
  int64_t tokens_per_pass;
};

static Throughput measure(const Tokenizer& tokenizer, const std::vector<std::string>& texts, size_t bytes,
                          int threads) {
  const int64_t tokens = encode_all(tokenizer, texts, threads);  // warm-up
  int passes = 0;
  const auto t0 = Clock::now();
  do {
    encode_all(tokenizer, texts, threads);
    ++passes;
  } while (seconds_since(t0) < 1.0);
  return {static_cast<double>(bytes) * passes / seconds_since(t0) / 1e6, tokens};
}

int main(int argc, char** argv) {
  CLI::App app{"memtune tokenizer benchmark"};
  std::string tokenizer_dir, corpus;
  int threads = omp_get_max_threads();
  app.add_option("--tokenizer", tokenizer_dir, "directory with tokenizer.json")->required();
  app.add_option("--corpus", corpus, "JSONL file, one JSON string per line")->required();
  app.add_option("--threads", threads, "threads for the parallel measurement")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    const auto t_load = Clock::now();
    const Tokenizer tokenizer = Tokenizer::load(tokenizer_dir);
    const double load_seconds = seconds_since(t_load);
    const std::vector<std::string> texts = read_corpus(corpus);
    size_t bytes = 0;
    for (const auto& t : texts) bytes += t.size();
    fmt::print("tokenizer {} (vocab {}) loaded in {:.2f} s; corpus {}: {} strings, {:.2f} MB\n", tokenizer_dir,
               tokenizer.vocab_size(), load_seconds, corpus, texts.size(), bytes / 1e6);

    const Throughput one = measure(tokenizer, texts, bytes, 1);
    fmt::print("1 thread:   {:8.2f} MB/s ({} tokens per pass, {:.2f} bytes/token)\n", one.mb_per_s, one.tokens_per_pass,
               static_cast<double>(bytes) / static_cast<double>(one.tokens_per_pass));
    const Throughput all = measure(tokenizer, texts, bytes, threads);
    fmt::print("{} threads: {:8.2f} MB/s ({:.2f}x)\n", threads, all.mb_per_s, all.mb_per_s / one.mb_per_s);
    if (all.tokens_per_pass != one.tokens_per_pass) throw Error("token counts differ between 1 and N threads");

    const nlohmann::json report = {{"tokenizer", tokenizer_dir},
                                   {"corpus", corpus},
                                   {"strings", texts.size()},
                                   {"bytes", bytes},
                                   {"tokens", one.tokens_per_pass},
                                   {"load_seconds", load_seconds},
                                   {"threads", threads},
                                   {"mb_per_s_1_thread", one.mb_per_s},
                                   {"mb_per_s_all_threads", all.mb_per_s}};
    fmt::print("{}\n", report.dump());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// Which kernel each family of matrix products ran, how often, how long and how fast: counted by
// the backend around the products it makes (the implementation name oneDNN gives for the
// primitive it built, or the BLAS / memtune kernel set), never read from a library's verbose log.
// memory.json's and generate's "products"; the benchmarks record it beside their figures.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace memtune {

enum class ProductFamily {
  Layers,              // the decoder layers' linear products of many rows (forward and backward)
  HeadForward,         // the fused LM head's logits, a vocabulary slice at a time
  HeadWeightGradient,  // d(head) += d(logits)^T @ hidden rows
  HeadInputGradient,   // d(hidden rows) = d(logits) @ head
  Prefill,             // quantized weights' products of many rows (prefill, evaluation)
};
const char* product_family_name(ProductFamily family);

struct ProductRecord {
  ProductFamily family;
  std::string kernel;
  int64_t calls = 0;
  double seconds = 0, flops = 0;
};

// Times one product call: the clock runs from construction to destruction, and the record joins
// the process's totals then (allocating only the first time a family meets a kernel: a step
// allocates nothing once its products have run; `kernel` outlives the timer). What a product's operands were prepared by beforehand (a 16-bit
// copy, a dequantized tile) is not in its time; a kernel that unpacks as it multiplies (memtune's
// int8 kernel) has it in. Thread-safe.
class ProductTimer {
 public:
  ProductTimer(ProductFamily family, std::string_view kernel, double flops);
  ~ProductTimer();
  ProductTimer(const ProductTimer&) = delete;
  ProductTimer& operator=(const ProductTimer&) = delete;

 private:
  ProductFamily family_;
  std::string_view kernel_;
  double flops_;
  int64_t start_ns_;
};

// The totals since the process started, by family then kernel.
std::vector<ProductRecord> product_records();
// The same as a JSON array: [{"family", "kernel", "calls", "seconds", "gflop", "gflop_per_second"}].
nlohmann::json products_json();

}  // namespace memtune

// The process's product totals (products.h).
#include "backend/products.h"

#include <chrono>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

namespace memtune {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Keyed by (family, kernel), looked up by a view of the kernel's name (no string is made).
struct Key {
  ProductFamily family;
  std::string kernel;
};
struct KeyOrder {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return std::pair(a.family, std::string_view(a.kernel)) < std::pair(b.family, std::string_view(b.kernel));
  }
};
struct KeyView {
  ProductFamily family;
  std::string_view kernel;
};
struct Totals {
  std::mutex mutex;
  std::map<Key, ProductRecord, KeyOrder> records;
};
Totals& totals() {
  static Totals t;
  return t;
}

}  // namespace

const char* product_family_name(ProductFamily family) {
  switch (family) {
    case ProductFamily::Layers: return "layers";
    case ProductFamily::HeadForward: return "head_forward";
    case ProductFamily::HeadWeightGradient: return "head_weight_gradient";
    case ProductFamily::HeadInputGradient: return "head_input_gradient";
    case ProductFamily::Prefill: return "prefill";
  }
  return "?";
}

ProductTimer::ProductTimer(ProductFamily family, std::string_view kernel, double flops)
    : family_(family), kernel_(kernel), flops_(flops), start_ns_(now_ns()) {}

ProductTimer::~ProductTimer() {
  const double seconds = static_cast<double>(now_ns() - start_ns_) * 1e-9;
  Totals& t = totals();
  std::lock_guard lock(t.mutex);
  auto it = t.records.find(KeyView{family_, kernel_});
  if (it == t.records.end())
    it = t.records.emplace(Key{family_, std::string(kernel_)}, ProductRecord{family_, std::string(kernel_)}).first;
  ProductRecord& r = it->second;
  r.calls += 1;
  r.seconds += seconds;
  r.flops += flops_;
}

std::vector<ProductRecord> product_records() {
  Totals& t = totals();
  std::lock_guard lock(t.mutex);
  std::vector<ProductRecord> out;
  for (const auto& [key, record] : t.records) out.push_back(record);
  return out;
}

nlohmann::json products_json() {
  nlohmann::json out = nlohmann::json::array();
  for (const ProductRecord& r : product_records())
    out.push_back({{"family", product_family_name(r.family)},
                   {"kernel", r.kernel},
                   {"calls", r.calls},
                   {"seconds", r.seconds},
                   {"gflop", r.flops * 1e-9},
                   {"gflop_per_second", r.seconds > 0 ? r.flops * 1e-9 / r.seconds : 0.0}});
  return out;
}

}  // namespace memtune

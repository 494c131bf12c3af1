// Deterministic random numbers: splitmix64 streams keyed by (seed, name), so a parameter's
// initial values depend only on the seed and its name, not on thread count or creation order.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

namespace memtune {

// splitmix64's finalizer: a bijection of 64-bit words whose outputs for nearby inputs look unrelated.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  Rng(uint64_t seed, std::string_view stream) : state_(seed) {
    for (unsigned char c : stream) state_ = (state_ ^ c) * 0x100000001b3ull;  // FNV-1a style mix
  }

  uint64_t next_u64() {
    return mix64(state_ += 0x9e3779b97f4a7c15ull);
  }
  // Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  // Standard normal (Box-Muller).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace memtune

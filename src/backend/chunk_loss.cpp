// Cross-entropy and the streaming log-sum-exp behind the extension API (chunk_loss.h): host
// code over one chunk of logits, shared by every backend that runs losses on host memory.
#include "backend/chunk_loss.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace memtune {

float row_logsumexp(const float* z, int64_t V, float* sum_out) {
  // Each block is reduced to (max, sum of exp) while it sits in L1, and blocks are merged like
  // an online softmax, so the row streams from memory once.
  constexpr int64_t kBlock = 2048;
  float row_max = -std::numeric_limits<float>::infinity(), row_sum = 0.0f, zsum = 0.0f;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    float bmax = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : bmax)
    for (int64_t v = b0; v < b1; ++v) bmax = std::max(bmax, z[v]);
    float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
    for (int64_t v = b0; v < b1; ++v) bsum += fast_exp(z[v] - bmax);
    if (sum_out) {
#pragma omp simd reduction(+ : zsum)
      for (int64_t v = b0; v < b1; ++v) zsum += z[v];
    }
    if (bmax > row_max) {
      row_sum = row_sum * fast_exp(row_max - bmax) + bsum;
      row_max = bmax;
    } else {
      row_sum += bsum * fast_exp(bmax - row_max);
    }
  }
  if (sum_out) *sum_out = zsum;
  return row_max + std::log(row_sum);
}

RowStats row_stats(const float* z, int64_t V, int32_t target) {
  const float zt = z[target];
  int64_t above = 0;
#pragma omp simd reduction(+ : above)
  for (int64_t v = 0; v < V; ++v) above += (z[v] > zt) | ((z[v] == zt) & (v < target));
  return {.logsumexp = row_logsumexp(z, V),
          .target_logit = zt,
          .argmax = static_cast<int32_t>(std::max_element(z, z + V) - z),
          .target_rank = static_cast<int32_t>(above)};
}

double CrossEntropyLoss::chunk(float* logits, const int32_t* targets, int64_t rows, int64_t V, bool gradient) const {
  const float eps = label_smoothing_;
  const float inv_v = 1.0f / static_cast<float>(V);
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t r = 0; r < rows; ++r) {
    float* z = logits + r * V;
    const int32_t t = targets[r];
    float zsum = 0.0f;
    const float lse = row_logsumexp(z, V, eps > 0.0f ? &zsum : nullptr);
    // nll = lse - z_t; the smoothing term mean_v(lse - z_v) = lse - mean(z)
    total += (1.0f - eps) * (lse - z[t]) + eps * (lse - zsum * inv_v);
    if (gradient) {
      // d/dz_v = p_v - (1-eps) [v==t] - eps/V
      const float shift = eps * inv_v;
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) z[v] = fast_exp(z[v] - lse) - shift;
      z[t] -= 1.0f - eps;
    }
  }
  return total;
}

}  // namespace memtune

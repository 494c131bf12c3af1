// Per-op checks of the CPU backend: every backward against central finite differences of its
// forward (in the spirit of ggml's test-backend-ops), and forwards against direct formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/rng.h"

namespace memtune::cpu {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = scale * static_cast<float>(rng.normal());
  return v;
}

double weighted_sum(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += double(out[i]) * r[i];
  return s;
}

// Compares `analytic` = dL/dx with central differences of L over every element of x.
// The error is measured as ||fd - analytic|| / max(||fd||, tiny) so tiny gradients don't dominate.
void expect_grad_matches(const char* what, std::vector<float>& x, const std::function<double()>& loss,
                         const std::vector<float>& analytic, size_t stride = 1, float h = 1e-2f, double tol = 2e-3) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double fd = (lp - lm) / (2.0 * h);
    diff2 += (fd - analytic[i]) * (fd - analytic[i]);
    ref2 += fd * fd;
  }
  ASSERT_GT(ref2, 0.0) << what << ": gradient is identically zero, the check would prove nothing";
  EXPECT_LT(std::sqrt(diff2 / ref2), tol) << what;
}

TEST(Ops, FastExpIsAccurate) {
  for (float x = -80.0f; x < 80.0f; x += 0.37f) {
    const double ref = std::exp(double(x));
    EXPECT_NEAR(fast_exp(x) / ref, 1.0, 5e-7) << x;
  }
  EXPECT_EQ(fast_exp(-1000.0f) < 1e-37f, true);
}

TEST(Ops, MatmulBackward) {
  const int64_t N = 5, C = 7, OC = 3;
  auto x = randn(N * C, 1), w = randn(OC * C, 2), b = randn(OC, 3), r = randn(N * OC, 4);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
    return weighted_sum(out, r);
  };
  loss();
  // forward against the definition
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = b[o];
      for (int64_t c = 0; c < C; ++c) s += double(x[n * C + c]) * w[o * C + c];
      EXPECT_NEAR(out[n * OC + o], s, 1e-5);
    }
  std::vector<float> dx(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  matmul_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N, C, OC);
  expect_grad_matches("dx", x, loss, dx);
  expect_grad_matches("dweight", w, loss, dw);
  expect_grad_matches("dbias", b, loss, db);
}

TEST(Ops, RmsnormBackward) {
  const int64_t N = 4, C = 16;
  auto x = randn(N * C, 5), w = randn(C, 6), r = randn(N * C, 7);
  std::vector<float> out(N * C), rstd(N);
  auto loss = [&] {
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
    return weighted_sum(out, r);
  };
  loss();
  double ms = 0;
  for (int64_t c = 0; c < C; ++c) ms += double(x[c]) * x[c] / C;
  EXPECT_NEAR(out[3], x[3] / std::sqrt(ms + 1e-6) * w[3], 1e-5);
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  expect_grad_matches("dx", x, loss, dx);
  expect_grad_matches("dweight", w, loss, dw);
}

TEST(Ops, RopeMatchesRotateHalfAndBackward) {
  const int64_t N = 6, H = 2, hd = 8;
  const float theta = 10000.0f;
  std::vector<int32_t> pos = {0, 1, 2, 0, 1, 7};  // two sequences: positions restart
  auto x = randn(N * H * hd, 8), r = randn(N * H * hd, 9);
  std::vector<float> out;
  auto loss = [&] {
    out = x;
    rope_forward(out.data(), pos.data(), N, H, hd, theta);
    return weighted_sum(out, r);
  };
  loss();
  // rotate-half definition: out = x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < hd; ++i) {
        const int64_t f = i % (hd / 2);
        const double angle = pos[n] / std::pow(double(theta), 2.0 * f / hd);
        const float* xs = x.data() + (n * H + h) * hd;
        const double rot = i < hd / 2 ? -xs[i + hd / 2] : xs[i - hd / 2];
        EXPECT_NEAR(out[(n * H + h) * hd + i], xs[i] * std::cos(angle) + rot * std::sin(angle), 1e-4);
      }
  std::vector<float> dx = r;
  rope_backward(dx.data(), pos.data(), N, H, hd, theta);
  expect_grad_matches("dx", x, loss, dx);
}

// Causal softmax attention computed the direct way (full score rows, double precision).
std::vector<float> naive_attention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, const std::vector<int32_t>& cu, int64_t Hq, int64_t Hkv,
                                   int64_t hd) {
  const int64_t N = cu.back(), qd = Hq * hd, kvd = Hkv * hd;
  std::vector<float> out(N * qd);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
        std::vector<double> p;
        double mx = -1e300;
        for (int64_t j = cu[s]; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += double(q[i * qd + h * hd + e]) * k[j * kvd + g * hd + e];
          p.push_back(d / std::sqrt(double(hd)));
          mx = std::max(mx, p.back());
        }
        double z = 0;
        for (double& x : p) z += (x = std::exp(x - mx));
        for (int64_t e = 0; e < hd; ++e) {
          double o = 0;
          for (int64_t j = cu[s]; j <= i; ++j) o += p[j - cu[s]] / z * v[j * kvd + g * hd + e];
          out[i * qd + h * hd + e] = static_cast<float>(o);
        }
      }
    }
  return out;
}

TEST(Ops, AttentionGqaWithSequenceBoundaries) {
  const int64_t Hq = 4, Hkv = 2, hd = 8;
  // Three sequences, one of length 1, one longer than a key block would need for the online
  // softmax to rescale (the block is 64, so use 70 tokens there).
  const std::vector<int32_t> cu = {0, 5, 6, 76};
  const int64_t N = cu.back(), S = 3;
  auto q = randn(N * Hq * hd, 10), k = randn(N * Hkv * hd, 11), v = randn(N * Hkv * hd, 12);
  auto r = randn(N * Hq * hd, 13);
  std::vector<float> out(N * Hq * hd), lse(N * Hq);
  auto loss = [&] {
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), S, Hq, Hkv, hd);
    return weighted_sum(out, r);
  };
  loss();
  const auto ref = naive_attention(q, k, v, cu, Hq, Hkv, hd);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-5) << i;
  std::vector<float> dq(q.size(), 7.0f), dk(k.size(), 7.0f), dv(v.size(), 7.0f);  // overwritten, not accumulated
  attention_backward(dq.data(), dk.data(), dv.data(), r.data(), out.data(), lse.data(), q.data(), k.data(), v.data(),
                     cu.data(), S, Hq, Hkv, hd);
  // Every 5th element (the loss is O(N^2) to evaluate); 5 is odd, so all heads and dims are hit.
  expect_grad_matches("dq", q, loss, dq, 5);
  expect_grad_matches("dk", k, loss, dk, 5);
  expect_grad_matches("dv", v, loss, dv, 5);
}

TEST(Ops, SwigluBackward) {
  const int64_t n = 40;
  auto g = randn(n, 14, 2.0f), u = randn(n, 15), r = randn(n, 16);
  std::vector<float> h(n);
  auto loss = [&] {
    swiglu_forward(h.data(), g.data(), u.data(), n);
    return weighted_sum(h, r);
  };
  loss();
  EXPECT_NEAR(h[0], g[0] / (1 + std::exp(-g[0])) * u[0], 1e-5);
  std::vector<float> dg(n, 0.0f), du(n, 0.0f);
  swiglu_backward(dg.data(), du.data(), r.data(), g.data(), u.data(), n);
  expect_grad_matches("dgate", g, loss, dg);
  expect_grad_matches("dup", u, loss, du);
}

TEST(Ops, EmbeddingBackwardWithRepeatedIds) {
  const int64_t V = 5, D = 70, N = 6;  // D above one column block
  const std::vector<int32_t> ids = {3, 1, 3, 0, 3, 4};
  auto table = randn(V * D, 17), r = randn(N * D, 18);
  std::vector<float> out(N * D);
  auto loss = [&] {
    embedding_forward(out.data(), ids.data(), table.data(), DType::F32, N, D);
    return weighted_sum(out, r);
  };
  loss();
  std::vector<float> dt(V * D, 0.0f);
  embedding_backward(dt.data(), r.data(), ids.data(), N, D);
  expect_grad_matches("dtable", table, loss, dt);
}

struct LmHeadCase {
  int64_t chunk_rows;
  float label_smoothing;
  DType weight_dtype = DType::F32;
  int64_t slice_rows = 0;
};

class LmHeadTest : public ::testing::TestWithParam<LmHeadCase> {};

TEST_P(LmHeadTest, MatchesMaterializedLogitsAndFiniteDifferences) {
  const auto [chunk, eps, wdtype, slice] = GetParam();
  const int64_t N = 9, D = 6, V = 37;
  const std::vector<int32_t> targets = {4, -100, 0, 36, -100, -100, 17, 4, 2};
  auto h = randn(N * D, 19), w = randn(V * D, 20);
  std::vector<float> logits(chunk * V), rows(chunk * D), drows(chunk * D), wslice(slice * D);
  std::vector<int32_t> positions(N), row_targets(chunk);
  const LmHeadWorkspace ws{logits.data(),      rows.data(), drows.data(),  positions.data(),
                           row_targets.data(), chunk,       wslice.data(), slice};
  const CrossEntropyLoss ce(eps);
  // A 16-bit weight holds the rounded values; the reference below uses the same rounded values.
  std::vector<uint16_t> w16(V * D);
  auto stored_weight = [&]() -> const void* {
    if (wdtype == DType::F32) return w.data();
    convert_from_f32(w.data(), w16.data(), wdtype, w.size());
    return w16.data();
  };
  if (wdtype != DType::F32) {
    convert_from_f32(w.data(), w16.data(), wdtype, w.size());
    convert_to_f32(w16.data(), wdtype, w.data(), w.size());
  }
  auto loss = [&] {
    return lm_head_loss(h.data(), targets.data(), N, stored_weight(), wdtype, V, D, ce, nullptr, nullptr, ws).sum;
  };

  // Direct computation over materialized logits, in double.
  double ref = 0;
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] == -100) continue;
    ++count;
    std::vector<double> z(V);
    double mx = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t d = 0; d < D; ++d) z[v] += double(h[n * D + d]) * w[v * D + d];
      mx = std::max(mx, z[v]);
    }
    double se = 0, mean_logp = 0;
    for (double x : z) se += std::exp(x - mx);
    const double lse = mx + std::log(se);
    for (double x : z) mean_logp += (x - lse) / V;
    ref += (1 - eps) * (lse - z[targets[n]]) - eps * mean_logp;
  }
  std::vector<float> dh(N * D, 5.0f), dw(V * D, 0.0f);
  const LossSum got =
      lm_head_loss(h.data(), targets.data(), N, stored_weight(), wdtype, V, D, ce, dh.data(), dw.data(), ws);
  EXPECT_EQ(got.count, count);
  EXPECT_NEAR(got.sum, ref, 1e-4 * std::abs(ref));
  EXPECT_NEAR(loss(), ref, 1e-4 * std::abs(ref));
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dh[1 * D + d], 0.0f) << "ignored position must get zero gradient";
  expect_grad_matches("dhidden", h, loss, dh);
  // Finite differences need a weight that can move by h; a 16-bit one cannot, so the weight
  // gradient is checked in float32 storage (the slicing path is the same code for dhidden).
  if (wdtype == DType::F32) {
    expect_grad_matches("dweight", w, loss, dw);
  } else {
    std::vector<float> dh32(N * D), dw32(V * D, 0.0f);
    lm_head_loss(h.data(), targets.data(), N, w.data(), DType::F32, V, D, ce, dh32.data(), dw32.data(), ws);
    for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw[i], dw32[i], 1e-5) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(ChunkSizes, LmHeadTest,
                         ::testing::Values(LmHeadCase{1, 0.0f}, LmHeadCase{4, 0.0f}, LmHeadCase{1000, 0.0f},
                                           LmHeadCase{3, 0.1f}, LmHeadCase{4, 0.0f, DType::BF16, 5},
                                           LmHeadCase{2, 0.1f, DType::F16, 37}, LmHeadCase{3, 0.0f, DType::BF16, 64}),
                         [](const ::testing::TestParamInfo<LmHeadCase>& info) {
                           const LmHeadCase& p = info.param;
                           return "chunk" + std::to_string(p.chunk_rows) + (p.label_smoothing > 0 ? "_smoothing" : "") +
                                  "_" + std::string(dtype_safetensors_name(p.weight_dtype)) +
                                  (p.slice_rows ? "_slice" + std::to_string(p.slice_rows) : "");
                         });

}  // namespace
}  // namespace memtune::cpu

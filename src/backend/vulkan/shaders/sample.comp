#version 460
// One token per row of logits [R, V] (backend/sample_row.h), one workgroup per row; only the ids
// leave the device. rows[10 r ..] holds row r's settings as 32-bit words: temperature,
// top_k (int), top_p, min_p, repetition, presence and frequency penalties (sample_penalties.comp
// applied them already), the uniform draw, and the penalty list's range.
//   temperature 0: the first maximum.
//   otherwise: e_v = exp((z_v - max) / temperature). top-k keeps the tokens at or above the k-th
//   largest logit and top-p those at or above the largest logit whose kept mass reaches top_p of
//   what top-k kept, both thresholds found by bisection over the logits' order (32 passes, no
//   sort); min-p keeps e_v >= min_p. The draw walks the kept e_v in id order to u times their sum.
// Unlike the host sampler, which sorts, a tie at a threshold keeps every tied token.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant) uniform Push { F32 logits; I32 rows; I32 tokens; uint V; } p;

shared float s_f[256];
shared uint s_u[256];
shared uint s_arg[256];

// Sums over the workgroup; every thread must call them, and every thread gets the total.
float sum_f(float x) {
  const uint t = gl_LocalInvocationID.x;
  barrier();
  s_f[t] = x;
  barrier();
  for (uint h = 128u; h > 0u; h >>= 1) {
    if (t < h) s_f[t] += s_f[t + h];
    barrier();
  }
  return s_f[0];
}
uint sum_u(uint x) {
  const uint t = gl_LocalInvocationID.x;
  barrier();
  s_u[t] = x;
  barrier();
  for (uint h = 128u; h > 0u; h >>= 1) {
    if (t < h) s_u[t] += s_u[t + h];
    barrier();
  }
  return s_u[0];
}
// A uint with the order of the floats.
uint order_key(float f) {
  const uint u = floatBitsToUint(f);
  return (u & 0x80000000u) != 0u ? ~u : u | 0x80000000u;
}

void main() {
  const uint t = gl_LocalInvocationID.x, row = gl_WorkGroupID.x, V = p.V;
  const uint base = row * V;
  const uint share = (V + 255u) / 256u, b0 = min(V, t * share), b1 = min(V, b0 + share);
  const float temperature = intBitsToFloat(p.rows.v[10u * row]);
  const int top_k = p.rows.v[10u * row + 1u];
  const float top_p = intBitsToFloat(p.rows.v[10u * row + 2u]);
  const float min_p = intBitsToFloat(p.rows.v[10u * row + 3u]);
  const float u = intBitsToFloat(p.rows.v[10u * row + 7u]);

  // The maximum and its first index (each thread's block is contiguous and walked in order).
  float best = -1.0 / 0.0;
  uint best_at = 0xffffffffu;
  for (uint v = b0; v < b1; ++v) {
    const float z = p.logits.v[base + v];
    if (z > best) {
      best = z;
      best_at = v;
    }
  }
  s_f[t] = best;
  s_arg[t] = best_at;
  barrier();
  for (uint h = 128u; h > 0u; h >>= 1) {
    if (t < h && (s_f[t + h] > s_f[t] || (s_f[t + h] == s_f[t] && s_arg[t + h] < s_arg[t]))) {
      s_f[t] = s_f[t + h];
      s_arg[t] = s_arg[t + h];
    }
    barrier();
  }
  const float m = s_f[0];
  const uint argmax = s_arg[0];
  if (temperature == 0.0) {
    if (t == 0u) p.tokens.v[row] = int(argmax);
    return;
  }
  const float inv_t = 1.0 / temperature;
  const uint top = order_key(m);
  uint floor_key = 0u;  // kept: order_key(z) >= floor_key
  if (top_k > 0 && uint(top_k) < V) {
    // The largest key with at least k logits at or above it: the k-th largest logit's.
    uint lo = 0u, hi = top;
    while (lo < hi) {
      const uint mid = lo + (hi - lo + 1u) / 2u;
      uint c = 0u;
      for (uint v = b0; v < b1; ++v) c += uint(order_key(p.logits.v[base + v]) >= mid);
      if (sum_u(c) >= uint(top_k)) lo = mid;
      else hi = mid - 1u;
    }
    floor_key = lo;
  }
  if (top_p < 1.0) {
    float kept = 0.0;
    for (uint v = b0; v < b1; ++v) {
      const float z = p.logits.v[base + v];
      if (order_key(z) >= floor_key) kept += exp((z - m) * inv_t);
    }
    const float goal = top_p * sum_f(kept);
    // The largest key whose logits at or above it hold at least top_p of the kept mass.
    uint lo = floor_key, hi = top;
    while (lo < hi) {
      const uint mid = lo + (hi - lo + 1u) / 2u;
      float mass = 0.0;
      for (uint v = b0; v < b1; ++v) {
        const float z = p.logits.v[base + v];
        if (order_key(z) >= mid) mass += exp((z - m) * inv_t);
      }
      if (sum_f(mass) >= goal) lo = mid;
      else hi = mid - 1u;
    }
    floor_key = lo;
  }
  // The draw: each thread's kept mass, an exclusive scan over the threads, then the thread whose
  // range holds u times the total walks its block.
  float mine = 0.0;
  uint last = 0xffffffffu;
  for (uint v = b0; v < b1; ++v) {
    const float z = p.logits.v[base + v];
    const float e = exp((z - m) * inv_t);
    if (order_key(z) >= floor_key && e >= min_p) {
      mine += e;
      last = v;
    }
  }
  barrier();
  s_f[t] = mine;
  s_arg[t] = last;
  barrier();
  if (t == 0u) {
    float run = 0.0;
    uint final_kept = argmax;
    for (uint i = 0u; i < 256u; ++i) {
      const float x = s_f[i];
      s_f[i] = run;  // exclusive prefix
      run += x;
      if (s_arg[i] != 0xffffffffu) final_kept = s_arg[i];
    }
    s_u[0] = floatBitsToUint(run);
    s_u[1] = final_kept;
    s_u[2] = 0xffffffffu;
  }
  barrier();
  const float total = uintBitsToFloat(s_u[0]);
  const float goal = u * total;
  const float before = s_f[t];
  if (mine > 0.0 && goal >= before && goal < before + mine) {
    float cumulative = before;
    for (uint v = b0; v < b1; ++v) {
      const float z = p.logits.v[base + v];
      const float e = exp((z - m) * inv_t);
      if (order_key(z) < floor_key || e < min_p) continue;
      cumulative += e;
      if (goal < cumulative) {
        s_u[2] = v;
        break;
      }
      s_u[2] = v;  // rounding: the block's last kept token
    }
  }
  barrier();
  if (t == 0u) p.tokens.v[row] = int(s_u[2] != 0xffffffffu ? s_u[2] : s_u[1]);
}

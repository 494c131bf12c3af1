// Shared by the attention shaders: the sum of one value per thread over a 64-wide
// workgroup (a shared-memory tree: the same order every run), and the sequence of a token.
shared float reduce_buffer[64];
// Every thread of the workgroup must call it (it holds barriers); all get the sum.
float workgroup_sum(float x) {
  const uint t = gl_LocalInvocationID.x;
  reduce_buffer[t] = x;
  barrier();
  for (uint half_ = 32u; half_ > 0u; half_ >>= 1) {
    if (t < half_) reduce_buffer[t] += reduce_buffer[t + half_];
    barrier();
  }
  const float sum = reduce_buffer[0];
  barrier();
  return sum;
}
// The sequence s with cu[s] <= token < cu[s + 1] among S sequences.
uint sequence_of(I32 cu, uint S, uint token) {
  uint lo = 0u, hi = S;
  while (hi - lo > 1u) {
    const uint mid = (lo + hi) / 2u;
    if (uint(cu.v[mid]) <= token) lo = mid; else hi = mid;
  }
  return lo;
}
// Each thread holds dims tid, tid + 64, ... of a head (head_dim <= 256).
#define DIMS 4

// What every shader shares: tensors are reached through 64-bit buffer device addresses handed
// in push constants (no descriptor sets, no binding-size limit), as float32 or int32 arrays or as
// 16-bit words (bfloat16 / float16 storage, widened in the shader).
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_EXT_shader_16bit_storage : require

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16 { uint16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };

// The row of a shader with a workgroup per row, over a grid that vulkan_geometry::per_row folds
// into x and y beyond 65,535 rows (the x * y workgroups may exceed the rows by less than a row of
// the grid: those return at once).
uint folded_row() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }

// The sequence s with cu[s] <= token < cu[s + 1] among S sequences.
uint sequence_of(I32 cu, uint S, uint token) {
  uint lo = 0u, hi = S;
  while (hi - lo > 1u) {
    const uint mid = (lo + hi) / 2u;
    if (uint(cu.v[mid]) <= token) lo = mid; else hi = mid;
  }
  return lo;
}
const float NEG_INF = -1.0 / 0.0;

// A grid-stride loop over n elements for a 1-D dispatch of 256-wide workgroups.
// The MLP's activation, h = silu(gate) * up: swiglu.comp's, and matvec.comp's and
// gemm_coopmat.comp's where it runs in their products' pass (the same bits in each).
float silu_times(float g, float u) { return g / (1.0 + exp(-g)) * u; }
#define FOR_EACH(i, n) for (uint i = gl_GlobalInvocationID.x; i < (n); i += gl_NumWorkGroups.x * 256u)

// Element i of a tensor stored in `dtype` (0 float32, 1 bfloat16, 2 float16: the numbering every
// shader's push constants use), read as or written from float32.
float bf16_to_f32(uint16_t h);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
uint16_t f32_to_f16(float f);
float load_f32(uint64_t address, uint dtype, uint i) {
  if (dtype == 0u) return F32(address).v[i];
  if (dtype == 1u) return bf16_to_f32(U16(address).v[i]);
  return f16_to_f32(U16(address).v[i]);
}
void store_f32(uint64_t address, uint dtype, uint i, float x) {
  if (dtype == 0u) F32(address).v[i] = x;
  else if (dtype == 1u) U16(address).v[i] = f32_to_bf16(x);
  else U16(address).v[i] = f32_to_f16(x);
}

float bf16_to_f32(uint16_t h) { return uintBitsToFloat(uint(h) << 16); }
// Round to nearest even, as the cpu backend converts (NaN stays NaN).
uint16_t f32_to_bf16(float f) {
  uint u = floatBitsToUint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// float16 in integer arithmetic, bit for bit as the cpu backend converts (core/dtype.cpp):
// unpackHalf2x16 / packHalf2x16 may flush float16 subnormals, and these do not.
float f16_to_f32(uint16_t h) {
  const uint x = uint(h), sign = (x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
  if (e == 31u) return uintBitsToFloat(sign | 0x7f800000u | (m << 13));
  if (e != 0u) return uintBitsToFloat(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0u) return uintBitsToFloat(sign);
  const uint top = uint(findMSB(m));  // a subnormal m x 2^-24, normalized
  return uintBitsToFloat(sign | ((top + 103u) << 23) | ((m << (23u - top)) & 0x7fffffu));
}
// Round to nearest even; NaN stays NaN, beyond 65520 is infinity, subnormals are kept.
uint16_t f32_to_f16(float f) {
  const uint x = floatBitsToUint(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (a < 0x38800000u) {  // below 2^-14: a subnormal m x 2^-24, or zero
    const uint e = a >> 23;
    if (e < 102u) return uint16_t(sign);  // below 2^-25
    const uint mant = (a & 0x7fffffu) | 0x800000u, shift = 126u - e, midpoint = 1u << (shift - 1u);
    uint q = mant >> shift;
    const uint rest = mant & ((1u << shift) - 1u);
    if (rest > midpoint || (rest == midpoint && (q & 1u) != 0u)) q += 1u;
    return uint16_t(sign | q);
  }
  return uint16_t(sign | ((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
}

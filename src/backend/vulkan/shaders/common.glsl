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

// A grid-stride loop over n elements for a 1-D dispatch of 256-wide workgroups.
#define FOR_EACH(i, n) for (uint i = gl_GlobalInvocationID.x; i < (n); i += gl_NumWorkGroups.x * 256u)

float bf16_to_f32(uint16_t h) { return uintBitsToFloat(uint(h) << 16); }
// Round to nearest even, as the cpu backend converts (NaN stays NaN).
uint16_t f32_to_bf16(float f) {
  uint u = floatBitsToUint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float f16_to_f32(uint16_t h) { return unpackHalf2x16(uint(h)).x; }
uint16_t f32_to_f16(float f) { return uint16_t(packHalf2x16(vec2(f, 0.0)) & 0xffffu); }

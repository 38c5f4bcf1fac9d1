// numeric.cuh: scalar conversions between float32 and the narrow types freetoken stores (bf16, f16, e4m3), shared
// by the expert kernels and the paged KV cache.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace ft {

// E4M3 (fn) byte -> float through the CUDA headers' converter (0x7F / 0xFF are NaN).
__device__ __forceinline__ float e4m3_to_float(unsigned b) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(b);
  return static_cast<float>(v);
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned b) { return __uint_as_float((b & 0xFFFFu) << 16); }

__device__ __forceinline__ float f16_bits_to_float(unsigned short b) { return __half2float(__ushort_as_half(b)); }

// Round a float to bf16 and back (the precision tensor-core inputs have).
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// float -> bf16 bits, round to nearest even; a NaN stays a (quiet) NaN (the carry of the rounding could make it
// inf). The same bit arithmetic as freetoken.ops.paged_attention.kv_encode on the host.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float v) {
  const unsigned bits = __float_as_uint(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);
  return static_cast<unsigned short>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// float -> IEEE half bits, round to nearest even (overflow: inf).
__device__ __forceinline__ unsigned short float_to_f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

// float -> e4m3fn code, round to nearest even, saturating at +-448 (NaN -> 0x7F).
__device__ __forceinline__ unsigned char float_to_e4m3(float v) {
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace ft

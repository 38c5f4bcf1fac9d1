// mma.cuh: the m16n8k16 bf16 tensor-core product of one warp, with a portable twin.
//
// ft::mma_bf16_16816(c, a, b): c[16 x 8] += a[16 x 16] * b[16 x 8], bf16 inputs, fp32 sums, each of the 32 lanes
// holding its PTX fragment (g = lane / 4, t = lane % 4; a register packs two bf16, the lower column / k first):
//   a[0]: A[g][2t, 2t+1]   a[1]: A[g+8][2t, 2t+1]   a[2]: A[g][2t+8, 2t+9]   a[3]: A[g+8][2t+8, 2t+9]
//   b[0]: B[2t, 2t+1][g]   b[1]: B[2t+8, 2t+9][g]   (so B stored n-major, [n][k], reads as 32-bit pairs)
//   c[0], c[1]: C[g][2t, 2t+1]                        c[2], c[3]: C[g+8][2t, 2t+1]
// On sm_80 and newer this is one mma.sync; elsewhere (older targets, FT_NO_MMA, and the emulator) the warp
// exchanges the fragments by shuffles and each lane sums its four outputs in fp32. Both compute the same
// function of the same registers, so a kernel built on it runs its whole data flow on the emulator.
// Call it from all 32 lanes of a warp with uniform control flow (it is a warp collective either way).
#pragma once

#include "common.cuh"
#include "numeric.cuh"  // cuda_bf16.h

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(FT_NO_MMA)
#define FT_USE_MMA 1
#else
#define FT_USE_MMA 0
#endif

namespace ft {

// Two floats as one register of bf16 (round to nearest even): `lo` in the lower half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

// The portable twin: what every lane computes without the tensor-core instruction. In an NVRTC build (FT_NO_MMA, the
// diagnostic build) it is one call, not inlined: inlined at each unrolled call site of the prefill kernels it made
// that build ~3x slower to compile than the tensor-core one (paged_attention.cu for sm_86: 185 s). The emulator
// inlines it as before.
#if defined(__CUDA_ARCH__)
__device__ __noinline__
#else
__device__ __forceinline__
#endif
void mma_bf16_16816_portable(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float arow[2][16], bcol[2][16];  // rows g, g + 8 of A; columns 2t, 2t + 1 of B; k = 0..15
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // the lanes of quad g hold A's rows g and g + 8; lanes 4n + s hold B's column n
    unsigned ar[4], br[2][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) ar[i] = __shfl_sync(FT_FULL_MASK, a[i], 4 * g + s);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      br[j][0] = __shfl_sync(FT_FULL_MASK, b[0], 4 * (2 * t + j) + s);
      br[j][1] = __shfl_sync(FT_FULL_MASK, b[1], 4 * (2 * t + j) + s);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h: the register's lower / upper bf16
      const int sh = 16 * h;
      arow[0][2 * s + h] = __uint_as_float(((ar[0] >> sh) & 0xFFFFu) << 16);
      arow[1][2 * s + h] = __uint_as_float(((ar[1] >> sh) & 0xFFFFu) << 16);
      arow[0][8 + 2 * s + h] = __uint_as_float(((ar[2] >> sh) & 0xFFFFu) << 16);
      arow[1][8 + 2 * s + h] = __uint_as_float(((ar[3] >> sh) & 0xFFFFu) << 16);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        bcol[j][2 * s + h] = __uint_as_float(((br[j][0] >> sh) & 0xFFFFu) << 16);
        bcol[j][8 + 2 * s + h] = __uint_as_float(((br[j][1] >> sh) & 0xFFFFu) << 16);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) s = fmaf(arow[e >> 1][k], bcol[e & 1][k], s);
    c[e] += s;
  }
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if FT_USE_MMA
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  mma_bf16_16816_portable(c, a, b);
#endif
}

}  // namespace ft

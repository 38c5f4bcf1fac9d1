// common.cuh: small device helpers shared by freetoken's kernels.
#pragma once

// The constants shared with Python (FT_TILE_M, FT_ROWS, FT_CACHE_MAX_PAIRS, ..., struct sizes and offsets) are
// defined once in freetoken/ops/constants.py and reach every compile as -D options; a source never defines them.
#ifndef FT_CONSTANTS
#error "freetoken's FT_* constants are missing: compile through freetoken (import freetoken.ops registers them)"
#endif

// static_assert of a member offset against freetoken/ops/constants.py. g++ (the emu build) checks it with
// __builtin_offsetof; NVRTC has no offsetof, so a GPU build checks the struct sizes alone (the layout of these
// structs of scalars and pointers follows from their declarations; the emu build pins it in CI).
#if defined(__CUDACC_RTC__)
#define FT_CHECK_OFFSET(T, m, off) static_assert((off) >= 0, #T "." #m)
#else
#define FT_CHECK_OFFSET(T, m, off) \
  static_assert(__builtin_offsetof(T, m) == (off), #T "." #m " offset differs from freetoken/ops/constants.py")
#endif

#define FT_FULL_MASK 0xffffffffu

namespace ft {

// +infinity without <math.h> (NVRTC has no INFINITY macro).
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// Sum over the 32 lanes of a full warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FT_FULL_MASK, v, off);
  return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024 threads); every thread gets the total.
// `scratch` is shared memory of at least 32 floats. Contains two __syncthreads: call from all threads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < nwarps ? scratch[lane] : 0.0f;
  total = warp_sum(total);
  __syncthreads();  // scratch may be reused right after
  return total;
}

}  // namespace ft

// common.cuh: small device helpers shared by freetoken's kernels.
#pragma once

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

// topk.cu: top-k of each row, one warp per row, selection by warp shuffles.
//
// Order: larger value first, equal values by lower index; NaN ranks as -inf (never above a real value).
// Each of the k rounds finds the best element strictly after the previous pick in that order, so the row is
// never modified and no scratch memory is needed: O(k * n / 32) per lane, right for routing (n <= 512, k <= 32).
#include "common.cuh"

namespace {

__device__ __forceinline__ float rank_key(float v) { return v != v ? -ft::inf() : v; }

// True when (a, ia) comes before (b, ib) in the selection order.
__device__ __forceinline__ bool before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

}  // namespace

// x [rows, n] float32 -> idx [rows, k] int32, val [rows, k] float32 (the original values, NaN kept).
// Block: a multiple of 32 threads; warp w of block b handles row b * (blockDim.x / 32) + w.
extern "C" __global__ void __launch_bounds__(256) topk_rows_f32(const float* __restrict__ x, int* __restrict__ idx,
                                                                float* __restrict__ val, int rows, int n, int k) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform across the warp
  const float* xr = x + static_cast<long long>(row) * n;
  float prev_key = ft::inf();
  int prev_idx = -1;
  for (int j = 0; j < k; ++j) {
    float best = -ft::inf();
    int best_i = 0x7fffffff;
    for (int c = lane; c < n; c += 32) {
      const float key = rank_key(xr[c]);
      if (before(prev_key, prev_idx, key, c) && before(key, c, best, best_i)) {
        best = key;
        best_i = c;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ob = __shfl_xor_sync(FT_FULL_MASK, best, off);
      const int oi = __shfl_xor_sync(FT_FULL_MASK, best_i, off);
      if (before(ob, oi, best, best_i)) {
        best = ob;
        best_i = oi;
      }
    }
    if (lane == 0) {
      idx[static_cast<long long>(row) * k + j] = best_i;
      val[static_cast<long long>(row) * k + j] = xr[best_i];
    }
    prev_key = best;
    prev_idx = best_i;
  }
}

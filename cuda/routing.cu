// routing.cu: MoE routing of each row of router logits, one warp per row: softmax (max-subtracted), the k largest
// probabilities (largest first, ties to the lower index, NaN ranked as -inf: topk.cu's order), their weights,
// renormalised to sum 1 when asked. A NaN logit makes the row's probabilities NaN (as a NumPy softmax does).
#include "common.cuh"

namespace {

__device__ __forceinline__ bool before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// Max over the warp, NaN winning (so that a NaN row stays NaN).
__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(FT_FULL_MASK, v, off);
    if (o > v || o != o) v = o;
  }
  return v;
}

}  // namespace

// logits [rows, n] float32 -> ids [rows, k] int32, weights [rows, k] float32. Block: FT_ROUTE_WARPS warps; warp w of
// block b routes row b * FT_ROUTE_WARPS + w. The probabilities are recomputed per round (no scratch memory):
// O(k * n / 32) per lane, right for routing (n <= 512, k <= 32).
extern "C" __global__ void __launch_bounds__(FT_ROUTE_WARPS * 32) route_softmax_topk_f32(
    const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights, int rows, int n, int k,
    int renormalize) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * FT_ROUTE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform across the warp
  const float* xr = logits + static_cast<long long>(row) * n;
  float m = -ft::inf();
  for (int c = lane; c < n; c += 32) {
    const float v = xr[c];
    if (v > m || v != v) m = v;
  }
  m = warp_max_nan(m);
  float total = 0.0f;
  for (int c = lane; c < n; c += 32) total += expf(xr[c] - m);
  total = ft::warp_sum(total);
  const float inv = 1.0f / total;
  float prev = ft::inf();
  int prev_i = -1;
  float sel = 0.0f;
  int* idr = ids + static_cast<long long>(row) * k;
  float* wr = weights + static_cast<long long>(row) * k;
  for (int j = 0; j < k; ++j) {
    float best = -ft::inf(), best_p = 0.0f;
    int best_i = 0x7fffffff;
    for (int c = lane; c < n; c += 32) {
      const float p = expf(xr[c] - m) * inv;
      const float key = p != p ? -ft::inf() : p;
      if (before(prev, prev_i, key, c) && before(key, c, best, best_i)) {
        best = key;
        best_i = c;
        best_p = p;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ob = __shfl_xor_sync(FT_FULL_MASK, best, off);
      const int oi = __shfl_xor_sync(FT_FULL_MASK, best_i, off);
      const float op = __shfl_xor_sync(FT_FULL_MASK, best_p, off);
      if (before(ob, oi, best, best_i)) {
        best = ob;
        best_i = oi;
        best_p = op;
      }
    }
    if (lane == 0) {
      idr[j] = best_i;
      wr[j] = best_p;
    }
    sel += best_p;
    prev = best;
    prev_i = best_i;
  }
  if (renormalize && lane == 0) {
    for (int j = 0; j < k; ++j) wr[j] = wr[j] / sel;
  }
}

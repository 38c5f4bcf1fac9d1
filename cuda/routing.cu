// routing.cu: MoE routing of each row of router logits, one warp per row.
// route_softmax_topk_f32: softmax (max-subtracted), the k largest probabilities (largest first, ties to the lower
// index, NaN ranked as -inf: topk.cu's order), their weights, renormalised to sum 1 when asked. A NaN logit makes
// the row's probabilities NaN (as a NumPy softmax does).
// route_sigmoid_group_topk_f32: DeepSeek-V3's sigmoid scores with a selection bias and group-limited top-k (below).
// route_softmax_group_topk_f32: DeepSeek-V2's softmax with group-limited (or plain) greedy top-k (below).
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

// A row's softmax as p = expf(x - m) * inv: its max m (NaN winning, so that a NaN row stays NaN) and the inverse of
// the sum of expf(x - m) over the row, on every lane.
__device__ __forceinline__ void softmax_stats(const float* __restrict__ xr, int n, int lane, float& m, float& inv) {
  m = -ft::inf();
  for (int c = lane; c < n; c += 32) {
    const float v = xr[c];
    if (v > m || v != v) m = v;
  }
  m = warp_max_nan(m);
  float total = 0.0f;
  for (int c = lane; c < n; c += 32) total += expf(xr[c] - m);
  inv = 1.0f / ft::warp_sum(total);
}

// The warp's best (key, index) pair in topk.cu's order, with the value chosen alongside it: every lane ends with it.
__device__ __forceinline__ void warp_best(float& best, int& best_i, float& value) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_xor_sync(FT_FULL_MASK, best, off);
    const int oi = __shfl_xor_sync(FT_FULL_MASK, best_i, off);
    const float ov = __shfl_xor_sync(FT_FULL_MASK, value, off);
    if (before(ob, oi, best, best_i)) {
      best = ob;
      best_i = oi;
      value = ov;
    }
  }
}

// The topk_group best groups as a bit mask (lane g < n_group holds group g's score; ties to the lower group).
__device__ __forceinline__ unsigned choose_groups(float group_score, int lane, int n_group, int topk_group) {
  unsigned chosen = 0u;
  for (int j = 0; j < topk_group; ++j) {
    const bool open = lane < n_group && !((chosen >> lane) & 1u);
    float best = open ? group_score : -ft::inf(), unused = 0.0f;
    int best_g = open ? lane : 0x7fffffff;
    warp_best(best, best_g, unused);
    chosen |= 1u << best_g;
  }
  return chosen;
}

// The k largest keys of a row, largest first (ties to the lower index), into idr and the value beside each into wr
// (lane 0 writes); returns the sum of the k values on every lane. key_value(c, key, value) gives expert c's key
// (never NaN: -inf instead) and value. Keys are recomputed per round (no scratch memory): O(k * n / 32) per lane,
// right for routing (n <= 512, k <= 32).
template <class KeyValue>
__device__ __forceinline__ float select_topk(int n, int k, int lane, int* __restrict__ idr, float* __restrict__ wr,
                                             KeyValue key_value) {
  float prev = ft::inf();
  int prev_i = -1;
  float sel = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best = -ft::inf(), best_v = 0.0f;
    int best_i = 0x7fffffff;
    for (int c = lane; c < n; c += 32) {
      float key, value;
      key_value(c, key, value);
      if (before(prev, prev_i, key, c) && before(key, c, best, best_i)) {
        best = key;
        best_i = c;
        best_v = value;
      }
    }
    warp_best(best, best_i, best_v);
    if (lane == 0) {
      idr[j] = best_i;
      wr[j] = best_v;
    }
    sel += best_v;
    prev = best;
    prev_i = best_i;
  }
  return sel;
}

}  // namespace

// logits [rows, n] float32 -> ids [rows, k] int32, weights [rows, k] float32. Block: FT_ROUTE_WARPS warps; warp w of
// block b routes row b * FT_ROUTE_WARPS + w.
extern "C" __global__ void __launch_bounds__(FT_ROUTE_WARPS * 32) route_softmax_topk_f32(
    const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights, int rows, int n, int k,
    int renormalize) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * FT_ROUTE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform across the warp
  const float* xr = logits + static_cast<long long>(row) * n;
  float m, inv;
  softmax_stats(xr, n, lane, m, inv);
  int* idr = ids + static_cast<long long>(row) * k;
  float* wr = weights + static_cast<long long>(row) * k;
  const float sel = select_topk(n, k, lane, idr, wr, [&](int c, float& key, float& value) {
    value = expf(xr[c] - m) * inv;
    key = value != value ? -ft::inf() : value;
  });
  if (renormalize && lane == 0) {
    for (int j = 0; j < k; ++j) wr[j] = wr[j] / sel;
  }
}

// DeepSeek-V3 / GLM-4.5 routing, one warp per row. Scores s = sigmoid(logit); selection keys c = s + bias (the
// checkpoint's e_score_correction_bias: it steers which experts are chosen, never their weights). The experts fall
// into n_group equal groups; a group's score is the sum of its two largest keys; the topk_group best groups stay in
// play and the k largest keys among their experts are chosen (largest first, ties to the lower index, NaN ranked as
// -inf, at every step). Weights are the chosen experts' scores s, divided by (their sum + 1e-20) when renormalize,
// then times `scale` (routed_scaling_factor). n_group <= 32 (lane g holds group g's score), n % n_group == 0,
// n / n_group >= 2, topk_group <= n_group: the launcher checks.
namespace {

__device__ __forceinline__ float sigmoid_score(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float choice_key(float x, float b) {
  const float c = sigmoid_score(x) + b;
  return c != c ? -ft::inf() : c;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FT_ROUTE_WARPS * 32) route_sigmoid_group_topk_f32(
    const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ ids,
    float* __restrict__ weights, int rows, int n, int k, int n_group, int topk_group, int renormalize, float scale) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * FT_ROUTE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform across the warp
  const float* xr = logits + static_cast<long long>(row) * n;
  const int gsize = n / n_group;
  // group scores: lane g ends with group g's
  float group_score = -ft::inf();
  for (int g = 0; g < n_group; ++g) {
    float a = -ft::inf(), b = -ft::inf();  // this lane's two largest keys of the group
    for (int c = g * gsize + lane; c < (g + 1) * gsize; c += 32) {
      const float v = choice_key(xr[c], bias[c]);
      if (v > a) {
        b = a;
        a = v;
      } else if (v > b) {
        b = v;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float oa = __shfl_xor_sync(FT_FULL_MASK, a, off);
      const float ob = __shfl_xor_sync(FT_FULL_MASK, b, off);
      const float hi = fmaxf(a, oa);
      b = fmaxf(fminf(a, oa), fmaxf(b, ob));
      a = hi;
    }
    if (lane == g) group_score = a + b;
  }
  const unsigned chosen = choose_groups(group_score, lane, n_group, topk_group);  // the best groups
  // the k largest keys among the chosen groups' experts (the others ranked as -inf), their scores as values
  int* idr = ids + static_cast<long long>(row) * k;
  float* wr = weights + static_cast<long long>(row) * k;
  const float sel = select_topk(n, k, lane, idr, wr, [&](int c, float& key, float& value) {
    value = sigmoid_score(xr[c]);
    key = ((chosen >> (c / gsize)) & 1u) ? choice_key(xr[c], bias[c]) : -ft::inf();
  });
  if (lane == 0) {
    const float denom = renormalize ? sel + 1e-20f : 1.0f;
    for (int j = 0; j < k; ++j) wr[j] = (renormalize ? wr[j] / denom : wr[j]) * scale;
  }
}

// DeepSeek-V2's routing, one warp per row: softmax probabilities p (max-subtracted, as route_softmax_topk_f32); the
// experts fall into n_group equal groups, a group scored by its largest p ("group_limited_greedy"; one group:
// "greedy"); the topk_group best groups stay in play and the k largest p among their experts are chosen (largest
// first, ties to the lower index, NaN ranked as -inf at every step); weights are their p, divided by their sum when
// renormalize, then times `scale` (routed_scaling_factor). n_group <= 32 (lane g holds group g's score),
// n % n_group == 0, topk_group <= n_group: the launcher checks.
extern "C" __global__ void __launch_bounds__(FT_ROUTE_WARPS * 32) route_softmax_group_topk_f32(
    const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights, int rows, int n, int k,
    int n_group, int topk_group, int renormalize, float scale) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * FT_ROUTE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform across the warp
  const float* xr = logits + static_cast<long long>(row) * n;
  float m, inv;
  softmax_stats(xr, n, lane, m, inv);
  const int gsize = n / n_group;
  float group_score = -ft::inf();  // lane g ends with group g's largest p
  for (int g = 0; g < n_group; ++g) {
    float a = -ft::inf();
    for (int c = g * gsize + lane; c < (g + 1) * gsize; c += 32) {
      const float p = expf(xr[c] - m) * inv;
      if (p > a) a = p;  // a NaN p never wins: ranked as -inf
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(FT_FULL_MASK, a, off));
    if (lane == g) group_score = a;
  }
  const unsigned chosen = choose_groups(group_score, lane, n_group, topk_group);  // the best groups
  int* idr = ids + static_cast<long long>(row) * k;
  float* wr = weights + static_cast<long long>(row) * k;
  const float sel = select_topk(n, k, lane, idr, wr, [&](int c, float& key, float& value) {
    value = expf(xr[c] - m) * inv;
    key = (((chosen >> (c / gsize)) & 1u) && value == value) ? value : -ft::inf();
  });
  if (lane == 0) {
    for (int j = 0; j < k; ++j) wr[j] = (renormalize ? wr[j] / sel : wr[j]) * scale;
  }
}

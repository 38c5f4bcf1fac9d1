// moe_plan.cu: group (token, k) pairs by expert slot for the routed-expert kernels, and merge their outputs.
//
// A counting sort in fixed-size buffers (graph-capturable, no host synchronisation):
//   moe_plan_count   counts[slot] += 1 for every pair          (counts zeroed by the caller; FT_NO_ROUTE pairs skipped)
//   moe_plan_scan    one block: offsets per slot, the unique slots in increasing order, prefill tiles
//   moe_plan_scatter pair_list[offset[slot] + cursor[slot]++] = pair
// The order of pairs within one slot depends on timing, but every pair's output is computed alone and written
// to its own row, so results do not. moe_combine sums each token's k outputs in j order (deterministic).
#include "common.cuh"

extern "C" __global__ void moe_plan_count(const int* __restrict__ ids, int pairs, int slots, int* __restrict__ counts,
                                          int* __restrict__ bad_id) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= pairs) return;
  const int s = ids[p];
  if (s >= 0 && s < slots) {
    atomicAdd(&counts[s], 1);
  } else if (s != FT_NO_ROUTE) {
    atomicMax(bad_id, p + 1);  // 1 + the largest offending pair; 0 when all ids are valid
  }
}

// One block of up to 1024 threads (a multiple of 32). Each thread owns a contiguous range of slots.
extern "C" __global__ void __launch_bounds__(1024) moe_plan_scan(
    const int* __restrict__ counts, int slots, int tile_m, int* __restrict__ slot_off, int* __restrict__ cursor,
    int* __restrict__ n_unique, int* __restrict__ unique_slot, int* __restrict__ unique_off, int* __restrict__ n_tiles,
    int* __restrict__ tile_unique, int* __restrict__ tile_start) {
  __shared__ int sums[3][1024];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int per = (slots + nt - 1) / nt;
  const int lo = min(slots, tid * per), hi = min(slots, lo + per);
  int pairs = 0, uniq = 0, tiles = 0;
  for (int s = lo; s < hi; ++s) {
    const int c = counts[s];
    pairs += c;
    uniq += c > 0;
    tiles += (c + tile_m - 1) / tile_m;
  }
  sums[0][tid] = pairs;
  sums[1][tid] = uniq;
  sums[2][tid] = tiles;
  __syncthreads();
  // Inclusive Hillis-Steele scan over the per-thread sums (1024 entries at most: 10 rounds).
  for (int off = 1; off < nt; off <<= 1) {
    int a = 0, b = 0, c = 0;
    if (tid >= off) {
      a = sums[0][tid - off];
      b = sums[1][tid - off];
      c = sums[2][tid - off];
    }
    __syncthreads();
    sums[0][tid] += a;
    sums[1][tid] += b;
    sums[2][tid] += c;
    __syncthreads();
  }
  int pair_at = sums[0][tid] - pairs, uniq_at = sums[1][tid] - uniq, tile_at = sums[2][tid] - tiles;
  for (int s = lo; s < hi; ++s) {
    const int c = counts[s];
    slot_off[s] = pair_at;
    cursor[s] = 0;
    if (c > 0) {
      unique_slot[uniq_at] = s;
      unique_off[uniq_at] = pair_at;
      for (int t = 0; t * tile_m < c; ++t) {
        tile_unique[tile_at] = uniq_at;
        tile_start[tile_at] = t * tile_m;
        ++tile_at;
      }
      ++uniq_at;
    }
    pair_at += c;
  }
  if (tid == nt - 1) {
    *n_unique = sums[1][tid];
    unique_off[sums[1][tid]] = sums[0][tid];
    *n_tiles = sums[2][tid];
  }
}

extern "C" __global__ void moe_plan_scatter(const int* __restrict__ ids, int pairs, int slots,
                                            const int* __restrict__ slot_off, int* __restrict__ cursor,
                                            int* __restrict__ pair_list) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= pairs) return;
  const int s = ids[p];
  if (s < 0 || s >= slots) return;
  pair_list[slot_off[s] + atomicAdd(&cursor[s], 1)] = p;
}

// y[t, c] = sum_j weights[t, j] * o[(t * k + j), c], j in order; pairs with an invalid id (FT_NO_ROUTE: routed to
// another format's experts) contribute nothing.
extern "C" __global__ void moe_combine(const float* __restrict__ o, const int* __restrict__ ids,
                                       const float* __restrict__ weights, int tokens, int k, int hidden, int slots,
                                       float* __restrict__ y) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * hidden) return;
  const int t = static_cast<int>(i / hidden), c = static_cast<int>(i % hidden);
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int p = t * k + j;
    const int s = ids[p];
    if (s >= 0 && s < slots) acc += weights[p] * o[static_cast<long long>(p) * hidden + c];
  }
  y[i] = acc;
}

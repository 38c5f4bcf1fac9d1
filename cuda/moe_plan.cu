// moe_plan.cu: group (token, k) pairs by expert slot for the routed-expert kernels, and merge their outputs.
//
// A counting sort in fixed-size buffers (graph-capturable, no host synchronisation):
//   moe_plan_count   counts[slot] += 1 for every pair          (counts zeroed by the caller; FT_NO_ROUTE pairs skipped)
//   moe_plan_scan    one block: offsets per slot, the unique slots in increasing order, prefill tiles
//   moe_plan_scatter pair_list[offset[slot] + cursor[slot]++] = pair
//   moe_plan_block   all three (and the zeroing of counts) in one block: one launch instead of four for the few
//                    pairs of a decode step (freetoken.ops.moe_experts.PLAN_BLOCK_MAX_PAIRS), the same outputs
// The order of pairs within one slot depends on timing, but every pair's output is computed alone and written
// to its own row, so results do not. moe_combine sums each token's k outputs in j order (deterministic).
#include "common.cuh"

namespace {

__device__ __forceinline__ void count_pair(const int* __restrict__ ids, int p, int slots, int* __restrict__ counts,
                                           int* __restrict__ bad_id) {
  const int s = ids[p];
  if (s >= 0 && s < slots) {
    atomicAdd(&counts[s], 1);
  } else if (s != FT_NO_ROUTE) {
    atomicMax(bad_id, p + 1);  // 1 + the largest offending pair; 0 when all ids are valid
  }
}

__device__ __forceinline__ void scatter_pair(const int* __restrict__ ids, int p, int slots,
                                             const int* __restrict__ slot_off, int* __restrict__ cursor,
                                             int* __restrict__ pair_list) {
  const int s = ids[p];
  if (s < 0 || s >= slots) return;
  pair_list[slot_off[s] + atomicAdd(&cursor[s], 1)] = p;
}

// The scan of one block of up to 1024 threads (a multiple of 32), each owning a contiguous range of slots; ``sums``
// is the block's shared [3][1024] scratch. Ends with every thread's writes done (the caller syncs before reading).
__device__ void scan_counts(int (*sums)[1024], const int* __restrict__ counts, int slots, int tile_m,
                            int* __restrict__ slot_off, int* __restrict__ cursor, int* __restrict__ n_unique,
                            int* __restrict__ unique_slot, int* __restrict__ unique_off, int* __restrict__ n_tiles,
                            int* __restrict__ tile_unique, int* __restrict__ tile_start) {
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

}  // namespace

extern "C" __global__ void moe_plan_count(const int* __restrict__ ids, int pairs, int slots, int* __restrict__ counts,
                                          int* __restrict__ bad_id) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < pairs) count_pair(ids, p, slots, counts, bad_id);
}

// One block of up to 1024 threads (a multiple of 32). Each thread owns a contiguous range of slots.
extern "C" __global__ void __launch_bounds__(1024) moe_plan_scan(
    const int* __restrict__ counts, int slots, int tile_m, int* __restrict__ slot_off, int* __restrict__ cursor,
    int* __restrict__ n_unique, int* __restrict__ unique_slot, int* __restrict__ unique_off, int* __restrict__ n_tiles,
    int* __restrict__ tile_unique, int* __restrict__ tile_start) {
  __shared__ int sums[3][1024];
  scan_counts(sums, counts, slots, tile_m, slot_off, cursor, n_unique, unique_slot, unique_off, n_tiles, tile_unique,
              tile_start);
}

extern "C" __global__ void moe_plan_scatter(const int* __restrict__ ids, int pairs, int slots,
                                            const int* __restrict__ slot_off, int* __restrict__ cursor,
                                            int* __restrict__ pair_list) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < pairs) scatter_pair(ids, p, slots, slot_off, cursor, pair_list);
}

// count, scan and scatter in one block (the launch shape of moe_plan_scan), counts and bad_id zeroed here first.
extern "C" __global__ void __launch_bounds__(1024) moe_plan_block(
    const int* __restrict__ ids, int pairs, int slots, int tile_m, int* __restrict__ counts, int* __restrict__ bad_id,
    int* __restrict__ slot_off, int* __restrict__ cursor, int* __restrict__ n_unique, int* __restrict__ unique_slot,
    int* __restrict__ unique_off, int* __restrict__ n_tiles, int* __restrict__ tile_unique,
    int* __restrict__ tile_start, int* __restrict__ pair_list) {
  __shared__ int sums[3][1024];
  for (int s = threadIdx.x; s < slots; s += blockDim.x) counts[s] = 0;
  if (threadIdx.x == 0) *bad_id = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) count_pair(ids, p, slots, counts, bad_id);
  __syncthreads();
  scan_counts(sums, counts, slots, tile_m, slot_off, cursor, n_unique, unique_slot, unique_off, n_tiles, tile_unique,
              tile_start);
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) scatter_pair(ids, p, slots, slot_off, cursor, pair_list);
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

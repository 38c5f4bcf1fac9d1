// cache.cu: the global expert cache on the device (see DESIGN.md, "The expert cache contract").
//
// Maps: slot_for_id[f] (f = layer * E + expert) is the slot holding f or -1; id_of_slot[s] its inverse.
// recency[s] is the admission clock of the slot's last use (-1: empty). Everything runs in fixed-size buffers
// with device-side counts, so a decode step needs no host synchronisation and can be captured in a graph.
//
//   cache_admit        one block: unique active ids, hits, LRU victims, map update, copy worklist, rewrite
//   cache_copy         pull every bank row of each worklist record from (mapped pinned) host memory
//   cache_borrow_layer prefill: invalidate a double buffer's previous owners, list the layer's records to copy
#include "common.cuh"


namespace {

struct Argmin {
  long long key;  // recency (+inf: not a candidate)
  int slot;
};

__device__ __forceinline__ bool less(const Argmin& a, const Argmin& b) {
  return a.key < b.key || (a.key == b.key && a.slot < b.slot);
}

__device__ __forceinline__ Argmin warp_argmin(Argmin v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Argmin o;
    o.key = __shfl_xor_sync(FT_FULL_MASK, v.key, off);
    o.slot = __shfl_xor_sync(FT_FULL_MASK, v.slot, off);
    if (less(o, v)) v = o;
  }
  return v;
}

}  // namespace

// The LRU admission of one layer's routed ids, in one block of up to 1024 threads (a multiple of 32).
//
// ids [pairs] (expert indices of the layer) are rewritten in place to slot ids. Semantics (the trace simulator's
// `lru` policy, cpu_kernels/cache.py and freetoken/testing/reference/cache.py implement the same): the clock advances once per call; hits
// refresh their slot's recency; then the misses, in increasing flat-id order, each take the slot with the lowest
// recency that is not pinned and holds no id active in this call (recency == clock marks those), ties to the
// lowest slot; the victim's old owner loses its mapping. worklist[2 * i] = slot, [2 * i + 1] = source flat id.
// A pair whose id is FT_NO_ROUTE is left out (slot FT_NO_ROUTE, no error).
// err: 1 an id out of [0, E) (its pair gets slot -1), 2 no victim left (too few slots). count = 0 leaves the
// per-layer hit/miss counters alone (prefetch admissions).
extern "C" __global__ void __launch_bounds__(1024) cache_admit(
    int* __restrict__ ids, int pairs, int layer, int experts, int* __restrict__ slot_for_id,
    int* __restrict__ id_of_slot, long long* __restrict__ recency, const unsigned char* __restrict__ pinned,
    int slots, long long* __restrict__ clock, int* __restrict__ worklist, int* __restrict__ n_work,
    long long* __restrict__ hits, long long* __restrict__ misses, int* __restrict__ err, int count) {
  __shared__ int flat[FT_CACHE_MAX_PAIRS];
  __shared__ int lead[FT_CACHE_MAX_PAIRS];
  __shared__ int active[FT_CACHE_MAX_PAIRS];
  __shared__ int is_hit[FT_CACHE_MAX_PAIRS];
  __shared__ Argmin warp_best[32];
  __shared__ long long now;
  __shared__ int n_active, n_miss_done;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;

  if (tid == 0) {
    now = ++clock[0];
    n_active = 0;
    n_miss_done = 0;
  }
  for (int p = tid; p < pairs; p += nt) {
    const int e = ids[p];
    if (e == FT_NO_ROUTE) {
      flat[p] = -1;  // a pair routed elsewhere (another format's experts): no admission, slot FT_NO_ROUTE
    } else if (e < 0 || e >= experts) {
      atomicMax(err, FT_CACHE_ERR_ID_RANGE);
      flat[p] = -1;
    } else {
      flat[p] = layer * experts + e;
    }
  }
  __syncthreads();
  // Unique active ids: a pair leads if no earlier pair has its id; leaders are ranked by id.
  for (int p = tid; p < pairs; p += nt) {
    int l = flat[p] >= 0;
    for (int q = 0; q < p && l; ++q) l = flat[q] != flat[p];
    lead[p] = l;
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += nt) {
    if (!lead[p]) continue;
    int rank = 0;
    for (int q = 0; q < pairs; ++q) rank += lead[q] && flat[q] < flat[p];
    active[rank] = flat[p];
    atomicAdd(&n_active, 1);
  }
  __syncthreads();
  const int na = n_active;
  // Hits refresh their recency (and so become ineligible as victims for the rest of this call).
  for (int u = tid; u < na; u += nt) {
    const int s = slot_for_id[active[u]];
    is_hit[u] = s >= 0;
    if (s >= 0) recency[s] = now;
  }
  __syncthreads();
  // Misses, in increasing id order: each takes the least recent eligible slot.
  int n_miss = 0;
  for (int u = 0; u < na; ++u) {
    if (is_hit[u]) continue;  // uniform: shared flag
    Argmin best = {0x7fffffffffffffffLL, 0x7fffffff};
    for (int s = tid; s < slots; s += nt) {
      const long long r = recency[s];
      const Argmin c = {(pinned[s] || r == now) ? 0x7fffffffffffffffLL : r, s};
      if (less(c, best)) best = c;
    }
    best = warp_argmin(best);
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (warp == 0) {
      Argmin b = lane < (nt >> 5) ? warp_best[lane] : Argmin{0x7fffffffffffffffLL, 0x7fffffff};
      b = warp_argmin(b);
      if (lane == 0) {
        if (b.key == 0x7fffffffffffffffLL) {
          atomicMax(err, FT_CACHE_ERR_NO_VICTIM);
        } else {
          const int v = b.slot, f = active[u];
          const int old = id_of_slot[v];
          if (old >= 0) slot_for_id[old] = -1;
          id_of_slot[v] = f;
          slot_for_id[f] = v;
          recency[v] = now;
          worklist[2 * n_miss_done] = v;
          worklist[2 * n_miss_done + 1] = f;
          ++n_miss_done;
        }
      }
    }
    ++n_miss;
    __syncthreads();
  }
  for (int p = tid; p < pairs; p += nt) ids[p] = flat[p] >= 0 ? slot_for_id[flat[p]] : FT_NO_ROUTE;
  if (tid == 0) {
    *n_work = n_miss_done;
    if (count) {  // 0 for a prefetch: its admissions are not the layer's hits and misses
      hits[layer] += na - n_miss;
      misses[layer] += n_miss;
    }
  }
}

// Source and destination of every bank: record r (a flat id) of bank b lives at src[b] + (r - first) * bytes[b]
// (host pool: the rows of one layer, or of all layers from flat id `first` on) and goes to
// dst[b] + slot * dst_stride[b] (slot banks: rows of the record's bank size, or longer when the slots are sized for
// the largest of several layer layouts).
struct BankTable {
  unsigned long long src[FT_CACHE_MAX_BANKS];
  unsigned long long dst[FT_CACHE_MAX_BANKS];
  unsigned long long bytes[FT_CACHE_MAX_BANKS];
  unsigned long long dst_stride[FT_CACHE_MAX_BANKS];
  long long first;
  int n;
};
// The layout freetoken/ops/constants.py BANK_TABLE packs.
static_assert(sizeof(BankTable) == FT_BANK_TABLE_SIZE, "BankTable size differs from constants.BANK_TABLE");
FT_CHECK_OFFSET(BankTable, src, FT_BANK_TABLE_SRC_OFFSET);
FT_CHECK_OFFSET(BankTable, dst, FT_BANK_TABLE_DST_OFFSET);
FT_CHECK_OFFSET(BankTable, bytes, FT_BANK_TABLE_BYTES_OFFSET);
FT_CHECK_OFFSET(BankTable, dst_stride, FT_BANK_TABLE_DST_STRIDE_OFFSET);
FT_CHECK_OFFSET(BankTable, first, FT_BANK_TABLE_FIRST_OFFSET);
FT_CHECK_OFFSET(BankTable, n, FT_BANK_TABLE_N_OFFSET);

// Grid (max work items, banks): block (i, b) copies bank b of worklist entry i; 16-byte accesses when the row
// and both addresses allow it (every bank of realistic shapes), else 4-byte or byte accesses.
extern "C" __global__ void cache_copy(const int* __restrict__ worklist, const int* __restrict__ n_work, BankTable t) {
  const int i = blockIdx.x, b = blockIdx.y;
  if (i >= *n_work || b >= t.n) return;
  const unsigned long long bytes = t.bytes[b];
  const unsigned char* src = reinterpret_cast<const unsigned char*>(t.src[b]) + bytes * (worklist[2 * i + 1] - t.first);
  unsigned char* dst = reinterpret_cast<unsigned char*>(t.dst[b]) + t.dst_stride[b] * worklist[2 * i];
  const unsigned long long align = reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst) | bytes;
  if ((align & 15) == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (unsigned long long j = threadIdx.x; j < bytes / 16; j += blockDim.x) d4[j] = s4[j];
  } else if ((align & 3) == 0) {
    const unsigned* s1 = reinterpret_cast<const unsigned*>(src);
    unsigned* d1 = reinterpret_cast<unsigned*>(dst);
    for (unsigned long long j = threadIdx.x; j < bytes / 4; j += blockDim.x) d1[j] = s1[j];
  } else {
    for (unsigned long long j = threadIdx.x; j < bytes; j += blockDim.x) dst[j] = src[j];
  }
}

// Prefill borrows slots [first, first + experts) for layer `layer`: their owners lose their mapping and recency
// (a later decode of those ids misses and reloads from the host pool), the slots stay unregistered (prefill
// addresses them directly), and the worklist lists the layer's records for cache_copy.
extern "C" __global__ void cache_borrow_layer(int layer, int first, int experts, int* __restrict__ slot_for_id,
                                              int* __restrict__ id_of_slot, long long* __restrict__ recency,
                                              int* __restrict__ worklist, int* __restrict__ n_work) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e == 0) *n_work = experts;
  if (e >= experts) return;
  const int s = first + e;
  const int old = id_of_slot[s];
  if (old >= 0) slot_for_id[old] = -1;
  id_of_slot[s] = -1;
  recency[s] = -1;
  worklist[2 * e] = s;
  worklist[2 * e + 1] = layer * experts + e;
}

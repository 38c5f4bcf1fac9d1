// cache.cu: the global expert cache on the device (see docs/design.md, "The expert cache contract").
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

// The start of both admissions, called by every thread of the block: the call's pairs as flat ids (flat[p]; -1 for
// FT_NO_ROUTE, a pair routed to another format's experts, and for an id out of [0, experts), which sets err) and its
// distinct flat ids in increasing order (active[0 .. returned count)): a pair leads if no earlier pair has its id,
// leaders are ranked by id. *n_active (shared) must be 0 before the call's first barrier (the caller's thread 0).
__device__ __forceinline__ int active_ids(const int* __restrict__ ids, int pairs, int layer, int experts, int* flat,
                                          int* lead, int* active, int* n_active, int* __restrict__ err) {
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int p = tid; p < pairs; p += nt) {
    const int e = ids[p];
    if (e == FT_NO_ROUTE) {
      flat[p] = -1;
    } else if (e < 0 || e >= experts) {
      atomicMax(err, FT_CACHE_ERR_ID_RANGE);
      flat[p] = -1;
    } else {
      flat[p] = layer * experts + e;
    }
  }
  __syncthreads();
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
    atomicAdd(n_active, 1);
  }
  __syncthreads();
  return *n_active;
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
  const int na = active_ids(ids, pairs, layer, experts, flat, lead, active, &n_active, err);
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

// ---- the scored (next_use) admission: the simulator's `default` policy on the device ----------------------------
//
// The rules are freetoken/policy/next_use.py's (its module docstring), on the state of freetoken/policy/scored.py:
// per flat id last (int64 layer clock of its last access, 0: never), c1, c2, c3, c4 (doubles); per layer lclock;
// per slot id_of_slot, stamp (the call clock of its last hit or admission), pinned; glob [3] (decayed continuations,
// re-accesses, average loads per call). Every double operation is an explicit round-to-nearest intrinsic, in the order
// the docstring writes it, so no multiply-add is fused and the device keys equal the reference's bit for bit.
namespace {

struct ScoredArgmin {
  double key;  // keep key (-inf: an empty slot; +inf: not a candidate)
  int slot;
};

__device__ __forceinline__ bool less(const ScoredArgmin& a, const ScoredArgmin& b) {
  return a.key < b.key || (a.key == b.key && a.slot < b.slot);
}

__device__ __forceinline__ ScoredArgmin warp_argmin(ScoredArgmin v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ScoredArgmin o;
    o.key = __shfl_xor_sync(FT_FULL_MASK, v.key, off);
    o.slot = __shfl_xor_sync(FT_FULL_MASK, v.slot, off);
    if (less(o, v)) v = o;
  }
  return v;
}

// The constants of one scored cache (fixed per cache: passed by value, so a captured graph keeps them).
// (The layout freetoken/device/constants.py SCORED_CONSTS packs.)
struct ScoredConsts {
  double q, q2, rho, kappa, id_decay, global_decay, load_weight, long_weight;
  double prior_weight, prior_keep, long_prior_keep;  // the prefill prior (cache_scored_prefill)
  long long dp_last, dp2_last;  // the decay tables' last indices (an index past them is clamped)
  int layers, bypass, cycle;
};
static_assert(sizeof(ScoredConsts) == FT_SCORED_CONSTS_SIZE, "ScoredConsts size differs from constants.SCORED_CONSTS");
FT_CHECK_OFFSET(ScoredConsts, q, FT_SCORED_CONSTS_Q_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, q2, FT_SCORED_CONSTS_Q2_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, rho, FT_SCORED_CONSTS_RHO_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, kappa, FT_SCORED_CONSTS_KAPPA_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, id_decay, FT_SCORED_CONSTS_ID_DECAY_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, global_decay, FT_SCORED_CONSTS_GLOBAL_DECAY_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, load_weight, FT_SCORED_CONSTS_LOAD_WEIGHT_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, long_weight, FT_SCORED_CONSTS_LONG_WEIGHT_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, prior_weight, FT_SCORED_CONSTS_PRIOR_WEIGHT_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, prior_keep, FT_SCORED_CONSTS_PRIOR_KEEP_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, long_prior_keep, FT_SCORED_CONSTS_LONG_PRIOR_KEEP_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, dp_last, FT_SCORED_CONSTS_DP_LAST_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, dp2_last, FT_SCORED_CONSTS_DP2_LAST_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, layers, FT_SCORED_CONSTS_LAYERS_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, bypass, FT_SCORED_CONSTS_BYPASS_OFFSET);
FT_CHECK_OFFSET(ScoredConsts, cycle, FT_SCORED_CONSTS_CYCLE_OFFSET);

__device__ __forceinline__ double dinf() { return __longlong_as_double(0x7ff0000000000000LL); }

// next_use's keep key of flat id o (of layer lo) for a call of layer c at the current clocks.
__device__ __forceinline__ double scored_key(int o, int lo, int c, const long long* last, const double* c1,
                                             const double* c2, const double* c3, const double* c4, const double* dp,
                                             const double* dp2, const long long* lclock, const ScoredConsts& k,
                                             double pbar, double itau) {
  const long long a = lclock[lo] - last[o];
  const double t = __dmul_rn(c1[o], dp[a < k.dp_last ? a : k.dp_last]);
  double r = __dmul_rn(k.q, t);
  if (k.long_weight != 0.0) {
    const double t2 = __dmul_rn(c4[o], dp2[a < k.dp2_last ? a : k.dp2_last]);
    r = __dadd_rn(__dmul_rn(__dsub_rn(1.0, k.long_weight), r), __dmul_rn(k.long_weight, __dmul_rn(k.q2, t2)));
  }
  const double w = __ddiv_rn(1.0, __dadd_rn(r, itau));
  const int d = k.cycle ? (lo - c - 1 + k.layers) % k.layers + 1 : k.layers;
  const double L = static_cast<double>(k.layers);
  if (a == 0) {
    const double p = __ddiv_rn(__dadd_rn(c2[o], __dmul_rn(k.kappa, pbar)), __dadd_rn(c3[o], k.kappa));
    double x = __dsub_rn(1.0, p);
    x = __dmul_rn(x, L);
    x = __dmul_rn(x, w);
    x = __dadd_rn(x, static_cast<double>(d));
    return __dsub_rn(FT_SCORED_PROTECT, x);
  }
  double x = __dsub_rn(w, 1.0);
  x = __dmul_rn(L, x);
  x = __dadd_rn(x, static_cast<double>(d));
  return -x;
}

}  // namespace

// The scored (next_use) admission of one layer's routed ids, in one block of up to 1024 threads (a multiple of 32).
//
// As cache_admit (ids rewritten in place to slots, FT_NO_ROUTE pairs left out, the worklist of (slot, flat id), the
// error codes, count), with the policy of freetoken/policy/scored.py's scored_admit (KIND_NEXT_USE): the call clock
// clock[0] and the layer clock lclock[layer] advance; the active ids' statistics are updated (a thread per id; the
// global estimates, a sequential sum in increasing id order, by one thread from shared flags); hits are stamped;
// each miss, in increasing id order, takes the eligible slot (not stamped in this call, not pinned) with the
// smallest (keep key, slot); keys are recomputed per miss (they do not change within a call). With bypass, a miss
// whose own key is not strictly greater than an owned victim's is bypassed: nothing is loaded or evicted, its pairs
// get slot FT_CACHE_BYPASSED and its flat id goes to bypass[n_bypass[0]++] (the caller serves it from the host);
// at most max_bypass misses of a call are bypassed (the caller's scratch slots), later ones are admitted.
// Then glob's loads average takes the call's admitted misses. count: hits, misses and bypassed [layers] are counted.
extern "C" __global__ void __launch_bounds__(1024) cache_admit_scored(
    int* __restrict__ ids, int pairs, int layer, int experts, int* __restrict__ slot_for_id,
    int* __restrict__ id_of_slot, long long* __restrict__ stamp, const unsigned char* __restrict__ pinned, int slots,
    long long* __restrict__ clock, long long* __restrict__ lclock, long long* __restrict__ last,
    double* __restrict__ c1, double* __restrict__ c2, double* __restrict__ c3, double* __restrict__ c4,
    const double* __restrict__ dp, const double* __restrict__ dp2, double* __restrict__ glob, ScoredConsts k,
    int* __restrict__ worklist, int* __restrict__ n_work, int* __restrict__ bypass, int* __restrict__ n_bypass,
    long long* __restrict__ hits, long long* __restrict__ misses, long long* __restrict__ bypassed,
    int* __restrict__ err, int count, int max_bypass) {
  __shared__ int flat[FT_CACHE_MAX_PAIRS];
  __shared__ int lead[FT_CACHE_MAX_PAIRS];
  __shared__ int active[FT_CACHE_MAX_PAIRS];
  __shared__ int is_hit[FT_CACHE_MAX_PAIRS];
  __shared__ int reacc[FT_CACHE_MAX_PAIRS];
  __shared__ ScoredArgmin warp_best[32];
  __shared__ long long call, layer_now;
  __shared__ double pbar, itau;
  __shared__ int n_active, n_miss_done, n_bypassed;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;

  if (tid == 0) {
    call = ++clock[0];
    n_active = 0;
    n_miss_done = 0;
    n_bypassed = 0;
  }
  const int na = active_ids(ids, pairs, layer, experts, flat, lead, active, &n_active, err);
  // The per-id statistics, one thread per active id (ids are unique: no two threads touch one id); hits are stamped.
  // reacc[u]: 0 a first access, 1 a re-access, 2 a continuation (a re-access at the layer's previous call).
  if (tid == 0) layer_now = ++lclock[layer];
  __syncthreads();
  const long long now = layer_now;
  for (int u = tid; u < na; u += nt) {
    const int f = active[u];
    const long long g = now - last[f];
    double cont = 0.0;
    reacc[u] = 0;
    if (last[f] > 0) {
      if (g == 1) cont = 1.0;
      reacc[u] = g == 1 ? 2 : 1;
      c2[f] = __dadd_rn(__dmul_rn(k.id_decay, c2[f]), cont);
      c3[f] = __dadd_rn(__dmul_rn(k.id_decay, c3[f]), 1.0);
    }
    const double inc = cont != 0.0 ? k.rho : 1.0;
    c1[f] = __dadd_rn(inc, __dmul_rn(c1[f], dp[g < k.dp_last ? g : k.dp_last]));
    c4[f] = __dadd_rn(inc, __dmul_rn(c4[f], dp2[g < k.dp2_last ? g : k.dp2_last]));
    last[f] = now;
    const int s = slot_for_id[f];
    is_hit[u] = s >= 0;
    if (s >= 0) stamp[s] = call;
  }
  __syncthreads();
  if (tid == 0) {
    // The global sums are sequential, in increasing id order (from shared flags: a short loop on one thread).
    double gc = glob[FT_SCORED_G_CONT], gr = glob[FT_SCORED_G_REUSE];
    for (int u = 0; u < na; ++u) {
      if (reacc[u] == 0) continue;
      gc = __dadd_rn(__dmul_rn(k.global_decay, gc), reacc[u] == 2 ? 1.0 : 0.0);
      gr = __dadd_rn(__dmul_rn(k.global_decay, gr), 1.0);
    }
    glob[FT_SCORED_G_CONT] = gc;
    glob[FT_SCORED_G_REUSE] = gr;
    // The values fixed for the call's victims.
    pbar = __ddiv_rn(glob[FT_SCORED_G_CONT], glob[FT_SCORED_G_REUSE]);
    const double ld = glob[FT_SCORED_G_LOADS];
    double tau = FT_SCORED_TAU_MAX;
    if (ld > 0.0) tau = __ddiv_rn(static_cast<double>(slots), __dmul_rn(static_cast<double>(k.layers), ld));
    if (tau < FT_SCORED_TAU_MIN) tau = FT_SCORED_TAU_MIN;
    if (tau > FT_SCORED_TAU_MAX) tau = FT_SCORED_TAU_MAX;
    itau = __ddiv_rn(1.0, tau);
  }
  __syncthreads();
  const double pb = pbar, it = itau;
  // Misses, in increasing id order: each takes the eligible slot with the smallest (key, slot), or is bypassed.
  int n_miss = 0;
  for (int u = 0; u < na; ++u) {
    if (is_hit[u]) continue;  // uniform: shared flag
    ScoredArgmin best = {dinf(), 0x7fffffff};
    for (int s = tid; s < slots; s += nt) {
      if (pinned[s] || stamp[s] == call) continue;
      const int o = id_of_slot[s];
      const double key =
          o < 0 ? -dinf() : scored_key(o, o / experts, layer, last, c1, c2, c3, c4, dp, dp2, lclock, k, pb, it);
      const ScoredArgmin c = {key, s};
      if (less(c, best)) best = c;
    }
    best = warp_argmin(best);
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (warp == 0) {
      ScoredArgmin b = lane < (nt >> 5) ? warp_best[lane] : ScoredArgmin{dinf(), 0x7fffffff};
      b = warp_argmin(b);
      if (lane == 0) {
        const int f = active[u];
        if (b.slot == 0x7fffffff) {
          atomicMax(err, FT_CACHE_ERR_NO_VICTIM);
        } else {
          const int v = b.slot;
          const int old = id_of_slot[v];
          bool admit = true;
          if (k.bypass && n_bypassed < max_bypass && old >= 0) {
            const double kin = scored_key(f, layer, layer, last, c1, c2, c3, c4, dp, dp2, lclock, k, pb, it);
            admit = kin > b.key;
          }
          if (admit) {
            if (old >= 0) slot_for_id[old] = -1;
            id_of_slot[v] = f;
            slot_for_id[f] = v;
            stamp[v] = call;
            worklist[2 * n_miss_done] = v;
            worklist[2 * n_miss_done + 1] = f;
            ++n_miss_done;
          } else {
            bypass[n_bypassed] = f;
            ++n_bypassed;
          }
        }
      }
    }
    ++n_miss;
    __syncthreads();
  }
  for (int p = tid; p < pairs; p += nt) {
    const int f = flat[p];
    ids[p] = f < 0 ? FT_NO_ROUTE : slot_for_id[f] >= 0 ? slot_for_id[f] : FT_CACHE_BYPASSED;
  }
  if (tid == 0) {
    *n_work = n_miss_done;
    *n_bypass = n_bypassed;
    // next_use's loads average: (1 - w) * ld + w * (admitted misses); a call without misses adds nothing.
    const double keep = __dmul_rn(__dsub_rn(1.0, k.load_weight), glob[FT_SCORED_G_LOADS]);
    glob[FT_SCORED_G_LOADS] =
        n_miss == 0 ? keep : __dadd_rn(keep, __dmul_rn(k.load_weight, static_cast<double>(n_miss_done)));
    if (count) {
      hits[layer] += na - n_miss;
      misses[layer] += n_miss;
      bypassed[layer] += n_bypassed;  // misses not loaded (misses - bypassed records were copied)
    }
  }
}

// next_use's prefill prior for one layer at a segment start (freetoken/policy/scored.py's scored_prefill): counts[e]
// (doubles) prefill tokens routed to expert e, k_eff tokens per step x top-k. When the counts sum (in e order) to
// more than 0, every id f of the layer gets c1 = keep * (c1 * dp[age]) + (weight * p) * (1 / q), c4 likewise with
// dp2, keep2 and 1 / q2, p = min(1, (k_eff * counts[e]) / total), and last = the layer's clock. One block.
extern "C" __global__ void cache_scored_prefill(int layer, int experts, const double* __restrict__ counts,
                                                double k_eff, const long long* __restrict__ lclock,
                                                long long* __restrict__ last, double* __restrict__ c1,
                                                double* __restrict__ c4, const double* __restrict__ dp,
                                                const double* __restrict__ dp2, ScoredConsts k) {
  __shared__ double total;
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int e = 0; e < experts; ++e) t = __dadd_rn(t, counts[e]);
    total = t;
  }
  __syncthreads();
  const double tot = total;
  if (!(tot > 0.0)) return;  // uniform: a layer without prefill tokens is left alone
  const long long now = lclock[layer];
  const double steady = __ddiv_rn(1.0, k.q), steady2 = __ddiv_rn(1.0, k.q2);
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const int f = layer * experts + e;
    const long long a = now - last[f];
    const double t = __dmul_rn(c1[f], dp[a < k.dp_last ? a : k.dp_last]);
    const double t2 = __dmul_rn(c4[f], dp2[a < k.dp2_last ? a : k.dp2_last]);
    double p = __ddiv_rn(__dmul_rn(k_eff, counts[e]), tot);
    if (p > 1.0) p = 1.0;
    const double wp = __dmul_rn(k.prior_weight, p);
    c1[f] = __dadd_rn(__dmul_rn(k.prior_keep, t), __dmul_rn(wp, steady));
    c4[f] = __dadd_rn(__dmul_rn(k.long_prior_keep, t2), __dmul_rn(wp, steady2));
    last[f] = now;
  }
}

// The misses the last scored admission bypassed (bypass[0 .. n_bypass)), the first `limit` of them (all when limit
// < 0) streamed through scratch slots: bypass[i] is copied into slot scratch + i (a slot past the cache's own, which
// no id owns: nothing is evicted and nothing stays resident), its worklist item goes after the admitted misses', and
// every pair the admission marked FT_CACHE_BYPASSED reads it there; the pairs of bypass[limit ..] get FT_NO_ROUTE
// (the caller computes them elsewhere: the q* split's CPU share). `ids` are the call's expert ids (the admission
// rewrote its copy `slots`). A marked pair whose id is not in the list (the admission never writes one) is an error:
// err gets FT_CACHE_ERR_ID_RANGE and the pair FT_NO_ROUTE, so no kernel reads a slot that does not exist. One block.
extern "C" __global__ void cache_stream_bypassed(const int* __restrict__ ids, int* __restrict__ slots, int pairs,
                                                 int layer, int experts, const int* __restrict__ bypass,
                                                 const int* __restrict__ n_bypass, int scratch, int limit,
                                                 int* __restrict__ worklist, int* __restrict__ n_work,
                                                 int* __restrict__ err) {
  const int nb = *n_bypass, nw = *n_work;
  const int ns = limit < 0 ? nb : min(limit, nb);
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    if (slots[p] != FT_CACHE_BYPASSED) continue;
    const int f = layer * experts + ids[p];
    int s = FT_NO_ROUTE;
    bool listed = false;
    for (int i = 0; i < nb; ++i) {
      if (bypass[i] == f) {
        listed = true;
        if (i < ns) s = scratch + i;
        break;
      }
    }
    if (!listed) atomicMax(err, FT_CACHE_ERR_ID_RANGE);
    slots[p] = s;
  }
  for (int i = threadIdx.x; i < ns; i += blockDim.x) {
    worklist[2 * (nw + i)] = scratch + i;
    worklist[2 * (nw + i) + 1] = bypass[i];
  }
  __syncthreads();  // every thread has read n_work
  if (threadIdx.x == 0) *n_work = nw + ns;
}

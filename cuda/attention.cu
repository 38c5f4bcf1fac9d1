// attention.cu: causal grouped-query attention of T new queries against a KV cache (decode, short prefill).
//
// q [T, H, D]; k, v [>= start + T, Hkv, D] (rows start..start+T-1 already hold the new keys/values), all float32.
// Query t (position start + t) attends to cache rows 0..start+t; query head h reads kv head h / (H / Hkv).
//
// attention_decode_f32_c<NC>_g<HB> (head dim D in (32 * (NC - 1), 32 * NC], NC = 1..8, so any D <= 256; HB = 1, 2,
// 4, 8): one block of FT_ATT_WARPS warps per
// (context split s, kv head and chunk of up to HB of its query heads, query t). Every K/V row a block reads
// serves all HB query heads of its group.
//   * Lane l holds elements d = c * 32 + l (c < NC) of q (pre-scaled by log2(e) / sqrt(D)), of the K/V rows
//     and of the HB output accumulators, so every row load is a coalesced 128-byte line per c. When D is not a
//     multiple of 32 (e.g. 48, 80) the lanes past D in the last chunk hold zeros (predicated loads).
//   * Warp w walks 32-key tiles w, w + FT_ATT_WARPS, ... of the split, loading K (then V) rows U at a time so that
//     several loads are in flight per warp. Per key the HB partial dot products are reduced across the warp
//     by a reduce-scatter butterfly (HB/2 + ... + 1 shuffles, then a full reduction of the one value left:
//     9 shuffles for HB = 8 instead of 40); the scores go to shared memory.
//   * Online softmax in fp32 and base 2, per tile: running max m, per-lane running sum, accumulators rescaled
//     by exp2(m_old - m_new); then acc += p_j * v_j over the tile's keys.
//   * The warps' (m, sum, acc) are merged through shared memory in a fixed order. With one split the block
//     writes out = acc / sum; with several it writes its unnormalised partial (acc, m, sum) and
//     attention_combine_f32 merges the splits (flash-decoding). No atomics: the result is deterministic.
// Empty splits (keys beyond a query's causal limit) write m = -inf, sum = 0, acc = 0 and weigh nothing.
#include "common.cuh"

// FT_ATT_WARPS (warps per block) and FT_ATT_TILE (keys per warp tile) come from freetoken/ops/constants.py.

namespace {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FT_FULL_MASK, v, off));
  return v;
}

// exp2(m - ref), 0 when m is -inf (an empty partial; also keeps -inf - -inf from making a NaN).
__device__ __forceinline__ float weight(float m, float ref) { return m == -ft::inf() ? 0.0f : exp2f(m - ref); }

// One reduce-scatter stage over lanes `off` apart: the lane with bit `off` set keeps the upper half of v[0..N)
// (moved down to v[0..N/2)), its partner the lower half; each adds the half the other one sent.
template <int N>
__device__ __forceinline__ void halve(float* v, int lane, int off) {
  const bool upper = (lane & off) != 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float send = upper ? v[i] : v[i + N / 2];
    const float keep = upper ? v[i + N / 2] : v[i];
    v[i] = keep + __shfl_xor_sync(FT_FULL_MASK, send, off);
  }
}

// Reduce-scatter of v[0..HB) over the warp: returns the warp total of element lane / (32 / HB).
template <int HB>
__device__ __forceinline__ float head_reduce(float (&v)[HB], int lane) {
  static_assert(HB == 1 || HB == 2 || HB == 4 || HB == 8, "HB: 1, 2, 4 or 8 heads per block");
  if constexpr (HB >= 8) halve<8>(v, lane, 16);
  if constexpr (HB >= 4) halve<4>(v, lane, 32 / HB * 2);
  if constexpr (HB >= 2) halve<2>(v, lane, 32 / HB);
  float s = v[0];
#pragma unroll
  for (int off = 32 / HB / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FT_FULL_MASK, s, off);
  return s;
}

template <int NC, int HB>
__device__ __forceinline__ void attention_block(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, float* __restrict__ out,
                                                float* __restrict__ part_o, float* __restrict__ part_ml, int T,
                                                int H, int Hkv, int D, int start, int chunk, int nsplit,
                                                float qscale) {
  constexpr int DP = NC * 32;  // D padded to whole 32-lane chunks
  constexpr int U = NC <= 4 ? 8 : HB < 8 ? 4 : 2;  // K/V rows loaded per batch (memory-level parallelism)
  __shared__ float s_p[FT_ATT_WARPS][HB][FT_ATT_TILE];  // a warp's tile scores, then probabilities
  __shared__ float s_m[FT_ATT_WARPS][HB];
  __shared__ float s_l[FT_ATT_WARPS][HB];
  __shared__ float s_acc[FT_ATT_WARPS][HB][DP];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = blockIdx.x, t = blockIdx.z;
  const int group = H / Hkv, chunks = (group + HB - 1) / HB;
  const int kvh = blockIdx.y / chunks;
  const int g0 = (blockIdx.y % chunks) * HB;  // first query head of this block within its group
  const int hb = min(HB, group - g0);
  const int h0 = kvh * group + g0;
  const int n = start + t + 1;  // keys this query sees
  const int lo = split * chunk, hi = min(n, lo + chunk);
  const long long row_stride = static_cast<long long>(Hkv) * D;
  const float* kb = k + static_cast<long long>(kvh) * D + lane;
  const float* vb = v + static_cast<long long>(kvh) * D + lane;
  // lanes past D in the last chunk read nothing (clamped to element 0) and hold zeros
  const bool tail_live = lane < D - (NC - 1) * 32;
  const int tail_off = tail_live ? (NC - 1) * 32 : -lane;

  float qr[HB][NC], acc[HB][NC], m[HB], l[HB];
#pragma unroll
  for (int g = 0; g < HB; ++g) {
    const float* qh = q + (static_cast<long long>(t) * H + h0 + g) * D + lane;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const bool live = c < NC - 1 || tail_live;
      qr[g][c] = g < hb && live ? qh[c < NC - 1 ? c * 32 : tail_off] * qscale : 0.0f;
      acc[g][c] = 0.0f;
    }
    m[g] = -ft::inf();
    l[g] = 0.0f;
  }

  for (int base = lo + warp * FT_ATT_TILE; base < hi; base += FT_ATT_WARPS * FT_ATT_TILE) {
    const int nk = min(FT_ATT_TILE, hi - base);  // uniform across the warp
    for (int j0 = 0; j0 < nk; j0 += U) {
      float kv[U][NC];  // U rows in flight: their loads are issued before any of them is used
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float* kr = kb + (base + min(j0 + u, nk - 1)) * row_stride;  // clamped: no branch, no overrun
#pragma unroll
        for (int c = 0; c < NC; ++c) kv[u][c] = c < NC - 1 ? kr[c * 32] : tail_live ? kr[tail_off] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j0 + u >= nk) break;  // uniform across the warp
        float part[HB];
#pragma unroll
        for (int g = 0; g < HB; ++g) {
          float s = 0.0f;
#pragma unroll
          for (int c = 0; c < NC; ++c) s = fmaf(qr[g][c], kv[u][c], s);
          part[g] = s;
        }
        const float score = head_reduce<HB>(part, lane);
        if ((lane & (32 / HB - 1)) == 0) s_p[warp][lane / (32 / HB)][j0 + u] = score;
      }
    }
    __syncwarp();
#pragma unroll
    for (int g = 0; g < HB; ++g) {
      const float s = lane < nk ? s_p[warp][g][lane] : -ft::inf();
      const float m_new = fmaxf(m[g], warp_max(s));
      const float corr = exp2f(m[g] - m_new);  // 0 on the first tile (m = -inf)
      const float p = exp2f(s - m_new);        // 0 past the tile's end
      l[g] = l[g] * corr + p;                  // per-lane partial sum; corr is uniform across the warp
      m[g] = m_new;
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[g][c] *= corr;
      s_p[warp][g][lane] = p;
    }
    __syncwarp();
    for (int j0 = 0; j0 < nk; j0 += U) {
      float vv[U][NC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float* vr = vb + (base + min(j0 + u, nk - 1)) * row_stride;
#pragma unroll
        for (int c = 0; c < NC; ++c) vv[u][c] = c < NC - 1 ? vr[c * 32] : tail_live ? vr[tail_off] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j0 + u >= nk) break;
#pragma unroll
        for (int g = 0; g < HB; ++g) {
          const float p = s_p[warp][g][j0 + u];
#pragma unroll
          for (int c = 0; c < NC; ++c) acc[g][c] = fmaf(p, vv[u][c], acc[g][c]);
        }
      }
    }
    __syncwarp();  // s_p is rewritten by the next tile
  }

#pragma unroll
  for (int g = 0; g < HB; ++g) {
    const float lw = ft::warp_sum(l[g]);
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = lw;
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) s_acc[warp][g][c * 32 + lane] = acc[g][c];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < hb * D; i += blockDim.x) {
    const int g = i / D, d = i - g * D;
    float mx = -ft::inf();
#pragma unroll
    for (int w = 0; w < FT_ATT_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < FT_ATT_WARPS; ++w) {
      const float e = weight(s_m[w][g], mx);
      sum = fmaf(s_l[w][g], e, sum);
      o = fmaf(s_acc[w][g][d], e, o);
    }
    const long long row = static_cast<long long>(t) * H + h0 + g;  // [t, h] of the output
    if (nsplit == 1) {
      out[row * D + d] = o / sum;  // sum >= 1: the largest score contributes exp2(0)
    } else {
      const long long prow = static_cast<long long>(split) * T * H + row;
      part_o[prow * D + d] = o;
      if (d == 0) {
        part_ml[2 * prow] = mx;
        part_ml[2 * prow + 1] = sum;
      }
    }
  }
}

}  // namespace

// Grid (nsplit, Hkv * ceil(G / HB), T), FT_ATT_WARPS * 32 threads, no dynamic shared memory; head dim D with
// 32 * (NC - 1) < D <= 32 * NC. Keys of split s:
// [s * chunk, min(start + t + 1, (s + 1) * chunk)). With nsplit > 1 the outputs are part_o [nsplit, T, H, D] and
// part_ml [nsplit, T, H, 2] (max in log2 units, sum) and `out` is not touched; with nsplit == 1 the reverse.
// qscale = log2(e) / sqrt(D).
#define FT_ATTENTION(NC, HB)                                                                                     \
  extern "C" __global__ void __launch_bounds__(FT_ATT_WARPS * 32) attention_decode_f32_c##NC##_g##HB(                \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                     \
      float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int T, int H, int Hkv,   \
      int D, int start, int chunk, int nsplit, float qscale) {                                                   \
    attention_block<NC, HB>(q, k, v, out, part_o, part_ml, T, H, Hkv, D, start, chunk, nsplit, qscale);         \
  }

#define FT_ATTENTION_GROUPS(NC) FT_ATTENTION(NC, 1) FT_ATTENTION(NC, 2) FT_ATTENTION(NC, 4) FT_ATTENTION(NC, 8)

// Head dims up to 32, 64, ..., 256 (any D <= 256); 1, 2, 4 or 8 query heads per block.
FT_ATTENTION_GROUPS(1)
FT_ATTENTION_GROUPS(2)
FT_ATTENTION_GROUPS(3)
FT_ATTENTION_GROUPS(4)
FT_ATTENTION_GROUPS(5)
FT_ATTENTION_GROUPS(6)
FT_ATTENTION_GROUPS(7)
FT_ATTENTION_GROUPS(8)

// Merge the splits: out[t, h, :] = sum_s part_o[s] * w_s / sum_s part_l[s] * w_s with w_s = exp2(m_s - max m).
// Grid (T * H), any multiple of 32 threads; the splits are summed in order (deterministic).
extern "C" __global__ void __launch_bounds__(1024) attention_combine_f32(const float* __restrict__ part_o,
                                                                         const float* __restrict__ part_ml,
                                                                         float* __restrict__ out, int rows, int D,
                                                                         int nsplit) {
  const long long row = blockIdx.x;  // t * H + h
  if (row >= rows) return;
  float mx = -ft::inf();
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, part_ml[2 * (s * static_cast<long long>(rows) + row)]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.0f, o = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
      const long long prow = s * static_cast<long long>(rows) + row;
      const float e = weight(part_ml[2 * prow], mx);
      sum = fmaf(part_ml[2 * prow + 1], e, sum);
      o = fmaf(part_o[prow * D + d], e, o);
    }
    out[row * D + d] = o / sum;
  }
}

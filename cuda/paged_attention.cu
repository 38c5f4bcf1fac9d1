// paged_attention.cu: the paged KV cache's kernels: the append (kv_store_*) and causal grouped-query attention over
// it, a decode kernel for a few queries (paged_decode_*) and a flash-attention kernel for prompts (paged_prefill_*).
// Contract: freetoken/testing/reference/paged_attention.py (layout and storage kinds in kv.cuh).
//
// Query t sits at position start + t and sees the keys p <= start + t, with a window W > 0 only those with
// start + t - p < W; query head h reads kv head h / (H / Hkv). Scores are in base 2: the launcher passes
// qscale = scale * log2(e) and the sinks (gpt-oss: one logit per query head added to the softmax denominator) are
// multiplied by log2(e) here. Every kernel reads K/V through the block table; keys outside a query's range are never
// read (the rows past a sequence's end may hold anything, NaN included).
//
// Decode (paged_decode_c<NC>_g<HB>, head dim D <= 32 NC, HB = 1, 2, 4, 8 query heads per block): one block
// of FT_ATT_WARPS warps per (context split, kv head and chunk of HB of its query heads, query), fp32 on the widened
// values. Lane l holds elements c * 32 + l of q, of the K/V rows and of the HB accumulators (coalesced rows); warp w
// walks key tiles w, w + FT_ATT_WARPS, ... of the split, U rows in flight; per key the HB dot products are reduced
// across the warp by a reduce-scatter butterfly; online softmax per tile; the warps merge through shared memory in a
// fixed order. With several splits each block writes its unnormalised partial and paged_combine merges them
// (flash-decoding). No atomics: results are deterministic.
//
// Prefill (paged_prefill_d<DP>, D <= DP, DP a multiple of 16): one block of 4 warps per (64 rows, kv head),
// the rows being (query, head of the group) pairs, so each K/V tile it reads serves the whole group. Per tile of 32
// keys the block widens K ([key][d]) and V (transposed, [d][key]) to bf16 in shared memory; each warp keeps its 16
// rows' Q fragments and fp32 output accumulators in registers and runs S = Q K^T and O += P V as m16n8k16 bf16
// products (mma.cuh: tensor cores on sm_80+, the same data flow on shuffles elsewhere), with the online softmax in
// between on the S fragments (the row max and sum reduced over the 4 lanes holding a row). Tiles past a block's last
// query and before its first query's window are skipped.
#include "common.cuh"
#include "kv.cuh"
#include "mma.cuh"

// FT_ATT_WARPS (warps per decode block) and FT_ATT_TILE (keys per warp tile) come from freetoken/device/constants.py.

namespace {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FT_FULL_MASK, v, off));
  return v;
}

// exp2(m - ref), 0 when m is -inf (an empty partial; also keeps -inf - -inf from making a NaN).
__device__ __forceinline__ float weight(float m, float ref) { return m == -ft::inf() ? 0.0f : exp2f(m - ref); }

// o / sum normalised, with the sink logit sl (base 2; -inf: none) in the denominator: all in the frame of m.
__device__ __forceinline__ float finish(float o, float sum, float m, float sl) {
  if (sl == -ft::inf()) return o / sum;  // sum >= 1: the largest score contributes exp2(0)
  const float mf = fmaxf(m, sl), e = weight(m, mf);
  return o * e / (sum * e + exp2f(sl - mf));
}

// ---- kv_store ----------------------------------------------------------------------------------------------------
// Grid (T, Hkv, 2: keys then values), 32 threads: one warp encodes row t of k or v (kv head blockIdx.y) into the
// cache at position pos.
template <int KIND>
__device__ __forceinline__ void store_row(const float* __restrict__ k, const float* __restrict__ v,
                                          typename ft::Kv<KIND>::T* __restrict__ k_pool,
                                          typename ft::Kv<KIND>::T* __restrict__ v_pool, float* __restrict__ k_scale,
                                          float* __restrict__ v_scale, const int* __restrict__ table, int Hkv, int D,
                                          int block_size, int t, int pos) {
  using K = ft::Kv<KIND>;
  const int h = blockIdx.y, lane = threadIdx.x;
  const bool values = blockIdx.z == 1;
  const float* src = (values ? v : k) + (static_cast<long long>(t) * Hkv + h) * D;
  typename K::T* pool = values ? v_pool : k_pool;
  const long long row = ft::kv_row(table, pos, block_size, Hkv, h);
  float scale = 1.0f;
  if constexpr (K::scaled) {
    float amax = 0.0f;
    for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(src[d]));
    amax = warp_max(amax);
    scale = amax > 0.0f ? amax / FT_KV_FP8_MAX : 1.0f;
    if (lane == 0) (values ? v_scale : k_scale)[row] = scale;
  }
  for (int d = lane; d < D; d += 32) pool[row * D + d] = K::store(src[d], scale);
}

// ---- decode ------------------------------------------------------------------------------------------------------
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

struct Paged {  // one layer's view of the pool, as every attention kernel reads it
  const void* k;
  const void* v;
  const float* k_scale;  // fp8 only (else any pointer, never read)
  const float* v_scale;
  const int* table;
  int kind, Hkv, D, block_size;  // kind: ft::KvKind
};

// U rows r0 .. r0 + U - 1 of one pool (kv head h) widened into rows[u][c] = element c * 32 + lane (0 past D); rows
// past `last` repeat it (no branch, no read outside the sequence).
template <int NC, int U>
__device__ __forceinline__ void load_rows(const Paged& P, const void* pool, const float* scales, int h, int r0,
                                          int last, int lane, bool tail_live, int tail_off, float (&rows)[U][NC]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long row = ft::kv_row(P.table, min(r0 + u, last), P.block_size, P.Hkv, h);
    const float s = P.kind == ft::KV_FP8 ? scales[row] : 1.0f;
    const long long e = row * P.D + lane;
#pragma unroll
    for (int c = 0; c < NC; ++c)
      rows[u][c] = c < NC - 1 ? ft::kv_load(P.kind, pool, e + c * 32, s)
                   : tail_live ? ft::kv_load(P.kind, pool, e + tail_off, s) : 0.0f;
  }
}

template <int NC, int HB>
__device__ __forceinline__ void decode_block(const float* __restrict__ q, const Paged& P,
                                             const float* __restrict__ sinks, float* __restrict__ out,
                                             float* __restrict__ part_o, float* __restrict__ part_ml, int T, int H,
                                             int t, int qrow, int start, int window, int key0, int chunk, int nsplit,
                                             int has_sinks, float qscale) {
  constexpr int DP = NC * 32;  // D padded to whole 32-lane chunks
  constexpr int U = NC <= 4 ? 8 : HB < 8 ? 4 : 2;  // K/V rows loaded per batch (memory-level parallelism)
  __shared__ float s_p[FT_ATT_WARPS][HB][FT_ATT_TILE];  // a warp's tile scores, then probabilities
  __shared__ float s_m[FT_ATT_WARPS][HB];
  __shared__ float s_l[FT_ATT_WARPS][HB];
  __shared__ float s_acc[FT_ATT_WARPS][HB][DP];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = blockIdx.x;
  const int D = P.D, group = H / P.Hkv, chunks = (group + HB - 1) / HB;
  const int kvh = blockIdx.y / chunks;
  const int g0 = (blockIdx.y % chunks) * HB;  // first query head of this block within its group
  const int hb = min(HB, group - g0);
  const int h0 = kvh * group + g0;
  const int n = start + t + 1;  // keys this query sees: [first, n)
  const int first = window > 0 ? max(0, n - window) : 0;
  const int lo = max(first, key0 + split * chunk), hi = min(n, key0 + (split + 1) * chunk);
  // lanes past D in the last chunk read nothing (clamped to element 0) and hold zeros
  const bool tail_live = lane < D - (NC - 1) * 32;
  const int tail_off = tail_live ? (NC - 1) * 32 : -lane;

  float qr[HB][NC], acc[HB][NC], m[HB], l[HB];
#pragma unroll
  for (int g = 0; g < HB; ++g) {
    const float* qh = q + (static_cast<long long>(qrow) * H + h0 + min(g, hb - 1)) * D + lane;
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
      load_rows<NC, U>(P, P.k, P.k_scale, kvh, base + j0, base + nk - 1, lane, tail_live, tail_off, kv);
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
      load_rows<NC, U>(P, P.v, P.v_scale, kvh, base + j0, base + nk - 1, lane, tail_live, tail_off, vv);
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
    if (nsplit == 1) {
      const long long row = static_cast<long long>(qrow) * H + h0 + g;  // [qrow, h] of the output
      out[row * D + d] = finish(o, sum, mx, has_sinks ? sinks[h0 + g] * kLog2e : -ft::inf());
    } else {
      const long long prow = (static_cast<long long>(split) * T + t) * H + h0 + g;
      part_o[prow * D + d] = o;
      if (d == 0) {
        part_ml[2 * prow] = mx;
        part_ml[2 * prow + 1] = sum;
      }
    }
  }
}

// ---- prefill -----------------------------------------------------------------------------------------------------
#define FT_PF_ROWS 64  // (query, head) rows per block: 16 per warp
#define FT_PF_KEYS 32  // keys per tile
#define FT_PF_PAD 8  // shared row padding (bf16 elements): conflict-free fragment reads

template <int DP>
__device__ __forceinline__ void prefill_block(const float* __restrict__ q, const Paged& P,
                                              const float* __restrict__ sinks, float* __restrict__ out, int T, int H,
                                              int start, int window, int has_sinks, float qscale, int tile) {
  static_assert(DP % 16 == 0 && DP <= 256, "DP: a multiple of 16 up to 256");
  constexpr int NKS = DP / 16;  // k-steps of Q K^T
  constexpr int NOT = DP / 8;   // 8-column tiles of O
  __shared__ __align__(16) unsigned short ks[FT_PF_KEYS][DP + FT_PF_PAD];  // K tile, [key][d], bf16 bits
  __shared__ __align__(16) unsigned short vt[DP][FT_PF_KEYS + FT_PF_PAD];  // V tile transposed, [d][key]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int D = P.D, group = H / P.Hkv;
  const int per_block = FT_PF_ROWS / group;  // queries per block (the launcher keeps group <= 64)
  const int kvh = blockIdx.y, t0 = tile * per_block;
  const int t_end = min(T, t0 + per_block);  // queries t0 .. t_end - 1
  const int rows = (t_end - t0) * group;
  // the two rows this thread holds: r[0] = 16 warp + g, r[1] = r[0] + 8; their query positions (a padding row takes
  // the block's last query: it computes like a real row and is not written)
  int pos[2], row_t[2], row_h[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * warp + g + 8 * i, rr = r < rows ? r : rows - 1;
    row_t[i] = t0 + rr / group;
    row_h[i] = kvh * group + rr % group;
    pos[i] = start + row_t[i];
  }

  unsigned qa[NKS][4];  // the warp's Q rows as A fragments
#pragma unroll
  for (int s = 0; s < NKS; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int hr = i & 1, col = 16 * s + 2 * tq + (i >> 1) * 8;
      const float* qrow = q + (static_cast<long long>(row_t[hr]) * H + row_h[hr]) * D;
      qa[s][i] = ft::pack_bf16x2(col < D ? qrow[col] : 0.0f, col + 1 < D ? qrow[col + 1] : 0.0f);
    }
  }
  float o[NOT][4];
#pragma unroll
  for (int j = 0; j < NOT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
  float m[2] = {-ft::inf(), -ft::inf()}, l[2] = {0.0f, 0.0f};

  const int k_hi = start + t_end;  // keys the block's last query sees: [0, k_hi)
  const int k_lo = window > 0 ? max(0, start + t0 + 1 - window) : 0;
  for (int kb = k_lo; kb < k_hi; kb += FT_PF_KEYS) {
    __syncthreads();  // the previous tile's fragments are read
    for (int i = threadIdx.x; i < FT_PF_KEYS * DP; i += blockDim.x) {
      const int j = i / DP, d = i - j * DP, key = kb + j;
      float kx = 0.0f, vx = 0.0f;  // keys past the block's range and d past D: zeros (never NaN: P is 0 there)
      if (key < k_hi && d < D) {
        const long long row = ft::kv_row(P.table, key, P.block_size, P.Hkv, kvh);
        const bool fp8 = P.kind == ft::KV_FP8;
        kx = ft::kv_load(P.kind, P.k, row * D + d, fp8 ? P.k_scale[row] : 1.0f);
        vx = ft::kv_load(P.kind, P.v, row * D + d, fp8 ? P.v_scale[row] : 1.0f);
      }
      ks[j][d] = __bfloat16_as_ushort(__float2bfloat16_rn(kx));
      vt[d][j] = __bfloat16_as_ushort(__float2bfloat16_rn(vx));
    }
    __syncthreads();

    float s[FT_PF_KEYS / 8][4];  // S = Q K^T: 4 tiles of 8 keys
#pragma unroll
    for (int nt = 0; nt < FT_PF_KEYS / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
      for (int st = 0; st < NKS; ++st) {
        const unsigned b[2] = {*reinterpret_cast<const unsigned*>(&ks[8 * nt + g][16 * st + 2 * tq]),
                               *reinterpret_cast<const unsigned*>(&ks[8 * nt + g][16 * st + 8 + 2 * tq])};
        ft::mma_bf16_16816(s[nt], qa[st], b);
      }
    }
    // mask and scale, then the online softmax of the two rows (each spread over the 4 lanes of quad g)
    float mx[2] = {-ft::inf(), -ft::inf()};
#pragma unroll
    for (int nt = 0; nt < FT_PF_KEYS / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e >> 1, key = kb + 8 * nt + 2 * tq + (e & 1);
        const bool seen = key <= pos[hr] && (window <= 0 || pos[hr] - key < window);
        s[nt][e] = seen ? s[nt][e] * qscale : -ft::inf();
        mx[hr] = fmaxf(mx[hr], s[nt][e]);
      }
    }
    float corr[2], ref[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(FT_FULL_MASK, mx[hr], 1));
      mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(FT_FULL_MASK, mx[hr], 2));
      const float m_new = fmaxf(m[hr], mx[hr]);
      ref[hr] = m_new == -ft::inf() ? 0.0f : m_new;  // a row that has seen no key yet: nothing to rescale
      corr[hr] = exp2f(m[hr] - ref[hr]);           // 0 while m is -inf
      m[hr] = m_new;
      l[hr] *= corr[hr];
    }
#pragma unroll
    for (int nt = 0; nt < FT_PF_KEYS / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e >> 1;
        s[nt][e] = exp2f(s[nt][e] - ref[hr]);  // 0 where masked
        l[hr] += s[nt][e];                     // this lane's part of the row sum
      }
    }
#pragma unroll
    for (int j = 0; j < NOT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] *= corr[e >> 1];
    // O += P V: the S fragments of key tiles 2kk, 2kk + 1 are the A fragment of k-step kk
#pragma unroll
    for (int kk = 0; kk < FT_PF_KEYS / 16; ++kk) {
      const unsigned pa[4] = {ft::pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), ft::pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              ft::pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              ft::pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < NOT; ++j) {
        const unsigned b[2] = {*reinterpret_cast<const unsigned*>(&vt[8 * j + g][16 * kk + 2 * tq]),
                               *reinterpret_cast<const unsigned*>(&vt[8 * j + g][16 * kk + 8 + 2 * tq])};
        ft::mma_bf16_16816(o[j], pa, b);
      }
    }
  }

  float sum[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    sum[hr] = l[hr] + __shfl_xor_sync(FT_FULL_MASK, l[hr], 1);
    sum[hr] += __shfl_xor_sync(FT_FULL_MASK, sum[hr], 2);
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if (16 * warp + g + 8 * hr >= rows) continue;
    const float sl = has_sinks ? sinks[row_h[hr]] * kLog2e : -ft::inf();
    float* orow = out + (static_cast<long long>(row_t[hr]) * H + row_h[hr]) * D;
#pragma unroll
    for (int j = 0; j < NOT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = 8 * j + 2 * tq + e;
        if (d < D) orow[d] = finish(o[j][2 * hr + e], sum[hr], m[hr], sl);
      }
    }
  }
}

}  // namespace

// paged_decode_c<NC>_g<HB>: grid (nsplit, Hkv * ceil(G / HB), T), FT_ATT_WARPS * 32 threads; head dim D <= 32 NC
// (lanes past D hold zeros and load nothing: a D between two builds costs arithmetic, not memory). Split s holds
// the keys [key0 + s chunk, key0 + (s + 1) chunk) of those a query sees (key0: the first key any query of the call
// sees). With nsplit > 1 the outputs are part_o [nsplit, T, H, D] and part_ml [nsplit, T, H, 2] (max in log2 units,
// sum) and `out` is not touched; with nsplit == 1 the reverse. kind: ft::KvKind of the pools; k_scale / v_scale are
// read for fp8 only, sinks [H] when has_sinks; qscale = scale * log2(e). width == 0: one sequence, query t at
// position start + t, block table `table`, `rows` not read. width > 0: a batch of sequences (paged_attention_batch):
// query t is row rows[3 t] of q and out at position rows[3 t + 2] of sequence rows[3 t + 1], whose block table is
// table[rows[3 t + 1] * width ..]; its keys are split from its own first key (start and key0 not read); partials
// are indexed by t (paged_combine_varlen writes them to their q rows).
#define FT_PAGED_DECODE(NC, HB)                                                                                  \
  extern "C" __global__ void __launch_bounds__(FT_ATT_WARPS * 32) paged_decode_c##NC##_g##HB(                   \
      const float* __restrict__ q, const void* k_pool, const void* v_pool, const float* k_scale,               \
      const float* v_scale, const int* table, const int* __restrict__ rows, const float* __restrict__ sinks,    \
      float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int kind, int T, int H, \
      int Hkv, int D, int block_size, int width, int start, int window, int key0, int chunk, int nsplit,        \
      int has_sinks, float qscale) {                                                                             \
    const int t = blockIdx.z;                                                                                    \
    int qrow = t, first = start, k0 = key0;                                                                      \
    const int* tb = table;                                                                                       \
    if (width > 0) { /* a batch: query t is row rows[3 t] of q, at position rows[3 t + 2] of sequence rows[3 t + 1] */ \
      const int pos = rows[3 * t + 2];                                                                           \
      qrow = rows[3 * t];                                                                                        \
      tb = table + static_cast<long long>(rows[3 * t + 1]) * width;                                              \
      first = pos - t;                                                                                           \
      k0 = window > 0 ? max(0, pos + 1 - window) : 0;                                                            \
    }                                                                                                            \
    const Paged P{k_pool, v_pool, k_scale, v_scale, tb, kind, Hkv, D, block_size};                              \
    decode_block<NC, HB>(q, P, sinks, out, part_o, part_ml, T, H, t, qrow, first, window, k0, chunk, nsplit,     \
                         has_sinks, qscale);                                                                     \
  }
#define FT_PAGED_DECODE_HEADS(NC) \
  FT_PAGED_DECODE(NC, 1) FT_PAGED_DECODE(NC, 2) FT_PAGED_DECODE(NC, 4) FT_PAGED_DECODE(NC, 8)

// Head dims up to 32, 64, 128, 256; 1, 2, 4 or 8 query heads per block.
FT_PAGED_DECODE_HEADS(1)
FT_PAGED_DECODE_HEADS(2)
FT_PAGED_DECODE_HEADS(4)
FT_PAGED_DECODE_HEADS(8)

// paged_prefill_d<DP>: grid (ceil(T / (64 / G)), Hkv), 128 threads; D <= DP, G = H / Hkv <= 64; the other arguments
// as for paged_decode. width > 0: a batch of sequences, grid (blocks, Hkv): block b takes query tile tiles[2 b + 1] of
// sequence s = tiles[2 b], whose queries are rows seqs[3 s] .. + seqs[3 s + 1] - 1 of q at positions seqs[3 s + 2]
// .., block table table[s * width ..] (T and start not read).
#define FT_PAGED_PREFILL(DP)                                                                                     \
  extern "C" __global__ void __launch_bounds__(128) paged_prefill_d##DP(                                         \
      const float* __restrict__ q, const void* k_pool, const void* v_pool, const float* k_scale,               \
      const float* v_scale, const int* table, const int* __restrict__ seqs, const int* __restrict__ tiles,      \
      const float* __restrict__ sinks, float* __restrict__ out, int kind, int T, int H, int Hkv, int D,        \
      int block_size, int width, int start, int window, int has_sinks, float qscale) {                         \
    long long off = 0;  /* one sequence; in a batch, this block's sequence and query tile: */                    \
    const int* tb = table;                                                                                       \
    int count = T, first = start, tile = blockIdx.x;                                                             \
    if (width > 0) {                                                                                             \
      const int s = tiles[2 * blockIdx.x];                                                                       \
      off = static_cast<long long>(seqs[3 * s]) * H * D;                                                         \
      tb = table + static_cast<long long>(s) * width;                                                            \
      count = seqs[3 * s + 1];                                                                                   \
      first = seqs[3 * s + 2];                                                                                   \
      tile = tiles[2 * blockIdx.x + 1];                                                                          \
    }                                                                                                            \
    const Paged P{k_pool, v_pool, k_scale, v_scale, tb, kind, Hkv, D, block_size};                              \
    prefill_block<DP>(q + off, P, sinks, out + off, count, H, first, window, has_sinks, qscale, tile);           \
  }

// Head dims up to 48, 64, 96, 128, 192, 256 (the list in freetoken/ops/paged_attention_cuda.py).
FT_PAGED_PREFILL(48)
FT_PAGED_PREFILL(64)
FT_PAGED_PREFILL(96)
FT_PAGED_PREFILL(128)
FT_PAGED_PREFILL(192)
FT_PAGED_PREFILL(256)

// kv_store_<kind>(k, v [T, Hkv, D] float32, k_pool, v_pool, k_scale, v_scale (fp8; else any pointer), table, Hkv, D,
// block_size, start): grid (T, Hkv, 2), 32 threads.
#define FT_KV_STORE(NAME, KIND)                                                                                  \
  extern "C" __global__ void __launch_bounds__(32) kv_store_##NAME(                                              \
      const float* __restrict__ k, const float* __restrict__ v, ft::Kv<KIND>::T* __restrict__ k_pool,           \
      ft::Kv<KIND>::T* __restrict__ v_pool, float* __restrict__ k_scale, float* __restrict__ v_scale,           \
      const int* __restrict__ table, int Hkv, int D, int block_size, int start) {                               \
    store_row<KIND>(k, v, k_pool, v_pool, k_scale, v_scale, table, Hkv, D, block_size, blockIdx.x,            \
                    start + blockIdx.x);                                                                         \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(32) kv_store_varlen_##NAME(                                       \
      const float* __restrict__ k, const float* __restrict__ v, ft::Kv<KIND>::T* __restrict__ k_pool,           \
      ft::Kv<KIND>::T* __restrict__ v_pool, float* __restrict__ k_scale, float* __restrict__ v_scale,           \
      const int* __restrict__ tables, const int* __restrict__ rows, int Hkv, int D, int block_size, int width) { \
    const int t = blockIdx.x;                                                                                    \
    store_row<KIND>(k, v, k_pool, v_pool, k_scale, v_scale, tables + static_cast<long long>(rows[3 * t + 1]) * width, \
                    Hkv, D, block_size, rows[3 * t], rows[3 * t + 2]);                                           \
  }

FT_KV_STORE(f32, ft::KV_F32)
FT_KV_STORE(f16, ft::KV_F16)
FT_KV_STORE(bf16, ft::KV_BF16)
FT_KV_STORE(fp8, ft::KV_FP8)

namespace {

// Merge of one (t, h) row's splits (row = t * H + h of `rows`) into orow[0 .. D).
__device__ __forceinline__ void combine_row(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                            const float* __restrict__ sinks, float* __restrict__ orow, long long row,
                                            int rows, int H, int D, int nsplit, int has_sinks) {
  float mx = -ft::inf();
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, part_ml[2 * (s * static_cast<long long>(rows) + row)]);
  const float sl = has_sinks ? sinks[row % H] * kLog2e : -ft::inf();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.0f, o = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
      const long long prow = s * static_cast<long long>(rows) + row;
      const float e = weight(part_ml[2 * prow], mx);
      sum = fmaf(part_ml[2 * prow + 1], e, sum);
      o = fmaf(part_o[prow * D + d], e, o);
    }
    orow[d] = finish(o, sum, mx, sl);
  }
}

}  // namespace

// Merge the decode splits: out[t, h, :] = sum_s part_o[s] w_s / (sum_s part_l[s] w_s [+ the sink]) with
// w_s = exp2(m_s - max m). Grid (T * H), any multiple of 32 threads; the splits are summed in order.
extern "C" __global__ void __launch_bounds__(1024) paged_combine(const float* __restrict__ part_o,
                                                                 const float* __restrict__ part_ml,
                                                                 const float* __restrict__ sinks,
                                                                 float* __restrict__ out, int rows, int H, int D,
                                                                 int nsplit, int has_sinks) {
  const long long row = blockIdx.x;  // t * H + h
  if (row >= rows) return;
  combine_row(part_o, part_ml, sinks, out + row * D, row, rows, H, D, nsplit, has_sinks);
}

// paged_combine for paged_decode_varlen: partial row t * H + h goes to out[rows_map[3 t], h, :].
extern "C" __global__ void __launch_bounds__(1024) paged_combine_varlen(const float* __restrict__ part_o,
                                                                        const float* __restrict__ part_ml,
                                                                        const float* __restrict__ sinks,
                                                                        float* __restrict__ out,
                                                                        const int* __restrict__ rows_map, int rows,
                                                                        int H, int D, int nsplit, int has_sinks) {
  const long long row = blockIdx.x;  // t * H + h
  if (row >= rows) return;
  const long long orow = static_cast<long long>(rows_map[3 * (row / H)]) * H + row % H;
  combine_row(part_o, part_ml, sinks, out + orow * D, row, rows, H, D, nsplit, has_sinks);
}

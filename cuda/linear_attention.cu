// linear_attention.cu: Gated DeltaNet's two sequence ops (Qwen3-Next, Qwen3.5-MoE linear attention), float32.
// Contract: freetoken/ops/linear_attention.py; reference: freetoken/testing/reference/linear_attention.py.
//
// short_conv_f32: the causal depthwise convolution of K <= FT_LINEAR_CONV_MAX_TAPS taps with SiLU, continuing from
// its state.
// gated_delta_rule_f32: the gated delta rule over T tokens in its recurrent form (decode and short prompts),
// continuing from the per-head state S [Dk, Dv].
// gated_delta_chunk_prep_f32 + gated_delta_chunk_scan_f32: the same rule in its chunked (WY) form, for prefill.
//
// Batch mode (continuous batching, freetoken/ops/linear_batch.py): short_conv_f32 and gated_delta_rule_f32 given
// `width` > 0 run `width` sequences in one launch, the last grid axis picking the sequence: desc[3 s .. 3 s + 2] =
// (its state's index in a pool of states laid one after another, its first row, its end row) of the x / qkv rows.
// With width 0 they run one sequence, rows 0 .. t_count - 1, on `state` itself (desc is not read).
#include "common.cuh"

namespace {

// (rows lo .. hi of the launch's inputs, the state's element offset) of the sequence this block runs.
struct SeqRows {
  int lo, hi;
  long long state;
};

__device__ __forceinline__ SeqRows seq_rows(const int* __restrict__ desc, int width, int s, int t_count,
                                             long long state_elems) {
  if (width == 0) return {0, t_count, 0};
  return {desc[3 * s + 1], desc[3 * s + 2], static_cast<long long>(desc[3 * s]) * state_elems};
}

}  // namespace

// ---- short_conv_f32 ----------------------------------------------------------------------------------------------
// x, out [T, C]; w [C, K]; state [K - 1, C] (oldest first), updated in place. One thread per channel (block:
// FT_LINEAR_CONV_THREADS channels, coalesced over C): the K - 1 state values in registers slide over the T inputs;
// out[t, c] = silu(sum_j w[c, j] u[t + j, c]) with u = concat(state, x); the last K - 1 rows of u are written back.
// Batch mode: grid.y = width, state the pool [N, K - 1, C].
extern "C" __global__ void __launch_bounds__(FT_LINEAR_CONV_THREADS)
    short_conv_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ state_in,
                   float* __restrict__ out, int t_count, int channels, int k, const int* __restrict__ desc,
                   int width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const SeqRows seq = seq_rows(desc, width, blockIdx.y, t_count, static_cast<long long>(k - 1) * channels);
  float* __restrict__ state = state_in + seq.state;
  // win[j]: u[t + j] for the token t about to be computed (oldest first; K - 1 used). Every index below is static
  // after unrolling, so the window and the taps stay in registers.
  float win[FT_LINEAR_CONV_MAX_TAPS];
  float wt[FT_LINEAR_CONV_MAX_TAPS];
  const float* wc = w + static_cast<long long>(c) * k;
#pragma unroll
  for (int j = 0; j < FT_LINEAR_CONV_MAX_TAPS; ++j) {
    wt[j] = j < k ? wc[j] : 0.0f;
    win[j] = j < k - 1 ? state[static_cast<long long>(j) * channels + c] : 0.0f;
  }
  for (int t = seq.lo; t < seq.hi; ++t) {
    const float u = x[static_cast<long long>(t) * channels + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < FT_LINEAR_CONV_MAX_TAPS; ++j) {
      if (j < k - 1) {
        acc = fmaf(wt[j], win[j], acc);
      } else if (j == k - 1) {
        acc = fmaf(wt[j], u, acc);
      }
    }
    out[static_cast<long long>(t) * channels + c] = acc / (1.0f + expf(-acc));
    // slide: win[0 .. k-3] <- win[1 .. k-2], win[k-2] <- u
#pragma unroll
    for (int j = 0; j < FT_LINEAR_CONV_MAX_TAPS - 1; ++j) {
      if (j < k - 2) {
        win[j] = win[j + 1];
      } else if (j == k - 2) {
        win[j] = u;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < FT_LINEAR_CONV_MAX_TAPS - 1; ++j) {
    if (j < k - 1) state[static_cast<long long>(j) * channels + c] = win[j];
  }
}

// ---- gated_delta_rule_f32 ----------------------------------------------------------------------------------------
// qkv [T, 2 Hk Dk + Hv Dv] (q heads, k heads, v heads); g, beta [T, Hv]; state [Hv, Dk, Dv], updated in place;
// out [T, Hv, Dv]. Grid (Hv, ceil(Dv / FT_LINEAR_COLUMNS)); block FT_LINEAR_COLUMNS threads, thread x owning the state
// column j = blockIdx.y * FT_LINEAR_COLUMNS + x of value head h = blockIdx.x. The block's columns S[:, j0 ..] live
// in shared memory for the whole T loop (Dk up to FT_LINEAR_MAX_HEAD_DIM = 256 would need 256 registers a thread
// and spill; shared memory is conflict-free as thread x reads word i * FT_LINEAR_COLUMNS + x), read from the state
// once at the start and written back once at the end (coalesced: the block's columns are contiguous in a row of S).
// Per token the block loads q_t and k_t of key head kh = h / (Hv / Hk) into shared memory and reduces their squares
// (block sums); each thread then, with q and k scaled on the fly by rq = rsqrt(|q|^2 + eps) / sqrt(Dk) and
// rk = rsqrt(|k|^2 + eps), eps = FT_LINEAR_L2NORM_EPS:
//   pass 1: S[:, j] *= exp(g); kv = sum_i S[i, j] k[i]                      (decay first, then k^T S)
//   pass 2: delta = beta (v_j - kv); S[i, j] += k[i] delta; out_j = sum_i S[i, j] q[i]
// Batch mode: grid.z = width, state the pool [N, Hv, Dk, Dv].
extern "C" __global__ void __launch_bounds__(FT_LINEAR_COLUMNS)
    gated_delta_rule_f32(const float* __restrict__ qkv, const float* __restrict__ g, const float* __restrict__ beta,
                         float* __restrict__ state_in, float* __restrict__ out, int t_count, int k_heads, int v_heads,
                         int dk, int dv, const int* __restrict__ desc, int width) {
  __shared__ float s[FT_LINEAR_MAX_HEAD_DIM * FT_LINEAR_COLUMNS];
  __shared__ float qs[FT_LINEAR_MAX_HEAD_DIM];
  __shared__ float ks[FT_LINEAR_MAX_HEAD_DIM];
  __shared__ float scratch[32];
  const int h = blockIdx.x;
  const int tid = threadIdx.x;
  const int j = blockIdx.y * FT_LINEAR_COLUMNS + tid;
  const bool live = j < dv;  // threads past Dv still join the block sums
  const int kh = h / (v_heads / k_heads);
  const long long row = 2LL * k_heads * dk + static_cast<long long>(v_heads) * dv;
  const SeqRows seq = seq_rows(desc, width, blockIdx.z, t_count, static_cast<long long>(v_heads) * dk * dv);
  float* sh = state_in + seq.state + static_cast<long long>(h) * dk * dv + j;  // column j of head h, rows dv apart
  for (int i = 0; i < dk; ++i) s[i * FT_LINEAR_COLUMNS + tid] = live ? sh[static_cast<long long>(i) * dv] : 0.0f;
  const float qscale = rsqrtf(static_cast<float>(dk));
  for (int t = seq.lo; t < seq.hi; ++t) {
    const float* qt = qkv + t * row + static_cast<long long>(kh) * dk;
    const float* kt = qt + static_cast<long long>(k_heads) * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < dk; i += blockDim.x) {
      const float qv = qt[i], kv = kt[i];
      qs[i] = qv;
      ks[i] = kv;
      sq = fmaf(qv, qv, sq);
      sk = fmaf(kv, kv, sk);
    }
    sq = ft::block_sum(sq, scratch);  // its barriers also publish qs and ks
    sk = ft::block_sum(sk, scratch);
    const float rq = rsqrtf(sq + FT_LINEAR_L2NORM_EPS) * qscale;
    const float rk = rsqrtf(sk + FT_LINEAR_L2NORM_EPS);
    if (live) {
      const long long th = static_cast<long long>(t) * v_heads + h;
      const float decay = expf(g[th]);
      float kv = 0.0f;
      for (int i = 0; i < dk; ++i) {
        const float v = s[i * FT_LINEAR_COLUMNS + tid] * decay;
        s[i * FT_LINEAR_COLUMNS + tid] = v;
        kv = fmaf(v, ks[i], kv);
      }
      const float vj = qkv[t * row + 2LL * k_heads * dk + static_cast<long long>(h) * dv + j];
      const float delta = beta[th] * (vj - kv * rk) * rk;  // k[i] delta = (ks[i] rk) (beta (v - k^T S))
      float o = 0.0f;
      for (int i = 0; i < dk; ++i) {
        const float v = fmaf(ks[i], delta, s[i * FT_LINEAR_COLUMNS + tid]);
        s[i * FT_LINEAR_COLUMNS + tid] = v;
        o = fmaf(v, qs[i], o);
      }
      out[th * dv + j] = o * rq;
    }
    __syncthreads();  // every thread is done with qs and ks before the next token's overwrite them
  }
  if (live) {
    for (int i = 0; i < dk; ++i) sh[static_cast<long long>(i) * dv] = s[i * FT_LINEAR_COLUMNS + tid];
  }
}

// ---- the chunked (WY) form: gated_delta_chunk_prep_f32, then gated_delta_chunk_scan_f32 --------------------------
// Prefill of T >= LINEAR_CHUNKED_MIN_TOKENS tokens (freetoken/ops/linear_attention.py dispatches; decode and short
// prompts keep the recurrent kernel above). The prompt is cut into chunks of C = FT_LINEAR_CHUNK tokens (the last
// one partial). Per value head h and chunk, t and s tokens of the chunk, with q_t, k_t normalised (q scaled by
// 1/sqrt(Dk)), b_t = beta, G_t = sum_{s <= t} g_s within the chunk and S the state at the chunk's start:
//   A[t, s] = b_t exp(G_t - G_s) (k_t . k_s) for s < t, else 0;    Tb = (I + A)^-1 diag(b)   (unit lower solve)
//   P[t, s] = exp(G_t - G_s) (q_t . k_s) for s <= t, else 0
//   Vn = Tb (V - diag(exp(G)) K S)                 (row t: the recurrence's delta u_t = beta_t (v_t - k_t^T S_t-1))
//   O  = diag(exp(G)) Q S + P Vn
//   S  = exp(G_last) S + K^T diag(exp(G_last - G)) Vn
// Every exponent is <= 0 (g <= 0, s <= t): exp(-G_s) alone, which overflows over a chunk of strong decay, is never
// formed. Tb and P depend on q, k, g and beta alone, so the prep kernel computes them for every chunk at once; only
// the scan over chunks touches the state, and it is sequential over chunks, parallel over the chunk's tokens.
//
// Precision: everything is fp32 on CUDA cores (G in fp64, see the prep kernel). Tensor cores were measured on emu
// (ft::mma_bf16_16816's portable twin) for the prep kernel's K K^T and Q K^T, against the float64 reference at
// T = 150 and 256, Dk 24 and 128: bf16 inputs put the output's error at 1.4e-3 .. 2.4e-3 of its largest value and
// the state's at 2e-5 .. 1.1e-3 of its, fp32 at 1.8e-7 .. 3.6e-7 and 6e-8 .. 2.2e-7 (the recurrent kernel's
// level). Those products are a small part of the work (the prep kernel is parallel over all chunks), so they stay
// fp32; the scan's products read the state and stay fp32 by design.
//
// The scratch the op allocates holds, per (value head, chunk), a record of kRec floats: Tb [C][C], P [C][C] (zero
// above the diagonal and outside the chunk's n tokens) and per token the coefficients (ce, co, cs, cd):
//   ce_t = exp(G_t) rk_t, co_t = exp(G_t) rq_t, cs_t = exp(G_last - G_t) rk_t, cd = exp(G_last)
// with rk_t, rq_t the l2norm scales of k_t and q_t (rq_t including 1/sqrt(Dk)), so the scan reads q and k raw from
// qkv and applies the normalisation and the decays as one factor per token (zero past the chunk's n tokens).
namespace {
constexpr int kChunk = FT_LINEAR_CHUNK;
constexpr int kCols = FT_LINEAR_CHUNK_COLUMNS;
constexpr int kTile = 32;                  // key dims per staged tile of the q/k products
constexpr int kTileLd = kTile + 1;         // [C][kTileLd] tiles: conflict-free down a column and along a row
constexpr int kLd = kChunk + 1;            // [C][kLd] matrices (A, Tb, P, a k tile of the state update)
constexpr int kXLd = kChunk + 8;           // the solve's X [C][kXLd]: the 32 lanes' (j, s) pairs in distinct banks
constexpr int kRec = FT_LINEAR_CHUNK_RECORD;
static_assert(kRec == 2 * kChunk * kChunk + 4 * kChunk, "the record: Tb and P [C][C], 4 coefficients a token");
static_assert(kChunk == 64 && kCols == 16 && FT_LINEAR_CHUNK_THREADS == 4 * kChunk,
              "the thread roles below assume C = 64 tokens, 16 state columns and 256 threads (4 a token)");
static_assert(FT_LINEAR_MAX_HEAD_DIM % 64 == 0, "the state update walks the key dims in tiles of 64");

// The chunk's raw q and k rows (of n tokens) at key dims i0 .. i0 + kTile - 1 into the [C][kTileLd] tiles qt and
// kt, zeros past the n tokens and past Dk. q0, k0: the chunk's first q and k of the key head; row: qkv's row length.
__device__ __forceinline__ void stage_qk_tiles(float* qt, float* kt, const float* q0, const float* k0, long long row,
                                               int n, int i0, int dk) {
  for (int e = threadIdx.x; e < kChunk * kTile; e += blockDim.x) {
    const int t = e / kTile, ii = e % kTile;
    const bool ok = t < n && i0 + ii < dk;
    qt[t * kTileLd + ii] = ok ? q0[t * row + i0 + ii] : 0.0f;
    kt[t * kTileLd + ii] = ok ? k0[t * row + i0 + ii] : 0.0f;
  }
}

// A record's [C][C] matrix (Tb or P) into shared memory as [C][kLd].
__device__ __forceinline__ void stage_square(float* dst, const float* src) {
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) dst[(e / kChunk) * kLd + e % kChunk] = src[e];
}

// acc[c] += sum_{j < count} w[j * stride] rv[j][c0 + c], c < 4, in j order: a row (stride 1) or a column (stride
// kLd) of a staged matrix times the [C][kCols] buffer rv, for the thread's four columns.
__device__ __forceinline__ void fma_rv(float (&acc)[4], const float* w, int stride, int count, const float* rv,
                                       int c0) {
  for (int j = 0; j < count; ++j) {
    const float wj = w[j * stride];
    const float4 u = *reinterpret_cast<const float4*>(rv + j * kCols + c0);
    acc[0] = fmaf(wj, u.x, acc[0]);
    acc[1] = fmaf(wj, u.y, acc[1]);
    acc[2] = fmaf(wj, u.z, acc[2]);
    acc[3] = fmaf(wj, u.w, acc[3]);
  }
}
}  // namespace

// gated_delta_chunk_prep_f32: grid (chunks, Hk), FT_LINEAR_CHUNK_THREADS threads. The block stages the chunk's raw
// q and k of key head kh in tiles of kTile dims and accumulates K K^T and Q K^T (thread (ty, tx) = (tid / 16,
// tid % 16) owns rows ty + 16a and columns tx + 16b, a, b < 4) and the rows' squared norms; then, for each value
// head h of kh's group in turn (the products are shared by the group): G (a serial fp64 sum by one thread),
// the coefficients, P (to the record), A (to shared memory), and the solve X = (I + A)^-1 by forward substitution
// down the columns: warp w solves columns 8w .. 8w + 7, four lanes a column each summing every fourth j of
// X[t, s] = delta_ts - sum_{j < t} A[t, j] X[j, s], reduced by shuffles; Tb = X diag(b) goes to the record.
// Shared memory: 18 KiB (tiles, then X) + 16.3 KiB (A) + 1.3 KiB = 35.5 KiB, at any head dim.
extern "C" __global__ void __launch_bounds__(FT_LINEAR_CHUNK_THREADS)
    gated_delta_chunk_prep_f32(const float* __restrict__ qkv, const float* __restrict__ g,
                               const float* __restrict__ beta, float* __restrict__ rec, int t_count, int k_heads,
                               int v_heads, int dk, int dv) {
  constexpr int kBuf = kChunk * kXLd > 2 * kChunk * kTileLd ? kChunk * kXLd : 2 * kChunk * kTileLd;
  __shared__ __align__(16) float buf[kBuf];  // q and k tiles [C][kTileLd] each; then the solve's X [C][kXLd]
  __shared__ float amat[kChunk * kLd];
  __shared__ double gcum[kChunk];  // G in fp64: see the decays below
  __shared__ float bsh[kChunk], rks[kChunk], rqs[kChunk];
  float* qt = buf;
  float* kt = buf + kChunk * kTileLd;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int chunk = blockIdx.x, kh = blockIdx.y, nchunks = gridDim.x;
  const int t0 = chunk * kChunk, n = min(kChunk, t_count - t0);
  const long long row = 2LL * k_heads * dk + static_cast<long long>(v_heads) * dv;
  const float* q0 = qkv + t0 * row + static_cast<long long>(kh) * dk;
  const float* k0 = q0 + static_cast<long long>(k_heads) * dk;

  float kk[4][4], qk[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.0f;
  float sq = 0.0f;  // threads 0 .. C-1: |q_t|^2 of row t = tid; C .. 2C-1: |k_t|^2 of row t = tid - C
  for (int i0 = 0; i0 < dk; i0 += kTile) {
    stage_qk_tiles(qt, kt, q0, k0, row, n, i0, dk);
    __syncthreads();
    if (tid < 2 * kChunk) {
      const float* r = (tid < kChunk ? qt : kt) + (tid % kChunk) * kTileLd;
      for (int ii = 0; ii < kTile; ++ii) sq = fmaf(r[ii], r[ii], sq);
    }
    for (int ii = 0; ii < kTile; ++ii) {
      float qa[4], ka[4], kb[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        qa[a] = qt[(ty + 16 * a) * kTileLd + ii];
        ka[a] = kt[(ty + 16 * a) * kTileLd + ii];
        kb[a] = kt[(tx + 16 * a) * kTileLd + ii];
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          kk[a][b] = fmaf(ka[a], kb[b], kk[a][b]);
          qk[a][b] = fmaf(qa[a], kb[b], qk[a][b]);
        }
    }
    __syncthreads();  // every thread is done with the tiles before the next overwrite them
  }
  if (tid < kChunk) {
    rqs[tid] = rsqrtf(sq + FT_LINEAR_L2NORM_EPS) * rsqrtf(static_cast<float>(dk));
  } else if (tid < 2 * kChunk) {
    rks[tid - kChunk] = rsqrtf(sq + FT_LINEAR_L2NORM_EPS);
  }

  const int rep = v_heads / k_heads;
  const int lane = tid & 31, warp = tid >> 5, part = lane >> 3, scol = 8 * warp + (lane & 7);
  float* xs = buf;
  for (int h = kh * rep; h < (kh + 1) * rep; ++h) {
    float* rc = rec + (static_cast<long long>(h) * nchunks + chunk) * kRec;
    if (tid < kChunk) {
      const long long th = static_cast<long long>(t0 + tid) * v_heads + h;
      gcum[tid] = tid < n ? g[th] : 0.0f;  // past the chunk's end: no decay, no write
      bsh[tid] = tid < n ? beta[th] : 0.0f;
    }
    __syncthreads();  // also publishes rks and rqs (first head), and ends the previous head's reads of gcum
    // G_t by one thread (64 adds) in fp64, and each decay exp(G_t - G_s) from the fp64 difference: an fp32 G
    // carries the rounding of its magnitude (|G| ~ 100 over a chunk of strong decay: ~1e-5 absolute), which the
    // difference of two nearby tokens keeps while its own magnitude is small, so their decay would be off by ~1e-5
    // relative (measured: 2e-6 of the largest output on emu, 2e-7 with fp64).
    if (tid == 0) {
      double acc = 0.0;
      for (int t = 0; t < kChunk; ++t) {
        acc += gcum[t];
        gcum[t] = acc;
      }
    }
    __syncthreads();
    const double glast = gcum[kChunk - 1];
    if (tid < kChunk) {
      const int t = tid;
      const bool in = t < n;
      const float et = expf(static_cast<float>(gcum[t]));
      float* cf = rc + 2 * kChunk * kChunk + 4 * t;
      cf[0] = in ? et * rks[t] : 0.0f;
      cf[1] = in ? et * rqs[t] : 0.0f;
      cf[2] = in ? expf(static_cast<float>(glast - gcum[t])) * rks[t] : 0.0f;
      cf[3] = expf(static_cast<float>(glast));
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int t = ty + 16 * a;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int s = tx + 16 * b;
        const float d = s <= t ? expf(static_cast<float>(gcum[t] - gcum[s])) : 0.0f;
        amat[t * kLd + s] = s < t ? bsh[t] * d * rks[t] * rks[s] * kk[a][b] : 0.0f;
        rc[kChunk * kChunk + t * kChunk + s] = s <= t && t < n ? d * rqs[t] * rks[s] * qk[a][b] : 0.0f;
      }
    }
    __syncthreads();
    // X[t, s] = delta_ts - sum_{s <= j < t} A[t, j] X[j, s] (X[j, s] = 0 for j < s), t = 0 .. n-1 in order; the
    // loop runs for all lanes (shuffles), and the lane with part 0 writes X[t, s]
    for (int t = 0; t < n; ++t) {
      float acc = 0.0f;
      for (int j = (scol & ~3) + part; j < t; j += 4) acc = fmaf(amat[t * kLd + j], xs[j * kXLd + scol], acc);
      acc += __shfl_xor_sync(FT_FULL_MASK, acc, 8);
      acc += __shfl_xor_sync(FT_FULL_MASK, acc, 16);
      if (part == 0) xs[t * kXLd + scol] = (t == scol ? 1.0f : 0.0f) - acc;
      __syncwarp();
    }
    __syncthreads();
    for (int e = tid; e < kChunk * kChunk; e += blockDim.x) {
      const int t = e / kChunk, s = e % kChunk;
      rc[e] = s <= t && t < n ? xs[t * kXLd + s] * bsh[s] : 0.0f;
    }
    __syncthreads();  // X, A and gcum are rewritten by the next head
  }
}

// gated_delta_chunk_scan_f32: grid (Hv, ceil(Dv / kCols)), FT_LINEAR_CHUNK_THREADS threads; sequential over the
// chunks, with the block's state columns S[:, j0 .. j0 + 16) in shared memory for the whole prompt (fp32; read
// once, written back once). Thread roles: token row r = tid / 4 of the chunk and columns c0 = 4 (tid % 4) .. + 3
// (float4 reads of S and of the [C][16] buffer rv), and for the state update key dim r of each 64-dim tile. Per
// chunk:
//   1. X = K S and Y = Q S (raw q, k in tiles of kTile dims, [C][kTileLd]);
//   2. rv = V - ce X;  Vn = Tb rv  (Tb staged in shared memory)   -> rv
//   3. O = co Y + P Vn            (P staged in shared memory)      -> out
//   4. S = cd S + (cs K)^T Vn     (k tiles [C][kLd] of 64 dims, scaled by cs as they are staged)
// Shared memory: 16 KiB (S, sized for Dk = 256) + 16.5 KiB (tiles, Tb, P) + 4 KiB (rv) + 1 KiB = 37.5 KiB, under
// the 48 KiB of static shared memory (no opt-in) at every head dim.
extern "C" __global__ void __launch_bounds__(FT_LINEAR_CHUNK_THREADS)
    gated_delta_chunk_scan_f32(const float* __restrict__ qkv, const float* __restrict__ rec,
                               float* __restrict__ state, float* __restrict__ out, int t_count, int k_heads,
                               int v_heads, int dk, int dv) {
  constexpr int kBuf = 2 * kChunk * kTileLd;
  static_assert(kBuf >= kChunk * kLd, "buf holds the q, k tiles, then Tb, P and the update's k tiles");
  __shared__ __align__(16) float s[FT_LINEAR_MAX_HEAD_DIM * kCols];
  __shared__ __align__(16) float buf[kBuf];
  __shared__ __align__(16) float rv[kChunk * kCols];
  __shared__ float coef[4 * kChunk];
  float* qt = buf;
  float* kt = buf + kChunk * kTileLd;
  const int tid = threadIdx.x, r = tid >> 2, c0 = 4 * (tid & 3);
  const int h = blockIdx.x, j0 = blockIdx.y * kCols;
  const int kh = h / (v_heads / k_heads);
  const int nchunks = (t_count + kChunk - 1) / kChunk;
  const long long row = 2LL * k_heads * dk + static_cast<long long>(v_heads) * dv;
  float* sh = state + static_cast<long long>(h) * dk * dv + j0;
  for (int e = tid; e < dk * kCols; e += blockDim.x) {
    const int i = e / kCols, c = e % kCols;
    s[e] = j0 + c < dv ? sh[static_cast<long long>(i) * dv + c] : 0.0f;
  }
  for (int chunk = 0; chunk < nchunks; ++chunk) {
    const int t0 = chunk * kChunk, n = min(kChunk, t_count - t0);
    const float* rc = rec + (static_cast<long long>(h) * nchunks + chunk) * kRec;
    const float* q0 = qkv + t0 * row + static_cast<long long>(kh) * dk;
    const float* k0 = q0 + static_cast<long long>(k_heads) * dk;
    coef[tid] = rc[2 * kChunk * kChunk + tid];  // 4 C = blockDim.x coefficients
    // 1. X = K S, Y = Q S for row r, columns c0 .. c0 + 3
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i0 = 0; i0 < dk; i0 += kTile) {
      stage_qk_tiles(qt, kt, q0, k0, row, n, i0, dk);
      __syncthreads();
      const int lim = min(kTile, dk - i0);  // S rows past Dk are never written: stop at Dk
      for (int ii = 0; ii < lim; ++ii) {
        const float4 sv = *reinterpret_cast<const float4*>(s + (i0 + ii) * kCols + c0);
        const float kv = kt[r * kTileLd + ii], qv = qt[r * kTileLd + ii];
        x[0] = fmaf(kv, sv.x, x[0]);
        x[1] = fmaf(kv, sv.y, x[1]);
        x[2] = fmaf(kv, sv.z, x[2]);
        x[3] = fmaf(kv, sv.w, x[3]);
        y[0] = fmaf(qv, sv.x, y[0]);
        y[1] = fmaf(qv, sv.y, y[1]);
        y[2] = fmaf(qv, sv.z, y[2]);
        y[3] = fmaf(qv, sv.w, y[3]);
      }
      __syncthreads();  // done with the tiles (and, after the last, buf is free for Tb)
    }
    // 2. rv = V - ce X, then Vn = Tb rv. Tb and P are zero above the diagonal: warp w's rows 8w .. 8w + 7 stop
    //    at s = 8w + 7 (one bound a warp)
    const float* vrow =
        qkv + static_cast<long long>(t0 + r) * row + 2LL * k_heads * dk + static_cast<long long>(h) * dv;
    const float ce = coef[4 * r], co = coef[4 * r + 1];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = j0 + c0 + c;
      rv[r * kCols + c0 + c] = (r < n && j < dv ? vrow[j] : 0.0f) - ce * x[c];
    }
    stage_square(buf, rc);
    __syncthreads();
    const int smax = min(r | 7, n - 1);
    float vn[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    fma_rv(vn, buf + r * kLd, 1, smax + 1, rv, c0);
    __syncthreads();  // every thread is done with rv and Tb
#pragma unroll
    for (int c = 0; c < 4; ++c) rv[r * kCols + c0 + c] = vn[c];
    stage_square(buf, rc + kChunk * kChunk);
    __syncthreads();
    // 3. O = co Y + P Vn
    float o[4] = {co * y[0], co * y[1], co * y[2], co * y[3]};
    fma_rv(o, buf + r * kLd, 1, smax + 1, rv, c0);
    if (r < n) {
      float* orow = out + (static_cast<long long>(t0 + r) * v_heads + h) * dv;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (j0 + c0 + c < dv) orow[j0 + c0 + c] = o[c];
      }
    }
    // 4. S = cd S + (cs K)^T Vn, key dims i0 + r of each 64-dim tile
    const float cd = coef[3];
    for (int i0 = 0; i0 < dk; i0 += kChunk) {
      __syncthreads();  // buf's readers (P, or the previous k tile) are done
      for (int e = tid; e < kChunk * kChunk; e += blockDim.x) {
        const int t = e / kChunk, ii = e % kChunk;
        buf[t * kLd + ii] = t < n && i0 + ii < dk ? coef[4 * t + 2] * k0[t * row + i0 + ii] : 0.0f;
      }
      __syncthreads();
      const int i = i0 + r;
      if (i < dk) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        fma_rv(acc, buf + r, kLd, n, rv, c0);
        float4* sp = reinterpret_cast<float4*>(s + i * kCols + c0);
        const float4 sv = *sp;
        *sp = make_float4(fmaf(cd, sv.x, acc[0]), fmaf(cd, sv.y, acc[1]), fmaf(cd, sv.z, acc[2]),
                          fmaf(cd, sv.w, acc[3]));
      }
    }
    __syncthreads();  // the next chunk overwrites coef and buf
  }
  for (int e = tid; e < dk * kCols; e += blockDim.x) {
    const int i = e / kCols, c = e % kCols;
    if (j0 + c < dv) sh[static_cast<long long>(i) * dv + c] = s[e];
  }
}

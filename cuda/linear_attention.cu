// linear_attention.cu: Gated DeltaNet's two sequence ops (Qwen3-Next, Qwen3.5-MoE linear attention), float32.
// Contract: freetoken/ops/linear_attention.py; reference: freetoken/testing/reference/linear_attention.py.
//
// short_conv_f32: the causal depthwise convolution of K <= FT_LINEAR_CONV_MAX_TAPS taps with SiLU, continuing from
// its state.
// gated_delta_rule_f32: the gated delta rule over T tokens in its recurrent form (decode, and prefill looped over T),
// continuing from the per-head state S [Dk, Dv].
#include "common.cuh"

// ---- short_conv_f32 ----------------------------------------------------------------------------------------------
// x, out [T, C]; w [C, K]; state [K - 1, C] (oldest first), updated in place. One thread per channel (block:
// FT_LINEAR_CONV_THREADS channels, coalesced over C): the K - 1 state values in registers slide over the T inputs;
// out[t, c] = silu(sum_j w[c, j] u[t + j, c]) with u = concat(state, x); the last K - 1 rows of u are written back.
extern "C" __global__ void __launch_bounds__(FT_LINEAR_CONV_THREADS)
    short_conv_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ state,
                   float* __restrict__ out, int t_count, int channels, int k) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
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
  for (int t = 0; t < t_count; ++t) {
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
extern "C" __global__ void __launch_bounds__(FT_LINEAR_COLUMNS)
    gated_delta_rule_f32(const float* __restrict__ qkv, const float* __restrict__ g, const float* __restrict__ beta,
                         float* __restrict__ state, float* __restrict__ out, int t_count, int k_heads, int v_heads,
                         int dk, int dv) {
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
  float* sh = state + static_cast<long long>(h) * dk * dv + j;  // column j of head h, rows dv apart
  for (int i = 0; i < dk; ++i) s[i * FT_LINEAR_COLUMNS + tid] = live ? sh[static_cast<long long>(i) * dv] : 0.0f;
  const float qscale = rsqrtf(static_cast<float>(dk));
  for (int t = 0; t < t_count; ++t) {
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

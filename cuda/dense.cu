// dense.cu: decode GEMV of the decoder's dense projections (attention q/k/v/o, routers, shared experts, dense
// MLPs, lm_head) with the weights in their checkpoint storage: y[T, N] = x[T, K] . W[N, K]^T (+ bias[N]).
//
// Memory bound (two flops per weight and token), so every weight is read once per call for all T <= 8 tokens.
// Grid ceil(N / DENSE_WARPS) blocks of DENSE_WARPS warps; warp w of block b owns output row b * DENSE_WARPS + w.
// Vector path (K a multiple of the vector width, W and x 16-byte aligned): lane l reads 16-byte chunks
// l, l + 32, ... of the row (8 bf16/f16 or 4 f32 weights; two chunks in flight per lane), widens them in
// registers and multiplies them with the matching x elements of every token (float4 loads, L1/L2-resident).
// Scalar path otherwise: lane l reads elements l, l + 32, ... Each lane accumulates in fp32 (fmaf, fixed
// order), a butterfly warp_sum combines the lanes, lane 0 adds the bias and writes the T outputs of the row.
// The summation order depends only on (K, alignment): results are deterministic.
//
// Kernels (extern "C"): dense_gemv_bf16 (W as uint16 bf16 bits), dense_gemv_f16 (IEEE half), dense_gemv_f32;
// parameters (w, x, bias, has_bias, y, T, N, K). bias is read only when has_bias != 0.
#include <cuda_fp16.h>

#include "common.cuh"

#define DENSE_WARPS 4  // warps (rows) per block (_WARPS in freetoken/ops/dense.py)
#define DENSE_MAX_T 8  // tokens per call (MAX_TOKENS in freetoken/ops/dense.py)

namespace {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// Per-storage weight access: the element type, the elements per 16-byte vector, one element and one vector
// widened to float.
struct Bf16W {
  using T = unsigned short;
  static constexpr int kVec = 8;
  __device__ static float one(T b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }
  __device__ static void vec(const T* p, float* out) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  }
};

struct F16W {
  using T = unsigned short;  // IEEE half bits
  static constexpr int kVec = 8;
  __device__ static float one(T b) { return __half2float(__ushort_as_half(b)); }
  __device__ static void vec(const T* p, float* out) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2_raw raw;
      raw.x = static_cast<unsigned short>(words[i] & 0xFFFFu);
      raw.y = static_cast<unsigned short>(words[i] >> 16);
      const float2 f = __half22float2(__half2(raw));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

struct F32W {
  using T = float;
  static constexpr int kVec = 4;
  __device__ static float one(T v) { return v; }
  __device__ static void vec(const T* p, float* out) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = q.x;
    out[1] = q.y;
    out[2] = q.z;
    out[3] = q.w;
  }
};

// acc += w[0..V) . x[0..V) in order (x 16-byte aligned, V a multiple of 4).
template <int V>
__device__ __forceinline__ float dot_chunk(const float* w, const float* __restrict__ x, float acc) {
#pragma unroll
  for (int j = 0; j < V; j += 4) {
    const float4 xv = *reinterpret_cast<const float4*>(x + j);
    acc = fmaf(w[j], xv.x, acc);
    acc = fmaf(w[j + 1], xv.y, acc);
    acc = fmaf(w[j + 2], xv.z, acc);
    acc = fmaf(w[j + 3], xv.w, acc);
  }
  return acc;
}

// One warp: output row `row` for NT tokens.
template <class W, int NT>
__device__ __forceinline__ void dense_row(const typename W::T* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ bias, int has_bias, float* __restrict__ y,
                                          int row, int n, int k, bool vec) {
  constexpr int V = W::kVec;
  const int lane = threadIdx.x & 31;
  const typename W::T* wr = w + static_cast<size_t>(row) * k;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  if (vec) {
    const int chunks = k / V;
    int c = lane;
    for (; c + 32 < chunks; c += 64) {  // two 16-byte loads in flight per lane
      float wa[V], wb[V];
      W::vec(wr + static_cast<size_t>(c) * V, wa);
      W::vec(wr + static_cast<size_t>(c + 32) * V, wb);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float* xt = x + static_cast<size_t>(t) * k;
        acc[t] = dot_chunk<V>(wa, xt + static_cast<size_t>(c) * V, acc[t]);
        acc[t] = dot_chunk<V>(wb, xt + static_cast<size_t>(c + 32) * V, acc[t]);
      }
    }
    if (c < chunks) {
      float wa[V];
      W::vec(wr + static_cast<size_t>(c) * V, wa);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        acc[t] = dot_chunk<V>(wa, x + static_cast<size_t>(t) * k + static_cast<size_t>(c) * V, acc[t]);
      }
    }
  } else {
    for (int i = lane; i < k; i += 32) {
      const float v = W::one(wr[i]);
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[t] = fmaf(v, x[static_cast<size_t>(t) * k + i], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = ft::warp_sum(acc[t]);
  if (lane == 0) {
    const float b = has_bias ? bias[row] : 0.0f;
#pragma unroll
    for (int t = 0; t < NT; ++t) y[static_cast<size_t>(t) * n + row] = acc[t] + b;
  }
}

template <class W>
__device__ __forceinline__ void dense_gemv(const typename W::T* __restrict__ w, const float* __restrict__ x,
                                           const float* __restrict__ bias, int has_bias, float* __restrict__ y,
                                           int t, int n, int k) {
  const int row = blockIdx.x * DENSE_WARPS + (threadIdx.x >> 5);
  if (row >= n) return;  // the whole warp: no collective is left waiting
  const bool vec = k % W::kVec == 0 && aligned16(w) && aligned16(x);
  switch (t) {
    case 1: dense_row<W, 1>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 2: dense_row<W, 2>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 3: dense_row<W, 3>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 4: dense_row<W, 4>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 5: dense_row<W, 5>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 6: dense_row<W, 6>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case 7: dense_row<W, 7>(w, x, bias, has_bias, y, row, n, k, vec); break;
    case DENSE_MAX_T: dense_row<W, DENSE_MAX_T>(w, x, bias, has_bias, y, row, n, k, vec); break;
    default: break;  // the host refuses T outside [1, DENSE_MAX_T]
  }
}

}  // namespace

#define FT_DENSE_GEMV(NAME, W, WT)                                                                              \
  extern "C" __global__ void __launch_bounds__(DENSE_WARPS * 32) dense_gemv_##NAME(                             \
      const WT* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias, int has_bias,       \
      float* __restrict__ y, int t, int n, int k) {                                                              \
    dense_gemv<W>(w, x, bias, has_bias, y, t, n, k);                                                             \
  }

FT_DENSE_GEMV(bf16, Bf16W, unsigned short)
FT_DENSE_GEMV(f16, F16W, unsigned short)
FT_DENSE_GEMV(f32, F32W, float)

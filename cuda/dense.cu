// dense.cu: decode GEMV of the decoder's dense projections (attention q/k/v/o, routers, shared experts, dense
// MLPs, lm_head) with the weights in their checkpoint storage: y[T, N] = x[T, K] . W[N, K]^T (+ bias[N]).
//
// Memory bound (two flops per weight and token), so every weight is read once per call for all T <= 8 tokens.
// Grid ceil(N / FT_DENSE_WARPS) blocks of FT_DENSE_WARPS warps; warp w of block b owns output row b * FT_DENSE_WARPS + w.
// Vector path (K a multiple of the vector width, W and x 16-byte aligned): lane l reads 16-byte chunks
// l, l + 32, ... of the row (8 bf16/f16 or 4 f32 weights; two chunks in flight per lane), widens them in
// registers and multiplies them with the matching x elements of every token (float4 loads, L1/L2-resident).
// Scalar path otherwise: lane l reads elements l, l + 32, ... Each lane accumulates in fp32 (fmaf, fixed
// order), a butterfly warp_sum combines the lanes, lane 0 adds the bias and writes the T outputs of the row.
// The summation order depends only on (K, alignment): results are deterministic.
//
// Kernels (extern "C"): dense_gemv_bf16 (W as uint16 bf16 bits), dense_gemv_f16 (IEEE half), dense_gemv_f32;
// parameters (w, x, bias, has_bias, y, T, N, K). bias is read only when has_bias != 0.
//
// GGUF block-quantized W, the file's blocks verbatim: dense_gemv_<storage> for q8_0 and q4_0 (blocks of 32
// weights, 34 / 18 bytes), q4_k, q5_k, q6_k and iq4_xs (super-blocks of 256 weights, 144 / 176 / 210 / 136 bytes);
// W is uint8 [N, K / block weights * block bytes], K a multiple of the block's weights, same parameters. The blocks
// are decoded by cuda/kquant.cuh (the expert kernels' decoders; exact float32 values). One warp per row as above;
// lane l decodes the row's 32-weight chunks l, l + 32, ... in registers and dots each with x per token (fmaf, fixed
// order), adding the chunk's sum to its accumulator. Loads are as wide as the blocks' alignment allows when W's base
// has it (16 bytes for Q4_K / Q5_K, 8 for IQ4_XS, 16-bit words for the 2-byte aligned 34-, 18- and 210-byte
// blocks); an offset view whose base does not reads bytes.
// dense_dequant_<storage> (w, out, N, K): the float32 matrix [N, K] (exact), one thread per 32-weight chunk (the
// chunked product of T > FT_DENSE_MAX_T tokens).
//
// Block-FP8 rows (dense_gemv_fp8_block, same parameters; freetoken/models/qmatrix.py): W is uint8
// [N, K + 4 * ceil(K/128)], each row its ceil(K/128) float32 scales, then its K e4m3fn codes; w[j] =
// e4m3(code j) * scale[j / 128]; K a multiple of 16. One warp per row; per step lane l reads the kBytes codes at
// l * kBytes of the warp's next 32 * kBytes (16-byte loads when every row's codes are 16-byte aligned: K a multiple
// of 512 and W aligned; else 4-byte words, else bytes), dots them with x per token (fmaf, fixed order) and adds the
// sum times its block's scale (a lane's codes never straddle a 128-block). dense_dequant_fp8_block (w, out, N, K):
// one thread per 16 codes, e4m3 * scale rounded once.
#include <cuda_fp16.h>

#include "common.cuh"
#include "kquant.cuh"
#include "numeric.cuh"

// FT_DENSE_WARPS (warps = rows per block) and FT_DENSE_MAX_T (tokens per call) come from freetoken/ops/constants.py.

namespace {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// The call's token count t (1..FT_DENSE_MAX_T; the host refuses others) as the compile-time NT of ROW(NT), a row
// call: each count its own unrolled row code.
#define FT_WITH_TOKENS(t, ROW)           \
  switch (t) {                           \
    case 1: ROW(1); break;               \
    case 2: ROW(2); break;               \
    case 3: ROW(3); break;               \
    case 4: ROW(4); break;               \
    case 5: ROW(5); break;               \
    case 6: ROW(6); break;               \
    case 7: ROW(7); break;               \
    case FT_DENSE_MAX_T: ROW(FT_DENSE_MAX_T); break; \
    default: break;                      \
  }

// The end of a warp's row: each token's lane sums added up, lane 0 adds the bias and writes the NT outputs.
template <int NT>
__device__ __forceinline__ void store_row(float (&acc)[NT], const float* __restrict__ bias, int has_bias,
                                          float* __restrict__ y, int row, int n) {
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = ft::warp_sum(acc[t]);
  if ((threadIdx.x & 31) == 0) {
    const float b = has_bias ? bias[row] : 0.0f;
#pragma unroll
    for (int t = 0; t < NT; ++t) y[static_cast<size_t>(t) * n + row] = acc[t] + b;
  }
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
  store_row<NT>(acc, bias, has_bias, y, row, n);
}

template <class W>
__device__ __forceinline__ void dense_gemv(const typename W::T* __restrict__ w, const float* __restrict__ x,
                                           const float* __restrict__ bias, int has_bias, float* __restrict__ y,
                                           int t, int n, int k) {
  const int row = blockIdx.x * FT_DENSE_WARPS + (threadIdx.x >> 5);
  if (row >= n) return;  // the whole warp: no collective is left waiting
  const bool vec = k % W::kVec == 0 && aligned16(w) && aligned16(x);
#define FT_ROW(NT) dense_row<W, NT>(w, x, bias, has_bias, y, row, n, k, vec)
  FT_WITH_TOKENS(t, FT_ROW)
#undef FT_ROW
}

}  // namespace

#define FT_DENSE_GEMV(NAME, W, WT)                                                                              \
  extern "C" __global__ void __launch_bounds__(FT_DENSE_WARPS * 32) dense_gemv_##NAME(                             \
      const WT* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias, int has_bias,       \
      float* __restrict__ y, int t, int n, int k) {                                                              \
    dense_gemv<W>(w, x, bias, has_bias, y, t, n, k);                                                             \
  }

FT_DENSE_GEMV(bf16, Bf16W, unsigned short)
FT_DENSE_GEMV(f16, F16W, unsigned short)
FT_DENSE_GEMV(f32, F32W, float)

// ---- GGUF blocks (kquant.cuh) ----------------------------------------------------------------------------------

namespace {

// A whole GGUF block: its header and quants at their file offsets (kquant.cuh's format structs).
template <class Q>
struct Block {
  static constexpr int kBytes = Q::kHeaderBytes + Q::kQuantBytes, kChunks = Q::kWeights / 32;
  // The alignment every block, header and quant field keeps when W's base has it (Q4_K / Q5_K 16, IQ4_XS 8,
  // Q8_0 / Q4_0 / Q6_K 2).
  static constexpr int kAlign = ft::gguf::align_of(kBytes | Q::kHeaderOffset | Q::kQuantOffset);

  // Chunk c (32 weights) of the block at blk, read with loads as wide as alignment A allows.
  template <int A>
  __device__ static void chunk(const unsigned char* blk, int c, float* out) {
    Q::template chunk<A, A>(blk + Q::kHeaderOffset, blk + Q::kQuantOffset, c, out);
  }
};

// One warp: output row `row` for NT tokens. Lane l decodes the row's 32-weight chunks l, l + 32, ... (a warp reads
// 1024 consecutive weights per step: 32 blocks of 32 or 4 super-blocks of 256), dots each with x per token (fmaf,
// fixed order) and adds the chunk's sum to its accumulator. Each lane's 32 floats of x are 128 bytes of their own,
// so a warp's x load touches 32 cache lines: with x 16-byte aligned (xvec) they are read as 8 float4 loads instead
// of 32 scalar ones (the same products in the same order: bit-identical sums). On an H200 this kernel ran at 3-6%
// of the copy bandwidth with scalar x loads (bench/GPU_RESULTS.md).
template <class Q, int NT, int A>
__device__ __forceinline__ void gguf_row(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                         const float* __restrict__ bias, int has_bias, float* __restrict__ y, int row,
                                         int n, int k, bool xvec) {
  using B = Block<Q>;
  const int lane = threadIdx.x & 31;
  const int chunks = k / 32;
  const unsigned char* wr = w + static_cast<size_t>(row) * (k / Q::kWeights) * B::kBytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int c = lane; c < chunks; c += 32) {
    float v[32];
    B::template chunk<A>(wr + static_cast<size_t>(c / B::kChunks) * B::kBytes, c % B::kChunks, v);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + static_cast<size_t>(t) * k + static_cast<size_t>(c) * 32;
      float s = 0.0f;
      if (xvec) {
        s = dot_chunk<32>(v, xt, s);
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) s = fmaf(v[j], __ldg(xt + j), s);
      }
      acc[t] += s;
    }
  }
  store_row<NT>(acc, bias, has_bias, y, row, n);
}

template <class Q, int A>
__device__ __forceinline__ void gguf_dispatch(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                              const float* __restrict__ bias, int has_bias, float* __restrict__ y,
                                              int t, int row, int n, int k) {
  const bool xvec = aligned16(x);  // K is a multiple of 32, so every token's row and chunk stays aligned too
#define FT_ROW(NT) gguf_row<Q, NT, A>(w, x, bias, has_bias, y, row, n, k, xvec)
  FT_WITH_TOKENS(t, FT_ROW)
#undef FT_ROW
}

// W's base aligned as the format's blocks are (any allocation): the widest loads; else (an offset view) bytes.
template <class Q>
__device__ __forceinline__ bool gguf_aligned(const unsigned char* w) {
  return (reinterpret_cast<unsigned long long>(w) % Block<Q>::kAlign) == 0ull;
}

template <class Q>
__device__ __forceinline__ void gguf_gemv(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ bias, int has_bias, float* __restrict__ y, int t,
                                          int n, int k) {
  const int row = blockIdx.x * FT_DENSE_WARPS + (threadIdx.x >> 5);
  if (row >= n) return;  // the whole warp: no collective is left waiting
  if (gguf_aligned<Q>(w)) {
    gguf_dispatch<Q, Block<Q>::kAlign>(w, x, bias, has_bias, y, t, row, n, k);
  } else {
    gguf_dispatch<Q, 1>(w, x, bias, has_bias, y, t, row, n, k);
  }
}

// One thread per 32-weight chunk; rows are contiguous, so chunk i of the matrix is chunk i % kChunks of block
// i / kChunks and goes to out[32 i ..].
template <class Q>
__device__ __forceinline__ void gguf_dequant(const unsigned char* __restrict__ w, float* __restrict__ out, int n,
                                             int k) {
  using B = Block<Q>;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(n) * (k / 32)) return;
  const unsigned char* blk = w + static_cast<size_t>(i / B::kChunks) * B::kBytes;
  const int c = static_cast<int>(i % B::kChunks);
  float v[32];
  if (gguf_aligned<Q>(w)) {
    B::template chunk<B::kAlign>(blk, c, v);
  } else {
    B::template chunk<1>(blk, c, v);
  }
  float* o = out + static_cast<size_t>(i) * 32;
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j] = v[j];
}

}  // namespace

#define FT_GGUF_DENSE(NAME, Q)                                                                                  \
  extern "C" __global__ void __launch_bounds__(FT_DENSE_WARPS * 32) dense_gemv_##NAME(                             \
      const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias,          \
      int has_bias, float* __restrict__ y, int t, int n, int k) {                                               \
    gguf_gemv<Q>(w, x, bias, has_bias, y, t, n, k);                                                              \
  }                                                                                                              \
  extern "C" __global__ void dense_dequant_##NAME(const unsigned char* __restrict__ w, float* __restrict__ out,  \
                                                  int n, int k) {                                                \
    gguf_dequant<Q>(w, out, n, k);                                                                               \
  }

FT_GGUF_DENSE(q8_0, ft::gguf::Q8_0)
FT_GGUF_DENSE(q4_0, ft::gguf::Q4_0)
FT_GGUF_DENSE(q4_k, ft::gguf::Q4_K)
FT_GGUF_DENSE(q5_k, ft::gguf::Q5_K)
FT_GGUF_DENSE(q6_k, ft::gguf::Q6_K)
FT_GGUF_DENSE(iq4_xs, ft::gguf::IQ4_XS)

// ---- block-FP8 rows ----------------------------------------------------------------------------------------

namespace {

// kBytes consecutive e4m3 codes at p (aligned to kBytes) as floats.
template <int kBytes>
__device__ __forceinline__ void fp8_codes(const unsigned char* p, float* v) {
  if constexpr (kBytes == 16) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = ft::e4m3_to_float((words[i / 4] >> (8 * (i % 4))) & 0xFFu);
  } else if constexpr (kBytes == 4) {
    const unsigned u = __ldg(reinterpret_cast<const unsigned*>(p));
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = ft::e4m3_to_float((u >> (8 * i)) & 0xFFu);
  } else {
    v[0] = ft::e4m3_to_float(__ldg(p));
  }
}

// The row's b-th float32 scale (little-endian at the row's start; read as a word when W is 4-byte aligned).
template <bool kWord>
__device__ __forceinline__ float fp8_row_scale(const unsigned char* row, int b) {
  if (kWord) return __ldg(reinterpret_cast<const float*>(row) + b);
  const unsigned char* p = row + 4 * b;
  return __uint_as_float(static_cast<unsigned>(__ldg(p)) | (static_cast<unsigned>(__ldg(p + 1)) << 8) |
                         (static_cast<unsigned>(__ldg(p + 2)) << 16) | (static_cast<unsigned>(__ldg(p + 3)) << 24));
}

// One warp: output row `row` for NT tokens, whose x values are xg[t * xs + j] (xg: the row's group's first).
template <int NT, int kBytes>
__device__ __forceinline__ void fp8dense_row(const unsigned char* __restrict__ w, const float* __restrict__ xg,
                                             size_t xs, const float* __restrict__ bias, int has_bias,
                                             float* __restrict__ y, int row, int n, int k) {
  constexpr bool kWord = kBytes >= 4;
  const int lane = threadIdx.x & 31;
  const int nkb = (k + 127) / 128;
  const unsigned char* wr = w + static_cast<size_t>(row) * (static_cast<size_t>(k) + 4u * nkb);
  const unsigned char* codes = wr + 4 * nkb;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int j0 = lane * kBytes; j0 < k; j0 += 32 * kBytes) {
    float v[kBytes];
    fp8_codes<kBytes>(codes + j0, v);
    const float s = fp8_row_scale<kWord>(wr, j0 / 128);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float* xt = xg + static_cast<size_t>(t) * xs + j0;
      float c = 0.0f;
#pragma unroll
      for (int i = 0; i < kBytes; ++i) c = fmaf(v[i], __ldg(xt + i), c);
      acc[t] = fmaf(s, c, acc[t]);
    }
  }
  store_row<NT>(acc, bias, has_bias, y, row, n);
}

template <int kBytes>
__device__ __forceinline__ void fp8dense_dispatch(const unsigned char* __restrict__ w, const float* __restrict__ xg,
                                                  size_t xs, const float* __restrict__ bias, int has_bias,
                                                  float* __restrict__ y, int t, int row, int n, int k) {
#define FT_ROW(NT) fp8dense_row<NT, kBytes>(w, xg, xs, bias, has_bias, y, row, n, k)
  FT_WITH_TOKENS(t, FT_ROW)
#undef FT_ROW
}

// The warp's row of y [T, N] = x . W^T, each group of `group_rows` consecutive rows reading its own K values of x
// [T, N / group_rows, K] (group_rows = N: a plain product, x [T, K]).
__device__ __forceinline__ void fp8_gemv(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                         const float* __restrict__ bias, int has_bias, float* __restrict__ y, int t,
                                         int n, int k, int group_rows) {
  const int row = blockIdx.x * FT_DENSE_WARPS + (threadIdx.x >> 5);
  if (row >= n) return;  // the whole warp: no collective is left waiting
  const float* xg = x + static_cast<size_t>(row / group_rows) * k;
  const size_t xs = static_cast<size_t>(n / group_rows) * k;
  const unsigned long long base = reinterpret_cast<unsigned long long>(w);
  const int nkb = (k + 127) / 128;
  if (aligned16(w) && nkb % 4 == 0) {  // with K % 16 == 0 (the host's check) every row's codes are aligned too
    fp8dense_dispatch<16>(w, xg, xs, bias, has_bias, y, t, row, n, k);
  } else if ((base & 3ull) == 0ull) {
    fp8dense_dispatch<4>(w, xg, xs, bias, has_bias, y, t, row, n, k);  // rows are whole words: K % 16 == 0
  } else {
    fp8dense_dispatch<1>(w, xg, xs, bias, has_bias, y, t, row, n, k);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FT_DENSE_WARPS * 32) dense_gemv_fp8_block(
    const unsigned char* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias, int has_bias,
    float* __restrict__ y, int t, int n, int k) {
  fp8_gemv(w, x, bias, has_bias, y, t, n, k, n);
}

// Grouped: y [T, G, N/G] from x [T, G, K] and W [N, K + 4 * ceil(K/128)], rows g * group_rows .. + group_rows
// reading x's group g (the per-head products of latent attention's absorbed kv_b_proj in one launch). No bias.
extern "C" __global__ void __launch_bounds__(FT_DENSE_WARPS * 32) dense_grouped_fp8_block(
    const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int t, int n, int k,
    int group_rows) {
  fp8_gemv(w, x, x, 0, y, t, n, k, group_rows);
}

extern "C" __global__ void dense_dequant_fp8_block(const unsigned char* __restrict__ w, float* __restrict__ out,
                                                   int n, int k) {
  const int chunks = k / 16;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(n) * chunks) return;
  const int row = static_cast<int>(i / chunks), j0 = static_cast<int>(i % chunks) * 16;
  const int nkb = (k + 127) / 128;
  const unsigned char* wr = w + static_cast<size_t>(row) * (static_cast<size_t>(k) + 4u * nkb);
  const float s = fp8_row_scale<false>(wr, j0 / 128);
  float* o = out + static_cast<size_t>(row) * k + j0;
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j] = ft::e4m3_to_float(__ldg(wr + 4 * nkb + j0 + j)) * s;
}

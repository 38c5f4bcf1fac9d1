// kv.cuh: the storage kinds of the paged KV cache (the contract of freetoken/testing/reference/paged_attention.py).
//
// A pool is [num_blocks, block_size, Hkv, D] of the kind's element type; position p of a sequence lives in pool block
// table[p / block_size], row p % block_size. fp8 rows carry one float32 scale per (block, row, kv head) (amax / 448).
// ft::Kv<KIND>::T is the element type, load() widens one element (times the row scale for fp8), store() encodes one;
// ft::kv_load() widens an element of a kind known at run time.
#pragma once

#include "common.cuh"
#include "numeric.cuh"

// FT_KV_FP8_MAX (448, the largest e4m3fn magnitude) and the kind codes FT_KV_F32 ... FT_KV_FP8 (the kernels' `kind`
// argument) come from freetoken/device/constants.py.

namespace ft {

enum KvKind { KV_F32 = FT_KV_F32, KV_F16 = FT_KV_F16, KV_BF16 = FT_KV_BF16, KV_FP8 = FT_KV_FP8 };

template <int KIND>
struct Kv;

template <>
struct Kv<KV_F32> {
  using T = float;
  static constexpr bool scaled = false;
  __device__ static float load(const T* p, long long i, float) { return p[i]; }
  __device__ static T store(float v, float) { return v; }
};

template <>
struct Kv<KV_F16> {
  using T = unsigned short;  // IEEE half bits
  static constexpr bool scaled = false;
  __device__ static float load(const T* p, long long i, float) { return f16_bits_to_float(p[i]); }
  __device__ static T store(float v, float) { return float_to_f16_bits(v); }
};

template <>
struct Kv<KV_BF16> {
  using T = unsigned short;  // bf16 bits
  static constexpr bool scaled = false;
  __device__ static float load(const T* p, long long i, float) { return bf16_bits_to_float(p[i]); }
  __device__ static T store(float v, float) { return float_to_bf16_bits(v); }
};

template <>
struct Kv<KV_FP8> {
  using T = unsigned char;  // e4m3fn codes
  static constexpr bool scaled = true;
  __device__ static float load(const T* p, long long i, float scale) { return e4m3_to_float(p[i]) * scale; }
  // v / scale (IEEE division, as the host's float32 numpy), saturated to +-448 by the conversion
  __device__ static T store(float v, float scale) { return float_to_e4m3(v / scale); }
};

// One element of a pool of any kind, widened (the kind is a kernel argument: one build serves the four; the branch
// is uniform across the block). `scale`: the row's fp8 scale (ignored by the other kinds).
__device__ __forceinline__ float kv_load(int kind, const void* pool, long long i, float scale) {
  switch (kind) {
    case KV_F32: return Kv<KV_F32>::load(static_cast<const float*>(pool), i, scale);
    case KV_F16: return Kv<KV_F16>::load(static_cast<const unsigned short*>(pool), i, scale);
    case KV_BF16: return Kv<KV_BF16>::load(static_cast<const unsigned short*>(pool), i, scale);
    default: return Kv<KV_FP8>::load(static_cast<const unsigned char*>(pool), i, scale);
  }
}

// Index of (position p, kv head h) in a pool's [blocks * block_size * Hkv] rows (times D: its first element).
__device__ __forceinline__ long long kv_row(const int* __restrict__ table, int p, int block_size, int Hkv, int h) {
  return (static_cast<long long>(table[p / block_size]) * block_size + p % block_size) * Hkv + h;
}

}  // namespace ft

// rope.cu: rotary position embedding (HF convention), one thread per output element.
//
// out[t, h, i] = x[t, h, i] * cos[t, i] + rotate_half(x)[t, h, i] * sin[t, i], rotate_half(x) = concat(-x2, x1) over
// the two halves of the head dimension d (even). x, out [T, heads, d]; cos, sin [T, d]; out must not alias x.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) rope_f32(const float* __restrict__ x, const float* __restrict__ cos_t,
                                                          const float* __restrict__ sin_t, float* __restrict__ out,
                                                          long long n, int heads, int d) {
  const long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const int half = d >> 1;
  const int i = static_cast<int>(e % d);
  const long long t = e / (static_cast<long long>(heads) * d);
  const float rot = i < half ? -x[e + half] : x[e - half];
  out[e] = x[e] * cos_t[t * d + i] + rot * sin_t[t * d + i];
}

// rope_qkv_cache_f32: a fused q/k/v projection into attention's inputs. qkv [T, H + 2 Hkv, d]; block (t, head):
// q and k heads (head < H + Hkv) RMS-normed with norm [H + Hkv, d] when use_norm (rms_norm_f32's arithmetic: launch
// with its block size) and rotated as rope_f32 rotates, q heads into q [T, H, d], k heads into k_cache[start + t];
// v heads (head >= H + Hkv) copied into v_cache[start + t]. Caches [rows, Hkv, d]; d <= FT_NORM_THREADS * 4.
extern "C" __global__ void __launch_bounds__(FT_NORM_THREADS) rope_qkv_cache_f32(
    const float* __restrict__ qkv, const float* __restrict__ norm, int use_norm, float eps,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, float* __restrict__ k_cache,
    float* __restrict__ v_cache, int start, float* __restrict__ q, int heads, int kv_heads, int d) {
  __shared__ float scratch[32];
  __shared__ float xs[4 * FT_NORM_THREADS];
  const int t = blockIdx.x, h = blockIdx.y;
  const int nqk = heads + kv_heads;
  const float* x = qkv + (static_cast<long long>(t) * (nqk + kv_heads) + h) * d;
  const long long cache_row = (static_cast<long long>(start) + t) * kv_heads;
  if (h >= nqk) {  // a v head: copied (uniform across the block)
    float* dst = v_cache + (cache_row + (h - nqk)) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = x[i];
    return;
  }
  if (use_norm) {  // uniform
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) acc = fmaf(x[i], x[i], acc);
    acc = ft::block_sum(acc, scratch);
    const float scale = rsqrtf(acc / static_cast<float>(d) + eps);
    const float* w = norm + static_cast<long long>(h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) xs[i] = x[i] * scale * w[i];
  } else {
    for (int i = threadIdx.x; i < d; i += blockDim.x) xs[i] = x[i];
  }
  __syncthreads();
  float* out = h < heads ? q + (static_cast<long long>(t) * heads + h) * d : k_cache + (cache_row + (h - heads)) * d;
  const int half = d >> 1;
  const float* c = cos_t + static_cast<long long>(t) * d;
  const float* s = sin_t + static_cast<long long>(t) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float rot = i < half ? -xs[i + half] : xs[i - half];
    out[i] = xs[i] * c[i] + rot * s[i];
  }
}

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

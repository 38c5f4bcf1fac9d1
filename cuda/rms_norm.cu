// rms_norm.cu: RMSNorm of each row (HF LlamaRMSNorm, fp32), one block per row; add_rms_norm_f32: the residual
// add fused with it.
//
// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w[r % wrows] for x, out [rows, d] and w [wrows, d] float32: a weight
// of the trailing axes of x ([d], or [heads, d] for per-head norms over x [T, heads, d]) repeats every wrows rows.
#include "common.cuh"

// Block: a multiple of 32 threads, at most FT_NORM_THREADS; grid: one block per row.
extern "C" __global__ void __launch_bounds__(FT_NORM_THREADS) rms_norm_f32(const float* __restrict__ x,
                                                                        const float* __restrict__ w,
                                                                        float* __restrict__ out, int rows, int d,
                                                                        int wrows, float eps) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;  // uniform across the block
  const float* xr = x + static_cast<long long>(row) * d;
  const float* wr = w + static_cast<long long>(row % wrows) * d;
  float* yr = out + static_cast<long long>(row) * d;
  float acc = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) acc = fmaf(xr[i], xr[i], acc);
  acc = ft::block_sum(acc, scratch);
  const float scale = rsqrtf(acc / static_cast<float>(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * scale * wr[i];
}

// add_rms_norm_f32: the residual add and the next norm: x[r] += y[r] (in place), then out[r] = rms_norm(x[r]) as
// rms_norm_f32 computes it (same block shape, same sums). Each thread adds the elements it later reads back itself.
extern "C" __global__ void __launch_bounds__(FT_NORM_THREADS) add_rms_norm_f32(float* __restrict__ x,
                                                                            const float* __restrict__ y,
                                                                            const float* __restrict__ w,
                                                                            float* __restrict__ out, int rows, int d,
                                                                            int wrows, float eps) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;  // uniform across the block
  float* xr = x + static_cast<long long>(row) * d;
  const float* yr = y + static_cast<long long>(row) * d;
  const float* wr = w + static_cast<long long>(row % wrows) * d;
  float* outr = out + static_cast<long long>(row) * d;
  float acc = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = xr[i] + yr[i];
    xr[i] = v;
    acc = fmaf(v, v, acc);
  }
  acc = ft::block_sum(acc, scratch);
  const float scale = rsqrtf(acc / static_cast<float>(d) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) outr[i] = xr[i] * scale * wr[i];
}

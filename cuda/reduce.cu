// reduce.cu: row sums, one block per row: a block reduction through shared memory.
#include "common.cuh"

// x [rows, cols] float32 row-major -> out [rows]. Block size: a multiple of 32, at most 1024.
extern "C" __global__ void __launch_bounds__(1024) reduce_rows_f32(const float* __restrict__ x,
                                                                   float* __restrict__ out, int rows, int cols) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;  // uniform across the block: no barrier divergence
  const float* xr = x + static_cast<long long>(row) * cols;
  float acc = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += xr[c];
  acc = ft::block_sum(acc, scratch);
  if (threadIdx.x == 0) out[row] = acc;
}

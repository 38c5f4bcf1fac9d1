// Deliberately broken kernels: the emu device must report each one, naming the kernel, and never hang.

// Threads with threadIdx.x >= cut return before the barrier the others wait at.
extern "C" __global__ void divergent_barrier(float* x, int cut) {
  if (threadIdx.x >= cut) return;
  x[threadIdx.x] = 1.0f;
  __syncthreads();
  x[threadIdx.x] += 1.0f;
}

// Two halves of the block wait at two different __syncthreads() calls.
extern "C" __global__ void split_barrier(float* x) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  x[threadIdx.x] = 0.0f;
}

// Lanes disagree on the mask of one shuffle.
extern "C" __global__ void mismatched_mask(float* x) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffffffffu;
  x[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 1);
}

// The mask names lanes that have already exited.
extern "C" __global__ void exited_lane(float* x) {
  if (threadIdx.x >= 8) return;
  x[threadIdx.x] = __shfl_down_sync(0xffffffffu, x[threadIdx.x], 1);
}

// A correct partial-mask shuffle: the first 16 lanes only.
extern "C" __global__ void partial_mask_ok(float* x) {
  if (threadIdx.x < 16) x[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, x[threadIdx.x], 1);
}

// Reads one element past the end of the array.
extern "C" __global__ void oob_read(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + 1];
}

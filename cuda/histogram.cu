// histogram.cu: count occurrences of each id (for example tokens routed to each expert).
// Per-block counts in dynamic shared memory with shared atomics, then one global atomic per bin and block.
#include "common.cuh"

// ids [n] int32 -> counts [nbins] int32 (accumulated: zero it first). Ids outside [0, nbins) are not counted.
// Dynamic shared memory: nbins * 4 bytes.
extern "C" __global__ void histogram_i32(const int* __restrict__ ids, long long n, int* __restrict__ counts,
                                         int nbins) {
  extern __shared__ int local[];
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int id = ids[i];
    if (id >= 0 && id < nbins) atomicAdd(&local[id], 1);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += blockDim.x)
    if (local[b]) atomicAdd(&counts[b], local[b]);
}

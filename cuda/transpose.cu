// transpose.cu: out = in^T through a shared-memory tile, on a 2-D grid.
//
// Tile width T = blockDim.x (a multiple of 32 keeps loads coalesced); blockDim.y rows are moved per step.
// Dynamic shared memory: T * (T + 1) elements; the +1 column avoids bank conflicts on the transposed read.
// One kernel per element size, instantiated through a macro so NVRTC and the emulator see the same names.
#include "common.cuh"

template <class T>
__device__ __forceinline__ void transpose_tile(const T* __restrict__ in, T* __restrict__ out, int rows, int cols,
                                               T* tile) {
  const int tw = blockDim.x;
  const int r0 = blockIdx.y * tw, c0 = blockIdx.x * tw;
  for (int dy = threadIdx.y; dy < tw; dy += blockDim.y) {
    const int r = r0 + dy, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[dy * (tw + 1) + threadIdx.x] = in[static_cast<long long>(r) * cols + c];
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < tw; dy += blockDim.y) {
    const int orow = c0 + dy, ocol = r0 + threadIdx.x;  // out is [cols, rows]
    if (orow < cols && ocol < rows) out[static_cast<long long>(orow) * rows + ocol] = tile[threadIdx.x * (tw + 1) + dy];
  }
}

#define FT_TRANSPOSE(NAME, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(1024) NAME(const T* __restrict__ in, T* __restrict__ out,      \
                                                          int rows, int cols) {                               \
    extern __shared__ __align__(16) unsigned char transpose_smem[];                                            \
    transpose_tile<T>(in, out, rows, cols, reinterpret_cast<T*>(transpose_smem));                              \
  }

FT_TRANSPOSE(transpose_u8, unsigned char)
FT_TRANSPOSE(transpose_u16, unsigned short)
FT_TRANSPOSE(transpose_u32, unsigned int)
FT_TRANSPOSE(transpose_u64, unsigned long long)

// Kernels that exercise each emulated CUDA feature; tests/test_emu.py checks them against NumPy.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// 3-D thread and block indices and dimensions: 8 ints per thread.
extern "C" __global__ void index3d(int* out) {
  const int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  int* o = out + 8 * (b * blockDim.x * blockDim.y * blockDim.z + t);
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
  o[6] = blockDim.x * blockDim.y * blockDim.z;
  o[7] = gridDim.x * gridDim.y * gridDim.z + warpSize * 1000;
}

// Every warp collective on full warps; out is [11, nthreads].
extern "C" __global__ void collectives(const int* in, int* out, int width, int delta) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = gridDim.x * blockDim.x;
  const int lane = threadIdx.x & 31;
  const int v = in[i];
  const unsigned full = 0xffffffffu;
  out[0 * n + i] = __shfl_sync(full, v, (lane * 7 + 3) & 31, width);
  out[1 * n + i] = __shfl_up_sync(full, v, delta, width);
  out[2 * n + i] = __shfl_down_sync(full, v, delta, width);
  out[3 * n + i] = __shfl_xor_sync(full, v, delta, width);
  out[4 * n + i] = static_cast<int>(__ballot_sync(full, v & 1));
  out[5 * n + i] = __any_sync(full, v > 90);
  out[6 * n + i] = __all_sync(full, v >= 0);
  out[7 * n + i] = static_cast<int>(__activemask());
  out[8 * n + i] = static_cast<int>(__match_any_sync(full, v & 3));
  out[9 * n + i] = __reduce_add_sync(full, v);
  out[10 * n + i] = __reduce_max_sync(full, v);
  __syncwarp();
  // A sub-warp collective: only the even lanes take part.
  if ((lane & 1) == 0) {
    out[1 * n + i] += 0 * __shfl_xor_sync(0x55555555u, v, 2);
  }
  // 64-bit and float payloads.
  const long long big = static_cast<long long>(v) << 33;
  const long long got = __shfl_down_sync(full, big, 1);
  const float fv = __shfl_xor_sync(full, static_cast<float>(v) * 0.5f, 1);
  if ((got >> 33) != __shfl_down_sync(full, v, 1) || fv != 0.5f * __shfl_xor_sync(full, v, 1)) out[0 * n + i] = -1;
}

// Atomics on every type the kernels use; results checked against closed forms.
extern "C" __global__ void atomics(int* i32, unsigned* u32, unsigned long long* u64, long long* i64, float* f32) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&i32[0], 1);
  atomicSub(&i32[1], 2);
  atomicMax(&i32[2], t);
  atomicMin(&i32[3], -t);
  int old = i32[4], assumed;
  do {
    assumed = old;
    old = atomicCAS(&i32[4], assumed, assumed + 3);
  } while (old != assumed);
  atomicExch(&i32[5], 7);
  atomicOr(&u32[0], 1u << (t & 31));
  atomicAnd(&u32[1], ~(1u << (t & 31)));
  atomicXor(&u32[2], 1u);
  atomicInc(&u32[3], 9u);
  atomicAdd(&u32[4], 2u);
  atomicAdd(&u64[0], static_cast<unsigned long long>(t));
  atomicMax(&u64[1], static_cast<unsigned long long>(t) << 40);
  atomicMax(&i64[0], static_cast<long long>(t) * 1000000000LL);
  atomicMin(&i64[1], -static_cast<long long>(t) * 1000000000LL);
  atomicAdd(&f32[0], 0.5f);
  __shared__ int block_count;
  if (threadIdx.x == 0) block_count = 0;
  __syncthreads();
  atomicAdd(&block_count, 1);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(&i32[6], block_count);
}

// __syncthreads_count / _and / _or.
extern "C" __global__ void barrier_reductions(int* out) {
  const int pred = (threadIdx.x % 3) == 0;
  const int c = __syncthreads_count(pred);
  const int a = __syncthreads_and(threadIdx.x < 1000);
  const int o = __syncthreads_or(threadIdx.x == 5);
  if (threadIdx.x == 0) { out[0] = c; out[1] = a; out[2] = o; }
}

// Round trips through the CUDA headers' half, bfloat16 and fp8 types.
extern "C" __global__ void fp_types(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __ldg(&x[i]);
  out[4 * i + 0] = __half2float(__float2half_rn(v));
  out[4 * i + 1] = __bfloat162float(__float2bfloat16_rn(v));
  out[4 * i + 2] = static_cast<float>(__nv_fp8_e4m3(v));
  out[4 * i + 3] = static_cast<float>(__nv_fp8_e5m2(v));
}

// Math and bit intrinsics.
extern "C" __global__ void math_fns(const float* x, const unsigned* u, float* fo, unsigned* uo, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  fo[6 * i + 0] = rsqrtf(fabsf(v) + 1.0f);
  fo[6 * i + 1] = __expf(v);
  fo[6 * i + 2] = __fdividef(v, 3.0f);
  fo[6 * i + 3] = __saturatef(v);
  fo[6 * i + 4] = fmaxf(v, 0.0f) + min(v, 1.0f) + max(-1.0f, v);
  fo[6 * i + 5] = __int_as_float(__float_as_int(v) ^ 0x80000000);
  const unsigned w = u[i];
  uo[5 * i + 0] = __popc(w);
  uo[5 * i + 1] = __clz(static_cast<int>(w));
  uo[5 * i + 2] = __brev(w);
  uo[5 * i + 3] = __byte_perm(w, 0x01234567u, 0x5140);
  uo[5 * i + 4] = __umulhi(w, 0x9e3779b9u);
}

// A struct passed by value.
struct Params {
  int n;
  float scale;
  long long offset;
  double bias;
};

extern "C" __global__ void struct_arg(Params p, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) out[i] = p.scale * i + static_cast<float>(p.offset) + static_cast<float>(p.bias);
}

// Static shared memory in a 2-D block, reversed through the tile; checks per-block isolation of __shared__.
extern "C" __global__ void shared_reverse(const int* in, int* out) {
  __shared__ int tile[8][16];
  const int b = blockIdx.x;
  tile[threadIdx.y][threadIdx.x] = in[b * 128 + threadIdx.y * 16 + threadIdx.x];
  __syncthreads();
  out[b * 128 + threadIdx.y * 16 + threadIdx.x] = tile[7 - threadIdx.y][15 - threadIdx.x];
}

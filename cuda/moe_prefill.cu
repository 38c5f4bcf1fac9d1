// moe_prefill.cu: the routed-expert forward for prefill (many tokens): a grouped GEMM over plan tiles.
//
// Grid (max tiles, ceil(N / 64)), 128 threads. Block x takes plan tile x (a slot and up to 64 of its pairs;
// blocks beyond the plan's tile count exit), block y 64 output rows. Each K step of 32 stages the pairs'
// activations and the dequantized weight rows in shared memory as bf16, then multiplies:
//   sm_80 and newer: mma.sync m16n8k16 bf16 -> f32 tensor-core tiles;
//   otherwise (and on the emulator): the same products in plain fp32 FMAs, owned by the same threads.
// Both paths compute the same function (bf16 inputs, fp32 accumulation); only the summation order differs.
// Warp w owns tile rows [16w, 16w + 16) and all 64 columns: 8 fragments of 16 x 8.
#include "common.cuh"
#include "mma.cuh"  // FT_USE_MMA: sm_80+ without FT_NO_MMA
#include "moe_common.cuh"

// FT_TILE_M (pairs per tile) and FT_TILE_N (output rows per block) come from freetoken/ops/constants.py.
#define FT_TILE_K 32
#define FT_SK (FT_TILE_K + 8)  // shared row stride in bf16 elements: 80 bytes, conflict-free fragment loads


namespace {

__device__ __forceinline__ unsigned short to_bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

#if FT_USE_MMA
// Two consecutive bf16 of a shared row as one 32-bit fragment register (element 2i in the low half).
__device__ __forceinline__ unsigned pair_bits(const unsigned short* p) { return *reinterpret_cast<const unsigned*>(p); }
#endif

template <int NMAT>
__device__ __forceinline__ void tile_products(const unsigned short (*as)[FT_SK], const unsigned short (*ws)[FT_TILE_N][FT_SK],
                                              float (*acc)[8][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int r0 = 16 * warp + g;
#pragma unroll
  for (int ks = 0; ks < FT_TILE_K; ks += 16) {
#if FT_USE_MMA
    const unsigned a0 = pair_bits(&as[r0][ks + 2 * tig]), a1 = pair_bits(&as[r0 + 8][ks + 2 * tig]);
    const unsigned a2 = pair_bits(&as[r0][ks + 8 + 2 * tig]), a3 = pair_bits(&as[r0 + 8][ks + 8 + 2 * tig]);
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const unsigned b0 = pair_bits(&ws[m][8 * nt + g][ks + 2 * tig]);
        const unsigned b1 = pair_bits(&ws[m][8 * nt + g][ks + 8 + 2 * tig]);
        float* c = acc[m][nt];
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
#else
    // c[0], c[1]: row r0, columns 8nt + 2tig + {0, 1};  c[2], c[3]: row r0 + 8, the same columns.
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
      for (int nt = 0; nt < 8; ++nt) {
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + (e >> 1) * 8, col = 8 * nt + 2 * tig + (e & 1);
          float s = 0.0f;
          for (int kk = 0; kk < 16; ++kk)
            s = fmaf(ft::bf16_bits_to_float(as[row][ks + kk]), ft::bf16_bits_to_float(ws[m][col][ks + kk]), s);
          acc[m][nt][e] += s;
        }
      }
    }
#endif
  }
}

// One tile: out[p, n] for the tile's pairs p and rows n of the block. NMAT = 2: gate/up with activation.
template <int F, class XT, int NMAT>
__device__ __forceinline__ void prefill_tile(const ft::SlotMatrix<F>* mats, const XT* in, int in_stride,
                                             const ft::Plan& plan, int pair_div, int n_rows, int k_dim, int act,
                                             float* out) {
  __shared__ __align__(16) unsigned short as[FT_TILE_M][FT_SK];
  __shared__ __align__(16) unsigned short ws[NMAT][FT_TILE_N][FT_SK];
  const int tile = blockIdx.x;
  const int u = plan.tile_unique[tile];
  const int first = plan.unique_off[u] + plan.tile_start[tile];
  const int count = min(FT_TILE_M, plan.unique_off[u + 1] - first);
  const int n0 = blockIdx.y * FT_TILE_N;

  float acc[NMAT][8][4];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][nt][e] = 0.0f;

  for (int k0 = 0; k0 < k_dim; k0 += FT_TILE_K) {
    // Stage: FT_TILE_M activation rows, then NMAT * FT_TILE_N weight rows, 32 elements each, as bf16.
    for (int task = threadIdx.x; task < FT_TILE_M + NMAT * FT_TILE_N; task += blockDim.x) {
      float v[32];
      unsigned short* dst;
      if (task < FT_TILE_M) {
        dst = as[task];
        if (task < count) {
          ft::load_x32(in + static_cast<long long>(plan.pair_list[first + task] / pair_div) * in_stride + k0, v);
        } else {
          for (int i = 0; i < 32; ++i) v[i] = 0.0f;
        }
      } else {
        const int m = (task - FT_TILE_M) / FT_TILE_N, n = (task - FT_TILE_M) % FT_TILE_N;
        dst = ws[m][n];
        if (n0 + n < n_rows) {
          mats[m].load32(n0 + n, k0, v);
        } else {
          for (int i = 0; i < 32; ++i) v[i] = 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) dst[i] = to_bf16_bits(v[i]);
    }
    __syncthreads();
    tile_products<NMAT>(as, ws, acc);
    __syncthreads();
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + (e >> 1) * 8, n = n0 + 8 * nt + 2 * tig + (e & 1);
      if (row < count && n < n_rows) {
        const long long p = plan.pair_list[first + row];
        float v[NMAT];
#pragma unroll
        for (int m = 0; m < NMAT; ++m) v[m] = acc[m][nt][e] * mats[m].g + mats[m].bias(n);
        out[p * n_rows + n] = NMAT == 2 ? ft::activation(act, v[0], v[NMAT - 1]) : v[0];
      }
    }
  }
}

template <int F, class XT>
__device__ __forceinline__ void prefill_gate_up(const ft::ExpertBanks& banks, const XT* x, const ft::Plan& plan,
                                                int k_route, int hidden, int inter, int act, float* h) {
  if (static_cast<int>(blockIdx.x) >= *plan.n_tiles) return;
  const int slot = plan.unique_slot[plan.tile_unique[blockIdx.x]];
  const ft::SlotMatrix<F> mats[2] = {ft::SlotMatrix<F>(banks.gate, slot, inter, hidden),
                                     ft::SlotMatrix<F>(banks.up, slot, inter, hidden)};
  prefill_tile<F, XT, 2>(mats, x, hidden, plan, k_route, inter, hidden, act, h);
}

template <int F>
__device__ __forceinline__ void prefill_down(const ft::ExpertBanks& banks, const float* h, const ft::Plan& plan,
                                             int hidden, int inter, float* o) {
  if (static_cast<int>(blockIdx.x) >= *plan.n_tiles) return;
  const int slot = plan.unique_slot[plan.tile_unique[blockIdx.x]];
  const ft::SlotMatrix<F> mats[1] = {ft::SlotMatrix<F>(banks.down, slot, hidden, inter)};
  prefill_tile<F, float, 1>(mats, h, inter, plan, 1, hidden, inter, 0, o);
}

}  // namespace

FT_MOE_KERNELS_ALL_FORMATS(prefill)

// moe_decode.cu: the routed-expert forward for decode (few tokens): memory-bound GEMV over expert records.
//
// Grid (P, ceil(N / FT_ROWS)): block x serves unique slot x of the plan (blocks beyond the plan's count exit),
// block y a range of FT_ROWS output rows; each warp owns rows, each lane 32-element chunks of K, read with
// 16-byte loads and dequantized in registers. A row is applied to every pair routed to the slot before the
// next row is read, so each record byte is read once per step however many tokens share the expert.
//   gate_up: h[p, i] = act(gate_i . x[t] * g_gate + b_gate[i], up_i . x[t] * g_up + b_up[i])     (t = p / k)
//   down:    o[p, c] = down_c . h[p] * g_down + b_down[c]
// moe_combine (moe_plan.cu) then forms y[t] = sum_j w[t, j] * o[t * k + j].
#include "common.cuh"
#include "moe_common.cuh"

// FT_ROWS (output rows per block: 4 warps x 2 rows) comes from freetoken/ops/constants.py.
#define FT_PAIR_BATCH 8    // pairs accumulated per pass over a row

namespace {

template <int F, class XT, int NMAT>
__device__ __forceinline__ void rows_times_pairs(const ft::SlotMatrix<F>* mats, const XT* in, int in_stride,
                                                 const int* pair_list, int p0, int p1, int pair_div, int n_rows,
                                                 int k_dim, int act, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int row_end = min(n_rows, static_cast<int>(blockIdx.y + 1) * FT_ROWS);
  for (int r = blockIdx.y * FT_ROWS + warp; r < row_end; r += nwarps) {
    for (int pb = p0; pb < p1; pb += FT_PAIR_BATCH) {
      const int np = min(FT_PAIR_BATCH, p1 - pb);
      float acc[NMAT][FT_PAIR_BATCH];
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int q = 0; q < FT_PAIR_BATCH; ++q) acc[m][q] = 0.0f;
      for (int k0 = lane * 32; k0 < k_dim; k0 += 32 * 32) {
        float w[NMAT][32];
#pragma unroll
        for (int m = 0; m < NMAT; ++m) mats[m].load32(r, k0, w[m]);
#pragma unroll
        for (int q = 0; q < FT_PAIR_BATCH; ++q) {
          if (q < np) {
            const int src = pair_list[pb + q] / pair_div;
            float xv[32];
            ft::load_x32(in + static_cast<long long>(src) * in_stride + k0, xv);
#pragma unroll
            for (int m = 0; m < NMAT; ++m) {
              float s = 0.0f;
#pragma unroll
              for (int i = 0; i < 32; ++i) s = fmaf(w[m][i], xv[i], s);
              acc[m][q] += s;
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < FT_PAIR_BATCH; ++q) {
        if (q < np) {  // uniform across the warp
          float v[NMAT];
#pragma unroll
          for (int m = 0; m < NMAT; ++m) v[m] = ft::warp_sum(acc[m][q]) * mats[m].g + mats[m].bias(r);
          if (lane == 0) {
            const long long p = pair_list[pb + q];
            out[p * n_rows + r] = NMAT == 2 ? ft::activation(act, v[0], v[NMAT - 1]) : v[0];
          }
        }
      }
    }
  }
}

template <int F, class XT>
__device__ __forceinline__ void decode_gate_up(const ft::ExpertBanks& banks, const XT* x, const ft::Plan& plan,
                                               int k_route, int hidden, int inter, int act, float* h) {
  const int u = blockIdx.x;
  if (u >= *plan.n_unique) return;
  const int slot = plan.unique_slot[u];
  const ft::SlotMatrix<F> mats[2] = {ft::SlotMatrix<F>(banks.gate, slot, inter, hidden),
                                     ft::SlotMatrix<F>(banks.up, slot, inter, hidden)};
  rows_times_pairs<F, XT, 2>(mats, x, hidden, plan.pair_list, plan.unique_off[u], plan.unique_off[u + 1], k_route,
                             inter, hidden, act, h);
}

template <int F>
__device__ __forceinline__ void decode_down(const ft::ExpertBanks& banks, const float* h, const ft::Plan& plan,
                                            int hidden, int inter, float* o) {
  const int u = blockIdx.x;
  if (u >= *plan.n_unique) return;
  const int slot = plan.unique_slot[u];
  const ft::SlotMatrix<F> mats[1] = {ft::SlotMatrix<F>(banks.down, slot, hidden, inter)};
  rows_times_pairs<F, float, 1>(mats, h, inter, plan.pair_list, plan.unique_off[u], plan.unique_off[u + 1], 1,
                                hidden, inter, 0, o);
}

}  // namespace

FT_MOE_KERNELS_ALL_FORMATS(decode)

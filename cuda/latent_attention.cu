// latent_attention.cu: DeepSeek-V3's multi-head latent attention over the paged KV cache, absorbed form
// (latent_attention_c<CMAX>). Contract: freetoken/testing/reference/latent_attention.py; the pool is the paged cache's
// (kv.cuh) with one kv head and rows of C = R + P values [c_kv (R), k_pe (P)]; the append is paged_attention.cu's
// kv_store_<kind> and the merge of context splits its paged_combine.
//
// Query t sits at position start + t and sees the rows p <= start + t. Every (query, head) pair is a row of
// Q [T * H, C] (q is [T, H, C]): scores S = Q K^T over all C values of the cached rows K, outputs O = softmax(S) V
// with V = K[:, :R] (the latent is both key and value). Scores are in base 2: the launcher passes
// qscale = scale * log2(e). Rows past a sequence's end are never read (they may hold anything, NaN included).
//
// One block of 8 warps per (32 rows, context split). All heads share each cached row, so a block loads a tile of
// FT_LATENT_KEYS rows ONCE, widened to bf16 in shared memory ([key][c], padded: conflict-free fragment reads), and
// uses it for its 32 (query, head) rows, both products on m16n8k16 bf16 tensor-core products (mma.cuh: tensor cores
// on sm_80+, the same data flow on shuffles elsewhere and on the emulator):
//   * S = Q K^T: warp w takes rows 16 (w / 4) .. + 15 and the k-steps w % 4, w % 4 + 4, ... of C (its Q fragments
//     stay in registers for the whole context); the four partial score tiles go to shared memory;
//   * softmax: each row's 32 scores are summed over the four partials in a fixed order, scaled, masked (causal, the
//     split's end) and folded into the row's online softmax (fp32 max and sum, 8 lanes per row); the probabilities
//     go to shared memory as bf16 (the row sum adds the rounded values: the weights the product uses);
//   * O += P V: warp w takes the same 16 rows and the 8-column tiles w % 4, w % 4 + 4, ... of R (fp32 accumulators:
//     R / 32 per lane, 64 registers at R = 512), V read from the same shared tile (no transposed copy).
// With one split the block writes O / sum; with several it writes its unnormalised partial and (max, sum) per row,
// merged by paged_combine (flash-decoding). No atomics: results are deterministic.
#include "common.cuh"
#include "kv.cuh"
#include "mma.cuh"

// FT_LATENT_ROWS (rows per block), FT_LATENT_KEYS (keys per tile) and FT_LATENT_MAX_DIM (the widest row, R + P) come
// from freetoken/device/constants.py.

namespace {

constexpr int kRows = FT_LATENT_ROWS;
constexpr int kKeys = FT_LATENT_KEYS;
constexpr int kSpStride = kKeys + 1;  // partial score tiles [4][kRows][kSpStride] (fp32)
constexpr int kPsStride = kKeys + 8;  // probabilities [kRows][kPsStride] (bf16): conflict-free A fragment reads
static_assert(kRows == 32 && kKeys == 32, "the warp roles below assume 32 rows (2 x 16) and 32 keys per tile");

// Max / sum over the 8 lanes of an aligned group (a softmax row).
__device__ __forceinline__ float group8_max(float v) {
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) v = fmaxf(v, __shfl_xor_sync(FT_FULL_MASK, v, off));
  return v;
}

__device__ __forceinline__ float group8_sum(float v) {
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) v += __shfl_xor_sync(FT_FULL_MASK, v, off);
  return v;
}

// One bf16 of shared memory as the low 16 bits of a register.
__device__ __forceinline__ unsigned u16(const unsigned short* p) { return static_cast<unsigned>(*p); }

// The block's dynamic shared memory (the launcher's smem_bytes in freetoken/ops/latent_attention_cuda.py):
// ks [kKeys][CMAX + 8] bf16 | sp [4][kRows][kSpStride] f32 | ps [kRows][kPsStride] bf16 | corr, m, l [kRows] f32.
template <int CMAX>
struct Layout {
  static constexpr int kStride = CMAX + 8;  // ks row stride (bf16): 4 words past a multiple of 32 banks
  static constexpr int kKs = kKeys * kStride * 2;
  static constexpr int kSp = 4 * kRows * kSpStride * 4;
  static constexpr int kPs = kRows * kPsStride * 2;
  static constexpr int kBytes = kKs + kSp + kPs + 3 * kRows * 4;
};

template <int CMAX>
__device__ __forceinline__ void latent_block(const float* __restrict__ q, const void* pool,
                                             const float* __restrict__ pool_scale, const int* __restrict__ table,
                                             float* __restrict__ out, float* __restrict__ part_o,
                                             float* __restrict__ part_ml, int kind, int T, int H, int R, int C,
                                             int block_size, int start, int chunk, int nsplit, float qscale, int r0,
                                             long long prows) {
  static_assert(CMAX % 64 == 0 && CMAX <= FT_LATENT_MAX_DIM, "CMAX: a multiple of 64 up to FT_LATENT_MAX_DIM");
  constexpr int KS = CMAX / 64;  // k-steps of Q K^T per warp (16 values each, a quarter of the row)
  constexpr int NOT = CMAX / 32;  // 8-column tiles of O per warp (a quarter of R <= CMAX)
  using L = Layout<CMAX>;
  static_assert(L::kBytes <= 99 * 1024, "the dynamic shared memory a consumer GPU grants one block (opt-in)");
  extern __shared__ __align__(16) unsigned char latent_smem[];
  unsigned short* ks = reinterpret_cast<unsigned short*>(latent_smem);
  float* sp = reinterpret_cast<float*>(latent_smem + L::kKs);
  unsigned short* ps = reinterpret_cast<unsigned short*>(latent_smem + L::kKs + L::kSp);
  float* s_corr = reinterpret_cast<float*>(latent_smem + L::kKs + L::kSp + L::kPs);
  float* s_m = s_corr + kRows;
  float* s_l = s_m + kRows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int rg = warp >> 2, quarter = warp & 3;  // mma roles: row group (16 rows) and quarter of the k-steps / columns
  const int rows = T * H, split = blockIdx.y;  // rows r0 .. r0 + kRows - 1 of this sequence's T H
  const int last = min(rows, r0 + kRows) - 1;  // the block's last real row
  const int lo = split * chunk;
  const int hi = min(start + last / H + 1, lo + chunk);  // keys [lo, hi): the split's, up to the last row's query
  const int ksteps = (C + 15) / 16, ntiles = (R + 7) / 8;

  // the rows of this thread's mma fragments: 16 rg + g and + 8 (a padding row repeats the block's last row: it
  // computes like a real one and is not written)
  int frow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) frow[i] = min(r0 + 16 * rg + g + 8 * i, last);
  unsigned qa[KS][4];  // Q as A fragments of this warp's k-steps (unscaled bf16)
#pragma unroll
  for (int si = 0; si < KS; ++si) {
    const int st = 4 * si + quarter;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 16 * st + 2 * tq + (i >> 1) * 8;
      const float* qrow = q + static_cast<long long>(frow[i & 1]) * C;
      qa[si][i] = ft::pack_bf16x2(col < C ? qrow[col] : 0.0f, col + 1 < C ? qrow[col + 1] : 0.0f);
    }
  }
  float o[NOT][4];
#pragma unroll
  for (int j = 0; j < NOT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;

  // softmax roles: warp w holds rows 4w .. 4w + 3, 8 lanes a row, 4 keys a lane; the row's running max and sum
  // live (replicated) in its 8 lanes
  const int srow = 4 * warp + (lane >> 3), skey = 4 * (lane & 7);
  const int spos = start + min(r0 + srow, last) / H;  // the row's query position
  float m = -ft::inf(), l = 0.0f;

  const int pairs = 8 * ksteps;  // bf16 pairs of a tile row filled (zeros past C)
  for (int kb = lo; kb < hi; kb += kKeys) {
    __syncthreads();  // the previous tile's ks / ps reads are done
    for (int i = threadIdx.x; i < kKeys * pairs; i += blockDim.x) {
      const int j = i / pairs, c = 2 * (i - j * pairs), key = kb + j;
      float x0 = 0.0f, x1 = 0.0f;  // keys past hi and values past C: zeros (never NaN: P is 0 there)
      if (key < hi) {
        const long long row = ft::kv_row(table, key, block_size, 1, 0);
        const float sc = kind == ft::KV_FP8 ? pool_scale[row] : 1.0f;
        const long long e = row * C + c;
        if (c < C) x0 = ft::kv_load(kind, pool, e, sc);
        if (c + 1 < C) x1 = ft::kv_load(kind, pool, e + 1, sc);
      }
      *reinterpret_cast<unsigned*>(&ks[j * L::kStride + c]) = ft::pack_bf16x2(x0, x1);
    }
    __syncthreads();

    // S = Q K^T over this warp's k-steps: 4 tiles of 8 keys
    float s[kKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
    for (int si = 0; si < KS; ++si) {
      const int st = 4 * si + quarter;
      if (st >= ksteps) break;  // uniform across the warp
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        const unsigned short* kr = ks + (8 * nt + g) * L::kStride + 16 * st + 2 * tq;
        const unsigned b[2] = {*reinterpret_cast<const unsigned*>(kr), *reinterpret_cast<const unsigned*>(kr + 8)};
        ft::mma_bf16_16816(s[nt], qa[si], b);
      }
    }
    float* mine = sp + quarter * kRows * kSpStride;
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(16 * rg + g + 8 * (e >> 1)) * kSpStride + 8 * nt + 2 * tq + (e & 1)] = s[nt][e];
    __syncthreads();

    // online softmax of row srow, keys skey .. skey + 3
    float x[4], mx = -ft::inf();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int at = srow * kSpStride + skey + i, key = kb + skey + i;
      const float v = ((sp[at] + sp[kRows * kSpStride + at]) + sp[2 * kRows * kSpStride + at]) +
                      sp[3 * kRows * kSpStride + at];
      x[i] = key < hi && key <= spos ? v * qscale : -ft::inf();
      mx = fmaxf(mx, x[i]);
    }
    const float m_new = fmaxf(m, group8_max(mx));
    const float ref = m_new == -ft::inf() ? 0.0f : m_new;  // a row that has seen no key yet: nothing to rescale
    const float corr = exp2f(m - ref);                      // 0 while m is -inf
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = ft::round_bf16(exp2f(x[i] - ref));  // 0 where masked
      sum += x[i];
    }
    l = l * corr + group8_sum(sum);
    m = m_new;
    unsigned* prow = reinterpret_cast<unsigned*>(&ps[srow * kPsStride + skey]);
    prow[0] = ft::pack_bf16x2(x[0], x[1]);
    prow[1] = ft::pack_bf16x2(x[2], x[3]);
    if ((lane & 7) == 0) s_corr[srow] = corr;
    __syncthreads();

    // O = O corr + P V over this warp's column tiles; V[key][c] = ks[key][c]
    const float c0 = s_corr[16 * rg + g], c1 = s_corr[16 * rg + g + 8];
#pragma unroll
    for (int j = 0; j < NOT; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c0;
      o[j][2] *= c1;
      o[j][3] *= c1;
    }
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const unsigned short* pr = ps + (16 * rg + g) * kPsStride + 16 * kk + 2 * tq;
      const unsigned pa[4] = {*reinterpret_cast<const unsigned*>(pr),
                              *reinterpret_cast<const unsigned*>(pr + 8 * kPsStride),
                              *reinterpret_cast<const unsigned*>(pr + 8),
                              *reinterpret_cast<const unsigned*>(pr + 8 * kPsStride + 8)};
      const unsigned short* vr = ks + (16 * kk + 2 * tq) * L::kStride + g;  // B[k = key][n = column]
#pragma unroll
      for (int j = 0; j < NOT; ++j) {
        const int n = 4 * j + quarter;
        if (n >= ntiles) break;  // uniform across the warp
        const unsigned short* v = vr + 8 * n;
        const unsigned b[2] = {u16(v) | (u16(v + L::kStride) << 16),
                               u16(v + 8 * L::kStride) | (u16(v + 9 * L::kStride) << 16)};
        ft::mma_bf16_16816(o[j], pa, b);
      }
    }
  }

  if ((lane & 7) == 0) {
    s_m[srow] = m;
    s_l[srow] = l;
  }
  __syncthreads();
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = 16 * rg + g + 8 * hr, rr = r0 + row;
    if (rr > last) continue;
    const float lr = s_l[row];
    const long long dst = (nsplit == 1 ? static_cast<long long>(rr) : split * prows + rr) * R;
    float* o_row = (nsplit == 1 ? out : part_o) + dst;
#pragma unroll
    for (int j = 0; j < NOT; ++j) {
      const int n = 4 * j + quarter;
      if (n >= ntiles) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * n + 2 * tq + e;
        if (c < R) o_row[c] = nsplit == 1 ? o[j][2 * hr + e] / lr : o[j][2 * hr + e];
      }
    }
    if (nsplit > 1 && quarter == 0 && tq == 0) {
      const long long prow = split * prows + rr;
      part_ml[2 * prow] = s_m[row];
      part_ml[2 * prow + 1] = lr;
    }
  }
}

}  // namespace

// latent_attention_c<CMAX>: grid (ceil(T H / 32), nsplit), 256 threads, Layout<CMAX>::kBytes of dynamic shared
// memory; rows of C = R + P <= CMAX values (a C between two builds costs arithmetic, not memory). q [T, H, C] float32;
// pool [blocks, block_size, 1, C] of ft::KvKind `kind`, pool_scale [blocks, block_size, 1] (read for fp8 only);
// table the block table. Split s holds the keys [s chunk, (s + 1) chunk). With nsplit == 1 the output is
// out [T, H * R]; with nsplit > 1 part_o [nsplit, T H, R] and part_ml [nsplit, T H, 2] (max in log2 units, sum),
// paged_combine's inputs. qscale = scale * log2(e).
//
// width > 0: several sequences in one launch (latent_attention_batch): grid (blocks, nsplit), block b taking rows
// tiles[2 b + 1] * 32 .. + 31 of sequence s = tiles[2 b], whose queries are rows seqs[3 s] .. + seqs[3 s + 1] - 1 of
// q at positions seqs[3 s + 2] .., block table table[s * width ..]; T is then the rows of every sequence (start not
// read) and the partials are laid out over all of them, so one paged_combine merges them.
#define FT_LATENT_ATTENTION(CMAX)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) latent_attention_c##CMAX(                                      \
      const float* __restrict__ q, const void* pool, const float* pool_scale, const int* table,                    \
      const int* __restrict__ seqs, const int* __restrict__ tiles, float* __restrict__ out,                        \
      float* __restrict__ part_o, float* __restrict__ part_ml, int kind, int T, int H, int R, int C,               \
      int block_size, int width, int start, int chunk, int nsplit, float qscale) {                                 \
    long long row0 = 0;  /* one sequence; in a batch, its first (query, head) row, and this block's rows: */      \
    const int* tb = table;                                                                                          \
    int count = T, first = start, r0 = blockIdx.x * kRows;                                                          \
    if (width > 0) {                                                                                                \
      const int s = tiles[2 * blockIdx.x];                                                                          \
      row0 = static_cast<long long>(seqs[3 * s]) * H;                                                               \
      tb = table + static_cast<long long>(s) * width;                                                               \
      count = seqs[3 * s + 1];                                                                                      \
      first = seqs[3 * s + 2];                                                                                      \
      r0 = tiles[2 * blockIdx.x + 1] * kRows;                                                                       \
    }                                                                                                               \
    latent_block<CMAX>(q + row0 * C, pool, pool_scale, tb, out + row0 * R, part_o + row0 * R, part_ml + 2 * row0,   \
                       kind, count, H, R, C, block_size, first, chunk, nsplit, qscale, r0,                          \
                       static_cast<long long>(T) * H);                                                             \
  }

// Rows up to 64, 128, 256, 576 (DeepSeek-V3: 512 + 64) and FT_LATENT_MAX_DIM values (LATENT_DIMS in
// freetoken/ops/latent_attention_cuda.py).
FT_LATENT_ATTENTION(64)
FT_LATENT_ATTENTION(128)
FT_LATENT_ATTENTION(256)
FT_LATENT_ATTENTION(576)
FT_LATENT_ATTENTION(1024)
static_assert(FT_LATENT_MAX_DIM == 1024, "the largest build is FT_LATENT_MAX_DIM");

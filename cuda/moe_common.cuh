// moe_common.cuh: expert-record access shared by the routed-expert kernels (decode and prefill).
//
// Bank layouts are specified in freetoken/formats/base.py. Every matrix is read in chunks of 32 consecutive
// K elements of one row (K is a multiple of 32), with 16-byte loads, and dequantized in registers. A
// per-matrix global scale (nvfp4) is NOT applied per element: callers multiply the finished dot product.
#pragma once
#include "common.cuh"
#include "kquant.cuh"
#include "numeric.cuh"

// Format codes FT_FMT_*, activation codes FT_ACT_* and the gpt-oss FT_GPT_OSS_LIMIT / FT_GPT_OSS_ALPHA come from
// freetoken/ops/constants.py (-D options on every compile).

namespace ft {

// Bank pointers of one matrix for all slots (host-mapped or device memory). g and b may be null.
// Slot x of a bank starts x * stride bytes after its base: a record's own bank size when the slot banks hold one
// layout, more when they are sized for the largest of several (per-layer formats of a GGUF Q4_K_M file).
struct MatBanks {
  const unsigned char* w;  // values
  const unsigned char* s;  // block scales
  const float* g;          // per-matrix global scale, one per slot (nvfp4)
  const float* b;          // bias [slots, N] (gpt-oss)
  unsigned long long w_stride, s_stride, g_stride, b_stride;  // bytes from one slot to the next
};

struct ExpertBanks {
  MatBanks gate, up, down;
};

// ---- scalar decoders ------------------------------------------------------------------------------------
// E2M1 code (4 bits, bit 3 = sign) -> float: 0, .5, 1, 1.5, 2, 3, 4, 6 built from its bits, no table.
__device__ __forceinline__ float e2m1_to_float(unsigned c) {
  const unsigned e = (c >> 1) & 3u, m = c & 1u;
  const unsigned mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((c & 8u) << 28));
}

// E8M0 byte -> 2^(e-127); 0 -> 2^-127 (a float subnormal), 255 -> NaN.
__device__ __forceinline__ float e8m0_to_float(unsigned e) {
  return __uint_as_float(e == 0u ? 0x00400000u : e == 255u ? 0x7FC00000u : (e << 23));
}

__device__ __forceinline__ uint4 load16(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }

// 32 consecutive bf16 values (64 bytes, 16-byte aligned) as floats: weights of bf16 records and bf16 activations.
__device__ __forceinline__ void bf16x32(const unsigned char* p, float* out) {
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint4 q = load16(p + 16 * v);
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[8 * v + 2 * i] = bf16_bits_to_float(words[i]);
      out[8 * v + 2 * i + 1] = bf16_bits_to_float(words[i] >> 16);
    }
  }
}

// The 16 nibble codes of 8 bytes in a 32-bit pair, low nibble first.
__device__ __forceinline__ void fp4x32(const uint4 q, float scale_lo, float scale_hi, float* out) {
  const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned byte = (words[i] >> (8 * j)) & 0xFFu;
      const int k = 8 * i + 2 * j;
      const float s = k < 16 ? scale_lo : scale_hi;
      out[k] = e2m1_to_float(byte & 15u) * s;
      out[k + 1] = e2m1_to_float(byte >> 4) * s;
    }
  }
}

// ---- per-format traits: the 32-element row-chunk decoder (slots are found by the banks' strides, MatBanks) ----
template <int F>
struct Fmt;

template <>
struct Fmt<FT_FMT_BF16> {
  __device__ static void load32(const unsigned char* w, const unsigned char*, int, int k, int row, int k0, float* out) {
    bf16x32(w + (static_cast<size_t>(row) * k + k0) * 2, out);
  }
};

template <>
struct Fmt<FT_FMT_FP8_BLOCK> {
  __device__ static void load32(const unsigned char* w, const unsigned char* s, int, int k, int row, int k0,
                                float* out) {
    const float scale = reinterpret_cast<const float*>(s)[(row / 128) * ((k + 127) / 128) + k0 / 128];
    const unsigned char* p = w + static_cast<size_t>(row) * k + k0;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const uint4 q = load16(p + 16 * v);
      const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 16; ++i) out[16 * v + i] = e4m3_to_float((words[i / 4] >> (8 * (i % 4))) & 0xFFu) * scale;
    }
  }
};

template <>
struct Fmt<FT_FMT_NVFP4> {
  __device__ static void load32(const unsigned char* w, const unsigned char* s, int, int k, int row, int k0,
                                float* out) {
    const unsigned char* sc = s + static_cast<size_t>(row) * (k / 16) + k0 / 16;
    fp4x32(load16(w + static_cast<size_t>(row) * (k / 2) + k0 / 2), e4m3_to_float(sc[0]), e4m3_to_float(sc[1]), out);
  }
};

template <>
struct Fmt<FT_FMT_MXFP4> {
  __device__ static void load32(const unsigned char* w, const unsigned char* s, int, int k, int row, int k0,
                                float* out) {
    const float scale = e8m0_to_float(s[static_cast<size_t>(row) * (k / 32) + k0 / 32]);
    fp4x32(load16(w + static_cast<size_t>(row) * (k / 2) + k0 / 2), scale, scale, out);
  }
};

// The GGUF block formats (kquant.cuh): each row is K / Q::kWeights blocks, block b's header bytes at b *
// Q::kHeaderBytes of the row's s bank and its quants at b * Q::kQuantBytes of its w bank. Every block's quants are
// 16-byte aligned, its header as aligned as the header size allows (Q4_K / Q5_K 16, IQ4_XS 8, Q6_K's 18 bytes and
// Q8_0 / Q4_0's 2: 2): the bank bases are 16-byte aligned and a slot stride is the bank's size or a multiple of 16.
template <class Q>
struct GgufFmt {
  __device__ static void load32(const unsigned char* w, const unsigned char* s, int, int k, int row, int k0,
                                float* out) {
    const size_t blk = static_cast<size_t>(row) * (k / Q::kWeights) + k0 / Q::kWeights;
    Q::template chunk<gguf::align_of(Q::kHeaderBytes), 16>(s + blk * Q::kHeaderBytes, w + blk * Q::kQuantBytes,
                                                            (k0 % Q::kWeights) / 32, out);
  }
};

template <>
struct Fmt<FT_FMT_Q4_0> : GgufFmt<gguf::Q4_0> {};
template <>
struct Fmt<FT_FMT_Q8_0> : GgufFmt<gguf::Q8_0> {};
template <>
struct Fmt<FT_FMT_Q4_K> : GgufFmt<gguf::Q4_K> {};
template <>
struct Fmt<FT_FMT_Q5_K> : GgufFmt<gguf::Q5_K> {};
template <>
struct Fmt<FT_FMT_Q6_K> : GgufFmt<gguf::Q6_K> {};
template <>
struct Fmt<FT_FMT_IQ4_XS> : GgufFmt<gguf::IQ4_XS> {};

// One matrix of one slot: base pointers already offset to the slot.
template <int F>
struct SlotMatrix {
  const unsigned char* w;
  const unsigned char* s;
  float g;         // global scale (1 when the format has none)
  const float* b;  // bias row vector or null
  int n, k;

  __device__ SlotMatrix(const MatBanks& m, int slot, int n_, int k_) : n(n_), k(k_) {
    w = m.w + m.w_stride * slot;
    s = m.s ? m.s + m.s_stride * slot : nullptr;
    g = m.g ? *reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(m.g) + m.g_stride * slot) : 1.0f;
    b = m.b ? reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(m.b) + m.b_stride * slot)
            : nullptr;
  }
  __device__ void load32(int row, int k0, float* out) const { Fmt<F>::load32(w, s, n, k, row, k0, out); }
  __device__ float bias(int row) const { return b ? b[row] : 0.0f; }
};

// ---- activations ------------------------------------------------------------------------------------------
// FT_ACT_SWIGLU: silu(gate) * up; FT_ACT_GPT_OSS: gpt-oss's clamped, alpha-scaled GLU. Any other code runs swiglu
// (the launchers pass only these two).
static_assert(FT_ACT_SWIGLU != FT_ACT_GPT_OSS, "activation codes must differ");
__device__ __forceinline__ float activation(int act, float gate, float up) {
  if (act == FT_ACT_GPT_OSS) {
    gate = fminf(gate, FT_GPT_OSS_LIMIT);
    up = fminf(fmaxf(up, -FT_GPT_OSS_LIMIT), FT_GPT_OSS_LIMIT);
    return (up + 1.0f) * gate / (1.0f + expf(-FT_GPT_OSS_ALPHA * gate));
  }
  return gate / (1.0f + expf(-gate)) * up;
}

// ---- activation vectors: 32 consecutive elements as floats ---------------------------------------------
__device__ __forceinline__ void load_x32(const float* p, float* out) {
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const float4 q = *reinterpret_cast<const float4*>(p + 4 * v);
    out[4 * v] = q.x;
    out[4 * v + 1] = q.y;
    out[4 * v + 2] = q.z;
    out[4 * v + 3] = q.w;
  }
}

__device__ __forceinline__ void load_x32(const __nv_bfloat16* p, float* out) {
  bf16x32(reinterpret_cast<const unsigned char*>(p), out);
}

// ---- the routing plan (built by moe_plan.cu) ----------------------------------------------------------------
// Pairs p = t * k + j are grouped by slot. Unique slots are listed in increasing order.
struct Plan {
  const int* n_unique;     // [1]
  const int* unique_slot;  // [P]
  const int* unique_off;   // [P + 1]: pairs of unique u are pair_list[unique_off[u] .. unique_off[u + 1])
  const int* pair_list;    // [P]
  const int* n_tiles;      // [1]       prefill tiles: (unique, first pair within it) of up to FT_TILE_M pairs
  const int* tile_unique;  // [max tiles]
  const int* tile_start;   // [max tiles]
};

// The layouts freetoken/ops/constants.py EXPERT_BANKS and PLAN pack.
static_assert(sizeof(ExpertBanks) == FT_EXPERT_BANKS_SIZE, "ExpertBanks size differs from constants.EXPERT_BANKS");
FT_CHECK_OFFSET(ExpertBanks, gate.w, FT_EXPERT_BANKS_GATE_W_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.s, FT_EXPERT_BANKS_GATE_S_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.g, FT_EXPERT_BANKS_GATE_G_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.b, FT_EXPERT_BANKS_GATE_B_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.w, FT_EXPERT_BANKS_UP_W_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.s, FT_EXPERT_BANKS_UP_S_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.g, FT_EXPERT_BANKS_UP_G_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.b, FT_EXPERT_BANKS_UP_B_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.w, FT_EXPERT_BANKS_DOWN_W_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.s, FT_EXPERT_BANKS_DOWN_S_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.g, FT_EXPERT_BANKS_DOWN_G_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.b, FT_EXPERT_BANKS_DOWN_B_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.w_stride, FT_EXPERT_BANKS_GATE_W_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.s_stride, FT_EXPERT_BANKS_GATE_S_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.g_stride, FT_EXPERT_BANKS_GATE_G_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, gate.b_stride, FT_EXPERT_BANKS_GATE_B_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.w_stride, FT_EXPERT_BANKS_UP_W_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.s_stride, FT_EXPERT_BANKS_UP_S_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.g_stride, FT_EXPERT_BANKS_UP_G_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, up.b_stride, FT_EXPERT_BANKS_UP_B_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.w_stride, FT_EXPERT_BANKS_DOWN_W_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.s_stride, FT_EXPERT_BANKS_DOWN_S_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.g_stride, FT_EXPERT_BANKS_DOWN_G_STRIDE_OFFSET);
FT_CHECK_OFFSET(ExpertBanks, down.b_stride, FT_EXPERT_BANKS_DOWN_B_STRIDE_OFFSET);
static_assert(sizeof(Plan) == FT_PLAN_SIZE, "Plan size differs from constants.PLAN");
FT_CHECK_OFFSET(Plan, n_unique, FT_PLAN_N_UNIQUE_OFFSET);
FT_CHECK_OFFSET(Plan, unique_slot, FT_PLAN_UNIQUE_SLOT_OFFSET);
FT_CHECK_OFFSET(Plan, unique_off, FT_PLAN_UNIQUE_OFF_OFFSET);
FT_CHECK_OFFSET(Plan, pair_list, FT_PLAN_PAIR_LIST_OFFSET);
FT_CHECK_OFFSET(Plan, n_tiles, FT_PLAN_N_TILES_OFFSET);
FT_CHECK_OFFSET(Plan, tile_unique, FT_PLAN_TILE_UNIQUE_OFFSET);
FT_CHECK_OFFSET(Plan, tile_start, FT_PLAN_TILE_START_OFFSET);

}  // namespace ft

// ---- kernel entry points --------------------------------------------------------------------------------------
// moe_decode.cu and moe_prefill.cu each define MODE_gate_up<F, XT>(banks, x, plan, k_route, hidden, inter, act, h)
// and MODE_down<F>(banks, h, plan, hidden, inter, o); these macros stamp out the same extern "C" kernels for both
// (gate_up for fp32 and bf16 activations, down) for every kernel family, so NVRTC and the emulator see one set of
// names: moe_<MODE>_gate_up_<family>_{f32,bf16}, moe_<MODE>_down_<family>.
#define FT_MOE_KERNELS(MODE, NAME, F)                                                                          \
  extern "C" __global__ void __launch_bounds__(128) moe_##MODE##_gate_up_##NAME##_f32(                         \
      ft::ExpertBanks banks, const float* __restrict__ x, ft::Plan plan, int k_route, int hidden, int inter,   \
      int act, float* __restrict__ h) {                                                                        \
    MODE##_gate_up<F, float>(banks, x, plan, k_route, hidden, inter, act, h);                                  \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) moe_##MODE##_gate_up_##NAME##_bf16(                        \
      ft::ExpertBanks banks, const __nv_bfloat16* __restrict__ x, ft::Plan plan, int k_route, int hidden,      \
      int inter, int act, float* __restrict__ h) {                                                             \
    MODE##_gate_up<F, __nv_bfloat16>(banks, x, plan, k_route, hidden, inter, act, h);                          \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) moe_##MODE##_down_##NAME(                                  \
      ft::ExpertBanks banks, const float* __restrict__ h, ft::Plan plan, int hidden, int inter,                \
      float* __restrict__ o) {                                                                                 \
    MODE##_down<F>(banks, h, plan, hidden, inter, o);                                                          \
  }

// Every kernel family (ds_fp4 experts run the mxfp4 family).
#define FT_MOE_KERNELS_ALL_FORMATS(MODE)              \
  FT_MOE_KERNELS(MODE, bf16, FT_FMT_BF16)             \
  FT_MOE_KERNELS(MODE, fp8_block, FT_FMT_FP8_BLOCK)   \
  FT_MOE_KERNELS(MODE, nvfp4, FT_FMT_NVFP4)           \
  FT_MOE_KERNELS(MODE, mxfp4, FT_FMT_MXFP4)           \
  FT_MOE_KERNELS(MODE, q4_0, FT_FMT_Q4_0)             \
  FT_MOE_KERNELS(MODE, q8_0, FT_FMT_Q8_0)             \
  FT_MOE_KERNELS(MODE, q4_k, FT_FMT_Q4_K)             \
  FT_MOE_KERNELS(MODE, q5_k, FT_FMT_Q5_K)             \
  FT_MOE_KERNELS(MODE, q6_k, FT_FMT_Q6_K)             \
  FT_MOE_KERNELS(MODE, iq4_xs, FT_FMT_IQ4_XS)

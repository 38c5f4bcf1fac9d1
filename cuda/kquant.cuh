// kquant.cuh: the device decoders of the GGUF block formats freetoken keeps as the file stores them (Q4_0, Q8_0,
// Q4_K, Q5_K, Q6_K, IQ4_XS), shared by the routed-expert kernels (moe_common.cuh: header and quants in separate
// banks, see freetoken/formats/base.py) and the dense GEMV (dense.cu: whole GGUF blocks, rows of blocks).
//
// Each format is a struct Q with its block geometry (kWeights per block: 32, or 256 for the K-quant super-blocks;
// the block is kHeaderBytes of scales at kHeaderOffset and kQuantBytes of quants at kQuantOffset) and
//   Q::chunk<AH, AQ>(hdr, qs, c, out): the 32 consecutive weights 32c .. 32c + 31 of one block (c < kWeights / 32)
// as floats, given pointers to the block's header and its quants, aligned to AH and AQ bytes (16, 8, 2 or 1):
// the loads are as wide as that alignment allows (16-byte loads of the 16-byte aligned expert banks; the 34-, 210-
// byte blocks of dense rows only give 2-byte words). Everything is decoded in registers: no shared memory, and the
// chunk index c (lane-dependent) only enters shifts and addresses, never the index of a register array.
//
// Exactness: every decoded value equals gguf-py's (gguf.quants.dequantize) bit for bit, whatever the compiler fuses. A
// float16 d or dmin has an 11-bit significand; a K-quant scale and min have 6 bits (Q6_K's int8 scale 7 bits plus
// sign, IQ4_XS's ls - 32 and the IQ4_NL table value 5 + 7 bits), a quant at most 6, so d * sc and (d * sc) * q fit
// in 24 bits, and dmin * m too: the one rounding is Q4_K / Q5_K's final subtraction d * sc * q - dmin * m, the same
// in every operation order (a fused multiply-add of the exact product rounds the same). Products of float16 values
// with small integers never reach the float32 subnormals, so flush-to-zero cannot change them either. An inf / NaN
// d gives inf / NaN weights, as gguf-py does (inf * 0 is NaN in either order).
#pragma once
#include "numeric.cuh"

namespace ft {
namespace gguf {

// The alignment (a power of two, at most 16) every multiple of `bytes` keeps.
__host__ __device__ constexpr int align_of(int bytes) { return (bytes | 16) & -(bytes | 16); }

// NB bytes at p (aligned to A) as NB / 4 little-endian 32-bit words, with the widest loads A allows.
template <int A, int NB>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned* w) {
  static_assert(NB % 4 == 0, "whole words");
  if constexpr (A % 16 == 0 && NB % 16 == 0) {
#pragma unroll
    for (int v = 0; v < NB / 16; ++v) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p) + v);
      w[4 * v] = q.x;
      w[4 * v + 1] = q.y;
      w[4 * v + 2] = q.z;
      w[4 * v + 3] = q.w;
    }
  } else if constexpr (A % 8 == 0 && NB % 8 == 0) {
#pragma unroll
    for (int v = 0; v < NB / 8; ++v) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p) + v);
      w[2 * v] = q.x;
      w[2 * v + 1] = q.y;
    }
  } else if constexpr (A % 2 == 0) {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int v = 0; v < NB / 4; ++v) {
      w[v] = static_cast<unsigned>(__ldg(h + 2 * v)) | (static_cast<unsigned>(__ldg(h + 2 * v + 1)) << 16);
    }
  } else {
#pragma unroll
    for (int v = 0; v < NB / 4; ++v) {
      w[v] = static_cast<unsigned>(__ldg(p + 4 * v)) | (static_cast<unsigned>(__ldg(p + 4 * v + 1)) << 8) |
             (static_cast<unsigned>(__ldg(p + 4 * v + 2)) << 16) | (static_cast<unsigned>(__ldg(p + 4 * v + 3)) << 24);
    }
  }
}

// The little-endian 16-bit word at p (aligned to A).
template <int A>
__device__ __forceinline__ unsigned load_u16(const unsigned char* p) {
  if constexpr (A % 2 == 0) return __ldg(reinterpret_cast<const unsigned short*>(p));
  return static_cast<unsigned>(__ldg(p)) | (static_cast<unsigned>(__ldg(p + 1)) << 8);
}

// The float16 in the low 16 bits of `bits`.
__device__ __forceinline__ float half_lo(unsigned bits) {
  return f16_bits_to_float(static_cast<unsigned short>(bits & 0xFFFFu));
}

// Byte i (a compile-time index after unrolling) of the little-endian words w, shifted right by `shift` more bits.
__device__ __forceinline__ unsigned byte_of(const unsigned* w, int i, int shift = 0) {
  return w[i >> 2] >> (8 * (i & 3) + shift);
}

// The 32 weights d * (nib - 8) of 16 bytes: byte i's low nibble is weight i, its high nibble weight i + 16.
__device__ __forceinline__ void q4_0_values(const unsigned* q, float d, float* out) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const unsigned b = byte_of(q, i);
    out[i] = static_cast<float>(static_cast<int>(b & 15u) - 8) * d;
    out[i + 16] = static_cast<float>(static_cast<int>((b >> 4) & 15u) - 8) * d;
  }
}

// ---- Q4_0 and Q8_0: blocks of 32, a float16 d then the quants ------------------------------------------------------
struct Q4_0 {
  static constexpr int kWeights = 32, kHeaderBytes = 2, kQuantBytes = 16, kHeaderOffset = 0, kQuantOffset = 2;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int, float* out) {
    unsigned q[4];
    load_words<AQ, 16>(qs, q);
    q4_0_values(q, half_lo(load_u16<AH>(hdr)), out);
  }
};

struct Q8_0 {
  static constexpr int kWeights = 32, kHeaderBytes = 2, kQuantBytes = 32, kHeaderOffset = 0, kQuantOffset = 2;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int, float* out) {
    const float d = half_lo(load_u16<AH>(hdr));
    unsigned q[8];
    load_words<AQ, 32>(qs, q);
#pragma unroll
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<signed char>(byte_of(q, i) & 0xFFu)) * d;
  }
};

// ---- Q4_K and Q5_K: d, dmin, 12 bytes of 6-bit scales and mins; 8 sub-blocks of 32 ---------------------------------
// Sub-block c's d * sc and dmin * m. The 12 bytes are three words s0 (bytes 0-3), s1 (4-7), s2 (8-11): for c < 4,
// sc and m are the low 6 bits of byte c of s0 and s1; for c >= 4 their low 4 bits are the nibbles of byte c - 4 of
// s2 and their top 2 bits the top bits of byte c - 4 of s0 (sc) and s1 (m). A shift by 8 * (c & 3) picks the bytes.
template <int AH>
__device__ __forceinline__ void k_scale_min(const unsigned char* hdr, int c, float& dsc, float& dm) {
  unsigned h[4];
  load_words<AH, 16>(hdr, h);
  const int sh = 8 * (c & 3);
  const unsigned a = (h[1] >> sh) & 0xFFu, b = (h[2] >> sh) & 0xFFu, e = (h[3] >> sh) & 0xFFu;
  const unsigned sc = c < 4 ? a & 63u : (e & 15u) | ((a >> 6) << 4);
  const unsigned m = c < 4 ? b & 63u : (e >> 4) | ((b >> 6) << 4);
  dsc = half_lo(h[0]) * static_cast<float>(sc);
  dm = half_lo(h[0] >> 16) * static_cast<float>(m);
}

// The quants are 4 groups of 32 bytes: sub-block c is group c / 2, the low nibbles for even c, the high for odd.
struct Q4_K {
  static constexpr int kWeights = 256, kHeaderBytes = 16, kQuantBytes = 128, kHeaderOffset = 0, kQuantOffset = 16;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int c, float* out) {
    float dsc, dm;
    k_scale_min<AH>(hdr, c, dsc, dm);
    unsigned q[8];
    load_words<AQ, 32>(qs + 32 * (c >> 1), q);
    const int nib = 4 * (c & 1);
#pragma unroll
    for (int i = 0; i < 32; ++i) out[i] = dsc * static_cast<float>(byte_of(q, i, nib) & 15u) - dm;
  }
};

// Q4_K's nibbles plus a fifth bit: bit c of byte i of the 32 qh bytes (before the 128 nibble bytes).
struct Q5_K {
  static constexpr int kWeights = 256, kHeaderBytes = 16, kQuantBytes = 160, kHeaderOffset = 0, kQuantOffset = 16;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int c, float* out) {
    float dsc, dm;
    k_scale_min<AH>(hdr, c, dsc, dm);
    unsigned qh[8], ql[8];
    load_words<AQ, 32>(qs, qh);
    load_words<AQ, 32>(qs + 32 + 32 * (c >> 1), ql);
    const int nib = 4 * (c & 1);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const unsigned q = (byte_of(ql, i, nib) & 15u) | ((byte_of(qh, i, c) & 1u) << 4);
      out[i] = dsc * static_cast<float>(q) - dm;
    }
  }
};

// ---- Q6_K: ql[128], qh[64] (the quants), then int8 scales[16] and d (the header); 16 sub-blocks of 16 ------------
// Chunk c = 4h + s (half h of 128 weights): the 4 low bits are the low (s < 2) or high (s >= 2) nibbles of
// ql[64h + 32 (s & 1) + i], the 2 high bits bits 2s, 2s + 1 of qh[32h + i]; weights i < 16 take scales[2c], the
// others scales[2c + 1]; the value is d * scale * (q - 32).
struct Q6_K {
  static constexpr int kWeights = 256, kHeaderBytes = 18, kQuantBytes = 192, kHeaderOffset = 192, kQuantOffset = 0;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int c, float* out) {
    const unsigned sc = load_u16<AH>(hdr + 2 * c);
    const float d = half_lo(load_u16<AH>(hdr + 16));
    const float d0 = d * static_cast<float>(static_cast<signed char>(sc & 0xFFu));
    const float d1 = d * static_cast<float>(static_cast<signed char>(sc >> 8));
    const int h = c >> 2, s = c & 3;
    unsigned ql[8], qh[8];
    load_words<AQ, 32>(qs + 64 * h + 32 * (s & 1), ql);
    load_words<AQ, 32>(qs + 128 + 32 * h, qh);
    const int nib = 4 * (s >> 1);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>((byte_of(ql, i, nib) & 15u) | ((byte_of(qh, i, 2 * s) & 3u) << 4));
      out[i] = (i < 16 ? d0 : d1) * static_cast<float>(q - 32);
    }
  }
};

// ---- IQ4_XS: d, scales_h (u16), scales_l[4], then 128 bytes of 4-bit indices into the IQ4_NL table ----------------
// The IQ4_NL table (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113) as int8 bytes, four per
// word (entry 4j + i is byte i of kIq4nl<j>).
constexpr unsigned kIq4nl0 = 0xBFAD9881u, kIq4nl1 = 0xF6EADDCFu, kIq4nl2 = 0x26190D01u, kIq4nl3 = 0x71594535u;

// The table's int8 values of four 4-bit indices (one per byte of n, each < 16), as four bytes: __byte_perm picks byte
// (index & 7) of entries 0-7 and of entries 8-15 (its selector nibbles stay below 8: bit 3 would sign-replicate),
// and bit 3 of each index chooses between the two.
__device__ __forceinline__ unsigned iq4nl_bytes(unsigned n) {
  const unsigned low = n & 0x07070707u;
  const unsigned pairs = low | (low >> 4);  // index bytes 0, 1 as the nibbles of byte 0; 2, 3 of byte 2
  const unsigned sel = (pairs & 0xFFu) | ((pairs >> 8) & 0xFF00u);
  const unsigned lo = __byte_perm(kIq4nl0, kIq4nl1, sel), hi = __byte_perm(kIq4nl2, kIq4nl3, sel);
  const unsigned upper = ((n >> 3) & 0x01010101u) * 0xFFu;
  return (lo & ~upper) | (hi & upper);
}

// Sub-block c: ls = nibble c % 2 of scales_l[c / 2] | bits 2c, 2c + 1 of scales_h << 4; its 32 indices are the low
// (weights i < 16) and high (weights 16 + i) nibbles of qs[16c + i]; the value is d * (ls - 32) * table[index].
struct IQ4_XS {
  static constexpr int kWeights = 256, kHeaderBytes = 8, kQuantBytes = 128, kHeaderOffset = 0, kQuantOffset = 8;
  template <int AH, int AQ>
  __device__ static void chunk(const unsigned char* hdr, const unsigned char* qs, int c, float* out) {
    unsigned h[2];
    load_words<AH, 8>(hdr, h);
    const unsigned ls = ((h[1] >> (4 * c)) & 15u) | (((h[0] >> (16 + 2 * c)) & 3u) << 4);
    const float dl = half_lo(h[0]) * static_cast<float>(static_cast<int>(ls) - 32);
    unsigned q[4];
    load_words<AQ, 16>(qs + 16 * c, q);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const unsigned lo = iq4nl_bytes(q[v] & 0x0F0F0F0Fu), hi = iq4nl_bytes((q[v] >> 4) & 0x0F0F0F0Fu);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        out[4 * v + j] = dl * static_cast<float>(static_cast<signed char>((lo >> (8 * j)) & 0xFFu));
        out[16 + 4 * v + j] = dl * static_cast<float>(static_cast<signed char>((hi >> (8 * j)) & 0xFFu));
      }
    }
  }
};

}  // namespace gguf
}  // namespace ft

// Dropout's keep decision as the fused GroupNorm's Triton kernels draw it (gn_kernels._keep_tile; norm.keep_mask is
// the reference, tests/test_conv_cutlass.py compiles this header on the host against it): a 32-bit hash of the
// step's seed and the element's index in (n, hw, c) order, kept where its top 24 bits are >= thr = p 2^24; with
// pair one hash for channels 2j and 2j + 1 (index / 2), channel c's the low 16 bits for even c and the high for odd,
// kept where >= thr = p 2^16. Used by conv_fprop.cu's dgrad epilogue to replay the forward's mask.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define KEEP_HD __host__ __device__ __forceinline__
#else
#define KEEP_HD inline
#endif

// The seed's mix (gn_kernels._mix_seed), from the int64 seed tensor's low 32 bits.
KEEP_HD uint32_t keep_mix_seed(uint32_t s) {
  s ^= s >> 16;
  s *= 0x7FEB352Du;
  s ^= s >> 15;
  return s;
}

// The 32-bit hash of element j (an index, or index / 2 with pair).
KEEP_HD uint32_t keep_hash(uint32_t mixed_seed, uint32_t j) {
  uint32_t z = j * 0x9E3779B1u + mixed_seed;
  z ^= z >> 16;
  z *= 0x85EBCA6Bu;
  z ^= z >> 13;
  z *= 0xC2B2AE35u;
  z ^= z >> 16;
  return z;
}

KEEP_HD bool keep_at(uint32_t mixed_seed, uint32_t index, uint32_t thr, bool pair) {
  uint32_t z = keep_hash(mixed_seed, pair ? index >> 1 : index);
  uint32_t r = pair ? (z >> (16 * (index & 1u))) & 0xFFFFu : z >> 8;
  return r >= thr;
}

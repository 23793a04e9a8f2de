// Philox4x32-10: the counter-based RNG of Salmon et al., "Parallel Random Numbers: As Easy
// as 1, 2, 3" (SC'11), bit-compatible with Random123's philox4x32_10 and with cuRAND's
// Philox4_32_10 block function. A draw is a pure function of (key, counter), so a replayed
// sequence redraws the same numbers with no state to carry, and the CPU and a CUDA kernel
// that feed the same (key, counter) get the same bits.
//
// Header-only and usable from CUDA device code (the functions are __host__ __device__
// when compiled by nvcc).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CONVEYOR_HD __host__ __device__ __forceinline__
#else
#define CONVEYOR_HD inline
#endif

namespace conveyor {

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_detail {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments

CONVEYOR_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}
}  // namespace philox_detail

// The block function: ten rounds over counter `ctr` with key (k0, k1).
CONVEYOR_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t k0, uint32_t k1) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, ctr.v[0], hi0, lo0);
    mulhilo(kMul1, ctr.v[2], hi1, lo1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// Keyed by a 64-bit seed, counted by two 64-bit words: the common way Conveyor calls it.
// counter = (c0 low, c0 high, c1 low, c1 high), key = (seed low, seed high).
CONVEYOR_HD Philox4x32 philox_draw(uint64_t seed, uint64_t c0, uint64_t c1) {
  return philox4x32_10(Philox4x32{{uint32_t(c0), uint32_t(c0 >> 32), uint32_t(c1), uint32_t(c1 >> 32)}},
                       uint32_t(seed), uint32_t(seed >> 32));
}

// A double uniform in [0, 1) with 53 random bits: the top 32 bits from a, the next 21 from
// the top of b. Exactly representable, so CPU and GPU agree bit for bit.
CONVEYOR_HD double uniform_double(uint32_t a, uint32_t b) {
  const uint64_t bits = (uint64_t(a) << 21) | uint64_t(b >> 11);
  return double(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

// A float uniform in [0, 1) with 24 random bits (the top 24 of x).
CONVEYOR_HD float uniform_float(uint32_t x) { return float(x >> 8) * (1.0f / 16777216.0f); }

}  // namespace conveyor

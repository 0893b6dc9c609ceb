// Philox4x32-10 (Salmon et al. 2011) as one inline function for both the host (engine) and
// CUDA kernels, so that draws made on the GPU are bit-identical to the CPU reference.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define IMAGEGEN_HD __host__ __device__ __forceinline__
#else
#define IMAGEGEN_HD inline
#endif

namespace imagegen {

struct Philox4 {
  uint32_t v[4];
};

IMAGEGEN_HD Philox4 PhiloxRounds(Philox4 c, uint64_t key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c.v[2];
    const Philox4 n = {{static_cast<uint32_t>(p1 >> 32) ^ c.v[1] ^ k0, static_cast<uint32_t>(p1),
                        static_cast<uint32_t>(p0 >> 32) ^ c.v[3] ^ k1, static_cast<uint32_t>(p0)}};
    c = n;
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// 53 random bits as a double in [0, 1).
IMAGEGEN_HD double PhiloxUniform(uint64_t seed, uint32_t position, uint32_t iteration,
                                 uint32_t purpose, uint32_t index) {
  const Philox4 r = PhiloxRounds(Philox4{{position, iteration, purpose, index}}, seed);
  const uint64_t bits =
      ((static_cast<uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11)) & ((uint64_t{1} << 53) - 1);
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

}  // namespace imagegen

#include "engine/decoding/philox.h"

#include "kernels/philox_rounds.h"

namespace imagegen {

PhiloxBlock Philox4x32(const PhiloxBlock& counter, uint64_t key) {
  const Philox4 r = PhiloxRounds(Philox4{{counter[0], counter[1], counter[2], counter[3]}}, key);
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}

double Uniform(uint64_t seed, uint32_t position, uint32_t iteration, Purpose purpose,
               uint32_t index) {
  return PhiloxUniform(seed, position, iteration, static_cast<uint32_t>(purpose), index);
}

}  // namespace imagegen

#include "engine/decoding/philox.h"

#include <cmath>

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

void Normals(uint64_t seed, uint32_t position, uint32_t iteration, Purpose purpose, float* out,
             int64_t n, uint32_t first_index) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int64_t k = 0; 2 * k < n; ++k) {
    const auto i = static_cast<uint32_t>(first_index + 2 * k);
    // 1 - u lies in (0, 1], so the log is finite.
    const double r =
        std::sqrt(-2.0 * std::log(1.0 - Uniform(seed, position, iteration, purpose, i)));
    const double a = kTwoPi * Uniform(seed, position, iteration, purpose, i + 1);
    out[2 * k] = static_cast<float>(r * std::cos(a));
    if (2 * k + 1 < n) out[2 * k + 1] = static_cast<float>(r * std::sin(a));
  }
}

}  // namespace imagegen

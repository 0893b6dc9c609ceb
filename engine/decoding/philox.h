// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011). Every draw is a pure
// function of (request seed, position, iteration, purpose, index), so a request's draws do not
// depend on what else is in the batch or on the order in which they are made (DESIGN.md,
// "Randomness and determinism"). Thread-safe (pure functions).
#pragma once

#include <array>
#include <cstdint>

namespace imagegen {

// What a draw is for; part of the counter so that draws for different purposes never collide.
enum class Purpose : uint32_t {
  kSample = 1,     // sampling a committed token from p
  kDraftInit = 2,  // random initialisation of a Jacobi window
  kAccept = 3,     // acceptance test u < p/q
  kResample = 4,   // residual resampling after a rejection
  kDraft = 5,      // drawing a draft token from a distribution
  kGumbel = 6,     // Gumbel noise for coupled drafts (keyed by position only)
  // Continuous tokens (MAR, CSpD): a token's diffusion trajectory noise (x_T and every step's
  // eps), keyed by position only so that draft and target share it (trajectory alignment).
  kTrajectory = 7,
  kResidualProposal = 8,  // CSpD residual sampling: proposals from the target's Gaussian
};

using PhiloxBlock = std::array<uint32_t, 4>;

PhiloxBlock Philox4x32(const PhiloxBlock& counter, uint64_t key);

// A double uniform on [0, 1) with 53 random bits.
double Uniform(uint64_t seed, uint32_t position, uint32_t iteration, Purpose purpose,
               uint32_t index = 0);

// n standard normal floats (Box-Muller on pairs of uniforms with indices 2k and 2k + 1 after
// `first_index`), written to out[0..n).
void Normals(uint64_t seed, uint32_t position, uint32_t iteration, Purpose purpose, float* out,
             int64_t n, uint32_t first_index = 0);

}  // namespace imagegen

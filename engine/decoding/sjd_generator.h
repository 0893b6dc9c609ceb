// Speculative Jacobi Decoding (seed 001 Alg. 1; shared/docs/algorithms.md section 1) over the
// ragged GPT forward: each request keeps a window of L-1 drafts, each with the full
// distribution q it was drawn from. One forward per step feeds [last committed, drafts...];
// drafts are verified in order with the exact rule min(1, p/q); the first rejection is replaced
// from the residual and ends acceptance; if all pass a bonus token is drawn from p. The rest of
// the window is redrawn from the stale p of this forward (q := that p) and new random drafts
// (q one-hot, or uniform) fill it up. Lossless: committed tokens are distributed exactly as AR.
// First cut of issue 3: the plain `sjd` preset only. Not thread-safe (owns a KV cache per call).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/decoding/ar_generator.h"
#include "engine/model/gpt.h"

namespace imagegen {

struct SjdParams {
  int64_t window = 16;           // L: tokens fed per step (1 committed + L-1 drafts)
  bool uniform_init_q = false;   // random drafts: q one-hot (false) or uniform over the vocab
};

struct SjdResult {
  ImageResult image;
  int64_t drafts_verified = 0;  // drafts tested against p (up to and including a rejection)
  int64_t drafts_accepted = 0;
};

class SjdGenerator {
 public:
  explicit SjdGenerator(const Gpt& gpt) : gpt_(gpt) {}
  StatusOr<std::vector<SjdResult>> Generate(const std::vector<ImageRequest>& requests,
                                            const SjdParams& params) const;

  // Test hook: a verifier that accepts every draft (must fail the exact-distribution test).
  bool broken_accept_always = false;

 private:
  const Gpt& gpt_;
};

}  // namespace imagegen

// Random inputs for the fused final distributions (kernels/guided_probs.h): a step's logits and
// its output rows with and without CFG, at scales and temperatures from plain to extreme, and
// the eager path on them (CfgCombine then FinalProbs, as GuidedBatch::Probs): the reference the
// fused pass is checked against on the host (guided_probs_test.cc) and on a GPU
// (kernels_test.cc).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "engine/decoding/sampling.h"
#include "kernels/guided_probs.h"

namespace imagegen::guided_test {

struct GuidedCase {
  at::Tensor logits;                  // [T, V] float32, on the CPU
  std::vector<int64_t> cond, uncond;  // per output row: its logit rows
  std::vector<float> scale;           // per output row (1 without CFG)
  std::vector<double> temperature;    // per output row, as a request gives it
  std::vector<int64_t> top_k;         // per output row, as a request gives it (0: none)
  int64_t rows() const { return static_cast<int64_t>(cond.size()); }
};

// `n` output rows over 2n logit rows. Row r: without CFG (its own row twice, scale 1) when
// r % 4 == 0, else its pair with scale 1.5-7.5; temperature 1, 0.6, 2.5 or 1e-7 (held at 1e-5:
// nearly one-hot); logits of spread 1, 8 or 30, and every ninth row flat (all ids equal),
// every thirteenth one id far above the rest; top-k none, 1, 2, 5, V / 3 or V - 1 in turn
// (ties with the k-th largest kept: the flat rows).
inline GuidedCase RandomGuidedCase(int64_t n, int64_t V, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  GuidedCase c;
  const int64_t T = 2 * n;
  at::Tensor spread = at::tensor(std::vector<float>{1.0F, 8.0F, 30.0F})
                          .index_select(0, at::arange(T, at::kLong) % 3);
  at::Tensor logits =
      at::randn({T, V}, g, at::TensorOptions().dtype(at::kFloat)) * spread.unsqueeze(1);
  const double temps[] = {1.0, 0.6, 2.5, 1e-7};
  for (int64_t r = 0; r < n; ++r) {
    if (r % 9 == 5) logits[2 * r].fill_(0.25);
    if (r % 13 == 7) logits[2 * r][(r * 31) % V] = 60.0;
    const bool cfg = r % 4 != 0;
    c.cond.push_back(2 * r);
    c.uncond.push_back(cfg ? 2 * r + 1 : 2 * r);
    c.scale.push_back(cfg ? 1.5F + static_cast<float>(r % 7) : 1.0F);
    c.temperature.push_back(temps[(r / 2) % 4]);
    const int64_t ks[] = {0, 1, 2, 5, V / 3, V - 1};
    c.top_k.push_back(ks[(r / 3) % 6]);
  }
  c.logits = logits.contiguous();
  return c;
}

// What GuidedBatch::FusedProbs uploads (kernels::GuidedMetaRow).
inline std::vector<double> GuidedMeta(const GuidedCase& c) {
  const int64_t n = c.rows();
  std::vector<double> meta(static_cast<size_t>(5 * n));
  for (int64_t r = 0; r < n; ++r) {
    kernels::GuidedMetaRow(meta.data(), n, c.logits.size(1), r, c.cond[r], c.uncond[r], c.scale[r],
                           c.temperature[r], c.top_k[r]);
  }
  return meta;
}

// The eager path (GuidedBatch::Probs): float32 [rows, V].
inline at::Tensor EagerGuidedProbs(const GuidedCase& c) {
  at::Tensor ci = at::tensor(c.cond, at::kLong), ui = at::tensor(c.uncond, at::kLong);
  std::vector<SamplingParams> params(c.cond.size());
  for (size_t r = 0; r < params.size(); ++r) {
    params[r].temperature = c.temperature[r];
    params[r].top_k = c.top_k[r];
  }
  return FinalProbs(CfgCombine(c.logits.index_select(0, ci), c.logits.index_select(0, ui),
                               at::tensor(c.scale, at::kFloat)),
                    params);
}

// z = CfgCombine / temperature as the eager path computes it: float32 [rows, V].
inline at::Tensor EagerLogits(const GuidedCase& c) {
  at::Tensor ci = at::tensor(c.cond, at::kLong), ui = at::tensor(c.uncond, at::kLong);
  std::vector<float> temps;
  for (double t : c.temperature) temps.push_back(static_cast<float>(std::max(t, 1e-5)));
  return (CfgCombine(c.logits.index_select(0, ci), c.logits.index_select(0, ui),
                     at::tensor(c.scale, at::kFloat)) /
          at::tensor(temps, at::kFloat).unsqueeze(1))
      .contiguous();
}

// The ids top-k keeps, by FinalProbs' rule (at least the k-th largest z): bool [rows, V].
inline at::Tensor EagerKeep(const GuidedCase& c) {
  at::Tensor z = EagerLogits(c);
  const int64_t V = z.size(1);
  at::Tensor sorted = std::get<0>(z.sort(1, /*descending=*/true));
  std::vector<int64_t> kk;
  for (int64_t k : c.top_k) kk.push_back((k > 0 ? std::min(k, V) : V) - 1);
  return z >= sorted.gather(1, at::tensor(kk, at::kLong).unsqueeze(1));
}

// The fused pass's arguments over `logits` and `meta` (host or device memory alike), writing
// into `out` [rows, V] float64.
inline kernels::GuidedProbsArgs GuidedArgs(const GuidedCase& c, const at::Tensor& logits,
                                           const double* meta, at::Tensor& out) {
  out = at::empty({c.rows(), logits.size(1)}, logits.options().dtype(at::kDouble));
  kernels::GuidedProbsArgs a;
  a.logits = logits.data_ptr<float>();
  a.meta = meta;
  a.rows = c.rows();
  a.vocab = logits.size(1);
  a.out = out.data_ptr<double>();
  return a;
}

// The fused pass on the host (the engine's CPU path): float64 [rows, V].
inline at::Tensor HostGuidedProbs(const GuidedCase& c) {
  const std::vector<double> meta = GuidedMeta(c);
  at::Tensor out;
  const kernels::GuidedProbsArgs a = GuidedArgs(c, c.logits, meta.data(), out);
  for (int64_t r = 0; r < c.rows(); ++r) kernels::GuidedProbsRowOnHost(a, r);
  return out;
}

// Elements of `got` farther from `want` than rel * max(|got|, |want|) + abs.
inline int64_t ProbsMismatches(const at::Tensor& want, const at::Tensor& got, double rel,
                               double abs) {
  at::Tensor w = want.to(at::kDouble).cpu(), x = got.to(at::kDouble).cpu();
  at::Tensor tol = at::maximum(w.abs(), x.abs()) * rel + abs;
  return ((w - x).abs() > tol).sum().item<int64_t>();
}

}  // namespace imagegen::guided_test

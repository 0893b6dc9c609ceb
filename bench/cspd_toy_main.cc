// How good is CSpD's approximate acceptance ratio? A two-step linear-Gaussian toy where the
// target's output distribution is known in closed form, so the distance each variant of the
// rule introduces can be measured (tests/cspd_rule_test.cc covers the one-step case, where the
// paper's rule is exact).
//
// Each model m (target p, draft q) maps x_T ~ N(0, I) through x_1 = a_m x_T + s_m e_1 and
// x_0 ~ N(b_m x_1 + c_m, sigma_m^2), dimension-wise. The target's x_0 is then Gaussian with
// mean c_p and variance b_p^2 (a_p^2 + s_p^2) + sigma_p^2. Variants:
//   paper       Eq. 9: Sigma * p(x_0 | x_1^p) / q(x_0 | x_1^q), Sigma = prod s_q / s_p (Eq. 8),
//               x_1^p from the draft's noise (trajectory alignment), residual by Corollary 1
//   inverted    the same with 1 / Sigma (the authors' code)
//   no-sigma    Sigma = 1
//   unaligned   the target's x_1 from fresh noise
//   authors     inverted Sigma, inner temperature 42, the draft's mean as its token, 100
//               residual rounds then an all-zero latent
//   path-exact  speculative sampling on whole trajectories: the target's path density at the
//               draft's path over the draft's, residual proposals from target paths (lossless)
// Prints, per scenario and variant, the acceptance rate, the output's mean and std against the
// target's, and the Kolmogorov-Smirnov distance to the target's marginal with its p-value.
//
// usage: imagegen-cspd-toy [--tokens N] [--seed S]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/decoding/cspd_rule.h"

namespace imagegen {
namespace {

struct Model {
  double a, s, b, c, sigma;
  double marginal_var() const { return b * b * (a * a + s * s) + sigma * sigma; }
};

struct Scenario {
  std::string name;
  Model p, q;
};

enum class Variant { kPaper, kInverted, kNoSigma, kUnaligned, kAuthors, kPathExact };

const char* Name(Variant v) {
  switch (v) {
    case Variant::kPaper:
      return "paper";
    case Variant::kInverted:
      return "inverted";
    case Variant::kNoSigma:
      return "no-sigma";
    case Variant::kUnaligned:
      return "unaligned";
    case Variant::kAuthors:
      return "authors";
    case Variant::kPathExact:
      return "path-exact";
  }
  return "?";
}

// log N(x; mean, std^2) summed over the last dimension, without the 2 pi constant.
at::Tensor LogN(const at::Tensor& x, const at::Tensor& mean, double std) {
  const at::Tensor z = (x - mean) / std;
  return (-0.5 * z * z - std::log(std)).sum(-1);
}

// Kolmogorov-Smirnov distance of samples (one dimension) to N(mean, var), and its asymptotic
// p-value.
std::pair<double, double> Ks(const at::Tensor& x, double mean, double var) {
  const at::Tensor sorted = std::get<0>(x.to(at::kDouble).sort());
  const int64_t n = sorted.size(0);
  const at::Tensor cdf = 0.5 * at::erfc(-(sorted - mean) / std::sqrt(2 * var));
  const at::Tensor i = at::arange(n, at::kDouble);
  const double d = std::max((cdf - i / n).abs().max().item<double>(),
                            (cdf - (i + 1) / n).abs().max().item<double>());
  double p = 0;
  const double t = static_cast<double>(n) * d * d;
  for (int k = 1; k <= 100; ++k) p += 2 * ((k % 2) ? 1 : -1) * std::exp(-2.0 * k * k * t);
  return {d, std::clamp(p, 0.0, 1.0)};
}

void Run(const Scenario& sc, Variant v, int64_t n, uint64_t seed) {
  constexpr int64_t kDims = 2;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const Model &p = sc.p, &q = sc.q;
  const at::Tensor xT = at::randn({n, kDims}, gen);
  const at::Tensor e1 = at::randn({n, kDims}, gen);
  const at::Tensor e0 = at::randn({n, kDims}, gen);
  const at::Tensor x1q = q.a * xT + q.s * e1;
  const at::Tensor e1p = v == Variant::kUnaligned ? at::randn({n, kDims}, gen) : e1;
  const at::Tensor x1p = p.a * xT + p.s * e1p;
  const at::Tensor mq = q.b * x1q + q.c;
  const at::Tensor x0 = v == Variant::kAuthors ? mq : mq + q.sigma * e0;
  const int64_t rounds = v == Variant::kAuthors ? 100 : 256;
  const at::Tensor u = at::rand({n}, gen);
  const at::Tensor prop_u = at::rand({n, rounds}, gen);

  at::Tensor tokens, accepted;
  if (v == Variant::kPathExact) {
    // Exact speculative sampling over (x_1, x_0) given the shared x_T.
    const at::Tensor log_r = LogN(x1q, p.a * xT, p.s) - LogN(x1q, q.a * xT, q.s) +
                             LogN(x0, p.b * x1q + p.c, p.sigma) - LogN(x0, mq, q.sigma);
    accepted = at::log(u) < log_r;
    // Residual: target paths (fresh noise), kept with probability max(0, 1 - q(Y) / p(Y)).
    const at::Tensor y1 = p.a * xT.unsqueeze(1) + p.s * at::randn({n, rounds, kDims}, gen);
    const at::Tensor y0 = p.b * y1 + p.c + p.sigma * at::randn({n, rounds, kDims}, gen);
    const at::Tensor xTr = xT.unsqueeze(1);
    const at::Tensor log_qp = LogN(y1, q.a * xTr, q.s) + LogN(y0, q.b * y1 + q.c, q.sigma) -
                              LogN(y1, p.a * xTr, p.s) - LogN(y0, p.b * y1 + p.c, p.sigma);
    const at::Tensor kept = prop_u < at::clamp_min(-at::expm1(at::clamp_max(log_qp, 0.0)), 0.0);
    const at::Tensor first = kept.to(at::kByte).argmax(1);
    const at::Tensor chosen = y0.gather(1, first.view({n, 1, 1}).expand({n, 1, kDims})).squeeze(1);
    tokens = at::where(accepted.unsqueeze(1), x0,
                       at::where(kept.any(1).unsqueeze(1), chosen, y0.select(1, 0)));
  } else {
    const double log_sigma_q = v == Variant::kNoSigma ? 0.0 : kDims * std::log(q.s);
    const double log_sigma_p = v == Variant::kNoSigma ? 0.0 : kDims * std::log(p.s);
    CspdHeads hq{mq, at::full({n, kDims}, q.sigma), at::full({n}, log_sigma_q)};
    CspdHeads hp{p.b * x1p + p.c, at::full({n, kDims}, p.sigma), at::full({n}, log_sigma_p)};
    CspdRuleOptions opts;
    if (v == Variant::kInverted || v == Variant::kAuthors) opts.invert_sigma = true;
    if (v == Variant::kAuthors) {
      opts.inner_temperature = 42;
      opts.fallback = CspdFallback::kZero;
    }
    const CspdVerdict verdict =
        CspdVerify(x0, hq, hp, {u, at::randn({n, rounds, kDims}, gen), prop_u}, opts);
    tokens = verdict.tokens;
    accepted = verdict.accepted;
  }
  const at::Tensor d0 = tokens.select(1, 0);
  const auto [ks, ks_p] = Ks(d0, p.c, p.marginal_var());
  std::printf("%-12s %-11s %8.3f %9.4f %9.4f %9.4f %9.4f %8.4f %9.2g\n", sc.name.c_str(), Name(v),
              accepted.to(at::kFloat).mean().item<double>(), d0.mean().item<double>(), p.c,
              d0.std().item<double>(), std::sqrt(p.marginal_var()), ks, ks_p);
}

}  // namespace
}  // namespace imagegen

int main(int argc, char** argv) {
  using namespace imagegen;
  int64_t n = 200000;
  uint64_t seed = 20261124;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {
      n = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--tokens N] [--seed S]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(1);
  // {a, s, b, c, sigma} per model: target first, draft second.
  const std::vector<Scenario> scenarios = {
      {"same-steps", {0.9, 0.4, 1.0, 0.0, 0.3}, {0.9, 0.4, 1.0, 0.2, 0.35}},
      {"std-differs", {0.9, 0.4, 1.0, 0.0, 0.3}, {0.9, 0.6, 1.0, 0.0, 0.3}},
      {"all-differ", {0.9, 0.4, 1.0, 0.0, 0.3}, {0.7, 0.5, 1.1, 0.2, 0.4}},
  };
  std::printf("%-12s %-11s %8s %9s %9s %9s %9s %8s %9s\n", "scenario", "variant", "accept", "mean",
              "target", "std", "target", "KS", "KS p");
  for (const Scenario& sc : scenarios) {
    for (Variant v : {Variant::kPaper, Variant::kInverted, Variant::kNoSigma, Variant::kUnaligned,
                      Variant::kAuthors, Variant::kPathExact}) {
      Run(sc, v, n, seed);
    }
  }
  return 0;
}

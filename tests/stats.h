// Goodness-of-fit statistics for the exact-distribution tests: Pearson's chi-square against
// known probabilities, its p-value (regularised upper incomplete gamma), and total variation.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace imagegen::testing {

// Q(a, x) = Gamma(a, x) / Gamma(a): series for x < a + 1, continued fraction (modified Lentz)
// otherwise; double precision is ample for p-values down to 1e-300.
inline double RegularizedGammaQ(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_prefix = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 100000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-16) break;
    }
    return 1.0 - sum * std::exp(log_prefix);
  }
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-16) break;
  }
  return std::exp(log_prefix) * h;
}

struct ChiSquare {
  double statistic = 0;
  int df = 0;
  double p_value = 1;
};

// Pearson's test of counts against probabilities. Cells whose expected count is below
// `min_expected` are pooled into one cell, so the chi-square approximation holds. Observations
// in cells of probability zero make the p-value 0 (an impossible outcome was drawn).
inline ChiSquare ChiSquareTest(const std::vector<int64_t>& counts, const std::vector<double>& probs,
                               double min_expected = 5.0) {
  if (counts.size() != probs.size()) throw std::invalid_argument("counts/probs size");
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  ChiSquare r;
  double pooled_obs = 0, pooled_exp = 0;
  int cells = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probs[i] * static_cast<double>(n);
    if (probs[i] == 0) {
      if (counts[i] > 0) return {HUGE_VAL, 0, 0.0};
      continue;
    }
    if (e < min_expected) {
      pooled_obs += static_cast<double>(counts[i]);
      pooled_exp += e;
      continue;
    }
    r.statistic += (counts[i] - e) * (counts[i] - e) / e;
    ++cells;
  }
  if (pooled_exp > 0) {
    r.statistic += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / pooled_exp;
    ++cells;
  }
  r.df = cells - 1;
  r.p_value = r.df > 0 ? RegularizedGammaQ(r.df / 2.0, r.statistic / 2.0) : 1.0;
  return r;
}

inline double TotalVariation(const std::vector<double>& p, const std::vector<double>& q) {
  double s = 0;
  for (size_t i = 0; i < p.size(); ++i) s += std::fabs(p[i] - q[i]);
  return s / 2;
}

}  // namespace imagegen::testing

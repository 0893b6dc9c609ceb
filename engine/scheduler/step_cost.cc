#include "engine/scheduler/step_cost.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "engine/util/json.h"

namespace imagegen {
namespace {

constexpr char kFormat[] = "imagegen-step-cost";
// 2: median of three, up to 32 requests; 3: one request at every knot up to 64 nodes.
constexpr int64_t kVersion = 3;

// A step of a million seconds or more is not a measurement (a garbage cache file): samples
// near 1e308 overflowed the fit's normal equations. (A cache timed on a machine 10,000x slower,
// thousands of seconds a step, is still read, and replaced by the spot check.)
bool Valid(const StepCostSample& s) {
  return s.tokens >= 1 && s.requests >= 1 && std::isfinite(s.seconds) && s.seconds > 0 &&
         s.seconds < 1e6;
}

// Solves a x = b (n x n, row-major) by Gaussian elimination with partial pivoting; false when
// singular.
bool Solve(std::vector<double> a, std::vector<double> b, int64_t n, std::vector<double>& x) {
  for (int64_t c = 0; c < n; ++c) {
    int64_t piv = c;
    for (int64_t r = c + 1; r < n; ++r) {
      if (std::abs(a[r * n + c]) > std::abs(a[piv * n + c])) piv = r;
    }
    if (std::abs(a[piv * n + c]) < 1e-300) return false;
    if (piv != c) {
      for (int64_t k = 0; k < n; ++k) std::swap(a[c * n + k], a[piv * n + k]);
      std::swap(b[c], b[piv]);
    }
    for (int64_t r = c + 1; r < n; ++r) {
      const double f = a[r * n + c] / a[c * n + c];
      if (f == 0) continue;
      for (int64_t k = c; k < n; ++k) a[r * n + k] -= f * a[c * n + k];
      b[r] -= f * b[c];
    }
  }
  x.assign(static_cast<size_t>(n), 0);
  for (int64_t r = n - 1; r >= 0; --r) {
    double s = b[r];
    for (int64_t k = r + 1; k < n; ++k) s -= a[r * n + k] * x[k];
    x[r] = s / a[r * n + r];
  }
  return true;
}

}  // namespace

SpotCheck JudgeSpotCheck(const std::vector<double>& ratios, double factor) {
  if (ratios.empty()) return SpotCheck::kConsistent;
  bool faster = true, slower = true;
  for (double r : ratios) {
    if (!std::isfinite(r)) return SpotCheck::kFaster;  // no usable prediction: replaced
    faster &= r * factor < 1;
    slower &= r > factor;
  }
  return faster ? SpotCheck::kFaster : slower ? SpotCheck::kSlower : SpotCheck::kConsistent;
}

StepCostModel::StepCostModel(int64_t max_tokens) {
  int64_t t = 1;
  knots_.push_back(t);
  while (t < std::max<int64_t>(max_tokens, 2)) knots_.push_back(t *= 2);
  values_.assign(knots_.size(), 0);
  const auto p = static_cast<size_t>(Params());
  prior_a_.assign(p * p, 0);
  online_a_.assign(p * p, 0);
  prior_b_.assign(p, 0);
  online_b_.assign(p, 0);
}

StepCostModel StepCostModel::Linear(double base, double per_token, double per_request) {
  StepCostModel m(2);
  m.fixed_ = true;
  m.fixed_base_ = base;
  m.fixed_per_token_ = per_token;
  m.per_request_ = per_request;
  return m;
}

void StepCostModel::Features(int64_t tokens, int64_t requests, std::vector<double>& phi) const {
  phi.assign(static_cast<size_t>(Params()), 0);
  const auto K = static_cast<int64_t>(knots_.size());
  const double t = static_cast<double>(std::max<int64_t>(tokens, 1));
  int64_t k = 0;  // the segment [knots_[k], knots_[k + 1]] (the last one extrapolates)
  while (k + 2 < K && static_cast<double>(knots_[k + 1]) < t) ++k;
  const double lo = static_cast<double>(knots_[k]), hi = static_cast<double>(knots_[k + 1]);
  const double w = (t - lo) / (hi - lo);
  phi[k] = 1 - w;
  phi[k + 1] = w;
  phi[K] = static_cast<double>(std::max<int64_t>(requests, 1) - 1);
}

void StepCostModel::Accumulate(std::vector<double>& a, std::vector<double>& b,
                               const StepCostSample& s, double w) const {
  std::vector<double> phi;
  Features(s.tokens, s.requests, phi);
  const int64_t n = Params();
  for (int64_t i = 0; i < n; ++i) {
    if (phi[i] == 0) continue;
    b[i] += w * phi[i] * s.seconds;
    for (int64_t j = 0; j < n; ++j) a[i * n + j] += w * phi[i] * phi[j];
  }
}

Status StepCostModel::Calibrate(const std::vector<StepCostSample>& samples) {
  if (samples.empty()) return InvalidArgument("step cost calibration: no samples");
  for (const StepCostSample& s : samples) {
    if (!Valid(s)) {
      return InvalidArgument("step cost calibration: bad sample (tokens " +
                             std::to_string(s.tokens) + ", requests " + std::to_string(s.requests) +
                             ", seconds " + std::to_string(s.seconds) + ")");
    }
  }
  if (fixed_) return OkStatus();
  prior_ = samples;
  prior_scale_ = 1;
  ratios_.clear();
  std::fill(prior_a_.begin(), prior_a_.end(), 0);
  std::fill(prior_b_.begin(), prior_b_.end(), 0);
  for (const StepCostSample& s : samples) Accumulate(prior_a_, prior_b_, s, 1);
  prior_values_ = values_;
  FitInto(false, prior_values_, prior_per_request_);
  Fit();
  return OkStatus();
}

void StepCostModel::Observe(int64_t tokens, int64_t requests, double seconds) {
  StepCostSample s{tokens, requests, seconds};
  if (fixed_ || !Valid(s)) return;
  if (!prior_.empty()) {
    const double p = Predict(tokens, requests);
    if (max_ratio >= 1) s.seconds = std::clamp(s.seconds, p / max_ratio, p * max_ratio);
    const double from_prior = PriorPredict(tokens, requests);
    if (rescale_band > 1 && rescale_window > 0 && from_prior > 0) {
      ratios_.push_back(s.seconds / from_prior);
    }
  }
  for (double& v : online_a_) v *= decay;
  for (double& v : online_b_) v *= decay;
  Accumulate(online_a_, online_b_, s, 1);
  observed_ += 1;
  bool refit = ++since_fit_ >= refit_every || prior_.empty();
  if (static_cast<int64_t>(ratios_.size()) >= std::max<int64_t>(rescale_window, 1)) {
    std::nth_element(ratios_.begin(),
                     ratios_.begin() + static_cast<std::ptrdiff_t>(ratios_.size() / 2),
                     ratios_.end());
    const double median = ratios_[ratios_.size() / 2];
    ratios_.clear();
    if (median > rescale_band || median < 1 / rescale_band) {
      prior_scale_ *= max_ratio >= 1 ? std::clamp(median, 1 / max_ratio, max_ratio) : median;
      refit = true;
    }
  }
  if (refit) Fit();
}

void StepCostModel::Fit() {
  since_fit_ = 0;
  FitInto(true, values_, per_request_);
}

void StepCostModel::FitInto(bool online, std::vector<double>& values, double& per_request) const {
  const int64_t n = Params();
  const auto K = static_cast<int64_t>(knots_.size());
  std::vector<double> a(prior_a_), b(prior_b_);
  if (online) {
    // b sums features times seconds, linear in the times: the prior scaled, then the online.
    for (double& v : b) v *= prior_scale_;
    for (size_t i = 0; i < a.size(); ++i) a[i] += online_a_[i];
    for (size_t i = 0; i < b.size(); ++i) b[i] += online_b_[i];
  }
  // The samples' weight on the knots alone: the per-request column's diagonal sums (R - 1)^2,
  // which for a calibration of up to 32 requests outweighed the knots' several hundred times
  // and made the penalty below as strong, pulling the knots of a convex f far under their
  // samples (a CPU calibration's 128-token steps predicted at 3.4 ms where all three took
  // 4.1-6.1).
  double weight = 0;
  for (int64_t i = 0; i < K; ++i) weight += a[i * n + i];
  if (weight <= 0) return;
  // Each interior knot is pulled toward the line through its neighbours (zero for an affine f).
  const double lambda = 0.01 * weight / static_cast<double>(std::max<int64_t>(K - 2, 1));
  for (int64_t k = 1; k + 1 < K; ++k) {
    const double t0 = static_cast<double>(knots_[k - 1]), t1 = static_cast<double>(knots_[k]),
                 t2 = static_cast<double>(knots_[k + 1]);
    const double alpha = (t2 - t1) / (t2 - t0);
    const int64_t idx[3] = {k - 1, k, k + 1};
    const double coef[3] = {-alpha, 1, -(1 - alpha)};
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) a[idx[i] * n + idx[j]] += lambda * coef[i] * coef[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) a[i * n + i] += 1e-9 * weight;
  std::vector<double> x;
  if (!Solve(a, b, n, x)) return;
  if (x[K] < 0) {
    // c >= 0 binds: the fit again with c = 0 (the knots alone). Clamping c after the fit would
    // leave the knots where a negative c had put them, every step of R requests predicted
    // |c| (R - 1) too slow: a calibration whose single long rows cost more than many short
    // ones (attention per row grows with its length) fitted c = -0.07 ms, and 16 one-token
    // requests were predicted at 4.97 ms where they took 4.0.
    std::vector<double> ak(static_cast<size_t>(K * K)), bk(b.begin(), b.begin() + K);
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = 0; j < K; ++j) ak[i * K + j] = a[i * n + j];
    }
    if (!Solve(std::move(ak), std::move(bk), K, x)) return;
    x.push_back(0);
  }
  for (double v : x) {
    if (!std::isfinite(v)) return;  // keeps the last fit rather than NaN predictions
  }
  for (int64_t k = 0; k < K; ++k) {
    values[k] = std::max(x[k], k == 0 ? 1e-7 : values[k - 1]);
  }
  per_request = x[K];  // >= 0: a negative one was fitted again at 0 above
}

double StepCostModel::PriorPredict(int64_t tokens, int64_t requests) const {
  return prior_scale_ * Evaluate(prior_values_, prior_per_request_, tokens, requests);
}

double StepCostModel::Predict(int64_t tokens, int64_t requests) const {
  if (fixed_) {
    return fixed_base_ + fixed_per_token_ * static_cast<double>(std::max<int64_t>(tokens, 1)) +
           per_request_ * static_cast<double>(std::max<int64_t>(requests, 1) - 1);
  }
  return Evaluate(values_, per_request_, tokens, requests);
}

double StepCostModel::Evaluate(const std::vector<double>& values, double per_request,
                               int64_t tokens, int64_t requests) const {
  // Features' sum without its vector (the planner predicts hundreds of steps a plan): the same
  // weights, the same products added in the same order.
  const auto K = static_cast<int64_t>(knots_.size());
  const double x = static_cast<double>(std::max<int64_t>(tokens, 1));
  int64_t k = 0;
  while (k + 2 < K && static_cast<double>(knots_[k + 1]) < x) ++k;
  const double lo = static_cast<double>(knots_[k]), hi = static_cast<double>(knots_[k + 1]);
  const double w = (x - lo) / (hi - lo);
  double t = 0;
  for (int64_t j = 0; j < static_cast<int64_t>(values.size()); ++j) {
    const double phi = j == k ? 1 - w : j == k + 1 ? w : 0.0;
    t += phi * values[j];
  }
  return std::max(t, values[0]) +
         per_request * static_cast<double>(std::max<int64_t>(requests, 1) - 1);
}

int64_t StepCostModel::MaxTokensWithin(double seconds, int64_t requests, int64_t limit) const {
  if (limit < 1 || Predict(1, requests) > seconds) return 0;
  if (Predict(limit, requests) <= seconds) return limit;
  int64_t lo = 1, hi = limit;  // Predict(lo) fits, Predict(hi) does not (non-decreasing in T)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (Predict(mid, requests) <= seconds ? lo : hi) = mid;
  }
  return lo;
}

int64_t StepCostModel::CalibratedRequests() const {
  int64_t m = planned_requests;
  for (const StepCostSample& s : prior_) m = std::max(m, s.requests);
  return m;
}

StepCostModel StepCostModel::OneRequest() const {
  std::vector<StepCostSample> one;
  for (const StepCostSample& s : prior_) {
    if (s.requests == 1) one.push_back(s);
  }
  StepCostModel m(knots_.empty() ? 4096 : knots_.back());
  if (fixed_ || one.empty() || !m.Calibrate(one).ok()) return *this;
  return m;
}

std::string StepCostModel::Serialize(const std::string& key) const {
  Json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["key"] = key;
  j["planned_requests"] = CalibratedRequests();
  Json samples = Json::array();
  for (const StepCostSample& s : prior_) samples.push_back({s.tokens, s.requests, s.seconds});
  j["samples"] = samples;
  return j.dump(1) + "\n";
}

Status StepCostModel::Deserialize(const std::string& text, const std::string& key,
                                  const std::string& where) {
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return DataLoss(where + ": " + parsed.status().message());
  const Json& j = *parsed;
  if (!j.is_object() || j.value("format", "") != kFormat) {
    return DataLoss(where + ": not a step-cost calibration (\"format\" is not \"" + kFormat +
                    "\")");
  }
  const Json* version = JsonFields(j, where).Find("version");
  if (version == nullptr || JsonInt(*version) != kVersion) {
    return DataLoss(where + ": unsupported \"version\" (this build reads " +
                    std::to_string(kVersion) + ")");
  }
  const Json* k = JsonFields(j, where).Find("key");
  if (k == nullptr || !k->is_string()) return DataLoss(where + ": \"key\" is missing");
  if (k->get<std::string>() != key) {
    return FailedPrecondition(where + ": calibrated for " + k->get<std::string>() + ", not for " +
                              key);
  }
  const Json* samples = JsonFields(j, where).Find("samples");
  if (samples == nullptr || !samples->is_array() || samples->empty()) {
    return DataLoss(where + ": \"samples\" must be a non-empty array");
  }
  const StatusOr<int64_t> planned = JsonFields(j, where).Int("planned_requests", 0);
  if (!planned.ok()) return DataLoss(planned.status().message());
  planned_requests = std::max<int64_t>(*planned, 0);
  std::vector<StepCostSample> out;
  for (const Json& s : *samples) {
    if (!s.is_array() || s.size() != 3 || !s[2].is_number()) {
      return DataLoss(where + ": each of \"samples\" must be [tokens, requests, seconds]");
    }
    const std::optional<int64_t> t = JsonInt(s[0]), r = JsonInt(s[1]);
    if (!t || !r) return DataLoss(where + ": sample tokens and requests must be integers");
    out.push_back({*t, *r, s[2].get<double>()});
  }
  Status st = Calibrate(out);
  if (!st.ok()) return DataLoss(where + ": " + st.message());
  return OkStatus();
}

}  // namespace imagegen

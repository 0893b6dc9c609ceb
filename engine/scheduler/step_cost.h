// The time of one engine step as a function of the target-forward tokens it feeds (CFG rows
// counted) and the requests it serves, for the goodput controller (goodput.h). Plain C++, no
// LibTorch; not thread-safe (the engine thread owns one per model).
//
// The model: t(T, R) = f(T) + c * (R - 1), with f piecewise linear through values at the knots
// T = 1, 2, 4, ..., and linear beyond the last knot. It is fitted by least squares to a
// start-up calibration (a few real steps at chosen T and R; ModelScheduler runs it, and caches
// its samples per device, model and dtype) and then refined online from every step's measured
// time: the calibration's samples stay as a fixed prior, the online ones decay (each new one
// multiplies the weight of the older ones by `decay`) and are bounded to a factor of the
// prediction (`max_ratio`: one-off stalls), and the fit is redone every few steps. When most
// recent steps ran faster (or slower) than predicted by more than `rescale_band`, the prior's
// times are scaled by the median ratio (at most `max_ratio` a time): a calibration taken while
// the machine was loaded (another process, a second daemon calibrating beside it) is off by
// about one factor everywhere, and the steps the engine runs, at a few shapes only, could not
// otherwise move the shapes they never visit.
// A small penalty on each knot's distance from the straight line through its neighbours keeps
// knots without samples on the line the others draw. f is made non-decreasing; c >= 0, by
// fitting the knots again with c = 0 when the unconstrained fit makes c negative.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

// A cached calibration checked against the device at start: `ratios` are measured / predicted
// times of a few shapes, each the fastest of a few steps. kFaster when every shape ran more
// than `factor` times faster than the calibration predicts (it was timed during a stall of the
// machine, or on a slower device), kSlower when every one ran more than `factor` times slower
// (a machine loaded right now, or a slowed device). No ratios: kConsistent. A ratio that is not
// finite (the cache predicts nothing usable) counts as kFaster: the cache is replaced.
enum class SpotCheck { kConsistent, kFaster, kSlower };
SpotCheck JudgeSpotCheck(const std::vector<double>& ratios, double factor = 3);

struct StepCostSample {
  int64_t tokens = 0;    // target-forward rows of the step
  int64_t requests = 0;  // requests in the step
  double seconds = 0;
};

class StepCostModel {
 public:
  // Knots 1, 2, 4, ... up to the first power of two >= max_tokens (at least 2).
  explicit StepCostModel(int64_t max_tokens = 4096);

  // A fixed model, t = base + per_token * T + per_request * (R - 1), that Observe leaves alone
  // (tests; and a cost override).
  static StepCostModel Linear(double base, double per_token, double per_request);

  // Replaces the prior with these samples (weight 1 each) and fits. INVALID_ARGUMENT when a
  // sample is malformed (tokens or requests < 1, seconds not finite and > 0) or none is given.
  Status Calibrate(const std::vector<StepCostSample>& samples);

  // Adds one measured step (ignored when malformed or when the model is fixed).
  void Observe(int64_t tokens, int64_t requests, double seconds);

  double Predict(int64_t tokens, int64_t requests) const;
  // The largest T <= limit with Predict(T, requests) <= seconds (0 if not even T = 1 fits).
  int64_t MaxTokensWithin(double seconds, int64_t requests, int64_t limit) const;

  bool calibrated() const { return !prior_.empty() || fixed_; }
  const std::vector<StepCostSample>& calibration() const { return prior_; }
  int64_t observed() const { return observed_; }
  const std::vector<int64_t>& knots() const { return knots_; }
  const std::vector<double>& values() const { return values_; }
  double per_request() const { return per_request_; }

  // A model fitted to this one's calibration samples of one request only (this model itself
  // when it has none, or is fixed): for a request alone (LoneRequestCeiling, goodput.h). The
  // form f(T) + c(R - 1) shares f between one wide request and many narrow ones, and on the
  // 2-core CPU the whole calibration's fit (c = 0) put one request's steps of 4-16 rows 10-30%
  // above what they measured: the margin between one node and two or three.
  StepCostModel OneRequest() const;

  // The calibration as JSON, with `key` (which device, model, dtype it belongs to).
  std::string Serialize(const std::string& key) const;
  // Reads Serialize's output; FAILED_PRECONDITION when the key differs (another device or
  // model: recalibrate), DATA_LOSS naming `where` when the text is not such a file.
  Status Deserialize(const std::string& text, const std::string& key, const std::string& where);

  double decay = 0.995;  // weight of the older online samples at each new one
  // An online sample counts as at most this factor above or below the current prediction
  // (0: as measured). A one-off stall (a CUDA graph's capture, the allocator growing its pool,
  // the host thread preempted) costs tens of steps; counted as measured, a handful of them
  // would raise the knots where they fell for hundreds of steps, and the controller would
  // then stop planning the steps that could correct it. A real change of the device's speed
  // is still learned: by this factor per refit at most.
  double max_ratio = 2;
  int64_t refit_every = 16;  // online samples between fits
  // The prior is rescaled when the median of the last `rescale_window` measured / predicted
  // ratios (each within max_ratio) is outside [1 / rescale_band, rescale_band]; 0: never.
  double rescale_band = 1.25;
  int64_t rescale_window = 64;
  // The factor the prior's times are scaled by now (1: as calibrated).
  double prior_scale() const { return prior_scale_; }
  // The most concurrent requests the calibration set out to measure (it may have stopped
  // short on a slow device); kept in the serialized file. 0: the most it measured.
  int64_t planned_requests = 0;
  int64_t CalibratedRequests() const;

 private:
  int64_t Params() const { return static_cast<int64_t>(knots_.size()) + 1; }
  void Features(int64_t tokens, int64_t requests, std::vector<double>& phi) const;
  void Accumulate(std::vector<double>& a, std::vector<double>& b, const StepCostSample& s,
                  double w) const;
  void Fit();
  // The least-squares fit of the prior (scaled by prior_scale_) and, with `online`, the online
  // samples.
  void FitInto(bool online, std::vector<double>& values, double& per_request) const;
  // The prediction of the prior's own fit, scaled by prior_scale_.
  double PriorPredict(int64_t tokens, int64_t requests) const;
  double Evaluate(const std::vector<double>& values, double per_request, int64_t tokens,
                  int64_t requests) const;

  std::vector<int64_t> knots_;
  std::vector<double> values_;  // f at the knots
  double per_request_ = 0;
  bool fixed_ = false;
  double fixed_base_ = 0, fixed_per_token_ = 0;
  std::vector<StepCostSample> prior_;
  // Normal equations: the prior's, and the decayed online samples'.
  std::vector<double> prior_a_, prior_b_, online_a_, online_b_;
  int64_t observed_ = 0, since_fit_ = 0;
  double prior_scale_ = 1;
  std::vector<double> prior_values_;  // the prior's own fit (scale 1)
  double prior_per_request_ = 0;
  std::vector<double> ratios_;  // measured / predicted since the last rescale, within max_ratio
};

}  // namespace imagegen

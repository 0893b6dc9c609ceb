// The bundled Fashion-MNIST classifier (tools/train/train_classifier.py) used to score
// generated images: class accuracy and a Frechet distance on its penultimate features against
// reference statistics of the real test set stored with it. Immutable after Load.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>

#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

class Classifier {
 public:
  static StatusOr<std::unique_ptr<Classifier>> Load(const std::string& dir,
                                                    const LoadOptions& opts);

  // images uint8 [B, 28, 28] or [B, 28, 28, 1] -> features [B, F] float32 (CPU).
  at::Tensor Features(const at::Tensor& images) const;
  // features -> logits [B, classes].
  at::Tensor Logits(const at::Tensor& features) const;

  const at::Tensor& reference_mean() const { return ref_mean_; }  // float64 [F]
  const at::Tensor& reference_cov() const { return ref_cov_; }    // float64 [F, F]
  double reference_accuracy() const { return ref_accuracy_; }

 private:
  Classifier() = default;
  LoadOptions opts_;
  at::Tensor c1w_, c1b_, c2w_, c2b_, c3w_, c3b_, c4w_, c4b_, f1w_, f1b_, f2w_, f2b_;
  at::Tensor ref_mean_, ref_cov_;
  double ref_accuracy_ = 0;
};

// Frechet distance between Gaussians (mu1, s1) and (mu2, s2), computed in float64.
double FrechetDistance(const at::Tensor& mu1, const at::Tensor& s1, const at::Tensor& mu2,
                       const at::Tensor& s2);

// Mean and covariance (unbiased) of features [N, F], float64.
std::pair<at::Tensor, at::Tensor> FeatureStats(const at::Tensor& features);

}  // namespace imagegen

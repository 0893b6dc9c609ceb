#include "engine/model/classifier.h"

#include <ATen/ATen.h>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

namespace imagegen {

StatusOr<std::unique_ptr<Classifier>> Classifier::Load(const std::string& dir,
                                                       const LoadOptions& load_opts) {
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  JsonFields f(json, dir + "/config.json");
  ASSIGN_OR_RETURN(std::string type, f.String("type"));
  if (type != "fmnist-classifier") {
    return FailedPrecondition(dir + "/config.json: 'type' must be \"fmnist-classifier\"");
  }
  ASSIGN_OR_RETURN(int64_t w, f.Int("width"));
  ASSIGN_OR_RETURN(int64_t feat, f.Int("features"));
  ASSIGN_OR_RETURN(int64_t classes, f.Int("num_classes"));
  std::unique_ptr<Classifier> m(new Classifier());
  ASSIGN_OR_RETURN(m->ref_accuracy_, f.Number("test_accuracy", 0));
  LoadOptions opts = load_opts;
  opts.dtype = at::kFloat;
  m->opts_ = opts;
  ASSIGN_OR_RETURN(auto s, WeightStore::Open(dir));
  ASSIGN_OR_RETURN(m->c1w_, s->Take("conv1.weight", {w, 1, 3, 3}, opts));
  ASSIGN_OR_RETURN(m->c1b_, s->Take("conv1.bias", {w}, opts));
  ASSIGN_OR_RETURN(m->c2w_, s->Take("conv2.weight", {w, w, 3, 3}, opts));
  ASSIGN_OR_RETURN(m->c2b_, s->Take("conv2.bias", {w}, opts));
  ASSIGN_OR_RETURN(m->c3w_, s->Take("conv3.weight", {2 * w, w, 3, 3}, opts));
  ASSIGN_OR_RETURN(m->c3b_, s->Take("conv3.bias", {2 * w}, opts));
  ASSIGN_OR_RETURN(m->c4w_, s->Take("conv4.weight", {2 * w, 2 * w, 3, 3}, opts));
  ASSIGN_OR_RETURN(m->c4b_, s->Take("conv4.bias", {2 * w}, opts));
  ASSIGN_OR_RETURN(m->f1w_, s->Take("fc1.weight", {feat, 2 * w * 7 * 7}, opts));
  ASSIGN_OR_RETURN(m->f1b_, s->Take("fc1.bias", {feat}, opts));
  ASSIGN_OR_RETURN(m->f2w_, s->Take("fc2.weight", {classes, feat}, opts));
  ASSIGN_OR_RETURN(m->f2b_, s->Take("fc2.bias", {classes}, opts));
  LoadOptions cpu64;
  cpu64.dtype = at::kDouble;  // on the CPU
  ASSIGN_OR_RETURN(m->ref_mean_, s->Take("reference.test_feature_mean", {feat}, cpu64));
  ASSIGN_OR_RETURN(m->ref_cov_, s->Take("reference.test_feature_cov", {feat, feat}, cpu64));
  RETURN_IF_ERROR(s->Finish({}));
  return m;
}

at::Tensor Classifier::Features(const at::Tensor& images) const {
  at::Tensor x = images.to(opts_.device, at::kFloat).reshape({-1, 1, 28, 28}) / 255.0;
  const auto pad = std::vector<int64_t>{1, 1};
  x = at::relu(at::conv2d(x, c1w_, c1b_, 1, pad));
  x = at::max_pool2d(at::relu(at::conv2d(x, c2w_, c2b_, 1, pad)), {2, 2});
  x = at::relu(at::conv2d(x, c3w_, c3b_, 1, pad));
  x = at::max_pool2d(at::relu(at::conv2d(x, c4w_, c4b_, 1, pad)), {2, 2});
  return at::relu(at::linear(x.flatten(1), f1w_, f1b_)).to(at::kCPU);
}

at::Tensor Classifier::Logits(const at::Tensor& features) const {
  return at::linear(features.to(opts_.device, at::kFloat), f2w_, f2b_).to(at::kCPU);
}

std::pair<at::Tensor, at::Tensor> FeatureStats(const at::Tensor& features) {
  at::Tensor f = features.to(at::kDouble);
  at::Tensor mu = f.mean(0);
  at::Tensor c = f - mu;
  at::Tensor cov = c.t().matmul(c) / static_cast<double>(f.size(0) - 1);
  return {mu, cov};
}

double FrechetDistance(const at::Tensor& mu1, const at::Tensor& s1, const at::Tensor& mu2,
                       const at::Tensor& s2) {
  at::Tensor a = s1.to(at::kDouble), b = s2.to(at::kDouble);
  // tr sqrt(s1 s2) = tr sqrt(r s2 r) with r = s1^(1/2), a symmetric PSD matrix.
  auto [ev, evec] = at::linalg_eigh(a);
  at::Tensor r = evec.matmul(at::diag(ev.clamp_min(0).sqrt())).matmul(evec.t());
  at::Tensor m = r.matmul(b).matmul(r);
  at::Tensor tr_sqrt = at::linalg_eigvalsh((m + m.t()) / 2).clamp_min(0).sqrt().sum();
  at::Tensor d = (mu1.to(at::kDouble) - mu2.to(at::kDouble)).pow(2).sum();
  return (d + at::trace(a) + at::trace(b) - 2 * tr_sqrt).item<double>();
}

}  // namespace imagegen

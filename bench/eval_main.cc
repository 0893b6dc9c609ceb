// imagegen-eval: sample N images per class with AR decoding and score them with the bundled
// classifier: class accuracy, and the Frechet distance of the classifier's penultimate features
// to those of the real Fashion-MNIST test set (stored with the classifier).
//
//   imagegen-eval --per-class 100 --min-accuracy 0.8      (the quality test in ctest)
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>

#include "bench/common.h"
#include "engine/decoding/ar_generator.h"
#include "engine/model/classifier.h"
#include "engine/model/image_model.h"

using namespace imagegen;

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"classifier", "fmnist-classifier"},
           {"per-class", "100"},
           {"seed", "1000"},
           {"cfg", "default"},
           {"temperature", "default"},
           {"top-k", "default"},
           {"top-p", "default"},
           {"batch", "200"},
           {"min-accuracy", "0"},
           {"max-fd", "-1"},
           {"grid-out", ""},
           {"device", "cpu"},
           {"dtype", "auto"}},
          "usage: imagegen-eval [--per-class N] [--cfg S] [--min-accuracy A] [--max-fd D]");
  const LoadOptions opts = LoadOptionsFromFlags(f);
  ImageModel model = OrDie(LoadImageModel(f.Str("models-dir"), f.Str("model"), opts));
  auto clf = OrDie(Classifier::Load(f.Str("models-dir") + "/" + f.Str("classifier"), opts));
  const GptConfig& cfg = model.gpt->config();
  const int64_t per_class = f.Int("per-class"), batch = f.Int("batch");
  if (per_class < 1 || batch < 1) f.Fail("--per-class and --batch must be positive");

  std::vector<ImageRequest> all;
  for (int64_t c = 0; c < cfg.num_classes; ++c) {
    for (int64_t i = 0; i < per_class; ++i) {
      ImageRequest r;
      r.class_id = c;
      r.seed = static_cast<uint64_t>(f.Int("seed") + c * per_class + i);
      r.sampling = SamplingFromFlags(f, cfg);
      all.push_back(r);
    }
  }
  ArGenerator gen(*model.gpt);
  std::vector<at::Tensor> feats, images;
  std::vector<int64_t> labels;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t b = 0; b < all.size(); b += batch) {
    std::vector<ImageRequest> chunk(all.begin() + b, all.begin() + std::min(all.size(), b + batch));
    auto results = OrDie(gen.Generate(chunk));
    std::vector<at::Tensor> ids;
    for (size_t i = 0; i < results.size(); ++i) {
      ids.push_back(at::tensor(results[i].tokens).to(at::kLong));
      labels.push_back(chunk[i].class_id);
    }
    at::Tensor img = ImageToUint8(OrDie(model.vq->Decode(at::stack(ids))));
    images.push_back(img);
    feats.push_back(clf->Features(img));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  at::Tensor features = at::cat(feats);
  at::Tensor pred = clf->Logits(features).argmax(1);
  at::Tensor y = at::tensor(labels);
  const double acc = (pred == y).to(at::kDouble).mean().item<double>();
  auto [mu, cov] = FeatureStats(features);
  const double fd = FrechetDistance(mu, cov, clf->reference_mean(), clf->reference_cov());

  const SamplingParams& sp = all[0].sampling;
  std::printf(
      "model %s: %lld images (%lld per class), cfg %.2f temperature %.2f top-k %lld "
      "top-p %.2f, seeds from %lld\n",
      model.name.c_str(), static_cast<long long>(all.size()), static_cast<long long>(per_class),
      sp.cfg_scale, sp.temperature, static_cast<long long>(sp.top_k), sp.top_p,
      static_cast<long long>(f.Int("seed")));
  std::printf("per-class accuracy:");
  for (int64_t c = 0; c < cfg.num_classes; ++c) {
    at::Tensor m = y == c;
    std::printf(" %s=%.2f",
                cfg.class_names.empty() ? std::to_string(c).c_str() : cfg.class_names[c].c_str(),
                (pred.masked_select(m) == c).to(at::kDouble).mean().item<double>());
  }
  std::printf("\nclass accuracy %.4f (classifier on real test images: %.4f)\n", acc,
              clf->reference_accuracy());
  std::printf("frechet distance to the test set %.4f\n", fd);
  std::printf("generation time %.1f s, %.1f images/s, %.1f tokens/s\n", secs, all.size() / secs,
              all.size() * cfg.block_size / secs);

  if (!f.Str("grid-out").empty()) {  // up to 10 images of every class, one class per row
    const int64_t cols = std::min<int64_t>(per_class, 10);
    std::vector<int64_t> pick;
    for (int64_t c = 0; c < cfg.num_classes; ++c) {
      for (int64_t i = 0; i < cols; ++i) pick.push_back(c * per_class + i);
    }
    WriteGridPng(at::cat(images).index_select(0, at::tensor(pick)), cols, f.Str("grid-out"));
  }
  bool ok = true;
  if (acc < f.Num("min-accuracy")) {
    std::printf("FAIL: class accuracy %.4f below --min-accuracy %.4f\n", acc,
                f.Num("min-accuracy"));
    ok = false;
  }
  if (f.Num("max-fd") >= 0 && fd > f.Num("max-fd")) {
    std::printf("FAIL: frechet distance %.4f above --max-fd %.4f\n", fd, f.Num("max-fd"));
    ok = false;
  }
  return ok ? 0 : 1;
}

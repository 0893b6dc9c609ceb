// imagegen-generate: draw images from a local model, no server, with any decoding method.
//
//   imagegen-generate --class sneaker --seed 7 --out sneaker.png
//   imagegen-generate --class sneaker --method sjd-pac --window 64 --out sneaker.png
//
// Several images (--count) are generated as rows of one batch and written side by side.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "bench/common.h"
#include "engine/decoding/speculative.h"
#include "engine/model/image_model.h"

using namespace imagegen;

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"class", "0"},
           {"seed", "0"},
           {"cfg", "default"},
           {"temperature", "default"},
           {"top-k", "default"},
           {"top-p", "default"},
           {"count", "1"},
           {"out", "image.png"},
           {"device", "cpu"},
           {"dtype", "auto"},
           {"method", "ar"},
           {"window", "0"},
           {"draft", "fmnist-draft"}},
          "usage: imagegen-generate --class NAME|ID [--seed N] [--cfg S] [--top-k K] "
          "[--count N] [--method "
          "ar|sjd|scd-mc|scd-gs|sjd-pac|pac-gumbel|gsd|cool-sjd|sd|cool-sd|ar-gm|scd-gm] "
          "[--window L] --out FILE.png");
  const LoadOptions opts = LoadOptionsFromFlags(f);
  ImageModel model = OrDie(LoadImageModel(f.Str("models-dir"), f.Str("model"), opts));
  const GptConfig& cfg = model.gpt->config();
  const int64_t class_id = OrDie(ResolveClass(cfg, f.Str("class")));
  const int64_t count = f.Int("count");
  if (count < 1 || count > 256) f.Fail("--count must be in [1, 256]");

  const DecodingPolicy policy = OrDie(PolicyFromPreset(f.Str("method"), f.Int("window")));
  std::unique_ptr<Gpt> draft;
  if (policy.draft == DraftSource::kDraftModel) {
    draft = OrDie(Gpt::Load(f.Str("models-dir") + "/" + f.Str("draft"), opts));
  }
  std::vector<ImageRequest> reqs(count);
  for (int64_t i = 0; i < count; ++i) {
    reqs[i].class_id = class_id;
    reqs[i].seed = static_cast<uint64_t>(f.Int("seed") + i);
    reqs[i].sampling = SamplingFromFlags(f, cfg);
    reqs[i].policy = policy;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<SpecResult> results = OrDie(GenerateSpeculative(*model.gpt, draft.get(), reqs));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<at::Tensor> ids;
  for (const auto& r : results) ids.push_back(at::tensor(r.tokens).to(at::kLong));
  at::Tensor img = ImageToUint8(OrDie(model.vq->Decode(at::stack(ids))));  // [N, H, W, C]
  WriteGridPng(img, std::min<int64_t>(count, 16), f.Str("out"));

  const SamplingParams& sp = reqs[0].sampling;
  double nfe = 0;
  for (const auto& r : results) nfe += static_cast<double>(r.stats.nfe) / count;
  const int64_t tokens = count * cfg.block_size;
  std::printf(
      "model %s class %lld (%s) seed %lld cfg %.2f temperature %.2f top-k %lld top-p %.2f\n",
      model.name.c_str(), static_cast<long long>(class_id),
      cfg.class_names.empty() ? "" : cfg.class_names[class_id].c_str(),
      static_cast<long long>(f.Int("seed")), sp.cfg_scale, sp.temperature,
      static_cast<long long>(sp.top_k), sp.top_p);
  std::printf("method %s\n", DescribePolicy(policy).c_str());
  std::printf("images %lld  tokens %lld  NFE/image %.1f  time %.3f s  tokens/s %.1f  -> %s\n",
              static_cast<long long>(count), static_cast<long long>(tokens), nfe, secs,
              tokens / secs, f.Str("out").c_str());
  return 0;
}

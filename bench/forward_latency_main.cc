// imagegen-forward-latency: time one decode step of the target GPT (one new token per row on
// top of a committed prefix) at several batch sizes, on CPU or CUDA. With CFG each image is two
// rows. Reports the median over repetitions; only ratios between rows of one run are meant to
// be compared across machines.
//
//   imagegen-forward-latency --device cuda --batches 1,16 --prefix 128
//
// --decoder 1 times the model's VQ decoder instead: tokens to uint8 pixels for `batches` images
// in one call (random grids), per call and per image (what EngineOptions::decode_batch saves).
//
//   imagegen-forward-latency --device cuda --decoder 1 --batches 1,4,16
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>

#include "bench/common.h"
#include "bench/op_profile.h"
#include "engine/model/image_model.h"

using namespace imagegen;

namespace {

double MedianMs(int64_t reps, const LoadOptions& opts, const std::function<void()>& run) {
  std::vector<double> ms;
  for (int64_t i = 0; i < reps + 3; ++i) {  // 3 warm-up calls
    if (opts.device.is_cuda()) torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    if (opts.device.is_cuda()) torch::cuda::synchronize();
    if (i >= 3) {
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int TimeDecoder(Flags& f, const LoadOptions& opts) {
  ImageModel m = OrDie(LoadImageModel(f.Str("models-dir"), f.Str("model"), opts));
  const int64_t n = m.gpt->config().block_size, v = m.vq->config().codebook_size;
  const int64_t reps = std::max<int64_t>(1, f.Int("reps"));
  std::printf("VQ decoder of %s on %s, %lld tokens an image\n", f.Str("model").c_str(),
              f.Str("device").c_str(), static_cast<long long>(n));
  std::printf("%8s %14s %14s\n", "images", "ms per call", "ms per image");
  std::stringstream ss(f.Str("batches"));
  for (std::string item; std::getline(ss, item, ',');) {
    const int64_t images = std::stoll(item);
    std::vector<std::vector<int32_t>> grids(static_cast<size_t>(images));
    for (size_t b = 0; b < grids.size(); ++b) {
      for (int64_t k = 0; k < n; ++k) {
        grids[b].push_back(static_cast<int32_t>((k * 7919 + static_cast<int64_t>(b) * 104729) % v));
      }
    }
    const double med = MedianMs(reps, opts, [&] { OrDie(TokensToPixels(*m.vq, grids).status()); });
    std::printf("%8lld %14.3f %14.3f\n", static_cast<long long>(images), med,
                med / static_cast<double>(images));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  OpProfile::InstallIfRequested();
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"batches", "1,16"},
           {"prefix", "-1"},
           {"reps", "20"},
           {"cfg", "true"},
           {"device", "cpu"},
           {"dtype", "auto"},
           {"decoder", "0"}},
          "usage: imagegen-forward-latency [--batches 1,16] [--prefix N] [--device cuda]");
  const LoadOptions opts = LoadOptionsFromFlags(f);
  if (f.Int("decoder") != 0) return TimeDecoder(f, opts);
  auto gpt = OrDie(Gpt::Load(f.Str("models-dir") + "/" + f.Str("model"), opts));
  const GptConfig& cfg = gpt->config();
  const int64_t prefix = f.Int("prefix") < 0 ? cfg.block_size / 2 : f.Int("prefix");
  if (prefix < 1 || prefix >= cfg.seq_len()) f.Fail("--prefix must be in [1, seq_len)");
  const int64_t reps = std::max<int64_t>(1, f.Int("reps"));
  const int64_t rows_per_image = f.Str("cfg") == "true" ? 2 : 1;
  std::printf("model %s (dim %lld, %lld layers) on %s %s, committed prefix %lld, %s\n",
              f.Str("model").c_str(), static_cast<long long>(cfg.dim),
              static_cast<long long>(cfg.n_layer), f.Str("device").c_str(), f.Str("dtype").c_str(),
              static_cast<long long>(prefix),
              rows_per_image == 2 ? "CFG (2 rows/image)" : "no CFG");
  std::printf("%8s %8s %12s %14s\n", "images", "rows", "median ms", "tokens/s");
  std::stringstream ss(f.Str("batches"));
  for (std::string item; std::getline(ss, item, ',');) {
    const int64_t images = std::stoll(item), rows = images * rows_per_image;
    KvCache cache = gpt->NewCache(rows);
    // Fill the committed prefix with one forward (its content does not matter for timing).
    std::vector<BatchRow> fill(rows), step(rows);
    for (int64_t r = 0; r < rows; ++r) {
      fill[r].slot = step[r].slot = r;
      for (int64_t p = 0; p < prefix; ++p) {
        fill[r].tokens.push_back(p == 0 ? 0 : (p * 7 + r) % cfg.vocab_size);
        fill[r].positions.push_back(p);
      }
      step[r].cache_len = prefix;
      step[r].tokens = {(r * 13) % cfg.vocab_size};
      step[r].positions = {prefix};
    }
    OrDie(gpt->Forward(fill, cache).status());
    const double med = MedianMs(reps, opts, [&] { OrDie(gpt->Forward(step, cache).status()); });
    std::printf("%8lld %8lld %12.3f %14.1f\n", static_cast<long long>(images),
                static_cast<long long>(rows), med, images / (med / 1000.0));
  }
  return 0;
}

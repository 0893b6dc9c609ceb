// imagegen-forward-latency: time one decode step of the target GPT (one new token per row on
// top of a committed prefix) at several batch sizes, on CPU or CUDA. With CFG each image is two
// rows. Reports the median over repetitions; only ratios between rows of one run are meant to
// be compared across machines.
//
//   imagegen-forward-latency --device cuda --batches 1,16 --prefix 128
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

#include "bench/common.h"
#include "bench/op_profile.h"
#include "engine/model/image_model.h"

using namespace imagegen;

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
           {"dtype", "auto"}},
          "usage: imagegen-forward-latency [--batches 1,16] [--prefix N] [--device cuda]");
  const LoadOptions opts = LoadOptionsFromFlags(f);
  auto gpt = OrDie(Gpt::Load(f.Str("models-dir") + "/" + f.Str("model"), opts));
  const GptConfig& cfg = gpt->config();
  const int64_t prefix = f.Int("prefix") < 0 ? cfg.block_size / 2 : f.Int("prefix");
  if (prefix < 1 || prefix >= cfg.seq_len()) f.Fail("--prefix must be in [1, seq_len)");
  const int64_t reps = std::max<int64_t>(1, f.Int("reps"));
  const int64_t rows_per_image = f.Str("cfg") == "true" ? 2 : 1;
  auto sync = [&] {
    if (opts.device.is_cuda()) torch::cuda::synchronize();
  };
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
    std::vector<double> ms;
    for (int64_t i = 0; i < reps + 3; ++i) {
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor out = OrDie(gpt->Forward(step, cache));
      sync();
      if (i >= 3) {
        ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
      }
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    std::printf("%8lld %8lld %12.3f %14.1f\n", static_cast<long long>(images),
                static_cast<long long>(rows), med, images / (med / 1000.0));
  }
  return 0;
}

// C++ forward passes against the Python reference (tools/parity.py, run by ctest first as the
// parity_reference fixture) on the same weights: fp32 logits and images agree to 1e-4.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <torch/cuda.h>

#include <cstdlib>

#include "engine/model/gpt.h"
#include "engine/model/image_model.h"
#include "engine/model/safetensors.h"
#include "engine/model/vq_decoder.h"

namespace imagegen {
namespace {

std::string RefDir() {
  const char* d = std::getenv("IMAGEGEN_PARITY_DIR");
  return d ? d : "parity";
}

std::map<std::string, at::Tensor> ReadRef(const std::string& name) {
  auto f = SafetensorsFile::Open(RefDir() + "/" + name);
  EXPECT_TRUE(f.ok()) << f.status().ToString() << " (run tools/parity.py --out " << RefDir() << ")";
  std::map<std::string, at::Tensor> out;
  if (!f.ok()) return out;
  for (const auto& [k, info] : (*f)->tensors()) out[k] = *(*f)->Read(k);
  return out;
}

// Full forward of each reference row (class + whole prefix) in one ragged batch, and the same
// again token by token through the KV cache.
void CheckGpt(const Gpt& gpt, const std::map<std::string, at::Tensor>& ref, double tol) {
  const at::Tensor labels = ref.at("labels"), prefix = ref.at("prefix");
  const at::Tensor logits = ref.at("logits").to(gpt.options().device);
  const int64_t rows = labels.size(0), m = prefix.size(1);
  std::vector<BatchRow> batch(rows);
  for (int64_t r = 0; r < rows; ++r) {
    batch[r].slot = r;
    batch[r].tokens.push_back(labels[r].item<int64_t>());
    batch[r].positions.push_back(0);
    for (int64_t i = 0; i < m; ++i) {
      batch[r].tokens.push_back(prefix[r][i].item<int64_t>());
      batch[r].positions.push_back(i + 1);
    }
  }
  KvCache cache = gpt.NewCache(rows);
  auto out = gpt.Forward(batch, cache);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  const at::Tensor expected = logits.reshape({rows * (m + 1), -1});
  const double full_err = (*out - expected).abs().max().item<double>();
  EXPECT_LT(full_err, tol) << "full forward";
  EXPECT_GT(expected.abs().max().item<double>(), 100 * tol);  // not trivially zero

  KvCache inc = gpt.NewCache(rows);
  double inc_err = 0;
  for (int64_t t = 0; t <= m; ++t) {
    std::vector<BatchRow> step(rows);
    for (int64_t r = 0; r < rows; ++r) {
      step[r].slot = r;
      step[r].cache_len = t;
      step[r].tokens = {batch[r].tokens[t]};
      step[r].positions = {t};
    }
    auto o = gpt.Forward(step, inc);
    ASSERT_TRUE(o.ok());
    for (int64_t r = 0; r < rows; ++r) {
      inc_err = std::max(inc_err, ((*o)[r] - logits[r][t]).abs().max().item<double>());
    }
  }
  EXPECT_LT(inc_err, tol) << "incremental decoding with the KV cache";
  std::printf("max |C++ - Python| logits: full %.3g, incremental %.3g\n", full_err, inc_err);
}

TEST(ParityTest, BundledGptMatchesPython) {
  auto gpt = Gpt::Load(DefaultModelsDir() + "/fmnist-gpt", {});
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  CheckGpt(**gpt, ReadRef("gpt_bundled.safetensors"), 1e-4);
}

TEST(ParityTest, RandomGptBShapeMatchesPython) {
  auto gpt = Gpt::Load(RefDir() + "/gptb-random", {});
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  EXPECT_EQ((*gpt)->config().ffn_hidden(), 2048);
  CheckGpt(**gpt, ReadRef("gptb_random.safetensors"), 1e-4);
}

void CheckVq(const std::string& dir, const std::string& ref_name, const LoadOptions& opts = {}) {
  auto vq = VqDecoder::Load(dir, opts);
  ASSERT_TRUE(vq.ok()) << vq.status().ToString();
  auto ref = ReadRef(ref_name);
  auto img = (*vq)->Decode(ref.at("ids"));
  ASSERT_TRUE(img.ok()) << img.status().ToString();
  const double err = (img->cpu() - ref.at("image")).abs().max().item<double>();
  EXPECT_LT(err, 1e-4);
  std::printf("max |C++ - Python| image (%s): %.3g\n", ref_name.c_str(), err);
}

TEST(ParityTest, BundledVqDecoderMatchesPython) {
  CheckVq(DefaultModelsDir() + "/fmnist-vq", "vq_bundled.safetensors");
}

TEST(ParityTest, OfficialVq16LayoutMatchesPython) {
  CheckVq(RefDir() + "/vq16-random", "vq16_random.safetensors");
}

// The same checks on a CUDA device in fp32 (TF32 off), where one is present.
LoadOptions Cuda() {
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  LoadOptions o;
  o.device = c10::Device(c10::kCUDA, 0);
  return o;
}

TEST(ParityTest, CudaBundledGptMatchesPython) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto gpt = Gpt::Load(DefaultModelsDir() + "/fmnist-gpt", Cuda());
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  CheckGpt(**gpt, ReadRef("gpt_bundled.safetensors"), 1e-4);
}

TEST(ParityTest, CudaRandomGptBShapeMatchesPython) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto gpt = Gpt::Load(RefDir() + "/gptb-random", Cuda());
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  CheckGpt(**gpt, ReadRef("gptb_random.safetensors"), 1e-4);
}

TEST(ParityTest, CudaVqDecodersMatchPython) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  CheckVq(DefaultModelsDir() + "/fmnist-vq", "vq_bundled.safetensors", Cuda());
  CheckVq(RefDir() + "/vq16-random", "vq16_random.safetensors", Cuda());
}

}  // namespace
}  // namespace imagegen

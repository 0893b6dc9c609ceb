// CUDA kernels against their CPU references (runs only where a CUDA device is present; the
// kernels are compiled everywhere nvcc is).
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "engine/decoding/philox.h"
#include "kernels/device_check.h"
#include "kernels/philox_uniform.h"
#include "tests/chain_verify_cases.h"
#include "tests/guided_probs_cases.h"
#include "tests/rope_scatter_cases.h"

namespace imagegen {
namespace {

// The engine's check that the kernels run on its GPU (engine/decoding/fused_kernels.h): it
// answers an error, without a crash, where there is no device, and on a device it agrees with
// the built architectures (a numbered one of the device's major loads there, and PTX for
// anything at or below the device's capability).
TEST(KernelsTest, TheImageLoadsOnTheDevicesTheArchitecturesCover) {
  const std::string built = kernels::BuiltCudaArchitectures();
  ASSERT_FALSE(built.empty());
  if (!torch::cuda::is_available()) {
    EXPECT_LT(kernels::CurrentDevice(), 0);
    EXPECT_NE(kernels::KernelImageError(), 0);
    GTEST_SKIP() << "no CUDA device (the error path checked)";
  }
  const int cc = kernels::CurrentComputeCapability();
  ASSERT_GT(cc, 0);
  bool covered = false;
  for (size_t at = 0; at < built.size();) {
    size_t end = built.find(',', at);
    if (end == std::string::npos) end = built.size();
    const std::string arch = built.substr(at, end - at);  // "90", "90-real", "90a", "all"...
    at = end + 1;
    const int a = std::atoi(arch.c_str());
    if (a == 0) covered = true;  // "all", "native": every device
    const bool real_only = arch.find("-real") != std::string::npos;
    if (a > 0 && cc >= a && (cc / 10 == a / 10 || !real_only)) covered = true;
  }
  const int error = kernels::KernelImageError();
  EXPECT_EQ(error == 0, covered) << "built for " << built << ", device " << cc << ": "
                                 << kernels::CudaErrorText(error);
}

TEST(KernelsTest, PhiloxUniformOnGpuIsBitIdenticalToCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 100000;
  at::Tensor seeds = at::randint(0, int64_t{1} << 62, {n}, at::kLong);
  at::Tensor pos = at::randint(0, 1 << 20, {n}, at::kInt);
  at::Tensor idx = at::randint(0, 1 << 10, {n}, at::kInt);
  auto cuda = at::TensorOptions().device(at::kCUDA);
  at::Tensor ds = seeds.to(at::kCUDA), dp = pos.to(at::kCUDA), di = idx.to(at::kCUDA);
  at::Tensor out = at::empty({n}, cuda.dtype(at::kDouble));
  ASSERT_EQ(kernels::LaunchPhiloxUniform(reinterpret_cast<const uint64_t*>(ds.data_ptr<int64_t>()),
                                         reinterpret_cast<const uint32_t*>(dp.data_ptr<int32_t>()),
                                         reinterpret_cast<const uint32_t*>(di.data_ptr<int32_t>()),
                                         3, static_cast<uint32_t>(Purpose::kAccept),
                                         out.data_ptr<double>(), n, nullptr),
            0);
  torch::cuda::synchronize();
  at::Tensor got = out.cpu();
  for (int64_t i = 0; i < n; ++i) {
    const double want = Uniform(static_cast<uint64_t>(seeds[i].item<int64_t>()),
                                static_cast<uint32_t>(pos[i].item<int32_t>()), 3, Purpose::kAccept,
                                static_cast<uint32_t>(idx[i].item<int32_t>()));
    ASSERT_EQ(got[i].item<double>(), want) << i;
  }
}

// The fused chain verification's kernel draws bit-identically to its host path (the engine's CPU
// path, itself checked against the eager verification in chain_verify_test.cc), edge cases
// included: the block's chunk sums are added in the host's order, GSD's clusters walked in the
// host's order, and trees' siblings and extra drafts taken in the host's order.
TEST(KernelsTest, ChainVerifyOnGpuIsBitIdenticalToTheHost) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // Chains (exact; COOL-SD's weights and Gumbel drafts; GSD), then trees (K 4 with 4 next
  // drafts and GSD's first sibling; K 8 with 8, the weights and Gumbel drafts).
  for (const int mode : {0, 1, 2, 3, 4}) {
    const bool weighted = mode == 1 || mode == 4;
    for (const int64_t V : {7, 512, 1000, 16384}) {
      chain_test::ChainCase c =
          mode < 3 ? chain_test::RandomChainCase(330, V, weighted, 11 + V)
                   : chain_test::RandomTreeCase(200, V, mode == 3 ? 4 : 8, mode == 3 ? 4 : 8,
                                                weighted, 41 + V);
      if (mode == 2 || mode == 3) chain_test::AddGroups(c, 29 + V);
      if ((mode == 1 || mode == 4) && V >= 8) chain_test::AddGumbel(c, 31 + V);
      if (mode == 1 && V >= 8) chain_test::AddMatch(c);  // and the match rule on some
      const chain_test::ChainVerdicts host = chain_test::HostChainVerify(c);
      const chain_test::ChainCase d = chain_test::ChainCaseOn(c, at::kCUDA);
      chain_test::ChainVerdicts dev;
      const kernels::ChainVerifyArgs a = chain_test::FusedArgs(d, dev);
      ASSERT_EQ(kernels::LaunchChainVerify(a, nullptr), 0);
      torch::cuda::synchronize();
      EXPECT_EQ(chain_test::Mismatches(host, dev, /*all=*/true), 0)
          << "V " << V << " mode " << mode;
      // Against the eager verification: as many nodes differ as differ between it and the host
      // path. Mostly none; one where an edge case leaves the residual nothing but rounding noise,
      // which two summation orders draw differently (mode 3, V 1000, node 50 on the CPU here and
      // on an H200's host: GSD rejects a first sibling whose q equals p up to rounding, and the
      // second sibling is verified against p - q). chain_verify_test.cc checks the host path
      // against the eager one; bit-identity with the host is what this test asks of the kernel.
      const chain_test::ChainVerdicts eager = chain_test::EagerChainVerify(c);
      EXPECT_EQ(chain_test::Mismatches(eager, dev), chain_test::Mismatches(eager, host))
          << "V " << V << " mode " << mode;
      EXPECT_EQ(chain_test::PackedMismatches(c, dev), 0) << "V " << V << " mode " << mode;
      EXPECT_TRUE(host.packed.equal(dev.packed.cpu())) << "V " << V << " mode " << mode;
    }
  }
}

// The fused final distributions' kernel against its host path (the engine's CPU path, itself
// checked against the eager one in guided_probs_test.cc): the same float32 logits and the same
// order of sums, so they differ only where CUDA's exp and the C library's round differently.
TEST(KernelsTest, GuidedProbsOnGpuMatchTheHost) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t V : {7, 512, 1000, 16384}) {
    const guided_test::GuidedCase c = guided_test::RandomGuidedCase(120, V, 3 + V);
    const at::Tensor host = guided_test::HostGuidedProbs(c);
    const std::vector<double> meta = guided_test::GuidedMeta(c);
    at::Tensor logits = c.logits.to(at::kCUDA);
    at::Tensor dmeta = at::tensor(meta, at::kDouble).to(at::kCUDA);
    at::Tensor out;
    const kernels::GuidedProbsArgs a =
        guided_test::GuidedArgs(c, logits, dmeta.data_ptr<double>(), out);
    ASSERT_EQ(kernels::LaunchGuidedProbs(a, nullptr), 0);
    torch::cuda::synchronize();
    EXPECT_EQ(guided_test::ProbsMismatches(host, out, 1e-13, 1e-300), 0) << "V " << V;
    EXPECT_EQ(guided_test::ProbsMismatches(guided_test::EagerGuidedProbs(c), out, 1e-5, 1e-35), 0)
        << "V " << V;
    const double bitwise = (out.cpu() == host).to(at::kDouble).mean().item<double>();
    std::printf("V %lld: %.4f of the probabilities equal the host's bit for bit\n",
                static_cast<long long>(V), bitwise);
  }
}

// The static forward's rotary scatter: the kernel writes what the host path writes, bit for bit
// (both without fused multiply-adds), and within an ulp of the eager path on the device. Its own
// suite, outside KernelsTest: bench/gpu's scripts decide IMAGEGEN_FUSED_KERNELS from KernelsTest
// alone, since this kernel is opt-in (LoadOptions::rope_scatter) and newer than the others.
TEST(RopeScatterKernelTest, IsTheHostPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const auto& [T, H, hd] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {5, 3, 8}, {37, 12, 64}, {4096, 16, 128}}) {
      SCOPED_TRACE(std::string(dtype == at::kFloat ? "fp32" : "bf16") + " T " + std::to_string(T));
      const rope_test::RopeCase c = rope_test::RandomRopeCase(T, H, hd, dtype, 23 + T);
      const rope_test::RopeOut host = rope_test::HostScatter(c);
      const rope_test::RopeCase d = c.To(at::kCUDA);
      rope_test::RopeOut dev = rope_test::ZeroOut(d);
      ASSERT_EQ(kernels::LaunchRopeScatter(rope_test::RopeArgs(d, dev), nullptr), 0);
      torch::cuda::synchronize();
      EXPECT_TRUE(at::equal(dev.k.cpu(), host.k));
      EXPECT_TRUE(at::equal(dev.v.cpu(), host.v));
      EXPECT_TRUE(at::equal(dev.q.cpu(), host.q));
      // ATen's complex multiply on the device may fuse a multiply and add: within an ulp of the
      // pair's norm (RotatedMismatches), and the share of elements equal bit for bit printed.
      const rope_test::RopeOut eager = rope_test::EagerScatter(d);
      EXPECT_EQ(rope_test::RotatedMismatches(c, 0, dev.q, eager.q, 1.0), 0);
      EXPECT_EQ(rope_test::RotatedMismatches(c, 1, dev.k, eager.k, 1.0), 0);
      EXPECT_TRUE(at::equal(dev.v, eager.v));
      std::printf(
          "%s T %lld: queries %.6f, keys %.6f of the elements ATen's on the device bit for "
          "bit\n",
          dtype == at::kFloat ? "fp32" : "bf16", static_cast<long long>(T),
          rope_test::BitEqualFraction(c, 0, dev.q, eager.q),
          rope_test::BitEqualFraction(c, 1, dev.k, eager.k));
    }
  }
}

}  // namespace
}  // namespace imagegen

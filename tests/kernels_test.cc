// CUDA kernels against their CPU references (runs only where a CUDA device is present; the
// kernels are compiled everywhere nvcc is).
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <ATen/ATen.h>

#include "engine/decoding/philox.h"
#include "kernels/philox_uniform.h"

namespace imagegen {
namespace {

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

}  // namespace
}  // namespace imagegen

// bench/kernel_profile.h: the GPU sessions' kernel-by-kernel profile (imagegen-step-cost
// --kernel-profile). Its arithmetic on made-up intervals, its classes on real kernel names, and
// the profiler itself on the CPU, where it sees ATen ops.
#include "bench/kernel_profile.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace imagegen {
namespace {

TEST(KernelProfileTest, ClassesOfKernelAndOpNames) {
  // Kernel names as CUPTI reports them on an H200 (cuBLAS's nvjet and cutlass GEMMs, the
  // memory-efficient attention, LibTorch's own kernels).
  EXPECT_EQ(KernelClass("nvjet_tst_64x8_64x16_4x1_v_bz_TNT"), "gemm");
  EXPECT_EQ(KernelClass("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64"), "gemm");
  EXPECT_EQ(KernelClass("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>"),
            "gemm");
  EXPECT_EQ(KernelClass("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::...)"),
            "attention");
  EXPECT_EQ(KernelClass("void at::native::(anonymous namespace)::rms_norm_kernel<c10::BFloat16>"),
            "norm");
  EXPECT_EQ(KernelClass("void at::native::index_elementwise_kernel<128, 4, ...>"), "memory");
  EXPECT_EQ(KernelClass("Memcpy HtoD (Pinned -> Device)"), "memory");
  EXPECT_EQ(KernelClass("void at::native::vectorized_elementwise_kernel<4, "
                        "at::native::CUDAFunctor_add<c10::BFloat16>, ...>"),
            "other");
  // CPU ops by their exact names: aten::topk is not aten::to.
  EXPECT_EQ(KernelClass("aten::addmm_"), "gemm");
  EXPECT_EQ(KernelClass("aten::scaled_dot_product_attention"), "attention");
  EXPECT_EQ(KernelClass("aten::index_select"), "memory");
  EXPECT_EQ(KernelClass("aten::to"), "memory");
  EXPECT_EQ(KernelClass("aten::topk"), "other");
  EXPECT_EQ(KernelClass("aten::silu"), "other");
}

TEST(KernelProfileTest, SummaryPerRepetitionWithTheUnionAsBusyTime) {
  // Two repetitions on a device: kernels of 10 + 5 us with a 5 us gap, then two overlapping
  // (another stream) of 10 us from 40 to 55 us.
  std::vector<KernelInterval> iv = {{"gemm_a", 7, 0, 10'000},
                                    {"add", 7, 15'000, 20'000},
                                    {"gemm_a", 7, 40'000, 50'000},
                                    {"Memcpy DtoD", 9, 45'000, 55'000}};
  KernelSummary s = SummarizeKernels(iv, /*device=*/true, /*reps=*/2);
  EXPECT_TRUE(s.device);
  EXPECT_DOUBLE_EQ(s.kernels, 2.0);  // 4 over 2 repetitions
  EXPECT_DOUBLE_EQ(s.kernel_us, (10 + 5 + 10 + 10) / 2.0);
  EXPECT_DOUBLE_EQ(s.busy_us, (10 + 5 + 15) / 2.0);  // the overlap counted once
  EXPECT_DOUBLE_EQ(s.span_us, 55 / 2.0);
  EXPECT_DOUBLE_EQ(s.Us("gemm"), 10.0);
  EXPECT_DOUBLE_EQ(s.Count("gemm"), 1.0);
  EXPECT_DOUBLE_EQ(s.Us("memory"), 5.0);
  EXPECT_DOUBLE_EQ(s.Us("other"), 2.5);
  EXPECT_DOUBLE_EQ(s.Us("attention"), 0.0);
  ASSERT_EQ(s.by_name.size(), 3u);
  EXPECT_EQ(s.by_name[0].name, "gemm_a");  // most time first
  EXPECT_DOUBLE_EQ(s.by_name[0].count, 1.0);
  EXPECT_NE(s.Line().find("kernels: 2.0 a rep"), std::string::npos) << s.Line();

  // On the CPU nested ops are dropped, per thread: aten::linear holds its aten::addmm; the
  // other thread's op stays.
  std::vector<KernelInterval> cpu = {{"aten::linear", 1, 0, 100},
                                     {"aten::addmm", 1, 10, 90},
                                     {"aten::silu", 1, 100, 130},
                                     {"aten::addmm", 2, 20, 40}};
  KernelSummary c = SummarizeKernels(cpu, /*device=*/false, /*reps=*/1);
  EXPECT_DOUBLE_EQ(c.kernels, 3.0);
  EXPECT_DOUBLE_EQ(c.Count("gemm"), 2.0);  // aten::linear and thread 2's aten::addmm
  EXPECT_DOUBLE_EQ(c.busy_us, 0.130);
  EXPECT_NE(c.Line().find("CPU ops (outermost)"), std::string::npos);
}

TEST(KernelProfileTest, ProfilesTheOutermostAtenOpsOnTheCpu) {
  at::Tensor x = at::randn({8, 16});
  at::Tensor w = at::randn({32, 16});
  KernelSummary s;
  {
    KernelProfile p(c10::Device(c10::kCPU));
    for (int rep = 0; rep < 2; ++rep) {
      at::Tensor y = at::linear(x, w);  // one outermost op (its matmul nests inside)
      y = at::silu(y);
      y = at::linear(y.narrow(1, 0, 16), w);
    }
    s = p.Stop(2);
  }
  EXPECT_FALSE(s.device);
  EXPECT_DOUBLE_EQ(s.Count("gemm"), 2.0) << s.Line();  // two aten::linear a repetition
  EXPECT_GE(s.Count("other"), 1.0) << s.Line();        // aten::silu (and the narrow)
  EXPECT_GT(s.kernel_us, 0.0);
  EXPECT_LE(s.busy_us, s.span_us + 1e-9);
  // Nothing is recorded once stopped: a second profile of no work is empty.
  KernelProfile q(c10::Device(c10::kCPU));
  EXPECT_DOUBLE_EQ(q.Stop(1).kernels, 0.0);
}

}  // namespace
}  // namespace imagegen

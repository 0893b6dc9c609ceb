// Whether the fused kernels (kernels/chain_verify.h, kernels/guided_probs.h) run on CUDA, and
// their launches; and the static forward's rotary scatter (kernels/rope_scatter.h, its own
// switch: LoadOptions::rope_scatter). Internal to the engine.
#pragma once

#include <string>

#include "kernels/chain_verify.h"
#include "kernels/guided_probs.h"
#include "kernels/rope_scatter.h"

namespace imagegen {

// True where this build has both kernels (kernels/ is built with them where nvcc is, or has
// neither) and IMAGEGEN_FUSED_KERNELS is not 0. With IMAGEGEN_FUSED_KERNELS=0 CUDA steps take
// the eager path (verify.h, GuidedBatch::Probs): the same decisions, in more launches. An
// operator's switch for a kernel that misbehaves on some device, and the GPU script's fallback
// when the kernels' own tests fail there (bench/gpu/lease.sh). The CPU's host path of the same
// arithmetic is not affected (SpecOptions::fused_verify and fused_probs choose it).
// False, too, on a CUDA device the kernels have no image for (KernelsRunHere).
bool FusedKernelsOn();
// Whether this build's kernels can run on the calling thread's current CUDA device (checked once
// per device: kernels/device_check.h); false where the kernels are not built. When false,
// `why` (if given) says so, naming the device's compute capability and the built architectures.
bool KernelsRunHere(std::string* why = nullptr);
// Whether this build has the kernels at all.
bool KernelsBuilt();
// kernels::LaunchChainVerify where the kernel is built; -1 where it is not.
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream);
// kernels::LaunchGuidedProbs where the kernel is built; -1 where it is not.
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs& args, void* stream);
// Whether this build has the rotary scatter's kernel; kernels::LaunchRopeScatter where it does,
// -1 where it does not.
// (And its image runs on the current device: KernelsRunHere.)
bool RopeScatterKernelBuilt();
int LaunchRopeScatterKernel(const kernels::RopeScatterArgs& args, void* stream);

}  // namespace imagegen

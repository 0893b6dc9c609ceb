// Whether the fused kernels (kernels/chain_verify.h, kernels/guided_probs.h) run on CUDA, and
// their launches. Internal to engine/decoding.
#pragma once

#include "kernels/chain_verify.h"
#include "kernels/guided_probs.h"

namespace imagegen {

// True where this build has both kernels (kernels/ is built with them where nvcc is, or has
// neither) and IMAGEGEN_FUSED_KERNELS is not 0. With IMAGEGEN_FUSED_KERNELS=0 CUDA steps take
// the eager path (verify.h, GuidedBatch::Probs): the same decisions, in more launches. An
// operator's switch for a kernel that misbehaves on some device, and the GPU script's fallback
// when the kernels' own tests fail there (bench/gpu/lease.sh). The CPU's host path of the same
// arithmetic is not affected (SpecOptions::fused_verify and fused_probs choose it).
bool FusedKernelsOn();
// kernels::LaunchChainVerify where the kernel is built; -1 where it is not.
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream);
// kernels::LaunchGuidedProbs where the kernel is built; -1 where it is not.
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs& args, void* stream);

}  // namespace imagegen

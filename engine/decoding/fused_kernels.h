// Whether this build has the fused kernels (kernels/chain_verify.h, kernels/guided_probs.h),
// and their launches. Internal to engine/decoding.
#pragma once

#include "kernels/chain_verify.h"
#include "kernels/guided_probs.h"

namespace imagegen {

// Both kernels are built together (kernels/ where nvcc is), or neither.
bool FusedKernelsBuilt();
// kernels::LaunchChainVerify where the kernel is built; -1 where it is not.
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream);
// kernels::LaunchGuidedProbs where the kernel is built; -1 where it is not.
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs& args, void* stream);

}  // namespace imagegen

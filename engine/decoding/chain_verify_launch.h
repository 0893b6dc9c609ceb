// Whether this build has the fused chain-verification kernel (kernels/chain_verify.h), and its
// launch. Internal to engine/decoding.
#pragma once

#include "kernels/chain_verify.h"

namespace imagegen {

bool ChainVerifyKernelBuilt();
// kernels::LaunchChainVerify where the kernel is built; -1 where it is not.
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream);

}  // namespace imagegen

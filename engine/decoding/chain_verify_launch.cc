// The engine's door to kernels/chain_verify.cu: built with the kernel where nvcc is, and
// without it (reporting so) in the CPU-only, sanitizer and nvcc-less builds.
#include "engine/decoding/chain_verify_launch.h"

namespace imagegen {

#ifdef IMAGEGEN_CHAIN_VERIFY_KERNEL
bool ChainVerifyKernelBuilt() { return true; }
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream) {
  return kernels::LaunchChainVerify(args, stream);
}
#else
bool ChainVerifyKernelBuilt() { return false; }
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs&, void*) { return -1; }
#endif

}  // namespace imagegen

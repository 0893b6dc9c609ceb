// The engine's door to kernels/*.cu: built with the kernels where nvcc is, and without them
// (reporting so) in the CPU-only, sanitizer and nvcc-less builds.
#include "engine/decoding/fused_kernels.h"

#include <cstdlib>
#include <cstring>

namespace imagegen {

#ifdef IMAGEGEN_FUSED_KERNELS
bool FusedKernelsOn() {
  static const bool on = [] {
    const char* e = std::getenv("IMAGEGEN_FUSED_KERNELS");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream) {
  return kernels::LaunchChainVerify(args, stream);
}
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs& args, void* stream) {
  return kernels::LaunchGuidedProbs(args, stream);
}
bool RopeScatterKernelBuilt() { return true; }
int LaunchRopeScatterKernel(const kernels::RopeScatterArgs& args, void* stream) {
  return kernels::LaunchRopeScatter(args, stream);
}
#else
bool FusedKernelsOn() { return false; }
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs&, void*) { return -1; }
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs&, void*) { return -1; }
bool RopeScatterKernelBuilt() { return false; }
int LaunchRopeScatterKernel(const kernels::RopeScatterArgs&, void*) { return -1; }
#endif

}  // namespace imagegen

// The engine's door to kernels/*.cu: built with the kernels where nvcc is, and without them
// (reporting so) in the CPU-only, sanitizer and nvcc-less builds.
#include "engine/decoding/fused_kernels.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#ifdef IMAGEGEN_FUSED_KERNELS
#include "kernels/device_check.h"
#endif

namespace imagegen {

#ifdef IMAGEGEN_FUSED_KERNELS
bool KernelsRunHere(std::string* why) {
  struct Check {
    bool runs = false;
    std::string why;
  };
  static std::mutex mu;
  static std::map<int, Check> checked;  // by device
  const int device = kernels::CurrentDevice();
  if (device < 0) {
    if (why != nullptr) *why = "no CUDA device";
    return false;
  }
  std::lock_guard<std::mutex> l(mu);
  auto it = checked.find(device);
  if (it == checked.end()) {
    Check c;
    const int error = kernels::KernelImageError();
    c.runs = error == 0;
    if (!c.runs) {
      const int cc = kernels::CurrentComputeCapability();
      c.why = std::string("the kernels are built for CUDA architectures ") +
              kernels::BuiltCudaArchitectures() + ", and GPU " + std::to_string(device) +
              " (compute capability " +
              (cc < 0 ? std::string("unknown")
                      : std::to_string(cc / 10) + "." + std::to_string(cc % 10)) +
              ") cannot load them: " + kernels::CudaErrorText(error) +
              " (build with -DCMAKE_CUDA_ARCHITECTURES=<its architecture> to have them)";
    }
    it = checked.emplace(device, std::move(c)).first;
  }
  if (!it->second.runs && why != nullptr) *why = it->second.why;
  return it->second.runs;
}
bool KernelsBuilt() { return true; }
bool FusedKernelsOn() {
  static const bool on = [] {
    const char* e = std::getenv("IMAGEGEN_FUSED_KERNELS");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on && KernelsRunHere();
}
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs& args, void* stream) {
  return kernels::LaunchChainVerify(args, stream);
}
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs& args, void* stream) {
  return kernels::LaunchGuidedProbs(args, stream);
}
bool RopeScatterKernelBuilt() { return KernelsRunHere(); }
int LaunchRopeScatterKernel(const kernels::RopeScatterArgs& args, void* stream) {
  return kernels::LaunchRopeScatter(args, stream);
}
#else
bool KernelsBuilt() { return false; }
bool KernelsRunHere(std::string* why) {
  if (why != nullptr) *why = "this build has no CUDA kernels";
  return false;
}
bool FusedKernelsOn() { return false; }
int LaunchChainVerifyKernel(const kernels::ChainVerifyArgs&, void*) { return -1; }
int LaunchGuidedProbsKernel(const kernels::GuidedProbsArgs&, void*) { return -1; }
bool RopeScatterKernelBuilt() { return false; }
int LaunchRopeScatterKernel(const kernels::RopeScatterArgs&, void*) { return -1; }
#endif

}  // namespace imagegen

// Whether this build's kernels (kernels/*.cu, built for CMAKE_CUDA_ARCHITECTURES: 90 by default,
// the H100 and H200) have an image the current CUDA device can run. A GPU of an older
// architecture (an A100 is 8.0) has none, and every launch there would fail with "no kernel image
// is available": the engine checks once per device and takes the eager path instead.
#pragma once

namespace imagegen::kernels {

// The CUDA runtime's error code for loading a kernel of this build on the current device: 0 when
// it can run there (the architecture's own code, or PTX the driver compiles for it).
int KernelImageError();
// The current CUDA device; -1 when there is none (no driver, no GPU).
int CurrentDevice();
// The CUDA runtime's text for an error code.
const char* CudaErrorText(int error);
// The device's compute capability, major * 10 + minor; -1 when it cannot be read.
int CurrentComputeCapability();
// The architectures the kernels were built for, as CMake lists them ("90").
const char* BuiltCudaArchitectures();

}  // namespace imagegen::kernels

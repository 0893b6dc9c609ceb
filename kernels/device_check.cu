#include <cuda_runtime.h>

#include "kernels/device_check.h"

namespace imagegen::kernels {
namespace {

// Built with the same architectures as the other kernels: its image loads where theirs do.
__global__ void ProbeKernel(int* out) {
  if (out != nullptr) *out = 1;
}

}  // namespace

int KernelImageError() {
  cudaFuncAttributes attributes;
  const cudaError_t e = cudaFuncGetAttributes(&attributes, ProbeKernel);
  if (e != cudaSuccess) (void)cudaGetLastError();  // not left for the next call to report
  return static_cast<int>(e);
}

int CurrentDevice() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return device;
}

const char* CudaErrorText(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int CurrentComputeCapability() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

const char* BuiltCudaArchitectures() { return IMAGEGEN_CUDA_ARCHITECTURES; }

}  // namespace imagegen::kernels

// Counter-based uniforms generated on the GPU: out[i] = PhiloxUniform(seeds[i], positions[i],
// iteration, purpose, indices[i]). Bit-identical to the CPU reference (engine/decoding/philox),
// so a speculative step can draw its acceptance and resampling numbers on the device without a
// host round trip. Raw device pointers; no LibTorch dependency.
#pragma once

#include <cstdint>

namespace imagegen::kernels {

// Returns 0 on success or the cudaError_t of the launch. `stream` is a cudaStream_t.
int LaunchPhiloxUniform(const uint64_t* seeds, const uint32_t* positions, const uint32_t* indices,
                        uint32_t iteration, uint32_t purpose, double* out, int64_t n, void* stream);

}  // namespace imagegen::kernels

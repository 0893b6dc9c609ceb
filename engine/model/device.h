// The --device / --dtype strings of the daemon and the local programs, parsed in one place.
#pragma once

#include <string>

#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

// device: "cpu", "cuda" (device 0) or "cuda:N"; dtype: "auto" (bf16 on CUDA, fp32 on the CPU),
// "fp32", "bf16" or "fp16". Errors are
// INVALID_ARGUMENT about the field "device" or "dtype": a malformed value, no CUDA device
// available, or a device index beyond the devices present.
StatusOr<LoadOptions> ParseDeviceAndDtype(const std::string& device, const std::string& dtype);

// The KV-cache memory a model gets when none is set (EngineOptions::kv_cache_bytes = -1, the
// daemon's --kv_cache_mb=0): 256 MiB on the CPU, and on a CUDA device half of `free_bytes` (what
// the device can still give after this model's weights, DeviceFreeBytes) shared by
// `models_left` (this model and those still to load), 256 MiB when the free memory is unknown
// (free_bytes < 0). The other half is left for the steps' activations, the CUDA graphs' pools
// and the VQ decoder. The slots stay capped by max_slots.
int64_t AutoKvCacheBytes(bool cuda, int64_t free_bytes, int64_t models_left);

// Called by the model loaders before a model is placed on `device`. On CUDA it turns off
// LibTorch's cuDNN backend of scaled_dot_product_attention, process-wide, unless
// IMAGEGEN_CUDNN_SDPA=1: measured on an H200 (docs/results-gpu.md), each cuDNN attention call
// cost 1.0-1.8 ms of host time, since the key length of every call changes from step to step
// and cuDNN builds a new plan for each new shape; it was 86% of a served step. With it off,
// a masked call goes to the memory-efficient kernel, which is compiled ahead. No effect on the CPU.
void PrepareAttention(const c10::Device& device);

// How many threads the engine's own CPU kernels (RowAttention, the AMX and few-row GEMMs, the
// norm and rotary kernels, the host verification and guided distributions) split their work
// over: found by running one at::parallel_for compiled in the engine and counting the threads
// that took a part. at::get_num_threads() where the engine is built with OpenMP
// (engine/CMakeLists.txt), 1 where not: ATen's OpenMP parallel_for is a template compiled in the
// caller, and without -fopenmp its parallel region is dropped (every engine kernel ran on one
// thread until 2026-12-06). Call it from the thread whose threads it should count.
int EngineKernelThreads();

}  // namespace imagegen

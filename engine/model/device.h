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

}  // namespace imagegen

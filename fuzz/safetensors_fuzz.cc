// Fuzz target: a safetensors file's bytes (header length, JSON header, data) through the parser
// that SafetensorsFile::Open uses. Any input must give a header or an error, never a crash, a
// sanitizer report or an allocation beyond the input's size.
#include <cstddef>
#include <cstdint>

#include "engine/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto h = imagegen::ParseSafetensorsHeader(data, size, "fuzz");
  if (h.ok()) {
    for (const auto& [name, info] : h->tensors) {
      // What the parser promised: every tensor lies inside the data section.
      if (info.begin > info.end || h->data_start + info.end > size) __builtin_trap();
    }
  }
  return 0;
}

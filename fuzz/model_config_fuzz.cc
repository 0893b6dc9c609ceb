// Fuzz target: a model's config.json through the JSON parser (depth and duplicate-key limits)
// and the GPT and VQ config readers, which must reject every value they cannot serve.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "engine/model/gpt.h"
#include "engine/model/vq_decoder.h"
#include "engine/util/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto json = imagegen::ParseJson(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!json.ok()) return 0;
  auto gpt = imagegen::ParseGptConfig(*json, "fuzz/config.json");
  if (gpt.ok()) {
    // What the reader promised: sizes in range, a square grid, names matching the classes.
    if (gpt->grid() * gpt->grid() != gpt->block_size || gpt->dim <= 0 || gpt->n_head <= 0 ||
        gpt->dim % gpt->n_head != 0) {
      __builtin_trap();
    }
  }
  (void)imagegen::ParseVqConfig(*json, "fuzz/config.json");
  return 0;
}

// Minimal PNG encoder (8-bit grey, grey+alpha, RGB or RGBA; zlib "stored" blocks, no
// compression). The engine needs only LibTorch, so it does not link libpng; the images are
// small and clients recompress if they care. Thread-safe (pure function).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

// pixels: height * width * channels bytes, row-major, channels in {1, 2, 3, 4}.
StatusOr<std::string> EncodePng(const uint8_t* pixels, int width, int height, int channels);

Status WriteFile(const std::string& path, const std::string& bytes);

}  // namespace imagegen

// PNG encoding through libpng (deflate-compressed), with optional nearest-neighbour upscaling.
// Used at the edge (server, CLI-side programs, benches), never inside the engine's step, and
// built as its own library (imagegen_png) so that the engine itself needs only LibTorch.
// Thread-safe (pure functions).
#pragma once

#include <cstdint>
#include <string>

#include "engine/image/image.h"
#include "engine/util/status.h"

namespace imagegen {

// pixels: height * width * channels bytes, row-major, channels in {1, 2, 3, 4}; each pixel is
// repeated `scale` times in both directions (scale in [1, 64]).
StatusOr<std::string> EncodePng(const uint8_t* pixels, int width, int height, int channels,
                                int scale = 1);
StatusOr<std::string> EncodePng(const Image& image, int scale = 1);

Status WriteFile(const std::string& path, const std::string& bytes);

}  // namespace imagegen

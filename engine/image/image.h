// Decoded pixels as the engine hands them out: 8-bit, row-major [height][width][channels]
// (grey, grey+alpha, RGB or RGBA). Encoding (PNG) and upscaling happen at the edge, in the
// server's and the local programs' threads, never on the engine thread. Plain data without
// LibTorch; thread-safe as values are.
#pragma once

#include <cstdint>
#include <string>

namespace imagegen {

struct Image {
  int64_t width = 0, height = 0, channels = 0;
  std::string pixels;  // width * height * channels bytes

  bool empty() const { return pixels.empty(); }
};

}  // namespace imagegen

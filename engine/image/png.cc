#include "engine/image/png.h"

#include <png.h>

#include <cstring>
#include <fstream>
#include <vector>

namespace imagegen {
namespace {

std::vector<uint8_t> Upscale(const uint8_t* px, int w, int h, int c, int scale) {
  const size_t out_row = static_cast<size_t>(w) * scale * c;
  std::vector<uint8_t> out(out_row * h * scale);
  for (int y = 0; y < h; ++y) {
    uint8_t* row = out.data() + static_cast<size_t>(y) * scale * out_row;
    for (int x = 0; x < w; ++x) {
      for (int r = 0; r < scale; ++r) {
        std::memcpy(row + (static_cast<size_t>(x) * scale + r) * c,
                    px + (static_cast<size_t>(y) * w + x) * c, c);
      }
    }
    for (int r = 1; r < scale; ++r) std::memcpy(row + r * out_row, row, out_row);
  }
  return out;
}

}  // namespace

StatusOr<std::string> EncodePng(const uint8_t* pixels, int width, int height, int channels,
                                int scale) {
  static constexpr png_uint_32 kFormat[5] = {0, PNG_FORMAT_GRAY, PNG_FORMAT_GA, PNG_FORMAT_RGB,
                                             PNG_FORMAT_RGBA};
  if (scale < 1 || scale > 64) return InvalidArgument("png: scale must be in [1, 64]");
  if (width <= 0 || height <= 0 || int64_t{width} * scale > (1 << 16) ||
      int64_t{height} * scale > (1 << 16)) {
    return InvalidArgument("png: width and height (after scaling) must be in [1, 65536]");
  }
  if (channels < 1 || channels > 4) return InvalidArgument("png: channels must be in [1, 4]");
  std::vector<uint8_t> scaled;
  if (scale > 1) {
    scaled = Upscale(pixels, width, height, channels, scale);
    pixels = scaled.data();
  }
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(width * scale);
  img.height = static_cast<png_uint_32>(height * scale);
  img.format = kFormat[channels];
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, pixels, 0, nullptr)) {
    return Internal(std::string("png: ") + img.message);
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, pixels, 0, nullptr)) {
    return Internal(std::string("png: ") + img.message);
  }
  out.resize(size);
  return out;
}

StatusOr<std::string> EncodePng(const Image& image, int scale) {
  if (static_cast<int64_t>(image.pixels.size()) != image.width * image.height * image.channels) {
    return InvalidArgument("png: pixel buffer does not match width x height x channels");
  }
  return EncodePng(reinterpret_cast<const uint8_t*>(image.pixels.data()),
                   static_cast<int>(image.width), static_cast<int>(image.height),
                   static_cast<int>(image.channels), scale);
}

Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound(path + ": cannot create");
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return Internal(path + ": write failed");
  return OkStatus();
}

}  // namespace imagegen

#include "engine/image/png.h"

#include <array>
#include <fstream>

namespace imagegen {
namespace {

const std::array<uint32_t, 256>& CrcTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  return table;
}

uint32_t Crc32(const std::string& data, size_t begin) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = begin; i < data.size(); ++i) {
    c = CrcTable()[(c ^ static_cast<uint8_t>(data[i])) & 0xFF] ^ (c >> 8);
  }
  return c ^ 0xFFFFFFFFu;
}

void PutU32(std::string& out, uint32_t v) {
  out += static_cast<char>(v >> 24);
  out += static_cast<char>(v >> 16);
  out += static_cast<char>(v >> 8);
  out += static_cast<char>(v);
}

void Chunk(std::string& png, const char* type, const std::string& body) {
  PutU32(png, static_cast<uint32_t>(body.size()));
  std::string typed = std::string(type, 4) + body;
  png += typed;
  PutU32(png, Crc32(typed, 0));
}

}  // namespace

StatusOr<std::string> EncodePng(const uint8_t* pixels, int width, int height, int channels) {
  if (width <= 0 || height <= 0 || width > (1 << 16) || height > (1 << 16)) {
    return InvalidArgument("png: width and height must be in [1, 65536]");
  }
  static constexpr uint8_t kColorType[5] = {0, 0, 4, 2, 6};
  if (channels < 1 || channels > 4) return InvalidArgument("png: channels must be 1..4");
  // Raw scanlines, each prefixed with filter type 0.
  const size_t stride = static_cast<size_t>(width) * channels;
  std::string raw;
  raw.reserve((stride + 1) * height);
  for (int y = 0; y < height; ++y) {
    raw += '\0';
    raw.append(reinterpret_cast<const char*>(pixels + y * stride), stride);
  }
  // zlib stream of stored deflate blocks (at most 65535 bytes each) + Adler-32.
  std::string z = "\x78\x01";
  uint32_t a = 1, b = 0;
  for (unsigned char ch : raw) {
    a = (a + ch) % 65521;
    b = (b + a) % 65521;
  }
  size_t pos = 0;
  do {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);
    const bool last = pos + n == raw.size();
    z += static_cast<char>(last ? 1 : 0);
    z += static_cast<char>(n & 0xFF);
    z += static_cast<char>(n >> 8);
    z += static_cast<char>(~n & 0xFF);
    z += static_cast<char>((~n >> 8) & 0xFF);
    z.append(raw, pos, n);
    pos += n;
  } while (pos < raw.size());
  PutU32(z, (b << 16) | a);

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string ihdr;
  PutU32(ihdr, static_cast<uint32_t>(width));
  PutU32(ihdr, static_cast<uint32_t>(height));
  ihdr += static_cast<char>(8);                    // bit depth
  ihdr += static_cast<char>(kColorType[channels]); // colour type
  ihdr += std::string(3, '\0');                    // deflate, adaptive filter, no interlace
  Chunk(png, "IHDR", ihdr);
  Chunk(png, "IDAT", z);
  Chunk(png, "IEND", "");
  return png;
}

Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound(path + ": cannot create");
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return Internal(path + ": write failed");
  return OkStatus();
}

}  // namespace imagegen

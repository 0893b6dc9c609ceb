#include "engine/image/png.h"

#include <gtest/gtest.h>
#include <png.h>

#include <cstring>
#include <vector>

namespace imagegen {
namespace {

// Decodes with libpng (independent of our encoder) into 8-bit samples.
std::vector<uint8_t> DecodeWithLibpng(const std::string& bytes, int* w, int* h, int* ch) {
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  EXPECT_TRUE(png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) << img.message;
  *w = static_cast<int>(img.width);
  *h = static_cast<int>(img.height);
  *ch = static_cast<int>(PNG_IMAGE_SAMPLE_CHANNELS(img.format));
  std::vector<uint8_t> out(PNG_IMAGE_SIZE(img));
  EXPECT_TRUE(png_image_finish_read(&img, nullptr, out.data(), 0, nullptr)) << img.message;
  return out;
}

class PngTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(PngTest, LibpngDecodesWhatWeEncode) {
  auto [w, h, c] = GetParam();
  std::vector<uint8_t> px(static_cast<size_t>(w) * h * c);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + i / 7) & 0xFF);
  auto png = EncodePng(px.data(), w, h, c);
  ASSERT_TRUE(png.ok());
  int dw, dh, dc;
  std::vector<uint8_t> back = DecodeWithLibpng(*png, &dw, &dh, &dc);
  EXPECT_EQ(dw, w);
  EXPECT_EQ(dh, h);
  EXPECT_EQ(dc, c);
  EXPECT_EQ(back, px);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PngTest,
                         ::testing::Values(std::make_tuple(28, 28, 1), std::make_tuple(1, 1, 3),
                                           std::make_tuple(300, 250, 3),  // > 65535 raw bytes
                                           std::make_tuple(17, 5, 4), std::make_tuple(9, 3, 2)));

TEST(PngTest, UpscalesByRepeatingPixelsAndCompresses) {
  const int w = 28, h = 28, s = 16;
  std::vector<uint8_t> px(w * h);
  for (int i = 0; i < w * h; ++i) px[i] = static_cast<uint8_t>(i % w < 14 ? 0 : 200);
  auto png = EncodePng(px.data(), w, h, 1, s);
  ASSERT_TRUE(png.ok());
  int dw, dh, dc;
  std::vector<uint8_t> back = DecodeWithLibpng(*png, &dw, &dh, &dc);
  ASSERT_EQ(dw, w * s);
  ASSERT_EQ(dh, h * s);
  for (int y = 0; y < dh; ++y) {
    for (int x = 0; x < dw; ++x) ASSERT_EQ(back[y * dw + x], px[(y / s) * w + x / s]);
  }
  // Deflate at work: far below the raw size (448 * 449 bytes stored).
  EXPECT_LT(png->size(), 448u * 449u / 20u);
}

TEST(PngErrors, RejectsBadShapes) {
  uint8_t px[4] = {0, 0, 0, 0};
  EXPECT_FALSE(EncodePng(px, 0, 1, 1).ok());
  EXPECT_FALSE(EncodePng(px, 1, 1, 5).ok());
  EXPECT_FALSE(EncodePng(px, 1, 1, 1, 0).ok());
  EXPECT_FALSE(EncodePng(px, 2048, 1, 1, 64).ok());  // 131072 wide after scaling
  Image img{2, 2, 1, std::string(3, '\0')};          // one byte short
  EXPECT_FALSE(EncodePng(img).ok());
}

}  // namespace
}  // namespace imagegen

#include "tests/e2e/classify.h"

#include <ATen/ATen.h>
#include <png.h>

#include <cstring>
#include <vector>

#include "engine/model/classifier.h"
#include "tests/build_paths.h"

namespace imagegen::testing {

namespace {

// A 28x28 grey PNG's pixels (empty on error, with *error set).
std::vector<uint8_t> Grey28(const std::string& png, std::string* error) {
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, png.data(), png.size())) {
    *error = std::string("libpng: ") + img.message;
    return {};
  }
  img.format = PNG_FORMAT_GRAY;
  std::vector<uint8_t> px(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, px.data(), 0, nullptr)) {
    *error = std::string("libpng: ") + img.message;
    return {};
  }
  if (img.width != 28 || img.height != 28) {
    *error = "expected 28x28, got " + std::to_string(img.width) + "x" + std::to_string(img.height);
    return {};
  }
  return px;
}

}  // namespace

double InkBrightness(const std::string& png, std::string* error) {
  const std::vector<uint8_t> px = Grey28(png, error);
  if (px.empty()) return -1;
  double sum = 0;
  int count = 0;
  for (uint8_t v : px) {
    if (v > 20) {
      sum += v;
      count += 1;
    }
  }
  return count > 0 ? sum / count : 0;
}

int ClassifyPng(const std::string& png, std::string* error) {
  std::vector<uint8_t> px = Grey28(png, error);
  if (px.empty()) return -1;
  static auto clf =
      Classifier::Load(std::string(imagegen::testing::TestModelsDir()) + "/fmnist-classifier", {});
  if (!clf.ok()) {
    *error = clf.status().ToString();
    return -1;
  }
  at::Tensor t = at::from_blob(px.data(), {1, 28, 28}, at::kByte).clone();
  return static_cast<int>((*clf)->Logits((*clf)->Features(t)).argmax(1).item<int64_t>());
}

}  // namespace imagegen::testing

// Shared set-up for the local programs: device/dtype flags and the sampling defaults.
#pragma once

#include <ATen/ATen.h>

#include <iostream>
#include <string>

#include "bench/flags.h"
#include "engine/decoding/sampling.h"
#include "engine/image/png.h"
#include "engine/model/device.h"
#include "engine/model/gpt.h"
#include "engine/model/weights.h"

namespace imagegen {

inline LoadOptions LoadOptionsFromFlags(const Flags& f) {
  StatusOr<LoadOptions> o = ParseDeviceAndDtype(f.Str("device"), f.Str("dtype"));
  if (!o.ok()) f.Fail("--" + o.status().message());
  return *o;
}

// Flags left as "default" take the model's recommended values from config.json.
inline SamplingParams SamplingFromFlags(const Flags& f, const GptConfig& c) {
  SamplingParams p;
  p.cfg_scale = f.Str("cfg") == "default" ? c.default_cfg_scale : f.Num("cfg");
  p.temperature = f.Str("temperature") == "default" ? c.default_temperature : f.Num("temperature");
  p.top_k = f.Str("top-k") == "default" ? c.default_top_k : f.Int("top-k");
  p.top_p = f.Str("top-p") == "default" ? c.default_top_p : f.Num("top-p");
  return p;
}

template <typename T>
T OrDie(StatusOr<T> v);
inline void OrDie(const Status& s);

// Tiles uint8 images [N, H, W, C] row-major, `per_row` to a row, and writes one PNG.
inline void WriteGridPng(const at::Tensor& images, int64_t per_row, const std::string& path) {
  const int64_t n = images.size(0), h = images.size(1), w = images.size(2), c = images.size(3);
  const int64_t rows = (n + per_row - 1) / per_row;
  at::Tensor canvas = at::zeros({rows * h, per_row * w, c}, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    canvas.narrow(0, (i / per_row) * h, h).narrow(1, (i % per_row) * w, w).copy_(images[i]);
  }
  OrDie(
      WriteFile(path, OrDie(EncodePng(canvas.data_ptr<uint8_t>(), static_cast<int>(canvas.size(1)),
                                      static_cast<int>(canvas.size(0)), static_cast<int>(c)))));
}

template <typename T>
T OrDie(StatusOr<T> v) {
  if (!v.ok()) {
    std::cerr << "error: " << v.status().ToString() << "\n";
    std::exit(1);
  }
  return std::move(v).value();
}

inline void OrDie(const Status& s) {
  if (!s.ok()) {
    std::cerr << "error: " << s.ToString() << "\n";
    std::exit(1);
  }
}

}  // namespace imagegen

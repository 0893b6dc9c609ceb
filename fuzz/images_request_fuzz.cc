// Fuzz target: a POST /v1/images/generations body, as the HTTP API receives it, through the
// JSON parse and the conversion to a GenerateRequest (every parameter type- and range-checked,
// errors naming the parameter) against a class-conditional and a text-to-image model.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/convert.h"
#include "server/http_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<imagegen::ModelInfo> models = [] {
    imagegen::ModelInfo c;
    c.name = "fmnist-gpt";
    c.image_width = c.image_height = 28;
    c.class_names = {"t-shirt", "bag"};
    c.num_classes = 2;
    imagegen::ModelInfo t = c;
    t.name = "fmnist-t2i";
    t.class_names.clear();
    t.num_classes = 0;
    t.prompted = true;
    return std::vector<imagegen::ModelInfo>{c, t};
  }();
  const std::string body(reinterpret_cast<const char*>(data), size);
  imagegen::server::ImagesRequest out;
  std::string param, message;
  if (!imagegen::server::ParseImagesRequest(body, models, 8, 16, &out, &param, &message)) {
    if (message.empty() || message.size() > 4096 || param.size() > 64) __builtin_trap();
    // Both go into the error's JSON, whose dump throws on invalid UTF-8 (a name cut in the
    // middle of a character did).
    (void)nlohmann::json({{"param", param}, {"message", message}}).dump();
    return 0;
  }
  // What parsed converts like a gRPC request (which checks every field again).
  imagegen::GenerateParams params;
  (void)imagegen::server::ToParams(out.req, "scd-mc", &params);
  if (out.partial_images < 0 || out.partial_images > 8) __builtin_trap();
  if (out.req.output().scale() < 1 || out.req.output().scale() > 16) __builtin_trap();
  return 0;
}

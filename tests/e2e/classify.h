// The bundled classifier on a PNG, behind a LibTorch-free interface so that the end-to-end tests
// (protobuf, gRPC) and LibTorch stay in separate translation units.
#pragma once

#include <string>

namespace imagegen::testing {

// The class the bundled Fashion-MNIST classifier sees in a 28x28 grey PNG (-1 on error, with
// *error set).
int ClassifyPng(const std::string& png, std::string* error);

// The brightness the bundled text-to-image model's captions name ("dark", "light"): the mean
// grey level of the pixels above 20 in a grey PNG (-1 on error, with *error set).
double InkBrightness(const std::string& png, std::string* error);

}  // namespace imagegen::testing

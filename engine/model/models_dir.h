// Where models live by default. No LibTorch here: the server uses it.
#pragma once

#include <string>

namespace imagegen {

// The bundled models directory: $IMAGEGEN_MODELS_DIR, else the source tree's models/.
std::string DefaultModelsDir();

}  // namespace imagegen

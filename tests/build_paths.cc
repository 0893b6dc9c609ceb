#include "tests/build_paths.h"

namespace imagegen::testing {

const char* SourceDir() { return IMAGEGEN_SOURCE_DIR; }
const char* TestModelsDir() { return IMAGEGEN_SOURCE_DIR "/models"; }
const char* ConfiguredPython() { return IMAGEGEN_CONFIGURED_PYTHON; }

}  // namespace imagegen::testing

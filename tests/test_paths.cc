#include "tests/test_paths.h"

namespace imagegen::testing {

const char* TestModelsDir() { return IMAGEGEN_TEST_MODELS_DIR; }

}  // namespace imagegen::testing

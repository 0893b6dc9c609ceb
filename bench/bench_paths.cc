#include "bench/bench_paths.h"

namespace imagegen {

const char* BenchSourceDir() { return IMAGEGEN_SOURCE_DIR; }
const char* BenchDefaultPython() { return IMAGEGEN_DEFAULT_PYTHON; }

}  // namespace imagegen

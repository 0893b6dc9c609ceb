#include "tests/e2e/e2e_paths.h"

namespace imagegen::testing {

const char* ServerBinary() { return IMAGEGEN_SERVER_BINARY; }
const char* CliBinary() { return IMAGEGEN_CLI_BINARY; }
const char* PythonStubs() { return IMAGEGEN_PYTHON_STUBS; }

}  // namespace imagegen::testing

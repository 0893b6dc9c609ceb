// The programs and files of this build the end-to-end tests run. Only e2e_paths.cc is compiled
// with the paths (tests/build_paths.h says why; the source tree and the Python are there).
#pragma once

namespace imagegen::testing {

const char* ServerBinary();  // imagegen-server
const char* CliBinary();     // imagegen
const char* PythonStubs();   // the generated Python gRPC stubs

}  // namespace imagegen::testing

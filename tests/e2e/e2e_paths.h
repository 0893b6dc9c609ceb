// The programs and files the end-to-end tests run, from this build and its source tree. Only
// e2e_paths.cc is compiled with the paths (tests/test_paths.h says why).
#pragma once

namespace imagegen::testing {

const char* ServerBinary();  // imagegen-server
const char* CliBinary();     // imagegen
const char* SourceDir();     // the source tree
const char* PythonStubs();   // the generated Python gRPC stubs
const char* VenvPython();    // the Python with torch and the client packages

}  // namespace imagegen::testing

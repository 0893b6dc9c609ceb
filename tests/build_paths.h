// Where this build's source tree and Python are, for the tests and the benches: the bundled
// models (the source tree's models/ folder), tools/*.py and the Python that runs them (with
// torch, the client packages and the plotting ones; CMake's IMAGEGEN_PYTHON). Only
// build_paths.cc is compiled with the paths, so that no other object depends on where the
// checkout is and a clone elsewhere (CI's) reuses them from ccache. The e2e test's paths into
// the build folder (the daemon, the CLI, the Python stubs) are in tests/e2e/e2e_paths.h.
#pragma once

namespace imagegen::testing {

const char* SourceDir();         // the source tree
const char* TestModelsDir();     // SourceDir()/models
const char* ConfiguredPython();  // IMAGEGEN_PYTHON as configured

}  // namespace imagegen::testing

// Where the bundled models are (the source tree's models/ folder), for the tests. Only
// test_paths.cc is compiled with the path, so that no other test's object depends on where the
// checkout is and a clone elsewhere (CI's) reuses them from ccache.
#pragma once

namespace imagegen::testing {

const char* TestModelsDir();

}  // namespace imagegen::testing

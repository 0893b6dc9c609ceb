// The source tree (for tools/plot_*.py and the bundled models) and the Python that plots, as
// this build was configured. Only bench_paths.cc is compiled with them, so that no bench's
// object depends on where the checkout is (ccache hits from another clone).
#pragma once

namespace imagegen {

const char* BenchSourceDir();
const char* BenchDefaultPython();

}  // namespace imagegen

// Percentile of a sample by linear interpolation between order statistics (q in [0, 1]).
//
// Header-only and standard-library-only: the load benchmark and the gRPC CLI (which links
// no engine library) both report latency percentiles the same way through it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace imagegen {

inline double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto i = static_cast<size_t>(pos);
  const double f = pos - static_cast<double>(i);
  return i + 1 < v.size() ? v[i] * (1 - f) + v[i + 1] * f : v[i];
}

}  // namespace imagegen

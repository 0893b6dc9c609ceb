// A main() for the fuzz targets where libFuzzer is not available (gcc builds, CI): runs the
// target over every file of the given corpus files and directories, then, with
// --mutations N, over N seeded random mutations of each (bytes flipped, inserted, deleted,
// truncated, or spliced from another input). A short, deterministic fuzzing run under the
// sanitizers of the build; the long runs use libFuzzer (tools/fuzz.sh).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void Run(const std::string& s) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::string Mutate(std::string s, const std::vector<std::string>& inputs, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t pos = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 6) {
      case 0:  // flip a bit
        if (!s.empty()) s[pos] = static_cast<char>(s[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:  // an interesting byte
        if (!s.empty()) {
          static const char kBytes[] = {0, 1, 0x7f, '\xff', '"', '{', '[', ':', '-', '9'};
          s[pos] = kBytes[rng() % sizeof(kBytes)];
        }
        break;
      case 2:  // insert bytes
        s.insert(pos, std::string(1 + rng() % 8, static_cast<char>(rng() % 256)));
        break;
      case 3:  // delete bytes
        if (!s.empty()) s.erase(pos, 1 + rng() % 8);
        break;
      case 4:  // truncate
        s.resize(pos);
        break;
      default: {  // splice a piece of another input
        const std::string& o = inputs[rng() % inputs.size()];
        if (!o.empty()) {
          const size_t from = rng() % o.size();
          s.insert(pos, o.substr(from, 1 + rng() % 64));
        }
      }
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  long mutations = 0;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mutations" && i + 1 < argc) {
      mutations = std::strtol(argv[++i], nullptr, 10);
      continue;
    }
    std::filesystem::path p(a);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        if (e.is_regular_file()) inputs.push_back(Slurp(e.path()));
      }
    } else {
      inputs.push_back(Slurp(p));
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "usage: %s [--mutations N] CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  for (const std::string& s : inputs) Run(s);
  std::mt19937_64 rng(20261123);
  long runs = static_cast<long>(inputs.size());
  for (const std::string& s : inputs) {
    for (long m = 0; m < mutations; ++m, ++runs) Run(Mutate(s, inputs, rng));
  }
  std::printf("%ld inputs run (%zu from the corpus), no crash\n", runs, inputs.size());
  return 0;
}

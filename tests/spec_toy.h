// The enumerable toy of the exact-distribution tests: a tiny random target GPT and a smaller
// draft GPT over a vocabulary of 3 and a 3x3 grid (9 tokens), two classes, CFG 1.5 and top-k 2
// on, so that p depends on class and prefix and has zeros. Every conditional distribution is
// tabulated from the models' own forward, which gives the exact AR distribution over all 3^9
// grids. The models are written as a models directory (toy-gpt with its draft toy-draft and a
// VQ toy-vq) so that the serving engine can load them by name.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/decoding/sampling.h"
#include "engine/model/gpt.h"
#include "tests/test_util.h"

namespace imagegen::testing {

constexpr int64_t kV = 3, kGrid = 3, kN = 9, kClasses = 2;
constexpr int64_t kSeqs = 19683;  // 3^9
constexpr int64_t kPerClass = 50000, kChunk = 12500;

inline int64_t Pow(int64_t b, int64_t e) {
  int64_t r = 1;
  while (e-- > 0) r *= b;
  return r;
}

// Target and draft GPTs with every conditional distribution tabulated. `cfg_interval`:
// LlamaGen's (SamplingParams::cfg_interval), the exact distributions follow it.
class Toy {
 public:
  explicit Toy(int64_t cfg_interval = -1) {
    TinyGptSpec spec;
    spec.vocab = kV;
    spec.grid = kGrid;
    spec.classes = kClasses;
    spec.dim = 16;
    dir = TempDir("spec_toy");
    const std::string extra =
        ", \"tokenizer\": \"toy-vq\", \"draft_model\": \"toy-draft\", "
        "\"class_names\": [\"zero\", \"one\"], \"sampling_defaults\": "
        "{\"cfg_scale\": 1.5, \"top_k\": 2}";
    auto t = Gpt::Load(WriteTinyGpt(dir + "/toy-gpt", spec, 11, extra), TestLoadOptions());
    spec.dim = 8;
    spec.n_layer = 1;
    spec.n_head = 2;
    auto d = Gpt::Load(WriteTinyGpt(dir + "/toy-draft", spec, 29), TestLoadOptions());
    WriteTinyVq(dir + "/toy-vq", kV, kGrid);
    if (!t.ok() || !d.ok()) throw std::runtime_error("toy models");
    target = std::move(t).value();
    draft = std::move(d).value();
    sampling.cfg_scale = 1.5;
    sampling.top_k = 2;
    sampling.cfg_interval = cfg_interval;
    for (int64_t c = 0; c < kClasses; ++c) {
      Tabulate(*target, c, pt[c]);
      Tabulate(*draft, c, pd[c]);
    }
  }

  // p(. | prefix) for the prefix given as (length, base-3 index).
  const double* P(int64_t cls, int64_t len, int64_t idx) const { return &pt[cls][len][idx * kV]; }
  const double* Q(int64_t cls, int64_t len, int64_t idx) const { return &pd[cls][len][idx * kV]; }

  // Exact AR probability of every complete grid.
  std::vector<double> Ar(int64_t cls) const {
    std::vector<double> out(kSeqs);
    for (int64_t s = 0; s < kSeqs; ++s) {
      double pr = 1;
      int64_t prefix = 0;
      for (int64_t k = 0; k < kN; ++k) {
        const int64_t tok = Digit(s, k);
        pr *= P(cls, k, prefix)[tok];
        prefix = prefix * kV + tok;
      }
      out[s] = pr;
    }
    return out;
  }

  static int64_t Digit(int64_t seq, int64_t k) { return seq / Pow(kV, kN - 1 - k) % kV; }

  std::unique_ptr<Gpt> target, draft;
  SamplingParams sampling;
  std::string dir;  // a models directory: toy-gpt (drafted for by toy-draft), toy-vq

 private:
  void Tabulate(const Gpt& m, int64_t cls, std::vector<std::vector<double>>& out) {
    out.resize(kN);
    for (int64_t len = 0; len < kN; ++len) {
      const int64_t count = Pow(kV, len);
      KvCache cache = m.NewCache(2 * count);
      std::vector<BatchRow> rows;
      for (int64_t i = 0; i < count; ++i) {
        BatchRow r;
        r.slot = 2 * i;
        r.tokens.push_back(cls);
        r.positions.push_back(0);
        for (int64_t k = 0; k < len; ++k) {
          r.tokens.push_back(i / Pow(kV, len - 1 - k) % kV);
          r.positions.push_back(k + 1);
        }
        rows.push_back(r);
        r.slot = 2 * i + 1;
        r.tokens[0] = m.config().null_class();
        rows.push_back(r);
      }
      at::Tensor l = m.Forward(rows, cache)->cpu();  // tabulated on the host
      at::Tensor last_c = at::arange(len, 2 * count * (len + 1), 2 * (len + 1));
      at::Tensor g = CfgCombine(l.index_select(0, last_c), l.index_select(0, last_c + len + 1),
                                at::full({count}, static_cast<float>(sampling.ScaleAt(len))));
      at::Tensor p =
          FinalProbs(g, std::vector<SamplingParams>(count, sampling)).to(at::kDouble).contiguous();
      out[len].assign(p.data_ptr<double>(), p.data_ptr<double>() + count * kV);
    }
  }

  std::vector<std::vector<double>> pt[kClasses], pd[kClasses];
};

inline Toy& TheToy() {
  static Toy* toy = new Toy();
  return *toy;
}

}  // namespace imagegen::testing

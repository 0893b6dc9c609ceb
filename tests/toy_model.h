// A toy class-conditional "model" small enough to enumerate: vocabulary 4, sequences of 4
// tokens, 2 classes plus the null class. Its logits depend on the class and on every earlier
// token, so that decoding methods are tested on real dependence. The exact distribution over
// all 256 sequences is computed with the engine's own FinalProbs (CFG, temperature, top-k,
// top-p), i.e. it is the AR distribution every lossless method must reproduce.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "engine/decoding/sampling.h"

namespace imagegen::testing {

class ToyModel {
 public:
  static constexpr int64_t kVocab = 4, kLen = 4, kClasses = 2;

  explicit ToyModel(uint64_t seed = 5) {
    at::manual_seed(seed);
    base_ = at::randn({kClasses + 1, kLen, kVocab}) * 0.8;  // per (class, position)
    pair_ = at::randn({kLen, kLen, kVocab, kVocab}) * 0.6;  // token j at pos i -> logits
  }

  // Raw logits [kVocab] of the next token after `prefix` under class `cls` (kClasses = null).
  at::Tensor Logits(int64_t cls, const std::vector<int64_t>& prefix) const {
    const auto k = static_cast<int64_t>(prefix.size());
    at::Tensor l = base_[cls][k].clone();
    for (int64_t j = 0; j < k; ++j) l += pair_[k][j][prefix[j]];
    return l;
  }

  // The final distribution p(. | prefix) after CFG and sampling filters, float32 [kVocab].
  at::Tensor Probs(int64_t cls, const std::vector<int64_t>& prefix, const SamplingParams& s) const {
    at::Tensor c = Logits(cls, prefix).unsqueeze(0);
    at::Tensor g = c;
    if (s.uses_cfg()) {
      g = CfgCombine(c, Logits(kClasses, prefix).unsqueeze(0),
                     at::tensor(std::vector<float>{static_cast<float>(s.cfg_scale)}));
    }
    return FinalProbs(g, {s})[0];
  }

  // Index of a sequence in [0, kVocab^kLen), first token most significant.
  static int64_t Index(const std::vector<int64_t>& seq) {
    int64_t i = 0;
    for (int64_t t : seq) i = i * kVocab + t;
    return i;
  }

  // Exact probability of every complete sequence.
  std::vector<double> Exact(int64_t cls, const SamplingParams& s) const {
    std::vector<double> out;
    std::vector<int64_t> seq;
    Enumerate(cls, s, seq, 1.0, out);
    return out;
  }

 private:
  void Enumerate(int64_t cls, const SamplingParams& s, std::vector<int64_t>& seq, double mass,
                 std::vector<double>& out) const {
    if (static_cast<int64_t>(seq.size()) == kLen) {
      out.push_back(mass);
      return;
    }
    at::Tensor p = Probs(cls, seq, s).to(at::kDouble);
    for (int64_t v = 0; v < kVocab; ++v) {
      seq.push_back(v);
      Enumerate(cls, s, seq, mass * p[v].item<double>(), out);
      seq.pop_back();
    }
  }

  at::Tensor base_, pair_;
};

}  // namespace imagegen::testing

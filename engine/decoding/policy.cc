#include "engine/decoding/policy.h"

#include <cmath>
#include <sstream>

namespace imagegen {

const std::vector<std::string>& PresetNames() {
  static const std::vector<std::string> names = {"ar",      "sjd",        "scd-mc", "scd-gs",
                                                 "sjd-pac", "pac-gumbel", "gsd",    "cool-sjd",
                                                 "sd",      "cool-sd",    "ar-gm",  "scd-gm"};
  return names;
}

const std::vector<std::string>& ContinuousPresetNames() {
  static const std::vector<std::string> names = {"mar", "cspd"};
  return names;
}

StatusOr<DecodingPolicy> PolicyFromPreset(const std::string& name, int64_t window) {
  DecodingPolicy p;
  p.preset = name;
  if (name == "mar") {  // the target alone, MAR's own loop
    p.continuous = true;
    p.window = 1;
  } else if (name == "cspd") {  // seed 000 Alg. 1; the authors' code drafts 8 (demo 4)
    p.continuous = true;
    p.draft = DraftSource::kDraftModel;
    p.window = 8;
    p.cont.final_noise = true;
  } else if (name == "ar") {
    p.window = 1;
  } else if (name == "sjd") {  // seed 001 Alg. 1; authors' code L = 16
    p.draft = DraftSource::kJacobi;
    p.window = 16;
  } else if (name == "scd-mc") {  // seed 001 Alg. 5
    p.draft = DraftSource::kJacobi;
    p.coupling = Coupling::kMaximal;
    p.window = 32;
  } else if (name == "scd-gs") {  // seed 001 Alg. 6
    p.draft = DraftSource::kJacobi;
    p.coupling = Coupling::kGumbel;
    p.window = 32;
  } else if (name == "ar-gm") {  // every token argmax(log p + g): the match rule's reference
    p.coupling = Coupling::kGumbel;
    p.acceptance = Acceptance::kMatch;
    p.window = 1;
  } else if (name == "scd-gm") {  // not in any paper: seed 001's Gumbel drafts, match rule
    p.draft = DraftSource::kJacobi;
    p.coupling = Coupling::kGumbel;
    p.acceptance = Acceptance::kMatch;
    p.window = 32;
  } else if (name == "sjd-pac") {  // seed 002 Alg. 1: AC + PD, K=4, D=3, L=64, uniform q
    p.draft = DraftSource::kJacobi;
    p.coupling = Coupling::kMaximal;
    p.tree_branches = 4;
    p.tree_depth = 3;
    p.window = 64;
    p.uniform_init_q = true;
  } else if (name == "pac-gumbel") {  // not in any paper: PD tree drawn by Gumbel top-K
    p.draft = DraftSource::kJacobi;
    p.coupling = Coupling::kGumbel;
    p.tree_branches = 4;
    p.tree_depth = 3;
    p.window = 64;
  } else if (name == "gsd") {  // seed 004: SJD with grouped acceptance, L = 16
    p.draft = DraftSource::kJacobi;
    p.acceptance = Acceptance::kGrouped;
    p.window = 16;
  } else if (name == "cool-sjd") {  // not in any paper: COOL-SD acceptance on Jacobi drafts
    p.draft = DraftSource::kJacobi;
    p.acceptance = Acceptance::kRelaxed;
    p.window = 16;
  } else if (name == "sd") {  // seed 003 Alg. 1, vanilla rule
    p.draft = DraftSource::kDraftModel;
    p.window = 5;
  } else if (name == "cool-sd") {  // seed 003: delta 1.1, nu 0.7 on a draft model
    p.draft = DraftSource::kDraftModel;
    p.acceptance = Acceptance::kRelaxed;
    p.window = 5;
  } else {
    std::string all;
    for (const auto& n : PresetNames()) all += (all.empty() ? "" : ", ") + n;
    for (const auto& n : ContinuousPresetNames()) all += ", " + n;
    return FieldError("method", "unknown preset " + Quoted(name) + " (one of: " + all + ")");
  }
  if (window > 0) p.window = window;
  return p;
}

Status ValidatePolicy(const DecodingPolicy& p, int64_t max_window, bool has_draft_model) {
  if (p.continuous) {
    return FieldError("method", Quoted(p.preset) + " is for continuous-token models (MAR)");
  }
  if (p.window < 1 || p.window > max_window) {
    return FieldError("window", "must be in [1, " + std::to_string(max_window) + "], got " +
                                    std::to_string(p.window));
  }
  if (p.draft == DraftSource::kNone && p.window != 1) {
    return FieldError("window", "must be 1 without a draft source (ar)");
  }
  if (p.draft != DraftSource::kNone && p.window < 2) {
    return FieldError("window", "speculative methods need window >= 2");
  }
  if (p.draft == DraftSource::kDraftModel && !has_draft_model) {
    return FieldError("method", "draft_model drafting needs a draft model, none is loaded");
  }
  if (p.tree_branches < 1 || p.tree_branches > 16) {
    return FieldError("tree_branches", "must be in [1, 16]");
  }
  if (p.tree_depth < 1 || p.tree_depth > 8) return FieldError("tree_depth", "must be in [1, 8]");
  if (p.has_tree()) {
    if (p.draft != DraftSource::kJacobi) {
      return FieldError("tree_branches", "proactive trees need Jacobi drafts");
    }
    if (p.acceptance != Acceptance::kExact && p.acceptance != Acceptance::kMatch) {
      return FieldError("tree_branches", "trees are verified with the exact or match rule only");
    }
    int64_t nodes = 1, level = 1;
    for (int64_t d = 1; d < p.tree_depth; ++d) nodes += (level *= p.tree_branches);
    if (nodes > p.window) {
      return FieldError("tree_depth", "a tree of " + std::to_string(nodes) +
                                          " nodes does not fit the window of " +
                                          std::to_string(p.window));
    }
  }
  if (p.acceptance == Acceptance::kMatch) {
    if (p.coupling != Coupling::kGumbel) {
      return FieldError("coupling",
                        "the match rule keeps a draft iff it is the Gumbel-max of p: "
                        "it needs gumbel coupling");
    }
    if (p.draft == DraftSource::kDraftModel) {
      return FieldError("acceptance", "the match rule takes Jacobi drafts or none (ar-gm)");
    }
  }
  if (p.draft == DraftSource::kDraftModel && p.coupling != Coupling::kIndependent) {
    return FieldError("coupling", "draft-model drafts are redrawn every step; use independent");
  }
  if (p.acceptance == Acceptance::kGrouped) {
    if (p.gsd_group < 1 || p.gsd_group > 1024)
      return FieldError("gsd_group", "must be in [1, 1024]");
    if (!(p.gsd_delta >= 0) || !std::isfinite(p.gsd_delta)) {
      return FieldError("gsd_delta", "must be a finite number >= 0");
    }
    if (!(p.gsd_distance >= 0)) return FieldError("gsd_distance", "must be >= 0");
  }
  if (p.acceptance == Acceptance::kRelaxed) {
    if (!(p.cool_delta > 0) || !std::isfinite(p.cool_delta)) {
      return FieldError("cool_delta", "must be a positive number");
    }
    if (!(p.cool_nu >= 0) || !std::isfinite(p.cool_nu)) {
      return FieldError("cool_nu", "must be >= 0");
    }
  }
  return OkStatus();
}

Status ValidateContinuousPolicy(const DecodingPolicy& p, int64_t seq_len, bool has_draft_model) {
  if (!p.continuous) {
    return FieldError(
        "method", Quoted(p.preset) + " is for discrete-token models; this model takes mar or cspd");
  }
  const ContinuousPolicy& c = p.cont;
  if (c.num_iter < 0 || c.num_iter > seq_len) {
    return FieldError("num_iter", "must be in [1, " + std::to_string(seq_len) + "] (0: default)");
  }
  if (c.cfg_schedule < -1 || c.cfg_schedule > 1) {
    return FieldError("cfg_schedule", "must be linear or constant");
  }
  if (p.draft == DraftSource::kNone) {
    if (p.window != 1) return FieldError("window", "must be 1 for mar");
    return OkStatus();
  }
  if (p.draft != DraftSource::kDraftModel) {
    return FieldError("draft", "cspd drafts with the draft model");
  }
  if (!has_draft_model) {
    return FieldError("method", "cspd needs a draft model, none is loaded");
  }
  if (p.window < 1 || p.window > seq_len) {
    return FieldError("window", "must be in [1, " + std::to_string(seq_len) + "], got " +
                                    std::to_string(p.window));
  }
  if (c.num_iter != 0 && c.num_iter != seq_len) {
    return FieldError("num_iter", "cspd draws one token per step: num_iter must be " +
                                      std::to_string(seq_len) + " (or unset)");
  }
  if (!c.final_noise) {
    // Its acceptance test compares the draft's and the target's densities at a draw from the
    // draft's final Gaussian; the mean is no draw, and the test would no longer be lossless.
    return FieldError("final_noise", "cspd draws tokens from the final Gaussian: must be true");
  }
  if (!(c.prefill >= 0 && c.prefill <= 1)) return FieldError("prefill", "must be in [0, 1]");
  if (!(c.inner_temperature > 0) || c.inner_temperature > 1e6) {
    return FieldError("inner_temperature", "must be in (0, 1e6]");
  }
  if (c.residual_rounds < 1 || c.residual_rounds > 4096) {
    return FieldError("residual_rounds", "must be in [1, 4096]");
  }
  return OkStatus();
}

std::vector<double> CoolWeights(double delta, double nu, int64_t gamma) {
  // w_i = delta * gamma * e^{-nu i} / sum_j e^{-nu j}: the mean weight is delta.
  std::vector<double> w(static_cast<size_t>(std::max<int64_t>(gamma, 0)));
  double sum = 0;
  for (int64_t i = 1; i <= gamma; ++i) sum += std::exp(-nu * static_cast<double>(i));
  for (int64_t i = 1; i <= gamma; ++i) {
    w[i - 1] = delta * static_cast<double>(gamma) * std::exp(-nu * static_cast<double>(i)) / sum;
  }
  return w;
}

std::string DescribePolicy(const DecodingPolicy& p, int digits) {
  std::ostringstream s;
  s.precision(digits);
  if (p.continuous) {
    const ContinuousPolicy& c = p.cont;
    s << p.preset << " (num_iter=" << c.num_iter << " final_noise=" << c.final_noise;
    if (p.draft == DraftSource::kDraftModel) {
      s << " gamma=" << p.window << " prefill=" << c.prefill << " aligned=" << c.aligned
        << " inner_t=" << c.inner_temperature << " invert_sigma=" << c.invert_sigma
        << " rounds=" << c.residual_rounds << " zero_fallback=" << c.zero_fallback
        << " draft_mean=" << c.draft_mean << " verified_context=" << c.verified_context;
    }
    s << ")";
    return s.str();
  }
  static const char* kDraft[] = {"none", "jacobi", "draft_model"};
  static const char* kCoupling[] = {"independent", "maximal", "gumbel"};
  static const char* kAcc[] = {"exact", "grouped", "relaxed", "match"};
  s << p.preset << " (draft=" << kDraft[static_cast<int>(p.draft)]
    << " coupling=" << kCoupling[static_cast<int>(p.coupling)] << " L=" << p.window;
  if (p.has_tree()) s << " tree=" << p.tree_branches << "x" << p.tree_depth;
  s << " q0=" << (p.uniform_init_q ? "uniform" : "onehot")
    << " accept=" << kAcc[static_cast<int>(p.acceptance)];
  if (p.acceptance == Acceptance::kGrouped) {
    s << "{G=" << p.gsd_group << " delta=" << p.gsd_delta << " d=" << p.gsd_distance << "}";
  }
  if (p.acceptance == Acceptance::kRelaxed) {
    s << "{delta=" << p.cool_delta << " nu=" << p.cool_nu << "}";
  }
  s << ")";
  return s.str();
}

}  // namespace imagegen

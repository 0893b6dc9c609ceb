// The decoding policy: every method of the seed papers is a setting of these parts
// (DESIGN.md, "Decoding"). Presets name the papers' settings; any combination that the
// validator accepts may be requested. Plain data; thread-safe.
//
//   draft source   jacobi (the window's own stale distributions), draft_model, none (AR)
//   coupling       independent (fresh redraw from the stale p after the first rejection),
//                  maximal (keep-or-resample every later position: SCD-MC, which is the same
//                  operation as SJD-PAC's adaptive continuation), gumbel (redraws are
//                  argmax(log p + g) with g keyed by (seed, absolute position, token): SCD-GS)
//   tree           off, or K candidates per level for tree_depth - 1 levels after the first
//                  rejection (SJD-PAC proactive drafting; depth counts the root, as the
//                  authors' code does), then a chain; all within the window of L nodes
//   acceptance     exact min(1, p/q) (lossless), grouped (GSD), relaxed (COOL-SD), match
//                  (lossless, with Gumbel coupling or no drafts: every committed token is
//                  argmax(log p + g) of its position, and a draft is kept iff it is that token;
//                  so a seed draws the same image at any window, plan or batch: the image
//                  ar-gm draws, the Gumbel-max trick's AR sample)
//   window         L: tokens fed per step, root included
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

enum class DraftSource { kNone, kJacobi, kDraftModel };
enum class Coupling { kIndependent, kMaximal, kGumbel };
enum class Acceptance { kExact, kGrouped, kRelaxed, kMatch };

// Continuous-token models (MAR; seed 000): `mar` draws with the target alone, `cspd` drafts
// `window` tokens with the draft model and verifies them with one target forward.
struct ContinuousPolicy {
  int64_t num_iter = 0;      // MAR iterations (cspd: the sequence length); 0: the model's
  int cfg_schedule = -1;     // 1 linear, 0 constant, -1 the model's
  bool final_noise = false;  // tokens drawn from the final Gaussian (cspd) or its mean (MAR)
  double prefill = 0.05;     // cspd: the fraction of tokens the target draws alone first
  bool aligned = true;       // cspd: draft and target share x_T and every step's eps
  // The authors' departures from the paper (shared/docs/algorithms.md 6), off by default.
  double inner_temperature = 1.0;  // 42 in their code
  bool invert_sigma = false;       // prod sigma_p / sigma_q
  // Residual proposals drawn at once; more follow in chunks of as many (cspd_rule.h,
  // kCspdMaxResidualRounds in all), except with zero_fallback, where it is the bound (their 100).
  int64_t residual_rounds = 256;
  bool zero_fallback = false;     // a token no residual proposal passed: all-zero latent
  bool draft_mean = false;        // the draft's token is its final mean (no final noise)
  bool verified_context = false;  // the target sees verified tokens only (no drafts)
};

// The least temperature a cspd request may have. The head's standard deviations scale with
// it, while the draft's and the target's means differ by the float32 rounding of their
// batched rows whatever the temperature: once that difference is a sizeable part of the
// spread, the acceptance test refuses drafts the target would have drawn, and each refusal
// costs a residual (and, with no proposal kept, the fallback). Measured with the bundled
// random MAR drafting for itself (as in MarEngineTest.CspdRefuses...; all accepted at
// 0.1 and above): 216 of 217 drafts accepted at 0.01, 194 of 233 at 1e-3, 15 of 243 at
// 1e-4, 1 of 243 at 1e-5 and below. mar itself takes any temperature in (0, 100].
inline constexpr double kCspdMinTemperature = 0.01;

struct DecodingPolicy {
  std::string preset = "ar";  // the name it was built from ("custom" when edited)
  DraftSource draft = DraftSource::kNone;
  Coupling coupling = Coupling::kIndependent;
  int64_t window = 1;           // L
  bool uniform_init_q = false;  // random Jacobi drafts: q uniform (PAC) or one-hot (SJD)
  int64_t tree_branches = 1;    // K; 1 = no tree
  int64_t tree_depth = 1;       // D, counting the root; 1 = no tree
  Acceptance acceptance = Acceptance::kExact;
  // grouped (GSD, seed 004): cluster of G ids around the draft in p-sorted order, kept if
  // |p(j) - p(x)| < gsd_delta and squared embedding distance < gsd_distance.
  int64_t gsd_group = 14;
  double gsd_delta = 0.15, gsd_distance = 0.5;
  // relaxed (COOL-SD, seed 003): f_i = min(1, w_i p/q), w_i = delta * exp(-nu i - mu), with mu
  // such that sum_{i=1..gamma} exp(-nu i - mu) = gamma (gamma = drafts in the window).
  double cool_delta = 1.1, cool_nu = 0.7;

  bool continuous = false;  // a continuous-token method (mar, cspd)
  ContinuousPolicy cont;

  bool lossless() const {
    return acceptance == Acceptance::kExact || acceptance == Acceptance::kMatch;
  }
  // What it draws for a seed does not depend on its windows (the match rule): the goodput
  // controller may plan it alone too (GoodputRequest::window_invariant).
  bool window_invariant() const { return acceptance == Acceptance::kMatch; }
  bool has_tree() const { return tree_branches > 1 && tree_depth > 1; }
};

// Names of the presets for discrete-token models, in the order the benchmark reports them.
const std::vector<std::string>& PresetNames();
// Names of the presets for continuous-token models: mar, cspd.
const std::vector<std::string>& ContinuousPresetNames();

// ar, sjd, scd-mc, scd-gs, sjd-pac, gsd, cool-sd, sd, the combinations pac-gumbel
// (proactive tree with Gumbel-coupled redraws) and cool-sjd (COOL-SD on Jacobi drafts), and the
// match rule's ar-gm (AR by the Gumbel-max trick) and scd-gm (Gumbel-coupled Jacobi drafts kept
// iff they are the token ar-gm draws: the same image, in fewer steps).
// `window` <= 0 keeps the preset's default L.
StatusOr<DecodingPolicy> PolicyFromPreset(const std::string& name, int64_t window = 0);

// Range and consistency checks; messages name the field ("window", "tree_branches", ...).
// `max_window` is the image's token count; `has_draft_model` says whether one is loaded.
Status ValidatePolicy(const DecodingPolicy& p, int64_t max_window, bool has_draft_model);
// The same for continuous-token models (MAR): `seq_len` tokens per image.
Status ValidateContinuousPolicy(const DecodingPolicy& p, int64_t seq_len, bool has_draft_model);

// COOL-SD weights w_1..w_gamma for a window with gamma drafts.
std::vector<double> CoolWeights(double delta, double nu, int64_t gamma);

// The policy's parts in one line, its real numbers to `digits` significant digits (17: exact,
// two policies with different parts never share a description).
std::string DescribePolicy(const DecodingPolicy& p, int digits = 6);

}  // namespace imagegen

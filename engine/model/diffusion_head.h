// MAR's DiffLoss head (SimpleMLPAdaLN, shared/docs/models.md 3.4) and the respaced cosine DDPM
// it samples tokens with (3.5), batched over tokens. All noise comes from the caller (x_T and
// every step's eps, per token), so that a draft and a target can share a trajectory (CSpD's
// alignment) and a token's draws do not depend on the batch. Besides the token, sampling
// returns what CSpD's acceptance rule needs: the final step's Gaussian and the accumulated
// log-std of the earlier steps. Immutable after Load; Sample is thread-safe.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

struct DiffusionHeadConfig {
  int64_t token_dim = 16;  // C: the head predicts 2C channels (eps and variance interpolation)
  int64_t cond_dim = 768;  // the MAR decoder's width
  int64_t width = 1024, depth = 6;
  std::string sampling_steps = "100";  // MAR's num_sampling_steps: respacing of 1000 steps
};

// The timesteps kept by DiT/IDDPM's space_timesteps(1000, sections) ("100", or "a,b,c"
// sections), ascending; INVALID_ARGUMENT naming `where` when the string is malformed.
StatusOr<std::vector<int64_t>> SpacedTimesteps(int64_t num_timesteps, const std::string& sections,
                                               const std::string& where);

struct HeadSample {
  at::Tensor x0;          // [N, C] the token
  at::Tensor mean0;       // [N, C] mean of the final (t = 0) reverse step
  at::Tensor std0;        // [N, C] its standard deviation, temperature included
  at::Tensor acc_logstd;  // [N, C] sum over the steps t >= 1 of log std (temperature included)
};

class DiffusionHead {
 public:
  // Takes the tensors under `prefix` (MAR: "diffloss.net.").
  static StatusOr<DiffusionHead> Load(WeightStore& store, const std::string& prefix,
                                      const DiffusionHeadConfig& cfg, const LoadOptions& opts);
  const DiffusionHeadConfig& config() const { return cfg_; }
  int64_t steps() const { return static_cast<int64_t>(timestep_map_.size()); }

  // The network: x [N, C], original timesteps t [N] (int64), condition c [N, cond_dim]
  // -> [N, 2C].
  at::Tensor Net(const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) const;

  // Runs the reverse process for N tokens. z_cond [N, cond_dim]; z_uncond [N, cond_dim] for
  // classifier-free guidance (eps_u + cfg (eps_c - eps_u), the unconditional net evaluated
  // at the conditional x, the variance unguided, as MAR's forward_with_cfg), or undefined for
  // none; cfg and temperature [N]; x_T [N, C]; eps [N, steps(), C] where eps[:, i] is the
  // noise of spaced step i (the loop runs i = steps() - 1 down to 0). MAR adds no noise at
  // i = 0; with `final_noise` the token is drawn from the final Gaussian with eps[:, 0], as
  // the CSpD paper samples it.
  HeadSample Sample(const at::Tensor& z_cond, const at::Tensor& z_uncond, const at::Tensor& cfg,
                    const at::Tensor& temperature, const at::Tensor& x_T, const at::Tensor& eps,
                    bool final_noise) const;

 private:
  struct Linear {
    at::Tensor w, b;
  };
  struct Block {
    at::Tensor ln_w, ln_b;
    Linear mlp0, mlp2, ada;
  };

  DiffusionHeadConfig cfg_;
  Linear time0_, time2_, cond_, input_, final_linear_, final_ada_;
  std::vector<Block> blocks_;
  // Per spaced step, float32 on the model's device (computed in float64, as the IDDPM code).
  std::vector<int64_t> timestep_map_;
  std::vector<double> log_beta_, log_var_clipped_, coef1_, coef2_, recip_, recipm1_;
};

}  // namespace imagegen

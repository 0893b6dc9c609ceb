#include "engine/model/diffusion_head.h"

#include <ATen/ATen.h>

#include <cmath>
#include <set>

namespace imagegen {
namespace {

constexpr int64_t kTrainSteps = 1000;
constexpr int64_t kFreqDim = 256;

at::Tensor Apply(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(x, w, b);
}

}  // namespace

StatusOr<std::vector<int64_t>> SpacedTimesteps(int64_t num_timesteps, const std::string& sections,
                                               const std::string& where) {
  std::vector<int64_t> counts;
  size_t start = 0;
  while (start <= sections.size()) {
    const size_t end = std::min(sections.find(',', start), sections.size());
    const std::string part = sections.substr(start, end - start);
    if (part.empty() || part.size() > 6 ||
        part.find_first_not_of("0123456789") != std::string::npos) {
      return InvalidArgument(where + ": '" + sections +
                             "' is not a list of step counts (e.g. \"100\" or \"10,10,5\")");
    }
    counts.push_back(std::stoll(part));
    start = end + 1;
  }
  const auto n = static_cast<int64_t>(counts.size());
  const int64_t size_per = num_timesteps / n, extra = num_timesteps % n;
  std::set<int64_t> steps;
  int64_t start_idx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t size = size_per + (i < extra ? 1 : 0);
    if (counts[i] < 1 || size < counts[i]) {
      return InvalidArgument(where + ": cannot take " + std::to_string(counts[i]) + " of " +
                             std::to_string(size) + " steps");
    }
    const double stride = counts[i] <= 1 ? 1.0 : static_cast<double>(size - 1) / (counts[i] - 1);
    double cur = 0;
    for (int64_t k = 0; k < counts[i]; ++k) {
      // Python's round(): half to even, as nearbyint in the default rounding mode.
      steps.insert(start_idx + static_cast<int64_t>(std::nearbyint(cur)));
      cur += stride;
    }
    start_idx += size;
  }
  return std::vector<int64_t>(steps.begin(), steps.end());
}

StatusOr<DiffusionHead> DiffusionHead::Load(WeightStore& store, const std::string& prefix,
                                            const DiffusionHeadConfig& cfg,
                                            const LoadOptions& opts) {
  DiffusionHead h;
  h.cfg_ = cfg;
  const int64_t w = cfg.width, c = cfg.token_dim;
  auto lin = [&](const std::string& name, int64_t out, int64_t in, Linear& l) -> Status {
    ASSIGN_OR_RETURN(l.w, store.Take(prefix + name + ".weight", {out, in}, opts));
    ASSIGN_OR_RETURN(l.b, store.Take(prefix + name + ".bias", {out}, opts));
    return OkStatus();
  };
  RETURN_IF_ERROR(lin("time_embed.mlp.0", w, kFreqDim, h.time0_));
  RETURN_IF_ERROR(lin("time_embed.mlp.2", w, w, h.time2_));
  RETURN_IF_ERROR(lin("cond_embed", w, cfg.cond_dim, h.cond_));
  RETURN_IF_ERROR(lin("input_proj", w, c, h.input_));
  for (int64_t i = 0; i < cfg.depth; ++i) {
    const std::string p = "res_blocks." + std::to_string(i) + ".";
    Block b;
    ASSIGN_OR_RETURN(b.ln_w, store.Take(prefix + p + "in_ln.weight", {w}, opts));
    ASSIGN_OR_RETURN(b.ln_b, store.Take(prefix + p + "in_ln.bias", {w}, opts));
    RETURN_IF_ERROR(lin(p + "mlp.0", w, w, b.mlp0));
    RETURN_IF_ERROR(lin(p + "mlp.2", w, w, b.mlp2));
    RETURN_IF_ERROR(lin(p + "adaLN_modulation.1", 3 * w, w, b.ada));
    h.blocks_.push_back(std::move(b));
  }
  RETURN_IF_ERROR(lin("final_layer.linear", 2 * c, w, h.final_linear_));
  RETURN_IF_ERROR(lin("final_layer.adaLN_modulation.1", 2 * w, w, h.final_ada_));

  // The cosine schedule, respaced (DiT/IDDPM's gaussian_diffusion.py and respace.py).
  ASSIGN_OR_RETURN(h.timestep_map_,
                   SpacedTimesteps(kTrainSteps, cfg.sampling_steps, "'num_sampling_steps'"));
  if (h.timestep_map_.size() < 2) {
    return InvalidArgument("'num_sampling_steps' must keep at least 2 steps");
  }
  auto alpha_bar = [](double t) {
    const double v = std::cos((t + 0.008) / 1.008 * M_PI / 2);
    return v * v;
  };
  std::vector<double> betas;
  double last = 1.0, cumprod = 1.0;
  size_t next = 0;
  for (int64_t i = 0; i < kTrainSteps; ++i) {
    const double beta = std::min(1 - alpha_bar(static_cast<double>(i + 1) / kTrainSteps) /
                                         alpha_bar(static_cast<double>(i) / kTrainSteps),
                                 0.999);
    cumprod *= 1 - beta;
    if (next < h.timestep_map_.size() && h.timestep_map_[next] == i) {
      betas.push_back(1 - cumprod / last);
      last = cumprod;
      ++next;
    }
  }
  const size_t s = betas.size();
  std::vector<double> ac(s), ac_prev(s), post_var(s);
  double prod = 1.0;
  for (size_t i = 0; i < s; ++i) {
    ac_prev[i] = prod;
    prod *= 1 - betas[i];
    ac[i] = prod;
    post_var[i] = betas[i] * (1 - ac_prev[i]) / (1 - ac[i]);
  }
  for (size_t i = 0; i < s; ++i) {
    h.log_beta_.push_back(std::log(betas[i]));
    h.log_var_clipped_.push_back(std::log(i == 0 ? post_var[1] : post_var[i]));
    h.coef1_.push_back(betas[i] * std::sqrt(ac_prev[i]) / (1 - ac[i]));
    h.coef2_.push_back((1 - ac_prev[i]) * std::sqrt(1 - betas[i]) / (1 - ac[i]));
    h.recip_.push_back(std::sqrt(1 / ac[i]));
    h.recipm1_.push_back(std::sqrt(1 / ac[i] - 1));
  }
  return h;
}

at::Tensor DiffusionHead::Net(const at::Tensor& x, const at::Tensor& t, const at::Tensor& c) const {
  const int64_t w = cfg_.width;
  // Sinusoidal embedding of the original timestep: [cos, sin] at exp(-ln(1e4) i / 128).
  const int64_t half = kFreqDim / 2;
  const at::Tensor freqs =
      at::exp(at::arange(half, x.options().dtype(at::kFloat)) * (-std::log(10000.0) / half));
  const at::Tensor args = t.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  const at::Tensor temb_in = at::cat({at::cos(args), at::sin(args)}, 1).to(x.scalar_type());
  const at::Tensor temb = Apply(at::silu(Apply(temb_in, time0_.w, time0_.b)), time2_.w, time2_.b);
  const at::Tensor y = temb + Apply(c, cond_.w, cond_.b);
  const at::Tensor sy = at::silu(y);
  at::Tensor h = Apply(x, input_.w, input_.b);
  for (const Block& b : blocks_) {
    const auto mod = Apply(sy, b.ada.w, b.ada.b).chunk(3, 1);  // shift, scale, gate
    at::Tensor u = at::layer_norm(h, {w}, b.ln_w, b.ln_b, 1e-6) * (1 + mod[1]) + mod[0];
    u = Apply(at::silu(Apply(u, b.mlp0.w, b.mlp0.b)), b.mlp2.w, b.mlp2.b);
    h = h + mod[2] * u;
  }
  const auto mod = Apply(sy, final_ada_.w, final_ada_.b).chunk(2, 1);  // shift, scale
  const at::Tensor u = at::layer_norm(h, {w}, {}, {}, 1e-6) * (1 + mod[1]) + mod[0];
  return Apply(u, final_linear_.w, final_linear_.b);
}

HeadSample DiffusionHead::Sample(const at::Tensor& z_cond, const at::Tensor& z_uncond,
                                 const at::Tensor& cfg, const at::Tensor& temperature,
                                 const at::Tensor& x_T, const at::Tensor& eps,
                                 bool final_noise) const {
  const int64_t n = z_cond.size(0), c = cfg_.token_dim;
  const bool guided = z_uncond.defined();
  const auto dtype = z_cond.scalar_type();
  const at::Tensor z = guided ? at::cat({z_cond, z_uncond}, 0) : z_cond;
  const at::Tensor scale = cfg.to(z.device(), at::kFloat).unsqueeze(1);
  const at::Tensor tau = temperature.to(z.device(), at::kFloat).unsqueeze(1);
  const at::Tensor log_tau = at::log(tau);
  const at::Tensor noise = eps.to(z.device(), at::kFloat);
  at::Tensor x = x_T.to(z.device(), at::kFloat);
  at::Tensor acc = at::zeros({n, c}, x.options());
  HeadSample out;
  for (int64_t i = steps() - 1; i >= 0; --i) {
    const at::Tensor t =
        at::full({guided ? 2 * n : n}, timestep_map_[i], z.options().dtype(at::kLong));
    const at::Tensor xin = (guided ? at::cat({x, x}, 0) : x).to(dtype);
    const at::Tensor o = Net(xin, t, z).to(at::kFloat);
    const at::Tensor oc = o.narrow(0, 0, n);
    at::Tensor e = oc.narrow(1, 0, c);
    if (guided) {
      const at::Tensor eu = o.narrow(0, n, n).narrow(1, 0, c);
      e = eu + scale * (e - eu);
    }
    // float32 coefficients, as the reference gathers its float64 arrays.
    const auto f = [](double v) { return static_cast<double>(static_cast<float>(v)); };
    const at::Tensor frac = (oc.narrow(1, c, c) + 1) / 2;
    const at::Tensor logvar = frac * f(log_beta_[i]) + (1 - frac) * f(log_var_clipped_[i]);
    const at::Tensor x0 = f(recip_[i]) * x - f(recipm1_[i]) * e;
    const at::Tensor mean = f(coef1_[i]) * x0 + f(coef2_[i]) * x;
    const at::Tensor std = at::exp(0.5 * logvar) * tau;
    if (i > 0) {
      x = mean + std * noise.select(1, i);
      acc = acc + 0.5 * logvar + log_tau;
    } else {
      out.mean0 = mean;
      out.std0 = std;
      out.x0 = final_noise ? mean + std * noise.select(1, 0) : mean;
    }
  }
  out.acc_logstd = acc;
  return out;
}

}  // namespace imagegen

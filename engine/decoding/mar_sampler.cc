#include "engine/decoding/mar_sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "engine/decoding/philox.h"

namespace imagegen {

int64_t MarMaskLen(int64_t seq_len, int64_t step, int64_t num_iter, int64_t masked) {
  const double ratio = std::cos(M_PI / 2.0 * static_cast<double>(step + 1) / num_iter);
  const auto target = static_cast<int64_t>(std::floor(static_cast<double>(seq_len) * ratio));
  return std::max<int64_t>(1, std::min(masked - 1, target));
}

int64_t MarPredictCount(int64_t seq_len, int64_t step, int64_t num_iter, int64_t masked) {
  if (step >= num_iter - 1) return masked;
  return masked - MarMaskLen(seq_len, step, num_iter, masked);
}

double MarCfgAt(const MarSamplingParams& p, int64_t seq_len, int64_t mask_len) {
  if (!p.cfg_linear) return p.cfg_scale;
  return 1 + (p.cfg_scale - 1) * static_cast<double>(seq_len - mask_len) / seq_len;
}

void MarTrajectoryNoise(uint64_t seed, int64_t position, int64_t steps, int64_t token_dim,
                        at::Tensor* x_T, at::Tensor* eps, uint32_t stream) {
  *x_T = at::empty({token_dim}, at::kFloat);
  *eps = at::empty({steps, token_dim}, at::kFloat);
  const auto pos = static_cast<uint32_t>(position);
  Normals(seed, pos, 2 * stream, Purpose::kTrajectory, x_T->data_ptr<float>(), token_dim);
  Normals(seed, pos, 2 * stream + 1, Purpose::kTrajectory, eps->data_ptr<float>(),
          steps * token_dim);
}

StatusOr<at::Tensor> MarSampleTokens(const Mar& mar, const at::Tensor& labels,
                                     const at::Tensor& orders_in, const at::Tensor& x_T,
                                     const at::Tensor& eps, const MarSamplingParams& params) {
  const MarConfig& cfg = mar.config();
  const int64_t b = labels.size(0), s = cfg.seq_len(), c = cfg.token_dim();
  const auto dev = mar.options().device();
  const at::Tensor orders = orders_in.to(at::kCPU, at::kLong);
  at::Tensor tokens = at::zeros({b, s, c}, at::TensorOptions().dtype(at::kFloat).device(dev));
  at::Tensor known = at::zeros({b, s}, at::kBool);  // host copy: the schedule is host logic
  const bool guided = params.cfg_scale != 1.0;
  const at::Tensor null_labels = at::full({b}, cfg.null_class(), at::kLong);
  int64_t masked = s;
  for (int64_t step = 0; step < params.num_iter && masked > 0; ++step) {
    const int64_t mask_len = MarMaskLen(s, step, params.num_iter, masked);
    const int64_t n_pred = MarPredictCount(s, step, params.num_iter, masked);
    // Positions predicted now: orders[mask_len_after .. masked) of each row.
    const at::Tensor pred_pos = orders.narrow(1, masked - n_pred, n_pred);  // [B, n]
    at::Tensor z;
    if (guided) {
      ASSIGN_OR_RETURN(z, mar.Forward(at::cat({tokens, tokens}), at::cat({known, known}),
                                      at::cat({labels.to(at::kCPU, at::kLong), null_labels})));
    } else {
      ASSIGN_OR_RETURN(z, mar.Forward(tokens, known, labels));
    }
    // Tokens in (row, position) order, as MAR's nonzero() gathers them.
    const at::Tensor sorted_pos = std::get<0>(pred_pos.sort(1));
    const at::Tensor rows = at::arange(b, at::kLong).unsqueeze(1).expand({b, n_pred}).reshape(-1);
    const at::Tensor cols = sorted_pos.reshape(-1);
    const at::Tensor rows_d = rows.to(dev), cols_d = cols.to(dev);
    const at::Tensor zc = z.index({rows_d, cols_d});
    const at::Tensor zu = guided ? z.index({rows_d + b, cols_d}) : at::Tensor();
    const int64_t n = rows.size(0);
    const double scale = guided ? MarCfgAt(params, s, mask_len) : 1.0;
    const HeadSample hs =
        mar.head().Sample(zc, zu, at::full({n}, static_cast<float>(scale)),
                          at::full({n}, static_cast<float>(params.temperature)),
                          x_T.index({rows, cols}), eps.index({rows, cols}), /*final_noise=*/false);
    tokens.index_put_({rows_d, cols_d}, hs.x0.to(at::kFloat));
    known.index_put_({rows, cols}, true);
    masked -= n_pred;
  }
  return tokens;
}

}  // namespace imagegen

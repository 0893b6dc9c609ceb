#include "engine/decoding/ar_generator.h"

#include <ATen/ATen.h>

#include "engine/decoding/philox.h"

namespace imagegen {

Status ValidateRequest(const ImageRequest& r, const GptConfig& cfg) {
  if (r.class_id < 0 || r.class_id >= cfg.num_classes) {
    return FieldError("class", "must be in [0, " + std::to_string(cfg.num_classes) + ")");
  }
  RETURN_IF_ERROR(ValidateSampling(r.sampling, cfg.vocab_size));
  if (r.sampling.uses_cfg() && !cfg.has_null_class()) {
    return FieldError("cfg_scale", "> 1 needs a model trained with a null class");
  }
  return OkStatus();
}

StatusOr<std::vector<ImageResult>> ArGenerator::Generate(
    const std::vector<ImageRequest>& requests) const {
  const GptConfig& cfg = gpt_.config();
  const auto n_req = static_cast<int64_t>(requests.size());
  if (n_req == 0) return std::vector<ImageResult>{};
  std::vector<int64_t> cond_row(n_req), uncond_row(n_req);
  std::vector<SamplingParams> params(n_req);
  std::vector<float> scale(n_req);
  std::vector<uint8_t> use_cfg(n_req);
  int64_t rows = 0;
  for (int64_t i = 0; i < n_req; ++i) {
    RETURN_IF_ERROR(ValidateRequest(requests[i], cfg));
    params[i] = requests[i].sampling;
    use_cfg[i] = params[i].uses_cfg();
    scale[i] = static_cast<float>(params[i].cfg_scale);
    cond_row[i] = rows++;
    uncond_row[i] = use_cfg[i] ? rows++ : cond_row[i];
  }
  KvCache cache = gpt_.NewCache(rows);
  std::vector<BatchRow> batch(rows);
  for (int64_t i = 0; i < n_req; ++i) {
    batch[cond_row[i]].tokens = {requests[i].class_id};
    if (use_cfg[i]) batch[uncond_row[i]].tokens = {cfg.null_class()};
  }
  for (int64_t r = 0; r < rows; ++r) batch[r].slot = r;

  const auto dev = gpt_.options().device;
  const at::Tensor cond_idx = at::tensor(cond_row).to(dev);
  const at::Tensor uncond_idx = at::tensor(uncond_row).to(dev);
  const at::Tensor scale_t = at::tensor(scale).to(dev);
  const at::Tensor cfg_mask = at::tensor(std::vector<int64_t>(use_cfg.begin(), use_cfg.end()))
                                  .to(dev).to(at::kBool).unsqueeze(1);

  std::vector<ImageResult> results(n_req);
  std::vector<double> u(n_req);
  for (int64_t t = 0; t < cfg.block_size; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      batch[r].cache_len = t;
      batch[r].positions = {t};
    }
    ASSIGN_OR_RETURN(at::Tensor logits, gpt_.Forward(batch, cache));
    at::Tensor c = logits.index_select(0, cond_idx);
    at::Tensor g = at::where(cfg_mask, CfgCombine(c, logits.index_select(0, uncond_idx), scale_t), c);
    at::Tensor probs = FinalProbs(g, params);
    for (int64_t i = 0; i < n_req; ++i) {
      u[i] = Uniform(requests[i].seed, static_cast<uint32_t>(t), 0, Purpose::kSample);
    }
    at::Tensor tok = SampleInverseCdf(probs, at::tensor(u)).to(at::kCPU);
    auto acc = tok.accessor<int64_t, 1>();
    for (int64_t i = 0; i < n_req; ++i) {
      results[i].tokens.push_back(static_cast<int32_t>(acc[i]));
      results[i].nfe += 1;
      batch[cond_row[i]].tokens = {acc[i]};
      if (use_cfg[i]) batch[uncond_row[i]].tokens = {acc[i]};
    }
  }
  return results;
}

}  // namespace imagegen

#include "engine/decoding/ar_generator.h"

#include <ATen/ATen.h>

#include "engine/decoding/guided_batch.h"
#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "engine/model/transfer.h"

namespace imagegen {

StatusOr<std::vector<ImageResult>> ArGenerator::Generate(
    const std::vector<ImageRequest>& requests) const {
  const GptConfig& cfg = gpt_.config();
  int64_t slots = 0;
  std::vector<int64_t> slot(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    RETURN_IF_ERROR(ValidateSampledRequest(requests[i], cfg));
    if (cfg.prompted()) {
      return FailedPrecondition(
          "ArGenerator draws class-conditional images; prompted models "
          "run through SpecBatch (policy \"ar\" is plain AR there)");
    }
    slot[i] = slots;
    slots += requests[i].sampling.uses_cfg() ? 2 : 1;
  }
  if (requests.empty()) return std::vector<ImageResult>{};
  KvCache cache = gpt_.NewCache(slots);
  std::vector<ImageResult> results(requests.size());
  std::vector<double> u(requests.size());
  for (int64_t t = 0; t < cfg.block_size; ++t) {
    GuidedBatch batch;
    for (size_t i = 0; i < requests.size(); ++i) {
      const ImageRequest& r = requests[i];
      BatchRow row;
      row.slot = slot[i];
      row.cache_len = t;
      row.positions = {t};
      row.tokens = {t == 0 ? r.class_id : results[i].tokens.back()};
      batch.Add(std::move(row), r.sampling.uses_cfg() ? slot[i] + 1 : -1, {cfg.null_class()},
                r.sampling, {0});
      u[i] = Uniform(r.seed, static_cast<uint32_t>(t), 0, Purpose::kSample);
    }
    ASSIGN_OR_RETURN(at::Tensor logits, gpt_.Forward(batch.rows(), cache));
    at::Tensor tok =
        ReadBack(SampleInverseCdf(batch.Probs(logits), UploadDoubles(u, logits.device())));
    auto acc = tok.accessor<int64_t, 1>();
    for (size_t i = 0; i < requests.size(); ++i) {
      results[i].tokens.push_back(static_cast<int32_t>(acc[static_cast<int64_t>(i)]));
      results[i].nfe += 1;
    }
  }
  return results;
}

}  // namespace imagegen

#include "engine/decoding/sjd_generator.h"

#include <ATen/ATen.h>

#include "engine/decoding/philox.h"
#include "engine/decoding/verify.h"

namespace imagegen {
namespace {

struct State {
  std::vector<int64_t> committed;  // image tokens
  std::vector<int64_t> drafts;     // drafts for image tokens committed.size(), +1, ...
  at::Tensor q;                    // [drafts, V] distributions the drafts were drawn from
  uint32_t iteration = 0;
  SjdResult result;
};

}  // namespace

StatusOr<std::vector<SjdResult>> SjdGenerator::Generate(const std::vector<ImageRequest>& requests,
                                                        const SjdParams& params) const {
  const GptConfig& cfg = gpt_.config();
  const int64_t N = cfg.block_size, V = cfg.vocab_size;
  if (params.window < 1 || params.window > N) {
    return InvalidArgument("window must be in [1, " + std::to_string(N) + "]");
  }
  const auto n_req = static_cast<int64_t>(requests.size());
  for (const auto& r : requests) RETURN_IF_ERROR(ValidateRequest(r, cfg));
  std::vector<int64_t> cond_row(n_req), uncond_row(n_req);
  int64_t rows = 0;
  for (int64_t i = 0; i < n_req; ++i) {
    cond_row[i] = rows++;
    uncond_row[i] = requests[i].sampling.uses_cfg() ? rows++ : -1;
  }
  const auto dev = gpt_.options().device;
  const auto fopt = at::TensorOptions().dtype(at::kFloat).device(dev);
  KvCache cache = gpt_.NewCache(rows);
  std::vector<State> st(n_req);
  for (auto& s : st) s.q = at::empty({0, V}, fopt);

  while (true) {
    // Build the batch: [input at seq position n, drafts for tokens n .. n+w-2].
    std::vector<BatchRow> batch;
    std::vector<int64_t> active, width;
    for (int64_t i = 0; i < n_req; ++i) {
      State& s = st[i];
      const auto n = static_cast<int64_t>(s.committed.size());
      if (n == N) continue;
      const int64_t w = std::min(params.window, N - n);
      // Fill the window with random drafts (q one-hot or uniform) where it is short.
      std::vector<at::Tensor> fresh;
      while (static_cast<int64_t>(s.drafts.size()) < w - 1) {
        const auto t = static_cast<uint32_t>(n + s.drafts.size());
        const double u = Uniform(requests[i].seed, t, s.iteration, Purpose::kDraftInit);
        const auto tok = std::min<int64_t>(static_cast<int64_t>(u * V), V - 1);
        s.drafts.push_back(tok);
        at::Tensor qrow = params.uniform_init_q ? at::full({V}, 1.0 / V, fopt)
                                                : at::zeros({V}, fopt).index_fill_(0, at::scalar_tensor(tok, at::kLong).to(dev), 1.0);
        fresh.push_back(qrow);
      }
      if (!fresh.empty()) s.q = at::cat({s.q, at::stack(fresh)});
      s.drafts.resize(w - 1);
      s.q = s.q.narrow(0, 0, w - 1);
      BatchRow row;
      row.slot = cond_row[i];
      row.cache_len = n;
      row.tokens.push_back(n == 0 ? requests[i].class_id : s.committed.back());
      for (int64_t d : s.drafts) row.tokens.push_back(d);
      for (int64_t j = 0; j < w; ++j) row.positions.push_back(n + j);
      batch.push_back(row);
      if (uncond_row[i] >= 0) {
        row.slot = uncond_row[i];
        if (n == 0) row.tokens[0] = cfg.null_class();
        batch.push_back(row);
      }
      active.push_back(i);
      width.push_back(w);
    }
    if (active.empty()) break;
    ASSIGN_OR_RETURN(at::Tensor logits, gpt_.Forward(batch, cache));

    int64_t off = 0;  // row offset into logits
    for (size_t a = 0; a < active.size(); ++a) {
      const int64_t i = active[a], w = width[a];
      State& s = st[i];
      const ImageRequest& req = requests[i];
      const auto n = static_cast<int64_t>(s.committed.size());
      at::Tensor c = logits.narrow(0, off, w);
      off += w;
      at::Tensor g = c;
      if (uncond_row[i] >= 0) {
        g = CfgCombine(c, logits.narrow(0, off, w),
                       at::full({w}, static_cast<float>(req.sampling.cfg_scale), fopt));
        off += w;
      }
      at::Tensor P = FinalProbs(g, std::vector<SamplingParams>(w, req.sampling));  // [w, V]
      s.result.image.nfe += 1;

      // Verify drafts d_1..d_{w-1} (image tokens n..n+w-2) against P[0..w-2].
      int64_t m = w;  // tokens committed this step
      int64_t replacement = -1;
      if (w > 1) {
        at::Tensor drafts = at::tensor(s.drafts).to(dev);
        at::Tensor acc = AcceptProbability(P.narrow(0, 0, w - 1), s.q, drafts).cpu();
        auto pa = acc.accessor<double, 1>();
        for (int64_t j = 0; j < w - 1; ++j) {
          const auto t = static_cast<uint32_t>(n + j);
          s.result.drafts_verified += 1;
          const double u = Uniform(req.seed, t, s.iteration, Purpose::kAccept);
          if (broken_accept_always || u < pa[j]) {
            s.result.drafts_accepted += 1;
            continue;
          }
          at::Tensor res = ResidualDistribution(P[j], s.q[j]).unsqueeze(0);
          const double ur = Uniform(req.seed, t, s.iteration, Purpose::kResample);
          replacement = SampleInverseCdf(res, at::tensor(std::vector<double>{ur})).item<int64_t>();
          m = j + 1;
          break;
        }
      }
      for (int64_t j = 0; j < m - 1; ++j) s.committed.push_back(s.drafts[j]);
      if (replacement >= 0) {
        s.committed.push_back(replacement);
      } else {  // all drafts accepted: bonus token from the last p
        const auto t = static_cast<uint32_t>(n + w - 1);
        const double u = Uniform(req.seed, t, s.iteration, Purpose::kSample);
        s.committed.push_back(
            SampleInverseCdf(P.narrow(0, w - 1, 1), at::tensor(std::vector<double>{u})).item<int64_t>());
      }
      // Redraw the rest of the window from the stale p: tokens n+m .. n+w-1 use P[m .. w-1].
      const int64_t keep = w - m;
      std::vector<int64_t> next;
      if (keep > 0) {
        std::vector<double> us(keep);
        for (int64_t j = 0; j < keep; ++j) {
          us[j] = Uniform(req.seed, static_cast<uint32_t>(n + m + j), s.iteration, Purpose::kDraft);
        }
        at::Tensor stale = P.narrow(0, m, keep);
        at::Tensor ids = SampleInverseCdf(stale, at::tensor(us)).cpu();
        for (int64_t j = 0; j < keep; ++j) next.push_back(ids[j].item<int64_t>());
        s.q = stale.clone();
      } else {
        s.q = at::empty({0, V}, fopt);
      }
      s.drafts = next;
      s.iteration += 1;
    }
  }
  std::vector<SjdResult> out;
  for (auto& s : st) {
    for (int64_t t : s.committed) s.result.image.tokens.push_back(static_cast<int32_t>(t));
    out.push_back(std::move(s.result));
  }
  return out;
}

}  // namespace imagegen

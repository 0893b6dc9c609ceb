#include "engine/scheduler/mar_scheduler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <numeric>

#include "engine/decoding/cspd_rule.h"
#include "engine/decoding/mar_sampler.h"
#include "engine/decoding/philox.h"
#include "engine/model/image_model.h"
#include "engine/util/run_queue_wait.h"

namespace imagegen {
namespace {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The rows of one forward: each a token grid, which of its tokens are known, and a label.
struct Rows {
  std::vector<at::Tensor> tokens, known;
  std::vector<int64_t> labels;
  int64_t Add(const at::Tensor& t, const at::Tensor& k, int64_t label) {
    tokens.push_back(t);
    known.push_back(k);
    labels.push_back(label);
    return static_cast<int64_t>(labels.size()) - 1;
  }
};

// The tokens the diffusion head samples from one forward's output.
struct HeadTokens {
  std::vector<int64_t> row_c, row_u, pos;  // row_u -1: no guidance
  std::vector<float> cfg, temperature;
  std::vector<at::Tensor> x_T, eps;  // [C] and [steps, C], CPU
  std::vector<uint8_t> final_noise;
  int64_t Add(int64_t rc, int64_t ru, int64_t p, double scale, double temp, const at::Tensor& xt,
              const at::Tensor& e, bool fn) {
    row_c.push_back(rc);
    row_u.push_back(ru);
    pos.push_back(p);
    cfg.push_back(static_cast<float>(scale));
    temperature.push_back(static_cast<float>(temp));
    x_T.push_back(xt);
    eps.push_back(e);
    final_noise.push_back(fn ? 1 : 0);
    return static_cast<int64_t>(pos.size()) - 1;
  }
  size_t size() const { return pos.size(); }
};

struct HeadOut {
  at::Tensor x0, mean0, std0;  // [N, C] float32 CPU
  at::Tensor acc_logstd;       // [N] summed over dims
};

at::Tensor Pick(const std::vector<int64_t>& v, const std::vector<size_t>& idx) {
  std::vector<int64_t> out;
  for (size_t i : idx) out.push_back(v[i]);
  return at::tensor(out, at::kLong);
}

// One forward of `mar` over `rows`, then the head over `toks` (guided and unguided tokens in
// one call each).
StatusOr<HeadOut> Run(const Mar& mar, const Rows& rows, const HeadTokens& toks) {
  HeadOut out;
  const int64_t n = static_cast<int64_t>(toks.size()), c = mar.config().token_dim();
  out.x0 = at::zeros({n, c});
  out.mean0 = at::zeros({n, c});
  out.std0 = at::zeros({n, c});
  out.acc_logstd = at::zeros({n});
  if (n == 0) return out;
  ASSIGN_OR_RETURN(at::Tensor z, mar.Forward(at::stack(rows.tokens), at::stack(rows.known),
                                             at::tensor(rows.labels, at::kLong)));
  const auto dev = z.device();
  for (const bool guided : {true, false}) {
    std::vector<size_t> idx;
    for (size_t i = 0; i < toks.size(); ++i) {
      if ((toks.row_u[i] >= 0) == guided) idx.push_back(i);
    }
    if (idx.empty()) continue;
    const at::Tensor pos = Pick(toks.pos, idx).to(dev);
    const at::Tensor zc = z.index({Pick(toks.row_c, idx).to(dev), pos});
    const at::Tensor zu = guided ? z.index({Pick(toks.row_u, idx).to(dev), pos}) : at::Tensor();
    std::vector<float> cfg, temp;
    std::vector<at::Tensor> xt, eps;
    std::vector<int64_t> fn;
    for (size_t i : idx) {
      cfg.push_back(toks.cfg[i]);
      temp.push_back(toks.temperature[i]);
      xt.push_back(toks.x_T[i]);
      eps.push_back(toks.eps[i]);
      fn.push_back(toks.final_noise[i]);
    }
    const at::Tensor e = at::stack(eps);
    const HeadSample hs = mar.head().Sample(zc, zu, at::tensor(cfg), at::tensor(temp),
                                            at::stack(xt), e, /*final_noise=*/false);
    const at::Tensor mean = hs.mean0.to(at::kCPU, at::kFloat);
    const at::Tensor std = hs.std0.to(at::kCPU, at::kFloat);
    const at::Tensor noisy = mean + std * e.select(1, 0);
    const at::Tensor use_noise = at::tensor(fn, at::kLong).to(at::kBool).unsqueeze(1);
    const at::Tensor where = at::tensor(std::vector<int64_t>(idx.begin(), idx.end()), at::kLong);
    out.x0.index_put_({where}, at::where(use_noise, noisy, mean));
    out.mean0.index_put_({where}, mean);
    out.std0.index_put_({where}, std);
    out.acc_logstd.index_put_({where}, hs.acc_logstd.to(at::kCPU, at::kFloat).sum(1));
  }
  return out;
}

// A request's decision order: token k goes to position order[k] (a uniform permutation keyed
// by the seed; MAR reveals the tail of its permutation first, which is the same law).
std::vector<int64_t> DecisionOrder(uint64_t seed, int64_t s) {
  std::vector<double> keys(static_cast<size_t>(s));
  for (int64_t p = 0; p < s; ++p) {
    keys[p] = Uniform(seed, static_cast<uint32_t>(p), 0, Purpose::kDraftInit);
  }
  std::vector<int64_t> order(static_cast<size_t>(s));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  return order;
}

// Every position's trajectory noise for one stream: x_T [S, C] and eps [S, steps, C].
void Trajectories(uint64_t seed, uint32_t stream, int64_t s, int64_t steps, int64_t c,
                  at::Tensor* x_T, at::Tensor* eps) {
  *x_T = at::empty({s, c});
  *eps = at::empty({s, steps, c});
  for (int64_t p = 0; p < s; ++p) {
    at::Tensor xt, e;
    MarTrajectoryNoise(seed, p, steps, c, &xt, &e, stream);
    (*x_T)[p].copy_(xt);
    (*eps)[p].copy_(e);
  }
}

}  // namespace

struct MarScheduler::Active {
  std::unique_ptr<Job> job;
  MarSamplingParams sp;
  bool cspd = false;
  int64_t prefill = 0, gamma = 1, rows = 1;
  std::vector<int64_t> order;  // decision order
  at::Tensor tokens;           // [S, C] float32 CPU
  at::Tensor known;            // [S] bool CPU
  at::Tensor x_T, eps;         // stream 0: the draft's, and the target's when aligned
  at::Tensor x_T_t, eps_t;     // the target's own when not aligned
  int64_t committed = 0, iter = 0;
  RequestCounters counters;
  std::vector<int32_t> step_tokens;  // tokens committed by each step
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  int64_t fallbacks = 0, residual_rounds = 0;
  double sq_dist = 0;  // draft vs target token, summed over drafted tokens
  int64_t dist_n = 0;
  std::vector<int32_t> decided;  // positions decided this step
  int64_t last_window = 0;
  bool done(int64_t s) const { return committed >= s; }
  int64_t label() const { return job->request.class_id; }
  bool guided() const { return sp.cfg_scale != 1.0; }
};

int64_t MarStepRows(const DecodingPolicy& policy, double cfg_scale) {
  const bool cspd = policy.draft == DraftSource::kDraftModel;
  const int64_t contexts = cspd && !policy.cont.verified_context ? policy.window + 1 : 1;
  return contexts * (cfg_scale != 1.0 ? 2 : 1);
}

MarScheduler::MarScheduler(const MarModel& model, int64_t slots, const EngineOptions& opts,
                           DecodeQueue& decoder, EngineListener* listener)
    : FamilyScheduler(opts),
      model_(model),
      opts_(opts),
      decoder_(decoder),
      listener_(listener),
      slots_(slots) {}

MarScheduler::~MarScheduler() = default;

Clock::time_point MarScheduler::next_deadline() const {
  Clock::time_point t = Clock::time_point::max();
  for (const auto& j : waiting_.jobs()) t = std::min(t, j->params.deadline);
  for (const auto& a : active_) t = std::min(t, a->job->params.deadline);
  return t;
}

void MarScheduler::End(Active& a, const Status& status) {
  used_ -= a.rows;
  NotifyError(*a.job->observer, status);
}

void MarScheduler::EndAll(const Status& status, Outcomes& out) {
  std::vector<std::unique_ptr<Job>> waiting = waiting_.TakeAll();
  for (auto& a : active_) {
    if (a) End(*a, status);  // null after an exception escaped a step's clean-up (EndAll then)
  }
  for (auto& j : waiting) NotifyError(*j->observer, status);
  out.failed += static_cast<int64_t>(active_.size() + waiting.size());
  active_.clear();
}

bool MarScheduler::Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
                        Outcomes& out) {
  auto ended = [&](Job& j, Active* a) {
    Status st;
    if (cancelled.count(j.id) > 0) {
      st = Cancelled("request " + std::to_string(j.id) + " cancelled");
      out.cancelled += 1;
    } else if (now >= j.params.deadline) {
      st = DeadlineExceeded("deadline exceeded after " +
                            std::to_string(a != nullptr ? a->counters.nfe : 0) + " steps");
      out.expired += 1;
    } else {
      return false;
    }
    if (a != nullptr) {
      End(*a, st);
    } else {
      NotifyError(*j.observer, st);
    }
    return true;
  };
  waiting_.EraseIf([&](Job& j) { return ended(j, nullptr); });
  std::erase_if(active_, [&](const std::unique_ptr<Active>& a) { return ended(*a->job, a.get()); });
  Admit(out);
  if (active_.empty()) return false;
  Step(out);
  return true;
}

// In the WaitQueue's order, as the discrete scheduler; the request next in that order is never
// overtaken. A request takes the rows it feeds the target forward: one per context (gamma + 1
// for cspd's paper rule), twice with CFG.
void MarScheduler::Admit(Outcomes& out) {
  const MarConfig& cfg = model_.mar->config();
  const int64_t s = cfg.seq_len(), c = cfg.token_dim(), steps = model_.mar->head().steps();
  const auto now = Clock::now();
  WaitQueue::Running running;
  for (const auto& a : active_) running.Add(*a->job);
  while (Job* next = waiting_.Next(running)) {
    Job& j = *next;
    const DecodingPolicy& p = j.request.policy;
    auto a = std::make_unique<Active>();
    a->cspd = p.draft == DraftSource::kDraftModel;
    a->gamma = a->cspd ? p.window : 1;
    a->sp.cfg_scale = j.request.sampling.cfg_scale;
    a->sp.temperature = j.request.sampling.temperature;
    a->sp.num_iter = a->cspd ? s : (p.cont.num_iter > 0 ? p.cont.num_iter : cfg.default_num_iter);
    a->sp.cfg_linear = p.cont.cfg_schedule < 0 ? cfg.default_cfg_linear : p.cont.cfg_schedule == 1;
    a->rows = MarStepRows(p, a->sp.cfg_scale);
    if (a->rows > slots_) {
      NotifyError(*j.observer, FieldError("window", "needs " + std::to_string(a->rows) +
                                                        " forward rows per step, the server has " +
                                                        std::to_string(slots_) + " (--max-slots)"));
      out.failed += 1;
      waiting_.Take(&j);
      continue;
    }
    if (used_ + a->rows > slots_) break;
    a->prefill =
        a->cspd ? static_cast<int64_t>(std::ceil(p.cont.prefill * static_cast<double>(s))) : 0;
    const uint64_t seed = j.request.seed;
    a->order = DecisionOrder(seed, s);
    a->tokens = at::zeros({s, c});
    a->known = at::zeros({s}, at::kBool);
    Trajectories(seed, 0, s, steps, c, &a->x_T, &a->eps);
    if (a->cspd && !p.cont.aligned) {
      Trajectories(seed, 1, s, steps, c, &a->x_T_t, &a->eps_t);
    } else {
      a->x_T_t = a->x_T;
      a->eps_t = a->eps;
    }
    j.started = now;
    j.last_preview = now;
    used_ += a->rows;
    running.Add(j);
    a->job = waiting_.Take(&j);
    active_.push_back(std::move(a));
  }
}

// draft phase (cspd: gamma one-token draft forwards, batched across requests) -> target phase
// (one forward: MAR iterations, pre-fill tokens, verification contexts) -> verification and
// commits.
Status MarScheduler::StepImpl() {
  const Mar& target = *model_.mar;
  const MarConfig& cfg = target.config();
  const int64_t s = cfg.seq_len(), null = cfg.null_class();
  for (auto& a : active_) a->decided.clear();
  auto place = [&](Active& a, int64_t k, const at::Tensor& x) {
    const int64_t pos = a.order[k];
    a.tokens[pos].copy_(x);
    a.known[pos] = true;
    a.decided.push_back(static_cast<int32_t>(pos));
  };
  // The guidance of the token decided k-th, one per step: MAR's mask length then is
  // max(1, S - k - 1) (at the last step too, as MAR computes it).
  auto cfg_at = [&](const Active& a, int64_t k) {
    return MarCfgAt(a.sp, s, std::max<int64_t>(1, s - k - 1));
  };

  // Draft phase.
  struct Drafting {
    Active* a;
    int64_t g;
    std::vector<at::Tensor> x, mean, std;
    std::vector<float> acc;
  };
  std::vector<Drafting> drafting;
  for (auto& a : active_) {
    if (a->cspd && a->committed >= a->prefill && !a->done(s)) {
      drafting.push_back({a.get(), std::min(a->gamma, s - a->committed), {}, {}, {}, {}});
    }
  }
  int64_t max_g = 0;
  for (const auto& d : drafting) max_g = std::max(max_g, d.g);
  for (int64_t i = 0; i < max_g; ++i) {
    Rows rows;
    HeadTokens toks;
    std::vector<Drafting*> in_round;
    for (auto& d : drafting) {
      if (i >= d.g) continue;
      Active& a = *d.a;
      at::Tensor t = a.tokens.clone(), k = a.known.clone();
      for (int64_t j = 0; j < i; ++j) {
        t[a.order[a.committed + j]].copy_(d.x[j]);
        k[a.order[a.committed + j]] = true;
      }
      const int64_t rc = rows.Add(t, k, a.label());
      const int64_t ru = a.guided() ? rows.Add(t, k, null) : -1;
      const int64_t pos = a.order[a.committed + i];
      toks.Add(rc, ru, pos, cfg_at(a, a.committed + i), a.sp.temperature, a.x_T[pos], a.eps[pos],
               !a.job->request.policy.cont.draft_mean);
      in_round.push_back(&d);
    }
    ASSIGN_OR_RETURN(HeadOut q, Run(*model_.draft, rows, toks));
    for (size_t r = 0; r < in_round.size(); ++r) {
      Drafting& d = *in_round[r];
      const auto ri = static_cast<int64_t>(r);
      d.x.push_back(q.x0[ri]);
      d.mean.push_back(q.mean0[ri]);
      d.std.push_back(q.std0[ri]);
      d.acc.push_back(q.acc_logstd[ri].item<float>());
      d.a->counters.draft_forwards += 1;
    }
  }

  // Target phase: every request's rows in one forward.
  Rows rows;
  HeadTokens toks;
  std::vector<std::vector<int64_t>> entries(active_.size());  // head tokens per request
  size_t next_draft = 0;
  for (size_t ai = 0; ai < active_.size(); ++ai) {
    Active& a = *active_[ai];
    const ContinuousPolicy& cp = a.job->request.policy.cont;
    Drafting* d = next_draft < drafting.size() && drafting[next_draft].a == &a
                      ? &drafting[next_draft++]
                      : nullptr;
    if (d == nullptr) {
      // A MAR iteration (mar), or one target token (cspd's pre-fill).
      const int64_t masked = s - a.committed;
      const int64_t n = a.cspd ? 1 : MarPredictCount(s, a.iter, a.sp.num_iter, masked);
      const double scale = a.cspd ? cfg_at(a, a.committed)
                                  : MarCfgAt(a.sp, s, MarMaskLen(s, a.iter, a.sp.num_iter, masked));
      // The iteration's positions in raster order, as MAR gathers them (the head's rows then
      // match MAR's loop exactly; the set is what the order decides).
      std::sort(a.order.begin() + a.committed, a.order.begin() + a.committed + n);
      const int64_t rc = rows.Add(a.tokens, a.known, a.label());
      const int64_t ru = a.guided() ? rows.Add(a.tokens, a.known, null) : -1;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t pos = a.order[a.committed + k];
        entries[ai].push_back(toks.Add(rc, ru, pos, scale, a.sp.temperature, a.x_T_t[pos],
                                       a.eps_t[pos], cp.final_noise));
      }
      a.last_window = n;
      continue;
    }
    a.last_window = d->g;
    if (cp.verified_context) {
      // The authors' rule: one context, the verified tokens only, for every window position.
      const int64_t rc = rows.Add(a.tokens, a.known, a.label());
      const int64_t ru = a.guided() ? rows.Add(a.tokens, a.known, null) : -1;
      for (int64_t i = 0; i < d->g; ++i) {
        const int64_t pos = a.order[a.committed + i];
        entries[ai].push_back(toks.Add(rc, ru, pos, cfg_at(a, a.committed + i), a.sp.temperature,
                                       a.x_T_t[pos], a.eps_t[pos], cp.final_noise));
      }
      continue;
    }
    // Algorithm 1: context i holds the drafts before i; context g gives the bonus token.
    const int64_t contexts = a.committed + d->g < s ? d->g + 1 : d->g;
    at::Tensor t = a.tokens.clone(), k = a.known.clone();
    for (int64_t i = 0; i < contexts; ++i) {
      if (i > 0) {
        t = t.clone();
        k = k.clone();
        t[a.order[a.committed + i - 1]].copy_(d->x[static_cast<size_t>(i - 1)]);
        k[a.order[a.committed + i - 1]] = true;
      }
      const int64_t rc = rows.Add(t, k, a.label());
      const int64_t ru = a.guided() ? rows.Add(t, k, null) : -1;
      const int64_t pos = a.order[a.committed + i];
      entries[ai].push_back(toks.Add(rc, ru, pos, cfg_at(a, a.committed + i), a.sp.temperature,
                                     a.x_T_t[pos], a.eps_t[pos], cp.final_noise));
    }
  }
  ASSIGN_OR_RETURN(HeadOut p, Run(target, rows, toks));

  // Verification and commits.
  next_draft = 0;
  for (size_t ai = 0; ai < active_.size(); ++ai) {
    Active& a = *active_[ai];
    a.counters.nfe += 1;
    const std::vector<int64_t>& e = entries[ai];
    Drafting* d = next_draft < drafting.size() && drafting[next_draft].a == &a
                      ? &drafting[next_draft++]
                      : nullptr;
    const int64_t before = a.committed;
    if (d == nullptr) {
      for (size_t k = 0; k < e.size(); ++k)
        place(a, a.committed + static_cast<int64_t>(k), p.x0[e[k]]);
      a.committed += static_cast<int64_t>(e.size());
      a.iter += 1;
    } else {
      const ContinuousPolicy& cp = a.job->request.policy.cont;
      const int64_t g = d->g, rounds = cp.residual_rounds, c = cfg.token_dim();
      const at::Tensor ids = at::tensor(std::vector<int64_t>(e.begin(), e.begin() + g), at::kLong);
      CspdHeads qh{at::stack(d->mean), at::stack(d->std), at::tensor(d->acc)};
      CspdHeads ph{p.mean0.index({ids}), p.std0.index({ids}), p.acc_logstd.index({ids})};
      CspdNoise noise{at::empty({g}), at::empty({g, rounds, c}), at::empty({g, rounds})};
      const uint64_t seed = a.job->request.seed;
      // Window token i's residual noise for rounds [chunk R, (chunk + 1) R), R = rounds, into
      // `proposal` ([R, C]) and `proposal_u` ([R]): chunk k continues chunk 0's streams.
      auto residual_noise = [&](int64_t i, int64_t chunk, at::Tensor proposal,
                                at::Tensor proposal_u) {
        const auto pos = static_cast<uint32_t>(a.order[a.committed + i]);
        const auto first = static_cast<uint32_t>(chunk * rounds);
        Normals(seed, pos, 0, Purpose::kResidualProposal, proposal.data_ptr<float>(), rounds * c,
                first * static_cast<uint32_t>(c));
        for (int64_t r = 0; r < rounds; ++r) {
          proposal_u[r] =
              Uniform(seed, pos, 0, Purpose::kResample, first + static_cast<uint32_t>(r));
        }
      };
      for (int64_t i = 0; i < g; ++i) {
        const auto pos = static_cast<uint32_t>(a.order[a.committed + i]);
        noise.accept_u[i] = Uniform(seed, pos, 0, Purpose::kAccept);
        residual_noise(i, 0, noise.proposal[i], noise.proposal_u[i]);
      }
      CspdRuleOptions ro;
      ro.inner_temperature = cp.inner_temperature;
      ro.invert_sigma = cp.invert_sigma;
      ro.fallback = cp.zero_fallback ? CspdFallback::kZero : CspdFallback::kTargetSample;
      const at::Tensor drafts = at::stack(d->x);
      CspdVerdict v = CspdVerify(drafts, qh, ph, noise, ro);
      a.sq_dist += (drafts - p.x0.index({ids})).pow(2).sum().item<double>();
      a.dist_n += g;
      const at::Tensor acc = v.accepted.to(at::kCPU);
      std::vector<uint8_t> accepted(static_cast<size_t>(g));
      for (int64_t i = 0; i < g; ++i) accepted[i] = acc[i].item<bool>() ? 1 : 0;
      // The rejected tokens whose residual draw is used (each one with the authors' verified
      // context, else the first) go on past the first chunk of proposals if none was kept,
      // with the next rounds of the same streams.
      std::vector<int64_t> used;
      for (int64_t i = 0; i < g; ++i) {
        if (accepted[i]) continue;
        used.push_back(i);
        if (!cp.verified_context) break;
      }
      CspdContinueResidual(
          qh, ph, ro, used, kCspdMaxResidualRounds,
          [&](int64_t chunk, const std::vector<int64_t>& rows) {
            const auto k = static_cast<int64_t>(rows.size());
            CspdNoise more{at::Tensor(), at::empty({k, rounds, c}), at::empty({k, rounds})};
            for (int64_t m = 0; m < k; ++m) {
              residual_noise(rows[m], chunk, more.proposal[m], more.proposal_u[m]);
            }
            return more;
          },
          &v);
      if (a.verified_at_depth.size() < static_cast<size_t>(g)) {
        a.verified_at_depth.resize(static_cast<size_t>(g), 0);
        a.accepted_at_depth.resize(static_cast<size_t>(g), 0);
      }
      auto residual = [&](int64_t i) {
        a.fallbacks += v.fell_back[i].item<bool>() ? 1 : 0;
        a.residual_rounds += v.rounds[i].item<int64_t>();
      };
      if (cp.verified_context) {
        for (int64_t i = 0; i < g; ++i) {
          place(a, a.committed + i, v.tokens[i]);
          a.counters.drafts_verified += 1;
          a.counters.drafts_accepted += accepted[i];
          a.verified_at_depth[i] += 1;
          a.accepted_at_depth[i] += accepted[i];
          if (!accepted[i]) residual(i);
        }
        a.committed += g;
      } else {
        int64_t n = 0;
        while (n < g && accepted[n]) ++n;
        for (int64_t i = 0; i < n; ++i) place(a, a.committed + i, d->x[i]);
        a.counters.drafts_verified += std::min(n + 1, g);
        a.counters.drafts_accepted += n;
        for (int64_t i = 0; i < std::min(n + 1, g); ++i) {
          a.verified_at_depth[i] += 1;
          a.accepted_at_depth[i] += i < n ? 1 : 0;
        }
        if (n < g) {
          place(a, a.committed + n, v.tokens[n]);
          residual(n);
          a.committed += n + 1;
        } else {
          if (static_cast<int64_t>(e.size()) > g) place(a, a.committed + g, p.x0[e[g]]);
          a.committed += static_cast<int64_t>(e.size());
        }
      }
    }
    a.step_tokens.push_back(static_cast<int32_t>(a.committed - before));
    a.counters.tokens = a.committed;
  }
  return OkStatus();
}

void MarScheduler::Step(Outcomes& out) {
  const auto t0 = Clock::now();
  Status st;
  try {
    InjectFailure();
    st = StepImpl();
  } catch (const std::exception& e) {
    st = Internal(std::string("step failed: ") + e.what());
  }
  CountStep(st);
  StepSample sample;
  sample.model = model_.name;
  sample.requests = static_cast<int64_t>(active_.size());
  if (!st.ok()) {
    for (auto& a : active_) End(*a, Internal("generation failed: " + st.message()));
    out.failed += static_cast<int64_t>(active_.size());
    active_.clear();
    return;
  }
  const auto t1 = Clock::now();
  std::vector<StepEvent> events;
  std::vector<size_t> due;
  const int64_t s = model_.mar->config().seq_len();
  for (size_t i = 0; i < active_.size(); ++i) {
    Active& a = *active_[i];
    if (a.job->first_token == Clock::time_point()) a.job->first_token = t1;
    sample.committed += static_cast<int64_t>(a.decided.size());
    sample.tokens += a.rows;
    events.push_back(Event(a));
    if (PreviewDueAt(*a.job, a.counters.nfe, events.back().totals.tokens, s)) due.push_back(i);
  }
  // The preview budget, as for the discrete family: the KL decoder runs on this thread too.
  due = PreviewsThisStep(std::move(due), Seconds(t0, t1),
                         [&](size_t i) { return active_[i]->job->last_preview; });
  if (!due.empty()) {
    const auto p0 = Clock::now();
    AddPreviews(due, events);
    previews_.Spent(due.size(), Seconds(p0, Clock::now()));
  }
  for (size_t i = 0; i < active_.size(); ++i) NotifyStep(*active_[i]->job->observer, events[i]);
  sample.step_seconds = Seconds(t0, Clock::now());
  std::erase_if(active_, [&](std::unique_ptr<Active>& a) {
    if (!a->done(s)) return false;
    Finish(*a);
    return true;
  });
  sample.seconds = Seconds(t0, Clock::now());
  sample.cpu_wait_seconds =
      RunQueueWaitSinceLastCall(opts_.schedstat_path.empty() ? nullptr
                                                             : opts_.schedstat_path.c_str())
          .value_or(-1);
  NotifyListener(listener_, sample);
}

StepEvent MarScheduler::Event(Active& a) {
  Job& j = *a.job;
  StepEvent ev;
  ev.request_id = j.id;
  ev.step = a.counters.nfe;
  ev.window = a.last_window;
  ev.positions = a.decided;  // continuous tokens: positions only, no ids
  ev.verified = a.counters.drafts_verified - j.verified;
  ev.accepted = a.counters.drafts_accepted - j.accepted;
  j.verified = a.counters.drafts_verified;
  j.accepted = a.counters.drafts_accepted;
  ev.verified_at_depth.resize(a.verified_at_depth.size());
  ev.accepted_at_depth.resize(a.accepted_at_depth.size());
  j.verified_at_depth.resize(a.verified_at_depth.size(), 0);
  j.accepted_at_depth.resize(a.accepted_at_depth.size(), 0);
  for (size_t d = 0; d < a.verified_at_depth.size(); ++d) {
    ev.verified_at_depth[d] = a.verified_at_depth[d] - j.verified_at_depth[d];
    ev.accepted_at_depth[d] = a.accepted_at_depth[d] - j.accepted_at_depth[d];
    j.verified_at_depth[d] = a.verified_at_depth[d];
    j.accepted_at_depth[d] = a.accepted_at_depth[d];
  }
  ev.totals = a.counters;
  ev.total_tokens = model_.mar->config().seq_len();
  return ev;
}

// The image so far (undecided tokens are zero latents), dimmed where undecided; all due
// previews in one decoder call. Best effort: on failure the events carry no preview.
void MarScheduler::AddPreviews(const std::vector<size_t>& due, std::vector<StepEvent>& events) {
  if (due.empty()) return;
  const MarConfig& cfg = model_.mar->config();
  const int64_t g = cfg.grid();
  std::vector<at::Tensor> grids;
  for (size_t i : due) grids.push_back(active_[i]->tokens);
  try {
    StatusOr<at::Tensor> pixels = LatentsToPixels(model_, at::stack(grids));
    if (!pixels.ok()) return;
    const at::Tensor px = *pixels;
    const int64_t h = px.size(1), w = px.size(2);
    for (size_t b = 0; b < due.size(); ++b) {
      Active& a = *active_[due[b]];
      at::Tensor one = px[static_cast<int64_t>(b)];
      at::Tensor pending = a.known.logical_not().view({g, g});
      pending = pending.repeat_interleave(h / g, 0).repeat_interleave(w / g, 1).unsqueeze(-1);
      one = at::where(pending, one.div(4, "floor").add(96), one);
      events[due[b]].preview = PixelsToImage(one);
      PreviewServed(*a.job, a.counters.nfe, events[due[b]].totals.tokens,
                    model_.mar->config().seq_len());
      a.job->last_preview = Clock::now();
    }
  } catch (const std::exception&) {
  }
}

// The result, then the image: decoded by the decode queue (on its thread, or now), which then
// completes the request.
void MarScheduler::Finish(Active& a) {
  used_ -= a.rows;
  Job& j = *a.job;
  const auto t_end = Clock::now();
  RequestResult res =
      FinishedResult(j, model_.name, model_.mar->config().grid(), a.counters, a.step_tokens,
                     a.verified_at_depth, a.accepted_at_depth, t_end);
  RequestStats& st = res.stats;
  st.mean_window = a.step_tokens.empty() ? 0
                                         : static_cast<double>(a.committed) /
                                               static_cast<double>(a.step_tokens.size());
  st.residual_fallbacks = a.fallbacks;
  st.residual_rounds = a.residual_rounds;
  st.draft_target_sq_dist = a.dist_n > 0 ? a.sq_dist / static_cast<double>(a.dist_n) : 0;
  DecodeQueue::ImageDecode decode;
  if (j.params.decode_image) {
    // The request's own latents (host memory), which nothing writes once it has finished.
    decode = [&m = model_, latents = a.tokens](const RequestResult&) -> StatusOr<Image> {
      ASSIGN_OR_RETURN(at::Tensor px, LatentsToPixels(m, latents.unsqueeze(0)));
      return PixelsToImage(px[0]);
    };
  }
  decoder_.Complete(j.observer, std::move(res), t_end, std::move(decode));
}

}  // namespace imagegen

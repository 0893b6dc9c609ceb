// imagegen-cspd-bench: continuous speculative decoding (seed 000) against the target alone, on
// a MAR model with a draft (the bundled fmnist-mar by default), side by side in one run through
// the serving engine.
//
// Speed: for each batch size (concurrent requests), `mar` at one token per step (the exact
// target of cspd: final-step noise) is run first and last (the spread of the two is the
// machine's noise), then cspd at every gamma x pre-fill x alignment; each row reports target
// forwards (NFE) and draft forwards per image, acceptance, wall time and the speedup over the
// first `mar` run. `mar` at the model's default iterations is reported too (fewer steps, many
// tokens each: the cheaper baseline the CSpD issue tracker asks about).
//
// Quality: --quality-images images per method (classes cycled) from two target-only runs with
// different seeds (the noise floor), cspd as the paper states it and cspd as the authors' code
// runs; class accuracy, Frechet distance to the test set, and between each set and the first
// target-only set: Frechet distance and a kernel two-sample test (MMD^2, RBF kernel at the
// median distance, permutation p-value), all in the bundled classifier's feature space.
//
//   imagegen-cspd-bench --batches 1,8 --gammas 4,8,16,32 --prefills 0,0.05,0.15 --csv out.csv
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>

#include "tests/build_paths.h"
#include "bench/common.h"
#include "engine/model/classifier.h"
#include "engine/scheduler/engine.h"
#include "tests/engine_client.h"

using namespace imagegen;
using testing::Recorder;

namespace {

struct Batch {
  double seconds = 0;
  std::vector<RequestResult> results;
};

Batch RunBatch(Engine& e, const std::string& model, const DecodingPolicy& policy, int64_t n,
               uint64_t seed0, int64_t classes) {
  std::vector<std::shared_ptr<Recorder>> recs;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    GenerateParams p;
    p.model = model;
    p.class_id = i % classes;
    p.seed = seed0 + static_cast<uint64_t>(i);
    p.policy = policy;
    auto rec = std::make_shared<Recorder>();
    OrDie(e.Submit(p, rec).status());
    recs.push_back(rec);
  }
  Batch b;
  for (auto& r : recs) {
    if (!r->Wait(std::chrono::seconds(36000)) || !r->result.has_value()) {
      std::fprintf(stderr, "request failed: %s\n",
                   r->error.has_value() ? r->error->ToString().c_str() : "timeout");
      std::exit(1);
    }
    b.results.push_back(*r->result);
  }
  b.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return b;
}

at::Tensor Images(const std::vector<RequestResult>& rs) {
  std::vector<at::Tensor> v;
  for (const auto& r : rs) {
    const Image& im = r.image;
    v.push_back(at::from_blob(const_cast<char*>(im.pixels.data()),
                              {im.height, im.width, im.channels}, at::kByte)
                    .clone());
  }
  return at::stack(v);
}

// MMD^2 (biased, RBF kernel with the median pairwise distance as bandwidth) between feature
// sets, and the fraction of `perms` permutations whose MMD^2 is at least as large. Both sets hold
// image i of class i % classes, so the permutations are stratified: labels are shuffled within
// each class (a free shuffle would also unbalance the classes between the two groups, inflate
// the null and give p near 1 whatever the sets).
std::pair<double, double> KernelTwoSample(const at::Tensor& a, const at::Tensor& b, int perms,
                                          int64_t classes, uint64_t seed) {
  const at::Tensor x = at::cat({a, b}).to(at::kDouble);
  const int64_t n = a.size(0), m = x.size(0);
  const at::Tensor d2 = at::cdist(x, x).pow(2);
  const double bw = d2.masked_select(d2 > 0).median().item<double>();
  const at::Tensor k = at::exp(-d2 / bw);
  auto mmd = [&](const std::vector<uint8_t>& group_a) {
    const at::Tensor mask =
        at::tensor(std::vector<int64_t>(group_a.begin(), group_a.end()), at::kLong).to(at::kDouble);
    const at::Tensor w = mask / n - (1 - mask) / (m - n);
    return at::matmul(w, at::matmul(k, w)).item<double>();
  };
  std::vector<uint8_t> labels(static_cast<size_t>(m), 0);
  for (int64_t i = 0; i < n; ++i) labels[static_cast<size_t>(i)] = 1;
  const double observed = mmd(labels);
  // The rows of each class, in both sets.
  std::vector<std::vector<int64_t>> by_class(static_cast<size_t>(classes));
  std::vector<size_t> in_a(static_cast<size_t>(classes), 0);  // group A's rows of each class
  for (int64_t i = 0; i < n; ++i) {
    by_class[static_cast<size_t>(i % classes)].push_back(i);
    in_a[static_cast<size_t>(i % classes)] += 1;
  }
  for (int64_t i = 0; i < m - n; ++i) by_class[static_cast<size_t>(i % classes)].push_back(n + i);
  std::mt19937_64 rng(seed);
  int at_least = 0;
  for (int p = 0; p < perms; ++p) {
    std::vector<uint8_t> perm(static_cast<size_t>(m), 0);
    for (size_t c = 0; c < by_class.size(); ++c) {
      std::shuffle(by_class[c].begin(), by_class[c].end(), rng);
      for (size_t i = 0; i < in_a[c]; ++i) perm[static_cast<size_t>(by_class[c][i])] = 1;
    }
    at_least += mmd(perm) >= observed ? 1 : 0;
  }
  return {observed, (at_least + 1.0) / (perms + 1.0)};
}

// cspd as the authors' code runs it (shared/docs/algorithms.md section 6), on top of `p`.
DecodingPolicy Authors(DecodingPolicy p) {
  p.cont.inner_temperature = 42;
  p.cont.invert_sigma = true;
  p.cont.residual_rounds = 100;
  p.cont.zero_fallback = true;
  p.cont.draft_mean = true;
  p.cont.verified_context = true;
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models", testing::TestModelsDir()},
           {"model", "fmnist-mar"},
           {"classifier", "fmnist-classifier"},
           {"batches", "1,8"},
           {"gammas", "4,8,16,32"},
           {"prefills", "0,0.05,0.15"},
           {"alignment", "on,off"},
           {"authors-gammas", "4,8,16,32"},
           {"images", "8"},
           {"quality-images", "0"},
           {"accuracy-images", "0"},
           {"perms", "500"},
           {"threads", "0"},
           {"csv", ""}},
          "imagegen-cspd-bench: cspd vs mar, speed and quality, side by side");
  EngineOptions o;
  o.models_dir = f.Str("models");
  o.models = {f.Str("model")};
  o.cpu_threads = f.Int("threads");
  o.max_slots = 1024;
  o.max_queue = 1 << 20;  // the quality runs submit all their requests at once
  auto engine = OrDie(Engine::Start(o));
  const ModelInfo& info = engine->Models().at(0);
  const int64_t s = info.grid * info.grid, classes = info.num_classes;
  std::FILE* csv = f.Str("csv").empty() ? nullptr : std::fopen(f.Str("csv").c_str(), "w");
  if (csv)
    std::fprintf(csv,
                 "batch,method,gamma,prefill,aligned,nfe,draft_forwards,acceptance,sq_dist,seconds,"
                 "speedup\n");

  DecodingPolicy target = OrDie(PolicyFromPreset("mar"));
  target.cont.num_iter = s;
  target.cont.final_noise = true;
  DecodingPolicy mar_default = OrDie(PolicyFromPreset("mar"));
  std::printf("%-5s %-22s %6s %7s %6s %8s %8s %6s %7s %9s %8s\n", "batch", "method", "gamma",
              "prefill", "align", "NFE/img", "draft/img", "accept", "dist", "seconds", "speedup");
  for (int64_t batch : f.Ints("batches")) {
    const int64_t n = std::max(batch, f.Int("images"));
    double base = 0;
    auto report = [&](const std::string& label, const DecodingPolicy& p, const Batch& b) {
      double nfe = 0, drafts = 0, ver = 0, acc = 0, dist = 0;
      for (const auto& r : b.results) {
        nfe += static_cast<double>(r.stats.counters.nfe);
        drafts += static_cast<double>(r.stats.counters.draft_forwards);
        ver += static_cast<double>(r.stats.counters.drafts_verified);
        acc += static_cast<double>(r.stats.counters.drafts_accepted);
        dist += r.stats.draft_target_sq_dist;
      }
      const double k = static_cast<double>(b.results.size());
      const bool spec = p.draft == DraftSource::kDraftModel;
      std::printf("%-5lld %-22s %6s %7s %6s %8.1f %8.1f %6.3f %7.3f %9.2f %8.2f\n",
                  static_cast<long long>(batch), label.c_str(),
                  spec ? std::to_string(p.window).c_str() : "-",
                  spec ? std::to_string(p.cont.prefill).substr(0, 4).c_str() : "-",
                  spec ? (p.cont.aligned ? "on" : "off") : "-", nfe / k, drafts / k,
                  ver > 0 ? acc / ver : 0.0, dist / k, b.seconds, base / b.seconds);
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%lld,%s,%lld,%g,%d,%g,%g,%g,%g,%g,%g\n", static_cast<long long>(batch),
                     label.c_str(), static_cast<long long>(spec ? p.window : 1),
                     spec ? p.cont.prefill : 0.0, spec && p.cont.aligned ? 1 : 0, nfe / k,
                     drafts / k, ver > 0 ? acc / ver : 0.0, dist / k, b.seconds, base / b.seconds);
        std::fflush(csv);
      }
    };
    // n images at `batch` concurrent requests: ceil(n / batch) rounds.
    auto run = [&](const DecodingPolicy& p) {
      Batch all;
      for (int64_t done = 0; done < n; done += batch) {
        Batch b = RunBatch(*engine, info.name, p, std::min(batch, n - done),
                           1000 + static_cast<uint64_t>(done), classes);
        all.seconds += b.seconds;
        for (auto& r : b.results) all.results.push_back(std::move(r));
      }
      return all;
    };
    const Batch first = run(target);
    base = first.seconds;
    report("mar (1 token/step)", target, first);
    report("mar (default iters)", mar_default, run(mar_default));
    for (int64_t g : f.Ints("gammas")) {
      for (const std::string& pf : f.List("prefills")) {
        for (const std::string& al : f.List("alignment")) {
          DecodingPolicy p = OrDie(PolicyFromPreset("cspd", g));
          p.cont.prefill = std::stod(pf);
          p.cont.aligned = al == "on";
          report("cspd", p, run(p));
        }
      }
    }
    // The authors' configuration, at their pre-fill (5%) with alignment.
    for (int64_t g : f.Ints("authors-gammas")) {
      DecodingPolicy p = OrDie(PolicyFromPreset("cspd", g));
      p.cont.prefill = 0.05;
      report("cspd (authors' code)", p, run(Authors(p)));
    }
    report("mar (1 token/step) again", target, run(target));
  }
  if (csv) std::fclose(csv);

  const int64_t q = f.Int("quality-images"), acc_n = f.Int("accuracy-images");
  if (q <= 0 && acc_n <= 0) return 0;
  auto clf = OrDie(Classifier::Load(f.Str("models") + "/" + f.Str("classifier"), {}));
  auto accuracy = [&](const at::Tensor& features) {
    const at::Tensor pred = clf->Logits(features).argmax(1);
    int64_t right = 0;
    for (int64_t i = 0; i < pred.size(0); ++i)
      right += pred[i].item<int64_t>() == i % classes ? 1 : 0;
    return static_cast<double>(right) / static_cast<double>(pred.size(0));
  };
  // The bundled target alone at the served defaults (the model's num_iter, cfg, temperature).
  if (acc_n > 0) {
    Batch b = RunBatch(*engine, info.name, mar_default, acc_n, 500000, classes);
    const at::Tensor feats = clf->Features(Images(b.results));
    const auto [mu, cov] = FeatureStats(feats);
    std::printf(
        "\ntarget alone (mar, served defaults), %lld images: accuracy %.3f, FD to the "
        "test set %.2f, %.1f s\n",
        static_cast<long long>(acc_n), accuracy(feats),
        FrechetDistance(mu, cov, clf->reference_mean(), clf->reference_cov()), b.seconds);
  }
  if (q <= 0) return 0;
  DecodingPolicy paper = OrDie(PolicyFromPreset("cspd"));
  const DecodingPolicy authors = Authors(paper);
  DecodingPolicy accept_all = paper;
  accept_all.cont.inner_temperature = 1e6;  // the largest allowed
  struct Set {
    std::string label;
    DecodingPolicy policy;
    uint64_t seed;
    at::Tensor features;
    double accuracy = 0, acceptance = 0, fallbacks = 0, seconds = 0;
  };
  std::vector<Set> sets = {{"mar (seeds A)", target, 100000, {}},
                           {"mar (seeds B)", target, 200000, {}},
                           {"cspd (paper)", paper, 300000, {}},
                           {"cspd (authors' code)", authors, 400000, {}},
                           // A control the comparison must catch: every draft accepted (an
                           // inner temperature so large the ratio is about 1): the draft's images.
                           {"control: accept all", accept_all, 500000, {}}};
  std::printf("\nquality: %lld images per method (classes cycled)\n", static_cast<long long>(q));
  std::printf("%-22s %8s %9s %12s %10s %10s %8s %10s %9s\n", "method", "accuracy", "FD test",
              "FD to A", "MMD^2", "MMD p", "accept", "fallbacks", "seconds");
  for (Set& st : sets) {
    Batch b = RunBatch(*engine, info.name, st.policy, q, st.seed, classes);
    const at::Tensor imgs = Images(b.results);
    st.features = clf->Features(imgs);
    st.accuracy = accuracy(st.features);
    double ver = 0, acc = 0;
    for (const auto& r : b.results) {
      ver += static_cast<double>(r.stats.counters.drafts_verified);
      acc += static_cast<double>(r.stats.counters.drafts_accepted);
      st.fallbacks += static_cast<double>(r.stats.residual_fallbacks);
    }
    st.acceptance = ver > 0 ? acc / ver : 0;
    st.seconds = b.seconds;
  }
  const auto [mu_a, cov_a] = FeatureStats(sets[0].features);
  for (Set& st : sets) {
    const auto [mu, cov] = FeatureStats(st.features);
    const double fd_test = FrechetDistance(mu, cov, clf->reference_mean(), clf->reference_cov());
    const double fd_a = FrechetDistance(mu, cov, mu_a, cov_a);
    const auto [mmd, p] = &st == &sets[0]
                              ? std::pair<double, double>{0, 1}
                              : KernelTwoSample(sets[0].features, st.features,
                                                static_cast<int>(f.Int("perms")), classes, 7);
    std::printf("%-22s %8.3f %9.2f %12.2f %10.5f %10.4f %8.3f %10.0f %9.1f\n", st.label.c_str(),
                st.accuracy, fd_test, fd_a, mmd, p, st.acceptance, st.fallbacks, st.seconds);
  }
  return 0;
}

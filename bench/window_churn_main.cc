// imagegen-window-churn: what a window that moves from step to step costs a Jacobi method
// (issue 15). The goodput controller re-plans every request's window each step; a Jacobi
// window cut short loses the drafts its tail was refining, and grown again it starts its new
// tail from random drafts. This bench grants windows directly (SpecBatch::Step's grants), so
// the cost of the movement is measured apart from any controller or cost model: for each
// method, the steps an image takes (NFE) and the tokens a step commits under
//   const:     the same window W every step;
//   alternate: W + S and W - S on alternate steps (requests out of phase), mean W;
//   random:    uniform in [W - S, W + S] each step and request, mean W;
// all with the same requests and seeds, in one run. `dwin` is the mean change of a request's
// granted window from one step to the next. With --keep-cut-drafts both ways (0,1), every
// schedule runs with the tail of a cut window dropped (0) and kept as stale drafts (1;
// SpecOptions::keep_cut_drafts). --forwards eager,static,graphs runs each under the ragged
// forward, the static-shape forward (what CUDA graphs replay; eager on the CPU) and CUDA graphs.
//
//   imagegen-window-churn --methods sjd,scd-mc,sjd-pac --windows 16,32 --swing 8
#include <cmath>
#include <cstdio>
#include <random>

#include "bench/common.h"
#include "engine/decoding/speculative.h"
#include "engine/model/image_model.h"

using namespace imagegen;

namespace {

struct Cell {
  double nfe = 0, window = 0, dwin = 0, tokens_per_step = 0;
};

Cell Run(const ImageModel& m, const std::vector<ImageRequest>& reqs, const std::string& schedule,
         int64_t W, int64_t S, bool keep, const std::string& forward, uint64_t seed) {
  SpecOptions o;
  o.batch_invariant = true;
  o.static_shapes = forward != "eager";
  o.cuda_graphs = forward == "graphs";
  o.keep_cut_drafts = keep;
  SpecBatch batch(*m.gpt, m.draft.get(), static_cast<int64_t>(2 * reqs.size()), o);
  std::vector<int64_t> h;
  for (const ImageRequest& r : reqs) h.push_back(OrDie(batch.Add(r)));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> swing(-S, S);
  std::vector<int64_t> last(h.size(), -1);
  double fed = 0, moves = 0, changes = 0;
  int64_t step = 0, req_steps = 0;
  while (batch.active() > 0) {
    std::vector<WindowGrant> grants;
    for (size_t i = 0; i < h.size(); ++i) {
      if (batch.done(h[i])) continue;
      int64_t w = W;
      if (schedule == "alternate") w = (step + static_cast<int64_t>(i)) % 2 == 0 ? W + S : W - S;
      if (schedule == "random") w = W + swing(rng);
      w = std::max<int64_t>(1, std::min(w, batch.WantedNodes(h[i])));
      grants.push_back({h[i], w});
      fed += static_cast<double>(w);
      if (last[i] >= 0) {
        moves += std::abs(static_cast<double>(w - last[i]));
        changes += 1;
      }
      last[i] = w;
      ++req_steps;
    }
    OrDie(batch.Step(grants));
    ++step;
  }
  Cell c;
  int64_t tokens = 0;
  for (int64_t x : h) {
    c.nfe += static_cast<double>(batch.stats(x).nfe);
    tokens += static_cast<int64_t>(batch.tokens(x).size());
  }
  c.nfe /= static_cast<double>(h.size());
  c.window = fed / static_cast<double>(req_steps);
  c.dwin = changes > 0 ? moves / changes : 0;
  c.tokens_per_step = static_cast<double>(tokens) / static_cast<double>(req_steps);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"methods", "sjd,scd-mc,sjd-pac"},
           {"windows", "16,32"},
           {"swing", "8"},
           {"schedules", "const,alternate,random"},
           {"keep-cut-drafts", "0,1"},
           {"forwards", "eager"},
           {"per-class", "3"},
           {"seed", "7000"},
           {"cfg", "default"},
           {"temperature", "default"},
           {"top-k", "default"},
           {"top-p", "default"},
           {"device", "cpu"},
           {"dtype", "auto"},
           {"csv", ""}},
          "usage: imagegen-window-churn [--methods sjd,scd-mc,sjd-pac] [--windows 16,32] "
          "[--swing S] [--schedules const,alternate,random] [--keep-cut-drafts 0,1] "
          "[--forwards eager,static,graphs] [--per-class N] [--device cuda] [--csv FILE]");
  const ImageModel model =
      OrDie(LoadImageModel(f.Str("models-dir"), f.Str("model"), LoadOptionsFromFlags(f)));
  const GptConfig& cfg = model.gpt->config();
  if (cfg.prompted()) f.Fail("model " + model.name + " is prompted: use a class model");
  const int64_t S = f.Int("swing");
  f.Choices("schedules", {"const", "alternate", "random"});  // checked before any model runs
  f.Choices("forwards", {"eager", "static", "graphs"});
  std::FILE* csv = nullptr;
  if (!f.Str("csv").empty()) {
    csv = std::fopen(f.Str("csv").c_str(), "w");
    if (csv == nullptr) f.Fail("cannot write --csv " + f.Str("csv"));
    std::fprintf(csv,
                 "method,window,swing,forward,schedule,keep_cut_drafts,images,nfe,mean_window,"
                 "mean_window_change,tokens_per_step,nfe_over_const\n");
  }
  std::printf("%-8s %4s %4s %-7s %-10s %4s %7s %7s %6s %8s %9s\n", "method", "W", "S", "forward",
              "schedule", "keep", "NFE", "window", "dwin", "tok/step", "NFE/const");
  for (const std::string& method : f.List("methods")) {
    for (int64_t W : f.Ints("windows")) {
      if (W - S < 1) f.Fail("--swing must be below every window");
      std::vector<ImageRequest> reqs;
      for (int64_t k = 0; k < f.Int("per-class"); ++k) {
        for (int64_t c = 0; c < cfg.num_classes; ++c) {
          ImageRequest r;
          r.class_id = c;
          r.seed = static_cast<uint64_t>(f.Int("seed") + k * cfg.num_classes + c);
          r.sampling = SamplingFromFlags(f, cfg);
          r.policy = OrDie(PolicyFromPreset(method, W + S));
          reqs.push_back(r);
        }
      }
      for (const std::string& forward : f.List("forwards")) {
        for (const std::string& keep_s : f.List("keep-cut-drafts")) {
          const bool keep = keep_s == "1";
          double base = 0;
          for (const std::string& schedule : f.List("schedules")) {
            const Cell c =
                Run(model, reqs, schedule, W, S, keep, forward, static_cast<uint64_t>(W));
            if (schedule == "const") base = c.nfe;
            const double ratio = base > 0 ? c.nfe / base : 0;
            std::printf("%-8s %4lld %4lld %-7s %-10s %4d %7.1f %7.1f %6.2f %8.2f %9.3f\n",
                        method.c_str(), static_cast<long long>(W), static_cast<long long>(S),
                        forward.c_str(), schedule.c_str(), keep ? 1 : 0, c.nfe, c.window, c.dwin,
                        c.tokens_per_step, ratio);
            std::fflush(stdout);
            if (csv != nullptr) {
              std::fprintf(csv, "%s,%lld,%lld,%s,%s,%d,%zu,%.3f,%.3f,%.3f,%.4f,%.4f\n",
                           method.c_str(), static_cast<long long>(W), static_cast<long long>(S),
                           forward.c_str(), schedule.c_str(), keep ? 1 : 0, reqs.size(), c.nfe,
                           c.window, c.dwin, c.tokens_per_step, ratio);
            }
          }
        }
      }
    }
  }
  if (csv != nullptr) std::fclose(csv);
  return 0;
}

// imagegen-spec-bench: every decoding preset on the bundled Fashion-MNIST model, side by side in
// one run. For each (method, window) it generates the same images (10 classes x --per-class
// seeds) at --batch requests per batch and reports NFE, step compression (image tokens / NFE),
// acceptance rate, accepted drafts per step, images/s and the latency ratio to AR measured in
// this run, class accuracy and Frechet distance from the bundled classifier. A second AR run
// with other seeds gives the noise of the quality measures. Writes results.csv, hist.csv
// (committed tokens per step), acceptance-map PNGs, and the plots (tools/plot_spec_bench.py).
// A text-to-image model draws from one prompt per class instead, its ids read from --prompts
// (a JSON list of {"class", "ids"}, as tools/train/train_t2i.py writes class_prompts.json; the
// bench has no tokenizer); class accuracy is then the prompt's class.
//
//   imagegen-spec-bench --per-class 20 --out-dir bench-out
//   imagegen-spec-bench --model fmnist-t2i --prompts models/fmnist-t2i/class_prompts.json
#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "tests/build_paths.h"
#include "bench/common.h"
#include "bench/kernel_profile.h"
#include "bench/op_profile.h"
#include "engine/decoding/speculative.h"
#include "engine/model/classifier.h"
#include "engine/model/image_model.h"
#include "engine/model/transfer.h"
#include "engine/util/json.h"
#include "engine/util/read_file.h"

using namespace imagegen;

namespace {

struct Config {
  std::string label;  // preset, or preset plus a variant
  DecodingPolicy policy;
  bool fused = true;     // SpecOptions::fused_verify
  int fused_probs = -1;  // SpecOptions::fused_probs
};

struct Row {
  Config cfg;
  int64_t images = 0;
  double nfe = 0, compression = 0, acceptance = 0, accepted_per_step = 0, draft_forwards = 0;
  double seconds = 0, images_per_s = 0, latency_ratio = 0, accuracy = 0, fd = 0, entropy = 0;
  StepTiming timing;      // with --split: the target forward vs the rest of each step
  StepTiming launches;    // with --split: the same split of device launches (one batch)
  KernelSummary kernels;  // with --kernel-profile: per step, on a run of its own
  int64_t kernel_steps = 0;
  std::map<int, int64_t> hist;  // committed tokens per step -> steps
};

// A viridis-like ramp through five anchors, t in [0, 1].
std::array<uint8_t, 3> Ramp(double t) {
  static const double k[5][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::clamp(t, 0.0, 1.0) * 4;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  std::array<uint8_t, 3> c{};
  for (int j = 0; j < 3; ++j) c[j] = static_cast<uint8_t>(k[i][j] + f * (k[i + 1][j] - k[i][j]));
  return c;
}

// The image (scaled) beside its token grid coloured by the step that committed each token.
void WriteAcceptanceMap(const VqDecoder& vq, const SpecResult& r, int64_t grid,
                        const std::string& path) {
  const int64_t cell = 16, side = grid * cell;
  at::Tensor img =
      ImageToUint8(OrDie(vq.Decode(at::tensor(r.tokens).to(at::kLong).unsqueeze(0))))[0];
  const int64_t h = img.size(0), w = img.size(1), c = img.size(2);
  at::Tensor canvas = at::full({side, 2 * side + cell, 3}, 255, at::kByte);
  auto cv = canvas.accessor<uint8_t, 3>();
  auto iv = img.accessor<uint8_t, 3>();
  for (int64_t y = 0; y < side; ++y) {
    for (int64_t x = 0; x < side; ++x) {
      const int64_t sy = y * h / side, sx = x * w / side;
      for (int64_t ch = 0; ch < 3; ++ch) cv[y][x][ch] = iv[sy][sx][c == 1 ? 0 : ch];
    }
  }
  const double last = std::max<int32_t>(1, r.stats.token_step.back());
  for (int64_t t = 0; t < grid * grid; ++t) {
    const auto col = Ramp(r.stats.token_step[t] / last);
    const int64_t y0 = (t / grid) * cell, x0 = side + cell + (t % grid) * cell;
    for (int64_t y = 1; y < cell; ++y) {
      for (int64_t x = 1; x < cell; ++x) {
        for (int ch = 0; ch < 3; ++ch) cv[y0 + y][x0 + x][ch] = col[ch];
      }
    }
  }
  OrDie(
      WriteFile(path, OrDie(EncodePng(canvas.data_ptr<uint8_t>(), static_cast<int>(canvas.size(1)),
                                      static_cast<int>(canvas.size(0)), 3))));
}

}  // namespace

int main(int argc, char** argv) {
  OpProfile::InstallIfRequested();
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"draft", "fmnist-draft"},
           {"prompts", ""},
           {"classifier", "fmnist-classifier"},
           {"per-class", "20"},
           {"seed", "1000"},
           {"noise-seed", "500000"},
           {"cfg", "default"},
           {"temperature", "default"},
           {"top-k", "default"},
           {"top-p", "default"},
           {"batch", "1"},
           {"windows", "16,32,64"},
           {"sd-windows", "4,8,16"},
           {"methods", "all"},
           {"split", "1"},
           {"kernel-profile", "0"},
           {"fused-verify", "1"},
           {"cuda-graphs", "0"},
           {"batch-invariant", "1"},
           {"noise-row", "1"},
           {"out-dir", "spec-bench"},
           {"python", testing::ConfiguredPython()},
           {"device", "cpu"},
           {"dtype", "auto"}},
          "usage: imagegen-spec-bench [--per-class N] [--batch B] [--windows 16,32,64] "
          "[--methods all|sjd,scd-mc,...] [--model M --draft D|'' --prompts F] [--split 0|1] "
          "[--kernel-profile BATCHES] "
          "[--fused-verify 1|0|both|all] [--cuda-graphs 0|1] [--batch-invariant 1|0] "
          "[--noise-row 1|0] [--out-dir DIR] [--device cpu|cuda|cuda:N]");
  const LoadOptions opts = LoadOptionsFromFlags(f);
  ImageModel model = OrDie(LoadImageModel(f.Str("models-dir"), f.Str("model"), opts));
  // --draft "": no draft model (the sd rows are left out).
  std::unique_ptr<Gpt> draft;
  if (!f.Str("draft").empty())
    draft = OrDie(Gpt::Load(f.Str("models-dir") + "/" + f.Str("draft"), opts));
  auto clf = OrDie(Classifier::Load(f.Str("models-dir") + "/" + f.Str("classifier"), opts));
  const GptConfig& gc = model.gpt->config();
  // Prompted models: class k draws from prompts[k] (the prompt's class labels accuracy).
  std::vector<std::vector<int64_t>> prompts;
  if (gc.prompted()) {
    if (f.Str("prompts").empty()) f.Fail("model " + model.name + " is prompted: give --prompts");
    const Json j = OrDie(ParseJson(OrDie(ReadFile(f.Str("prompts")))));
    if (!j.is_array() || j.empty()) f.Fail("--prompts: expected a non-empty JSON list");
    for (const Json& e : j) {
      const auto k = e.at("class").get<size_t>();
      if (k != prompts.size()) f.Fail("--prompts: entries must be classes 0, 1, ... in order");
      prompts.push_back(e.at("ids").get<std::vector<int64_t>>());
    }
  }
  const int64_t classes = gc.prompted() ? static_cast<int64_t>(prompts.size()) : gc.num_classes;
  auto condition = [&](ImageRequest& r, int64_t c) {
    r.class_id = c;
    if (gc.prompted()) r.prompt = prompts[static_cast<size_t>(c)];
  };
  const int64_t per_class = f.Int("per-class"), batch = f.Int("batch");
  if (per_class < 1 || batch < 1) f.Fail("--per-class and --batch must be positive");
  const std::string out = f.Str("out-dir");
  if (std::error_code ec; !std::filesystem::create_directories(out, ec) && ec) {
    f.Fail("cannot create --out-dir " + out + ": " + ec.message());
  }

  auto want = [&](const std::string& m) {
    if (f.Str("methods") == "all") return true;
    return ("," + f.Str("methods") + ",").find("," + m + ",") != std::string::npos;
  };
  std::vector<Config> configs;
  auto add = [&](const std::string& preset, int64_t L, const std::string& label) {
    DecodingPolicy p = OrDie(PolicyFromPreset(preset, L));
    if (!ValidatePolicy(p, gc.block_size, true).ok()) return;
    configs.push_back({label.empty() ? preset : label, p});
    return;
  };
  add("ar", 1, "");
  if (want("ar-gm")) add("ar-gm", 1, "");  // the match rule's AR (scd-gm draws its images)
  for (int64_t L : f.Ints("windows")) {
    for (const char* m :
         {"sjd", "scd-mc", "scd-gs", "scd-gm", "sjd-pac", "pac-gumbel", "gsd", "cool-sjd"}) {
      if (want(m)) add(m, L, "");
    }
  }
  for (int64_t L : f.Ints("sd-windows")) {
    for (const char* m : {"sd", "cool-sd"}) {
      if (want(m) && draft) add(m, L, "");
    }
  }
  if (want("sjd-pac")) {  // ablation: adaptive continuation with PAC's uniform q, no tree
    for (int64_t L : f.Ints("windows")) {
      add("scd-mc", L, "ac-uniform-q");
      configs.back().policy.uniform_init_q = true;
    }
  }
  if (want("gsd")) {  // the paper's G sweep (seed 004 Table 1), at the authors' L = 16
    for (int64_t G : {3, 50}) {
      add("gsd", 16, "gsd-G" + std::to_string(G));
      configs.back().policy.gsd_group = G;
    }
  }
  // Same count, other seeds: the noise of accuracy and FD (--noise-row 0 leaves it out).
  if (f.Int("noise-row") != 0) add("ar", 1, "ar-noise");

  auto requests = [&](const DecodingPolicy& p, int64_t seed0) {
    std::vector<ImageRequest> all;
    for (int64_t c = 0; c < classes; ++c) {
      for (int64_t i = 0; i < per_class; ++i) {
        ImageRequest r;
        condition(r, c);
        r.seed = static_cast<uint64_t>(seed0 + c * per_class + i);
        r.sampling = SamplingFromFlags(f, gc);
        r.policy = p;
        all.push_back(r);
      }
    }
    return all;
  };

  {  // warm-up (allocator, thread pools) so that the first timed row is not penalised
    auto w = requests(configs[0].policy, 7);
    w.resize(2);
    OrDie(GenerateSpeculative(*model.gpt, draft.get(), w));
  }
  // --fused-verify both: every row twice, fused then eager ("+eager"), side by side; all: also
  // the fused verification with the eager final distributions between them ("+eager-probs";
  // on the CPU, whose default is the eager distributions, the same as the fused row).
  const std::string fv = f.Str("fused-verify");
  if (fv != "0" && fv != "1" && fv != "both" && fv != "all") {
    f.Fail("--fused-verify: 1, 0, both or all");
  }
  if (fv == "0") {
    for (Config& c : configs) c.fused = false;
  } else if (fv == "both" || fv == "all") {
    std::vector<Config> both;
    for (const Config& c : configs) {
      both.push_back(c);
      if (fv == "all") {
        both.push_back(c);
        both.back().fused_probs = 0;
        both.back().label += "+eager-probs";
      }
      both.push_back(c);
      both.back().fused = false;
      both.back().label += "+eager";
    }
    configs = both;
  }
  std::vector<Row> rows;
  double ar_seconds = 0;
  for (const Config& cfg : configs) {
    const bool noise = cfg.label.rfind("ar-noise", 0) == 0;
    auto all = requests(cfg.policy, noise ? f.Int("noise-seed") : f.Int("seed"));
    SpecOptions so;
    so.collect_entropy = cfg.policy.draft == DraftSource::kNone;
    so.fused_verify = cfg.fused;
    so.fused_probs = cfg.fused_probs;
    // Static-shape forwards captured as CUDA graphs (EngineOptions::cuda_graphs); on the CPU the
    // static forward runs eagerly.
    so.static_shapes = so.cuda_graphs = f.Int("cuda-graphs") != 0;
    // The daemon's forward (EngineOptions::batch_invariant, on by default), with the CPU's
    // few-row kernels (row attention, the few-row GEMM, RMSNorm and rotary as one kernel each):
    // the served step, which at batch 1 on the CPU is the faster one. 0: one padded attention
    // call for the whole batch (offline sampling of many rows at once).
    so.batch_invariant = f.Int("batch-invariant") != 0;
    Row row;
    row.cfg = cfg;
    if (f.Int("split") != 0) so.timing = &row.timing;
    std::vector<at::Tensor> feats;
    std::vector<int64_t> labels;
    int64_t nfe = 0, verified = 0, accepted = 0, dfw = 0;
    double ent = 0;
    int64_t ent_n = 0;
    for (size_t b = 0; b < all.size(); b += batch) {
      std::vector<ImageRequest> chunk(all.begin() + b,
                                      all.begin() + std::min(all.size(), b + batch));
      const auto t0 = std::chrono::steady_clock::now();
      auto res = OrDie(GenerateSpeculative(*model.gpt, draft.get(), chunk, so));
      row.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::vector<at::Tensor> ids;
      for (size_t i = 0; i < res.size(); ++i) {
        const SpecStats& s = res[i].stats;
        nfe += s.nfe;
        verified += s.drafts_verified;
        accepted += s.drafts_accepted;
        dfw += s.draft_forwards;
        ent += s.entropy_sum;
        ent_n += s.entropy_count;
        for (int32_t k : s.step_tokens) row.hist[k]++;
        ids.push_back(at::tensor(res[i].tokens).to(at::kLong));
        labels.push_back(chunk[i].class_id);
      }
      feats.push_back(clf->Features(ImageToUint8(OrDie(model.vq->Decode(at::stack(ids))))));
    }
    if (f.Int("split") != 0) {
      // Device launches per step, counted on a run of its own (the counting callback would slow
      // the timed one): the first batch again.
      std::vector<ImageRequest> chunk(
          all.begin(), all.begin() + std::min(all.size(), static_cast<size_t>(batch)));
      SpecOptions counted = so;
      counted.timing = &row.launches;
      LaunchCount count;
      OrDie(GenerateSpeculative(*model.gpt, draft.get(), chunk, counted));
    }
    if (f.Int("kernel-profile") > 0) {
      // Where a step's device time goes (bench/kernel_profile.h), on a run of its own without
      // the split's syncs: the first --kernel-profile batches again, per step.
      SpecOptions profiled = so;
      profiled.timing = nullptr;
      const size_t n = std::min(all.size(), static_cast<size_t>(batch * f.Int("kernel-profile")));
      SynchronizeDevice(opts.device);
      KernelProfile prof(opts.device);
      int64_t steps = 0;
      for (size_t b = 0; b < n; b += batch) {
        std::vector<ImageRequest> chunk(all.begin() + b, all.begin() + std::min(n, b + batch));
        auto res = OrDie(GenerateSpeculative(*model.gpt, draft.get(), chunk, profiled));
        int64_t most = 0;  // the batch steps together until its last image is done
        for (const auto& r : res) most = std::max(most, r.stats.nfe);
        steps += most;
      }
      SynchronizeDevice(opts.device);
      row.kernel_steps = steps;
      row.kernels = prof.Stop(steps);
    }
    row.images = static_cast<int64_t>(all.size());
    row.nfe = static_cast<double>(nfe) / row.images;
    row.compression = gc.block_size / row.nfe;
    row.acceptance = verified ? static_cast<double>(accepted) / verified : 0;
    row.accepted_per_step = static_cast<double>(accepted) / nfe;
    row.draft_forwards = static_cast<double>(dfw) / row.images;
    row.images_per_s = row.images / row.seconds;
    if (cfg.label == "ar") ar_seconds = row.seconds;
    row.latency_ratio = ar_seconds > 0 ? ar_seconds / row.seconds : 0;
    at::Tensor feat = at::cat(feats);
    row.accuracy =
        (clf->Logits(feat).argmax(1) == at::tensor(labels)).to(at::kDouble).mean().item<double>();
    auto [mu, cov] = FeatureStats(feat);
    row.fd = FrechetDistance(mu, cov, clf->reference_mean(), clf->reference_cov());
    row.entropy = ent_n ? ent / ent_n : std::nan("");
    std::fprintf(stderr, "%-12s L=%-3lld NFE %6.1f compression %5.2f accept %.3f  %.1f s\n",
                 cfg.label.c_str(), static_cast<long long>(cfg.policy.window), row.nfe,
                 row.compression, row.acceptance, row.seconds);
    rows.push_back(row);
  }

  const SamplingParams sp = SamplingFromFlags(f, gc);
  std::printf(
      "imagegen-spec-bench: model %s, %lld images per row (%lld per class), batch %lld, "
      "device %s, %s forward, cfg %.2f top-k %lld top-p %.2f temperature %.2f\n",
      model.name.c_str(), static_cast<long long>(rows[0].images), static_cast<long long>(per_class),
      static_cast<long long>(batch), f.Str("device").c_str(),
      f.Int("cuda-graphs") != 0       ? "static-shape"
      : f.Int("batch-invariant") != 0 ? "batch-invariant"
                                      : "padded",
      sp.cfg_scale, static_cast<long long>(sp.top_k), sp.top_p, sp.temperature);
  std::printf("mean entropy of p at AR-sampled tokens: %.3f nats (uniform over %lld ids: %.3f)\n",
              rows[0].entropy, static_cast<long long>(gc.vocab_size),
              std::log(static_cast<double>(gc.vocab_size)));
  if (f.Int("split") != 0) {
    std::printf(
        "step split (--split 1): fwd = the target forward, other = the rest of the step (draft "
        "forwards apart), per step in ms; on CUDA timing adds up to three device syncs per step; "
        "fwd.ln, other.ln = device launches per step (ATen calls that would launch a kernel, "
        "LaunchCount, one batch counted apart)\n");
  }
  std::printf("%-12s %4s %7s %6s %7s %7s %7s %8s %8s %7s %7s %8s %8s %6s %7s %8s\n", "method", "L",
              "NFE", "compr", "accept", "acc/st", "dfwd", "img/s", "lat.x", "cls.acc", "FD",
              "fwd.ms", "other.ms", "other%", "fwd.ln", "other.ln");
  std::ofstream csv(out + "/results.csv");
  csv << "method,window,policy,images,nfe,step_compression,acceptance_rate,accepted_per_step,"
         "draft_forwards,seconds,images_per_s,latency_ratio_vs_ar,class_accuracy,frechet,entropy,"
         "steps_timed,forward_ms_per_step,draft_ms_per_step,other_ms_per_step,other_share,"
         "forward_launches_per_step,draft_launches_per_step,other_launches_per_step\n";
  std::ofstream hist(out + "/hist.csv");
  hist << "method,window,tokens_per_step,steps\n";
  for (const Row& r : rows) {
    const StepTiming& t = r.timing;
    const double n = t.steps > 0 ? static_cast<double>(t.steps) : std::nan("");
    const double fwd = 1e3 * t.forward_seconds / n, drf = 1e3 * t.draft_seconds / n;
    const double other = 1e3 * t.step_seconds / n - fwd - drf;
    const double share = other / (1e3 * t.step_seconds / n);
    const StepTiming& l = r.launches;
    const double ln = l.steps > 0 ? static_cast<double>(l.steps) : std::nan("");
    const double fwd_ln = static_cast<double>(l.forward_launches) / ln;
    const double drf_ln = static_cast<double>(l.draft_launches) / ln;
    const double other_ln =
        static_cast<double>(l.step_launches - l.forward_launches - l.draft_launches) / ln;
    std::printf(
        "%-12s %4lld %7.1f %6.2f %7.3f %7.2f %7.1f %8.2f %8.2f %7.3f %7.2f %8.3f %8.3f %5.1f%% "
        "%7.1f %8.1f\n",
        r.cfg.label.c_str(), static_cast<long long>(r.cfg.policy.window), r.nfe, r.compression,
        r.acceptance, r.accepted_per_step, r.draft_forwards, r.images_per_s, r.latency_ratio,
        r.accuracy, r.fd, fwd, other, 100 * share, fwd_ln, other_ln);
    csv << r.cfg.label << "," << r.cfg.policy.window << ",\"" << DescribePolicy(r.cfg.policy)
        << "\"," << r.images << "," << r.nfe << "," << r.compression << "," << r.acceptance << ","
        << r.accepted_per_step << "," << r.draft_forwards << "," << r.seconds << ","
        << r.images_per_s << "," << r.latency_ratio << "," << r.accuracy << "," << r.fd << ","
        << r.entropy << "," << t.steps << "," << fwd << "," << drf << "," << other << "," << share
        << "," << fwd_ln << "," << drf_ln << "," << other_ln << "\n";
    for (const auto& [k, n] : r.hist) {
      hist << r.cfg.label << "," << r.cfg.policy.window << "," << k << "," << n << "\n";
    }
  }
  csv.close();
  hist.close();
  if (f.Int("kernel-profile") > 0) {
    std::printf(
        "kernel profile (--kernel-profile %lld: that many batches again, profiled, without the "
        "split's syncs), per step; busy = the union of the device's kernels and copies, span = "
        "first start to last end, so busy / span is how busy the device was:\n",
        static_cast<long long>(f.Int("kernel-profile")));
    std::ofstream kcsv(out + "/kernels.csv");
    kcsv << "method,window,steps," << KernelSummary::CsvHeader() << "\n";  // per step
    for (const Row& r : rows) {
      const KernelSummary& k = r.kernels;
      PrintKernelSummary(k, 8,
                         (r.cfg.label + " " + std::to_string(r.cfg.policy.window) + " ").c_str());
      kcsv << r.cfg.label << "," << r.cfg.policy.window << "," << r.kernel_steps << ","
           << k.CsvFields() << "\n";
    }
  }

  // Acceptance maps of one image (class 7, the first seed) for three methods.
  for (const auto& [preset, L] :
       {std::pair<const char*, int64_t>{"sjd", 32}, {"scd-mc", 32}, {"sjd-pac", 64}}) {
    ImageRequest r;
    condition(r, 7 % classes);
    r.seed = static_cast<uint64_t>(f.Int("seed"));
    r.sampling = sp;
    r.policy = OrDie(PolicyFromPreset(preset, L));
    auto res = OrDie(GenerateSpeculative(*model.gpt, draft.get(), {r}));
    const std::string path = out + "/acceptance_map_" + preset + "_L" + std::to_string(L) + ".png";
    WriteAcceptanceMap(*model.vq, res[0], gc.grid(), path);
    std::printf(
        "acceptance map %s: %lld steps (colour = step that committed the token, dark "
        "early, yellow late)\n",
        path.c_str(), static_cast<long long>(res[0].stats.nfe));
  }
  const std::string plot =
      f.Str("python") + " '" + testing::SourceDir() + "/tools/plot_spec_bench.py' '" + out + "'";
  if (std::system(plot.c_str()) != 0) {
    std::printf("plots not written (needs matplotlib): %s\n", plot.c_str());
  }
  return 0;
}

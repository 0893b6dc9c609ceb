// imagegen-step-cost: the cost of one target forward as a function of the tokens it carries and
// of how many requests they are spread over (issue 14's step-cost curve). For each model shape
// (the bundled model, or random LlamaGen GPT-B/L/XL shapes), dtype, request count r and tokens
// per step t (t / r new tokens per request, on top of a committed prefix, two rows per request
// with CFG), it times the forward (median of --reps, the device synchronised around each) and
// reports milliseconds, tokens/s, and the time relative to one token for one request. With
// --hbm-gbps it also gives the weight-read limit of a step (weights / bandwidth) and the ratio
// of the 1-request, 1-token step to it. With --kernel-profile N it also runs N more forwards of
// each cell under LibTorch's profiler and prints where their device time went, kernel by kernel
// (bench/kernel_profile.h; on the CPU, ATen op by op). The "bundled" shape is --model in
// --models-dir (fmnist-gpt; a twin from tools/grow_model.py, say).
//
//   imagegen-step-cost --device cuda --shapes bundled,gpt-b,gpt-l,gpt-xl --dtypes bf16,fp32
//       --hbm-gbps 3350 --csv step_cost.csv   (one line)
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>

#include "bench/common.h"  // flags, OrDie (header-only: no libpng needed)
#include "bench/kernel_profile.h"
#include "bench/op_profile.h"
#include "engine/model/device.h"
#include "engine/model/gpt.h"
#include "engine/model/models_dir.h"
#include "engine/model/small_gemm.h"
#include "engine/model/transfer.h"

using namespace imagegen;

namespace {

// LlamaGen's c2i shapes (gpt.py GPT_B/L/XL: dim, layers, heads), 1000 classes, VQ-16 vocab.
bool Shape(const std::string& name, int64_t grid, GptConfig* c) {
  struct S {
    const char* name;
    int64_t dim, layers, heads;
  };
  static const S kShapes[] = {{"gpt-b", 768, 12, 12},
                              {"gpt-l", 1024, 24, 16},
                              {"gpt-xl", 1280, 36, 20},
                              {"tiny", 64, 2, 2},
                              // the bundled model's width and depth with heads of 12, and a
                              // small model with heads of 4: RowAttention's path for sizes that
                              // are not multiples of 8. The forward takes it for heads under 8
                              // only (RowAttentionTakes), so on hd12 eager is eager-sdpa.
                              {"hd12", 192, 6, 16},
                              {"hd4", 64, 2, 16}};
  for (const S& s : kShapes) {
    if (name != s.name) continue;
    *c = GptConfig();
    c->dim = s.dim;
    c->n_layer = s.layers;
    c->n_head = s.heads;
    c->vocab_size = 16384;
    c->num_classes = 1000;
    c->block_size = grid * grid;
    return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  OpProfile::InstallIfRequested();
  Flags f(
      argc, argv,
      {{"models-dir", DefaultModelsDir()},
       {"model", "fmnist-gpt"},
       {"shapes", "bundled"},
       {"grid", "16"},
       {"dtypes", "fp32"},
       {"device", "cpu"},
       {"requests", "1,2,4,8,16,32,64"},
       {"tokens", "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"},
       {"prefix", "-1"},
       {"reps", "10"},
       {"batch-invariant", "1"},
       {"forwards", "eager"},
       {"hbm-gbps", "0"},
       {"kernel-profile", "0"},
       {"kernel-top", "12"},
       {"csv", ""}},
      "usage: imagegen-step-cost [--shapes bundled,gpt-b,gpt-l,gpt-xl,tiny,hd12,hd4] [--model "
      "M (the bundled shape's)] [--dtypes bf16,fp32] [--device cuda] [--requests 1,2,..] "
      "[--tokens 1,2,..] [--forwards eager,eager-sdpa,eager-pad,eager-tile,eager-wide,eager-engine,"
      "eager-ops,eager-bf16mm,static,graphs,static-ref,graphs-ref,static-rope,graphs-rope] "
      "[--kernel-profile N] "
      "[--csv FILE]");
  std::ofstream csv;
  if (!f.Str("csv").empty()) {
    csv.open(f.Str("csv"));
    if (!csv) f.Fail("cannot write --csv " + f.Str("csv"));
    csv << "shape,dtype,device,params_bytes,requests,rows,tokens_per_step,tokens_per_request,"
           "committed_prefix,median_ms,tokens_per_s,ratio_to_one_token,weight_read_ms,forward,"
           "launches,"
        << KernelSummary::CsvHeader() << "\n";
  }
  const double gbps = std::stod(f.Str("hbm-gbps"));
  const int64_t profile_reps = f.Int("kernel-profile");
  if (profile_reps < 0) f.Fail("--kernel-profile must be >= 0");
  const bool invariant = f.Int("batch-invariant") != 0;
  // eager: the ragged forward (batch-invariant unless --batch-invariant 0); static: the
  // static-shape forward; graphs: the static forward through CUDA graphs (one capture per
  // bucket in the warm-up repetitions, replays after). Both with the fused layer
  // (LoadOptions::fused_static_forward, forced on here, on the CPU too); static-ref and
  // graphs-ref: the same with the reference layer (a second copy of the model); static-rope and
  // graphs-rope: the fused layer with the rotary scatter (LoadOptions::rope_scatter, a third);
  // eager-sdpa: the eager forward with one SDPA call per row group instead of RowAttention
  // (LoadOptions::row_attention off, a fourth; the same as eager where RowAttention does not
  // run: off the CPU, in bf16, or with --batch-invariant 0); eager-pad: the eager forward with
  // the linear layers of fewer than 16 rows padded to 16 for the BLAS instead of
  // SmallRowsLinear's kernel (LoadOptions::small_rows_gemm off, a fifth; the same logits);
  // eager-tile: the kernel on fewer than 16 rows only, the BLAS on more (LoadOptions::
  // small_rows_gemm_rows -1, an eighth; eager's kernel takes the rows it was timed faster on
  // at load; the same logits); eager-wide: the kernel on every row count up to the most
  // Prepare times (LoadOptions::small_rows_gemm_rows kSmallRowsMeasuredMax, a ninth; the same
  // logits);
  // eager-engine: the kernel on every row count, never the BLAS (LoadOptions::engine_linear, a
  // tenth; other logits);
  // eager-ops: the eager forward with RMSNorm and the rotary embedding as ATen ops instead of
  // one kernel each (LoadOptions::fused_norm_rope off, a sixth; the same logits); eager-bf16mm:
  // the eager forward with every linear layer in bf16 on the AMX tiles (LoadOptions::
  // bf16_matmul, the engine's matmul precision "medium"; a seventh; other logits).
  bool any_ref = false, any_rope = false, any_sdpa = false, any_pad = false, any_ops = false;
  bool any_bf16mm = false, any_tile = false, any_wide = false, any_engine = false;
  for (const std::string& fw :
       f.Choices("forwards", {"eager", "eager-sdpa", "eager-pad", "eager-tile", "eager-wide",
                              "eager-engine", "eager-ops", "eager-bf16mm", "static", "graphs",
                              "static-ref", "graphs-ref", "static-rope", "graphs-rope"})) {
    any_tile |= fw == "eager-tile";
    any_wide |= fw == "eager-wide";
    any_engine |= fw == "eager-engine";
    any_ref |= fw == "static-ref" || fw == "graphs-ref";
    any_rope |= fw == "static-rope" || fw == "graphs-rope";
    any_sdpa |= fw == "eager-sdpa";
    any_pad |= fw == "eager-pad";
    any_ops |= fw == "eager-ops";
    any_bf16mm |= fw == "eager-bf16mm";
  }
  for (const std::string& dtype : f.List("dtypes")) {
    auto lo = ParseDeviceAndDtype(f.Str("device"), dtype);
    if (!lo.ok()) f.Fail(lo.status().message());
    for (const std::string& shape : f.List("shapes")) {
      // The fused layer, no rotary scatter and every CPU kernel on, as `adjust` changes them.
      auto load = [&](const std::function<void(LoadOptions&)>& adjust) {
        LoadOptions o = *lo;
        o.fused_static_forward = true;
        o.rope_scatter = false;
        o.row_attention = true;
        o.small_rows_gemm = true;
        o.fused_norm_rope = true;
        adjust(o);
        if (shape == "bundled")
          return OrDie(Gpt::Load(f.Str("models-dir") + "/" + f.Str("model"), o));
        GptConfig c;
        if (!Shape(shape, f.Int("grid"), &c)) f.Fail("unknown shape " + shape);
        return Gpt::Random(c, o, 7);  // the same weights for both layers
      };
      std::unique_ptr<Gpt> fused_gpt = load([](LoadOptions&) {});
      std::unique_ptr<Gpt> ref_gpt =
          any_ref ? load([](LoadOptions& o) { o.fused_static_forward = false; }) : nullptr;
      std::unique_ptr<Gpt> rope_gpt =
          any_rope ? load([](LoadOptions& o) { o.rope_scatter = true; }) : nullptr;
      std::unique_ptr<Gpt> sdpa_gpt =
          any_sdpa ? load([](LoadOptions& o) { o.row_attention = false; }) : nullptr;
      std::unique_ptr<Gpt> pad_gpt =
          any_pad ? load([](LoadOptions& o) { o.small_rows_gemm = false; }) : nullptr;
      std::unique_ptr<Gpt> tile_gpt =
          any_tile ? load([](LoadOptions& o) { o.small_rows_gemm_rows = -1; }) : nullptr;
      std::unique_ptr<Gpt> wide_gpt =
          any_wide ? load([](LoadOptions& o) { o.small_rows_gemm_rows = kSmallRowsMeasuredMax; })
                   : nullptr;
      std::unique_ptr<Gpt> engine_gpt =
          any_engine ? load([](LoadOptions& o) { o.engine_linear = true; }) : nullptr;
      if (engine_gpt != nullptr && !engine_gpt->engine_linear()) {
        f.Fail("--forwards eager-engine: the kernel does not run for " + shape + " in " + dtype +
               " here (fp32 on an x86-64 CPU with AVX2 and FMA only)");
      }
      std::unique_ptr<Gpt> ops_gpt =
          any_ops ? load([](LoadOptions& o) { o.fused_norm_rope = false; }) : nullptr;
      std::unique_ptr<Gpt> bf16mm_gpt =
          any_bf16mm ? load([](LoadOptions& o) { o.bf16_matmul = true; }) : nullptr;
      if (bf16mm_gpt != nullptr && bf16mm_gpt->bf16_matmul_linears() == 0) {
        f.Fail("--forwards eager-bf16mm: no bf16 products for " + shape + " in " + dtype +
               " here (" +
               (AmxBf16Linear::Supported() ? std::string("not fp32 on the CPU")
                                           : AmxBf16Linear::Unsupported()) +
               ")");
      }
      if (rope_gpt != nullptr && !rope_gpt->rope_scatter()) {
        f.Fail("--forwards *-rope: no rotary scatter for " + shape + " in " + dtype +
               " here (a Janus-layout model, another dtype, or no kernel in this build)");
      }
      const Gpt* gpt = fused_gpt.get();
      const GptConfig& cfg = gpt->config();
      // The bundled shape under another --model is named by the model.
      const std::string label =
          shape == "bundled" && f.Str("model") != "fmnist-gpt" ? f.Str("model") : shape;
      const double weight_ms = gbps > 0 ? gpt->weight_bytes() / (gbps * 1e9) * 1e3 : 0;
      std::printf(
          "\n%s %s on %s: dim %lld, %lld layers, %lld image tokens, weights %.1f MB%s\n",
          label.c_str(), dtype.c_str(), f.Str("device").c_str(), static_cast<long long>(cfg.dim),
          static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.block_size),
          gpt->weight_bytes() / 1e6,
          gbps > 0 ? (", weight-read limit " + std::to_string(weight_ms) + " ms").c_str() : "");
      if (gpt->small_rows_linears() > 0) {
        std::printf("few-row kernel on %lld of %lld linear layers, up to %lld-%lld rows%s\n",
                    static_cast<long long>(gpt->small_rows_linears()),
                    static_cast<long long>(gpt->small_rows_tried()),
                    static_cast<long long>(gpt->small_rows_min()),
                    static_cast<long long>(gpt->small_rows_max()),
                    tile_gpt != nullptr ? (" (eager-tile: up to " +
                                           std::to_string(tile_gpt->small_rows_max()) + ")")
                                              .c_str()
                                        : "");
      }
      std::printf("%8s %6s %8s %8s %10s %12s %8s %8s\n", "requests", "rows", "tokens", "tok/req",
                  "median ms", "tokens/s", "x 1 tok", "launches");
      for (const std::string& fw : f.List("forwards")) {
        const bool ref = fw == "static-ref" || fw == "graphs-ref";
        const bool rope = fw == "static-rope" || fw == "graphs-rope";
        gpt = ref                    ? ref_gpt.get()
              : rope                 ? rope_gpt.get()
              : fw == "eager-sdpa"   ? sdpa_gpt.get()
              : fw == "eager-pad"    ? pad_gpt.get()
              : fw == "eager-tile"   ? tile_gpt.get()
              : fw == "eager-wide"   ? wide_gpt.get()
              : fw == "eager-engine" ? engine_gpt.get()
              : fw == "eager-ops"    ? ops_gpt.get()
              : fw == "eager-bf16mm" ? bf16mm_gpt.get()
                                     : fused_gpt.get();
        const bool eager = fw.rfind("eager", 0) == 0;
        const ForwardOptions fo{invariant, !eager, fw.rfind("graphs", 0) == 0};
        if (f.List("forwards").size() > 1) std::printf("forward: %s\n", fw.c_str());
        double one_token_ms = 0;
        for (int64_t r : f.Ints("requests")) {
          const int64_t rows = 2 * r;  // CFG: conditional and unconditional
          KvCache cache = gpt->NewCache(rows, 0, !eager);
          for (int64_t t : f.Ints("tokens")) {
            if (t < r || t % r != 0) continue;
            const int64_t n = t / r;
            if (n > cfg.block_size) continue;
            int64_t prefix = f.Int("prefix") < 0 ? cfg.block_size / 2 : f.Int("prefix");
            prefix = std::max<int64_t>(1, std::min(prefix, cfg.seq_len() - n));
            std::vector<BatchRow> step(static_cast<size_t>(rows));
            for (int64_t i = 0; i < rows; ++i) {
              BatchRow& b = step[static_cast<size_t>(i)];
              b.slot = i;
              b.cache_len = prefix;  // the cache's content does not matter for timing
              b.group = i / 2;
              for (int64_t k = 0; k < n; ++k) {
                b.tokens.push_back((i * 131 + k * 7) % cfg.vocab_size);
                b.positions.push_back(prefix + k);
              }
            }
            std::vector<double> ms;
            const int64_t reps = std::max<int64_t>(1, f.Int("reps"));
            for (int64_t i = 0; i < reps + 2; ++i) {
              SynchronizeDevice(lo->device);
              const auto t0 = std::chrono::steady_clock::now();
              OrDie(gpt->Forward(step, cache, at::Tensor(), fo));
              SynchronizeDevice(lo->device);
              if (i >= 2) {
                ms.push_back(
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count());
              }
            }
            int64_t launches = 0;  // ATen calls that launch device work (one more forward)
            {
              LaunchCount count;
              OrDie(gpt->Forward(step, cache, at::Tensor(), fo));
              launches = count.launches();
            }
            KernelSummary ks;  // --kernel-profile: N forwards more, profiled
            if (profile_reps > 0) {
              SynchronizeDevice(lo->device);
              KernelProfile prof(lo->device);
              for (int64_t i = 0; i < profile_reps; ++i) {
                OrDie(gpt->Forward(step, cache, at::Tensor(), fo));
              }
              SynchronizeDevice(lo->device);
              ks = prof.Stop(profile_reps);
            }
            std::sort(ms.begin(), ms.end());
            const double med = ms[ms.size() / 2];
            if (r == 1 && t == 1) one_token_ms = med;
            const double ratio = one_token_ms > 0 ? med / one_token_ms : 0;
            std::printf("%8lld %6lld %8lld %8lld %10.3f %12.0f %8.2f %8lld\n",
                        static_cast<long long>(r), static_cast<long long>(rows),
                        static_cast<long long>(t), static_cast<long long>(n), med, t / (med / 1e3),
                        ratio, static_cast<long long>(launches));
            if (profile_reps > 0) {
              PrintKernelSummary(ks, static_cast<size_t>(std::max<int64_t>(0, f.Int("kernel-top"))),
                                 "    ");
            }
            if (csv) {
              csv << label << "," << dtype << "," << f.Str("device") << "," << gpt->weight_bytes()
                  << "," << r << "," << rows << "," << t << "," << n << "," << prefix << "," << med
                  << "," << t / (med / 1e3) << "," << ratio << "," << weight_ms << "," << fw << ","
                  << launches;
              csv << "," << (profile_reps > 0 ? ks.CsvFields() : ",,,,,,,,") << std::endl;
            }
            std::fflush(stdout);  // a run stopped at a time limit keeps the rows it printed
          }
        }
        if (gbps > 0 && one_token_ms > 0) {
          std::printf(
              "%s, 1 request, 1 token: %.3f ms = %.2f x the weight-read limit (%.3f ms at %.0f "
              "GB/s)\n",
              fw.c_str(), one_token_ms, one_token_ms / weight_ms, weight_ms, gbps);
        }
      }
    }
  }
  return 0;
}

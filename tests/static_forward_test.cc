// The graph-ready forward (ForwardOptions::static_shapes, issue 14): it gives the ragged
// forward's logits and cache entries within rounding, step after step (CFG rows, tree masks,
// condition tokens, device tokens, non-consecutive slots); every ATen call it makes, with its
// input shapes and scalar arguments, depends only on the batch's bucket, which is what lets one
// CUDA graph per bucket replay it for any batch of that bucket (the ragged forward's calls
// differ between the same two batches: the check has teeth); it makes no syncing call. On a
// CUDA device, graph replays equal the eager static forward. The fused layer
// (LoadOptions::fused_static_forward) gives the reference layer's logits within rounding in
// fewer launches.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#ifdef IMAGEGEN_TEST_CUDA
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "engine/decoding/fused_kernels.h"
#include "engine/model/cuda_graphs.h"
#include "engine/model/cuda_stream.h"
#include "engine/model/gpt.h"
#include "engine/model/transfer.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

using testing::TinyGptSpec;

BatchRow Row(int64_t slot, int64_t cache_len, std::vector<int64_t> tokens,
             std::vector<int64_t> positions, std::vector<uint8_t> mask = {}, int64_t group = -1) {
  BatchRow r;
  r.slot = slot;
  r.cache_len = cache_len;
  r.tokens = std::move(tokens);
  r.positions = std::move(positions);
  r.mask = std::move(mask);
  r.group = group;
  return r;
}

// A tree of n nodes: node 0 the root, every other node its child (each sees itself and the
// root): n diagonal pairs and n - 1 root pairs.
std::vector<uint8_t> Fan(int64_t n) {
  std::vector<uint8_t> m(static_cast<size_t>(n * n), 0);
  for (int64_t i = 0; i < n; ++i) {
    m[static_cast<size_t>(i * n + i)] = 1;
    m[static_cast<size_t>(i * n)] = 1;
  }
  return m;
}

// Three steps of a small serving batch: CFG pairs (classes, the null class 3), a chain window, a
// tree window, a lone prefill; slots out of order.
std::vector<std::vector<BatchRow>> Steps() {
  std::vector<std::vector<BatchRow>> s(3);
  s[0] = {Row(4, 0, {0, 1, 2, 3}, {0, 1, 2, 3}, {}, 0),
          Row(1, 0, {3, 1, 2, 3}, {0, 1, 2, 3}, {}, 0), Row(2, 0, {2}, {0})};
  s[1] = {Row(4, 4, {5, 6, 7}, {4, 5, 5}, Fan(3), 1), Row(1, 4, {5, 6, 7}, {4, 5, 5}, Fan(3), 1),
          Row(2, 1, {10, 11, 12, 13, 14}, {1, 2, 3, 4, 5})};
  s[2] = {Row(4, 6, {8, 9}, {6, 7}, {}, 2), Row(1, 6, {8, 9}, {6, 7}, {}, 2),
          Row(2, 6, {15, 16, 17, 18, 19, 20, 21}, {6, 7, 8, 9, 10, 11, 12}, Fan(7)),
          Row(0, 0, {1, 4}, {0, 1})};
  return s;
}

class StaticForwardTest : public ::testing::Test {
 protected:
  void SetUp() override { gpt_ = Load(LoadOptions{}); }
  // A test that stopped before its failing capture leaves none for the next.
  void TearDown() override { TestingFailNextCaptures(0, CaptureFault::kInvalidate); }
  std::unique_ptr<Gpt> Load(const LoadOptions& o) {
    auto m = Gpt::Load(testing::WriteTinyGpt(testing::TempDir("static") + "/m", spec_, 1), o);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::move(m).value() : nullptr;
  }
  // Options for the fused layer (true) or the reference one.
  static LoadOptions FusedOptions(bool fused, at::ScalarType dtype = at::kFloat,
                                  at::Device device = at::kCPU) {
    LoadOptions o;
    o.device = device;
    o.dtype = dtype;
    o.fused_static_forward = fused;
    return o;
  }
  std::unique_ptr<Gpt> LoadFused(bool fused, at::ScalarType dtype = at::kFloat,
                                 at::Device device = at::kCPU) {
    return Load(FusedOptions(fused, dtype, device));
  }
  // Where the fused layer is compared with the reference one: the CPU in fp32 and bf16, and the
  // first CUDA device in both when there is one.
  std::vector<std::pair<at::Device, at::ScalarType>> FusedCases() const {
    std::vector<std::pair<at::Device, at::ScalarType>> cases = {{at::kCPU, at::kFloat},
                                                                {at::kCPU, at::kBFloat16}};
    if (torch::cuda::is_available()) {
      cases.push_back({kCuda, at::kFloat});
      cases.push_back({kCuda, at::kBFloat16});
    }
    return cases;
  }
  // The model on the first CUDA device (the CUDA tests skip first where there is none).
  std::unique_ptr<Gpt> LoadOnCuda() {
    LoadOptions o;
    o.device = kCuda;
    return Load(o);
  }
  // One step through the eager static forward into `eager` and through the graphs into
  // `graphed`: the same logits, bit for bit (the same kernels).
  static void ExpectGraphsEqualEager(const Gpt& gpt, const std::vector<BatchRow>& step,
                                     KvCache& eager, KvCache& graphed, const at::Tensor& tokens) {
    auto a = gpt.Forward(step, eager, tokens, ForwardOptions{false, true});
    auto b = gpt.Forward(step, graphed, tokens, ForwardOptions{false, true, true});
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ((*a - *b).abs().max().item<float>(), 0.0f);
  }
  const at::Device kCuda{at::kCUDA, 0};
  TinyGptSpec spec_;
  std::unique_ptr<Gpt> gpt_;
};

TEST_F(StaticForwardTest, MatchesTheRaggedForwardStepByStep) {
  for (const bool device_tokens : {false, true}) {
    SCOPED_TRACE(device_tokens ? "device tokens" : "host tokens");
    KvCache ragged = gpt_->NewCache(6), fixed = gpt_->NewCache(6, 0, /*scratch_slot=*/true);
    ASSERT_EQ(fixed.scratch, 6);
    ASSERT_EQ(fixed.k[0].size(0), 7);
    int64_t step = 0;
    for (const auto& batch : Steps()) {
      SCOPED_TRACE("step " + std::to_string(step++));
      at::Tensor tokens;
      if (device_tokens) {
        std::vector<int64_t> ids;
        for (const BatchRow& r : batch) ids.insert(ids.end(), r.tokens.begin(), r.tokens.end());
        tokens = at::tensor(ids, at::kLong);
      }
      auto a = gpt_->Forward(batch, ragged, tokens, ForwardOptions{true});
      auto b = gpt_->Forward(batch, fixed, tokens, ForwardOptions{false, true});
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      ASSERT_EQ(a->sizes(), b->sizes());
      EXPECT_LT((*a - *b).abs().max().item<float>(), 2e-5);
      EXPECT_GT(a->abs().max().item<float>(), 0.1);  // not all zero
    }
    // Every slot's entries (the scratch slot aside) hold the same keys and values.
    for (size_t l = 0; l < ragged.k.size(); ++l) {
      EXPECT_LT((ragged.k[l] - fixed.k[l].narrow(0, 0, 6)).abs().max().item<float>(), 2e-5);
      EXPECT_LT((ragged.v[l] - fixed.v[l].narrow(0, 0, 6)).abs().max().item<float>(), 2e-5);
    }
    EXPECT_GT(ragged.k[0].abs().max().item<float>(), 0.1);
  }
}

// The static forward hands attention an additive bias built once per forward (rows padded to 16
// elements) instead of the boolean mask SDPA converts in every layer: the same logits and cache
// entries, bit for bit, step after step, in fp32 and bf16 (and on a CUDA device when there is
// one). A bias with the mask inverted fails it by 7-8 (tried by hand); -1e4 for -inf does not,
// as the softmax rounds both to zero.
TEST_F(StaticForwardTest, TheAdditiveBiasGivesTheBooleanMasksLogitsBitForBit) {
  for (const auto& [device, dtype] : FusedCases()) {
    SCOPED_TRACE(device.str() + (dtype == at::kFloat ? " fp32" : " bf16"));
    std::unique_ptr<Gpt> gpt = LoadFused(true, dtype, device);
    ASSERT_NE(gpt, nullptr);
    KvCache bias = gpt->NewCache(6, 0, true), boolean = gpt->NewCache(6, 0, true);
    int64_t step = 0;
    for (const auto& batch : Steps()) {
      SCOPED_TRACE("step " + std::to_string(step++));
      ASSERT_FALSE(StaticBoolMask());
      auto a = gpt->Forward(batch, bias, at::Tensor(), ForwardOptions{false, true});
      ::setenv("IMAGEGEN_SDPA_BOOL_MASK", "1", 1);
      ASSERT_TRUE(StaticBoolMask());
      auto b = gpt->Forward(batch, boolean, at::Tensor(), ForwardOptions{false, true});
      ::unsetenv("IMAGEGEN_SDPA_BOOL_MASK");
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      EXPECT_GT(a->abs().max().item<float>(), 0.1);
      EXPECT_EQ((*a - *b).abs().max().item<float>(), 0.0f);
    }
    for (size_t l = 0; l < bias.k.size(); ++l) {
      EXPECT_TRUE(at::equal(bias.k[l], boolean.k[l]));
      EXPECT_TRUE(at::equal(bias.v[l], boolean.v[l]));
    }
  }
}

// The rotary scatter (LoadOptions::rope_scatter: the rotary embedding and the new queries',
// keys' and values' writes in one kernel, on the CPU its host path) gives the fused layer's
// logits and cache entries, step after step, in fp32 and bf16 (and on a CUDA device when there
// is one): within rounding, as its complex multiply may round as ATen's does or not (a bf16
// rounding of a key moves the logits by about a percent of their range); without the scatter
// nothing changes. A rotation the wrong way fails it (tried by hand: the sine negated in
// RopeScatterUnit).
TEST_F(StaticForwardTest, TheRopeScatterGivesTheFusedLayersLogits) {
  for (const auto& [device, dtype] : FusedCases()) {
    SCOPED_TRACE(device.str() + (dtype == at::kFloat ? " fp32" : " bf16"));
    LoadOptions o = FusedOptions(true, dtype, device);
    o.rope_scatter = false;
    std::unique_ptr<Gpt> fused = Load(o);
    o.rope_scatter = true;
    std::unique_ptr<Gpt> scatter = Load(o);
    ASSERT_NE(fused, nullptr);
    ASSERT_NE(scatter, nullptr);
    EXPECT_FALSE(fused->rope_scatter());
    if (device.is_cuda() && !RopeScatterKernelBuilt()) {
      EXPECT_FALSE(scatter->rope_scatter());  // no kernel in this build: the fused layer as is
      continue;
    }
    ASSERT_TRUE(scatter->rope_scatter());
    const double tol = dtype == at::kFloat ? 2e-5 : 0.03;
    KvCache a_cache = fused->NewCache(6, 0, true), b_cache = scatter->NewCache(6, 0, true);
    int64_t step = 0;
    for (const auto& batch : Steps()) {
      SCOPED_TRACE("step " + std::to_string(step++));
      auto a = fused->Forward(batch, a_cache, at::Tensor(), ForwardOptions{false, true});
      auto b = scatter->Forward(batch, b_cache, at::Tensor(), ForwardOptions{false, true});
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      const float range = a->abs().max().item<float>();
      EXPECT_GT(range, 0.1);
      EXPECT_LE((*a - *b).abs().max().item<float>(), tol * range);
    }
    // Every slot's entries, the scratch slot's (padding) included.
    for (size_t l = 0; l < a_cache.k.size(); ++l) {
      const float kr = a_cache.k[l].abs().max().item<float>();
      EXPECT_LE((a_cache.k[l] - b_cache.k[l]).abs().max().item<float>(), tol * kr) << l;
      EXPECT_LE((a_cache.v[l] - b_cache.v[l]).abs().max().item<float>(), tol * kr) << l;
    }
  }
}

// Two batches of one bucket (16 tokens, 4 rows, width 8, 8 mask pairs) that differ in every
// length, slot, cache length, mask and token.
std::vector<BatchRow> BucketP() {
  return {Row(0, 3, {1, 2, 3}, {3, 4, 4}, Fan(3)), Row(2, 5, {4, 5}, {5, 6}),
          Row(5, 0, {1, 7, 8, 9, 10}, {0, 1, 2, 3, 4})};
}
std::vector<BatchRow> BucketQ() {
  return {Row(5, 8, {9, 8, 7, 6}, {8, 9, 9, 9}, Fan(4)), Row(1, 0, {2}, {0}),
          Row(3, 2, {11, 12, 13, 14, 15, 16}, {2, 3, 4, 5, 6, 7}), Row(0, 9, {17}, {9})};
}

// The calls of the ragged forward.
std::vector<std::string> Trace(const Gpt& gpt, const std::vector<BatchRow>& batch, KvCache& cache,
                               ForwardOptions fo) {
  OpTrace trace;
  auto out = gpt.Forward(batch, cache, at::Tensor(), fo);
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return trace.calls();
}

// The calls of the static forward's device half: what a CUDA graph captures (the host half
// and the upload run before it, and the narrowing to the batch's tokens after it, at every
// step).
std::vector<std::string> TraceStatic(const Gpt& gpt, const std::vector<BatchRow>& batch,
                                     KvCache& cache, bool device_tokens, int64_t* syncing) {
  const StaticShape shape = gpt.StaticBucket(batch);
  const at::Tensor up = UploadLongs(gpt.StaticUpload(batch, cache, shape, device_tokens), at::kCPU);
  at::Tensor tokens;
  // Ids below 4 are valid at condition positions too (3 classes and the null class).
  if (device_tokens) tokens = at::randint(0, 4, {shape.tokens}, at::kLong);
  SyncWatch watch;
  OpTrace trace;
  at::Tensor logits = gpt.StaticForward(up, tokens, shape, cache);
  EXPECT_EQ(logits.size(0), shape.tokens);
  *syncing = watch.syncing_calls() + watch.stray_moves();
  return trace.calls();
}

TEST_F(StaticForwardTest, EveryCallShapeAndScalarDependsOnlyOnTheBucket) {
  const StaticShape p = gpt_->StaticBucket(BucketP()), q = gpt_->StaticBucket(BucketQ());
  ASSERT_TRUE(p == q);
  EXPECT_EQ(p.tokens, 16);
  EXPECT_EQ(p.rows, 4);
  EXPECT_EQ(p.width, 8);
  EXPECT_EQ(p.pairs, 8);

  KvCache cache = gpt_->NewCache(6, 0, true);
  std::unique_ptr<Gpt> fused = LoadFused(true);
  ASSERT_NE(fused, nullptr);
  for (const Gpt* gpt : {gpt_.get(), fused.get()}) {
    for (const bool device_tokens : {false, true}) {
      const std::string what = std::string(gpt->fused_static() ? "fused" : "reference") +
                               " layer, " + (device_tokens ? "device tokens" : "host tokens");
      SCOPED_TRACE(what);
      int64_t sync_p = -1, sync_q = -1;
      const std::vector<std::string> tp =
          TraceStatic(*gpt, BucketP(), cache, device_tokens, &sync_p);
      const std::vector<std::string> tq =
          TraceStatic(*gpt, BucketQ(), cache, device_tokens, &sync_q);
      EXPECT_GT(tp.size(), 100u);
      ASSERT_EQ(tp.size(), tq.size());
      for (size_t i = 0; i < tp.size(); ++i) ASSERT_EQ(tp[i], tq[i]) << "call " << i;
      std::printf("static forward (%s): %zu ATen calls, the same for both batches\n", what.c_str(),
                  tp.size());
      EXPECT_EQ(sync_p, 0);
      EXPECT_EQ(sync_q, 0);
    }
  }

  // The ragged forward's calls differ between the same two batches (shapes follow the data).
  for (const bool invariant : {false, true}) {
    const std::vector<std::string> rp = Trace(*gpt_, BucketP(), cache, ForwardOptions{invariant});
    const std::vector<std::string> rq = Trace(*gpt_, BucketQ(), cache, ForwardOptions{invariant});
    EXPECT_NE(rp, rq) << (invariant ? "batch-invariant" : "padded");
  }
}

TEST_F(StaticForwardTest, BucketsAreRoundedUpToPowersOfTwo) {
  std::vector<BatchRow> one = {Row(0, 0, {1}, {0})};
  const StaticShape s = gpt_->StaticBucket(one);
  EXPECT_EQ(s.tokens, kInvariantMinRows);  // never below the invariant row floor
  EXPECT_EQ(s.rows, 1);
  EXPECT_EQ(s.width, 1);
  EXPECT_EQ(s.pairs, 0);
  std::vector<BatchRow> wide = {Row(0, 0, std::vector<int64_t>(17, 1), std::vector<int64_t>(17, 1)),
                                Row(1, 0, {1}, {0}), Row(2, 0, {1}, {0})};
  const StaticShape w = gpt_->StaticBucket(wide);
  EXPECT_EQ(w.tokens, 32);
  EXPECT_EQ(w.rows, 4);
  EXPECT_EQ(w.width, 32);
}

TEST_F(StaticForwardTest, NeedsACacheWithAScratchSlot) {
  KvCache plain = gpt_->NewCache(2);
  EXPECT_EQ(plain.scratch, -1);
  auto out = gpt_->Forward({Row(0, 0, {1}, {0})}, plain, at::Tensor(), ForwardOptions{false, true});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("scratch slot"), std::string::npos)
      << out.status().ToString();
  // The scratch slot is not a slot a batch may name.
  KvCache with = gpt_->NewCache(2, 0, true);
  auto bad = gpt_->Forward({Row(2, 0, {1}, {0})}, with, at::Tensor(), ForwardOptions{false, true});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad slot"), std::string::npos);
}

// The fused layer against the reference layer, step by step through the static forward: on the
// CPU in fp32 (within 2e-5, as the static forward against the ragged one) and bf16 (within 3%
// of the logits' range: one rounding of each product instead of two), and on a CUDA device
// when there is one (where the fused layer is the default; fp32 within 1e-4 there); the keys and
// values written agree as well. Launches counted on the CPU (LaunchCount, an estimate of a CUDA
// forward's kernels) for the 2-layer model: 104 -> 61 in fp32, 119 -> 66 in bf16 (19 and 23 a
// layer, and the final norm).
TEST_F(StaticForwardTest, FusedLayersMatchTheReferenceLayerInFewerLaunches) {
  const auto cases = FusedCases();
  if (torch::cuda::is_available()) {
    EXPECT_TRUE(LoadOnCuda()->fused_static());  // the default there
  }
  EXPECT_FALSE(gpt_->fused_static());  // the default on the CPU
  for (const auto& [device, dtype] : cases) {
    const bool fp32 = dtype == at::kFloat;
    // fp32: 2e-5 on the CPU; 1e-4 on CUDA, where cuBLAS picks its GEMM kernels by shape (w13's
    // is not w1's) and the parity tests allow 1e-4 too.
    const float fp32_tol = device.is_cpu() ? 2e-5f : 1e-4f;
    SCOPED_TRACE(device.str() + (fp32 ? " fp32" : " bf16"));
    // The reference layer as ATen's ops, as a CUDA device runs it: on the CPU in fp32 its
    // RMSNorm and rotary kernels (LoadOptions::fused_norm_rope) would take 20 launches a layer
    // away from it (NormRopeForwardTest compares those with the ops).
    LoadOptions ref_options = FusedOptions(false, dtype, device);
    ref_options.fused_norm_rope = false;
    std::unique_ptr<Gpt> ref = Load(ref_options);
    std::unique_ptr<Gpt> fused = LoadFused(true, dtype, device);
    ASSERT_NE(ref, nullptr);
    ASSERT_NE(fused, nullptr);
    ASSERT_FALSE(ref->fused_static());
    ASSERT_TRUE(fused->fused_static());
    KvCache a = ref->NewCache(6, 0, true), b = fused->NewCache(6, 0, true);
    int64_t step = 0;
    for (const auto& batch : Steps()) {
      SCOPED_TRACE("step " + std::to_string(step++));
      auto la = ref->Forward(batch, a, at::Tensor(), ForwardOptions{false, true});
      auto lb = fused->Forward(batch, b, at::Tensor(), ForwardOptions{false, true});
      ASSERT_TRUE(la.ok()) << la.status().ToString();
      ASSERT_TRUE(lb.ok()) << lb.status().ToString();
      const float range = la->abs().max().item<float>();
      const float diff = (*la - *lb).abs().max().item<float>();
      EXPECT_GT(range, 0.1);
      EXPECT_LT(diff, fp32 ? fp32_tol : 0.03f * range) << "range " << range;
    }
    for (size_t l = 0; l < a.k.size(); ++l) {
      const float range = a.k[l].abs().max().item<float>();
      EXPECT_LT((a.k[l] - b.k[l]).abs().max().item<float>(), fp32 ? fp32_tol : 0.03f * range);
      EXPECT_LT((a.v[l] - b.v[l]).abs().max().item<float>(), fp32 ? fp32_tol : 0.03f * range);
    }
    if (device.is_cpu()) {
      int64_t launches[2] = {0, 0};
      for (const Gpt* gpt : {ref.get(), fused.get()}) {
        KvCache c = gpt->NewCache(6, 0, true);
        LaunchCount count;
        ASSERT_TRUE(gpt->Forward(Steps()[2], c, at::Tensor(), ForwardOptions{false, true}).ok());
        launches[gpt->fused_static() ? 1 : 0] = count.launches();
      }
      const int64_t layers = ref->config().n_layer;
      std::printf(
          "static forward of %lld layers, %s: %lld launches with the reference layer, "
          "%lld with the fused one\n",
          static_cast<long long>(layers), fp32 ? "fp32" : "bf16",
          static_cast<long long>(launches[0]), static_cast<long long>(launches[1]));
      // In fp32 the casts to and from fp32 are no-ops: fewer launches to save.
      EXPECT_GE(launches[0] - launches[1], (fp32 ? 14 : 20) * layers);
    }
  }
}

// The same for a Janus-layout (prompted) model, whose fused layer keeps the rotate-half rotary
// embedding on its strided view of the projection: two steps of prompt prefill, image tokens
// and a tree, on the CPU in fp32 and bf16 and on a CUDA device when there is one.
TEST_F(StaticForwardTest, FusedLayersMatchTheReferenceLayerForPromptedModels) {
  const auto cases = FusedCases();
  const std::string dir =
      testing::WriteTinyJanus(testing::TempDir("static-janus") + "/m", testing::TinyJanusSpec{}, 5);
  auto prompted = [](int64_t slot, int64_t prefix, int64_t cache_len, std::vector<int64_t> tokens,
                     std::vector<int64_t> positions, std::vector<uint8_t> mask = {}) {
    BatchRow r = Row(slot, cache_len, std::move(tokens), std::move(positions), std::move(mask));
    r.prefix = prefix;
    return r;
  };
  // Text ids below 8 at the prompt's positions, image ids below 3 after them.
  const std::vector<std::vector<BatchRow>> steps = {
      {prompted(0, 4, 0, {1, 2, 3, 4, 0, 1}, {0, 1, 2, 3, 4, 5}),
       prompted(1, 2, 0, {5, 6, 2}, {0, 1, 2})},
      {prompted(0, 4, 6, {2, 0, 1}, {6, 7, 7}, Fan(3)), prompted(1, 2, 3, {1}, {3})}};
  for (const auto& [device, dtype] : cases) {
    const bool fp32 = dtype == at::kFloat;
    // fp32: 2e-5 on the CPU; 1e-4 on CUDA, where cuBLAS picks its GEMM kernels by shape (w13's
    // is not w1's) and the parity tests allow 1e-4 too.
    const float fp32_tol = device.is_cpu() ? 2e-5f : 1e-4f;
    SCOPED_TRACE(device.str() + (fp32 ? " fp32" : " bf16"));
    std::unique_ptr<Gpt> models[2];
    for (const bool fused : {false, true}) {
      auto m = Gpt::Load(dir, FusedOptions(fused, dtype, device));
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      ASSERT_TRUE((*m)->config().prompted());
      ASSERT_EQ((*m)->fused_static(), fused);
      models[fused ? 1 : 0] = std::move(m).value();
    }
    KvCache a = models[0]->NewCache(2, 0, true), b = models[1]->NewCache(2, 0, true);
    for (size_t i = 0; i < steps.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      auto la = models[0]->Forward(steps[i], a, at::Tensor(), ForwardOptions{false, true});
      auto lb = models[1]->Forward(steps[i], b, at::Tensor(), ForwardOptions{false, true});
      ASSERT_TRUE(la.ok()) << la.status().ToString();
      ASSERT_TRUE(lb.ok()) << lb.status().ToString();
      const float range = la->abs().max().item<float>();
      EXPECT_GT(range, 0.1);
      EXPECT_LT((*la - *lb).abs().max().item<float>(), fp32 ? fp32_tol : 0.03f * range);
    }
  }
}

// On a CUDA device: every step through the graphs equals the eager static forward bit for bit
// (the same kernels), the second pass over the same buckets replays instead of capturing, and
// the caches agree.
TEST_F(StaticForwardTest, CudaGraphReplaysEqualTheEagerStaticForward) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Gpt> gpt = LoadOnCuda();
  ASSERT_NE(gpt, nullptr);
  KvCache eager = gpt->NewCache(6, 0, true), graphed = gpt->NewCache(6, 0, true);
  std::vector<std::vector<BatchRow>> steps = Steps();
  steps.push_back(BucketP());
  steps.push_back(BucketQ());  // the same bucket as P: a replay
  for (const bool device_tokens : {false, true}) {
    for (size_t i = 0; i < steps.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i) + (device_tokens ? ", device tokens" : ""));
      at::Tensor tokens;
      if (device_tokens) {
        std::vector<int64_t> ids;
        for (const BatchRow& r : steps[i]) ids.insert(ids.end(), r.tokens.begin(), r.tokens.end());
        tokens = at::tensor(ids, at::kLong).to(kCuda);
      }
      ASSERT_NO_FATAL_FAILURE(ExpectGraphsEqualEager(*gpt, steps[i], eager, graphed, tokens));
    }
  }
  const ForwardGraphStats st = GraphStats(graphed);
  std::printf("CUDA graphs: %lld captured, %lld replays\n", static_cast<long long>(st.captures),
              static_cast<long long>(st.replays));
  // Buckets (tokens, rows, width, pairs): step 0 (16, 4, 4, 0); steps 1 and 2 (16, 4, 8, 16);
  // P and Q (16, 4, 8, 8); once with host and once with device tokens.
  EXPECT_EQ(st.captures, 6);
  EXPECT_EQ(st.replays, 4);
  for (size_t l = 0; l < eager.k.size(); ++l) {
    EXPECT_EQ((eager.k[l].narrow(0, 0, 6) - graphed.k[l].narrow(0, 0, 6)).abs().max().item<float>(),
              0.0f);
  }
}

// On a CUDA device: a capture that fails costs nothing but its graph. The step still gets its
// logits (the eager run before the capture), that bucket runs eagerly from then on, and later
// captures work and replay, bit for bit the eager forward. Two ways: a capture invalidated by a
// stream sync inside it, as a syncing call in the forward would (before, capture_end then threw
// before it ended the caching allocator's recording into the cache's pool, so every later
// capture with that pool threw, "already recording to mempool_id", and failed its step); and a
// clean exception in a cache's first capture (its graph's pool then released to a use count of
// 0, which LibTorch asserts against when a capture asks for the pool again).
TEST_F(StaticForwardTest, AFailedCaptureRunsItsBucketEagerlyAndLaterCapturesWork) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Gpt> gpt = LoadOnCuda();
  ASSERT_NE(gpt, nullptr);
  const std::vector<std::vector<BatchRow>> steps = Steps();
  for (const CaptureFault how : {CaptureFault::kInvalidate, CaptureFault::kThrow}) {
    SCOPED_TRACE(how == CaptureFault::kInvalidate ? "invalidated" : "thrown");
    KvCache eager = gpt->NewCache(6, 0, true), graphed = gpt->NewCache(6, 0, true);
    TestingFailNextCaptures(1, how);
    ASSERT_NO_FATAL_FAILURE(ExpectGraphsEqualEager(*gpt, steps[0], eager, graphed, at::Tensor()));
    ForwardGraphStats st = GraphStats(graphed);
    EXPECT_EQ(st.capture_failures, 1);
    EXPECT_EQ(st.captures, 0);
    EXPECT_EQ(st.graphs, 0);
    std::printf("the failed capture: %s\n", st.last_failure.c_str());
    // The hook's sync really invalidated the capture (else its exception would follow it).
    EXPECT_NE(st.last_failure.find(how == CaptureFault::kInvalidate ? "capturing" : "on purpose"),
              std::string::npos);
#ifdef IMAGEGEN_TEST_CUDA
    // Neither allocator records into the failed capture's pool any more (ending it again
    // throws), and nothing holds the pool: its memory can be freed.
    const c10::MempoolId_t pool = st.last_failed_pool;
    EXPECT_THROW(c10::cuda::CUDACachingAllocator::endAllocateToPool(0, pool), c10::Error);
    EXPECT_THROW(at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool), c10::Error);
    int uses = 0;
    try {
      uses = c10::cuda::CUDACachingAllocator::getPoolUseCount(0, pool);
    } catch (const c10::Error&) {  // released and freed already
    }
    EXPECT_EQ(uses, 0);
#endif
    // Steps 1 and 2 share a bucket of their own: captured, then replayed.
    for (size_t i : {1, 2}) {
      SCOPED_TRACE("step " + std::to_string(i));
      ASSERT_NO_FATAL_FAILURE(ExpectGraphsEqualEager(*gpt, steps[i], eager, graphed, at::Tensor()));
    }
    // Step 0's bucket again: eagerly, not captured again.
    ASSERT_NO_FATAL_FAILURE(ExpectGraphsEqualEager(*gpt, steps[0], eager, graphed, at::Tensor()));
    st = GraphStats(graphed);
    EXPECT_EQ(st.capture_failures, 1);
    EXPECT_EQ(st.captures, 1);
    EXPECT_EQ(st.replays, 1);
    for (size_t l = 0; l < eager.k.size(); ++l) {
      EXPECT_EQ(
          (eager.k[l].narrow(0, 0, 6) - graphed.k[l].narrow(0, 0, 6)).abs().max().item<float>(),
          0.0f);
    }
  }
}

#ifdef IMAGEGEN_TEST_CUDA
// Captures beside another thread that keeps uploading on a pooled stream of its own (the decode
// thread's OwnStream): they run on GraphCaptureStream, outside LibTorch's pool, never on that
// thread's stream. Captures used to take the pool's next stream; the pool hands its 32 streams
// out in turn, so now and then the capture's was the decode thread's, whose next upload failed
// mid-capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture") before the
// process crashed (an H200, the load bench with CUDA graphs at 4 clients). Here the pool is
// turned so that its next stream is the uploader's, as it was then: the old capture fails this.
TEST_F(StaticForwardTest, CapturesNeverRunOnAnotherThreadsStream) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Gpt> gpt = LoadOnCuda();
  ASSERT_NE(gpt, nullptr);
  KvCache eager = gpt->NewCache(6, 0, true), graphed = gpt->NewCache(6, 0, true);
  std::atomic<bool> ready{false}, stop{false};
  std::atomic<int64_t> uploads{0};
  void* theirs = nullptr;
  std::string failure;
  std::thread uploader([&] {
    OwnStream own(kCuda);
    theirs = CurrentCudaStream(kCuda);
    ready = true;
    try {
      const at::Tensor host = at::arange(4096, at::kFloat);
      while (!stop) {
        at::Tensor d = host.to(kCuda);  // pageable memory: the copy waits for its stream
        uploads += 1;
      }
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    }
  });
  // Whatever the checks below do, the uploader stops and is joined.
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Joiner() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } joiner{stop, uploader};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!ready && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_TRUE(ready.load());
  // Turn the pool until it hands out the uploader's stream, then 31 times more: the next stream
  // it hands out (the one the old capture took) is the uploader's again.
  int turns = 0;
  while (c10::cuda::getStreamFromPool(false, 0).stream() != theirs && turns < 64) turns += 1;
  ASSERT_LT(turns, 64) << "the uploader's stream is not one of the pool's";
  for (int i = 0; i < 31; ++i) c10::cuda::getStreamFromPool(false, 0);
  // The uploader is uploading (a generous limit: a loaded machine).
  while (uploads.load() < 10 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<std::vector<BatchRow>> steps = Steps();
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    ASSERT_NO_FATAL_FAILURE(ExpectGraphsEqualEager(*gpt, steps[i], eager, graphed, at::Tensor()));
  }
  const int64_t during = uploads.load();
  stop = true;
  uploader.join();
  EXPECT_EQ(failure, "");
  EXPECT_GT(during, 10);
  EXPECT_GT(GraphStats(graphed).captures, 0);
  EXPECT_NE(GraphCaptureStream(kCuda), nullptr);
  EXPECT_NE(GraphCaptureStream(kCuda), theirs);
}
#endif

}  // namespace
}  // namespace imagegen

// The ragged forward: incremental decoding with the KV cache equals a full forward, rows are
// independent of each other and of slot placement, and tree masks behave like the sequences
// they encode.
#include "engine/model/gpt.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace imagegen {
namespace {

using testing::TinyGptSpec;

class GptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = Gpt::Load(testing::WriteTinyGpt(testing::TempDir("gpt") + "/m", spec_, 1), {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    gpt_ = std::move(m).value();
  }
  // One row feeding class + tokens[0..n) in one forward from an empty slot.
  at::Tensor Full(int64_t cls, const std::vector<int64_t>& toks, KvCache& cache, int64_t slot) {
    BatchRow row;
    row.slot = slot;
    row.tokens = {cls};
    row.positions = {0};
    for (size_t i = 0; i < toks.size(); ++i) {
      row.tokens.push_back(toks[i]);
      row.positions.push_back(static_cast<int64_t>(i) + 1);
    }
    auto out = gpt_->Forward({row}, cache);
    EXPECT_TRUE(out.ok()) << out.status().ToString();
    return *out;
  }
  TinyGptSpec spec_;
  std::unique_ptr<Gpt> gpt_;
};

TEST_F(GptTest, IncrementalDecodingEqualsFullForward) {
  std::vector<int64_t> toks = {3, 7, 1, 22, 5, 9, 9, 0, 13, 4, 17, 2, 8, 6, 11};  // 15 = N - 1
  KvCache c1 = gpt_->NewCache(1);
  at::Tensor full = Full(2, toks, c1, 0);
  ASSERT_EQ(full.size(0), 16);
  KvCache c2 = gpt_->NewCache(1);
  for (int64_t t = 0; t <= 15; ++t) {
    BatchRow row;
    row.tokens = {t == 0 ? 2 : toks[t - 1]};
    row.positions = {t};
    row.cache_len = t;
    auto out = gpt_->Forward({row}, c2);
    ASSERT_TRUE(out.ok());
    EXPECT_LT((*out - full[t]).abs().max().item<float>(), 1e-5) << "position " << t;
  }
  // Chunks of 3, 5 and 8 tokens (a Jacobi-window pattern) agree as well.
  KvCache c3 = gpt_->NewCache(1);
  int64_t done = 0;
  for (int64_t n : {3, 5, 8}) {
    BatchRow row;
    row.cache_len = done;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = done + i;
      row.tokens.push_back(p == 0 ? 2 : toks[p - 1]);
      row.positions.push_back(p);
    }
    auto out = gpt_->Forward({row}, c3);
    ASSERT_TRUE(out.ok());
    EXPECT_LT((*out - full.narrow(0, done, n)).abs().max().item<float>(), 1e-5);
    done += n;
  }
}

TEST_F(GptTest, RowsAreIndependentOfBatchAndSlot) {
  std::vector<int64_t> a = {1, 2, 3, 4, 5}, b = {9, 8, 7};
  KvCache solo = gpt_->NewCache(1);
  at::Tensor ra = Full(0, a, solo, 0);
  KvCache solo2 = gpt_->NewCache(1);
  at::Tensor rb = Full(3 /* null class */, b, solo2, 0);

  KvCache shared = gpt_->NewCache(5);
  BatchRow x, y;
  x.slot = 4;  // non-consecutive slots exercise the gather path
  y.slot = 1;
  x.tokens = {0, 1, 2, 3, 4, 5};
  x.positions = {0, 1, 2, 3, 4, 5};
  y.tokens = {3, 9, 8, 7};
  y.positions = {0, 1, 2, 3};
  auto out = gpt_->Forward({x, y}, shared);
  ASSERT_TRUE(out.ok());
  EXPECT_LT((out->narrow(0, 0, 6) - ra).abs().max().item<float>(), 1e-5);
  EXPECT_LT((out->narrow(0, 6, 4) - rb).abs().max().item<float>(), 1e-5);
}

TEST_F(GptTest, TreeMaskEqualsTheBranchAsASequence) {
  // Committed: class, 5, 6. New: a tree with root r=10 at position 3 and two children
  // c1=11, c2=12 both at position 4. c2 must not see c1.
  KvCache tree = gpt_->NewCache(1, /*extra=*/4);
  BatchRow prefix;
  prefix.tokens = {1, 5, 6};
  prefix.positions = {0, 1, 2};
  ASSERT_TRUE(gpt_->Forward({prefix}, tree).ok());
  BatchRow t;
  t.cache_len = 3;
  t.tokens = {10, 11, 12};
  t.positions = {3, 4, 4};
  t.mask = {1, 0, 0,   // r sees itself
            1, 1, 0,   // c1 sees r
            1, 0, 1};  // c2 sees r, not c1
  auto out = gpt_->Forward({t}, tree);
  ASSERT_TRUE(out.ok());
  KvCache seq = gpt_->NewCache(1);
  at::Tensor s1 = Full(1, {5, 6, 10, 11}, seq, 0);
  KvCache seq2 = gpt_->NewCache(1);
  at::Tensor s2 = Full(1, {5, 6, 10, 12}, seq2, 0);
  EXPECT_LT(((*out)[1] - s1[4]).abs().max().item<float>(), 1e-5);
  EXPECT_LT(((*out)[2] - s2[4]).abs().max().item<float>(), 1e-5);
  EXPECT_GT(((*out)[1] - (*out)[2]).abs().max().item<float>(), 1e-3);  // the test has teeth
}

TEST_F(GptTest, ClassTokenHasZeroRope) {
  at::Tensor table = RopeTable2d(4, 8, 10000, 1);
  EXPECT_EQ(table[0].abs().sum().item<float>(), 0.0f);
  // Image token k = row * g + col at table row k + 1: first half row angles, last half col.
  EXPECT_NEAR(table[1 + 2 * 4 + 3][0][0].item<float>(), std::cos(2.0), 1e-6);
  EXPECT_NEAR(table[1 + 2 * 4 + 3][2][1].item<float>(), std::sin(3.0), 1e-6);
}

TEST_F(GptTest, BadBatchesAreRejected) {
  KvCache c = gpt_->NewCache(2);
  BatchRow r;
  r.tokens = {99};
  r.positions = {0};
  EXPECT_FALSE(gpt_->Forward({r}, c).ok());  // class id out of range
  r.tokens = {1};
  r.slot = 2;
  EXPECT_FALSE(gpt_->Forward({r}, c).ok());  // bad slot
  r.slot = 0;
  r.positions = {17};
  EXPECT_FALSE(gpt_->Forward({r}, c).ok());  // position past the sequence
  r.positions = {0};
  r.cache_len = 17;
  EXPECT_FALSE(gpt_->Forward({r}, c).ok());  // past the slot's capacity
  r.cache_len = 0;
  BatchRow r2 = r;
  EXPECT_FALSE(gpt_->Forward({r, r2}, c).ok());  // same slot twice
  EXPECT_FALSE(gpt_->Forward({}, c).ok());
  r.tokens = {1, 5};
  r.positions = {0, 1};
  r.mask = {1, 0, 1, 0};  // second token may not see itself: would leave it without keys
  EXPECT_FALSE(gpt_->Forward({r}, c).ok());
  r.mask = {1, 0, 1, 1};
  EXPECT_TRUE(gpt_->Forward({r}, c).ok());
}

}  // namespace
}  // namespace imagegen

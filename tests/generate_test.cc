// AR generation on the bundled model: determinism per seed, exact NFE, valid images.
#include "engine/decoding/ar_generator.h"

#include <gtest/gtest.h>

#include "engine/model/image_model.h"

namespace imagegen {
namespace {

class GenerateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadImageModel(DefaultModelsDir(), "fmnist-gpt", {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new ImageModel(std::move(m).value());
  }
  static void TearDownTestSuite() { delete model_; }
  static ImageRequest Req(int64_t cls, uint64_t seed) {
    ImageRequest r;
    r.class_id = cls;
    r.seed = seed;
    r.sampling.cfg_scale = model_->gpt->config().default_cfg_scale;
    r.sampling.top_k = model_->gpt->config().default_top_k;
    return r;
  }
  static ImageModel* model_;
};
ImageModel* GenerateTest::model_ = nullptr;

TEST_F(GenerateTest, SameSeedSameImageDifferentSeedDifferentImage) {
  ArGenerator gen(*model_->gpt);
  auto a = gen.Generate({Req(7, 11)});
  auto b = gen.Generate({Req(7, 11)});
  auto c = gen.Generate({Req(7, 12)});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ((*a)[0].tokens, (*b)[0].tokens);
  EXPECT_NE((*a)[0].tokens, (*c)[0].tokens);
  auto pa = TokensToImage(*model_->vq, (*a)[0].tokens);
  auto pb = TokensToImage(*model_->vq, (*b)[0].tokens);
  ASSERT_TRUE(pa.ok() && pb.ok());
  EXPECT_EQ(pa->pixels, pb->pixels);
  EXPECT_EQ(pa->width, 28);
  EXPECT_EQ(pa->pixels.size(), 28u * 28u);
}

TEST_F(GenerateTest, NfeIsOnePerTokenWithCfgCountedOnce) {
  ArGenerator gen(*model_->gpt);
  ImageRequest guided = Req(3, 1), plain = Req(3, 1);
  guided.sampling.cfg_scale = 3.0;
  plain.sampling.cfg_scale = 1.0;
  auto r = gen.Generate({guided, plain});
  ASSERT_TRUE(r.ok());
  const auto n = static_cast<size_t>(model_->gpt->config().block_size);
  for (const auto& res : *r) {
    EXPECT_EQ(res.tokens.size(), n);
    EXPECT_EQ(res.nfe, static_cast<int64_t>(n));
    for (int32_t t : res.tokens) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, model_->gpt->config().vocab_size);
    }
  }
  EXPECT_NE((*r)[0].tokens, (*r)[1].tokens);  // guidance changes the image
}

TEST_F(GenerateTest, TopKOneIsGreedyAndIgnoresTheSeed) {
  ArGenerator gen(*model_->gpt);
  ImageRequest a = Req(5, 1), b = Req(5, 2);
  a.sampling.top_k = b.sampling.top_k = 1;
  auto r = gen.Generate({a, b});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].tokens, (*r)[1].tokens);
}

TEST_F(GenerateTest, InvalidRequestsNameTheField) {
  ArGenerator gen(*model_->gpt);
  ImageRequest r = Req(10, 1);
  EXPECT_EQ(gen.Generate({r}).status().field(), "class_id");
  EXPECT_NE(gen.Generate({r}).status().message().find("class"), std::string::npos);
  r = Req(1, 1);
  r.sampling.top_p = 1.5;
  EXPECT_EQ(gen.Generate({r}).status().field(), "top_p");
  EXPECT_NE(gen.Generate({r}).status().message().find("top_p"), std::string::npos);
}

TEST_F(GenerateTest, ResolveClassByNameOrId) {
  const GptConfig& c = model_->gpt->config();
  EXPECT_EQ(*ResolveClass(c, "sneaker"), 7);
  EXPECT_EQ(*ResolveClass(c, "3"), 3);
  EXPECT_FALSE(ResolveClass(c, "10").ok());
  EXPECT_FALSE(ResolveClass(c, "giraffe").ok());
}

}  // namespace
}  // namespace imagegen

// MAR's configuration, diffusion schedule and mask schedule (the forward passes are checked
// against the Python reference in parity_test.cc).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/decoding/mar_sampler.h"
#include "engine/model/diffusion_head.h"
#include "engine/model/kl_decoder.h"
#include "engine/model/mar.h"

namespace imagegen {
namespace {

TEST(MarTest, SpacedTimestepsAsIddpmRespacesThem) {
  auto steps = SpacedTimesteps(1000, "100", "x");
  ASSERT_TRUE(steps.ok());
  ASSERT_EQ(steps->size(), 100u);
  // models.md 3.5: {0, 10, 20, 30, 40, 50, 61, 71, ..., 989, 999}.
  EXPECT_EQ(std::vector<int64_t>(steps->begin(), steps->begin() + 8),
            (std::vector<int64_t>{0, 10, 20, 30, 40, 50, 61, 71}));
  EXPECT_EQ(steps->at(98), 989);
  EXPECT_EQ(steps->back(), 999);
  auto sections = SpacedTimesteps(1000, "10,5", "x");
  ASSERT_TRUE(sections.ok());
  EXPECT_EQ(sections->size(), 15u);
  EXPECT_EQ(sections->at(10), 500);
  for (const char* bad : {"", "ddim50", "10,", "0", "1001", "-5"}) {
    auto s = SpacedTimesteps(1000, bad, "'num_sampling_steps'");
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("num_sampling_steps"), std::string::npos);
  }
}

TEST(MarTest, MaskScheduleRevealsEveryTokenExactlyOnce) {
  for (int64_t seq : {196, 256}) {
    for (int64_t iters = 1; iters <= seq; ++iters) {
      int64_t masked = seq, total = 0;
      for (int64_t step = 0; step < iters; ++step) {
        const int64_t n = MarPredictCount(seq, step, iters, masked);
        ASSERT_GE(n, 1) << seq << " " << iters << " " << step;
        total += n;
        masked -= n;
      }
      EXPECT_EQ(total, seq) << iters;
    }
  }
  // The cosine schedule front-loads nothing: at 64 iterations the first step predicts 1 token
  // of 256 (floor(256 cos(pi/128)) = 255).
  EXPECT_EQ(MarPredictCount(256, 0, 64, 256), 1);
  MarSamplingParams p;
  p.cfg_scale = 4;
  EXPECT_DOUBLE_EQ(MarCfgAt(p, 256, 256), 1.0);
  EXPECT_DOUBLE_EQ(MarCfgAt(p, 256, 0), 4.0);
  p.cfg_linear = false;
  EXPECT_DOUBLE_EQ(MarCfgAt(p, 256, 256), 4.0);
}

nlohmann::json SmallMar() {
  return {{"type", "mar"},           {"img_size", 256},
          {"vae_stride", 16},        {"vae_embed_dim", 16},
          {"class_num", 10},         {"encoder_embed_dim", 64},
          {"encoder_depth", 2},      {"encoder_num_heads", 4},
          {"decoder_embed_dim", 64}, {"decoder_depth", 2},
          {"decoder_num_heads", 4},  {"diffloss_d", 2},
          {"diffloss_w", 128},       {"num_sampling_steps", "100"}};
}

std::string MarError(const nlohmann::json& j) {
  auto c = ParseMarConfig(Json(j), "m/config.json");
  return c.ok() ? "" : c.status().message();
}

TEST(MarTest, ConfigErrorsNameTheFieldAndFile) {
  auto ok = ParseMarConfig(Json(SmallMar()), "m/config.json");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->seq_len(), 256);
  EXPECT_EQ(ok->token_dim(), 16);
  auto j = SmallMar();
  j["type"] = "llamagen-gpt";
  EXPECT_NE(MarError(j).find("'type'"), std::string::npos);
  j = SmallMar();
  j.erase("diffloss_w");
  EXPECT_NE(MarError(j).find("diffloss_w"), std::string::npos);
  j = SmallMar();
  j["encoder_num_heads"] = 5;
  EXPECT_NE(MarError(j).find("head counts"), std::string::npos);
  j = SmallMar();
  j["num_sampling_steps"] = "fast";
  EXPECT_NE(MarError(j).find("fast"), std::string::npos);
  j = SmallMar();
  j["class_names"] = {"a", "b"};
  EXPECT_NE(MarError(j).find("'class_names' has 2"), std::string::npos);
  j = SmallMar();
  j["sampling_defaults"] = {{"cfg_schedule", "cosine"}};
  EXPECT_NE(MarError(j).find("cfg_schedule"), std::string::npos);
  j = SmallMar();
  j["img_size"] = 250;
  EXPECT_NE(MarError(j).find("img_size"), std::string::npos);
  for (const char* e : {"m/config.json"}) EXPECT_NE(MarError(j).find(e), std::string::npos);
}

TEST(MarTest, KlConfigErrorsNameTheField) {
  nlohmann::json j = {
      {"type", "kl-autoencoder"}, {"embed_dim", 16},     {"z_channels", 16}, {"ch", 32},
      {"ch_mult", {1, 2, 2}},     {"num_res_blocks", 1}, {"resolution", 64}, {"num_groups", 8},
      {"latent_scale", 0.2325}};
  auto ok = ParseKlConfig(Json(j), "kl/config.json");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->grid(), 16);
  j["latent_scale"] = -1;
  auto bad = ParseKlConfig(Json(j), "kl/config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("latent_scale"), std::string::npos);
  j["latent_scale"] = 0.2;
  j["ch"] = 30;  // not a multiple of 8 groups
  bad = ParseKlConfig(Json(j), "kl/config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("num_groups"), std::string::npos);
}

}  // namespace
}  // namespace imagegen

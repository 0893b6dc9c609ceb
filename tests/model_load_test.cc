// Corrupt or mismatched model directories give a clear error naming the file and tensor, and
// never crash.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include "engine/model/gpt.h"
#include "engine/model/image_model.h"
#include "engine/model/vq_decoder.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

namespace fs = std::filesystem;
using testing::Contains;
using testing::TinyGptSpec;

class ModelLoadTest : public ::testing::Test {
 protected:
  std::string root_ = testing::TempDir("load");
  TinyGptSpec spec_;
  std::string Fresh(const std::string& name) {
    return testing::WriteTinyGpt(root_ + "/" + name, spec_, 3);
  }
  Status LoadStatus(const std::string& dir) { return Gpt::Load(dir, {}).status(); }
  void Rewrite(const std::string& dir,
               const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
    auto t = testing::TinyGptTensors(spec_, 3);
    edit(t);
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", t).ok());
  }
};

TEST_F(ModelLoadTest, ValidModelLoads) { EXPECT_TRUE(LoadStatus(Fresh("ok")).ok()); }

TEST_F(ModelLoadTest, MissingDirectoryOrConfig) {
  EXPECT_EQ(LoadStatus(root_ + "/nothing").code(), Code::kNotFound);
  std::string d = Fresh("noconfig");
  fs::remove(d + "/config.json");
  Status s = LoadStatus(d);
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_TRUE(Contains(s.message(), "config.json"));
}

TEST_F(ModelLoadTest, TruncatedWeightsAreDataLoss) {
  std::string d = Fresh("trunc");
  const auto size = fs::file_size(d + "/model.safetensors");
  fs::resize_file(d + "/model.safetensors", size / 2);
  Status s = LoadStatus(d);
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_TRUE(Contains(s.message(), "model.safetensors")) << s.message();
}

TEST_F(ModelLoadTest, GarbageWeightsAreDataLoss) {
  std::string d = Fresh("garbage");
  std::ofstream(d + "/model.safetensors", std::ios::trunc) << "this is not a safetensors file";
  EXPECT_EQ(LoadStatus(d).code(), Code::kDataLoss);
}

TEST_F(ModelLoadTest, MissingTensorIsNamed) {
  std::string d = Fresh("missing");
  Rewrite(d, [](auto& t) { t.erase("layers.1.feed_forward.w3.weight"); });
  Status s = LoadStatus(d);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(s.message(), "missing tensor 'layers.1.feed_forward.w3.weight'"))
      << s.message();
}

TEST_F(ModelLoadTest, UnexpectedTensorIsNamed) {
  std::string d = Fresh("extra");
  Rewrite(d, [](auto& t) { t["layers.2.attention.wo.weight"] = at::zeros({32, 32}); });
  Status s = LoadStatus(d);
  EXPECT_TRUE(Contains(s.message(), "unexpected tensors")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "layers.2.attention.wo.weight"));
}

TEST_F(ModelLoadTest, IgnorableTensorsAreIgnored) {
  std::string d = Fresh("ignorable");
  Rewrite(d, [](auto& t) {
    t["freqs_cis"] = at::zeros({17, 4, 2});
    t["layers.0.attention.kv_cache.k_cache"] = at::zeros({1});
  });
  EXPECT_TRUE(LoadStatus(d).ok());
}

TEST_F(ModelLoadTest, ShapeMismatchWithConfigIsNamed) {
  std::string d = Fresh("shape");
  std::string j = testing::TinyGptConfigJson(spec_);
  j.replace(j.find("\"dim\": 32"), 9, "\"dim\": 64");
  testing::WriteText(d + "/config.json", j);
  Status s = LoadStatus(d);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(s.message(), "has shape [24, 32] but config.json implies [24, 64]"))
      << s.message();
}

TEST_F(ModelLoadTest, IntegerWeightsAreRejected) {
  std::string d = Fresh("dtype");
  Rewrite(d, [](auto& t) { t["norm.weight"] = at::ones({32}, at::kLong); });
  Status s = LoadStatus(d);
  EXPECT_TRUE(Contains(s.message(), "'norm.weight' has dtype I64")) << s.message();
}

TEST_F(ModelLoadTest, BadConfigValuesAreNamed) {
  std::string d = Fresh("badcfg");
  testing::WriteText(d + "/config.json", R"({"dim": 32, "n_layer": 2, "n_head": 4})");
  EXPECT_TRUE(Contains(LoadStatus(d).message(), "'vocab_size' is missing"));
  testing::WriteText(d + "/config.json", "{\"dim\": 32,");
  EXPECT_TRUE(Contains(LoadStatus(d).message(), "invalid JSON"));
  std::string j = testing::TinyGptConfigJson(spec_);
  j.replace(j.find("\"block_size\": 16"), 16, "\"block_size\": 15");
  testing::WriteText(d + "/config.json", j);
  EXPECT_TRUE(Contains(LoadStatus(d).message(), "square")) << LoadStatus(d).message();
}

// A config whose sampling_defaults no request could use is refused at load, naming the file
// and the field (it used to load, and then every request that set no sampling field failed on
// a field its client never sent).
TEST_F(ModelLoadTest, BadSamplingDefaultsAreNamedAtLoad) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"cfg_scale", "1e300"}, {"temperature", "-5"}, {"top_k", "100000"}, {"top_p", "7"}};
  for (const auto& [field, value] : bad) {
    std::string d = Fresh("defaults_" + field);
    testing::WriteText(d + "/config.json",
                       testing::TinyGptConfigJson(
                           spec_, ", \"sampling_defaults\": {\"" + field + "\": " + value + "}"));
    const Status s = LoadStatus(d);
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << field;
    EXPECT_TRUE(Contains(s.message(), d + "/config.json")) << s.message();
    EXPECT_TRUE(Contains(s.message(), "'sampling_defaults." + field + "'")) << s.message();
  }
  // Guidance by default needs a null class.
  std::string d = Fresh("defaults_null");
  std::string j = testing::TinyGptConfigJson(spec_, ", \"sampling_defaults\": {\"cfg_scale\": 2}");
  j.replace(j.find("\"class_dropout_prob\": 0.1"), 25, "\"class_dropout_prob\": 0.0");
  testing::WriteText(d + "/config.json", j);
  EXPECT_TRUE(Contains(LoadStatus(d).message(), "null class")) << LoadStatus(d).message();
  // In range: loads.
  d = Fresh("defaults_ok");
  testing::WriteText(d + "/config.json",
                     testing::TinyGptConfigJson(
                         spec_, ", \"sampling_defaults\": {\"cfg_scale\": 4, \"top_k\": 24}"));
  EXPECT_TRUE(LoadStatus(d).ok()) << LoadStatus(d).ToString();
}

// A text-to-image config that guides by default needs a pad_id (the unconditional prompt's
// padding): without one it loaded, and every request that kept the default cfg_scale failed,
// naming a field its client never sent.
TEST(JanusConfigTest, DefaultGuidanceWithoutAPadIdIsRefusedAtLoad) {
  std::ifstream in(DefaultModelsDir() + "/fmnist-t2i/config.json");
  ASSERT_TRUE(in) << "no bundled text-to-image model";
  Json j = Json::parse(in);
  ASSERT_TRUE(ParseGptConfig(j, "t2i/config.json").ok());
  j.erase("pad_id");
  const auto no_pad = ParseGptConfig(j, "t2i/config.json");
  ASSERT_FALSE(no_pad.ok());
  EXPECT_EQ(no_pad.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(no_pad.status().message(), "'pad_id'")) << no_pad.status().message();
  j["sampling_defaults"]["cfg_scale"] = 1.0;  // no guidance by default: loads
  EXPECT_TRUE(ParseGptConfig(j, "t2i/config.json").ok());
}

// NaN or Inf weights (which load and draw one repeated token) are refused, naming the tensor.
TEST_F(ModelLoadTest, NonFiniteWeightsAreDataLoss) {
  for (double v : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
    std::string d = Fresh("nonfinite");
    Rewrite(d, [v](auto& t) {
      t["layers.1.feed_forward.w2.weight"][3][5] = v;
      t["layers.1.feed_forward.w2.weight"][7][1] = v;
    });
    const Status s = LoadStatus(d);
    EXPECT_EQ(s.code(), Code::kDataLoss) << v;
    EXPECT_TRUE(Contains(s.message(), "'layers.1.feed_forward.w2.weight' has 2 non-finite values"))
        << s.message();
  }
  // Finite in fp32 but beyond fp16's range: refused when serving in fp16.
  std::string d = Fresh("overflow");
  Rewrite(d, [](auto& t) { t["norm.weight"][0] = 1e6; });
  LoadOptions fp16;
  fp16.dtype = at::kHalf;
  const Status s = Gpt::Load(d, fp16).status();
  EXPECT_TRUE(Contains(s.message(), "'norm.weight' overflows")) << s.message();
  EXPECT_TRUE(LoadStatus(d).ok());  // fine in fp32
}

TEST_F(ModelLoadTest, AbsurdSizesAreRejectedBeforeAllocating) {
  std::string d = Fresh("huge");
  std::string j = testing::TinyGptConfigJson(spec_);
  j.replace(j.find("\"block_size\": 16"), 16, "\"block_size\": 4503599627370496");
  testing::WriteText(d + "/config.json", j);
  EXPECT_TRUE(Contains(LoadStatus(d).message(), "out of range")) << LoadStatus(d).message();
}

TEST_F(ModelLoadTest, NonRegularWeightFilesAreSkippedOrRejected) {
  std::string d = Fresh("fifo");
  ASSERT_EQ(::mkfifo((d + "/extra.safetensors").c_str(), 0600), 0);
  EXPECT_TRUE(LoadStatus(d).ok());  // the FIFO is not a weight file; nothing blocks
  auto f = SafetensorsFile::Open(d + "/extra.safetensors");
  EXPECT_EQ(f.status().code(), Code::kDataLoss);
}

TEST_F(ModelLoadTest, ModelNamesCannotBePaths) {
  for (const char* bad : {"../etc", "a/b", "", ".hidden", "x y"}) {
    auto m = LoadImageModel(root_, bad, {});
    EXPECT_EQ(m.status().code(), Code::kInvalidArgument) << bad;
  }
  EXPECT_EQ(LoadImageModel(root_, "absent", {}).status().code(), Code::kNotFound);
}

TEST_F(ModelLoadTest, TokenizerMismatchIsReported) {
  // The tiny GPT (vocab 24, 4x4 grid) against the bundled tokenizer (512 codes, 14x14).
  const std::string bundled = DefaultModelsDir() + "/fmnist-vq";
  if (!fs::exists(bundled + "/config.json")) GTEST_SKIP() << "no bundled tokenizer";
  std::string d = Fresh("gpt");
  fs::create_directory_symlink(fs::absolute(bundled), root_ + "/fmnist-vq");
  std::string j = testing::TinyGptConfigJson(spec_);
  j.insert(j.size() - 1, ", \"tokenizer\": \"fmnist-vq\"");
  testing::WriteText(d + "/config.json", j);
  auto m = LoadImageModel(root_, "gpt", {});
  EXPECT_EQ(m.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(m.status().message(), "vocab_size 24")) << m.status().message();
}

}  // namespace
}  // namespace imagegen

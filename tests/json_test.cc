#include "engine/util/json.h"

#include <gtest/gtest.h>

namespace imagegen {
namespace {

TEST(JsonTest, ParsesNestedDocument) {
  auto j = Json::Parse(R"({"a": [1, -2.5e1, true, null], "b": {"c": "x\u00e9\n"}})");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  const auto& a = j->Find("a")->as_array();
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a[0].as_number(), 1);
  EXPECT_EQ(a[1].as_number(), -25);
  EXPECT_TRUE(a[2].as_bool());
  EXPECT_TRUE(a[3].is_null());
  EXPECT_EQ(j->Find("b")->Find("c")->as_string(), "x\xc3\xa9\n");
}

TEST(JsonTest, RejectsMalformedInputWithOffset) {
  for (const char* bad : {"", "{", "{\"a\":}", "[1,]", "{\"a\":1}x", "\"\\q\"", "01", "{\"a\":1,\"a\":2}",
                          "[1 2]", "\"\x01\""}) {
    auto j = Json::Parse(bad);
    EXPECT_FALSE(j.ok()) << bad;
    EXPECT_NE(j.status().message().find("byte"), std::string::npos) << bad;
  }
}

TEST(JsonTest, RejectsDeepNesting) {
  EXPECT_FALSE(Json::Parse(std::string(100, '[') + std::string(100, ']')).ok());
  EXPECT_TRUE(Json::Parse(std::string(50, '[') + std::string(50, ']')).ok());
}

TEST(JsonTest, FieldsNameTheKey) {
  auto j = Json::Parse(R"({"dim": 1.5, "name": 3})");
  ASSERT_TRUE(j.ok());
  JsonFields f(*j, "config.json");
  auto dim = f.Int("dim");
  ASSERT_FALSE(dim.ok());
  EXPECT_NE(dim.status().message().find("'dim'"), std::string::npos);
  auto missing = f.Int("n_layer");
  EXPECT_NE(missing.status().message().find("'n_layer' is missing"), std::string::npos);
  EXPECT_EQ(*f.Int("n_layer", 7), 7);
  EXPECT_FALSE(f.String("name").ok());
}

}  // namespace
}  // namespace imagegen

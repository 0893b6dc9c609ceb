// What the engine adds on top of nlohmann::json: the limits for untrusted files, error
// messages with a byte offset, and the typed accessors' integer checks and key names.
#include "engine/util/json.h"

#include <gtest/gtest.h>

#include <cstdint>

#include <nlohmann/json.hpp>

namespace imagegen {
namespace {

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(JsonTest, ParsesADocument) {
  auto j = ParseJson(R"({"a": [1, -2.5e1, true, null], "b": {"c": "x\u00e9\n"}})");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)["a"].size(), 4u);
  EXPECT_EQ((*j)["b"]["c"], "x\xc3\xa9\n");
}

TEST(JsonTest, RejectsMalformedInputWithOffset) {
  for (const char* bad : {"", "{", "{\"a\":}", "[1,]", "{\"a\":1}x", "\"\\q\"", "01", "[1 2]",
                          "\"\x01\"", "\"\\ud800\""}) {
    auto j = ParseJson(bad);
    ASSERT_FALSE(j.ok()) << bad;
    EXPECT_EQ(j.status().code(), Code::kDataLoss) << bad;
    EXPECT_TRUE(Contains(j.status().message(), "invalid JSON at byte ")) << j.status().message();
  }
  EXPECT_TRUE(Contains(ParseJson("[1,]").status().message(), "at byte 4"));
  EXPECT_FALSE(ParseJson("1e999").ok());  // overflows a double
}

TEST(JsonTest, RejectsDuplicateKeysNamingThem) {
  auto j = ParseJson(R"({"a": {"w": 1, "x": 2}, "b": {"w": 1, "x": 2, "w": 3}})");
  ASSERT_FALSE(j.ok());
  EXPECT_TRUE(Contains(j.status().message(), "duplicate key \"w\"")) << j.status().message();
  // The same key in different objects is fine.
  EXPECT_TRUE(ParseJson(R"({"a": {"w": 1}, "b": {"w": 1}, "c": [{"w": 1}, {"w": 2}]})").ok());
}

TEST(JsonTest, RejectsNestingDeeperThanTheLimit) {
  auto nested = [](int n) { return std::string(n, '[') + std::string(n, ']'); };
  EXPECT_TRUE(ParseJson(nested(kMaxJsonDepth)).ok());
  auto deep = ParseJson(nested(kMaxJsonDepth + 1));
  ASSERT_FALSE(deep.ok());
  EXPECT_TRUE(Contains(deep.status().message(), "nesting deeper than 64"));
  // Stops at the limit: had it read on, the error would be the unexpected end of input.
  EXPECT_TRUE(Contains(ParseJson(std::string(1 << 20, '[')).status().message(), "nesting"));
  std::string objects;
  for (int i = 0; i < kMaxJsonDepth + 1; ++i) objects += "{\"k\":";
  EXPECT_FALSE(ParseJson(objects + "1" + std::string(kMaxJsonDepth + 1, '}')).ok());
}

TEST(JsonTest, IntAcceptsExactIntegersOnly) {
  auto j = ParseJson(R"({"a": 7, "b": -3, "c": 256.0, "d": 1.5, "e": "7", "f": true,
                         "g": 9223372036854775807, "h": 9223372036854775808, "i": 1e300})");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(JsonInt((*j)["a"]), 7);
  EXPECT_EQ(JsonInt((*j)["b"]), -3);
  EXPECT_EQ(JsonInt((*j)["c"]), 256);
  EXPECT_EQ(JsonInt((*j)["g"]), INT64_MAX);
  for (const char* k : {"d", "e", "f", "h", "i"}) EXPECT_FALSE(JsonInt((*j)[k]).has_value()) << k;
}

TEST(JsonTest, FieldsNameTheKey) {
  auto j = ParseJson(R"({"dim": 1.5, "name": 3, "ch_mult": [1, 2.5], "off": null})");
  ASSERT_TRUE(j.ok());
  JsonFields f(*j, "config.json");
  auto dim = f.Int("dim");
  ASSERT_FALSE(dim.ok());
  EXPECT_EQ(dim.status().message(), "config.json: 'dim' must be an integer");
  EXPECT_EQ(f.Int("n_layer").status().message(), "config.json: 'n_layer' is missing");
  EXPECT_EQ(*f.Int("n_layer", 7), 7);
  EXPECT_EQ(*f.Int("off", 7), 7);  // null counts as absent where there is a fallback
  EXPECT_FALSE(f.Int("off").ok());
  EXPECT_EQ(f.String("name").status().message(), "config.json: 'name' must be a string");
  EXPECT_EQ(f.IntList("ch_mult").status().message(),
            "config.json: 'ch_mult' must be a list of integers");
  EXPECT_NE(f.Find("off"), nullptr);
  EXPECT_EQ(f.Find("nope"), nullptr);
}

}  // namespace
}  // namespace imagegen

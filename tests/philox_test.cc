#include "engine/decoding/philox.h"

#include <gtest/gtest.h>

#include <set>

namespace imagegen {
namespace {

// Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
TEST(PhiloxTest, KnownAnswers) {
  EXPECT_EQ(Philox4x32({0, 0, 0, 0}, 0),
            (PhiloxBlock{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(Philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffffffffffull),
            (PhiloxBlock{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(Philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                       (uint64_t{0x299f31d0u} << 32) | 0xa4093822u),
            (PhiloxBlock{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(PhiloxTest, UniformIsAPureFunctionOfItsKey) {
  EXPECT_EQ(Uniform(7, 3, 1, Purpose::kSample), Uniform(7, 3, 1, Purpose::kSample));
  std::set<double> seen;
  for (uint32_t p = 0; p < 50; ++p) {
    seen.insert(Uniform(7, p, 0, Purpose::kSample));
    seen.insert(Uniform(7, p, 1, Purpose::kSample));
    seen.insert(Uniform(7, p, 0, Purpose::kAccept));
    seen.insert(Uniform(8, p, 0, Purpose::kSample));
  }
  EXPECT_EQ(seen.size(), 200u);
}

TEST(PhiloxTest, UniformMomentsAndRange) {
  double sum = 0, sum2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double u = Uniform(1, static_cast<uint32_t>(i), 0, Purpose::kSample);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sum2 += u * u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.003);
  EXPECT_NEAR(sum2 / n - (sum / n) * (sum / n), 1.0 / 12, 0.002);
}

}  // namespace
}  // namespace imagegen

#include "engine/util/status.h"

#include <gtest/gtest.h>

namespace imagegen {
namespace {

// One table names the engine's codes and gRPC's (the CLI and the server's metrics use it).
TEST(StatusTest, CodesHaveTheirCanonicalNames) {
  EXPECT_STREQ(StatusCodeName(Code::kOk), "OK");
  EXPECT_STREQ(StatusCodeName(Code::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_STREQ(StatusCodeName(Code::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_STREQ(StatusCodeName(Code::kDataLoss), "DATA_LOSS");
  EXPECT_STREQ(StatusCodeName(16), "UNAUTHENTICATED");
  EXPECT_STREQ(StatusCodeName(17), "UNKNOWN");
  EXPECT_STREQ(StatusCodeName(-1), "UNKNOWN");
  EXPECT_EQ(NotFound("m: no such model").ToString(), "NOT_FOUND: m: no such model");
  EXPECT_EQ(OkStatus().ToString(), "OK");
}

}  // namespace
}  // namespace imagegen

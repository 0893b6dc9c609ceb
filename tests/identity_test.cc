// Who a call is from: API keys (server/auth.h: the key file's lines, names and priorities,
// matching, reloading) and the caller's address behind trusted proxies (server/forwarded.h).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "engine/util/read_file.h"
#include "server/auth.h"
#include "server/forwarded.h"
#include "tests/temp_dir.h"

namespace imagegen {
namespace {

using server::ApiKey;
using server::ParseKeys;
using server::TokenAuth;
using server::TrustedProxies;

TEST(ApiKeysTest, LinesGiveTokensWithNamesAndPriorities) {
  auto keys = ParseKeys(
      "# the interactive app\n"
      "tok-a name=app priority=-1\n"
      "\n"
      "   tok-b\tname=batch   priority=10 max_in_flight=32 # may not ask for less\r\n"
      "tok-c==\n");  // base64 padding is part of a token
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  ASSERT_EQ(keys->size(), 3u);
  EXPECT_EQ((*keys)[0].token, "tok-a");
  EXPECT_EQ((*keys)[0].name, "app");
  EXPECT_EQ((*keys)[0].priority, -1);
  EXPECT_EQ((*keys)[1].token, "tok-b");
  EXPECT_EQ((*keys)[1].name, "batch");
  EXPECT_EQ((*keys)[1].priority, 10);
  EXPECT_EQ((*keys)[1].max_in_flight, 32);
  EXPECT_FALSE((*keys)[0].max_in_flight.has_value());
  EXPECT_EQ((*keys)[2].token, "tok-c==");
  EXPECT_EQ((*keys)[2].name, "");
  EXPECT_FALSE((*keys)[2].priority.has_value());
  // The format before names: the file is one token.
  keys = ParseKeys("s3cret-token-0123456789\n");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 1u);
  EXPECT_EQ((*keys)[0].token, "s3cret-token-0123456789");
  // A UTF-8 byte-order mark before it (a Windows editor's) is not part of the token.
  keys = ParseKeys("\xEF\xBB\xBFs3cret-token-0123456789 name=app\n");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ((*keys)[0].token, "s3cret-token-0123456789");
}

TEST(ApiKeysTest, BadLinesAreRefusedNamingTheLineAndWhatIsWrong) {
  const std::pair<std::string, const char*> bad[] = {
      {"", "no key"},
      {"# only a comment\n\n", "no key"},
      {"tok\nname=x tok2\n", "line 2: the token comes first"},
      {"tok two words\n", "line 1: field 2 is not an attribute"},
      {"tok name=\n", "line 1: name: 1 to 64"},
      {"tok name=has/slash\n", "line 1: name: 1 to 64"},
      {"tok name=a name=b\n", "line 1: name: given twice"},
      {"tok priority=high\n", "line 1: priority: must be an integer"},
      {"tok priority=99999999999\n", "line 1: priority: must be an integer"},
      {"tok weight=2\n", "line 1: field 2: an unknown attribute"},
      {"tok max_in_flight=4\n", "line 1: max_in_flight: needs a name"},
      {"tok name=a max_in_flight=0\n", "line 1: max_in_flight: must be an integer in [1,"},
      {"tok name=a max_in_flight=2 max_in_flight=3\n", "line 1: max_in_flight: given twice"},
      {"tok name=a\ntok name=b\n", "line 2: the same token as an earlier line"},
      {"t1 name=a\nt2 name=a\n", "line 2: name: 'a' is an earlier key's"},
      {"t1\n" + std::string(4097, 'x') + "\n", "line 2: the token is longer than 4096 bytes"},
      // A non-breaking space pasted into a token, a control byte, and a mark not at the start.
      {"t1\ntok\xC2\xA0x\n", "line 2: the token's byte 4 is not printable ASCII"},
      {"tok\x01\n", "line 1: the token's byte 4 is not printable ASCII"},
      {"t1\n\xEF\xBB\xBFt2\n", "line 2: the token's byte 1 is not printable ASCII"},
  };
  for (const auto& [text, message] : bad) {
    auto keys = ParseKeys(text);
    ASSERT_FALSE(keys.ok()) << text;
    EXPECT_NE(keys.status().message().find(message), std::string::npos)
        << text << " -> " << keys.status().message();
  }
  // A token written with a space in it: the error (which is logged) holds neither half.
  for (const char* text : {"s3cr3t-part1 s3cr3t-part2\n", "s3cr3t-part1 s3cr3t=part2\n"}) {
    auto keys = ParseKeys(text);
    ASSERT_FALSE(keys.ok()) << text;
    EXPECT_EQ(keys.status().message().find("s3cr3t"), std::string::npos) << keys.status().message();
  }
}

TEST(ApiKeysTest, AuthenticateFindsTheKeyAndReloadReplacesThem) {
  const std::string dir = testing::TempDir("api_keys");
  const std::string path = dir + "/keys";
  { std::ofstream(path) << "tok-a name=app priority=-1\ntok-b name=batch priority=10\n"; }
  auto auth = TokenAuth::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status().ToString();
  ASSERT_TRUE(auth->enabled());
  auto a = auth->AuthenticateHeader("Bearer tok-a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "app");
  EXPECT_EQ(auth->AuthenticateHeader("Bearer tok-b")->name, "batch");
  for (const std::string& wrong :
       std::vector<std::string>{"Bearer tok-c", "Bearer tok-", "Bearer tok-aa", "bearer tok-a",
                                "tok-a", "Bearer ", "", std::string("Bearer tok-a\0", 13)}) {
    EXPECT_EQ(auth->AuthenticateHeader(wrong), nullptr) << wrong;
  }
  // Longer than any key may be: refused without comparing.
  EXPECT_EQ(auth->AuthenticateHeader("Bearer " + std::string(4097, 'x')), nullptr);
  // Changed: not since it was read; yes once the file is replaced (a rename, as a Kubernetes
  // Secret volume does); no again once read.
  EXPECT_FALSE(auth->Changed());
  ASSERT_TRUE(WriteFileAtomically(path, "tok-a name=app priority=-1\ntok-b name=batch\n").ok());
  EXPECT_TRUE(auth->Changed());
  ASSERT_TRUE(auth->Reload().ok());
  EXPECT_FALSE(auth->Changed());
  EXPECT_FALSE(auth->AuthenticateHeader("Bearer tok-b")->priority.has_value());
  // Copies share the keys (the service's and the daemon's), and a reload replaces them for
  // every copy; a key already matched stays valid.
  const TokenAuth copy = *auth;
  { std::ofstream(path) << "tok-c name=new\n"; }
  auto n = copy.Reload();
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);
  EXPECT_EQ(auth->AuthenticateHeader("Bearer tok-a"), nullptr);
  EXPECT_EQ(auth->AuthenticateHeader("Bearer tok-c")->name, "new");
  EXPECT_EQ(a->name, "app");
  // A file that no longer parses (or is gone) leaves the keys as they were.
  { std::ofstream(path) << "tok-d name=bad/name\n"; }
  n = auth->Reload();
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("line 1: name"), std::string::npos) << n.status().message();
  std::remove(path.c_str());
  EXPECT_FALSE(auth->Reload().ok());
  EXPECT_EQ(auth->AuthenticateHeader("Bearer tok-c")->name, "new");
  // Disabled: every call is the open key (no name, no priority); nothing to reload.
  const TokenAuth open;
  auto k = open.AuthenticateHeader("");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->name, "");
  EXPECT_FALSE(k->priority.has_value());
  EXPECT_FALSE(open.Reload().ok());
  testing::RemoveTree(dir);
}

// What the daemon's poll sees: a key of the longest length is accepted; a chmod counts as a
// change (a file made readable is read); a symbolic link swapped to a new target (a Kubernetes
// Secret volume's update) counts, and its keys are read.
TEST(ApiKeysTest, LongestTokensChmodAndSymlinkSwaps) {
  const std::string dir = testing::TempDir("api_keys_swap");
  const std::string longest(server::kMaxTokenBytes, 'k');
  ASSERT_EQ(::mkdir((dir + "/v1").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((dir + "/v2").c_str(), 0700), 0);
  ASSERT_TRUE(WriteFileAtomically(dir + "/v1/keys", longest + " name=long\n").ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/v2/keys", "tok-v2 name=two\n").ok());
  ASSERT_EQ(::symlink("v1", (dir + "/data").c_str()), 0);
  const std::string path = dir + "/data/keys";
  auto auth = TokenAuth::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status().ToString();
  ASSERT_NE(auth->AuthenticateHeader("Bearer " + longest), nullptr);
  EXPECT_EQ(auth->AuthenticateHeader("Bearer " + longest)->name, "long");
  EXPECT_EQ(auth->AuthenticateHeader("Bearer " + longest.substr(1)), nullptr);
  EXPECT_FALSE(auth->Changed());
  ASSERT_EQ(::chmod((dir + "/v1/keys").c_str(), 0400), 0);
  EXPECT_TRUE(auth->Changed());
  ASSERT_TRUE(auth->Reload().ok());
  EXPECT_FALSE(auth->Changed());
  // The swap: a new link renamed over the old one.
  ASSERT_EQ(::symlink("v2", (dir + "/data.new").c_str()), 0);
  ASSERT_EQ(std::rename((dir + "/data.new").c_str(), (dir + "/data").c_str()), 0);
  EXPECT_TRUE(auth->Changed());
  ASSERT_TRUE(auth->Reload().ok());
  EXPECT_EQ(auth->AuthenticateHeader("Bearer tok-v2")->name, "two");
  EXPECT_EQ(auth->AuthenticateHeader("Bearer " + longest), nullptr);
  testing::RemoveTree(dir);
}

TEST(TrustedProxiesTest, RangesParseAndContainAddresses) {
  auto t = TrustedProxies::Parse("10.0.0.0/8, 192.168.1.7 ,fd00::/8,::1,::ffff:172.16.0.0/108");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  for (const char* in : {"10.0.0.1", "10.255.255.255", "192.168.1.7", "fd12::3", "::1", "[::1]",
                         "[::1]:443", "10.1.2.3:8080", "ipv4:10.1.2.3", "ipv6:[fd00::1]",
                         "ipv6:%5B::1%5D", "::ffff:10.9.9.9", "172.16.5.5"}) {
    EXPECT_TRUE(t->Contains(in)) << in;
  }
  for (const char* out : {"11.0.0.1", "192.168.1.8", "fe80::1", "::2", "172.32.0.1", "",
                          "not-an-address", "10.0.0.1.5"}) {
    EXPECT_FALSE(t->Contains(out)) << out;
  }
  EXPECT_TRUE(TrustedProxies::Parse("").ok());
  EXPECT_TRUE(TrustedProxies::Parse("")->empty());
  EXPECT_TRUE(TrustedProxies::Parse("0.0.0.0/0")->Contains("8.8.8.8"));
  const std::pair<const char*, const char*> bad[] = {
      {"10.0.0.0/33", "[0, 32]"},     {"fd00::/129", "[0, 128]"},
      {"10.0.0.0/x", "[0, 32]"},      {"proxy.local", "not an address"},
      {"10.0.0/8", "not an address"}, {"::ffff:10.0.0.0/95", "[96, 128]"},
  };
  for (const auto& [range, why] : bad) {
    auto p = TrustedProxies::Parse(range);
    ASSERT_FALSE(p.ok()) << range;
    EXPECT_NE(p.status().message().find(range), std::string::npos) << p.status().message();
    EXPECT_NE(p.status().message().find(why), std::string::npos) << p.status().message();
  }
}

TEST(TrustedProxiesTest, TheCallerIsTheFirstUntrustedAddressFromTheRight) {
  const TrustedProxies none;
  auto t = TrustedProxies::Parse("10.0.0.0/8,::1");
  ASSERT_TRUE(t.ok());
  // Without trusted proxies, or from an untrusted peer, X-Forwarded-For is ignored.
  EXPECT_EQ(none.ClientAddress("ipv4:10.0.0.5:4000", "203.0.113.9"), "ipv4:10.0.0.5");
  EXPECT_EQ(t->ClientAddress("ipv4:198.51.100.1:4000", "203.0.113.9"), "ipv4:198.51.100.1");
  // A trusted peer without the header is the caller.
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", ""), "ipv4:10.0.0.5");
  // Through one proxy, then two (the client's own entry on the left is spoofable and skipped
  // once an untrusted address is met).
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "203.0.113.9"), "ipv4:203.0.113.9");
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "1.2.3.4, 203.0.113.9, 10.0.0.6"),
            "ipv4:203.0.113.9");
  // All trusted: the leftmost.
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "10.1.1.1, 10.0.0.6"), "ipv4:10.1.1.1");
  // An entry that is not an address ends the walk at the last address read.
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "unknown, 10.0.0.6"), "ipv4:10.0.0.6");
  // IPv6 peers (gRPC escapes the brackets), bracketed entries with ports, v4 with ports.
  EXPECT_EQ(t->ClientAddress("ipv6:%5B::1%5D:4000", "[2001:db8::7]:5555"), "ipv6:[2001:db8::7]");
  EXPECT_EQ(t->ClientAddress("ipv6:[::1]:4000", "2001:db8::7"), "ipv6:[2001:db8::7]");
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "203.0.113.9:61000"), "ipv4:203.0.113.9");
  // An untrusted IPv6 peer in the one spelling; not forwarded.
  bool forwarded = true;
  EXPECT_EQ(t->ClientAddress("ipv6:%5B::2%5D:4000", "203.0.113.9", &forwarded), "ipv6:[::2]");
  EXPECT_FALSE(forwarded);
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "203.0.113.9", &forwarded), "ipv4:203.0.113.9");
  EXPECT_TRUE(forwarded);
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "", &forwarded), "ipv4:10.0.0.5");
  EXPECT_FALSE(forwarded);
  EXPECT_EQ(t->ClientAddress("unix:/run/imagegen.sock", "203.0.113.9"), "unix:/run/imagegen.sock");
  // Empty entries (a trailing comma, a proxy that had nothing to add) are skipped.
  EXPECT_EQ(t->ClientAddress("ipv4:10.0.0.5:4000", "203.0.113.9, ,"), "ipv4:203.0.113.9");
}

}  // namespace
}  // namespace imagegen

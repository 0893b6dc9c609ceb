// Tiny --name=value / --name value flag parser for the local programs (no Abseil in bench/,
// which must build on GPU hosts with only LibTorch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace imagegen {

class Flags {
 public:
  Flags(int argc, char** argv, std::map<std::string, std::string> defaults, std::string usage)
      : values_(std::move(defaults)), usage_(std::move(usage)) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "-h" || a == "--help") Usage(0);
      if (a.rfind("--", 0) != 0) Fail("unexpected argument '" + a + "'");
      a = a.substr(2);
      std::string value;
      if (auto eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        Fail("flag --" + a + " needs a value");
      }
      if (!values_.count(a)) Fail("unknown flag --" + a);
      values_[a] = value;
    }
  }
  const std::string& Str(const std::string& k) const { return values_.at(k); }
  double Num(const std::string& k) const {
    char* end = nullptr;
    const std::string& v = values_.at(k);
    double d = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') Fail("--" + k + " must be a number, got '" + v + "'");
    return d;
  }
  int64_t Int(const std::string& k) const {
    char* end = nullptr;
    const std::string& v = values_.at(k);
    long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0') Fail("--" + k + " must be an integer, got '" + v + "'");
    return n;
  }
  // A comma-separated flag's non-empty items.
  std::vector<std::string> List(const std::string& k) const {
    std::vector<std::string> out;
    std::stringstream ss(values_.at(k));
    for (std::string item; std::getline(ss, item, ',');) {
      if (!item.empty()) out.push_back(item);
    }
    return out;
  }
  // The same, each item one of `allowed` (else a failure naming the flag and the choices).
  std::vector<std::string> Choices(const std::string& k,
                                   const std::vector<std::string>& allowed) const {
    std::vector<std::string> out = List(k);
    for (const std::string& item : out) {
      if (std::find(allowed.begin(), allowed.end(), item) != allowed.end()) continue;
      std::string all;
      for (const std::string& a : allowed) all += (all.empty() ? "" : ", ") + a;
      Fail("--" + k + ": expected " + all + "; got '" + item + "'");
    }
    return out;
  }
  // The same, as integers.
  std::vector<int64_t> Ints(const std::string& k) const {
    std::vector<int64_t> out;
    for (const std::string& item : List(k)) {
      char* end = nullptr;
      const long long n = std::strtoll(item.c_str(), &end, 10);
      if (*end != '\0') Fail("--" + k + ": '" + item + "' is not an integer");
      out.push_back(n);
    }
    return out;
  }
  // The same, as numbers.
  std::vector<double> Nums(const std::string& k) const {
    std::vector<double> out;
    for (const std::string& item : List(k)) {
      char* end = nullptr;
      const double d = std::strtod(item.c_str(), &end);
      if (*end != '\0') Fail("--" + k + ": '" + item + "' is not a number");
      out.push_back(d);
    }
    return out;
  }
  [[noreturn]] void Fail(const std::string& msg) const {
    std::cerr << "error: " << msg << "\n";
    Usage(2);
  }
  [[noreturn]] void Usage(int code) const {
    std::cerr << usage_ << "\nflags (defaults):\n";
    for (const auto& [k, v] : values_) std::cerr << "  --" << k << " (" << v << ")\n";
    std::exit(code);
  }

 private:
  std::map<std::string, std::string> values_;
  std::string usage_;
};

}  // namespace imagegen

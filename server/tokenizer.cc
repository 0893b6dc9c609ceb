#include "server/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <fstream>
#include <queue>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "engine/util/json.h"

namespace imagegen::server {
namespace {

// --- UTF-8 ------------------------------------------------------------------------------------

// The length of the valid UTF-8 sequence at s[i], or 0 (overlong forms, surrogates and code
// points past U+10FFFF are invalid).
size_t Utf8Len(std::string_view s, size_t i, uint32_t* cp = nullptr) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  uint32_t v = 0;
  if (c < 0x80) {
    n = 1;
    v = c;
  } else if ((c & 0xE0) == 0xC0) {
    n = 2;
    v = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    v = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    v = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(i + k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  if (cp != nullptr) *cp = v;
  return n;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The characters of valid UTF-8 text, each as its bytes.
std::vector<std::string_view> Chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = Utf8Len(s, i);
    if (n == 0) n = 1;  // validated earlier; never splits a sequence
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// GPT-2's byte-to-character table: printable Latin-1 bytes map to themselves, the others to
// U+0100 upwards in byte order.
struct ByteTable {
  std::string to_char[256];
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteTable() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      AppendUtf8(printable ? static_cast<uint32_t>(b) : next++, &to_char[b]);
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};
const ByteTable& Bytes() {
  static const ByteTable t;
  return t;
}

// --- regular expressions ----------------------------------------------------------------------

// A pattern that fails on a text (a PCRE2 resource limit) ends Encode with an error; thrown
// through the splitters, caught in Tokenizer::Encode.
struct SplitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A compiled PCRE2 pattern in UTF mode with Unicode properties for \w, \d, \s and \b (what the
// Oniguruma patterns of tokenizer.json files assume).
class Regex {
 public:
  static StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern,
                                                  const std::string& where) {
    int err = 0;
    PCRE2_SIZE at = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return DataLoss(where + ": the pattern does not compile at offset " + std::to_string(at) +
                      ": " + reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if it fails
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Every non-overlapping match, left to right, as [start, end) byte offsets. After an empty
  // match the search resumes one character later.
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t start = 0;
    while (start <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start,
                                 PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {  // a resource limit (match, depth, JIT stack): not "no more matches"
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        pcre2_match_data_free(md);
        throw SplitError(std::string("the pre-tokenizer's pattern failed on this text: ") +
                         reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      out.emplace_back(ov[0], ov[1]);
      if (ov[1] > ov[0]) {
        start = ov[1];
      } else {
        if (ov[1] >= s.size()) break;
        size_t n = Utf8Len(s, ov[1]);
        start = ov[1] + (n == 0 ? 1 : n);
      }
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// A split pattern: a literal string or a regular expression.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view s) const {
    if (regex) return regex->FindAll(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal.empty()) return out;
    for (size_t i = s.find(literal); i != std::string_view::npos;
         i = s.find(literal, i + literal.size())) {
      out.emplace_back(i, i + literal.size());
    }
    return out;
  }
};

// --- splitting --------------------------------------------------------------------------------

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits `s` at the matches of `p` (or, inverted, keeps the matches and splits at the rest), the
// way the `tokenizers` package's SplitDelimiterBehavior does; empty pieces are dropped.
std::vector<std::string> SplitBy(const std::string& s, const Pattern& p, Behavior behavior,
                                 bool invert) {
  struct Seg {
    size_t a, b;
    bool match;
  };
  std::vector<Seg> segs;
  size_t prev = 0;
  for (const auto& [a, b] : p.FindAll(s)) {
    if (a > prev) segs.push_back({prev, a, invert});
    segs.push_back({a, b, !invert});
    prev = b;
  }
  if (prev < s.size()) segs.push_back({prev, s.size(), invert});

  std::vector<Seg> out;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const Seg& g : segs)
        if (!g.match) out.push_back(g);
      break;
    case Behavior::kIsolated:
      out = segs;
      break;
    case Behavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const Seg& g : segs) {
        if (g.match && !prev_match && !out.empty()) {
          out.back().b = g.b;
        } else {
          out.push_back(g);
        }
        prev_match = g.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !prev_match && !out.empty()) {
          out.back().a = it->a;
        } else {
          out.push_back(*it);
        }
        prev_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case Behavior::kContiguous: {
      bool prev_match = false;
      for (const Seg& g : segs) {
        if (g.match == prev_match && !out.empty()) {
          out.back().b = g.b;
        } else {
          out.push_back(g);
        }
        prev_match = g.match;
      }
      break;
    }
  }
  std::vector<std::string> pieces;
  for (const Seg& g : out)
    if (g.b > g.a) pieces.push_back(s.substr(g.a, g.b - g.a));
  return pieces;
}

// --- normalizers ------------------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string Apply(const std::string& s) const = 0;
};

class UnicodeForm : public Normalizer {
 public:
  explicit UnicodeForm(const icu::Normalizer2* n) : n_(n) {}
  std::string Apply(const std::string& s) const override {
    UErrorCode err = U_ZERO_ERROR;
    icu::UnicodeString out = n_->normalize(icu::UnicodeString::fromUTF8(s), err);
    std::string r;
    if (U_FAILURE(err)) return s;
    out.toUTF8String(r);
    return r;
  }

 private:
  const icu::Normalizer2* n_;
};

class Lowercase : public Normalizer {
 public:
  std::string Apply(const std::string& s) const override {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
    u.toLower(icu::Locale::getRoot());
    std::string r;
    u.toUTF8String(r);
    return r;
  }
};

class Replace : public Normalizer {
 public:
  Replace(Pattern p, std::string content) : p_(std::move(p)), content_(std::move(content)) {}
  std::string Apply(const std::string& s) const override {
    std::string r;
    size_t prev = 0;
    for (const auto& [a, b] : p_.FindAll(s)) {
      r.append(s, prev, a - prev);
      r += content_;
      prev = b;
    }
    r.append(s, prev, std::string::npos);
    return r;
  }

 private:
  Pattern p_;
  std::string content_;
};

class Prepend : public Normalizer {
 public:
  explicit Prepend(std::string p) : p_(std::move(p)) {}
  std::string Apply(const std::string& s) const override { return s.empty() ? s : p_ + s; }

 private:
  std::string p_;
};

class Strip : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  std::string Apply(const std::string& s) const override;

 private:
  bool left_, right_;
};

bool IsWhitespace(uint32_t c) {  // Unicode White_Space, as Rust's char::is_whitespace
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The start of the character that ends just before `at` (never below `floor`).
size_t PrevChar(std::string_view s, size_t floor, size_t at) {
  size_t k = at - 1;
  while (k > floor && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  return k;
}

// `from` moved forward past whitespace characters, not beyond `limit`.
size_t SkipWhitespace(std::string_view s, size_t from, size_t limit) {
  while (from < limit) {
    uint32_t c = 0;
    const size_t n = Utf8Len(s, from, &c);
    if (n == 0 || !IsWhitespace(c)) break;
    from += n;
  }
  return from;
}

// `end` moved back past whitespace characters, not below `floor`.
size_t SkipWhitespaceBack(std::string_view s, size_t floor, size_t end) {
  while (end > floor) {
    const size_t k = PrevChar(s, floor, end);
    uint32_t c = 0;
    if (Utf8Len(s, k, &c) == 0 || !IsWhitespace(c)) break;
    end = k;
  }
  return end;
}

std::string Strip::Apply(const std::string& s) const {
  const size_t a = left_ ? SkipWhitespace(s, 0, s.size()) : 0;
  const size_t b = right_ ? SkipWhitespaceBack(s, a, s.size()) : s.size();
  return s.substr(a, b - a);
}

class NormalizerSequence : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> parts;
  std::string Apply(const std::string& s) const override {
    std::string r = s;
    for (const auto& n : parts) r = n->Apply(r);
    return r;
  }
};

// --- pre-tokenizers ---------------------------------------------------------------------------

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits every piece further (and, for ByteLevel, maps its bytes to characters).
  virtual std::vector<std::string> Apply(std::vector<std::string> pieces) const = 0;
};

class SplitPre : public PreTokenizer {
 public:
  SplitPre(Pattern p, Behavior b, bool invert) : p_(std::move(p)), b_(b), invert_(invert) {}
  std::vector<std::string> Apply(std::vector<std::string> pieces) const override {
    std::vector<std::string> out;
    for (const std::string& s : pieces) {
      for (std::string& t : SplitBy(s, p_, b_, invert_)) out.push_back(std::move(t));
    }
    return out;
  }

 private:
  Pattern p_;
  Behavior b_;
  bool invert_;
};

// GPT-2's split: contractions, letters, numbers, other symbols, each with an optional leading
// space, then whitespace runs (a run's last space goes with the next word).
constexpr const char* kGpt2Split =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPre : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, std::unique_ptr<Regex> split)
      : add_prefix_space_(add_prefix_space), split_(std::move(split)) {}
  std::vector<std::string> Apply(std::vector<std::string> pieces) const override {
    std::vector<std::string> out;
    for (std::string& s : pieces) {
      if (add_prefix_space_ && (s.empty() || s[0] != ' ')) s.insert(s.begin(), ' ');
      std::vector<std::string> parts;
      if (split_) {  // isolated: the matches and whatever lies between them
        size_t prev = 0;
        for (const auto& [a, b] : split_->FindAll(s)) {
          if (a > prev) parts.push_back(s.substr(prev, a - prev));
          if (b > a) parts.push_back(s.substr(a, b - a));
          prev = b;
        }
        if (prev < s.size()) parts.push_back(s.substr(prev));
      } else {
        parts.push_back(s);
      }
      for (const std::string& t : parts) {
        std::string mapped;
        for (unsigned char c : t) mapped += Bytes().to_char[c];
        if (!mapped.empty()) out.push_back(std::move(mapped));
      }
    }
    return out;
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> split_;
};

class PreSequence : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  std::vector<std::string> Apply(std::vector<std::string> pieces) const override {
    for (const auto& p : parts) pieces = p->Apply(std::move(pieces));
    return pieces;
  }
};

// --- post-processors --------------------------------------------------------------------------

// Only the single-sequence template matters here: ids before and after the sequence.
struct Template {
  std::vector<int32_t> before, after;
};

// --- JSON helpers -----------------------------------------------------------------------------

std::string Where(const std::string& what, const std::string& key) { return what + ": " + key; }

StatusOr<std::string> TypeOf(const Json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    return DataLoss(where + ": expected an object with a string 'type'");
  return j["type"].get<std::string>();
}

StatusOr<Pattern> ParsePattern(const Json& j, const std::string& where) {
  Pattern p;
  if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    ASSIGN_OR_RETURN(p.regex, Regex::Compile(j["Regex"].get<std::string>(), where));
  } else if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    p.literal = j["String"].get<std::string>();
  } else {
    return DataLoss(where + ": expected {\"Regex\": ...} or {\"String\": ...}");
  }
  return p;
}

StatusOr<Behavior> ParseBehavior(const Json& j, const std::string& where) {
  const std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return DataLoss(where + ": unknown behavior '" + b + "'");
}

bool BoolOr(const Json& j, const char* key, bool fallback) {
  return j.is_object() && j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : fallback;
}

StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const Json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<Normalizer>();
  ASSIGN_OR_RETURN(const std::string type, TypeOf(j, where));
  UErrorCode err = U_ZERO_ERROR;
  if (type == "Sequence") {
    auto seq = std::make_unique<NormalizerSequence>();
    const Json& list = j.contains("normalizers") ? j["normalizers"] : Json();
    if (!list.is_array()) return DataLoss(where + ".normalizers: expected a list");
    for (size_t i = 0; i < list.size(); ++i) {
      ASSIGN_OR_RETURN(auto n,
                       ParseNormalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]"));
      if (n) seq->parts.push_back(std::move(n));
    }
    return std::unique_ptr<Normalizer>(std::move(seq));
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    const icu::Normalizer2* n = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
                                : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
                                : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                                                 : icu::Normalizer2::getNFKDInstance(err);
    if (U_FAILURE(err) || n == nullptr) return Internal(where + ": ICU has no " + type);
    return std::unique_ptr<Normalizer>(std::make_unique<UnicodeForm>(n));
  }
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(std::make_unique<Lowercase>());
  if (type == "Replace") {
    if (!j.contains("pattern") || !j.contains("content") || !j["content"].is_string())
      return DataLoss(where + ": Replace needs 'pattern' and 'content'");
    ASSIGN_OR_RETURN(Pattern p, ParsePattern(j["pattern"], where + ".pattern"));
    return std::unique_ptr<Normalizer>(
        std::make_unique<Replace>(std::move(p), j["content"].get<std::string>()));
  }
  if (type == "Prepend") {
    if (!j.contains("prepend") || !j["prepend"].is_string())
      return DataLoss(where + ": Prepend needs 'prepend'");
    return std::unique_ptr<Normalizer>(std::make_unique<Prepend>(j["prepend"].get<std::string>()));
  }
  if (type == "Strip") {
    return std::unique_ptr<Normalizer>(
        std::make_unique<Strip>(BoolOr(j, "strip_left", true), BoolOr(j, "strip_right", true)));
  }
  return FailedPrecondition(where + ": the normalizer type '" + type + "' is not supported");
}

StatusOr<std::unique_ptr<PreTokenizer>> ParsePre(const Json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<PreTokenizer>();
  ASSIGN_OR_RETURN(const std::string type, TypeOf(j, where));
  if (type == "Sequence") {
    auto seq = std::make_unique<PreSequence>();
    const Json& list = j.contains("pretokenizers") ? j["pretokenizers"] : Json();
    if (!list.is_array()) return DataLoss(where + ".pretokenizers: expected a list");
    for (size_t i = 0; i < list.size(); ++i) {
      ASSIGN_OR_RETURN(auto p,
                       ParsePre(list[i], where + ".pretokenizers[" + std::to_string(i) + "]"));
      if (p) seq->parts.push_back(std::move(p));
    }
    return std::unique_ptr<PreTokenizer>(std::move(seq));
  }
  if (type == "Split") {
    if (!j.contains("pattern")) return DataLoss(where + ": Split needs 'pattern'");
    ASSIGN_OR_RETURN(Pattern p, ParsePattern(j["pattern"], where + ".pattern"));
    ASSIGN_OR_RETURN(Behavior b, ParseBehavior(j.contains("behavior") ? j["behavior"] : Json(),
                                               where + ".behavior"));
    return std::unique_ptr<PreTokenizer>(
        std::make_unique<SplitPre>(std::move(p), b, BoolOr(j, "invert", false)));
  }
  if (type == "Digits") {
    Pattern p;
    ASSIGN_OR_RETURN(p.regex, Regex::Compile(R"(\p{N})", where));
    return std::unique_ptr<PreTokenizer>(std::make_unique<SplitPre>(
        std::move(p),
        BoolOr(j, "individual_digits", false) ? Behavior::kIsolated : Behavior::kContiguous,
        false));
  }
  if (type == "Punctuation") {
    Pattern p;
    // Rust's char::is_ascii_punctuation or a Unicode punctuation category.
    ASSIGN_OR_RETURN(p.regex, Regex::Compile(R"([\p{P}!-/:-@\[-`{-~])", where));
    ASSIGN_OR_RETURN(Behavior b, j.contains("behavior")
                                     ? ParseBehavior(j["behavior"], where + ".behavior")
                                     : StatusOr<Behavior>(Behavior::kIsolated));
    return std::unique_ptr<PreTokenizer>(std::make_unique<SplitPre>(std::move(p), b, false));
  }
  if (type == "WhitespaceSplit") {
    Pattern p;
    ASSIGN_OR_RETURN(p.regex, Regex::Compile(R"(\s+)", where));
    return std::unique_ptr<PreTokenizer>(
        std::make_unique<SplitPre>(std::move(p), Behavior::kRemoved, false));
  }
  if (type == "Whitespace") {
    Pattern p;
    ASSIGN_OR_RETURN(p.regex, Regex::Compile(R"(\w+|[^\w\s]+)", where));
    return std::unique_ptr<PreTokenizer>(
        std::make_unique<SplitPre>(std::move(p), Behavior::kRemoved, true));
  }
  if (type == "ByteLevel") {
    std::unique_ptr<Regex> split;
    if (BoolOr(j, "use_regex", true)) {
      ASSIGN_OR_RETURN(split, Regex::Compile(kGpt2Split, where));
    }
    return std::unique_ptr<PreTokenizer>(
        std::make_unique<ByteLevelPre>(BoolOr(j, "add_prefix_space", true), std::move(split)));
  }
  return FailedPrecondition(where + ": the pre_tokenizer type '" + type + "' is not supported");
}

}  // namespace

// --- the tokenizer ----------------------------------------------------------------------------

namespace {
// Ids at or past this are refused when a tokenizer.json is read (the largest vocabularies have
// a few hundred thousand): an id of 2^31 would otherwise size the id table at 64 GiB.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// A merge's key: its two symbols joined by a byte that valid UTF-8 (every token's text) never
// holds, so no two pairs share a key.
constexpr char kMergeSeparator = '\xff';
std::string MergeKey(std::string_view a, std::string_view b) {
  std::string k(a);
  k += kMergeSeparator;
  k.append(b);
  return k;
}
}  // namespace

struct Tokenizer::Impl {
  struct Added {
    std::string content;
    int32_t id = 0;
    bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
  };
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;
  // The rank of each merge, keyed by MergeKey(a, b).
  std::unordered_map<std::string, int32_t> merge_rank;
  std::vector<Added> added;
  std::unordered_map<std::string, size_t> added_by_content;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre;
  std::optional<int32_t> unk;
  bool fuse_unk = false, ignore_merges = false, byte_fallback = false;
  Template tmpl;

  // Splits `text` at added tokens (leftmost, longest first), honouring lstrip, rstrip and
  // single_word. Pieces: (text, added index or -1).
  std::vector<std::pair<std::string, int>> SplitAdded(const std::string& text,
                                                      bool normalized_pass) const;
  void Bpe(const std::string& word, std::vector<int32_t>* out) const;
};

std::vector<std::pair<std::string, int>> Tokenizer::Impl::SplitAdded(const std::string& text,
                                                                     bool normalized_pass) const {
  std::vector<std::pair<std::string, int>> out;
  size_t start = 0, i = 0;  // start: the first byte not yet emitted
  auto is_word = [](std::string_view s, size_t at, bool before) {
    // The character just before `at` (before) or at `at` is a word character.
    size_t k = at;
    if (before) {
      if (at == 0) return false;
      k = PrevChar(s, 0, at);
    } else if (at >= s.size()) {
      return false;
    }
    uint32_t c = 0;
    if (Utf8Len(s, k, &c) == 0) return false;
    // Unicode's \w (UTS #18): alphabetic, marks, decimal digits, connector punctuation and
    // join controls, as the `tokenizers` package's word test.
    const auto u = static_cast<UChar32>(c);
    return u_hasBinaryProperty(u, UCHAR_ALPHABETIC) ||
           (U_GET_GC_MASK(u) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0 ||
           u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL);
  };
  while (i < text.size()) {
    // The longest added token starting at i.
    int best = -1;
    size_t best_len = 0;
    for (size_t k = 0; k < added.size(); ++k) {
      const Added& a = added[k];
      if (a.normalized != normalized_pass || a.content.empty()) continue;
      if (a.content.size() > best_len && text.compare(i, a.content.size(), a.content) == 0) {
        if (a.single_word && (is_word(text, i, true) || is_word(text, i + a.content.size(), false)))
          continue;
        best = static_cast<int>(k);
        best_len = a.content.size();
      }
    }
    if (best < 0) {
      size_t n = Utf8Len(text, i);
      i += n == 0 ? 1 : n;
      continue;
    }
    const Added& a = added[static_cast<size_t>(best)];
    const size_t from = a.lstrip ? SkipWhitespaceBack(text, start, i) : i;
    const size_t to = a.rstrip ? SkipWhitespace(text, i + best_len, text.size()) : i + best_len;
    if (from > start) out.emplace_back(text.substr(start, from - start), -1);
    out.emplace_back(a.content, best);
    start = i = to;
  }
  if (start < text.size()) out.emplace_back(text.substr(start), -1);
  return out;
}

void Tokenizer::Impl::Bpe(const std::string& word, std::vector<int32_t>* out) const {
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  // The word's symbols, a doubly linked list over its characters, each named by the byte where
  // it starts; a merge grows the left symbol and kills the right one (length 0). The candidate
  // merges (adjacent pairs that have a rank) wait in a heap ordered by rank, then position,
  // which is the order `tokenizers` merges in (the lowest-ranked pair, leftmost first), in
  // O(n log n): a scan of every pair for each merge took quadratic time, minutes for a 64 KiB
  // prompt of one word. A candidate is stale once either symbol changed length; a pair that
  // still has its lengths has its text, since symbols are contiguous.
  struct Sym {
    size_t len;
    size_t prev, next;  // byte offsets of the neighbours; kNone at either end
  };
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<Sym> syms(word.size(), Sym{0, kNone, kNone});
  size_t last = kNone;
  for (std::string_view c : Chars(word)) {
    const size_t at = static_cast<size_t>(c.data() - word.data());
    syms[at] = Sym{c.size(), last, kNone};
    if (last != kNone) syms[last].next = at;
    last = at;
  }
  struct Candidate {
    int32_t rank;
    size_t left, left_len, right_len;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  std::string key;
  auto consider = [&](size_t left) {
    if (left == kNone) return;
    const size_t right = syms[left].next;
    if (right == kNone) return;
    key.assign(word, left, syms[left].len);
    key += kMergeSeparator;
    key.append(word, right, syms[right].len);
    if (auto it = merge_rank.find(key); it != merge_rank.end())
      heap.push(Candidate{it->second, left, syms[left].len, syms[right].len});
  };
  for (size_t at = 0; at != kNone && !word.empty(); at = syms[at].next) consider(at);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Sym& l = syms[c.left];
    if (l.len != c.left_len || l.next == kNone || syms[l.next].len != c.right_len) continue;
    Sym& r = syms[l.next];
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (l.next != kNone) syms[l.next].prev = c.left;
    consider(l.prev);
    consider(c.left);
  }
  std::vector<std::string> pieces;
  for (size_t at = 0; at != kNone && !word.empty(); at = syms[at].next)
    pieces.push_back(word.substr(at, syms[at].len));
  bool last_unk = false;
  for (const std::string& s : pieces) {
    if (auto it = vocab.find(s); it != vocab.end()) {
      out->push_back(it->second);
      last_unk = false;
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      std::vector<int32_t> bytes;
      for (unsigned char c : s) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", c);
        auto it = vocab.find(name);
        if (it == vocab.end()) {
          all = false;
          break;
        }
        bytes.push_back(it->second);
      }
      if (all) {
        out->insert(out->end(), bytes.begin(), bytes.end());
        last_unk = false;
        continue;
      }
    }
    if (unk.has_value()) {
      if (!(fuse_unk && last_unk)) out->push_back(*unk);
      last_unk = true;
    }
    // Without an unknown token a symbol outside the vocabulary is dropped, as `tokenizers` does.
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str(), path);
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(const std::string& text,
                                                         const std::string& what) {
  // A field of an unexpected JSON type that a check above missed throws in nlohmann's get<>():
  // the file is refused, not the daemon ended.
  try {
    return FromJsonChecked(text, what);
  } catch (const Json::exception& e) {
    return DataLoss(what + ": " + e.what());
  }
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJsonChecked(const std::string& text,
                                                                const std::string& what) {
  ASSIGN_OR_RETURN(const Json j, ParseJson(text));
  if (!j.is_object()) return DataLoss(what + ": expected a JSON object");
  auto impl = std::make_unique<Impl>();

  // The model.
  const Json& model = j.contains("model") ? j["model"] : Json();
  ASSIGN_OR_RETURN(const std::string mtype, model.is_object() && !model.contains("type")
                                                ? StatusOr<std::string>("BPE")
                                                : TypeOf(model, what + ": model"));
  if (mtype != "BPE")
    return FailedPrecondition(what + ": model.type '" + mtype + "' is not supported (BPE only)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() &&
        !(model[key].is_string() && model[key].get<std::string>().empty()))
      return FailedPrecondition(Where(what, std::string("model.") + key) + " is not supported");
  }
  if (model.contains("dropout") && !model["dropout"].is_null())
    return FailedPrecondition(Where(what, "model.dropout") + " is not supported");
  const Json& vocab = model.contains("vocab") ? model["vocab"] : Json();
  if (!vocab.is_object()) return DataLoss(Where(what, "model.vocab") + ": expected an object");
  int64_t max_id = -1;
  for (const auto& [tok, id] : vocab.items()) {
    const auto v = JsonInt(id);
    if (!v || *v < 0 || *v >= kMaxTokenId)
      return DataLoss(Where(what, "model.vocab") + ": the id of '" + tok +
                      "' is not an id in [0, " + std::to_string(kMaxTokenId) + ")");
    impl->vocab[tok] = static_cast<int32_t>(*v);
    max_id = std::max(max_id, *v);
  }
  const Json& merges = model.contains("merges") ? model["merges"] : Json::array();
  if (!merges.is_array()) return DataLoss(Where(what, "model.merges") + ": expected a list");
  for (size_t r = 0; r < merges.size(); ++r) {
    const Json& m = merges[r];
    std::string a, b;
    if (m.is_string()) {  // "a b"
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size())
        return DataLoss(Where(what, "model.merges[" + std::to_string(r) + "]") +
                        ": expected two symbols separated by a space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return DataLoss(Where(what, "model.merges[" + std::to_string(r) + "]") +
                      ": expected \"a b\" or [\"a\", \"b\"]");
    }
    impl->merge_rank.emplace(MergeKey(a, b), static_cast<int32_t>(r));
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto it = impl->vocab.find(model["unk_token"].get<std::string>());
    if (it != impl->vocab.end()) impl->unk = it->second;
  }
  impl->fuse_unk = BoolOr(model, "fuse_unk", false);
  impl->ignore_merges = BoolOr(model, "ignore_merges", false);
  impl->byte_fallback = BoolOr(model, "byte_fallback", false);

  // Added tokens.
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const Json& list = j["added_tokens"];
    if (!list.is_array()) return DataLoss(Where(what, "added_tokens") + ": expected a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const Json& t = list[i];
      const std::string where = Where(what, "added_tokens[" + std::to_string(i) + "]");
      const auto id = t.is_object() && t.contains("id") ? JsonInt(t["id"]) : std::nullopt;
      if (!id || *id < 0 || *id >= kMaxTokenId || !t.contains("content") ||
          !t["content"].is_string())
        return DataLoss(where + ": expected 'id' (in [0, " + std::to_string(kMaxTokenId) +
                        ")) and 'content'");
      Impl::Added a;
      a.content = t["content"].get<std::string>();
      a.id = static_cast<int32_t>(*id);
      a.special = BoolOr(t, "special", false);
      a.single_word = BoolOr(t, "single_word", false);
      a.lstrip = BoolOr(t, "lstrip", false);
      a.rstrip = BoolOr(t, "rstrip", false);
      a.normalized = BoolOr(t, "normalized", !a.special);
      impl->added_by_content[a.content] = impl->added.size();
      impl->added.push_back(a);
      max_id = std::max<int64_t>(max_id, *id);
    }
  }
  impl->id_to_token.assign(static_cast<size_t>(max_id + 1), "");
  for (const auto& [tok, id] : impl->vocab) impl->id_to_token[static_cast<size_t>(id)] = tok;
  for (const auto& a : impl->added) {
    impl->id_to_token[static_cast<size_t>(a.id)] = a.content;
    impl->vocab.emplace(a.content, a.id);
  }

  ASSIGN_OR_RETURN(
      impl->normalizer,
      ParseNormalizer(j.contains("normalizer") ? j["normalizer"] : Json(), what + ": normalizer"));
  ASSIGN_OR_RETURN(impl->pre, ParsePre(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : Json(),
                                       what + ": pre_tokenizer"));

  // The post-processor: the single-sequence template.
  std::vector<const Json*> procs;
  const Json& post = j.contains("post_processor") ? j["post_processor"] : Json();
  if (!post.is_null()) {
    ASSIGN_OR_RETURN(const std::string ptype, TypeOf(post, what + ": post_processor"));
    if (ptype == "Sequence" && post.contains("processors") && post["processors"].is_array()) {
      for (const Json& p : post["processors"]) procs.push_back(&p);
    } else {
      procs.push_back(&post);
    }
  }
  for (const Json* p : procs) {
    ASSIGN_OR_RETURN(const std::string ptype, TypeOf(*p, what + ": post_processor"));
    if (ptype == "ByteLevel") continue;  // offsets only
    if (ptype == "TemplateProcessing") {
      const Json& single = p->contains("single") ? (*p)["single"] : Json();
      const Json& specials = p->contains("special_tokens") ? (*p)["special_tokens"] : Json();
      if (!single.is_array()) return DataLoss(what + ": post_processor.single: expected a list");
      bool seen_a = false;
      for (const Json& item : single) {
        if (item.contains("Sequence")) {
          seen_a = true;
          continue;
        }
        if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
          return DataLoss(what + ": post_processor.single: unknown item");
        if (!item["SpecialToken"]["id"].is_string())
          return DataLoss(what + ": post_processor.single: a SpecialToken's id is not a string");
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        if (!specials.is_object() || !specials.contains(name) || !specials[name].contains("ids") ||
            !specials[name]["ids"].is_array())
          return DataLoss(what + ": post_processor.special_tokens: no ids for '" + name + "'");
        for (const Json& id : specials[name]["ids"]) {
          const auto v = JsonInt(id);
          if (!v || *v < 0 || *v >= kMaxTokenId)
            return DataLoss(what + ": post_processor.special_tokens['" + name +
                            "']: an id not in [0, " + std::to_string(kMaxTokenId) + ")");
          (seen_a ? impl->tmpl.after : impl->tmpl.before).push_back(static_cast<int32_t>(*v));
        }
      }
      continue;
    }
    if (ptype == "RobertaProcessing" || ptype == "BertProcessing") {
      const Json& cls = p->contains("cls") ? (*p)["cls"] : Json();
      const Json& sep = p->contains("sep") ? (*p)["sep"] : Json();
      if (!cls.is_array() || cls.size() != 2 || !sep.is_array() || sep.size() != 2)
        return DataLoss(what + ": post_processor: expected 'cls' and 'sep' pairs");
      const auto c = JsonInt(cls[1]), e = JsonInt(sep[1]);
      if (!c || !e || *c < 0 || *c >= kMaxTokenId || *e < 0 || *e >= kMaxTokenId)
        return DataLoss(what + ": post_processor: 'cls' and 'sep' ids not in [0, " +
                        std::to_string(kMaxTokenId) + ")");
      impl->tmpl.before.push_back(static_cast<int32_t>(*c));
      impl->tmpl.after.push_back(static_cast<int32_t>(*e));
      continue;
    }
    return FailedPrecondition(what + ": the post_processor type '" + ptype + "' is not supported");
  }
  // The template's ids count in vocab_size(), so that the daemon's check against the model's
  // text vocabulary covers them too (an id past it would fail every request as the prompt's).
  for (const auto* ids : {&impl->tmpl.before, &impl->tmpl.after}) {
    for (int32_t id : *ids) {
      if (static_cast<size_t>(id) >= impl->id_to_token.size())
        impl->id_to_token.resize(static_cast<size_t>(id) + 1);
    }
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    ASSIGN_OR_RETURN(const std::string dtype, TypeOf(j["decoder"], what + ": decoder"));
    (void)dtype;  // Decode assumes the byte-level mapping (checked by the tests' round trip)
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                 bool add_special_tokens) const {
  for (size_t i = 0; i < text.size();) {
    const size_t n = Utf8Len(text, i);
    if (n == 0) return InvalidArgument("prompt: not valid UTF-8 at byte " + std::to_string(i));
    i += n;
  }
  try {
    return EncodeValid(text, add_special_tokens);
  } catch (const SplitError& e) {
    return InvalidArgument(std::string("prompt: ") + e.what());
  }
}

StatusOr<std::vector<int32_t>> Tokenizer::EncodeValid(std::string_view text,
                                                      bool add_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<int32_t> ids(m.tmpl.before);
  // Added tokens matched on the raw text, then those matched after normalisation.
  for (const auto& [raw, a] : m.SplitAdded(std::string(text), false)) {
    if (a >= 0) {
      ids.push_back(m.added[static_cast<size_t>(a)].id);
      continue;
    }
    const std::string norm = m.normalizer ? m.normalizer->Apply(raw) : raw;
    for (const auto& [piece, b] : m.SplitAdded(norm, true)) {
      if (b >= 0) {
        ids.push_back(m.added[static_cast<size_t>(b)].id);
        continue;
      }
      std::vector<std::string> words{piece};
      if (m.pre) words = m.pre->Apply(std::move(words));
      for (const std::string& w : words) m.Bpe(w, &ids);
    }
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), m.tmpl.after.begin(), m.tmpl.after.end());
  } else {
    ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(m.tmpl.before.size()));
  }
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= m.id_to_token.size()) continue;
    const std::string& tok = m.id_to_token[static_cast<size_t>(id)];
    auto added = m.added_by_content.find(tok);
    if (added != m.added_by_content.end() && m.added[added->second].id == id) {
      if (!(skip_special_tokens && m.added[added->second].special)) out += tok;
      continue;
    }
    for (std::string_view c : Chars(tok)) {
      auto it = Bytes().to_byte.find(std::string(c));
      if (it != Bytes().to_byte.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        out.append(c);
      }
    }
  }
  return out;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) return std::nullopt;
  return impl_->id_to_token[static_cast<size_t>(id)];
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

}  // namespace imagegen::server

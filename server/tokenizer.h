// A text tokenizer for Hugging Face `tokenizer.json` files of the byte-level BPE kind (GPT-2,
// LLaMA-3, DeepSeek-LLM and Janus, Qwen): the added and special tokens, the normalizer, the
// pre-tokenizer's splits (regular expressions with Unicode classes and look-ahead, through
// PCRE2), the byte-to-character mapping, BPE merges, and the post-processor's template. It
// gives the ids the `tokenizers` Python package gives for the same file
// (tests/tokenizer_test.cc compares them on a corpus).
//
// It lives in the server layer: the engine sees prompt token ids only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

class Tokenizer {
 public:
  // Reads a tokenizer.json. Errors name the file and the JSON field; a component this class
  // does not implement (a WordPiece model, a Metaspace pre-tokenizer, ...) is refused by name.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  static StatusOr<std::unique_ptr<Tokenizer>> FromJson(const std::string& json,
                                                       const std::string& what);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text` (UTF-8; invalid UTF-8 is an error naming the byte offset).
  // `add_special_tokens`: apply the post-processor's template (a BOS, for example), as
  // `Tokenizer.encode(text, add_special_tokens=True)` does.
  StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                        bool add_special_tokens = true) const;
  // The text of `ids` through the byte-level decoder (special tokens kept unless skipped).
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  // One more than the largest id (vocabulary and added tokens).
  int64_t vocab_size() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  static StatusOr<std::unique_ptr<Tokenizer>> FromJsonChecked(const std::string& json,
                                                              const std::string& what);
  StatusOr<std::vector<int32_t>> EncodeValid(std::string_view text,
                                             bool add_special_tokens) const;  // UTF-8 checked
  std::unique_ptr<Impl> impl_;
};

}  // namespace imagegen::server

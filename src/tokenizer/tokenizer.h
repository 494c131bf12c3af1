// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (the Qwen2 / GPT-2 /
// Llama-3 family): NFC normalizer, Split pre-tokenizer with the file's own regex (PCRE2, JIT),
// ByteLevel byte-to-unicode mapping, BPE merges by rank, added tokens matched before the split,
// and decoding back to UTF-8 (invalid sequences replaced with U+FFFD). Files outside this family
// are refused with a message naming the field. tokenizer_config.json supplies eos/pad tokens and
// the chat template text. Encoding is thread-safe (const), so callers may encode on all cores.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace memtune {

class Tokenizer {
 public:
  // Reads dir/tokenizer.json and, if present, dir/tokenizer_config.json.
  static Tokenizer load(const std::string& dir);
  // From the JSON texts directly (tests); config_json may be empty.
  static Tokenizer from_json(const std::string& tokenizer_json, const std::string& config_json,
                             const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Appends the ids of `text` to `out`. Added tokens (special or not) that occur in the text are
  // matched as whole tokens before pre-tokenization, as Hugging Face tokenizers do. With
  // add_special_tokens the file's post-processor template (e.g. Llama-3's BOS) is applied;
  // Qwen2's adds nothing.
  void encode(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens = false) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // UTF-8 text of ids; invalid byte sequences become U+FFFD. Unknown ids are an Error.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The raw bytes one id stands for (a byte-level token may hold part of a UTF-8 character):
  // streaming decoders join them and cut at character boundaries; decode() is their lossy UTF-8.
  // "" for a special token with skip_special_tokens. Unknown ids are an Error.
  std::string_view token_bytes(int32_t id, bool skip_special_tokens = false) const;
  // Whether an id stands for a token (a model's vocabulary is often padded past the tokenizer's).
  bool has_id(int32_t id) const;

  // Id of a vocabulary or added token, or nullopt.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Number of ids (vocabulary plus added tokens): max id + 1.
  int64_t vocab_size() const;

  // From tokenizer_config.json (nullopt / empty when absent).
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> pad_token_id() const;
  const std::string& chat_template() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune

// A small byte-level BPE tokenizer built in the test itself, shaped like Qwen2.5's
// tokenizer.json (GPT-2's byte-to-unicode vocabulary of 256 byte tokens, the Qwen2 split regex,
// a few merges, and the added tokens <|endoftext|>, <|im_start|>, <|im_end|>), so the data tests
// run without the real 11 MB file. Tests that need Qwen2.5's exact ids use the real tokenizer
// from the directory in MEMTUNE_TOKENIZER_DIR and skip when it is unset.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/test_util.h"
#include "tokenizer/tokenizer.h"

namespace memtune::testing_support {

// A Jinja template with Qwen2.5's distinctive literals (ChatML, default system message).
inline constexpr std::string_view kQwen2_5LikeTemplate =
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba\n      Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n";

// A plain ChatML template without a default system message.
inline constexpr std::string_view kChatMLTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

inline constexpr int32_t kSyntheticEndOfText = 256 + 10;  // after the 256 bytes and the merges below
inline constexpr int32_t kSyntheticImStart = kSyntheticEndOfText + 1;
inline constexpr int32_t kSyntheticImEnd = kSyntheticEndOfText + 2;

// The UTF-8 text of GPT-2's printable stand-in for each byte, indexed by token id: bytes that
// are printable map to themselves, the others to U+0100 onwards, in GPT-2's order.
inline std::vector<std::pair<int, std::string>> gpt2_byte_tokens() {
  std::vector<int> bytes;
  for (int b = '!'; b <= '~'; ++b) bytes.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bytes.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bytes.push_back(b);
  std::vector<int> codepoints = bytes;
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bytes.begin(), bytes.end(), b) != bytes.end()) continue;
    bytes.push_back(b);
    codepoints.push_back(256 + extra++);
  }
  std::vector<std::pair<int, std::string>> out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int cp = codepoints[i];
    std::string utf8;
    if (cp < 0x80) {
      utf8 += static_cast<char>(cp);
    } else {
      utf8 += static_cast<char>(0xC0 | (cp >> 6));
      utf8 += static_cast<char>(0x80 | (cp & 0x3F));
    }
    out.emplace_back(bytes[i], utf8);
  }
  return out;
}

inline std::string synthetic_tokenizer_json() {
  using nlohmann::json;
  json vocab = json::object();
  int id = 0;
  for (const auto& [byte, text] : gpt2_byte_tokens()) vocab[text] = id++;
  // "Ġ" is the stand-in for a space.
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"},        {"l", "l"}, {"he", "ll"},        {"hell", "o"}, {"H", "i"},
      {"\xC4\xA0", "w"}, {"o", "r"}, {"\xC4\xA0w", "or"}, {"l", "d"},    {"\xC4\xA0wor", "ld"},
  };
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merge_list.push_back(a + " " + b);
  }
  json added = json::array();
  for (const char* token : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
    added.push_back({{"id", id++},
                     {"content", token},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  const std::string regex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
      "\\s+(?!\\S)|\\s+";
  const json doc = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
          byte_level}}}},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  return doc.dump();
}

// tokenizer_config.json with the given chat template (omitted when empty) and eos token.
inline std::string synthetic_tokenizer_config(std::string_view chat_template = kQwen2_5LikeTemplate,
                                              std::string_view eos_token = "<|im_end|>") {
  nlohmann::json config = {{"pad_token", "<|endoftext|>"}, {"model_max_length", 32768}};
  if (!eos_token.empty()) config["eos_token"] = eos_token;
  if (!chat_template.empty()) config["chat_template"] = chat_template;
  return config.dump();
}

inline Tokenizer synthetic_tokenizer(std::string_view chat_template = kQwen2_5LikeTemplate,
                                     std::string_view eos_token = "<|im_end|>") {
  return Tokenizer::from_json(synthetic_tokenizer_json(), synthetic_tokenizer_config(chat_template, eos_token),
                              "synthetic tokenizer");
}

// Writes tokenizer.json and tokenizer_config.json into dir (for command-line tests).
inline void write_synthetic_tokenizer(const std::filesystem::path& dir,
                                      std::string_view chat_template = kQwen2_5LikeTemplate) {
  std::ofstream(dir / "tokenizer.json") << synthetic_tokenizer_json();
  std::ofstream(dir / "tokenizer_config.json") << synthetic_tokenizer_config(chat_template);
}

// The real Qwen2.5 tokenizer's directory from MEMTUNE_TOKENIZER_DIR, or nullopt.
inline std::optional<std::string> real_tokenizer_dir() {
  const char* dir = std::getenv("MEMTUNE_TOKENIZER_DIR");
  if (!dir || !*dir) return std::nullopt;
  return std::string(dir);
}

}  // namespace memtune::testing_support

// Declares `dir`, the real Qwen2.5 tokenizer's directory. Without one the test is skipped, or
// fails where every test is required: a check that silently does not run is not a pass.
#define REQUIRE_QWEN_TOKENIZER(dir)                                                    \
  const std::optional<std::string> dir = ::memtune::testing_support::real_tokenizer_dir(); \
  if (!dir) SKIP_OR_FAIL_WHERE_REQUIRED("MEMTUNE_TOKENIZER_DIR is not set (scripts/prepare-tokenizer.sh prints the directory)")

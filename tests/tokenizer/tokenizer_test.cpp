// Tokenizer tests. Small tokenizer.json files are built here (GPT-2's 256 byte tokens plus a few
// merges) to pin each part of the pipeline: merges in both file forms and their rank order,
// added tokens (special or not, lstrip/rstrip/single_word, normalized), NFC, GPT-2's ByteLevel
// regex, Llama-3's ignore_merges and BOS template, refusal of unsupported files, U+FFFD repair,
// round trips, and concurrent encoding. Tests against the real Qwen2.5 tokenizer (an exact chat
// prompt and llama.cpp's published Qwen2 vectors) run when MEMTUNE_TOKENIZER_DIR names it
// (scripts/prepare-tokenizer.sh makes out/tokenizers/qwen2.5) and are skipped otherwise.
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <utf8proc.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "data/synthetic_tokenizer.h"
#include "support/run_command.h"
#include "support/test_util.h"
#include "tokenizer/split_regex.h"
#include "tokenizer/unicode.h"

namespace memtune {
namespace {

using nlohmann::json;
using testing_support::error_of;

constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's printable stand-in for each byte (the byte-level alphabet), as UTF-8.
std::string byte_symbol(uint8_t b) {
  int next = 256;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
    const int cp = printable ? x : next++;
    if (x == b) {
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return s;
    }
  }
  return {};
}

// Raw bytes written in the byte-level alphabet, as vocabulary entries and merges are.
std::string bl(std::string_view raw) {
  std::string s;
  for (const char c : raw) s += byte_symbol(static_cast<uint8_t>(c));
  return s;
}

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &out,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::string r = n >= 0 ? std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n)) : "(NFC failed)";
  std::free(out);
  return r;
}

// A byte-level BPE tokenizer.json: byte b has id b, and merge i (given in raw bytes) creates
// token 256 + i. By default shaped like Qwen2's (NFC, the Qwen2 split regex, ByteLevel).
struct Spec {
  std::vector<std::pair<std::string, std::string>> merges;
  bool merges_as_pairs = false;
  std::map<std::string, int> extra_vocab;  // raw bytes -> id, outside the merges
  json added_tokens = json::array();
  json normalizer = {{"type", "NFC"}};
  json pre_tokenizer = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", kQwen2Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
  json post_processor = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  json decoder = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  bool ignore_merges = false;

  json document() const {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_symbol(static_cast<uint8_t>(b))] = b;
    json merge_list = json::array();
    int next = 256;
    for (const auto& [l, r] : merges) {
      if (!vocab.contains(bl(l + r))) vocab[bl(l + r)] = next++;
      if (merges_as_pairs)
        merge_list.push_back({bl(l), bl(r)});
      else
        merge_list.push_back(bl(l) + " " + bl(r));
    }
    for (const auto& [raw, id] : extra_vocab) vocab[bl(raw)] = id;
    return {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", added_tokens},
            {"normalizer", normalizer},
            {"pre_tokenizer", pre_tokenizer},
            {"post_processor", post_processor},
            {"decoder", decoder},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", nullptr},
              {"continuing_subword_prefix", ""},
              {"end_of_word_suffix", ""},
              {"fuse_unk", false},
              {"byte_fallback", false},
              {"ignore_merges", ignore_merges},
              {"vocab", vocab},
              {"merges", merge_list}}}};
  }
  Tokenizer build(const std::string& config = "") const {
    return Tokenizer::from_json(document().dump(), config, "synthetic");
  }
};

json added(int id, const std::string& content, bool special, bool normalized = false) {
  return {{"id", id},        {"content", content},       {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", normalized}, {"special", special}};
}

std::vector<int32_t> bytes_of(std::string_view raw) {
  std::vector<int32_t> ids;
  for (const char c : raw) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

// Merges spelling "hello" and " world" (ids 256..262), in rank order.
Spec hello_spec() {
  Spec s;
  s.merges = {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}, {"o", "r"}, {" w", "or"}};
  return s;
}

TEST(Tokenizer, MergesInBothFileFormsGiveTheSameIds) {
  Spec strings = hello_spec();
  Spec pairs = hello_spec();
  pairs.merges_as_pairs = true;
  const Tokenizer a = strings.build(), b = pairs.build();
  EXPECT_EQ(a.encode("hello world"), (std::vector<int32_t>{259, 262, 'l', 'd'}));
  for (const char* text : {"hello world", "lll", "hellohello", "or wo"})
    EXPECT_EQ(a.encode(text), b.encode(text)) << text;
}

TEST(Tokenizer, LowestRankMergesFirstAndLeftmostOnTies) {
  EXPECT_EQ(hello_spec().build().encode("lll"), (std::vector<int32_t>{257, 'l'}));
  Spec ab_first;
  ab_first.merges = {{"a", "b"}, {"b", "c"}};
  EXPECT_EQ(ab_first.build().encode("abc"), (std::vector<int32_t>{256, 'c'}));
  Spec bc_first;
  bc_first.merges = {{"b", "c"}, {"a", "b"}};
  EXPECT_EQ(bc_first.build().encode("abc"), (std::vector<int32_t>{'a', 256}));
}

// Straightforward BPE over strings, the textbook algorithm, as an oracle for the fast paths.
std::vector<int32_t> reference_bpe(const Spec& spec, std::string_view word) {
  std::map<std::pair<std::string, std::string>, int> rank;
  std::map<std::string, int> id;
  for (int b = 0; b < 256; ++b) id[std::string(1, static_cast<char>(b))] = b;
  int next = 256;  // ids as Spec::document() numbers new tokens
  for (size_t i = 0; i < spec.merges.size(); ++i) {
    const auto& [l, r] = spec.merges[i];
    rank.emplace(std::make_pair(l, r), static_cast<int>(i));
    if (id.emplace(l + r, next).second) ++next;
  }
  std::vector<std::string> symbols;
  for (const char c : word) symbols.emplace_back(1, c);
  while (true) {
    int best = -1, best_rank = 1 << 30;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = rank.find({symbols[i], symbols[i + 1]});
      if (it != rank.end() && it->second < best_rank) best = static_cast<int>(i), best_rank = it->second;
    }
    if (best < 0) break;
    symbols[static_cast<size_t>(best)] += symbols[static_cast<size_t>(best) + 1];
    symbols.erase(symbols.begin() + best + 1);
  }
  std::vector<int32_t> ids;
  for (const auto& s : symbols) ids.push_back(id.at(s));
  return ids;
}

TEST(Tokenizer, ShortAndLongWordsMatchTextbookBpe) {
  // Words of one letter run are single pre-tokens; lengths cross the short/long path boundary.
  // Two merges ("ab"+"ab" and "aba"+"b") make the same token.
  Spec spec;
  spec.merges = {{"a", "b"},   {"b", "a"}, {"ab", "a"},  {"a", "a"},  {"ba", "b"},      {"aa", "aa"},
                 {"ab", "ab"}, {"c", "a"}, {"aba", "b"}, {"ca", "b"}, {"abab", "abab"}, {"b", "c"}};
  const Tokenizer t = spec.build();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    std::string word(1 + rng() % 300, 'a');
    for (char& c : word) c = "abc"[rng() % 3];
    ASSERT_EQ(t.encode(word), reference_bpe(spec, word)) << word;
  }
  const std::string megabyte(1 << 20, 'a');
  EXPECT_EQ(t.encode(megabyte).size(), (1u << 20) / 4);  // "aa" then "aaaa" merges everywhere
}

TEST(Tokenizer, AddedTokensSpecialAndNotAreMatchedBeforeSplitting) {
  Spec spec = hello_spec();
  spec.added_tokens = {added(300, "<|end|>", true), added(301, "<tool>", false), added(302, "<|a|>", true),
                       added(303, "<|a|>x", false)};
  const Tokenizer t = spec.build();
  EXPECT_EQ(t.encode("hello<|end|>hello<tool> world"), (std::vector<int32_t>{259, 300, 259, 301, 262, 'l', 'd'}));
  EXPECT_EQ(t.encode("<|a|>xy<|a|>"), (std::vector<int32_t>{303, 'y', 302}));  // longest match first
  EXPECT_EQ(t.encode("<|end"), bytes_of("<|end"));                             // partial: plain text
  EXPECT_EQ(t.encode("<|end|><|end|>"), (std::vector<int32_t>{300, 300}));
  const std::vector<int32_t> ids = t.encode("a<|end|>b<tool>c");
  EXPECT_EQ(t.decode(ids), "a<|end|>b<tool>c");
  EXPECT_EQ(t.decode(ids, /*skip_special_tokens=*/true), "ab<tool>c");
  EXPECT_EQ(t.token_to_id("<tool>"), 301);
  EXPECT_EQ(t.token_to_id(bl("hello")), 259);
  EXPECT_EQ(t.token_to_id("nope"), std::nullopt);
  EXPECT_EQ(t.vocab_size(), 304);
}

TEST(Tokenizer, AddedTokenStripAndSingleWordOptions) {
  Spec spec;
  json mask = added(300, "<mask>", true);
  mask["lstrip"] = true;
  mask["rstrip"] = true;
  json word = added(301, "hi", false);
  word["single_word"] = true;
  spec.added_tokens = {mask, word};
  const Tokenizer t = spec.build();
  EXPECT_EQ(t.encode("a \t <mask> \n b"), (std::vector<int32_t>{'a', 300, 'b'}));
  EXPECT_EQ(t.encode("hi there"), (std::vector<int32_t>{301, ' ', 't', 'h', 'e', 'r', 'e'}));
  EXPECT_EQ(t.encode("this"), bytes_of("this"));  // inside a word: not the added token
  EXPECT_EQ(t.encode("(hi)"), (std::vector<int32_t>{'(', 301, ')'}));
}

TEST(Tokenizer, NormalizedAddedTokensMatchAfterNfc) {
  Spec spec;
  spec.added_tokens = {added(300, "caf\u00e9", false, /*normalized=*/true), added(301, "ke\u0301y", false, false)};
  const Tokenizer t = spec.build();
  EXPECT_EQ(t.encode("cafe\u0301!"), (std::vector<int32_t>{300, '!'}));  // matched after NFC
  EXPECT_EQ(t.encode("ke\u0301y"), (std::vector<int32_t>{301}));         // raw match, before NFC
  EXPECT_EQ(t.encode("k\u00e9y"), bytes_of("k\u00e9y"));
}

TEST(Tokenizer, NfcNormalizerComposesBeforeSplitting) {
  Spec with = hello_spec();
  Spec without = hello_spec();
  without.normalizer = nullptr;
  const Tokenizer a = with.build(), b = without.build();
  EXPECT_EQ(a.encode("e\u0301"), a.encode("\u00e9"));
  EXPECT_EQ(a.encode("e\u0301"), bytes_of("\u00e9"));
  EXPECT_EQ(b.encode("e\u0301"), bytes_of("e\u0301"));
  EXPECT_EQ(a.decode(a.encode("A\u030angstro\u0308m \u212b")), "\u00c5ngstr\u00f6m \u00c5");
  Spec sequence = hello_spec();
  sequence.normalizer = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  EXPECT_EQ(sequence.build().encode("e\u0301"), bytes_of("\u00e9"));
}

TEST(Tokenizer, Gpt2ByteLevelRegexSplitsWords) {
  Spec gpt2;
  gpt2.merges = {{"o", " "}, {"'", "s"}, {"i", "t"}};
  gpt2.normalizer = nullptr;
  gpt2.pre_tokenizer = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  // One piece per word: "o " never occurs inside a piece, "'s" is a piece of its own.
  EXPECT_EQ(gpt2.build().encode("go it's"), (std::vector<int32_t>{'g', 'o', ' ', 258, 257}));
  Spec whole = gpt2;
  whole.pre_tokenizer["use_regex"] = false;
  EXPECT_EQ(whole.build().encode("go it's"), (std::vector<int32_t>{'g', 256, 258, 257}));
}

TEST(Tokenizer, WhiteSpaceIsUnicodeWhiteSpaceAsInHuggingFace) {
  // Hugging Face's regex engine (Oniguruma) takes \s as White_Space: U+0085 is in, U+180E out.
  Spec spec;
  spec.normalizer = nullptr;
  spec.merges = {{"\xE1", "\xA0"}, {"\xE1\xA0", "\x8E"}, {"\u180E", "\u180E"}, {"\xC2", "\x85"}, {"\u0085", "\u0085"}};
  spec.pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const Tokenizer t = spec.build();
  EXPECT_EQ(t.encode("x\u180E\u180Ey"), (std::vector<int32_t>{'x', 258, 'y'}));       // punctuation-like run
  EXPECT_EQ(t.encode("a\u0085\u0085b"), (std::vector<int32_t>{'a', 259, 259, 'b'}));  // two whitespace pieces
  const std::string rewritten = tokenizer_detail::with_unicode_white_space(R"([^\s\p{L}]\s+\\s\Q\s\E)", "test");
  EXPECT_EQ(rewritten.find("\\s"), rewritten.find("\\\\s") + 1);  // only the escaped backslash and \Q..\E keep it
  EXPECT_NE(rewritten.find("\\Q\\s\\E"), std::string::npos);
  EXPECT_CONTAINS(error_of([] { tokenizer_detail::with_unicode_white_space("[\\S]", "where"); }), "where");
}

TEST(Tokenizer, Llama3IgnoreMergesAndBosTemplate) {
  Spec spec;
  spec.ignore_merges = true;
  spec.normalizer = nullptr;
  spec.merges = {{"a", "b"}};
  spec.extra_vocab = {{"abc", 300}, {" abc", 301}};  // reachable only through ignore_merges
  spec.added_tokens = {added(302, "<|begin_of_text|>", true)};
  const json bos_template = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
      {"pair", json::array()},
      {"special_tokens",
       {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {302}}, {"tokens", {"<|begin_of_text|>"}}}}}}};
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  spec.post_processor = {{"type", "Sequence"}, {"processors", json::array({byte_level, bos_template})}};
  const Tokenizer t = spec.build();
  EXPECT_EQ(t.encode("abc abc abd"), (std::vector<int32_t>{300, 301, ' ', 256, 'd'}));
  EXPECT_EQ(t.encode("abc", /*add_special_tokens=*/true), (std::vector<int32_t>{302, 300}));
  EXPECT_EQ(t.encode("", true), (std::vector<int32_t>{302}));
  Spec plain = spec;
  plain.ignore_merges = false;
  EXPECT_EQ(plain.build().encode("abc"), (std::vector<int32_t>{256, 'c'}));
  EXPECT_EQ(hello_spec().build().encode("hello", true), (std::vector<int32_t>{259}));  // Qwen2: no template
}

TEST(Tokenizer, RefusesUnsupportedFilesNamingTheField) {
  auto refusal = [](const std::function<void(json&)>& edit) {
    json doc = hello_spec().document();
    edit(doc);
    return error_of([&] { Tokenizer::from_json(doc.dump(), "", "dir"); });
  };
  std::string e = refusal([](json& d) { d["model"]["type"] = "WordPiece"; });
  EXPECT_CONTAINS(e, "dir/tokenizer.json");
  EXPECT_CONTAINS(e, "model.type");
  EXPECT_CONTAINS(e, "WordPiece");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["type"] = "Unigram"; }), "model.type");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["byte_fallback"] = true; }), "model.byte_fallback");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["dropout"] = 0.1; }), "model.dropout");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["continuing_subword_prefix"] = "##"; }),
                  "model.continuing_subword_prefix");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["merges"][0] = "h e x"; }), "model.merges[0]");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["merges"][1] = "zz q"; }), "model.merges[1]");
  EXPECT_CONTAINS(refusal([](json& d) { d["model"]["vocab"].erase(bl("\n")); }), "model.vocab");
  EXPECT_CONTAINS(refusal([](json& d) { d["normalizer"] = {{"type", "NFKC"}}; }), "normalizer.type");
  EXPECT_CONTAINS(refusal([](json& d) {
                    d["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}};
                  }),
                  "normalizer.normalizers[0].type");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"] = {{"type", "Metaspace"}}; }), "pre_tokenizer.type");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"] = nullptr; }), "pre_tokenizer");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
                  "pre_tokenizer.pretokenizers[0].behavior");
  EXPECT_CONTAINS(refusal([](json& d) {
                    d["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}};
                  }),
                  "pre_tokenizer.pretokenizers[0].pattern");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
                  "pre_tokenizer.pretokenizers[0].pattern.Regex");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }),
                  "pre_tokenizer.pretokenizers[1].add_prefix_space");
  EXPECT_CONTAINS(refusal([](json& d) { d["pre_tokenizer"]["pretokenizers"].erase(1); }), "no ByteLevel");
  EXPECT_CONTAINS(refusal([](json& d) { d["post_processor"] = {{"type", "BertProcessing"}}; }), "post_processor.type");
  EXPECT_CONTAINS(refusal([](json& d) { d["decoder"] = {{"type", "WordPiece"}}; }), "decoder.type");
  EXPECT_CONTAINS(refusal([](json& d) { d["added_tokens"] = {added(5, "<x>", true)}; }), "added_tokens[0].id");
  EXPECT_CONTAINS(error_of([] { Tokenizer::from_json("{not json", "", "dir"); }), "invalid JSON");
}

TEST(Tokenizer, NumberTooLargeForADoubleIsAnError) {
  json doc = hello_spec().document();
  doc["version"] = "VERSION_MARKER";
  std::string text = doc.dump();
  text.replace(text.find("\"VERSION_MARKER\""), 16, "1e400");
  std::string e = error_of([&] { Tokenizer::from_json(text, "", "dir"); });
  EXPECT_CONTAINS(e, "dir/tokenizer.json: invalid JSON");
  EXPECT_CONTAINS(e, "1e400");
  e = error_of([] { hello_spec().build(R"({"model_max_length": 1e400})"); });
  EXPECT_CONTAINS(e, "synthetic/tokenizer_config.json: invalid JSON");
}

TEST(Tokenizer, IdsFarBeyondTheFilesOwnListsAreRefused) {
  // Ids size the decoding tables: an id of 10^8 in a file of ~260 tokens must not allocate them.
  std::string e = error_of([] {
    Spec spec = hello_spec();
    spec.extra_vocab = {{"abc", 100000000}};
    spec.build();
  });
  EXPECT_CONTAINS(e, "model.vocab[");
  EXPECT_CONTAINS(e, "id 100000000 is out of range");
  e = error_of([] {
    Spec spec = hello_spec();
    spec.added_tokens = {added(100000000, "<|end|>", true)};
    spec.build();
  });
  EXPECT_CONTAINS(e, "added_tokens[0].id");
  EXPECT_CONTAINS(e, "out of range");
}

TEST(Tokenizer, DuplicateVocabularyKeysAreRefused) {
  // JSON keeps the last of two equal keys; a vocabulary listing a token twice is a broken file.
  std::string text = hello_spec().document().dump();
  const size_t vocab = text.find("\"vocab\":{");
  ASSERT_NE(vocab, std::string::npos);
  text.insert(vocab + 9, "\"!\":7,");
  const std::string e = error_of([&] { Tokenizer::from_json(text, "", "dir"); });
  EXPECT_CONTAINS(e, "dir/tokenizer.json");
  EXPECT_CONTAINS(e, "key \"!\" appears twice");
}

TEST(Tokenizer, InvalidUtf8BecomesReplacementCharacters) {
  const Tokenizer t = hello_spec().build();
  // Decoding: each maximal invalid subsequence is one U+FFFD (Python's errors="replace").
  EXPECT_EQ(t.decode(bytes_of("\xE2\x82\xAC")), "\u20AC");
  EXPECT_EQ(t.decode(bytes_of("\xE2\x82")), "\uFFFD");
  EXPECT_EQ(t.decode(bytes_of("a\xF0\x9F"
                              "b")),
            "a\uFFFDb");
  EXPECT_EQ(t.decode(bytes_of("\xFF")), "\uFFFD");
  EXPECT_EQ(t.decode(bytes_of("\xC0\x80")), "\uFFFD\uFFFD");                      // overlong
  EXPECT_EQ(t.decode(bytes_of("\xED\xA0\x80")), "\uFFFD\uFFFD\uFFFD");            // surrogate
  EXPECT_EQ(t.decode(bytes_of("\xF4\x90\x80\x80")), "\uFFFD\uFFFD\uFFFD\uFFFD");  // past U+10FFFF
  EXPECT_EQ(t.decode(bytes_of("\xE2\x82"
                              "\xE2\x82\xAC")),
            "\uFFFD\u20AC");
  // Encoding: invalid input is repaired the same way first, as a JavaScript TextDecoder would.
  EXPECT_EQ(t.encode("a\xFF"
                     "b"),
            t.encode("a\uFFFDb"));
  EXPECT_EQ(t.encode("\xE2\x82"), t.encode("\uFFFD"));
  EXPECT_EQ(t.encode("\xED\xA0\x80x"), t.encode("\uFFFD\uFFFD\uFFFDx"));
  EXPECT_EQ(t.decode(t.encode(std::string("x\xC3", 2))), "x\uFFFD");
  EXPECT_CONTAINS(error_of([&] { t.decode(std::vector<int32_t>{1 << 20}); }), "1048576");
  EXPECT_CONTAINS(error_of([&] { t.decode(std::vector<int32_t>{-1}); }), "-1");
}

TEST(Tokenizer, DecodeOfEncodeIsNfcOfTheText) {
  Spec spec = hello_spec();
  spec.added_tokens = {added(300, "<|im_start|>", true), added(301, "<|im_end|>", true)};
  const Tokenizer t = spec.build();
  std::vector<std::string> texts = {"",
                                    " ",
                                    "hello world",
                                    "  \n\n\t \r\n",
                                    "e\u0301 cafe\u0301 \u212b",
                                    "\u6211\u60f3\u5728apple\u5de5\u4f5c",
                                    "\U0001F468\u200D\U0001F469\u200D\U0001F467 \U0001F1EF\U0001F1F5",
                                    "<|im_start|>user\nhi<|im_end|>\n<|im_",
                                    "I'M here, we'LL see",
                                    std::string("nul\0byte", 8),
                                    "\u0928\u092e\u0938\u094d\u0924\u0947 \u05e9\u05dc\u05d5\u05dd",
                                    "\u1100\u1161\u11a8 \uac00\u11a8"};
  std::mt19937 rng(11);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    for (int k = rng() % 40; k > 0; --k) {
      char32_t cp = static_cast<char32_t>(rng() % 0x30000);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
      tokenizer_detail::append_utf8(cp, s);
    }
    texts.push_back(s);
  }
  for (const std::string& text : texts) ASSERT_EQ(t.decode(t.encode(text)), nfc(text)) << text;
}

TEST(Tokenizer, ConcurrentEncodingMatchesSequential) {
  const Tokenizer t = hello_spec().build();
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i)
    texts.push_back(fmt::format("hello world {} hellohello {} <|x|> \u00e9\u00e9", i, i * 7));
  std::vector<std::vector<int32_t>> expected;
  for (const auto& s : texts) expected.push_back(t.encode(s));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 20; ++rep)
        for (size_t i = static_cast<size_t>(w); i < texts.size(); i += 2)
          if (t.encode(texts[i]) != expected[i]) ++mismatches;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Tokenizer, ConfigGivesEosPadAndChatTemplate) {
  Spec spec = hello_spec();
  spec.added_tokens = {added(300, "<|endoftext|>", true), added(301, "<|im_end|>", true)};
  const Tokenizer t =
      spec.build(R"({"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>", "lstrip": false},
                                     "chat_template": "{{ messages }}"})");
  EXPECT_EQ(t.eos_token_id(), 301);
  EXPECT_EQ(t.pad_token_id(), 300);
  EXPECT_EQ(t.chat_template(), "{{ messages }}");
  const Tokenizer named = spec.build(
      R"({"eos_token": null, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  EXPECT_EQ(named.eos_token_id(), std::nullopt);
  EXPECT_EQ(named.chat_template(), "D");
  const Tokenizer none = spec.build();
  EXPECT_EQ(none.pad_token_id(), std::nullopt);
  EXPECT_EQ(none.chat_template(), "");
  const std::string e = error_of([&] { spec.build(R"({"eos_token": "</s>"})"); });
  EXPECT_CONTAINS(e, "synthetic/tokenizer_config.json");
  EXPECT_CONTAINS(e, "eos_token");
  EXPECT_CONTAINS(error_of([&] { spec.build(R"({"chat_template": [{"name": "x", "template": "T"}]})"); }),
                  "chat_template");
}

TEST(Tokenizer, LoadsADirectory) {
  const auto dir = testing_support::make_temp_dir("tokenizer");
  std::ofstream(dir / "tokenizer.json") << hello_spec().document().dump();
  EXPECT_EQ(Tokenizer::load(dir.string()).encode("hello"), (std::vector<int32_t>{259}));
  // Without tokenizer_config.json there is no eos; a separate chat_template.jinja is read.
  std::ofstream(dir / "chat_template.jinja") << "{{ bos_token }}";
  const Tokenizer t = Tokenizer::load(dir.string());
  EXPECT_EQ(t.eos_token_id(), std::nullopt);
  EXPECT_EQ(t.chat_template(), "{{ bos_token }}");
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": "inline"})";
  EXPECT_EQ(Tokenizer::load(dir.string()).chat_template(), "inline");
  EXPECT_CONTAINS(error_of([&] { Tokenizer::load((dir / "missing").string()); }), "missing/tokenizer.json");
  std::filesystem::remove_all(dir);
}

TEST(QwenTokenizer, ChatPromptHasTheExactIds) {
  REQUIRE_QWEN_TOKENIZER(dir);
  const Tokenizer t = Tokenizer::load(*dir);
  const std::string prompt =
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
  const std::vector<int32_t> expected = {151644, 8948,   198, 2610, 525,   1207,   16948, 11,     3465,  553,
                                         54364,  14817,  13,  1446, 525,   264,    10950, 17847,  13,    151645,
                                         198,    151644, 872, 198,  13048, 151645, 198,   151644, 77091, 198};
  EXPECT_EQ(t.encode(prompt), expected);
  EXPECT_EQ(t.encode(prompt, /*add_special_tokens=*/true), expected);  // Qwen2 adds nothing
  EXPECT_EQ(t.decode(expected), prompt);
  EXPECT_EQ(t.decode(expected, /*skip_special_tokens=*/true),
            "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\nuser\nHi\nassistant\n");
  EXPECT_EQ(t.eos_token_id(), 151645);
  EXPECT_EQ(t.pad_token_id(), 151643);
  EXPECT_EQ(t.vocab_size(), 151665);
  EXPECT_EQ(t.token_to_id("<|file_sep|>"), 151664);
  EXPECT_EQ(t.token_to_id("<think>"), std::nullopt);  // a Qwen3 token, not Qwen2.5's
  EXPECT_CONTAINS(t.chat_template(), "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
}

TEST(QwenTokenizer, MatchesLlamaCppPublishedVectors) {
  REQUIRE_QWEN_TOKENIZER(dir);
  const Tokenizer t = Tokenizer::load(*dir);
  const auto path =
      std::filesystem::path(testing_support::source_dir()) / "tests" / "tokenizer" / "data" / "llama_cpp_qwen2_vectors.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const json doc = json::parse(in);
  ASSERT_EQ(doc.at("cases").size(), 43u);
  for (const json& c : doc.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    EXPECT_EQ(t.encode(text), c.at("ids").get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(t.decode(t.encode(text)), text);
  }
}

}  // namespace
}  // namespace memtune

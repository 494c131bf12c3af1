// Loading and running a Hugging Face byte-level BPE tokenizer (tokenizer.json), following the
// Rust `tokenizers` pipeline step by step so that ids match it exactly:
//   1. invalid UTF-8 in the input is replaced by U+FFFD, maximal subpart by maximal subpart (what
//      JavaScript's TextDecoder does to bytes; the Rust library only accepts valid strings);
//   2. added tokens whose `normalized` is false are cut out of the raw text (leftmost-longest,
//      honouring lstrip / rstrip / single_word as AddedVocabulary does);
//   3. each remaining section is NFC-normalized (if the file says so), then searched for the
//      `normalized` added tokens;
//   4. the pre-tokenizer regexes split it ("Isolated": matches and the text between them);
//   5. each piece is byte-level BPE-encoded (ignore_merges: a piece that is itself a vocabulary
//      token is emitted whole), with a per-thread cache of frequent pieces;
//   6. with add_special_tokens, the TemplateProcessing `single` template wraps the ids.
// `truncation` and `padding` are ignored: memtune's data pipeline handles lengths itself. Files
// outside this family are refused with an Error naming the field.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/json_reader.h"
#include "tokenizer/bpe.h"
#include "tokenizer/split_regex.h"
#include "tokenizer/unicode.h"

namespace memtune {
namespace {

using nlohmann::json;
using namespace tokenizer_detail;

// The regex of GPT-2's ByteLevel pre-tokenizer when `use_regex` is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Pieces longer than this are not cached (they rarely repeat), nor are results of more ids.
constexpr size_t kCacheMaxBytes = 128;
constexpr size_t kCacheMaxIds = 7;
// A thread's cache is emptied when it reaches this many entries, bounding its memory.
constexpr size_t kCacheMaxEntries = size_t{1} << 16;

// GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the other 68
// bytes (controls, space, DEL, NBSP, soft hyphen) for U+0100 upwards in byte order, so every
// byte is a visible, non-space character.
std::array<char32_t, 256> byte_to_unicode() {
  std::array<char32_t, 256> table{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    table[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = true;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// Finds added tokens in text, leftmost first and the longest at that position, as the
// Aho-Corasick automaton (MatchKind::LeftmostLongest) of Hugging Face's AddedVocabulary does.
// Added tokens are few and share few first bytes, so a first-byte table of candidates, longest
// first, is all the structure needed.
class AddedTokenMatcher {
 public:
  // `pattern` is what to look for (the content, NFC-normalized for `normalized` tokens).
  void add(const AddedToken& token, std::string pattern) {
    auto& list = by_first_byte_[static_cast<uint8_t>(pattern[0])];
    list.push_back({std::move(pattern), &token});
    std::stable_sort(list.begin(), list.end(),
                     [](const Entry& a, const Entry& b) { return a.pattern.size() > b.pattern.size(); });
    empty_ = false;
  }

  // Calls on_text(section) for the text between matches and on_token(id) for each match.
  template <class OnText, class OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    if (empty_) {
      if (!text.empty()) on_text(text);
      return;
    }
    size_t done = 0;  // end of the previous match, stripped whitespace included
    for (size_t i = 0; i < text.size();) {
      const Entry* hit = match_at(text, i);
      if (!hit) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + hit->pattern.size();
      const AddedToken& t = *hit->token;
      if (t.single_word && (word_char_before(text, start) || word_char_after(text, stop))) {
        i = stop;  // the automaton resumes after a discarded match, not inside it
        continue;
      }
      if (t.lstrip) {
        size_t prev = start;
        while (start > done && is_white_space(previous_code_point(text, start, prev))) start = prev;
      }
      if (t.rstrip) {
        while (stop < text.size()) {
          size_t next = stop;
          if (!is_white_space(next_code_point(text, next))) break;
          stop = next;
        }
      }
      if (start > done) on_text(text.substr(done, start - done));
      on_token(t.id);
      done = i = stop;
    }
    if (done < text.size()) on_text(text.substr(done));
  }

 private:
  struct Entry {
    std::string pattern;
    const AddedToken* token;
  };

  const Entry* match_at(std::string_view text, size_t i) const {
    for (const Entry& e : by_first_byte_[static_cast<uint8_t>(text[i])])
      if (text.size() - i >= e.pattern.size() && std::memcmp(text.data() + i, e.pattern.data(), e.pattern.size()) == 0)
        return &e;
    return nullptr;
  }

  // Whether a word character (regex \w) directly precedes / follows byte offset `pos`: a
  // single_word token only matches with neither.
  static bool word_char_before(std::string_view text, size_t pos) {
    size_t start = 0;
    return pos > 0 && is_word_char(previous_code_point(text, pos, start));
  }
  static bool word_char_after(std::string_view text, size_t pos) {
    return pos < text.size() && is_word_char(next_code_point(text, pos));
  }

  std::array<std::vector<Entry>, 256> by_first_byte_;
  bool empty_ = true;
};

// A thread's cache of encoded pieces, for one tokenizer at a time.
struct CachedIds {
  uint32_t count;
  std::array<int32_t, kCacheMaxIds> ids;
};
struct WordCache {
  uint64_t owner = 0;
  StringMap<CachedIds> entries;
};

WordCache& word_cache(uint64_t owner) {
  thread_local WordCache cache;
  if (cache.owner != owner) {
    cache.entries.clear();
    cache.owner = owner;
  }
  return cache;
}

std::atomic<uint64_t> g_next_instance{1};

// Token ids are int32 and one id past the largest must still fit (vocab_size).
constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 2;

// An id of a file that lists `tokens` tokens (model.vocab entries plus added tokens). Ids may
// leave gaps, but the tables indexed by id stay within a small multiple of the file's own lists:
// a stray id such as 2^31 would otherwise size them at gigabytes.
int32_t token_id(const JsonReader& value, int64_t tokens) {
  const int64_t bound = std::min(kMaxTokenId + 1, 2 * tokens + 1024);
  const int64_t id = value.as_integer(0, kMaxTokenId);
  if (id >= bound)
    value.fail(
        fmt::format("id {} is out of range: the file lists {} tokens (model.vocab and added_tokens), so ids "
                    "must be below {} (twice that plus 1024, leaving room for unused ids)",
                    id, tokens, bound));
  return static_cast<int32_t>(id);
}

// The "type" member of a component object.
std::string type_of(const JsonReader& component) {
  return component.as_object().string("type");
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open: {}", path.string(), std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(fmt::format("{}: read failed", path.string()));
  return text.str();
}

}  // namespace

struct Tokenizer::Impl {
  uint64_t instance = g_next_instance.fetch_add(1);

  StringMap<int32_t> vocab;              // vocabulary token (byte-level string) -> id
  std::vector<AddedToken> added;         // never resized after the matchers point into it
  StringMap<int32_t> added_by_content;   // added token content -> id
  AddedTokenMatcher raw_matcher;         // added tokens with normalized = false
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized = true
  bool nfc = false;
  std::vector<SplitRegex> pre_tokenizer;  // applied in order; each splits the previous pieces
  std::optional<BytePairMerger> merger;
  bool ignore_merges = false;
  StringMap<int32_t> piece_to_id;       // raw bytes of each vocabulary token (only for ignore_merges)
  std::vector<int32_t> prefix, suffix;  // TemplateProcessing around the text's ids

  // Decoding: the bytes each id stands for and what kind of token it is.
  enum Kind : uint8_t { kUnused, kVocab, kAdded, kSpecial };
  std::vector<std::string> id_bytes;
  std::vector<Kind> id_kind;

  std::optional<int32_t> eos, pad;
  std::string chat_template;
  int64_t listed_tokens = 0;  // model.vocab entries + added_tokens: every id is below it

  void parse_model(const JsonReader& model);
  void parse_added_tokens(const std::optional<JsonReader>& tokens);
  void parse_normalizer(const std::optional<JsonReader>& normalizer);
  void parse_pre_tokenizer(const JsonReader& root);
  void parse_byte_level(const JsonReader& byte_level);
  void parse_post_processor(const std::optional<JsonReader>& post_processor);
  void parse_template(const JsonReader& processor);
  void parse_config(const JsonReader& config);
  std::optional<int32_t> config_token(const JsonReader& config, std::string_view key) const;

  bool known(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_kind.size() && id_kind[static_cast<size_t>(id)] != kUnused;
  }
  std::optional<int32_t> find_id(std::string_view token) const {
    if (auto it = added_by_content.find(token); it != added_by_content.end()) return it->second;
    if (auto it = vocab.find(token); it != vocab.end()) return it->second;
    return std::nullopt;
  }

  void encode(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens) const;
  void encode_section(std::string_view section, WordCache& cache, std::string& scratch,
                      std::vector<int32_t>& out) const;
  void pre_tokenize(std::string_view text, size_t level, WordCache& cache, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, WordCache& cache, std::vector<int32_t>& out) const;
};

void Tokenizer::Impl::parse_model(const JsonReader& model) {
  const std::string type = model.string("type");
  if (type != "BPE") model.fail("type", fmt::format("\"{}\" is not supported (expected \"BPE\")", type));
  if (model.has("dropout")) model.fail("dropout", "BPE dropout is not supported (expected null)");
  if (model.optional_bool("byte_fallback").value_or(false))
    model.fail("byte_fallback", "byte fallback is not supported (expected false)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const std::optional<JsonReader> affix = model.find(key);
    if (affix && affix->value() != "")
      affix->fail(fmt::format("{} is not supported (expected null)", json_excerpt(affix->value())));
  }
  ignore_merges = model.optional_bool("ignore_merges").value_or(false);

  const JsonReader vocab_json = model.object("vocab");
  listed_tokens += static_cast<int64_t>(vocab_json.value().size());
  vocab.reserve(vocab_json.value().size());
  vocab_json.for_each_entry([&](const std::string& token, const JsonReader& id_json) {
    const int32_t id = token_id(id_json, listed_tokens);
    vocab.emplace(token, id);
    if (static_cast<size_t>(id) >= id_kind.size()) {
      id_kind.resize(static_cast<size_t>(id) + 1, kUnused);
      id_bytes.resize(static_cast<size_t>(id) + 1);
    }
    if (id_kind[static_cast<size_t>(id)] != kUnused) id_json.fail(fmt::format("id {} is used by two tokens", id));
    id_kind[static_cast<size_t>(id)] = kVocab;
  });

  // Byte-level: every byte has a one-character token; decoding maps characters back to bytes.
  const std::array<char32_t, 256> to_unicode = byte_to_unicode();
  std::unordered_map<char32_t, uint8_t> to_byte;
  std::array<int32_t, 256> byte_ids{};
  for (int b = 0; b < 256; ++b) {
    to_byte[to_unicode[static_cast<size_t>(b)]] = static_cast<uint8_t>(b);
    std::string symbol;
    append_utf8(to_unicode[static_cast<size_t>(b)], symbol);
    auto it = vocab.find(symbol);
    if (it == vocab.end())
      vocab_json.fail(
          fmt::format("no token \"{}\" for byte 0x{:02X}; a byte-level vocabulary needs all 256", symbol, b));
    byte_ids[static_cast<size_t>(b)] = it->second;
  }
  for (const auto& [token, id] : vocab) {
    // A token with a character outside the byte alphabet decodes to its own UTF-8 text, as the
    // Rust ByteLevel decoder does.
    std::string bytes;
    bool byte_level = is_valid_utf8(token);
    for (size_t i = 0; byte_level && i < token.size();) {
      auto it = to_byte.find(next_code_point(token, i));
      if (it == to_byte.end())
        byte_level = false;
      else
        bytes += static_cast<char>(it->second);
    }
    id_bytes[static_cast<size_t>(id)] = byte_level ? bytes : token;
    if (ignore_merges && byte_level) piece_to_id.emplace(std::move(bytes), id);
  }

  merger.emplace(byte_ids);
  const JsonReader merges = model.array("merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const JsonReader merge = merges[rank];
    const json& m = merge.value();
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        merge.fail(fmt::format("expected \"left right\" with exactly one space, got {}", json_excerpt(m)));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      merge.fail(fmt::format("expected \"left right\" or [\"left\", \"right\"], got {}", json_excerpt(m)));
    }
    const auto l = vocab.find(left), rt = vocab.find(right), merged = vocab.find(left + right);
    if (l == vocab.end() || rt == vocab.end() || merged == vocab.end())
      merge.fail(fmt::format("\"{}\", \"{}\" or their concatenation is not in model.vocab", left, right));
    merger->add_merge(l->second, rt->second, static_cast<int32_t>(rank), merged->second);
  }
}

void Tokenizer::Impl::parse_added_tokens(const std::optional<JsonReader>& tokens) {
  if (!tokens) return;
  added.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const JsonReader t = (*tokens)[i];
    t.as_object();
    AddedToken a;
    a.id = token_id(t.get("id"), listed_tokens);
    a.content = t.string("content");
    if (a.content.empty()) t.fail("content", "empty");
    if (!is_valid_utf8(a.content)) t.fail("content", "not valid UTF-8");
    a.special = t.optional_bool("special").value_or(false);
    a.normalized = t.optional_bool("normalized").value_or(!a.special);
    a.lstrip = t.optional_bool("lstrip").value_or(false);
    a.rstrip = t.optional_bool("rstrip").value_or(false);
    a.single_word = t.optional_bool("single_word").value_or(false);
    if (!added_by_content.emplace(a.content, a.id).second)
      t.fail("content", fmt::format("\"{}\" is listed twice", a.content));
    if (auto it = vocab.find(a.content); it != vocab.end() && it->second != a.id)
      t.fail(fmt::format("\"{}\" has id {} but model.vocab gives it id {}", a.content, a.id, it->second));
    const auto slot = static_cast<size_t>(a.id);
    if (slot >= id_kind.size()) {
      id_kind.resize(slot + 1, kUnused);
      id_bytes.resize(slot + 1);
    }
    if (id_kind[slot] == kAdded || id_kind[slot] == kSpecial)
      t.fail("id", fmt::format("id {} is used by two added tokens", a.id));
    if (id_kind[slot] == kVocab && !vocab.contains(a.content))
      t.fail("id", fmt::format("id {} already belongs to another model.vocab token", a.id));
    id_kind[slot] = a.special ? kSpecial : kAdded;
    id_bytes[slot] = a.content;
    added.push_back(std::move(a));
  }
}

void Tokenizer::Impl::parse_normalizer(const std::optional<JsonReader>& normalizer) {
  if (!normalizer) return;
  const std::string type = type_of(*normalizer);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const JsonReader list = normalizer->array("normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string t = type_of(list[i]);
      if (t != "NFC") list[i].fail("type", fmt::format("\"{}\" is not supported (expected \"NFC\")", t));
      nfc = true;
    }
  } else {
    normalizer->fail("type",
                     fmt::format("\"{}\" is not supported (expected null, \"NFC\" or a Sequence of NFC)", type));
  }
}

void Tokenizer::Impl::parse_byte_level(const JsonReader& byte_level) {
  // Hugging Face's default for add_prefix_space is true, so an absent field counts as true.
  if (byte_level.optional_bool("add_prefix_space").value_or(true))
    byte_level.fail("add_prefix_space", "true (or absent) is not supported (expected false)");
  if (byte_level.optional_bool("use_regex").value_or(true))
    pre_tokenizer.emplace_back(kGpt2Pattern, byte_level.where() + " (GPT-2 regex)");
}

void Tokenizer::Impl::parse_pre_tokenizer(const JsonReader& root) {
  const std::optional<JsonReader> pre = root.find("pre_tokenizer");
  if (!pre) root.fail("pre_tokenizer", "null is not supported (expected ByteLevel or a Sequence ending in ByteLevel)");
  const std::string type = type_of(*pre);
  if (type == "ByteLevel") {
    parse_byte_level(*pre);
    return;
  }
  if (type != "Sequence")
    pre->fail("type", fmt::format("\"{}\" is not supported (expected \"ByteLevel\" or \"Sequence\")", type));
  const JsonReader list = pre->array("pretokenizers");
  bool byte_level = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const JsonReader item = list[i];
    const std::string t = type_of(item);
    if (byte_level) item.fail("ByteLevel must be the last pre-tokenizer of the Sequence");
    if (t == "ByteLevel") {
      parse_byte_level(item);
      byte_level = true;
    } else if (t == "Split") {
      const JsonReader pattern = item.object("pattern");
      if (!pattern.has("Regex"))
        pattern.fail(fmt::format("{} is not supported (expected {{\"Regex\": ...}})", json_excerpt(pattern.value())));
      const JsonReader regex = pattern.get("Regex");
      const std::string behavior = item.string("behavior");
      if (behavior != "Isolated")
        item.fail("behavior", fmt::format("\"{}\" is not supported (expected \"Isolated\")", behavior));
      if (item.optional_bool("invert").value_or(false)) item.fail("invert", "true is not supported (expected false)");
      pre_tokenizer.emplace_back(regex.as_string(), regex.where());
    } else {
      item.fail("type", fmt::format("\"{}\" is not supported (expected \"Split\" or \"ByteLevel\")", t));
    }
  }
  if (!byte_level) list.fail("no ByteLevel pre-tokenizer (required last)");
}

void Tokenizer::Impl::parse_template(const JsonReader& processor) {
  const JsonReader single = processor.array("single");
  const std::optional<JsonReader> specials = processor.optional_object("special_tokens");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const JsonReader item = single[i];
    item.as_object();
    if (const std::optional<JsonReader> sequence = item.find("Sequence")) {
      const std::string id = sequence->string("id");
      if (id != "A") sequence->fail("id", fmt::format("\"{}\" is not supported (expected \"A\")", id));
      if (seen_sequence) item.fail("sequence A appears twice");
      seen_sequence = true;
    } else if (const std::optional<JsonReader> special = item.find("SpecialToken")) {
      const std::string name = special->string("id");
      const std::optional<JsonReader> entry = specials ? specials->find(name) : std::nullopt;
      if (!entry) processor.fail("special_tokens", fmt::format("no entry for \"{}\" used by {}", name, item.path()));
      const JsonReader ids = entry->array("ids");
      for (size_t k = 0; k < ids.size(); ++k)
        (seen_sequence ? suffix : prefix).push_back(token_id(ids[k], listed_tokens));
    } else {
      item.fail(fmt::format("{} is not supported (expected Sequence or SpecialToken)", json_excerpt(item.value())));
    }
  }
  if (!seen_sequence) single.fail("has no Sequence A");
}

void Tokenizer::Impl::parse_post_processor(const std::optional<JsonReader>& post) {
  if (!post) return;
  auto one = [&](const JsonReader& processor) {
    const std::string type = type_of(processor);
    if (type == "TemplateProcessing") {
      if (!prefix.empty() || !suffix.empty()) processor.fail("a second TemplateProcessing is not supported");
      parse_template(processor);
    } else if (type != "ByteLevel") {
      processor.fail("type", fmt::format("\"{}\" is not supported (expected \"ByteLevel\", \"TemplateProcessing\" or "
                                         "a Sequence of them)",
                                         type));
    }
  };
  if (type_of(*post) == "Sequence") {
    const JsonReader list = post->array("processors");
    for (size_t i = 0; i < list.size(); ++i) one(list[i]);
  } else {
    one(*post);
  }
}

std::optional<int32_t> Tokenizer::Impl::config_token(const JsonReader& config, std::string_view key) const {
  const std::optional<JsonReader> token = config.find(key);
  if (!token) return std::nullopt;
  // Either the token's text or an AddedToken object {"content": ..., ...}.
  const std::string content = token->value().is_object() ? token->string("content") : token->as_string();
  const std::optional<int32_t> id = find_id(content);
  if (!id) token->fail(fmt::format("\"{}\" is not a token of tokenizer.json", content));
  return id;
}

void Tokenizer::Impl::parse_config(const JsonReader& config) {
  config.as_object();
  eos = config_token(config, "eos_token");
  pad = config_token(config, "pad_token");
  const std::optional<JsonReader> t = config.find("chat_template");
  if (!t) return;
  if (t->value().is_string()) {
    chat_template = t->as_string();
    return;
  }
  // A list of named templates: the one named "default" is the chat template.
  for (size_t i = 0; i < t->size(); ++i) {
    const JsonReader entry = (*t)[i];
    if (entry.string("name") == "default") {
      chat_template = entry.string("template");
      return;
    }
  }
  t->fail("a list of templates without one named \"default\"");
}

void Tokenizer::Impl::encode(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens) const {
  std::string repaired;
  if (!is_valid_utf8(text)) {
    append_utf8_lossy(text, repaired);
    text = repaired;
  }
  if (add_special_tokens) out.insert(out.end(), prefix.begin(), prefix.end());
  WordCache& cache = word_cache(instance);
  std::string scratch;
  raw_matcher.split(
      text, [&](std::string_view section) { encode_section(section, cache, scratch, out); },
      [&](int32_t id) { out.push_back(id); });
  if (add_special_tokens) out.insert(out.end(), suffix.begin(), suffix.end());
}

void Tokenizer::Impl::encode_section(std::string_view section, WordCache& cache, std::string& scratch,
                                     std::vector<int32_t>& out) const {
  if (nfc && nfc_if_changed(section, scratch)) section = scratch;
  normalized_matcher.split(
      section, [&](std::string_view text) { pre_tokenize(text, 0, cache, out); },
      [&](int32_t id) { out.push_back(id); });
}

void Tokenizer::Impl::pre_tokenize(std::string_view text, size_t level, WordCache& cache,
                                   std::vector<int32_t>& out) const {
  if (level == pre_tokenizer.size()) {
    encode_piece(text, cache, out);
    return;
  }
  pre_tokenizer[level].split(
      text, [&](size_t begin, size_t end) { pre_tokenize(text.substr(begin, end - begin), level + 1, cache, out); });
}

void Tokenizer::Impl::encode_piece(std::string_view piece, WordCache& cache, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    if (auto it = piece_to_id.find(piece); it != piece_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = piece.size() > 1 && piece.size() <= kCacheMaxBytes;
  if (cacheable) {
    if (auto it = cache.entries.find(piece); it != cache.entries.end()) {
      out.insert(out.end(), it->second.ids.begin(), it->second.ids.begin() + it->second.count);
      return;
    }
  }
  const size_t before = out.size();
  merger->encode(piece, out);
  const size_t count = out.size() - before;
  if (cacheable && count <= kCacheMaxIds) {
    if (cache.entries.size() >= kCacheMaxEntries) cache.entries.clear();
    CachedIds entry{static_cast<uint32_t>(count), {}};
    std::copy(out.begin() + static_cast<std::ptrdiff_t>(before), out.end(), entry.ids.begin());
    cache.entries.emplace(piece, entry);
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(const std::string& tokenizer_json, const std::string& config_json,
                               const std::string& source) {
  auto impl = std::make_unique<Impl>();
  const std::string file = source + "/tokenizer.json";
  // A vocabulary or added-token list that names a token twice is a broken file, not a choice.
  const json document = parse_json(tokenizer_json, file, DuplicateKeys::Refuse);
  const JsonReader root(document, file);
  root.as_object();
  const std::optional<JsonReader> added_tokens = root.optional_array("added_tokens");
  impl->listed_tokens = added_tokens ? static_cast<int64_t>(added_tokens->size()) : 0;  // parse_model adds the vocab
  impl->parse_model(root.object("model"));
  impl->parse_added_tokens(added_tokens);
  impl->parse_normalizer(root.find("normalizer"));
  impl->parse_pre_tokenizer(root);
  impl->parse_post_processor(root.find("post_processor"));
  const std::optional<JsonReader> decoder = root.find("decoder");
  if (!decoder) root.fail("decoder", "missing or null (expected ByteLevel)");
  if (const std::string type = type_of(*decoder); type != "ByteLevel")
    decoder->fail("type", fmt::format("\"{}\" is not supported (expected \"ByteLevel\")", type));

  for (const auto* ids : {&impl->prefix, &impl->suffix})
    for (const int32_t id : *ids)
      if (!impl->known(id)) root.fail("post_processor", fmt::format("template id {} is not a token", id));

  // The matchers point into `added`, which is complete now.
  for (const AddedToken& t : impl->added) {
    if (!t.normalized) {
      impl->raw_matcher.add(t, t.content);
      continue;
    }
    std::string normalized;
    impl->normalized_matcher.add(t, impl->nfc && nfc_if_changed(t.content, normalized) ? normalized : t.content);
  }

  if (!config_json.empty()) {
    const std::string config_file = source + "/tokenizer_config.json";
    const json config = parse_json(config_json, config_file);
    impl->parse_config(JsonReader(config, config_file));
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::string& dir) {
  const std::filesystem::path root(dir);
  const std::filesystem::path config_path = root / "tokenizer_config.json";
  const std::string config = std::filesystem::exists(config_path) ? read_file(config_path) : std::string();
  Tokenizer t = from_json(read_file(root / "tokenizer.json"), config, dir);
  // Newer Hugging Face exports keep the chat template in a file of its own.
  const std::filesystem::path template_path = root / "chat_template.jinja";
  if (t.impl_->chat_template.empty() && std::filesystem::exists(template_path))
    t.impl_->chat_template = read_file(template_path);
  return t;
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, bool add_special_tokens) const {
  impl_->encode(text, out, add_special_tokens);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> out;
  impl_->encode(text, out, add_special_tokens);
  return out;
}

std::string_view Tokenizer::token_bytes(int32_t id, bool skip_special_tokens) const {
  if (!impl_->known(id))
    throw Error(fmt::format("decode: token id {} is not in the vocabulary (ids 0..{})", id, vocab_size() - 1));
  if (skip_special_tokens && impl_->id_kind[static_cast<size_t>(id)] == Impl::kSpecial) return {};
  return impl_->id_bytes[static_cast<size_t>(id)];
}

bool Tokenizer::has_id(int32_t id) const {
  return impl_->known(id);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) bytes += token_bytes(id, skip_special_tokens);
  std::string text;
  append_utf8_lossy(bytes, text);
  return text;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->find_id(token);
}

int64_t Tokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->id_kind.size());
}

std::optional<int32_t> Tokenizer::eos_token_id() const {
  return impl_->eos;
}

std::optional<int32_t> Tokenizer::pad_token_id() const {
  return impl_->pad;
}

const std::string& Tokenizer::chat_template() const {
  return impl_->chat_template;
}

}  // namespace memtune

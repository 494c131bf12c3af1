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

// Short rendering of a JSON value for error messages.
std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// Typed access to a parsed JSON file with errors that name the file and field.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& message) const {
    throw Error(fmt::format("{}: {}: {}", file_, path, message));
  }

  json parse(const std::string& text) const {
    try {
      return json::parse(text);
    } catch (const json::parse_error& e) {
      throw Error(fmt::format("{}: not valid JSON: {}", file_, e.what()));
    }
  }

  // The member, or nullptr when it is absent.
  static const json* member(const json& object, const char* key) {
    auto it = object.find(key);
    return it == object.end() ? nullptr : &*it;
  }
  // The member when present and not null.
  static const json* non_null(const json& object, const char* key) {
    const json* v = member(object, key);
    return v && !v->is_null() ? v : nullptr;
  }

  const json& require(const json& object, const char* key, const std::string& path) const {
    const json* v = member(object, key);
    if (!v) fail(path, "missing");
    return *v;
  }
  std::string string(const json& v, const std::string& path) const {
    if (!v.is_string()) fail(path, fmt::format("expected a string, got {}", show(v)));
    return v.get<std::string>();
  }
  std::string string_member(const json& object, const char* key, const std::string& path) const {
    return string(require(object, key, path), path);
  }
  bool bool_member(const json& object, const char* key, bool fallback, const std::string& path) const {
    const json* v = non_null(object, key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(path, fmt::format("expected true or false, got {}", show(*v)));
    return v->get<bool>();
  }
  int32_t id(const json& v, const std::string& path) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (int64_t{1} << 31) - 1)
      fail(path, fmt::format("expected a token id (integer >= 0), got {}", show(v)));
    return static_cast<int32_t>(v.get<int64_t>());
  }
  const json& array(const json& v, const std::string& path) const {
    if (!v.is_array()) fail(path, fmt::format("expected an array, got {}", show(v)));
    return v;
  }
  const json& object(const json& v, const std::string& path) const {
    if (!v.is_object()) fail(path, fmt::format("expected an object, got {}", show(v)));
    return v;
  }
  // The "type" member of a component object.
  std::string type_of(const json& v, const std::string& path) const {
    return string_member(object(v, path), "type", path + ".type");
  }

 private:
  std::string file_;
};

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

  StringMap<int32_t> vocab;             // vocabulary token (byte-level string) -> id
  std::vector<AddedToken> added;        // never resized after the matchers point into it
  StringMap<int32_t> added_by_content;  // added token content -> id
  AddedTokenMatcher raw_matcher;        // added tokens with normalized = false
  AddedTokenMatcher normalized_matcher; // added tokens with normalized = true
  bool nfc = false;
  std::vector<SplitRegex> pre_tokenizer;  // applied in order; each splits the previous pieces
  std::optional<BytePairMerger> merger;
  bool ignore_merges = false;
  StringMap<int32_t> piece_to_id;  // raw bytes of each vocabulary token (only for ignore_merges)
  std::vector<int32_t> prefix, suffix;  // TemplateProcessing around the text's ids

  // Decoding: the bytes each id stands for and what kind of token it is.
  enum Kind : uint8_t { kUnused, kVocab, kAdded, kSpecial };
  std::vector<std::string> id_bytes;
  std::vector<Kind> id_kind;

  std::optional<int32_t> eos, pad;
  std::string chat_template;

  void parse_model(const Reader& r, const json& model);
  void parse_added_tokens(const Reader& r, const json* tokens);
  void parse_normalizer(const Reader& r, const json* normalizer);
  void parse_pre_tokenizer(const Reader& r, const json* pre_tokenizer);
  void parse_byte_level(const Reader& r, const json& v, const std::string& path);
  void parse_post_processor(const Reader& r, const json* post_processor);
  void parse_template(const Reader& r, const json& v, const std::string& path);
  void parse_config(const Reader& r, const json& config);
  std::optional<int32_t> config_token(const Reader& r, const json& config, const char* key) const;

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

void Tokenizer::Impl::parse_model(const Reader& r, const json& model) {
  r.object(model, "model");
  const std::string type = r.string_member(model, "type", "model.type");
  if (type != "BPE") r.fail("model.type", fmt::format("\"{}\" is not supported (expected \"BPE\")", type));
  if (Reader::non_null(model, "dropout"))
    r.fail("model.dropout", "BPE dropout is not supported (expected null)");
  if (r.bool_member(model, "byte_fallback", false, "model.byte_fallback"))
    r.fail("model.byte_fallback", "byte fallback is not supported (expected false)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* v = Reader::non_null(model, key);
    if (v && !(v->is_string() && v->get<std::string>().empty()))
      r.fail(fmt::format("model.{}", key), fmt::format("{} is not supported (expected null)", show(*v)));
  }
  ignore_merges = r.bool_member(model, "ignore_merges", false, "model.ignore_merges");

  const json& vocab_json = r.object(r.require(model, "vocab", "model.vocab"), "model.vocab");
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id_json] : vocab_json.items()) {
    const int32_t id = r.id(id_json, fmt::format("model.vocab[\"{}\"]", token));
    vocab.emplace(token, id);
    if (static_cast<size_t>(id) >= id_kind.size()) {
      id_kind.resize(static_cast<size_t>(id) + 1, kUnused);
      id_bytes.resize(static_cast<size_t>(id) + 1);
    }
    if (id_kind[static_cast<size_t>(id)] != kUnused)
      r.fail(fmt::format("model.vocab[\"{}\"]", token), fmt::format("id {} is used by two tokens", id));
    id_kind[static_cast<size_t>(id)] = kVocab;
  }

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
      r.fail("model.vocab", fmt::format("no token \"{}\" for byte 0x{:02X}; a byte-level vocabulary needs all 256",
                                        symbol, b));
    byte_ids[static_cast<size_t>(b)] = it->second;
  }
  for (const auto& [token, id] : vocab) {
    // A token with a character outside the byte alphabet decodes to its own UTF-8 text, as the
    // Rust ByteLevel decoder does.
    std::string bytes;
    bool byte_level = is_valid_utf8(token);
    for (size_t i = 0; byte_level && i < token.size();) {
      auto it = to_byte.find(next_code_point(token, i));
      if (it == to_byte.end()) byte_level = false;
      else bytes += static_cast<char>(it->second);
    }
    id_bytes[static_cast<size_t>(id)] = byte_level ? bytes : token;
    if (ignore_merges && byte_level) piece_to_id.emplace(std::move(bytes), id);
  }

  merger.emplace(byte_ids);
  const json& merges = r.array(r.require(model, "merges", "model.merges"), "model.merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string path = fmt::format("model.merges[{}]", rank);
    const json& m = merges[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(path, fmt::format("expected \"left right\" with exactly one space, got {}", show(m)));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      r.fail(path, fmt::format("expected \"left right\" or [\"left\", \"right\"], got {}", show(m)));
    }
    const auto l = vocab.find(left), rt = vocab.find(right), merged = vocab.find(left + right);
    if (l == vocab.end() || rt == vocab.end() || merged == vocab.end())
      r.fail(path, fmt::format("\"{}\", \"{}\" or their concatenation is not in model.vocab", left, right));
    merger->add_merge(l->second, rt->second, static_cast<int32_t>(rank), merged->second);
  }
}

void Tokenizer::Impl::parse_added_tokens(const Reader& r, const json* tokens) {
  if (!tokens || tokens->is_null()) return;
  r.array(*tokens, "added_tokens");
  added.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const std::string path = fmt::format("added_tokens[{}]", i);
    const json& t = r.object((*tokens)[i], path);
    AddedToken a;
    a.id = r.id(r.require(t, "id", path + ".id"), path + ".id");
    a.content = r.string_member(t, "content", path + ".content");
    if (a.content.empty()) r.fail(path + ".content", "empty");
    if (!is_valid_utf8(a.content)) r.fail(path + ".content", "not valid UTF-8");
    a.special = r.bool_member(t, "special", false, path + ".special");
    a.normalized = r.bool_member(t, "normalized", !a.special, path + ".normalized");
    a.lstrip = r.bool_member(t, "lstrip", false, path + ".lstrip");
    a.rstrip = r.bool_member(t, "rstrip", false, path + ".rstrip");
    a.single_word = r.bool_member(t, "single_word", false, path + ".single_word");
    if (!added_by_content.emplace(a.content, a.id).second)
      r.fail(path + ".content", fmt::format("\"{}\" is listed twice", a.content));
    if (auto it = vocab.find(a.content); it != vocab.end() && it->second != a.id)
      r.fail(path, fmt::format("\"{}\" has id {} but model.vocab gives it id {}", a.content, a.id, it->second));
    const auto slot = static_cast<size_t>(a.id);
    if (slot >= id_kind.size()) {
      id_kind.resize(slot + 1, kUnused);
      id_bytes.resize(slot + 1);
    }
    if (id_kind[slot] == kAdded || id_kind[slot] == kSpecial)
      r.fail(path + ".id", fmt::format("id {} is used by two added tokens", a.id));
    if (id_kind[slot] == kVocab && !vocab.contains(a.content))
      r.fail(path + ".id", fmt::format("id {} already belongs to another model.vocab token", a.id));
    id_kind[slot] = a.special ? kSpecial : kAdded;
    id_bytes[slot] = a.content;
    added.push_back(std::move(a));
  }
}

void Tokenizer::Impl::parse_normalizer(const Reader& r, const json* normalizer) {
  if (!normalizer || normalizer->is_null()) return;
  const std::string type = r.type_of(*normalizer, "normalizer");
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const json& list = r.array(r.require(*normalizer, "normalizers", "normalizer.normalizers"), "normalizer.normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string path = fmt::format("normalizer.normalizers[{}]", i);
      const std::string t = r.type_of(list[i], path);
      if (t != "NFC") r.fail(path + ".type", fmt::format("\"{}\" is not supported (expected \"NFC\")", t));
      nfc = true;
    }
  } else {
    r.fail("normalizer.type", fmt::format("\"{}\" is not supported (expected null, \"NFC\" or a Sequence of NFC)", type));
  }
}

void Tokenizer::Impl::parse_byte_level(const Reader& r, const json& v, const std::string& path) {
  // Hugging Face's default for add_prefix_space is true, so an absent field counts as true.
  if (r.bool_member(v, "add_prefix_space", true, path + ".add_prefix_space"))
    r.fail(path + ".add_prefix_space", "true (or absent) is not supported (expected false)");
  if (r.bool_member(v, "use_regex", true, path + ".use_regex"))
    pre_tokenizer.emplace_back(kGpt2Pattern, path + " (GPT-2 regex)");
}

void Tokenizer::Impl::parse_pre_tokenizer(const Reader& r, const json* pre) {
  if (!pre || pre->is_null()) r.fail("pre_tokenizer", "null is not supported (expected ByteLevel or a Sequence ending in ByteLevel)");
  const std::string type = r.type_of(*pre, "pre_tokenizer");
  if (type == "ByteLevel") {
    parse_byte_level(r, *pre, "pre_tokenizer");
    return;
  }
  if (type != "Sequence")
    r.fail("pre_tokenizer.type", fmt::format("\"{}\" is not supported (expected \"ByteLevel\" or \"Sequence\")", type));
  const json& list =
      r.array(r.require(*pre, "pretokenizers", "pre_tokenizer.pretokenizers"), "pre_tokenizer.pretokenizers");
  bool byte_level = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("pre_tokenizer.pretokenizers[{}]", i);
    const std::string t = r.type_of(list[i], path);
    if (byte_level) r.fail(path, "ByteLevel must be the last pre-tokenizer of the Sequence");
    if (t == "ByteLevel") {
      parse_byte_level(r, list[i], path);
      byte_level = true;
    } else if (t == "Split") {
      const json& pattern = r.object(r.require(list[i], "pattern", path + ".pattern"), path + ".pattern");
      if (!Reader::member(pattern, "Regex"))
        r.fail(path + ".pattern", fmt::format("{} is not supported (expected {{\"Regex\": ...}})", show(pattern)));
      const std::string regex = r.string_member(pattern, "Regex", path + ".pattern.Regex");
      const std::string behavior = r.string_member(list[i], "behavior", path + ".behavior");
      if (behavior != "Isolated")
        r.fail(path + ".behavior", fmt::format("\"{}\" is not supported (expected \"Isolated\")", behavior));
      if (r.bool_member(list[i], "invert", false, path + ".invert"))
        r.fail(path + ".invert", "true is not supported (expected false)");
      pre_tokenizer.emplace_back(regex, path + ".pattern.Regex");
    } else {
      r.fail(path + ".type", fmt::format("\"{}\" is not supported (expected \"Split\" or \"ByteLevel\")", t));
    }
  }
  if (!byte_level) r.fail("pre_tokenizer.pretokenizers", "no ByteLevel pre-tokenizer (required last)");
}

void Tokenizer::Impl::parse_template(const Reader& r, const json& v, const std::string& path) {
  const json& single = r.array(r.require(v, "single", path + ".single"), path + ".single");
  const json* specials = Reader::member(v, "special_tokens");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item_path = fmt::format("{}.single[{}]", path, i);
    const json& item = r.object(single[i], item_path);
    if (const json* seq = Reader::member(item, "Sequence")) {
      const std::string id = r.string_member(r.object(*seq, item_path + ".Sequence"), "id", item_path + ".Sequence.id");
      if (id != "A") r.fail(item_path + ".Sequence.id", fmt::format("\"{}\" is not supported (expected \"A\")", id));
      if (seen_sequence) r.fail(item_path, "sequence A appears twice");
      seen_sequence = true;
    } else if (const json* special = Reader::member(item, "SpecialToken")) {
      const std::string name =
          r.string_member(r.object(*special, item_path + ".SpecialToken"), "id", item_path + ".SpecialToken.id");
      const json* entry = specials && specials->is_object() ? Reader::member(*specials, name.c_str()) : nullptr;
      if (!entry) r.fail(path + ".special_tokens", fmt::format("no entry for \"{}\" used by {}", name, item_path));
      const std::string ids_path = fmt::format("{}.special_tokens[\"{}\"].ids", path, name);
      for (const json& id : r.array(r.require(r.object(*entry, ids_path), "ids", ids_path), ids_path))
        (seen_sequence ? suffix : prefix).push_back(r.id(id, ids_path));
    } else {
      r.fail(item_path, fmt::format("{} is not supported (expected Sequence or SpecialToken)", show(item)));
    }
  }
  if (!seen_sequence) r.fail(path + ".single", "has no Sequence A");
}

void Tokenizer::Impl::parse_post_processor(const Reader& r, const json* post) {
  if (!post || post->is_null()) return;
  auto one = [&](const json& v, const std::string& path) {
    const std::string type = r.type_of(v, path);
    if (type == "TemplateProcessing") {
      if (!prefix.empty() || !suffix.empty()) r.fail(path, "a second TemplateProcessing is not supported");
      parse_template(r, v, path);
    } else if (type != "ByteLevel") {
      r.fail(path + ".type",
             fmt::format("\"{}\" is not supported (expected \"ByteLevel\", \"TemplateProcessing\" or a Sequence of them)", type));
    }
  };
  if (r.type_of(*post, "post_processor") == "Sequence") {
    const json& list =
        r.array(r.require(*post, "processors", "post_processor.processors"), "post_processor.processors");
    for (size_t i = 0; i < list.size(); ++i) one(list[i], fmt::format("post_processor.processors[{}]", i));
  } else {
    one(*post, "post_processor");
  }
}

std::optional<int32_t> Tokenizer::Impl::config_token(const Reader& r, const json& config, const char* key) const {
  const json* v = Reader::non_null(config, key);
  if (!v) return std::nullopt;
  // Either the token's text or an AddedToken object {"content": ..., ...}.
  const std::string content =
      v->is_object() ? r.string_member(*v, "content", fmt::format("{}.content", key)) : r.string(*v, key);
  const std::optional<int32_t> id = find_id(content);
  if (!id) r.fail(key, fmt::format("\"{}\" is not a token of tokenizer.json", content));
  return id;
}

void Tokenizer::Impl::parse_config(const Reader& r, const json& config) {
  r.object(config, "(top level)");
  eos = config_token(r, config, "eos_token");
  pad = config_token(r, config, "pad_token");
  const json* t = Reader::non_null(config, "chat_template");
  if (!t) return;
  if (t->is_string()) {
    chat_template = t->get<std::string>();
    return;
  }
  // A list of named templates: the one named "default" is the chat template.
  const json& list = r.array(*t, "chat_template");
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("chat_template[{}]", i);
    const json& entry = r.object(list[i], path);
    if (r.string_member(entry, "name", path + ".name") == "default") {
      chat_template = r.string_member(entry, "template", path + ".template");
      return;
    }
  }
  r.fail("chat_template", "a list of templates without one named \"default\"");
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
  pre_tokenizer[level].split(text, [&](size_t begin, size_t end) {
    pre_tokenize(text.substr(begin, end - begin), level + 1, cache, out);
  });
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
  const Reader r(source + "/tokenizer.json");
  const json root = r.parse(tokenizer_json);
  r.object(root, "(top level)");
  impl->parse_model(r, r.require(root, "model", "model"));
  impl->parse_added_tokens(r, Reader::member(root, "added_tokens"));
  impl->parse_normalizer(r, Reader::member(root, "normalizer"));
  impl->parse_pre_tokenizer(r, Reader::member(root, "pre_tokenizer"));
  impl->parse_post_processor(r, Reader::member(root, "post_processor"));
  const json* decoder = Reader::non_null(root, "decoder");
  if (!decoder) r.fail("decoder", "missing or null (expected ByteLevel)");
  if (const std::string type = r.type_of(*decoder, "decoder"); type != "ByteLevel")
    r.fail("decoder.type", fmt::format("\"{}\" is not supported (expected \"ByteLevel\")", type));

  for (const auto* ids : {&impl->prefix, &impl->suffix})
    for (const int32_t id : *ids)
      if (!impl->known(id)) r.fail("post_processor", fmt::format("template id {} is not a token", id));

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
    const Reader c(source + "/tokenizer_config.json");
    impl->parse_config(c, c.parse(config_json));
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

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (!impl_->known(id))
      throw Error(fmt::format("decode: token id {} is not in the vocabulary (ids 0..{})", id, vocab_size() - 1));
    if (skip_special_tokens && impl_->id_kind[static_cast<size_t>(id)] == Impl::kSpecial) continue;
    bytes += impl_->id_bytes[static_cast<size_t>(id)];
  }
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

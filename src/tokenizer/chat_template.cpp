// Chat templates written out in C++ (see chat_template.h): recognition of the tokenizer's Jinja
// template by its distinctive literals, conversation validation, rendering to trainable and
// untrainable segments, and tokenization: segment by segment into ids and unshifted labels
// (training), or the whole text into ids (prompts).
#include "tokenizer/chat_template.h"

#include <fmt/format.h>

#include <array>
#include <cctype>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace memtune {

namespace {

constexpr std::array<std::pair<std::string_view, ChatTemplate>, 5> kTemplateNames{{
    {"qwen2_5", ChatTemplate::Qwen2_5},
    {"chatml", ChatTemplate::ChatML},
    {"plain", ChatTemplate::Plain},
    {"qwen3", ChatTemplate::Qwen3},
    {"llama3", ChatTemplate::Llama3},
}};

constexpr std::string_view kTemplateChoice = "pass --template qwen2_5|chatml|plain|qwen3|llama3";

// Whitespace runs become one space, so literals match however the template is indented or
// line-wrapped.
std::string collapse_whitespace(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  bool in_space = false;
  for (char c : text) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      in_space = true;
      continue;
    }
    if (in_space && !out.empty()) out += ' ';
    in_space = false;
    out += c;
  }
  return out;
}

// True when some string literal in the template writes a system header followed directly by
// literal text ('<|im_start|>system\nYou are ...'): a default system message baked into the
// template, which plain ChatML rendering would silently leave out.
bool has_literal_default_system(std::string_view text) {
  constexpr std::string_view header = "<|im_start|>system";
  for (size_t at = text.find(header); at != std::string_view::npos; at = text.find(header, at + 1)) {
    std::string_view rest = text.substr(at + header.size());
    // The newline after the role: Jinja's escape "\n" in the source, or a real newline.
    if (rest.starts_with("\\n"))
      rest.remove_prefix(2);
    else if (rest.starts_with("\n"))
      rest.remove_prefix(1);
    else
      continue;
    if (!rest.empty() && rest[0] != '\'' && rest[0] != '"') return true;
  }
  return false;
}

void add(std::vector<ChatSegment>& segments, std::string text, bool trainable) {
  segments.push_back({std::move(text), trainable});
}

// The UTF-8 of the characters Python's str.isspace() accepts (bidirectional class WS, B or S, or
// category Zs), which str.strip() without arguments removes.
constexpr std::array<std::string_view, 29> kPythonSpaces{
    "\t",           "\n",           "\v",           "\f",           "\r",
    "\x1c",         "\x1d",         "\x1e",         "\x1f",         " ",
    "\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80", "\xE2\x80\x80", "\xE2\x80\x81",  // U+0085 U+00A0 U+1680 U+2000..
    "\xE2\x80\x82", "\xE2\x80\x83", "\xE2\x80\x84", "\xE2\x80\x85", "\xE2\x80\x86",
    "\xE2\x80\x87", "\xE2\x80\x88", "\xE2\x80\x89", "\xE2\x80\x8A", "\xE2\x80\xA8",  // ..U+200A U+2028
    "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80",                 // U+2029 U+202F U+205F U+3000
};

// Jinja's trim, which is Python's str.strip(): those characters off both ends.
std::string_view trim_whitespace(std::string_view s) {
  // The length of the space character at the front (or the back) of s, 0 when there is none.
  const auto space = [&s](bool front) -> size_t {
    for (std::string_view c : kPythonSpaces)
      if (front ? s.starts_with(c) : s.ends_with(c)) return c.size();
    return 0;
  };
  for (size_t n; (n = space(true)) > 0;) s.remove_prefix(n);
  for (size_t n; (n = space(false)) > 0;) s.remove_suffix(n);
  return s;
}

// Qwen3's template: a user message that is a tool's result, not a query.
bool is_tool_response(const ChatMessage& m) {
  return m.content.starts_with("<tool_response>") && m.content.ends_with("</tool_response>");
}

}  // namespace

ChatTemplate parse_chat_template(std::string_view name) {
  for (const auto& [n, t] : kTemplateNames)
    if (n == name) return t;
  throw Error(fmt::format("unknown chat template \"{}\": expected qwen2_5, chatml, plain, qwen3 or llama3", name));
}

std::string_view chat_template_name(ChatTemplate chat_template) {
  for (const auto& [n, t] : kTemplateNames)
    if (t == chat_template) return n;
  throw InternalError("chat template without a name");
}

ChatTemplate detect_chat_template(std::string_view jinja_text, std::string_view source) {
  if (jinja_text.empty())
    throw Error(
        fmt::format("{}: the tokenizer has no chat_template (tokenizer_config.json); {}", source, kTemplateChoice));
  const std::string text = collapse_whitespace(jinja_text);
  if (text.find("<|start_header_id|>") != std::string::npos && text.find("<|eot_id|>") != std::string::npos) {
    if (text.find("Cutting Knowledge Date") != std::string::npos)
      throw Error(
          fmt::format("{}: chat_template is Llama 3.1's with its dated default system block (\"Cutting "
                      "Knowledge Date ...\"), which memtune does not render; pass --template llama3 for "
                      "the Llama 3 header format without it",
                      source));
    return ChatTemplate::Llama3;
  }
  if (text.find("<|im_start|>") == std::string::npos)
    throw Error(
        fmt::format("{}: chat_template is not a ChatML template (no <|im_start|>), which memtune does not "
                    "render; {}",
                    source, kTemplateChoice));
  if (text.find("You are Qwen, created by Alibaba Cloud.") != std::string::npos) return ChatTemplate::Qwen2_5;
  if (text.find("<think>") != std::string::npos && text.find("enable_thinking") != std::string::npos)
    return ChatTemplate::Qwen3;
  if (text.find("<think>") != std::string::npos)
    throw Error(fmt::format("{}: chat_template is a reasoning (<think>) template, which memtune does not render; {}",
                            source, kTemplateChoice));
  if (has_literal_default_system(jinja_text))
    throw Error(
        fmt::format("{}: chat_template has a default system message that memtune does not recognize; {} "
                    "(with --system \"...\" to keep that default)",
                    source, kTemplateChoice));
  return ChatTemplate::ChatML;
}

ChatTemplate resolve_chat_template(std::string_view name, const Tokenizer& tokenizer, std::string_view source) {
  if (!name.empty()) return parse_chat_template(name);
  return detect_chat_template(tokenizer.chat_template(), source);
}

void validate_conversation(std::span<const ChatMessage> messages, bool require_final_assistant) {
  if (messages.empty()) throw Error("empty conversation: expected a user message and an assistant reply");
  size_t first = 0;
  if (messages[0].role == "system") first = 1;
  if (first == messages.size()) throw Error("the conversation has only a system message: expected a user message");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role == "tool" || role == "function" || role == "observation" || role == "function_call")
      throw Error(
          fmt::format("message {}: role \"{}\" is not supported yet: expected system, user or assistant", i, role));
    if (role != "system" && role != "user" && role != "assistant")
      throw Error(fmt::format("message {}: unknown role \"{}\": expected system, user or assistant", i, role));
    if (i < first) continue;
    const char* expected = (i - first) % 2 == 0 ? "user" : "assistant";
    if (role != expected) {
      if (i == first)
        throw Error(fmt::format("message {}: expected the conversation to start with a user message{}, got \"{}\"", i,
                                first ? " after the system message" : "", role));
      throw Error(fmt::format("message {}: expected role \"{}\" after \"{}\", got \"{}\"", i, expected,
                              messages[i - 1].role, role));
    }
  }
  if (require_final_assistant && messages.back().role != "assistant")
    throw Error(
        fmt::format("the conversation ends with a \"{}\" message: expected it to end with an assistant reply "
                    "to train on",
                    messages.back().role));
}

std::vector<ChatSegment> render_chat(ChatTemplate chat_template, std::span<const ChatMessage> messages,
                                     const RenderOptions& options) {
  std::vector<ChatSegment> segments;
  const bool all = options.train_on_prompt;
  if (chat_template == ChatTemplate::Plain) {
    MT_ASSERT(!options.eos_token.empty(), "the plain template needs the eos token's text");
    for (const ChatMessage& m : messages) {
      if (m.role == "assistant")
        add(segments, m.content + options.eos_token, all || m.loss);
      else
        add(segments, m.content, all);
    }
    return segments;
  }
  if (chat_template == ChatTemplate::Llama3) {
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      const std::string header =
          std::string(i == 0 ? "<|begin_of_text|>" : "") + "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
      const std::string body = std::string(trim_whitespace(m.content)) + "<|eot_id|>";
      if (m.role == "assistant") {
        add(segments, header, all);
        add(segments, body, all || m.loss);
      } else {
        add(segments, header + body, all);
      }
    }
    if (options.add_generation_prompt)
      add(segments,
          std::string(messages.empty() ? "<|begin_of_text|>" : "") +
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
          all);
    return segments;
  }
  if (chat_template == ChatTemplate::Qwen3) {
    // The template's last_query_index: the last user message that is not a tool response, else
    // the last message (so no reply keeps its reasoning). Replies after it keep their reasoning.
    size_t last_query = messages.empty() ? 0 : messages.size() - 1;
    for (size_t i = messages.size(); i-- > 0;)
      if (messages[i].role == "user" && !is_tool_response(messages[i])) {
        last_query = i;
        break;
      }
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if (m.role != "assistant") {
        add(segments, fmt::format("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content), all);
        continue;
      }
      std::string_view content = m.content, reasoning;
      if (const size_t close = content.find("</think>"); close != std::string_view::npos) {
        // As the template splits: the reasoning is what precedes the first </think> (after its
        // last <think>), the reply what follows the last </think>.
        std::string_view before = content.substr(0, close);
        while (!before.empty() && before.back() == '\n') before.remove_suffix(1);
        if (const size_t open = before.rfind("<think>"); open != std::string_view::npos) before.remove_prefix(open + 7);
        while (!before.empty() && before.front() == '\n') before.remove_prefix(1);
        reasoning = before;
        content = content.substr(content.rfind("</think>") + 8);
        while (!content.empty() && content.front() == '\n') content.remove_prefix(1);
      }
      std::string body;
      if (i > last_query && (i + 1 == messages.size() || !reasoning.empty())) {
        while (!reasoning.empty() && reasoning.front() == '\n') reasoning.remove_prefix(1);
        while (!reasoning.empty() && reasoning.back() == '\n') reasoning.remove_suffix(1);
        std::string_view reply = content;
        while (!reply.empty() && reply.front() == '\n') reply.remove_prefix(1);
        body = fmt::format("<think>\n{}\n</think>\n\n{}", reasoning, reply);
      } else {
        body = std::string(content);
      }
      add(segments, "<|im_start|>assistant\n", all);
      add(segments, body + "<|im_end|>", all || m.loss);
      add(segments, "\n", all);
    }
    if (options.add_generation_prompt)
      add(segments,
          options.enable_thinking ? "<|im_start|>assistant\n" : "<|im_start|>assistant\n<think>\n\n</think>\n\n", all);
    return segments;
  }
  if (chat_template == ChatTemplate::Qwen2_5 && (messages.empty() || messages[0].role != "system"))
    add(segments, fmt::format("<|im_start|>system\n{}<|im_end|>\n", kQwen2_5DefaultSystem), all);
  for (const ChatMessage& m : messages) {
    if (m.role == "assistant") {
      add(segments, "<|im_start|>assistant\n", all);
      add(segments, m.content + "<|im_end|>", all || m.loss);
      add(segments, "\n", all);
    } else {
      add(segments, fmt::format("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content), all);
    }
  }
  if (options.add_generation_prompt) add(segments, "<|im_start|>assistant\n", all);
  return segments;
}

std::vector<int32_t> encode_chat_text(const Tokenizer& tokenizer, std::span<const ChatSegment> segments) {
  std::string text;
  for (const ChatSegment& segment : segments) text += segment.text;
  return tokenizer.encode(text);
}

void encode_segments(const Tokenizer& tokenizer, std::span<const ChatSegment> segments, std::vector<int32_t>& ids,
                     std::vector<int32_t>& labels) {
  MT_ASSERT(ids.size() == labels.size());
  for (const ChatSegment& s : segments) {
    const size_t begin = ids.size();
    tokenizer.encode(s.text, ids);
    if (s.trainable)
      labels.insert(labels.end(), ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.end());
    else
      labels.resize(ids.size(), kIgnoreIndex);
  }
}

std::vector<int32_t> chat_prompt_ids(const Tokenizer& tokenizer, ChatTemplate chat_template,
                                     std::vector<ChatMessage> messages, const std::string& system,
                                     bool enable_thinking) {
  if (!system.empty() && (messages.empty() || messages[0].role != "system"))
    messages.insert(messages.begin(), ChatMessage{.role = "system", .content = system});
  validate_conversation(messages, false);
  if (messages.back().role != "user") throw Error("the last message must be the user's: generation writes the reply");
  RenderOptions options;
  options.add_generation_prompt = true;
  options.enable_thinking = enable_thinking;
  if (const auto eos = tokenizer.eos_token_id()) options.eos_token = tokenizer.decode(std::vector<int32_t>{*eos});
  return encode_chat_text(tokenizer, render_chat(chat_template, messages, options));
}

}  // namespace memtune

// Chat templates: a conversation rendered to text segments, each marked trainable or not, then
// tokenized in one of two ways. encode_chat_text tokenizes the rendered text whole, as Hugging
// Face's apply_chat_template(tokenize=True) and the inference servers (vLLM, TGI) do: generation
// prompts (generate, chat, serve) and `memtune tokenize --chat`. encode_segments tokenizes
// segment by segment, as LLaMA-Factory and ms-swift do, with labels: the training (and
// evaluation) examples, so that each reply's ids start exactly where generation starts.
// The two differ only where a token would straddle a segment boundary, e.g. a reply that starts
// with "\n" right after "<|im_start|>assistant\n" (whole: "\n\n" is one token). Instead of a
// Jinja interpreter, the few templates memtune trains with are written out here and recognized
// from the tokenizer's chat_template text; anything else asks the user to name one, so a model is
// never trained with a silently different format.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/labels.h"

namespace memtune {

class Tokenizer;

enum class ChatTemplate {
  // ChatML with Qwen2.5's default system message when the conversation has none.
  Qwen2_5,
  // <|im_start|>{role}\n{content}<|im_end|>\n, no default system message.
  ChatML,
  // The contents back to back with no separators; each assistant message is followed by the
  // eos token. For base models and for data whose prompts already carry their own formatting.
  Plain,
  // Qwen3's ChatML: no default system message; the assistant reply after the last user message
  // carries its reasoning as <think>\n...\n</think>\n\n (empty when it has none), earlier replies
  // lose theirs; with enable_thinking false the generation prompt ends in an empty think block.
  // As in Qwen3's template, a user message whose content is '<tool_response>...</tool_response>'
  // does not count as the last user message; when every one is such, no reply keeps reasoning.
  Qwen3,
  // Llama 3: <|begin_of_text|>, then <|start_header_id|>{role}<|end_header_id|>\n\n{content,
  // trimmed}<|eot_id|> per message (no default system message). Trimmed as Jinja's `trim` (Python's
  // str.strip()) does: every character str.isspace() accepts, Unicode spaces included.
  Llama3,
};

// "qwen2_5" | "chatml" | "plain" | "qwen3" | "llama3"; anything else is an Error listing these.
ChatTemplate parse_chat_template(std::string_view name);
std::string_view chat_template_name(ChatTemplate chat_template);

// Recognizes a tokenizer_config.json chat_template (Jinja source): Qwen2.5's (ChatML with the
// "You are Qwen, created by Alibaba Cloud..." default system), Qwen3's (ChatML with <think> and
// enable_thinking), Llama 3's header format, or a plain ChatML template without a default system
// message. Anything else, or an empty text, is an Error asking for --template.
// `source` names the tokenizer in the message.
ChatTemplate detect_chat_template(std::string_view jinja_text, std::string_view source);

// The user's choice if given (non-empty name), else the one detected from the tokenizer.
ChatTemplate resolve_chat_template(std::string_view name, const Tokenizer& tokenizer, std::string_view source);

inline constexpr std::string_view kQwen2_5DefaultSystem =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

// Roles are "system", "user" and "assistant". Tool and function messages are refused for now
// (validate_conversation names them): memtune has no tool-calling format yet, and rendering
// them some other way than the model's own template would teach it the wrong format.
struct ChatMessage {
  std::string role;
  std::string content;
  bool loss = true;  // consulted for assistant messages only: false keeps that reply untrained
};

// Throws an Error (without a location; callers add file:line) unless the conversation is:
// an optional system message first, then user and assistant messages strictly alternating,
// starting with user; with require_final_assistant (training) it must end with an assistant
// message. An empty conversation or one with no user message is refused.
void validate_conversation(std::span<const ChatMessage> messages, bool require_final_assistant);

struct ChatSegment {
  std::string text;
  bool trainable = false;
};

struct RenderOptions {
  // Append the assistant header (<|im_start|>assistant\n; nothing for Plain) for generation.
  bool add_generation_prompt = false;
  // Every segment trainable: the prompt, and replies marked loss=false, included.
  bool train_on_prompt = false;
  // The eos token's text (e.g. "<|endoftext|>"); required by Plain, unused otherwise.
  std::string eos_token;
  // Qwen3: false ends the generation prompt with an empty think block (no reasoning).
  bool enable_thinking = true;
};

// Renders a conversation that passed validate_conversation(messages, false). Trainable are the
// assistant contents with their closing <|im_end|> (Plain: eos; Llama3: <|eot_id|>; Qwen3: the
// think block too), not the assistant header and not the "\n" after <|im_end|>; an assistant
// message with loss=false is not trainable.
std::vector<ChatSegment> render_chat(ChatTemplate chat_template, std::span<const ChatMessage> messages,
                                     const RenderOptions& options);

// Tokenizes each segment on its own (as LLaMA-Factory and ms-swift encode prompt and response
// apart) and appends the ids to `ids` and, to `labels`, the id for a trainable token and -100
// otherwise (unshifted labels, the Hugging Face convention). Training and evaluation examples are
// built this way on purpose: generation starts from a prompt whose last token is the header's
// ("assistant\n") and the model writes the reply's tokens after it, so a reply is trained as the
// tokens it is generated as. Tokenizing the whole text would merge a reply's leading "\n" into
// the header's token ("\n\n"): masked, so the reply's first character would never be trained.
void encode_segments(const Tokenizer& tokenizer, std::span<const ChatSegment> segments, std::vector<int32_t>& ids,
                     std::vector<int32_t>& labels);

// The segments' text joined, tokenized as one string: Hugging Face's
// apply_chat_template(tokenize=True) and what inference servers feed the model. The ids equal
// encode_segments' except where a token would cross a segment boundary.
std::vector<int32_t> encode_chat_text(const Tokenizer& tokenizer, std::span<const ChatSegment> segments);

// A generation prompt: the conversation (with `system` first when given and the conversation
// has none) rendered with the assistant header appended, as token ids of the whole text (as
// apply_chat_template and vLLM give them). An Error unless the conversation is valid and ends
// with the user's message.
std::vector<int32_t> chat_prompt_ids(const Tokenizer& tokenizer, ChatTemplate chat_template,
                                     std::vector<ChatMessage> messages, const std::string& system,
                                     bool enable_thinking = true);

}  // namespace memtune

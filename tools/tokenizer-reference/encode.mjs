// Reference tokenizer ("oracle") for memtune's tests and benchmark: encodes strings with
// @lenml/tokenizers (a dependency-free fork of transformers.js' tokenizers), which is
// independent of memtune's C++ implementation.
//   node encode.mjs --tokenizer DIR --input FILE.jsonl [--add_special_tokens]
//       reads one JSON string per line, prints one JSON array of ids per line;
//   node encode.mjs --tokenizer DIR --input FILE.jsonl --bench
//       encodes the whole file (after one warm-up pass) and prints one JSON line with the
//       single-threaded throughput in MB/s (10^6 bytes of UTF-8 input per second).
// DIR holds tokenizer.json and tokenizer_config.json. The packages are loaded from out/npm
// (scripts/prepare-tokenizer.sh installs them there) or from $MEMTUNE_NPM_DIR.
import { readFileSync, existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

function usage(message) {
  if (message) console.error(`encode.mjs: ${message}`);
  console.error("usage: node encode.mjs --tokenizer DIR --input FILE.jsonl [--add_special_tokens] [--bench]");
  process.exit(2);
}

const args = { tokenizer: null, input: null, bench: false, addSpecial: false };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; ++i) {
  const a = argv[i];
  if (a === "--tokenizer") args.tokenizer = argv[++i];
  else if (a === "--input") args.input = argv[++i];
  else if (a === "--bench") args.bench = true;
  else if (a === "--add_special_tokens") args.addSpecial = true;
  else usage(`unknown argument '${a}'`);
}
if (!args.tokenizer || !args.input) usage("--tokenizer and --input are required");

const here = dirname(fileURLToPath(import.meta.url));
const npmDir = process.env.MEMTUNE_NPM_DIR ?? resolve(here, "../../out/npm");
const entry = join(npmDir, "node_modules/@lenml/tokenizers/dist/main.mjs");
if (!existsSync(entry)) {
  console.error(`encode.mjs: ${entry} not found; run scripts/prepare-tokenizer.sh first`);
  process.exit(1);
}
const { TokenizerLoader } = await import(pathToFileURL(entry).href);

const readJson = (name) => JSON.parse(readFileSync(join(args.tokenizer, name), "utf8"));
const configPath = join(args.tokenizer, "tokenizer_config.json");
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: readJson("tokenizer.json"),
  tokenizerConfig: existsSync(configPath) ? readJson("tokenizer_config.json") : {},
});

const lines = readFileSync(args.input, "utf8").split("\n").filter((l) => l.length > 0);
const texts = lines.map((l, i) => {
  const v = JSON.parse(l);
  if (typeof v !== "string") {
    console.error(`encode.mjs: ${args.input}:${i + 1}: expected a JSON string`);
    process.exit(1);
  }
  return v;
});
const encode = (t) => tokenizer.encode(t, { add_special_tokens: args.addSpecial });

if (args.bench) {
  const bytes = texts.reduce((n, t) => n + Buffer.byteLength(t, "utf8"), 0);
  let tokens = 0;
  for (const t of texts) encode(t); // warm-up: JIT compilation and the BPE cache
  const t0 = process.hrtime.bigint();
  for (const t of texts) tokens += encode(t).length;
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  console.log(JSON.stringify({ strings: texts.length, bytes, tokens, seconds, mb_per_s: bytes / seconds / 1e6 }));
} else {
  const out = [];
  for (const t of texts) out.push(JSON.stringify(encode(t)));
  process.stdout.write(out.length ? out.join("\n") + "\n" : "");
}

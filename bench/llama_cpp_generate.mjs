// Generation speed of llama.cpp on a GGUF file (bench/gguf_writer.py writes one from a memtune /
// Hugging Face checkpoint), for the comparison with memtune's bench_generate on the same weights.
// llama.cpp runs through node-llama-cpp's prebuilt CPU binary (bench/llama-cpp pins it; install it
// with scripts/npm-pinned.sh bench/llama-cpp out/llama-cpp): gpu off, never built from source,
// nothing downloaded. After one untimed warm-up pass, each round feeds the same prompt of --prompt
// pseudo-random token ids (from --seed) to a cleared sequence and decodes --new tokens greedily at
// batch 1, eos included, as memtune's bench_generate does: prefill tokens/s is the prompt over the
// time to the first new token, decode tokens/s the other new tokens over the time after it. Prints
// one JSON line at the end (the medians over the rounds; every round is in "rounds").
// --check decodes --new tokens greedily after --prompt_ids and prints them (JSON), with each step's
// top candidates and their probabilities, for comparing with memtune generate on the same model.
// Usage: node bench/llama_cpp_generate.mjs --model FILE.gguf [--threads 2] [--prompt 128] [--new 128]
//        [--rounds 3] [--seed 1]
//        node bench/llama_cpp_generate.mjs --model FILE.gguf --check --prompt_ids 1,2,3 [--new 16]
import { existsSync, readFileSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { availableParallelism } from "node:os";

const options = { threads: availableParallelism(), prompt: 128, new: 128, rounds: 3, seed: 1 };
const args = process.argv.slice(2);
for (let i = 0; i < args.length; ++i) {
  const key = args[i].replace(/^--/, "");
  if (key === "check") options.check = true;
  else if (["model", "prompt_ids", "threads", "prompt", "new", "rounds", "seed"].includes(key) && i + 1 < args.length)
    options[key] = ["model", "prompt_ids"].includes(key) ? args[++i] : Number(args[++i]);
  else {
    console.error(`llama_cpp_generate: unknown or incomplete option ${args[i]}`);
    process.exit(2);
  }
}
for (const key of ["threads", "prompt", "new", "rounds"]) {
  if (!Number.isInteger(options[key]) || options[key] < 1) {
    console.error(`llama_cpp_generate: --${key} takes a positive integer`);
    process.exit(2);
  }
}
if (!options.model || !existsSync(options.model)) {
  console.error(`llama_cpp_generate: --model FILE.gguf is required${options.model ? ` (${options.model} not found)` : ""}`);
  process.exit(2);
}

// node-llama-cpp from the pinned install under out/ (or NODE_LLAMA_CPP_DIR, a node_modules' parent).
const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const installDir = process.env.NODE_LLAMA_CPP_DIR ?? join(root, "out", "llama-cpp");
const entry = join(installDir, "node_modules", "node-llama-cpp", "dist", "index.js");
if (!existsSync(entry)) {
  console.error(`llama_cpp_generate: ${entry} missing; run scripts/npm-pinned.sh bench/llama-cpp out/llama-cpp`);
  process.exit(1);
}
const { getLlama, GgmlType } = await import(pathToFileURL(entry).href);
const version = JSON.parse(readFileSync(join(entry, "..", "..", "package.json"), "utf8")).version;

// The prebuilt CPU binary only: gpu false picks @node-llama-cpp/linux-x64, build "never" and
// skipDownload forbid compiling or fetching llama.cpp (a missing binary is an error instead).
const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true,
                               maxThreads: options.threads, progressLogs: false, logLevel: "error" });
if (llama.buildType !== "prebuilt" || llama.gpu !== false) {
  console.error(`llama_cpp_generate: got a ${llama.buildType} ${llama.gpu} binary, not the prebuilt CPU one`);
  process.exit(1);
}
const model = await llama.loadModel({ modelPath: options.model, gpuLayers: 0 });
const vocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
const fileTypes = { 0: "f32", 1: "f16", 2: "q4_0", 7: "q8_0" };
const fileType = model.fileInfo.metadata.general.file_type;
const type = fileTypes[fileType] ?? `file_type ${fileType}`;

// Deterministic pseudo-random ids in [0, vocab) (mulberry32).
function promptIds(n, seed) {
  let state = seed >>> 0;
  const ids = [];
  for (let k = 0; k < n; ++k) {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    ids.push(((t ^ (t >>> 14)) >>> 0) % vocab);
  }
  return ids;
}

const prompt = options.check ? String(options.prompt_ids ?? "").split(",").map(Number)
                              : promptIds(options.prompt, options.seed);
if (prompt.some((id) => !Number.isInteger(id) || id < 0 || id >= vocab)) {
  console.error(`llama_cpp_generate: the prompt needs token ids in [0, ${vocab}) (--check takes --prompt_ids 1,2,3)`);
  process.exit(2);
}
const context = await model.createContext({
  contextSize: prompt.length + options.new + 16, batchSize: Math.max(prompt.length, 1), sequences: 1,
  threads: { ideal: options.threads, min: options.threads },
});
const sequence = context.getSequence();
// Greedy, with nothing that stops or bends it: eos is decoded on like any other token.
const greedy = { temperature: 0, yieldEogToken: true };

if (options.check) {
  const steps = [];
  for await (const out of sequence.evaluateWithMetadata(prompt, { probabilities: true }, greedy)) {
    const top = [...out.probabilities.entries()].sort((a, b) => b[1] - a[1]).slice(0, 3);
    steps.push({ token: out.token, top: top.map(([id, p]) => [id, Number(p.toFixed(6))]) });
    if (steps.length === options.new) break;
  }
  console.log(JSON.stringify({ engine: "llama.cpp", model: basename(options.model), type, prompt_ids: prompt,
                               token_ids: steps.map((s) => s.token), steps }));
  process.exit(0);
}

// One untimed pass first: the weights are mapped from the file and read in on first touch, where
// memtune's bench has them loaded before it starts timing.
for await (const token of sequence.evaluate(prompt.slice(0, 16), greedy)) break;
const rounds = [];
for (let r = 0; r < options.rounds; ++r) {
  await sequence.clearHistory();
  const start = performance.now();
  let first = 0, last = 0, count = 0;
  for await (const token of sequence.evaluate(prompt, greedy)) {
    last = performance.now();
    if (count++ === 0) first = last;
    if (count === options.new) break;
  }
  if (count !== options.new) throw new Error(`round ${r + 1} generated ${count} of ${options.new} tokens`);
  const round = { prefill_tokens_per_s: (1000 * prompt.length) / (first - start),
                  decode_tokens_per_s: count > 1 ? (1000 * (count - 1)) / (last - first) : 0 };
  rounds.push(round);
  console.error(`round ${r + 1}: prefill ${round.prefill_tokens_per_s.toFixed(1)} tokens/s, ` +
                `decode ${round.decode_tokens_per_s.toFixed(1)} tokens/s`);
}
const median = (key) => {
  const s = rounds.map((r) => r[key]).sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
};
console.log(JSON.stringify({
  engine: "llama.cpp", model: basename(options.model), type, threads: options.threads, prompt_tokens: prompt.length,
  new_tokens: options.new, prefill_tokens_per_s: median("prefill_tokens_per_s"),
  decode_tokens_per_s: median("decode_tokens_per_s"), rounds,
  kv_cache: `${GgmlType[context.kvCacheKeyType]}/${GgmlType[context.kvCacheValueType]}`,
  flash_attention: context.flashAttention,
  binary: `node-llama-cpp ${version} ${llama.buildType} ${llama.gpu === false ? "cpu" : llama.gpu}, ` +
          `llama.cpp ${llama.llamaCppRelease.release}`,
}));
await context.dispose();
await model.dispose();
await llama.dispose();

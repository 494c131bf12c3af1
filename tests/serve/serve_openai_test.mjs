// `memtune serve` driven by the official OpenAI client (the npm package `openai`, pinned in
// tools/openai-client): chat and completions, streamed and not, equal `memtune generate`'s
// greedy output for the same prompts and adapters; 16 concurrent streams with mixed prompt
// lengths and adapters equal their sequential runs, also when only 2 sequences run at a time;
// bad requests get their documented status and the server keeps serving; a client that goes
// away mid-stream frees its KV blocks; SIGTERM stops new connections at once, lets the streams
// finish within --shutdown_timeout, ends the rest with "abort" and exits 0; and the same answers
// from `serve --backend vulkan` where a Vulkan device is usable.
//
// Usage: node tests/serve/serve_openai_test.mjs --memtune BIN --workdir DIR
import { execFileSync, spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const arg = (name) => {
  const i = process.argv.indexOf(name);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`missing ${name}`);
  return process.argv[i + 1];
};
const memtune = arg("--memtune");
const work = arg("--workdir");
fs.rmSync(work, { recursive: true, force: true });
fs.mkdirSync(work, { recursive: true });
const lastLine = (out) => out.trim().split("\n").pop();
const clientDir = lastLine(execFileSync(path.join(root, "scripts/prepare-openai-client.sh"), { encoding: "utf8" }));
const tokenizerDir = process.env.MEMTUNE_TOKENIZER_DIR ||
  lastLine(execFileSync(path.join(root, "scripts/prepare-tokenizer.sh"), { encoding: "utf8" }));
const OpenAI = createRequire(path.join(clientDir, "package.json"))("openai").default;

const run = (args) => execFileSync(memtune, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
const at = (name) => path.join(work, name);
const writeJsonl = (file, rows) => fs.writeFileSync(file, rows.map((r) => JSON.stringify(r)).join("\n") + "\n");
const readJsonl = (file) => fs.readFileSync(file, "utf8").trim().split("\n").map((l) => JSON.parse(l));

// A tiny model with the real Qwen2.5 tokenizer, and two LoRA adapters trained a few steps apart.
const model = at("model");
run(["init-model", "--preset", "tiny", "--set", "vocab_size=151936", "--set", "tie_word_embeddings=false",
     "--seed", "5", "--out", model]);
for (const f of ["tokenizer.json", "tokenizer_config.json"]) fs.copyFileSync(path.join(tokenizerDir, f), path.join(model, f));
const words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple"];
for (const [name, seed] of [["a", 1], ["b", 2]]) {
  const rows = [];
  for (let i = 0; i < 16; ++i)
    rows.push({ messages: [{ role: "user", content: `${words[(i + seed) % 8]} ${i}` },
                           { role: "assistant", content: `${words[(i * seed + 3) % 8]} ${words[i % 8]}` }] });
  writeJsonl(at(`train_${name}.jsonl`), rows);
  run(["train", "--model", model, "--train_file", at(`train_${name}.jsonl`), "--output_dir", at(`adapter_${name}`),
       "--max_steps", "4", "--learning_rate", "0.05", "--lora_rank", "4", "--seed", String(seed),
       "--per_device_train_batch_size", "4", "--save_strategy", "no"]);
}

// The requests: chat and completion prompts of different lengths, each with an adapter or none.
const adapters = [null, "a", "b"];
const requests = [];
for (let i = 0; i < 16; ++i) {
  const text = Array.from({ length: 1 + (i * 7) % 23 }, (_, k) => words[(i + k) % 8]).join(" ");
  requests.push({ chat: i % 2 === 0, text, adapter: adapters[i % 3], max_tokens: 6 + (i % 5) * 3 });
}
// Their greedy results from `memtune generate` (batching changes no token: tests/generate/).
writeJsonl(at("requests.jsonl"), requests.map((r) => ({
  ...(r.chat ? { messages: [{ role: "user", content: r.text }] } : { prompt: r.text }),
  ...(r.adapter ? { adapter: r.adapter } : {}),
})));
const maxNew = Math.max(...requests.map((r) => r.max_tokens));
const expected = [];
for (const r of requests) {
  const line = { ...(r.chat ? { messages: [{ role: "user", content: r.text }] } : { prompt: r.text }),
                 ...(r.adapter ? { adapter: r.adapter } : {}) };
  writeJsonl(at("one.jsonl"), [line]);
  run(["generate", "--model", model, "--input", at("one.jsonl"), "--adapter", `a=${at("adapter_a")}`,
       "--adapter", `b=${at("adapter_b")}`, "--temperature", "0", "--max_new_tokens", String(r.max_tokens),
       "--output", at("one_out.jsonl"), "--json"]);
  expected.push(readJsonl(at("one_out.jsonl"))[0]);
}
assert.ok(expected.some((e) => e.text.trim().length > 0), "every reference generation is empty");
assert.ok(new Set(expected.map((e) => e.text)).size > 4, "the references hardly differ: adapters or prompts change nothing");

// Every server started, killed when the test ends however it ends (a failed assertion leaves
// none behind).
const servers = new Set();
process.on("exit", () => {
  for (const child of servers) if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
});

// Starts a server; resolves with its base URL and the child process.
function startServer(extra, maxModelLen = 96, modelDir = model) {
  const child = spawn(memtune, ["serve", modelDir, "--port", "0", "--max_model_len", String(maxModelLen),
                                "--lora_modules", `a=${at("adapter_a")}`, `b=${at("adapter_b")}`, ...extra],
                      { stdio: ["ignore", "pipe", "pipe"] });
  servers.add(child);
  child.on("exit", () => servers.delete(child));
  let out = "";
  child.stderr.on("data", (d) => { out += d; });
  return new Promise((resolve, reject) => {
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) resolve({ url: `http://127.0.0.1:${m[1]}`, child, output: () => out });
    });
    child.on("exit", (code) => reject(new Error(`memtune serve exited (${code}) before listening:\n${out}`)));
  });
}
function stopServer(server) {
  return new Promise((resolve) => {
    server.child.removeAllListeners("exit");
    server.child.on("exit", (code, signal) => resolve({ code, signal }));
    server.child.kill("SIGTERM");
  });
}

const modelName = (r) => r.adapter ?? model;
async function complete(client, r, stream) {
  const common = { model: modelName(r), max_tokens: r.max_tokens, temperature: 0 };
  if (!stream) {
    const out = r.chat
      ? await client.chat.completions.create({ ...common, messages: [{ role: "user", content: r.text }] })
      : await client.completions.create({ ...common, prompt: r.text });
    const choice = out.choices[0];
    return { text: r.chat ? choice.message.content : choice.text, finish: choice.finish_reason, usage: out.usage };
  }
  const s = r.chat
    ? await client.chat.completions.create({ ...common, messages: [{ role: "user", content: r.text }], stream: true,
                                             stream_options: { include_usage: true } })
    : await client.completions.create({ ...common, prompt: r.text, stream: true,
                                        stream_options: { include_usage: true } });
  let text = "", finish = null, usage = null;
  for await (const chunk of s) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += r.chat ? (c.delta.content ?? "") : c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage };
}
function checkAgainstReference(got, i, what) {
  const e = expected[i];
  assert.equal(got.text, e.text, `${what}: request ${i} text`);
  assert.equal(got.finish, e.finish_reason, `${what}: request ${i} finish_reason`);
  assert.equal(got.usage.prompt_tokens, e.prompt_tokens, `${what}: request ${i} prompt_tokens`);
  assert.equal(got.usage.completion_tokens, e.completion_tokens, `${what}: request ${i} completion_tokens`);
  assert.equal(got.usage.total_tokens, e.prompt_tokens + e.completion_tokens, `${what}: request ${i} total_tokens`);
}
// One scrape of /metrics: a reader of its values. Counters compared with each other come from one
// scrape, since the engine may finish a step (and publish its counts) between two.
async function scrape(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  return (name) => {
    const m = text.match(new RegExp(`^${name.replace(/[{}]/g, "\\$&")} (\\S+)$`, "m"));
    assert.ok(m, `${name} not in /metrics:\n${text}`);
    return Number(m[1]);
  };
}

async function metric(url, name) {
  return (await scrape(url))(name);
}

// 1. One server: models, each request streamed and not, against the references.
let server = await startServer(["--max_num_seqs", "8"]);
let client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0 });
const models = await client.models.list();
assert.deepEqual(models.data.map((m) => m.id), [model, "a", "b"]);
for (let i = 0; i < requests.length; ++i) {
  checkAgainstReference(await complete(client, requests[i], false), i, "non-streamed");
  checkAgainstReference(await complete(client, requests[i], true), i, "streamed");
}
// 16 concurrent streams, mixed lengths and adapters: batching changes nothing.
let results = await Promise.all(requests.map((r) => complete(client, r, true)));
results.forEach((got, i) => checkAgainstReference(got, i, "concurrent"));

// 2. Bad requests get their status, and the server goes on serving.
const post = (route, body, headers = {}, signal = undefined) =>
  fetch(`${server.url}${route}`,
        { method: "POST", headers: { "Content-Type": "application/json", ...headers }, body, signal });
const expectError = async (response, status, what) => {
  assert.equal(response.status, status, what);
  const body = await response.json();
  assert.ok(body.error && typeof body.error.message === "string" && body.error.type, `${what}: ${JSON.stringify(body)}`);
  return body.error;
};
await expectError(await post("/v1/chat/completions", "{\"messages\": [oops"), 400, "malformed JSON");
await expectError(await post("/v1/completions", JSON.stringify({ prompt: "hi", max_tokens: -3 })), 400, "negative max_tokens");
const long = Array.from({ length: 200 }, (_, k) => words[k % 8]).join(" ");
await expectError(await post("/v1/completions", JSON.stringify({ prompt: long, max_tokens: 4 })), 400, "beyond max_model_len");
await expectError(await post("/v1/completions", JSON.stringify({ prompt: "hi", n: 2 })), 400, "n = 2");
await expectError(await post("/v1/completions", "x".repeat(2 << 20)), 413, "oversized body");
await assert.rejects(client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "hi" }] }),
                     (e) => e.status === 404 && e.code === "model_not_found");
await assert.rejects(client.completions.create({ model, prompt: "hi", temperature: 7 }), (e) => e.status === 400);
// Clients that go away mid-stream: their sequences are cancelled and their blocks freed.
for (let k = 0; k < 4; ++k) {
  const controller = new AbortController();
  const response = await post("/v1/completions",
                              JSON.stringify({ prompt: "hello there", max_tokens: 80, stream: true, ignore_eos: true }),
                              {}, controller.signal);
  const reader = response.body.getReader();
  await reader.read();
  controller.abort();
  await reader.cancel().catch(() => {});
}
// Asked every 100 ms until none is used; the 5-minute limit only turns a hang into a failure.
let used = -1;
for (let tries = 0; tries < 3000 && used !== 0; ++tries) {
  await new Promise((r) => setTimeout(r, 100));
  used = await metric(server.url, "memtune_kv_cache_blocks_used");
}
assert.equal(used, 0, "KV blocks still held after the clients disconnected");
assert.ok((await metric(server.url, "memtune_kv_cache_blocks_free")) > 0);
checkAgainstReference(await complete(client, requests[1], false), 1, "after the bad requests");
assert.ok((await metric(server.url, 'memtune_requests_total{status="400"}')) >= 4);
assert.ok((await metric(server.url, "memtune_time_to_first_token_seconds_count")) > 0);
let stopped = await stopServer(server);
assert.equal(stopped.code, 0, `SIGTERM: exit code ${stopped.code} (${stopped.signal})\n${server.output()}`);

// 3. Two sequences at a time and an API key: the 16 streams all complete, with the same tokens.
server = await startServer(["--max_num_seqs", "2", "--api_key", "secret-key"]);
await assert.rejects(new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "wrong", maxRetries: 0 }).models.list(),
                     (e) => e.status === 401);
client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "secret-key", maxRetries: 0 });
results = await Promise.all(requests.map((r) => complete(client, r, true)));
results.forEach((got, i) => checkAgainstReference(got, i, "max_num_seqs 2"));
stopped = await stopServer(server);
assert.equal(stopped.code, 0, `SIGTERM: exit code ${stopped.code}\n${server.output()}`);

// 4. SIGTERM with streams running and queued (2 decode at a time, the others wait): the port stops
// taking connections at once while the streams go on, every stream ends with its finish chunk and
// [DONE] (finished within --shutdown_timeout, or "abort" once it has passed), and the server
// exits 0. Each claim is an order among the events the client sees (its signal, a connection
// refused, each stream's tokens, finish chunk and end), never a reading of how fast anything ran:
// - a connection is refused before the last stream has ended: the port is not held open until
//   the streams are done;
// - within each stream no token follows its finish chunk, and [DONE] comes last;
// - the end of the grace period, which the server tells by finishing what is left with "abort",
//   comes no sooner than --shutdown_timeout after the signal was sent (one monotonic clock, read
//   before the signal: the server's period starts after it);
// - nothing decodes once it has ended: a stream with no token when the first "abort" arrives gets
//   none afterwards, and at most --max_num_seqs streams ever get tokens (the others were waiting).
// The signal goes once the server holds every request (each response has begun), one has a token
// and none has finished; nothing here depends on how fast a machine decodes, only on the grace
// period in the abort case being far shorter than what its streams ask for.

// One connection attempt, which resolves true when refused. One that connects asks for /health
// and resolves false once the server has answered and closed it (or reset it, as a listener that
// stops does to the connections it had not yet taken): the next attempt waits for that, since
// attempts made faster than the server accepts them would fill its short listen backlog, and TCP
// would retry the one it dropped only a second later.
const refused = (url) => new Promise((resolve) => {
  const socket = net.connect(Number(new URL(url).port), "127.0.0.1");
  socket.on("connect", () => socket.write("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"));
  socket.on("data", () => {});
  socket.on("close", () => resolve(false));
  socket.on("error", (e) => resolve(e.code === "ECONNREFUSED"));
});
const maxNumSeqs = 2;
async function shutdownWhileStreaming(grace, maxTokens) {
  server = await startServer(["--max_num_seqs", String(maxNumSeqs), "--shutdown_timeout", String(grace)], 2048);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0 });
  // What the client saw, in the order it saw it.
  const seen = [];
  const note = (what, stream, extra = {}) => seen.push({ what, stream, at: performance.now(), ...extra });
  let tokenArrived;
  const firstToken = new Promise((resolve) => { tokenArrived = resolve; });
  const noteChoices = (stream, choices) => {
    for (const c of choices) {
      if (c.finish_reason) {
        note("finish", stream, { reason: c.finish_reason });
      } else {
        note("token", stream);
        tokenArrived();
      }
    }
  };
  // Four streams through the client, one read raw for its exact events; each resolves its `taken`
  // once its response has begun (the server has queued the request).
  const begun = [];
  const taken = Array.from({ length: 5 }, (_, k) => new Promise((resolve) => { begun[k] = resolve; }));
  const streams = Array.from({ length: 5 }, (_, k) => {
    if (k < 4) {
      return (async () => {
        const s = await client.completions.create({ model, prompt: `${words[k]} ${words[k + 1]}`,
                                                   max_tokens: maxTokens, stream: true, ignore_eos: true,
                                                   stream_options: { include_usage: true } });
        begun[k]();
        let usage = null;
        for await (const chunk of s) {
          if (chunk.usage) usage = chunk.usage;
          noteChoices(k, chunk.choices);
        }
        note("end", k);
        return { usage };
      })();
    }
    return (async () => {
      const response = await fetch(`${server.url}/v1/completions`, {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ prompt: "river stone", max_tokens: maxTokens, stream: true, ignore_eos: true }) });
      assert.equal(response.status, 200, "the raw stream's request");
      begun[k]();
      const decoder = new TextDecoder();
      let text = "", parsed = 0;
      for await (const bytes of response.body) {
        text += decoder.decode(bytes, { stream: true });
        const events = text.split("\n\n");
        for (; parsed < events.length - 1; ++parsed) {
          const e = events[parsed];
          if (e.startsWith("data: {")) noteChoices(k, JSON.parse(e.slice("data: ".length)).choices);
        }
      }
      note("end", k);
      return { events: text.trim().split("\n\n").filter((e) => e.startsWith("data: ")) };
    })();
  });
  // (A stream that fails before its response begins fails the test here.)
  await Promise.all(taken.map((t, k) => Promise.race([t, streams[k]])));
  await firstToken;
  assert.ok(!seen.some((e) => e.what === "finish"), "a stream finished before SIGTERM: nothing left to drain");
  note("signal");
  const stopping = stopServer(server);
  // Connection attempts until one is refused, or every stream has ended first.
  const ended = () => seen.filter((e) => e.what === "end").length === streams.length;
  while (!ended()) {
    if (await refused(server.url)) {
      note("refused");
      break;
    }
  }
  const results = await Promise.all(streams);
  stopped = await stopping;
  assert.equal(stopped.code, 0, `SIGTERM while streaming: exit code ${stopped.code} (${stopped.signal})\n${server.output()}`);

  const first = (what, stream) =>
    seen.findIndex((e) => e.what === what && (stream === undefined || e.stream === stream));
  const signal = first("signal"), refusal = first("refused");
  const lastEnd = seen.findLastIndex((e) => e.what === "end");
  assert.ok(refusal > signal && refusal < lastEnd,
            "the port still took connections when the last stream ended: it was held open until the streams were done");
  const perStream = results.map((r, k) => {
    const finish = first("finish", k);
    assert.ok(finish >= 0 && seen.filter((e) => e.what === "finish" && e.stream === k).length === 1,
              `stream ${k}: not exactly one finish chunk`);
    assert.ok(!seen.some((e, i) => i > finish && e.what === "token" && e.stream === k),
              `stream ${k}: a token after its finish chunk`);
    const tokens = seen.filter((e) => e.what === "token" && e.stream === k);
    return { ...r, finish: seen[finish].reason, tokens: tokens.length,
             after: tokens.filter((e) => seen.indexOf(e) > signal).length };
  });
  const events = results[4].events;
  assert.equal(events.at(-1), "data: [DONE]", `the raw stream's last event: ${events.at(-1)}`);
  assert.equal(JSON.parse(events.at(-2).slice("data: ".length)).choices[0].finish_reason, perStream[4].finish,
               "the raw stream's event before [DONE] is not its finish chunk");
  return { seen, signal, streams: perStream, finishes: perStream.map((s) => s.finish) };
}
// Within the grace period, running and queued streams all finish their max_tokens, each decoding
// after the signal. The grace (600 s) is there only so that it does not end first.
const drainTokens = 48;
let drained = await shutdownWhileStreaming(600, drainTokens);
assert.deepEqual(drained.finishes, Array(5).fill("length"), "streams finishing within --shutdown_timeout");
drained.streams.slice(0, 4).forEach((s) => assert.equal(s.usage.completion_tokens, drainTokens));
drained.streams.forEach((s, k) =>
  assert.ok(s.after > 0, `stream ${k} had all its tokens before SIGTERM: the drain was not tested`));
// Past it, what is left ends with "abort", queued streams too, with its last chunk and [DONE].
const grace = 0.5;
drained = await shutdownWhileStreaming(grace, 1900);
const firstAbort = drained.seen.findIndex((e) => e.what === "finish" && e.reason === "abort");
assert.ok(firstAbort >= 0, `no stream was cut by --shutdown_timeout: ${drained.finishes}`);
const decoding = new Set(drained.seen.slice(0, firstAbort).filter((e) => e.what === "token").map((e) => e.stream));
const late = drained.seen.slice(firstAbort).find((e) => e.what === "token" && !decoding.has(e.stream));
assert.ok(late === undefined, `stream ${late?.stream} began decoding after the grace period ended`);
assert.ok(decoding.size <= maxNumSeqs, `${decoding.size} streams decoded with --max_num_seqs ${maxNumSeqs}`);
assert.ok(drained.seen[firstAbort].at - drained.seen[drained.signal].at >= grace * 1000,
          `"abort" came ${drained.seen[firstAbort].at - drained.seen[drained.signal].at} ms after SIGTERM, ` +
          `before --shutdown_timeout ${grace} had passed`);
assert.ok(drained.finishes.every((f) => f === "abort"), `streams cut by --shutdown_timeout: ${drained.finishes}`);
assert.ok(drained.streams.some((s) => s.after > 0), "no stream decoded during the grace period");

// 5. --skip_tokenizer_init on a model directory without tokenizer files: token ids in, token_ids
// out (whole and streamed), the same tokens as `memtune generate`; chat and text prompts refused.
const bare = at("bare_model");
fs.mkdirSync(bare, { recursive: true });
for (const f of ["config.json", "model.safetensors"]) fs.copyFileSync(path.join(model, f), path.join(bare, f));
const promptIds = [9707, 11, 1879, 0, 42];
writeJsonl(at("ids.jsonl"), [{ prompt_ids: promptIds }]);
run(["generate", "--model", model, "--input", at("ids.jsonl"), "--temperature", "0", "--max_new_tokens", "8",
     "--ignore_eos", "--output", at("ids_out.jsonl")]);
const wantIds = readJsonl(at("ids_out.jsonl"))[0].token_ids;
server = await startServer(["--skip_tokenizer_init"], 96, bare);
client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0 });
const whole = await client.completions.create({ model: bare, prompt: promptIds, max_tokens: 8, temperature: 0,
                                                ignore_eos: true });
assert.deepEqual(whole.choices[0].token_ids, wantIds, "--skip_tokenizer_init: token_ids of a whole answer");
assert.equal(whole.choices[0].text, "");
const streamed = [];
for await (const chunk of await client.completions.create({ model: bare, prompt: promptIds, max_tokens: 8,
                                                            temperature: 0, ignore_eos: true, stream: true }))
  for (const c of chunk.choices) streamed.push(...(c.token_ids ?? []));
assert.deepEqual(streamed, wantIds, "--skip_tokenizer_init: token_ids of a stream");
await assert.rejects(client.completions.create({ model: bare, prompt: "hello", max_tokens: 4 }),
                     (e) => e.status === 400 && e.param === "prompt");
await assert.rejects(client.chat.completions.create({ model: bare, messages: [{ role: "user", content: "hi" }] }),
                     (e) => e.status === 400 && e.param === "messages");
stopped = await stopServer(server);
assert.equal(stopped.code, 0, `SIGTERM: exit code ${stopped.code}\n${server.output()}`);

// 6. `serve --backend vulkan` where a Vulkan device is usable (lavapipe in CI): the same answers as
// the cpu references, concurrent streams batched on the device with adapters, tokens chosen on
// the device (only their ids come back), and a clean SIGTERM. Part of the requests: lavapipe
// computes the 151936-row head at a few steps per second.
// A sanitizer build has no vulkan backend (`devices --json` says so), and the driver's own leaks
// would fail its exit, so leak checks are off for this one listing.
const devices = JSON.parse(execFileSync(memtune, ["devices", "--json"], {
  encoding: "utf8", stdio: ["ignore", "pipe", "pipe"],
  env: { ...process.env, ASAN_OPTIONS: `${process.env.ASAN_OPTIONS ?? ""}:detect_leaks=0` } }));
const vulkanDevice = devices.backend_vulkan_device;
let onVulkan = 0;
if (vulkanDevice !== null) {
  server = await startServer(["--backend", "vulkan", "--max_num_seqs", "8"]);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0 });
  const picked = [0, 1, 2, 3, 4, 5];
  checkAgainstReference(await complete(client, requests[0], false), 0, "vulkan non-streamed");
  results = await Promise.all(picked.map((i) => complete(client, requests[i], true)));
  results.forEach((got, k) => checkAgainstReference(got, picked[k], "vulkan concurrent"));
  onVulkan = picked.length + 1;
  // What the engine's steps asked of the device, from the backend's own counters (/metrics): a
  // decode or prefill step waits once, for its token ids, and submits at least once.
  const counts = await scrape(server.url);
  for (const kind of ["decode", "prefill"]) {
    const steps = counts(`memtune_engine_steps_total{kind="${kind}"}`);
    assert.ok(steps > 0, `no ${kind} steps on vulkan`);
    assert.equal(counts(`memtune_device_waits_total{kind="${kind}"}`), steps, `${kind} waits`);
    assert.ok((counts(`memtune_device_submissions_total{kind="${kind}"}`)) >= steps);
    const dispatches = counts(`memtune_device_dispatches_total{kind="${kind}"}`);
    assert.ok(dispatches > 10 * steps);
    // The barriers between the steps' commands are counted (that they fall below one a command is
    // TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu's check: an engine step's uploads and
    // token read also take some, so here there may be as many as dispatches).
    const barriers = counts(`memtune_device_barriers_total{kind="${kind}"}`);
    assert.ok(barriers > 0 && barriers <= dispatches + 4 * steps, `${barriers} barriers for ${dispatches} dispatches`);
  }
  stopped = await stopServer(server);
  assert.equal(stopped.code, 0, `vulkan SIGTERM: exit code ${stopped.code}\n${server.output()}`);
} else if (devices.vulkan_backend_built && process.env.MEMTUNE_REQUIRE_ALL_TESTS === "1") {
  throw new Error(`no usable Vulkan device for serve --backend vulkan:\n${JSON.stringify(devices, null, 2)}`);
}

console.log(`serve_openai_test: ${requests.length} requests x (non-streamed, streamed, 16 concurrent, 2 at a time) ` +
            `equal memtune generate; bad requests, disconnects and SIGTERM as documented; ` +
            (devices.vulkan_backend_built ? `${onVulkan} on vulkan` : "this build has no vulkan backend"));

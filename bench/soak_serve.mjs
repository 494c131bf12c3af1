// A soak of `memtune serve` as a hostile mix of clients would load it (scripts/soak-serve.sh
// starts the server and runs this): CONCURRENCY workers for SECONDS send completions, chats,
// streams read to the end, streams dropped after one or two chunks, malformed, oversized and
// invalid-UTF-8 bodies, unknown models and over-long prompts. Afterwards: the status counts (any
// 5xx is a failure), whether every stream read to the end closed with [DONE], the server's
// resident set sampled through the run (drift from the first sample after warm-up), the KV blocks
// still held once the load stops (must be 0), and whether greedy answers to fixed prompts are the
// same before and after. Prints one JSON object; exits 1 when a check fails.
// Usage: node bench/soak_serve.mjs URL SERVER_PID [seconds=120] [concurrency=24]
import fs from "node:fs";

const [url, pidText, secondsText = "120", concurrencyText = "24"] = process.argv.slice(2);
const pid = Number(pidText), seconds = Number(secondsText), concurrency = Number(concurrencyText);
if (!url || !pid || !(seconds > 0) || !(concurrency > 0)) {
  console.error("usage: node bench/soak_serve.mjs URL SERVER_PID [seconds=120] [concurrency=24]");
  process.exit(2);
}

const rssBytes = () => {
  const m = fs.readFileSync(`/proc/${pid}/status`, "utf8").match(/^VmRSS:\s+(\d+) kB$/m);
  return m ? Number(m[1]) * 1024 : NaN;
};
const metric = async (name) => {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = text.match(new RegExp(`^${name} (\\S+)$`, "m"));
  return m ? Number(m[1]) : NaN;
};
const post = (route, body, signal) =>
  fetch(`${url}${route}`, { method: "POST", headers: { "Content-Type": "application/json" }, body, signal });

// Greedy answers to fixed prompts: the same text before and after the load.
const probes = ["alpha beta gamma", "river stone cloud maple", "The capital of France is"];
const greedy = async () => {
  const out = [];
  for (const prompt of probes) {
    const r = await post("/v1/completions", JSON.stringify({ prompt, max_tokens: 12, temperature: 0 }));
    out.push((await r.json()).choices[0].text);
  }
  return out;
};

const words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple"];
const sentence = (n, k) => Array.from({ length: n }, (_, i) => words[(i * 7 + k) % 8]).join(" ");
const statuses = {};
let requests = 0, streamsRead = 0, streamsWithoutDone = 0, streamsDropped = 0, networkErrors = 0;
const count = (status) => { statuses[status] = (statuses[status] ?? 0) + 1; };

// One request of kind `k` (the mix cycles through them).
const kinds = [
  async (k) => count((await post("/v1/completions", JSON.stringify({ prompt: sentence(5 + (k % 30), k), max_tokens: 8 + (k % 24), temperature: 0.8, seed: k }))).status),
  async (k) => count((await post("/v1/chat/completions", JSON.stringify({ messages: [{ role: "user", content: sentence(3 + (k % 20), k) }], max_tokens: 16 }))).status),
  async (k) => {  // a stream read to its end
    const r = await post("/v1/completions", JSON.stringify({ prompt: sentence(8, k), max_tokens: 24, stream: true, ignore_eos: true }));
    count(r.status);
    const text = await r.text();
    ++streamsRead;
    if (r.status === 200 && !text.trimEnd().endsWith("data: [DONE]")) ++streamsWithoutDone;
  },
  async (k) => {  // a client that goes away after one or two chunks
    const controller = new AbortController();
    const r = await post("/v1/chat/completions", JSON.stringify({ messages: [{ role: "user", content: sentence(6, k) }], max_tokens: 64, stream: true, ignore_eos: true }), controller.signal);
    count(r.status);
    const reader = r.body.getReader();
    for (let i = 0; i < 1 + (k % 2); ++i) await reader.read();
    controller.abort();
    await reader.cancel().catch(() => {});
    ++streamsDropped;
  },
  async () => count((await post("/v1/chat/completions", "{\"messages\": [oops")).status),
  async () => count((await post("/v1/completions", "x".repeat(2 << 20))).status),
  async () => count((await post("/v1/completions", JSON.stringify({ model: "nope", prompt: "hi" }))).status),
  async () => count((await post("/v1/completions", JSON.stringify({ prompt: sentence(400, 1), max_tokens: 4 }))).status),
  async () => count((await post("/v1/completions", Buffer.from([0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]))).status),
  async () => count((await post("/v1/completions", JSON.stringify({ prompt: "hi", max_tokens: 1e12 }))).status),
];

const before = await greedy();
const started = Date.now(), deadline = started + seconds * 1000;
const rss = [];  // [seconds since start, bytes]
const sampler = setInterval(() => rss.push([(Date.now() - started) / 1000, rssBytes()]), 1000);
let next = 0;
await Promise.all(Array.from({ length: concurrency }, async () => {
  while (Date.now() < deadline) {
    const k = next++;
    ++requests;
    try {
      await kinds[k % kinds.length](k);
    } catch {
      ++networkErrors;  // a dropped stream's abort is counted above; anything else lands here
    }
  }
}));
clearInterval(sampler);
let blocksUsed = NaN;
for (let i = 0; i < 100 && blocksUsed !== 0; ++i) {
  await new Promise((r) => setTimeout(r, 100));
  blocksUsed = await metric("memtune_kv_cache_blocks_used");
}
const after = await greedy();
const warm = rss.find(([t]) => t >= seconds * 0.1) ?? rss[0];
const last = rss.at(-1);
const serverErrors = Object.entries(statuses).filter(([s]) => Number(s) >= 500).reduce((a, [, n]) => a + n, 0);
const result = {
  seconds, concurrency, requests, statuses, server_errors: serverErrors, network_errors: networkErrors,
  streams_read: streamsRead, streams_without_done: streamsWithoutDone, streams_dropped: streamsDropped,
  requests_per_second: requests / seconds,
  rss_warm_bytes: warm[1], rss_end_bytes: last[1], rss_max_bytes: Math.max(...rss.map(([, b]) => b)),
  rss_drift_bytes: last[1] - warm[1], kv_blocks_used_after: blocksUsed,
  greedy_unchanged: JSON.stringify(before) === JSON.stringify(after),
};
console.log(JSON.stringify(result));
const failed = serverErrors > 0 || streamsWithoutDone > 0 || blocksUsed !== 0 || !result.greedy_unchanged;
process.exit(failed ? 1 : 0);

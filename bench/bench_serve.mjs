// Benchmark client for `memtune serve` (scripts/bench-serve.sh starts the server): at each
// concurrency, that many clients each stream requests of a fixed prompt length (token ids) and
// max_tokens (ignore_eos, so every request generates all of them) for a fixed number of rounds.
// Reports per concurrency: aggregate generated tokens/s (all tokens over the wall time), time to
// first token p50/p99 (send to the first text chunk) and inter-token latency p50/p99 (gaps between
// text chunks of one request). Prints one JSON line per concurrency.
// Usage: node bench/bench_serve.mjs URL PROMPT_TOKENS NEW_TOKENS CONCURRENCY... [--rounds N]
const [url, promptArg, newArg, ...rest] = process.argv.slice(2);
const promptTokens = Number(promptArg), newTokens = Number(newArg);
const roundsAt = rest.indexOf("--rounds");
const rounds = roundsAt >= 0 ? Number(rest[roundsAt + 1]) : 1;
const levels = rest.filter((x, i) => x !== "--rounds" && i !== roundsAt + 1).map(Number);

const quantile = (xs, q) => {
  if (xs.length === 0) return 0;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))];
};
let salt = 0;
async function one(ttfts, gaps) {
  const ids = Array.from({ length: promptTokens }, (_, k) => 1000 + ((k * 7919 + salt * 104729) % 50000));
  ++salt;  // different prompts: nothing is shared between requests
  const start = performance.now();
  const response = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt: ids, max_tokens: newTokens, temperature: 0, ignore_eos: true, stream: true,
                           stream_options: { include_usage: true } }),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  const decoder = new TextDecoder();
  let buffer = "", last = null, tokens = 0;
  for await (const bytes of response.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      if (!chunk.choices.length || !chunk.choices[0].text) continue;
      const now = performance.now();
      if (last === null) ttfts.push((now - start) / 1000);
      else gaps.push((now - last) / 1000);
      last = now;
    }
  }
  return tokens;
}
for (const c of levels) {
  const ttfts = [], gaps = [];
  const start = performance.now();
  const counts = await Promise.all(Array.from({ length: c }, async () => {
    let n = 0;
    for (let r = 0; r < rounds; ++r) n += await one(ttfts, gaps);
    return n;
  }));
  const seconds = (performance.now() - start) / 1000;
  const generated = counts.reduce((a, b) => a + b, 0);
  console.log(JSON.stringify({
    concurrency: c, requests: c * rounds, generated_tokens: generated, seconds,
    tokens_per_s: generated / seconds,
    ttft_p50_s: quantile(ttfts, 0.5), ttft_p99_s: quantile(ttfts, 0.99),
    itl_p50_s: quantile(gaps, 0.5), itl_p99_s: quantile(gaps, 0.99),
  }));
}

// Load test (loopback only, bounded in count and time): many concurrent
// streaming clients, several requests each, some hanging up early. Every
// completed stream must be complete and valid, none may be lost, the server
// must answer /health afterwards and its RSS must come back near the
// baseline.
//
// Size: LILY_LOAD_CLIENTS (default 40) x LILY_LOAD_REQUESTS (default 4)
// requests; LILY_LOAD_MAX_TOKENS (default 24) caps the longest ones.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import {
  MODEL, startServer, makeClient, readReference, http, metrics, rssKiB, sleep,
} from './lib.mjs';

const CLIENTS = Number(process.env.LILY_LOAD_CLIENTS ?? 40);
const REQUESTS = Number(process.env.LILY_LOAD_REQUESTS ?? 4);
const MAX_TOKENS = Number(process.env.LILY_LOAD_MAX_TOKENS ?? 24);
const ref = readReference();
const haiku = [{ role: 'user', content: 'Write a haiku about the sea.' }];

let server;

before(async () => {
  server = await startServer(['--quiet']);
});

after(async () => {
  assert.equal(await server.stop(), 0, server.logs());
});

// One streamed request. kind: 'reference' (temperature 0, must reproduce the
// reference), 'seeded' (sampled with a seed: equal seeds, equal text) or
// 'abort' (hang up after a few chunks).
async function one(client, kind, i) {
  const seed = i % 5;
  const params = {
    model: MODEL, messages: haiku, stream: true, stream_options: { include_usage: true },
    ...(kind === 'reference'
      ? { temperature: 0, max_tokens: Math.min(MAX_TOKENS, ref.generated_ids.length) }
      : { temperature: 0.8, top_p: 0.95, seed, max_tokens: 4 + (seed % 3) * 4 }),
  };
  if (kind === 'abort') params.max_tokens = 2000;  // long: the hang-up must cancel it
  const controller = new AbortController();
  const t0 = performance.now();
  const stream = await client.chat.completions.create(params, { signal: controller.signal });
  const chunks = [];
  let ttft = null;
  try {
    for await (const c of stream) {
      chunks.push(c);
      if (ttft === null && c.choices[0]?.delta?.content) ttft = performance.now() - t0;
      if (kind === 'abort' && chunks.length >= 2 + (i % 3)) controller.abort();
    }
  } catch (e) {
    if (kind !== 'abort') throw e;
  }
  return { kind, seed, params, chunks, ttft, ms: performance.now() - t0 };
}

function validate(r) {
  const { chunks, params } = r;
  assert.ok(chunks.length >= 3, `chunks: ${chunks.length}`);
  const id = chunks[0].id;
  assert.match(id, /^chatcmpl-/);
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  let text = '';
  let finishes = 0;
  let finish = null;
  for (const c of chunks) {
    assert.equal(c.id, id, 'one id per stream');
    assert.equal(c.object, 'chat.completion.chunk');
    if (c.choices.length === 0) continue;
    text += c.choices[0].delta.content ?? '';
    if (c.choices[0].finish_reason) {
      finishes++;
      finish = c.choices[0].finish_reason;
    }
  }
  assert.equal(finishes, 1, 'exactly one finish_reason');
  const usage = chunks.at(-1).usage;
  assert.ok(usage, 'usage chunk last');
  assert.equal(usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
  assert.ok(usage.completion_tokens >= 1 && usage.completion_tokens <= params.max_tokens);
  if (finish === 'length') assert.equal(usage.completion_tokens, params.max_tokens);
  else assert.equal(finish, 'stop');
  if (r.kind === 'reference' && params.max_tokens === ref.generated_ids.length)
    assert.equal(text, ref.generated_text);
  return { id, text, completion: usage.completion_tokens };
}

test(`${CLIENTS} concurrent streaming clients x ${REQUESTS} requests`, async () => {
  const pid = server.proc.pid;
  // Warm up with the same concurrency (threads, arenas, caches), then
  // take the baseline.
  const warmClients = Array.from({ length: CLIENTS }, () => makeClient(server));
  await Promise.all(warmClients.map((c, i) => one(c, 'seeded', i)));
  await sleep(500);
  const baseline = rssKiB(pid);
  const before = await metrics(server);

  let peak = baseline;
  const sampler = setInterval(() => {
    try { peak = Math.max(peak, rssKiB(pid)); } catch {}
  }, 50);
  const t0 = performance.now();
  const results = await Promise.all(Array.from({ length: CLIENTS }, async (_, c) => {
    const client = makeClient(server);
    const out = [];
    for (let k = 0; k < REQUESTS; k++) {
      const i = c * REQUESTS + k;
      const kind = i % 4 === 3 ? 'abort' : i % 3 === 0 ? 'reference' : 'seeded';
      out.push(await one(client, kind, i));
    }
    return out;
  }));
  const seconds = (performance.now() - t0) / 1000;
  clearInterval(sampler);

  const all = results.flat();
  assert.equal(all.length, CLIENTS * REQUESTS, 'no request lost');
  const completed = all.filter((r) => r.kind !== 'abort');
  const aborted = all.filter((r) => r.kind === 'abort');
  const ids = new Set();
  const bySeed = new Map();
  let tokens = 0;
  for (const r of completed) {
    const v = validate(r);
    assert.ok(!ids.has(v.id), 'unique ids');
    ids.add(v.id);
    tokens += v.completion;
    if (r.kind === 'seeded') {
      const key = `${r.seed}/${r.params.max_tokens}`;
      if (bySeed.has(key)) assert.equal(v.text, bySeed.get(key), `same seed, same text (${key})`);
      else bySeed.set(key, v.text);
    }
  }

  // The server is idle again and healthy.
  let after;
  for (let i = 0; i < 100; i++) {
    after = await metrics(server);
    if (after.lily_queue_depth === 0 && after.lily_running_requests === 0 &&
        after.lily_open_streams === 0) break;
    await sleep(100);
  }
  assert.equal(after.lily_queue_depth, 0);
  assert.equal(after.lily_running_requests, 0);
  assert.equal(after.lily_open_streams, 0);
  const h = await http(server, 'GET', '/health');
  assert.equal(h.status, 200);
  const gens = after.lily_generations_total - before.lily_generations_total;
  assert.equal(gens, all.length, 'every request reached the engine once');
  const ok200 = after['lily_requests_total{route="/v1/chat/completions",status="200"}'] -
    before['lily_requests_total{route="/v1/chat/completions",status="200"}'];
  assert.equal(ok200, all.length);
  const cancelled = after.lily_generations_cancelled_total - before.lily_generations_cancelled_total;
  const generated = after.lily_generated_tokens_total - before.lily_generated_tokens_total;
  // The hung-up requests asked for 2000 tokens each; cancelling stops them early.
  assert.ok(generated < tokens + aborted.length * 1000, `generated ${generated}`);

  await sleep(1000);
  const end = rssKiB(pid);
  const ttfts = completed.map((r) => r.ttft).filter((x) => x !== null).sort((a, b) => a - b);
  const pct = (p) => ttfts[Math.min(ttfts.length - 1, Math.floor(p * ttfts.length))];
  const summary = {
    clients: CLIENTS, requests: all.length, completed: completed.length, aborted: aborted.length,
    cancelled_by_server: cancelled, seconds: +seconds.toFixed(2),
    completion_tokens: tokens, engine_tokens: generated,
    engine_tok_per_s: +(generated / seconds).toFixed(1),
    ttft_ms_p50: +pct(0.5).toFixed(1), ttft_ms_p95: +pct(0.95).toFixed(1),
    rss_mib_baseline: +(baseline / 1024).toFixed(1), rss_mib_peak: +(peak / 1024).toFixed(1),
    rss_mib_after: +(end / 1024).toFixed(1),
  };
  console.log(`LOAD ${JSON.stringify(summary)}`);
  // Memory comes back: within 25% + 32 MiB of the warmed-up baseline.
  assert.ok(end <= baseline * 1.25 + 32 * 1024, `RSS ${end} KiB vs baseline ${baseline} KiB`);
});

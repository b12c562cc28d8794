// `lily serve` on the bundled tiny model, driven by the official OpenAI SDK:
// the reference continuation (streaming and not), usage, logprobs, stop
// strings, reasoning switches, tool calls, completions, prefix reuse,
// disconnects and a clean shutdown.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import {
  MODEL, startServer, makeClient, readReference, http, metrics, sleep,
} from './lib.mjs';

const ref = readReference();
const N = ref.generated_ids.length;  // 24
// The reference prompt is the template's rendering with thinking on (the
// default): "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n".
const haiku = [{ role: 'user', content: 'Write a haiku about the sea.' }];
const weatherTool = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather in a city',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string' } },
      required: ['city'],
    },
  },
};

let server;
let client;

before(async () => {
  server = await startServer();
  client = makeClient(server);
});

after(async () => {
  const code = await server.stop();
  assert.equal(code, 0, `clean exit; log:\n${server.logs()}`);
});

async function collectStream(stream) {
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  return chunks;
}

test('GET /v1/models lists the served model', async () => {
  const list = await client.models.list();
  assert.equal(list.data.length, 1);
  assert.equal(list.data[0].id, MODEL);
  assert.equal(list.data[0].object, 'model');
  const one = await client.models.retrieve(MODEL);
  assert.equal(one.id, MODEL);
});

test('non-streaming chat at temperature 0 reproduces the reference', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N,
  });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.model, MODEL);
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, ref.generated_text);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(r.usage.completion_tokens, N);
  assert.equal(r.usage.total_tokens, ref.prompt_ids.length + N);
  assert.equal(typeof r.usage.prompt_tokens_details.cached_tokens, 'number');
});

test('streaming chat reproduces the reference and matches the non-streamed text', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N, stream: true,
    stream_options: { include_usage: true },
  });
  const chunks = await collectStream(stream);
  assert.ok(chunks.length >= 3);
  const ids = new Set(chunks.map((c) => c.id));
  assert.equal(ids.size, 1, 'one id for the whole stream');
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  let text = '';
  let finish = null;
  for (const c of chunks) {
    assert.equal(c.object, 'chat.completion.chunk');
    if (c.choices.length === 0) continue;
    text += c.choices[0].delta.content ?? '';
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  assert.equal(text, ref.generated_text);
  assert.equal(finish, 'length');
  const last = chunks.at(-1);
  assert.deepEqual(last.choices, []);
  assert.equal(last.usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(last.usage.completion_tokens, N);
  assert.equal(last.usage.total_tokens, ref.prompt_ids.length + N);
  for (const c of chunks.slice(0, -1)) assert.equal(c.usage, null);

  const plain = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N,
  });
  assert.equal(text, plain.choices[0].message.content);

  // Without include_usage there is no usage chunk.
  const s2 = await collectStream(await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 4, stream: true,
  }));
  assert.ok(s2.every((c) => c.choices.length === 1 && c.usage === undefined));
});

test('logprobs describe the generated tokens', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N, logprobs: true, top_logprobs: 3,
  });
  const entries = r.choices[0].logprobs.content;
  assert.equal(entries.length, N);
  for (const e of entries) {
    assert.ok(e.logprob <= 0);
    assert.equal(e.top_logprobs.length, 3);
    // Greedy: the chosen token is the most likely one.
    assert.deepEqual(e.top_logprobs[0].bytes, e.bytes);
    assert.ok(Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6);
    assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob);
  }
  // The tokens' bytes spell the text.
  const bytes = Buffer.from(entries.flatMap((e) => e.bytes));
  assert.equal(bytes.toString('utf8'), ref.generated_text);

  const chunks = await collectStream(await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N, logprobs: true, stream: true,
  }));
  const streamed = chunks.flatMap((c) => c.choices[0]?.logprobs?.content ?? []);
  assert.equal(streamed.length, N);
  assert.deepEqual(streamed.map((e) => e.logprob), entries.map((e) => e.logprob));
});

test('stop strings end the reply before the match', async () => {
  const cut = ref.generated_text.indexOf('DAYS');
  for (const stop of ['DAYS', ['nothing-like-this', 'DAYS']]) {
    const r = await client.chat.completions.create({
      model: MODEL, messages: haiku, temperature: 0, max_tokens: N, stop,
    });
    assert.equal(r.choices[0].message.content, ref.generated_text.slice(0, cut));
    assert.equal(r.choices[0].finish_reason, 'stop');
  }
  const chunks = await collectStream(await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N, stop: 'DAYS', stream: true,
  }));
  assert.equal(chunks.map((c) => c.choices[0]?.delta?.content ?? '').join(''),
               ref.generated_text.slice(0, cut));
  assert.equal(chunks.at(-1).choices[0].finish_reason, 'stop');
});

test('logit_bias bans and forces tokens', async () => {
  const first = ref.generated_ids[0];
  const plain = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, logprobs: true,
  });
  const banned = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, logprobs: true,
    logit_bias: { [String(first)]: -100 },
  });
  assert.notDeepEqual(banned.choices[0].logprobs.content[0].bytes,
                      plain.choices[0].logprobs.content[0].bytes);
  // +100 on one token: sampled at temperature 1, it is every token.
  const forced = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 1, seed: 5, max_tokens: 6, logprobs: true,
    logit_bias: { [String(ref.generated_ids[3])]: 100 },
  });
  const seen = new Set(forced.choices[0].logprobs.content.map((e) => JSON.stringify(e.bytes)));
  assert.equal(seen.size, 1);
  await assert.rejects(
    client.chat.completions.create({
      model: MODEL, messages: haiku, max_tokens: 2, logit_bias: { 99999999: 1 },
    }),
    (e) => e.status === 400 && e.param === 'logit_bias');
});

test('n choices: indices, seeds, usage, streamed and not', async () => {
  // Greedy: every choice is the reference continuation.
  const g = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N, n: 3,
  });
  assert.equal(g.choices.length, 3);
  g.choices.forEach((c, i) => {
    assert.equal(c.index, i);
    assert.equal(c.message.content, ref.generated_text);
  });
  assert.equal(g.usage.completion_tokens, 3 * N);
  assert.equal(g.usage.total_tokens, g.usage.prompt_tokens + 3 * N);
  // Seeded sampling: choice i is the single-choice request with seed + i.
  const params = { model: MODEL, messages: haiku, temperature: 1, max_tokens: 10, seed: 77 };
  const many = await client.chat.completions.create({ ...params, n: 3 });
  for (let i = 0; i < 3; ++i) {
    const one = await client.chat.completions.create({ ...params, seed: 77 + i });
    assert.equal(many.choices[i].message.content, one.choices[0].message.content);
  }
  assert.notEqual(many.choices[0].message.content, many.choices[1].message.content);
  // Streamed: each choice's deltas under its index, one usage chunk, one [DONE].
  const chunks = await collectStream(await client.chat.completions.create({
    ...params, n: 3, stream: true, stream_options: { include_usage: true },
  }));
  for (let i = 0; i < 3; ++i) {
    const text = chunks.flatMap((c) => c.choices.filter((x) => x.index === i))
      .map((x) => x.delta?.content ?? '').join('');
    assert.equal(text, many.choices[i].message.content);
  }
  const usages = chunks.filter((c) => c.usage);
  assert.equal(usages.length, 1);
  assert.equal(usages[0].usage.completion_tokens, 30);
  assert.equal(chunks.filter((c) => c.choices.some((x) => x.finish_reason)).length, 3);
  // Completions too.
  const comp = await client.completions.create({ model: MODEL, prompt: 'Hello', max_tokens: 4, n: 2, temperature: 0 });
  assert.deepEqual(comp.choices.map((c) => c.index), [0, 1]);
  assert.equal(comp.choices[0].text, comp.choices[1].text);
});

test('sampling parameters are accepted and seeds reproduce', async () => {
  const params = {
    model: MODEL, messages: haiku, max_tokens: 12, temperature: 0.9, top_p: 0.9, top_k: 50,
    min_p: 0.01, presence_penalty: 0.5, frequency_penalty: 0.3, repetition_penalty: 1.1,
    seed: 1234, n: 1, user: 'e2e', prompt_cache_key: 'haiku',
  };
  const a = await client.chat.completions.create(params);
  const b = await client.chat.completions.create(params);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.equal(a.usage.completion_tokens, 12);
});

test('thinking can be switched off through chat_template_kwargs or reasoning_effort', async () => {
  const on = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2,
  });
  const kw = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2,
    chat_template_kwargs: { enable_thinking: false },
  });
  const effort = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, reasoning_effort: 'none',
  });
  const high = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, reasoning_effort: 'high',
  });
  assert.equal(on.usage.prompt_tokens, 16);
  // "<think>\n\n</think>\n\n" is added to the prompt when thinking is off.
  assert.equal(kw.usage.prompt_tokens, 20);
  assert.equal(effort.usage.prompt_tokens, 20);
  assert.equal(high.usage.prompt_tokens, 16);
});

test('tools: tool_choice none keeps them out of the prompt, auto puts them in', async () => {
  const none = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, tools: [weatherTool],
    tool_choice: 'none',
  });
  const auto = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 2, tools: [weatherTool],
  });
  assert.equal(none.usage.prompt_tokens, 16);
  assert.ok(auto.usage.prompt_tokens > 100, `tools rendered: ${auto.usage.prompt_tokens}`);
});

test('tool-call round trip: a forced call, then the tool result in the history', async () => {
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const r = await client.chat.completions.create({
    model: MODEL, messages: ask, tools: [weatherTool], temperature: 0, max_tokens: 8,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  const msg = r.choices[0].message;
  assert.equal(msg.tool_calls.length >= 1, true, JSON.stringify(msg));
  const call = msg.tool_calls[0];
  assert.match(call.id, /^call_[A-Za-z0-9]{24}$/);
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  const args = JSON.parse(call.function.arguments);
  assert.equal(typeof args, 'object');
  assert.ok(['tool_calls', 'length'].includes(r.choices[0].finish_reason));

  // The same request streamed: id and name first, then argument fragments.
  const chunks = await collectStream(await client.chat.completions.create({
    model: MODEL, messages: ask, tools: [weatherTool], temperature: 0, max_tokens: 8,
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, stream: true,
  }));
  const deltas = chunks.flatMap((c) => c.choices[0]?.delta?.tool_calls ?? []);
  assert.ok(deltas.length >= 1);
  assert.equal(deltas[0].index, 0);
  assert.match(deltas[0].id, /^call_/);
  assert.equal(deltas[0].type, 'function');
  assert.equal(deltas[0].function.name, 'get_weather');
  const streamedArgs = deltas.filter((d) => d.index === 0)
    .map((d) => d.function?.arguments ?? '').join('');
  assert.equal(streamedArgs, call.function.arguments);
  assert.equal(chunks.map((c) => c.choices[0]?.delta?.content ?? '').join(''), msg.content ?? '');

  // Round trip: the assistant's call and the tool's answer go back in.
  const history = [
    ...ask,
    { role: 'assistant', content: null, tool_calls: [call] },
    { role: 'tool', tool_call_id: call.id, content: '{"temperature_c": 18, "sky": "clear"}' },
  ];
  const r2 = await client.chat.completions.create({
    model: MODEL, messages: history, tools: [weatherTool], temperature: 0, max_tokens: 6,
  });
  assert.equal(r2.choices[0].message.role, 'assistant');
  assert.equal(typeof r2.choices[0].message.content, 'string');
  assert.ok(r2.usage.prompt_tokens > r.usage.prompt_tokens);
  // The follow-up extends the first prompt: its prefix was reused.
  assert.ok(r2.usage.prompt_tokens_details.cached_tokens > 0);

  // tool_choice "required" is enforced by validation: a call, or a 400.
  try {
    const req = await client.chat.completions.create({
      model: MODEL, messages: ask, tools: [weatherTool], temperature: 0, max_tokens: 8,
      tool_choice: 'required',
    });
    assert.ok(['tool_calls', 'length'].includes(req.choices[0].finish_reason));
  } catch (e) {
    assert.ok(e instanceof OpenAI.APIError);
    assert.equal(e.status, 400);
    assert.equal(e.code, 'tool_use_failed');
  }
});

test('tool calls are constrained to the tool schemas (random weights, forced call)', async () => {
  const modeTool = {
    type: 'function',
    function: {
      name: 'set_mode',
      parameters: {
        type: 'object',
        properties: { mode: { enum: ['fast', 'slow'] }, level: { type: 'integer' } },
        required: ['mode', 'level'],
        additionalProperties: false,
      },
    },
  };
  const noTool = {
    type: 'function',
    function: { name: 'stop', parameters: { type: 'object', properties: {}, additionalProperties: false } },
  };
  // (No free-text parameter: a model of random weights would fill it up to max_tokens.)
  for (const temperature of [0, 1]) {
    const r = await client.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'Set the mode.' }], tools: [noTool, modeTool],
      tool_choice: 'required', temperature, seed: 3, max_tokens: 60,
    });
    const calls = r.choices[0].message.tool_calls;
    assert.ok(calls && calls.length >= 1, JSON.stringify(r.choices[0]));
    const call = calls[0];
    const args = JSON.parse(call.function.arguments);
    if (call.function.name === 'set_mode') {
      assert.deepEqual(Object.keys(args), ['mode', 'level']);
      assert.ok(['fast', 'slow'].includes(args.mode));
      assert.ok(Number.isInteger(args.level));
    } else {
      assert.equal(call.function.name, 'stop');
      assert.deepEqual(args, {});
    }
  }
});

test('response_format json_schema: a model of random weights answers in the schema', async () => {
  const schema = {
    type: 'object',
    properties: {
      verdict: { enum: ['yes', 'no', 'unsure'] },
      score: { type: 'integer' },
      flags: { type: 'array', items: { type: 'boolean' }, maxItems: 4 },
    },
    required: ['verdict', 'score', 'flags'],
    additionalProperties: false,
  };
  const response_format = { type: 'json_schema', json_schema: { name: 'review', strict: true, schema } };
  for (const temperature of [0, 1]) {
    const r = await client.chat.completions.create({
      model: MODEL, messages: haiku, temperature, seed: 3, max_tokens: 200, response_format,
    });
    assert.equal(r.choices[0].finish_reason, 'stop', r.choices[0].message.content);
    const v = JSON.parse(r.choices[0].message.content);
    assert.deepEqual(Object.keys(v), ['verdict', 'score', 'flags']);
    assert.ok(['yes', 'no', 'unsure'].includes(v.verdict));
    assert.ok(Number.isInteger(v.score));
    assert.ok(Array.isArray(v.flags) && v.flags.length <= 4 && v.flags.every((f) => typeof f === 'boolean'));
  }
  // Streamed: the deltas make up the same kind of object.
  const stream = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 200, response_format, stream: true,
  });
  const content = (await collectStream(stream)).map((c) => c.choices[0]?.delta?.content ?? '').join('');
  assert.ok(['yes', 'no', 'unsure'].includes(JSON.parse(content).verdict), content);
});

test('response_format json_object: the reply is a JSON object or cut by max_tokens', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N,
    response_format: { type: 'json_object' },
  });
  const text = r.choices[0].message.content;
  if (r.choices[0].finish_reason === 'stop') assert.equal(typeof JSON.parse(text), 'object');
  else assert.ok(text.trimStart().startsWith('{'), text);
});

test('follow-up turns reuse the cached prefix', async () => {
  // A different conversation first: the live sequence holds something else,
  // the haiku conversation's state is kept aside (earlier tests ran it).
  await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Something else entirely.' }],
    temperature: 0, max_tokens: 3,
  });
  const first = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: N,
  });
  assert.ok(first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens);
  assert.equal(first.choices[0].message.content, ref.generated_text);
  const second = await client.chat.completions.create({
    model: MODEL, temperature: 0, max_tokens: 4,
    messages: [...haiku, first.choices[0].message, { role: 'user', content: 'Another one.' }],
  });
  assert.ok(second.usage.prompt_tokens_details.cached_tokens >= ref.prompt_ids.length,
    JSON.stringify(second.usage));
  assert.ok(second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens);
  const m = await metrics(server);
  assert.ok(m.lily_prefix_cache_hits_total >= 1);
  assert.ok(m.lily_prefix_cache_entries >= 1);
  assert.ok(m.lily_prefix_cache_bytes > 0);
});

test('completions: text prompt, token prompt, echo, streaming', async () => {
  const a = await client.completions.create({
    model: MODEL, prompt: ref.prompt_text, temperature: 0, max_tokens: N,
  });
  assert.equal(a.object, 'text_completion');
  assert.equal(a.choices[0].text, ref.generated_text);
  assert.equal(a.choices[0].finish_reason, 'length');
  assert.equal(a.usage.prompt_tokens, ref.prompt_ids.length);
  assert.equal(a.usage.completion_tokens, N);

  const b = await client.completions.create({
    model: MODEL, prompt: ref.prompt_ids, temperature: 0, max_tokens: N,
  });
  assert.equal(b.choices[0].text, ref.generated_text);

  const echo = await client.completions.create({
    model: MODEL, prompt: ref.prompt_text, temperature: 0, max_tokens: 3, echo: true,
  });
  assert.ok(echo.choices[0].text.startsWith(ref.prompt_text));

  const lp = await client.completions.create({
    model: MODEL, prompt: ref.prompt_ids, temperature: 0, max_tokens: 5, logprobs: 2,
  });
  assert.equal(lp.choices[0].logprobs.tokens.length, 5);
  assert.equal(lp.choices[0].logprobs.token_logprobs.length, 5);
  assert.equal(lp.choices[0].logprobs.top_logprobs.length, 5);

  const chunks = await collectStream(await client.completions.create({
    model: MODEL, prompt: ref.prompt_text, temperature: 0, max_tokens: N, stream: true,
    stream_options: { include_usage: true },
  }));
  assert.equal(chunks.map((c) => c.choices[0]?.text ?? '').join(''), ref.generated_text);
  assert.equal(chunks.at(-1).usage.completion_tokens, N);
});

test('/health and /metrics', async () => {
  const h = await http(server, 'GET', '/health');
  assert.equal(h.status, 200);
  assert.equal(h.json.status, 'ok');
  const m = await metrics(server);
  assert.ok(m['lily_requests_total{route="/v1/chat/completions",status="200"}'] > 5);
  assert.ok(m.lily_prompt_tokens_total > 0);
  assert.ok(m.lily_generated_tokens_total > 0);
  assert.ok(m.lily_time_to_first_token_seconds_count > 0);
  assert.ok(m.lily_decode_tokens_per_second_count > 0);
  assert.equal(m.lily_queue_depth, 0);
  assert.ok('lily_prefix_cache_hits_total' in m);
});

test('a client that disconnects mid-stream has its generation cancelled', async () => {
  const before = await metrics(server);
  const controller = new AbortController();
  const stream = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 3000, stream: true,
  }, { signal: controller.signal });
  let seen = 0;
  try {
    for await (const c of stream) {
      if (c.choices[0]?.delta?.content && ++seen === 3) {
        controller.abort();
        break;  // chunks already received would still be iterated
      }
    }
  } catch {
    // Aborting may end the iteration quietly or with an abort error.
  }
  assert.equal(seen, 3);
  let after;
  for (let i = 0; i < 100; i++) {
    after = await metrics(server);
    if (after.lily_generations_cancelled_total > before.lily_generations_cancelled_total) break;
    await sleep(100);
  }
  assert.ok(after.lily_generations_cancelled_total > before.lily_generations_cancelled_total,
    'cancelled');
  assert.ok(after.lily_generated_tokens_total - before.lily_generated_tokens_total < 1500,
    'stopped long before max_tokens');
  // And the server goes on.
  const r = await client.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 4,
  });
  assert.equal(r.usage.completion_tokens, 4);
});

test('SIGTERM ends open streams and the process exits cleanly', async () => {
  const s = await startServer();
  const c = makeClient(s);
  const stream = await c.chat.completions.create({
    model: MODEL, messages: haiku, temperature: 0, max_tokens: 3000, stream: true,
  });
  let got = 0;
  const reading = (async () => {
    for await (const chunk of stream) {
      if (chunk.choices[0]?.delta?.content) got++;
    }
    return null;
  })().catch((e) => e);
  while (got < 2) await sleep(10);
  const t0 = Date.now();
  const code = await s.stop();
  assert.equal(code, 0, s.logs());
  assert.ok(Date.now() - t0 < 10_000);
  // The stream ends with an error event saying why.
  const err = await reading;
  assert.ok(err instanceof OpenAI.APIError, String(err));
  assert.equal(err.error?.code, 'server_shutting_down');
  assert.ok(got < 3000);
  assert.match(s.logs(), /received SIGTERM, shutting down/);
});

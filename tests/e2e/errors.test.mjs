// Every error `lily serve` reports: status and OpenAI-shaped body, and the
// server keeps serving after each one.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import {
  MODEL, startServer, makeClient, http, assertErrorBody, readReference,
} from './lib.mjs';

const KEY = 'sk-e2e-secret';
const auth = { authorization: `Bearer ${KEY}` };
const ref = readReference();
const haiku = [{ role: 'user', content: 'Write a haiku about the sea.' }];
const chat = (extra = {}) => ({ model: MODEL, messages: haiku, max_tokens: 4, ...extra });

let server;

before(async () => {
  server = await startServer(['--api-key', KEY, '--ctx', '64', '--max-tokens-limit', '32',
                              '--max-body', '65536']);
});

after(async () => {
  assert.equal(await server.stop(), 0, server.logs());
});

// After every error the server must still answer, and still generate.
async function stillServing() {
  const h = await http(server, 'GET', '/health');
  assert.equal(h.status, 200);
  const r = await http(server, 'POST', '/v1/chat/completions',
                       { headers: auth, body: chat({ temperature: 0 }) });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].message.content.length > 0, true);
}

const longText = Array.from({ length: 100 }, (_, i) => `word${i}`).join(' ');

const cases = [
  // [name, method, route, {body|raw, headers}, status, {code, param, type}]
  ['malformed JSON', 'POST', '/v1/chat/completions', { raw: '{"model": "x", "messages": [' }, 400,
    { code: 'invalid_json', type: 'invalid_request_error' }],
  ['body not an object', 'POST', '/v1/chat/completions', { raw: '[1, 2, 3]' }, 400,
    { code: 'invalid_json' }],
  ['empty body', 'POST', '/v1/chat/completions', { raw: '' }, 400, { code: 'invalid_json' }],
  ['missing messages', 'POST', '/v1/chat/completions', { body: { model: MODEL } }, 400,
    { param: 'messages', code: 'missing_required_parameter' }],
  ['empty messages', 'POST', '/v1/chat/completions', { body: { model: MODEL, messages: [] } }, 400,
    { param: 'messages' }],
  ['messages not an array', 'POST', '/v1/chat/completions',
    { body: { model: MODEL, messages: 'hi' } }, 400, { param: 'messages' }],
  ['message without role', 'POST', '/v1/chat/completions',
    { body: { model: MODEL, messages: [{ content: 'hi' }] } }, 400, { param: 'messages[0].role' }],
  ['unknown role', 'POST', '/v1/chat/completions',
    { body: { model: MODEL, messages: [{ role: 'wizard', content: 'hi' }] } }, 400,
    { param: 'messages[0].role' }],
  ['image content part', 'POST', '/v1/chat/completions',
    { body: { model: MODEL, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'http://x/y.png' } }] }] } },
    400, { param: 'messages[0].content[0].type' }],
  ['temperature of the wrong type', 'POST', '/v1/chat/completions',
    { body: chat({ temperature: 'hot' }) }, 400, { param: 'temperature', code: 'invalid_type' }],
  ['max_tokens of the wrong type', 'POST', '/v1/chat/completions',
    { body: chat({ max_tokens: '10' }) }, 400, { param: 'max_tokens', code: 'invalid_type' }],
  ['stream of the wrong type', 'POST', '/v1/chat/completions',
    { body: chat({ stream: 'yes' }) }, 400, { param: 'stream', code: 'invalid_type' }],
  ['stop of the wrong type', 'POST', '/v1/chat/completions',
    { body: chat({ stop: 42 }) }, 400, { param: 'stop', code: 'invalid_type' }],
  ['temperature out of range', 'POST', '/v1/chat/completions',
    { body: chat({ temperature: 7 }) }, 400, { param: 'temperature', code: 'invalid_value' }],
  ['top_p out of range', 'POST', '/v1/chat/completions',
    { body: chat({ top_p: 1.5 }) }, 400, { param: 'top_p' }],
  ['n beyond 16', 'POST', '/v1/chat/completions', { body: chat({ n: 17 }) }, 400,
    { param: 'n', code: 'invalid_value' }],
  ['top_logprobs without logprobs', 'POST', '/v1/chat/completions',
    { body: chat({ top_logprobs: 2 }) }, 400, { param: 'top_logprobs' }],
  ['max_tokens beyond the limit', 'POST', '/v1/chat/completions',
    { body: chat({ max_tokens: 33 }) }, 400, { param: 'max_tokens', code: 'invalid_value' }],
  ['max_completion_tokens beyond the limit', 'POST', '/v1/chat/completions',
    { body: chat({ max_completion_tokens: 1000 }) }, 400, { param: 'max_completion_tokens' }],
  ['prompt + max_tokens beyond the context', 'POST', '/v1/chat/completions',
    { body: chat({ max_tokens: 32, messages: [{ role: 'user', content: 'word '.repeat(30) }] }) },
    400, { code: 'context_length_exceeded' }],
  ['prompt longer than the context', 'POST', '/v1/chat/completions',
    { body: { model: MODEL, messages: [{ role: 'user', content: longText }] } }, 400,
    { code: 'context_length_exceeded', param: 'messages' }],
  ['completion prompt longer than the context', 'POST', '/v1/completions',
    { body: { model: MODEL, prompt: longText } }, 400,
    { code: 'context_length_exceeded', param: 'prompt' }],
  ['completion without prompt', 'POST', '/v1/completions', { body: { model: MODEL } }, 400,
    { param: 'prompt', code: 'missing_required_parameter' }],
  ['completion token id outside the vocabulary', 'POST', '/v1/completions',
    { body: { model: MODEL, prompt: [1, 99999999] } }, 400, { param: 'prompt' }],
  ['several completion prompts', 'POST', '/v1/completions',
    { body: { model: MODEL, prompt: ['a', 'b'] } }, 400, { param: 'prompt' }],
  ['tool_choice naming an unknown tool', 'POST', '/v1/chat/completions',
    { body: chat({ tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: { type: 'function', function: { name: 'g' } } }) },
    400, { param: 'tool_choice' }],
  ['tool_choice required without tools', 'POST', '/v1/chat/completions',
    { body: chat({ tool_choice: 'required' }) }, 400, { param: 'tool_choice' }],
  ['response_format json_schema with a bad schema', 'POST', '/v1/chat/completions',
    { body: chat({ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'strng' } } } }) },
    400, { param: 'response_format.json_schema.schema', code: 'invalid_value' }],
  ['response_format of an unknown type', 'POST', '/v1/chat/completions',
    { body: chat({ response_format: { type: 'regex' } }) }, 400, { param: 'response_format.type' }],
  ['stream_options without stream', 'POST', '/v1/chat/completions',
    { body: chat({ stream_options: { include_usage: true } }) }, 400, { param: 'stream_options' }],
  ['unknown route', 'GET', '/v1/nothing-here', {}, 404, { code: 'unknown_url', type: 'not_found_error' }],
  ['unknown route (POST)', 'POST', '/v2/chat/completions', { body: {} }, 404, { code: 'unknown_url' }],
  ['unknown model id', 'GET', '/v1/models/gpt-9', {}, 404, { code: 'model_not_found' }],
];

for (const [name, method, route, opts, status, expect] of cases) {
  test(`${status}: ${name}`, async () => {
    const res = await http(server, method, route, { ...opts, headers: { ...auth, ...(opts.headers ?? {}) } });
    assertErrorBody(res, status, expect);
    await stillServing();
  });
}

test('413: a body over --max-body', async () => {
  const big = JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'x'.repeat(70_000) }] });
  const res = await http(server, 'POST', '/v1/chat/completions', { raw: big, headers: auth });
  assertErrorBody(res, 413, { code: 'request_too_large' });
  await stillServing();
});

test('401: missing or wrong API key', async () => {
  const none = await http(server, 'POST', '/v1/chat/completions', { body: chat() });
  assertErrorBody(none, 401, { code: 'missing_api_key' });
  const wrong = await http(server, 'POST', '/v1/chat/completions',
                           { body: chat(), headers: { authorization: 'Bearer nope' } });
  assertErrorBody(wrong, 401, { code: 'invalid_api_key' });
  const models = await http(server, 'GET', '/v1/models');
  assertErrorBody(models, 401);
  // /health and /metrics stay open.
  assert.equal((await http(server, 'GET', '/health')).status, 200);
  assert.equal((await http(server, 'GET', '/metrics')).status, 200);
  await stillServing();
});

test('the SDK sees the same errors as typed exceptions', async () => {
  const bad = makeClient(server, 'wrong-key');
  await assert.rejects(bad.chat.completions.create(chat()),
    (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  const good = makeClient(server, KEY);
  await assert.rejects(good.chat.completions.create(chat({ n: 30 })),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'n');
  await assert.rejects(good.chat.completions.create(chat({ max_tokens: 100 })),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'max_tokens');
  await assert.rejects(good.models.retrieve('nope'),
    (e) => e instanceof OpenAI.NotFoundError);
  // A streaming request that fails validation fails before streaming.
  await assert.rejects(good.chat.completions.create(chat({ temperature: -1, stream: true })),
    (e) => e instanceof OpenAI.BadRequestError && e.param === 'temperature');
  const ok = await good.chat.completions.create(chat({ temperature: 0, max_tokens: 24 }));
  assert.equal(ok.choices[0].message.content, ref.generated_text);
});

test('the request log has one line per request', async () => {
  const lines = server.logs().split('\n').filter((l) => /^lily serve: (GET|POST) /.test(l));
  assert.ok(lines.length > cases.length);
  const gen = lines.find((l) => l.includes('POST /v1/chat/completions 200'));
  assert.match(gen, /prompt=\d+ cached=\d+ completion=\d+ ttft=[0-9.]+ms tok\/s=[0-9.]+/);
  assert.ok(lines.some((l) => l.includes(' 401 ')));
  assert.ok(lines.some((l) => l.includes(' 404 ')));
  assert.ok(lines.some((l) => l.includes(' 413 ')));
});

// Shared helpers for the end-to-end tests: start a real `lily serve` on a free
// loopback port, talk to it, stop it.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

export const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
export const lilyBin = process.env.LILY_BIN || path.join(repoRoot, 'build/lily');
export const MODEL = 'qwen3-chat-tiny';

export function readReference() {
  return JSON.parse(
    readFileSync(path.join(repoRoot, 'tests/fixtures/qwen3-chat-tiny/reference.json'), 'utf8'));
}

// Starts `lily serve --port 0 ARGS` (the bundled tiny model unless ARGS says
// otherwise) and resolves once it listens.
export async function startServer(args = [], { startTimeoutMs = 180_000 } = {}) {
  const proc = spawn(lilyBin, ['serve', '--port', '0', '--threads', '1', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let log = '';
  let exitCode = null;
  const exited = once(proc, 'exit').then(([code, signal]) => {
    exitCode = code ?? signal;
    return exitCode;
  });
  proc.stderr.setEncoding('utf8');
  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`lily serve did not start in time:\n${log}`)), startTimeoutMs);
    proc.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/listening on http:\/\/[0-9.]+:(\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve(Number(m[1]));
      }
    });
    exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`lily serve exited (${code}) before listening:\n${log}`));
    });
  });
  const baseURL = `http://127.0.0.1:${port}`;
  return {
    proc,
    port,
    baseURL,
    logs: () => log,
    exitCode: () => exitCode,
    // SIGTERM, then the exit status (0 for a clean shutdown).
    async stop({ timeoutMs = 30_000 } = {}) {
      if (exitCode !== null) return exitCode;
      proc.kill('SIGTERM');
      const timer = setTimeout(() => proc.kill('SIGKILL'), timeoutMs);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

export function makeClient(server, apiKey = 'not-needed') {
  return new OpenAI({ apiKey, baseURL: `${server.baseURL}/v1`, maxRetries: 0, timeout: 120_000 });
}

// A raw request; resolves to {status, headers, text, json}.
export async function http(server, method, route, { body, headers = {}, raw } = {}) {
  const init = { method, headers: { ...headers } };
  if (raw !== undefined) {
    init.body = raw;
    init.headers['content-type'] ??= 'application/json';
  } else if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers['content-type'] = 'application/json';
  }
  const res = await fetch(`${server.baseURL}${route}`, init);
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, headers: res.headers, text, json };
}

// The OpenAI error shape: {"error": {"message", "type", "param", "code"}}.
export function assertErrorBody(res, status, { code, param, type } = {}) {
  assert.equal(res.status, status, `status for ${res.text}`);
  assert.ok(res.json && typeof res.json.error === 'object', `error body: ${res.text}`);
  const e = res.json.error;
  assert.deepEqual(Object.keys(e).sort(), ['code', 'message', 'param', 'type']);
  assert.equal(typeof e.message, 'string');
  assert.ok(e.message.length > 0);
  assert.equal(typeof e.type, 'string');
  assert.ok(e.param === null || typeof e.param === 'string');
  assert.ok(e.code === null || typeof e.code === 'string');
  if (code !== undefined) assert.equal(e.code, code, res.text);
  if (param !== undefined) assert.equal(e.param, param, res.text);
  if (type !== undefined) assert.equal(e.type, type, res.text);
}

// Prometheus text -> {name{labels}: value}.
export async function metrics(server) {
  const res = await http(server, 'GET', '/metrics');
  assert.equal(res.status, 200);
  const out = {};
  for (const line of res.text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

// Resident set size of a process, in KiB.
export function rssKiB(pid) {
  const status = readFileSync(`/proc/${pid}/status`, 'utf8');
  return Number(status.match(/VmRSS:\s+(\d+)/)[1]);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

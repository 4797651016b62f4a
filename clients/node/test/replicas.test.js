'use strict';
// Several replicas behind one Client, without braid: the target joined for gRPC's resolvers, the
// service config's round robin and retries, and a broken stream resumed, against fake Generate
// services that serve one story as braid would (from the resumed tokens on). `npm test` runs it.

const assert = require('node:assert/strict');
const { test } = require('node:test');
const { Client, DEFAULT_CHANNEL_OPTIONS, SERVICE_CONFIG, channelTarget, grpc, isCancelled, loadBraid } =
  require('../index.js');
const { MAX_RESUMES, RESUME_BACKOFF_MS, isBroken, isCut } = require('../generation.js');

const braid = loadBraid();
const SEED = '42';
const STORY = [11, 12, 13, 14, 15, 16]; // the token ids of the one generation the fake replicas know
const textOf = (ids) => ids.map((id) => `t${id} `).join('');
const UNAVAILABLE = { code: grpc.status.UNAVAILABLE, details: 'Connection dropped' };
const RST_STREAM = { code: grpc.status.INTERNAL, details: 'Received RST_STREAM with code 2 (Internal server error)' };
const SHUTDOWN = { code: grpc.status.CANCELLED, details: 'CANCELLED' };

/**
 * Serves STORY as braid does: headers with the seed, then a message per token from the request's
 * resume_token_ids on, the last one final; `breakAfter` messages in, it fails with `failure` instead.
 */
function serveStory(call, { breakAfter, failure = UNAVAILABLE, seed = SEED } = {}) {
  const metadata = new grpc.Metadata();
  if (seed) metadata.set('braid-seed', seed);
  call.sendMetadata(metadata);
  const rest = STORY.slice(call.request.resumeTokenIds.length);
  for (const [i, id] of rest.entries()) {
    if (i === breakAfter) {
      call.emit('error', failure);
      return;
    }
    const finishReason = i === rest.length - 1 ? 'FINISH_REASON_MAX_TOKENS' : 'FINISH_REASON_UNSPECIFIED';
    call.write({ text: textOf([id]), tokenIds: [id], finishReason, seed: SEED });
  }
  if (breakAfter === rest.length) call.emit('error', failure); // after the final message
  else call.end();
}

/**
 * Starts `count` fake replicas whose Stream calls, one after another over all of them, are served
 * by script[attempt] (the last entry serves the rest); resolves to { addresses, calls }, where each
 * of `calls` is { replica, request, at } in order. They stop when the test ends.
 */
async function replicas(t, script, count = 2) {
  const calls = [];
  const addresses = [];
  for (let replica = 0; replica < count; replica += 1) {
    const server = new grpc.Server();
    server.addService(braid.Generate.service, {
      Stream(call) {
        const serve = script[Math.min(calls.length, script.length - 1)];
        calls.push({ replica, request: call.request, at: Date.now() });
        serve(call);
      },
    });
    const port = await new Promise((resolve, reject) => {
      const credentials = grpc.ServerCredentials.createInsecure();
      server.bindAsync('127.0.0.1:0', credentials, (error, p) => (error ? reject(error) : resolve(p)));
    });
    t.after(() => server.forceShutdown());
    addresses.push(`127.0.0.1:${port}`);
  }
  return { addresses, calls };
}

function connect(t, addresses, options) {
  const client = new Client(addresses, options);
  t.after(() => client.close());
  return client;
}

/** Reads a Generation to its end, recording its events: { messages, events, error }. */
async function read(call) {
  const events = [];
  for (const name of ['metadata', 'status', 'resumed']) call.on(name, (value) => events.push([name, value]));
  const messages = [];
  try {
    for await (const message of call) messages.push(message);
  } catch (error) {
    return { messages, events, error };
  }
  return { messages, events, error: null };
}

test('channelTarget: one address as it is, several joined for gRPC\'s ipv4 or ipv6 resolver', () => {
  assert.equal(channelTarget('braid:50051'), 'braid:50051');
  assert.equal(channelTarget('dns:///braid.default.svc:50051'), 'dns:///braid.default.svc:50051');
  assert.equal(channelTarget(['braid:50051']), 'braid:50051');
  assert.equal(channelTarget(['10.0.0.1:50051', 'localhost:50052']), 'ipv4:10.0.0.1:50051,127.0.0.1:50052');
  assert.equal(channelTarget(['[::1]:1', '[fe80::2]:2']), 'ipv6:[::1]:1,[fe80::2]:2');
  assert.throws(() => channelTarget([]), { name: 'RangeError', message: 'no address to connect to' });
  for (const [odd, list] of [['braid:2', ['10.0.0.1:1', 'braid:2']], ['[::1]:2', ['10.0.0.1:1', '[::1]:2']],
    ['10.0.0.1', ['10.0.0.1', '10.0.0.2:1']], ['::1:1', ['::1:1', '::1:2']]]) {
    assert.throws(() => channelTarget(list), { name: 'RangeError', message: new RegExp(`^"${odd.replace(/[[\]]/g, '\\$&')}" among`) });
  }
});

test('the service config: round robin, and retries of UNAVAILABLE and RESOURCE_EXHAUSTED', () => {
  assert.deepEqual(JSON.parse(DEFAULT_CHANNEL_OPTIONS['grpc.service_config']), SERVICE_CONFIG);
  assert.equal(DEFAULT_CHANNEL_OPTIONS['grpc.enable_retries'], 1);
  assert.deepEqual(SERVICE_CONFIG.loadBalancingConfig, [{ round_robin: {} }]);
  const [{ name, retryPolicy }] = SERVICE_CONFIG.methodConfig;
  assert.deepEqual(name, [{ service: braid.Generate.service.Stream.path.split('/')[1] }]); // braid.v1.Generate
  assert.deepEqual(retryPolicy.retryableStatusCodes, ['UNAVAILABLE', 'RESOURCE_EXHAUSTED']);
  assert.equal(retryPolicy.maxAttempts, 4);
});

test('isBroken: a dropped connection, a reset stream and a stream ended with no status, not a failure', () => {
  assert.ok(isBroken(UNAVAILABLE));
  assert.ok(isBroken(RST_STREAM));
  assert.ok(isBroken({ code: grpc.status.INTERNAL,
    details: 'Received RST_STREAM with code 0 (Call ended without gRPC status)' }));
  assert.ok(isBroken({ code: grpc.status.UNKNOWN, details: 'No status information received' }));
  assert.ok(!isBroken({ code: grpc.status.INTERNAL, details: 'forward pass failed: boom' }));
  assert.ok(!isBroken({ code: grpc.status.UNKNOWN, details: 'Unexpected error in handler' }));
  assert.ok(!isBroken({ code: grpc.status.INVALID_ARGUMENT, details: 'prompt: set prompt or messages' }));
  // gRPC's own status for a call that reached a server as it shut down (grpc/grpc#41785), not a cancel
  assert.ok(isCut(SHUTDOWN) && isBroken(SHUTDOWN));
  assert.ok(!isBroken({ code: grpc.status.CANCELLED, details: 'Cancelled on client' }));
  assert.ok(!isCut(UNAVAILABLE)); // refused, not cut: the retry policy's to send again
});

test('a stream cut before its headers is sent again as it was, after a backoff, then resumed with the new call\'s seed',
  async (t) => {
    for (const failure of [SHUTDOWN, RST_STREAM]) {
      const { addresses, calls } = await replicas(t, [
        (call) => call.emit('error', failure), // no headers, nothing delivered
        (call) => serveStory(call, { breakAfter: 2 }), // then a replica dies mid-way
        (call) => serveStory(call),
      ]);
      const call = connect(t, addresses).stream({ prompt: 'hi', seed: '7' });
      const { messages, events, error } = await read(call);
      const what = grpc.status[failure.code];
      assert.equal(error, null, what);
      assert.deepEqual(messages.flatMap((m) => m.tokenIds), STORY, what);
      assert.equal(call.resumes, 2, what);
      assert.deepEqual(calls.map(({ request }) => [request.resumeTokenIds, request.seed]), [
        [[], '7'], [[], '7'], [[11, 12], SEED], // the request's own seed kept, then the headers'
      ], what);
      assert.ok(calls[1].at - calls[0].at >= RESUME_BACKOFF_MS - 10, `${calls[1].at - calls[0].at} ms (${what})`);
      assert.ok(calls[2].at - calls[1].at >= 2 * RESUME_BACKOFF_MS - 10, `${calls[2].at - calls[1].at} ms (${what})`);
      const names = events.map(([name, value]) => (name === 'resumed' ? `resumed ${grpc.status[value.code]}` : name));
      assert.deepEqual(names, [`resumed ${what}`, 'metadata', 'resumed UNAVAILABLE', 'status'], what);
    }
  });

test('cancel() while a resume waits out its backoff fails the stream with CANCELLED, and sends nothing more',
  async (t) => {
    const { addresses, calls } = await replicas(t, [(call) => serveStory(call, { breakAfter: 1 })]);
    const call = connect(t, addresses).stream({ prompt: 'hi' });
    call.once('data', () => setTimeout(() => call.cancel(), RESUME_BACKOFF_MS / 5)); // the break comes first
    const { error } = await read(call);
    assert.ok(isCancelled(error), String(error));
    await new Promise((resolve) => setTimeout(resolve, 2 * RESUME_BACKOFF_MS));
    assert.equal(calls.length, 1);
  });

test('calls go round robin over the replicas', async (t) => {
  const { addresses, calls } = await replicas(t, [(call) => serveStory(call)]);
  const client = connect(t, addresses);
  for (let i = 0; i < 8; i += 1) assert.equal((await client.generate({ prompt: 'hi' })).text, textOf(STORY));
  const served = [0, 1].map((replica) => calls.filter((call) => call.replica === replica).length);
  assert.ok(served.every((count) => count >= 3), `calls per replica: ${served}`);
});

test('a call refused before it began is retried: UNAVAILABLE, and RESOURCE_EXHAUSTED after its pushback', async (t) => {
  const pushback = new grpc.Metadata();
  pushback.set('grpc-retry-pushback-ms', '400');
  const { addresses, calls } = await replicas(t, [
    (call) => call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'draining' }), // no headers: not begun
    (call) => call.emit('error', { code: grpc.status.RESOURCE_EXHAUSTED, details: 'queue full', metadata: pushback }),
    (call) => serveStory(call),
  ], 1);
  const client = connect(t, addresses);
  const call = client.stream({ prompt: 'hi' });
  const { messages, error } = await read(call);
  assert.equal(error, null);
  assert.deepEqual(messages.flatMap((m) => m.tokenIds), STORY);
  assert.equal(calls.length, 3);
  assert.equal(call.resumes, 0); // gRPC's retries, not a resume
  assert.ok(calls[2].at - calls[1].at >= 390, `${calls[2].at - calls[1].at} ms after RESOURCE_EXHAUSTED`);
});

test('a stream that breaks mid-way is resumed from the tokens it delivered, with its headers\' seed', async (t) => {
  const { addresses, calls } = await replicas(t, [
    (call) => serveStory(call, { breakAfter: 2 }), // a replica dies
    (call) => serveStory(call, { breakAfter: 1, failure: RST_STREAM }), // a proxy cuts the stream
    (call) => serveStory(call),
  ]);
  const client = connect(t, addresses);
  const call = client.stream({ prompt: 'hi', resumeTokenIds: [11] }); // itself a resume, after 11
  const { messages, events, error } = await read(call);
  assert.equal(error, null);
  assert.deepEqual(messages.flatMap((m) => m.tokenIds), STORY.slice(1)); // one unbroken stream
  assert.equal(messages.map((m) => m.text).join(''), textOf(STORY.slice(1)));
  assert.equal(call.final, messages.at(-1));
  assert.equal(call.resumes, 2);
  assert.deepEqual(calls.map(({ request }) => [request.resumeTokenIds, request.seed, request.prompt]), [
    [[11], undefined, 'hi'], [[11, 12, 13], SEED, 'hi'], [[11, 12, 13, 14], SEED, 'hi'],
  ]);
  const names = events.map(([name, value]) => (name === 'resumed' ? `resumed ${grpc.status[value.code]}` : name));
  assert.deepEqual(names, ['metadata', 'resumed UNAVAILABLE', 'resumed INTERNAL', 'status']); // one of each
  assert.equal(events.at(-1)[1].code, grpc.status.OK);
});

test('a stream that breaks after its final message has ended: no error, and not resumed', async (t) => {
  for (const failure of [UNAVAILABLE, RST_STREAM, { code: grpc.status.UNKNOWN, details: 'No status information received' }]) {
    const { addresses, calls } = await replicas(t, [(call) => serveStory(call, { breakAfter: STORY.length, failure })]);
    const { messages, error } = await read(connect(t, addresses).stream({ prompt: 'hi' }));
    assert.equal(error, null, failure.details);
    assert.deepEqual(messages.flatMap((m) => m.tokenIds), STORY);
    assert.equal(messages.at(-1).finishReason, 'FINISH_REASON_MAX_TOKENS');
    assert.equal(calls.length, 1);
  }
  // a failure, not a break, after the final message still fails the stream
  const failed = { code: grpc.status.INTERNAL, details: 'boom' };
  const { addresses } = await replicas(t, [(call) => serveStory(call, { breakAfter: STORY.length, failure: failed })]);
  const { error } = await read(connect(t, addresses).stream({ prompt: 'hi' }));
  assert.equal(error?.code, grpc.status.INTERNAL);
});

test('a stream is not resumed when it failed, was told not to, has n > 1, had no seed, or broke too often',
  async (t) => {
    const cases = [
      { name: 'failed', serve: { breakAfter: 1, failure: { code: grpc.status.INVALID_ARGUMENT, details: 'no' } },
        code: grpc.status.INVALID_ARGUMENT },
      { name: 'resume: false', serve: { breakAfter: 1 }, options: { resume: false } },
      { name: 'n > 1', serve: { breakAfter: 1 }, request: { n: 2 } },
      { name: 'no seed in the headers', serve: { breakAfter: 1, seed: '' } },
      { name: 'broke too often', serve: { breakAfter: 1 }, calls: MAX_RESUMES + 1 },
    ];
    for (const { name, serve, options, request, code = grpc.status.UNAVAILABLE, calls: expected = 1 } of cases) {
      const { addresses, calls } = await replicas(t, [(call) => serveStory(call, serve)]);
      const { error } = await read(connect(t, addresses, options).stream({ prompt: 'hi', ...request }));
      assert.equal(error?.code, code, name);
      assert.equal(calls.length, expected, name);
    }
  });

test('cancel() fails the stream with CANCELLED; leaving a for await early cancels the call too', async (t) => {
  const cancelled = [];
  const endless = (call) => {
    call.on('cancelled', () => cancelled.push(call.request.prompt));
    const timer = setInterval(() => call.write({ text: 'x', tokenIds: [1] }), 5);
    call.on('cancelled', () => clearInterval(timer));
  };
  const { addresses } = await replicas(t, [endless]);
  const client = connect(t, addresses);
  const call = client.stream({ prompt: 'cancel' });
  call.once('data', () => call.cancel());
  const { error } = await read(call);
  assert.ok(isCancelled(error), String(error));
  for await (const message of client.stream({ prompt: 'break' })) {
    assert.equal(message.text, 'x');
    break; // leaves the for await: the Generation is destroyed, and its call cancelled
  }
  const deadline = Date.now() + 5000;
  while (cancelled.length < 2 && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 10));
  assert.deepEqual(cancelled.sort(), ['break', 'cancel']);
});

'use strict';
// The errors a failed call fails with, without braid: a fake Generate service fails each call with
// the status (and the google.rpc details, encoded here as braid's server encodes them) its prompt
// asks for. `npm test` runs it.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const {
  BadRequestError, BraidError, CallCancelledError, Client, DeadlineExceededError, InternalError, NotFoundError,
  OverloadedError, PermissionDeniedError, UnauthenticatedError, UnavailableError, finishReasonName, fromServiceError,
  grpc, isCancelled, loadBraid,
} = require('../index.js');

const braid = loadBraid();

// Protobuf's wire format, enough for google.rpc.Status and its details.
const varint = (value) => {
  const bytes = [];
  let rest = BigInt(value);
  do {
    bytes.push(Number(rest & 0x7fn) | (rest > 0x7fn ? 0x80 : 0));
    rest >>= 7n;
  } while (rest > 0n);
  return Buffer.from(bytes);
};
const bytesField = (number, value) => {
  const bytes = Buffer.from(value);
  return Buffer.concat([varint((number << 3) | 2), varint(bytes.length), bytes]);
};
const varintField = (number, value) => Buffer.concat([varint(number << 3), varint(value)]);
const any = (type, value) =>
  bytesField(3, Buffer.concat([bytesField(1, `type.googleapis.com/${type}`), bytesField(2, value)]));
const status = (code, message, ...details) => Buffer.concat([varintField(1, code), bytesField(2, message), ...details]);
const badRequest = (...violations) => Buffer.concat(violations.map(([field, description]) =>
  bytesField(1, Buffer.concat([bytesField(1, field), bytesField(2, description)]))));
const retryInfo = (seconds, nanos) => bytesField(1, Buffer.concat([varintField(1, seconds), varintField(2, nanos)]));

function failure(code, details, statusBytes) {
  const metadata = new grpc.Metadata();
  if (statusBytes) metadata.set('grpc-status-details-bin', statusBytes);
  return { code, details, metadata };
}

const INVALID = failure(grpc.status.INVALID_ARGUMENT, 'temperature: -1 is outside [0.0, 100.0]',
  status(grpc.status.INVALID_ARGUMENT, 'temperature: -1 is outside [0.0, 100.0]',
    any('google.rpc.BadRequest', badRequest(['temperature', '-1 is outside [0.0, 100.0]'], ['top_p', 'x']))));
const FULL = failure(grpc.status.RESOURCE_EXHAUSTED, 'the queue is full',
  status(grpc.status.RESOURCE_EXHAUSTED, 'the queue is full', any('google.rpc.RetryInfo', retryInfo(2, 500000000))));
const MISMATCHED = failure(grpc.status.INTERNAL, 'something else',
  status(grpc.status.RESOURCE_EXHAUSTED, 'the queue is full', any('google.rpc.RetryInfo', retryInfo(2, 0))));
const DENIED = failure(grpc.status.UNAUTHENTICATED, 'wrong API key');

const denied = (call) => call.metadata.get('authorization')[0] === 'Bearer deny';

let server;
let target;

before(async () => {
  server = new grpc.Server();
  server.addService(braid.Generate.service, {
    Stream(call) {
      const { prompt } = call.request;
      const fail = (error) => call.emit('error', error);
      if (denied(call)) return fail(DENIED);
      if (prompt === 'invalid') return fail(INVALID);
      if (prompt === 'full') return fail(FULL);
      if (prompt === 'mismatched') return fail(MISMATCHED);
      if (prompt === 'endless') {
        const timer = setInterval(() => call.write({ text: 'x', tokenIds: [1] }), 5);
        return call.on('cancelled', () => clearInterval(timer));
      }
      if (prompt.startsWith('fail ') && prompt !== 'fail mid-stream') {
        const name = prompt.slice('fail '.length);
        return fail({ code: grpc.status[name], details: `failed with ${name}\nsee the log` });
      }
      call.write({ text: 'Hel', tokenIds: [1] });
      if (prompt === 'fail mid-stream') return fail({ code: grpc.status.INTERNAL, details: 'forward pass failed' });
      call.write({ text: 'lo', tokenIds: [2], finishReason: 'FINISH_REASON_MAX_TOKENS' });
      return call.end();
    },
    Tokenize(call, callback) {
      callback(denied(call) ? DENIED : INVALID);
    },
    ModelInfo(call, callback) {
      callback(DENIED);
    },
    ServerStatus(call, callback) {
      callback(DENIED);
    },
    Abort(call, callback) {
      callback(DENIED);
    },
  });
  const port = await new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p)));
  });
  target = `127.0.0.1:${port}`;
});

after(() => server?.forceShutdown());

function connect(t, options) {
  const client = new Client(target, options);
  t.after(() => client.close());
  return client;
}

const TYPED = {
  INVALID_ARGUMENT: BadRequestError, RESOURCE_EXHAUSTED: OverloadedError, UNAVAILABLE: UnavailableError,
  DEADLINE_EXCEEDED: DeadlineExceededError, CANCELLED: CallCancelledError, NOT_FOUND: NotFoundError,
  PERMISSION_DENIED: PermissionDeniedError, UNAUTHENTICATED: UnauthenticatedError, INTERNAL: InternalError,
  UNIMPLEMENTED: BraidError, UNKNOWN: BraidError,
};

test('a failed stream fails with the error class of its status, keeping its code and details', async (t) => {
  const client = connect(t);
  for (const [name, Kind] of Object.entries(TYPED)) {
    await assert.rejects(client.generate({ prompt: `fail ${name}` }), (error) => {
      assert.equal(error.constructor, Kind, name);
      assert.ok(error instanceof BraidError && error instanceof Error, name);
      assert.equal(error.name, Kind.name);
      assert.equal(error.code, grpc.status[name]);
      assert.equal(error.codeName, name);
      assert.equal(error.details, `failed with ${name}\nsee the log`);
      assert.equal(error.message, `${name.toLowerCase().replaceAll('_', ' ')}: failed with ${name} see the log`);
      assert.equal(error.cause.code, grpc.status[name]); // grpc-js's own error
      assert.equal(error.status, null);
      return true;
    });
  }
});

test('a bad request names its field; the mid-stream failure of a stream is typed too', async (t) => {
  const client = connect(t);
  for (const call of [() => client.generate({ prompt: 'invalid' }), () => client.tokenize({ text: 'hi' })]) {
    await assert.rejects(call(), (error) => {
      assert.ok(error instanceof BadRequestError);
      assert.equal(error.field, 'temperature');
      assert.equal(error.description, '-1 is outside [0.0, 100.0]');
      assert.deepEqual(error.violations, [
        { field: 'temperature', description: '-1 is outside [0.0, 100.0]' }, { field: 'top_p', description: 'x' },
      ]);
      assert.equal(error.message, 'invalid argument: temperature: -1 is outside [0.0, 100.0]');
      assert.equal(error.status.code, grpc.status.INVALID_ARGUMENT);
      return true;
    });
  }
  const call = client.stream({ prompt: 'fail mid-stream' });
  const texts = [];
  await assert.rejects((async () => {
    for await (const message of call) texts.push(message.text);
  })(), { name: 'InternalError', message: 'internal: forward pass failed' });
  assert.deepEqual(texts, ['Hel']);
  assert.equal(call.finishReason, null);
  const plain = new BadRequestError({ code: grpc.status.INVALID_ARGUMENT, details: 'prompt: is empty' });
  assert.deepEqual([plain.field, plain.description, plain.violations], [null, 'prompt: is empty', []]);
});

test('an overloaded server says when to try again; details of another status are left out', async (t) => {
  const client = connect(t);
  await assert.rejects(client.generate({ prompt: 'full' }), (error) => {
    assert.ok(error instanceof OverloadedError);
    assert.equal(error.retryAfter, 2.5);
    assert.equal(error.message, 'resource exhausted: the queue is full (retry after 2.5 s)');
    return true;
  });
  const pushback = new grpc.Metadata();
  pushback.set('grpc-retry-pushback-ms', '1500'); // no RetryInfo: gRPC's pushback trailer
  const error = fromServiceError({ code: grpc.status.RESOURCE_EXHAUSTED, details: 'full', metadata: pushback });
  assert.equal(error.retryAfter, 1.5);
  assert.equal(fromServiceError(error), error);
  assert.equal(new OverloadedError({ code: grpc.status.RESOURCE_EXHAUSTED }).retryAfter, null);
  await assert.rejects(client.generate({ prompt: 'mismatched' }), (mismatched) => {
    assert.ok(mismatched instanceof InternalError);
    assert.equal(mismatched.status, null);
    return true;
  });
});

test('every method fails with a typed error: unary calls, health, a deadline, a cancel', async (t) => {
  const client = connect(t, { apiKey: 'deny' });
  for (const call of [() => client.generate({ prompt: 'hi' }), () => client.tokenize({ text: 'hi' }),
    () => client.modelInfo(), () => client.serverStatus(), () => client.abort(['r1'])]) {
    await assert.rejects(call(), { name: 'UnauthenticatedError', message: 'unauthenticated: wrong API key' });
  }
  await assert.rejects(client.health(), { name: 'BraidError', codeName: 'UNIMPLEMENTED' }); // the fake has none
  const allowed = connect(t);
  await assert.rejects(allowed.generate({ prompt: 'endless' }, { timeoutMs: 100 }), DeadlineExceededError);
  const endless = allowed.stream({ prompt: 'endless' });
  endless.once('data', () => endless.cancel());
  await assert.rejects((async () => {
    for await (const message of endless) assert.equal(message.text, 'x');
  })(), (error) => error instanceof CallCancelledError && isCancelled(error));
});

test('the finish reason is a name', async (t) => {
  const client = connect(t);
  const { text, finishReason, final } = await client.generate({ prompt: 'hi' });
  assert.deepEqual([text, finishReason, final.finishReason], ['Hello', 'MAX_TOKENS', 'FINISH_REASON_MAX_TOKENS']);
  const call = client.stream({ prompt: 'hi' });
  assert.equal(call.finishReason, null);
  for await (const message of call) assert.ok(message);
  assert.equal(call.finishReason, 'MAX_TOKENS');
  const reasons = ['FINISH_REASON_EOS', 'FINISH_REASON_UNSPECIFIED', undefined, 'FINISH_REASON_NEW'];
  assert.deepEqual(reasons.map(finishReasonName), ['EOS', null, null, 'NEW']);
});

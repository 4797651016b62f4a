'use strict';
// The library against a live braid server: BRAID_TARGET=host:port npm test
// (tests/test_node_client.py starts a server and runs this).

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { BadRequestError, Client, choice, isCancelled, jsonSchema, grpc } = require('../index.js');

const TARGET = process.env.BRAID_TARGET;
let client;

before(() => {
  assert.ok(TARGET, 'set BRAID_TARGET=host:port of a running braid server');
  client = new Client(TARGET);
});

after(() => client?.close());

async function waitFor(predicate, timeoutMs = 20000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    assert.ok(Date.now() < deadline, 'condition not met in time');
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

test('health, model info and tokenize', async () => {
  assert.equal(await client.health(), 'SERVING');
  assert.equal(await client.health('braid.v1.Generate'), 'SERVING');
  const info = await client.modelInfo();
  assert.ok(info.modelName);
  assert.ok(info.contextLength > 0);
  assert.match(info.mode, /^SCHEDULING_MODE_/);
  const tokens = await client.tokenize({ text: 'Hello world' });
  assert.ok(tokens.tokenIds.length > 0);
  assert.equal(tokens.pieces.join(''), 'Hello world');
});

test('token ids in: the text prompt\'s tokens; skipDetokenize: ids without text; detokenize and offsets', async () => {
  const prompt = 'The capital of France is';
  const { tokenIds: ids } = await client.tokenize({ text: prompt });
  const byText = await client.generate({ prompt, maxNewTokens: 4, ignoreEos: true });
  const byIds = await client.generate({ promptTokenIds: ids, maxNewTokens: 4, ignoreEos: true, skipDetokenize: true });
  assert.deepEqual(byIds.tokenIds, byText.tokenIds);
  assert.equal(byIds.text, '');
  assert.equal(byIds.final.usage.promptTokens, ids.length);
  assert.deepEqual(await client.detokenize(ids), { text: prompt, heldBackTokens: 0 });
  const { offsets } = await client.tokenize({ text: prompt, returnOffsets: true });
  assert.equal(offsets.at(-1).end, prompt.length);
});

test('a stream read with for await ends with finishReason and usage', async () => {
  const call = client.stream({ prompt: 'The capital of France is', maxNewTokens: 4, ignoreEos: true });
  const messages = [];
  for await (const message of call) messages.push(message);
  const final = messages.at(-1);
  assert.equal(final.finishReason, 'FINISH_REASON_MAX_TOKENS');
  assert.equal(final.usage.generatedTokens, 4);
  assert.equal(messages.flatMap((m) => m.tokenIds).length, 4);
  assert.ok(messages.map((m) => m.text).join('').length > 0);
  assert.ok(messages.slice(0, -1).every((m) => m.finishReason === 'FINISH_REASON_UNSPECIFIED'));
});

test('generate() runs a chat to its end with the seed it was given', async () => {
  const result = await client.generate({
    messages: [{ role: 'user', content: 'Say hi.' }], maxNewTokens: 3, temperature: 0.8, seed: '7', ignoreEos: true,
  });
  assert.equal(result.tokenIds.length, 3);
  assert.equal(result.final.seed, '7');
  assert.equal(result.final.usage.generatedTokens, 3);
});

test('cancel() ends the call with CANCELLED and frees the session on the server', async () => {
  const before = await client.serverStatus();
  const call = client.stream({ prompt: 'Count to a thousand:', maxNewTokens: 500, ignoreEos: true });
  const error = await new Promise((resolve, reject) => {
    call.once('data', () => call.cancel());
    call.on('error', resolve);
    call.on('end', () => reject(new Error('the stream ran to its end')));
  });
  assert.ok(isCancelled(error), String(error));
  const status = await waitFor(async () => {
    const now = await client.serverStatus();
    const counted = BigInt(now.sessionsFinished.cancelled) > BigInt(before.sessionsFinished.cancelled);
    return now.sessionsActive === 0 && counted && now;
  });
  assert.equal(status.sessionsQueued, 0);
});

test('abort() cancels a generation by its request id and resolves to the ids it cancelled', async () => {
  const requestId = `node-abort-${process.pid}`;
  const call = client.stream({ prompt: 'Count to a thousand:', maxNewTokens: 500, ignoreEos: true, requestId });
  const messages = [];
  const ended = new Promise((resolve, reject) => {
    call.on('data', (message) => messages.push(message));
    call.on('end', resolve);
    call.on('error', reject);
  });
  await waitFor(() => messages.length > 0);
  assert.deepEqual(await client.abort([requestId, 'no-such-request']), [requestId]);
  await ended; // normally, with a last message
  assert.equal(messages.at(-1).finishReason, 'FINISH_REASON_CANCELLED');
  assert.deepEqual(await client.abort([requestId]), []); // ended: nothing to abort
});

test('constraints: a choice and a JSON schema end with FINISH_REASON_CONSTRAINT', async () => {
  const answer = await client.generate({ prompt: 'Is the sky blue? Answer:', constraint: choice(['yes', 'no']) });
  assert.ok(['yes', 'no'].includes(answer.text), answer.text);
  assert.equal(answer.final.finishReason, 'FINISH_REASON_CONSTRAINT');
  assert.equal(answer.finishReason, 'CONSTRAINT'); // the name, as both clients show it
  const schema = {
    type: 'object', additionalProperties: false, required: ['age'],
    properties: { age: { type: 'integer', minimum: 0, maximum: 120 } },
  };
  const constraint = jsonSchema(schema);
  const person = await client.generate({ prompt: 'Alice is 30. As JSON:', maxNewTokens: 64, constraint });
  assert.equal(person.final.finishReason, 'FINISH_REASON_CONSTRAINT', person.text);
  assert.ok(Number.isInteger(JSON.parse(person.text).age), person.text);
});

test('a bad request is INVALID_ARGUMENT: a BadRequestError naming the field of the server\'s BadRequest', async () => {
  await assert.rejects(client.generate({ maxNewTokens: 2 }), (error) => {
    assert.equal(error.code, grpc.status.INVALID_ARGUMENT);
    assert.match(error.details, /prompt/);
    assert.ok(error instanceof BadRequestError, String(error));
    assert.equal(error.field, 'prompt');
    assert.equal(error.details, `${error.field}: ${error.description}`); // braid's details: "field: description"
    assert.equal(error.message, `invalid argument: ${error.details}`);
    return true;
  });
  const tooMany = client.generate({ prompt: 'hi', topLogprobs: 50 });
  await assert.rejects(tooMany, { name: 'BadRequestError', field: 'top_logprobs' });
});

'use strict';
// Embeddings from the library against a live braid server: BRAID_TARGET=host:port npm test.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { BadRequestError, Client } = require('../index.js');

let client;

before(() => {
  assert.ok(process.env.BRAID_TARGET, 'set BRAID_TARGET=host:port of a running braid server');
  client = new Client(process.env.BRAID_TARGET);
});

after(() => client?.close());

test('embed: one unit vector per input, in order, of texts or token ids', async () => {
  const info = await client.modelInfo();
  assert.ok(info.embeddingDimensions > 0);
  const { embeddings, promptTokens, pooling } = await client.embed(['The tide comes in', 'The tide goes out']);
  assert.equal(embeddings.length, 2);
  assert.equal(pooling, info.embeddingPooling);
  assert.equal(promptTokens, embeddings[0].promptTokens + embeddings[1].promptTokens);
  for (const { values } of embeddings) {
    assert.equal(values.length, info.embeddingDimensions);
    assert.ok(Math.abs(values.reduce((sum, v) => sum + v * v, 0) - 1) < 1e-4);
  }
  const { tokenIds } = await client.tokenize({ text: 'The tide comes in' });
  const byIds = await client.embed([tokenIds], { dimensions: 8, pooling: 'mean', normalize: false });
  assert.equal(byIds.embeddings[0].values.length, 8);
  assert.equal(byIds.pooling, 'POOLING_MEAN');
});

test('embed: an empty text is a BadRequestError naming it', async () => {
  await assert.rejects(client.embed(['fine', '']), (error) => error instanceof BadRequestError && /texts\[1\]/.test(error.message));
});

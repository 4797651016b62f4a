'use strict';
// The prefix cache's events from the library against a live braid server: BRAID_TARGET=host:port npm test.

const assert = require('node:assert/strict');
const { after, before, test } = require('node:test');
const { Client } = require('../index.js');

const PAGE = 16; // tokens per page: the server's --kv-page-size, its default

let client;

before(() => {
  assert.ok(process.env.BRAID_TARGET, 'set BRAID_TARGET=host:port of a running braid server');
  client = new Client(process.env.BRAID_TARGET);
});

after(() => client?.close());

test("kvEvents: a prompt's full pages arrive stored, chained and in sequence; a resumed read starts after its sequence", async () => {
  const { tokenIds } = await client.tokenize({ text: 'The tide comes in and the tide goes out. '.repeat(8) });
  const cacheSalt = `node-kv-events-${process.pid}-${Date.now()}`; // pages of their own: stored now
  await client.generate({ promptTokenIds: tokenIds, maxNewTokens: 1, cacheSalt });
  const pages = Math.floor(tokenIds.length / PAGE);
  assert.ok(pages >= 2);
  const stored = [];
  for await (const event of client.kvEvents(0)) { // every event held, from the oldest
    if (event.stored?.cacheSalt === cacheSalt) stored.push(event);
    if (stored.length === pages) break; // cancels the call
  }
  assert.deepEqual(stored.map((e) => e.stored.numTokens), Array(pages).fill(PAGE));
  for (let i = 1; i < pages; i++) {
    assert.ok(stored[i].stored.parentHash.equals(stored[i - 1].stored.hash));
    assert.equal(BigInt(stored[i].sequence), BigInt(stored[i - 1].sequence) + 1n);
  }
  const first = stored[0];
  for await (const event of client.kvEvents(first.sequence)) {
    assert.equal(event.sequence, stored[1].sequence); // the next one, not a resync
    assert.ok(event.stored.hash.equals(stored[1].stored.hash));
    break;
  }
});

'use strict';
// The routing key (routing.js) against the Python client's (braid.client.routing) for the same
// requests: tests/test_client_unit.py checks these same vectors on the Python side.

const assert = require('node:assert/strict');
const { test } = require('node:test');
const { routeKey } = require('../routing.js');

const VECTORS = [
  [{ prompt: 'The sea is' }, '4d5efeb7493816fd'],
  [{ prompt: 'The sea is', cacheSalt: 'tenant-a' }, '6e1419c97a310cb1'],
  [{ prompt: `${'é'.repeat(600)} and more` }, 'd6552e76fec2954d'], // cut at 1,024 bytes, mid-character
  [{ messages: [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hi' },
    { role: 'assistant', content: 'Hello' }, { role: 'user', content: 'Again' }] }, 'c27234034c1a4c49'],
  [{ messages: [{ role: 'user', content: '日本語 🌊' }] }, '9311b7a87686bfd7'],
  [{ prompt: '' }, '6e340b9cffb37a98'],
  [{ promptTokenIds: [1, 400, 49151] }, 'e7b52d33f5ae94b9'],
  [{ promptTokenIds: [...Array(300).keys()], cacheSalt: 'tenant-a' }, 'bf95a4d8e7a45eb1'], // the first 256 ids
];

test('the routing key is the Python client\'s for the same request', () => {
  for (const [request, key] of VECTORS) assert.equal(routeKey(request), key, JSON.stringify(request));
});

test('a conversation keeps its key as it grows; its salt changes it', () => {
  const first = [{ role: 'system', content: 'S' }, { role: 'user', content: 'Q1' }];
  const later = [...first, { role: 'assistant', content: 'A1' }, { role: 'user', content: 'Q2' }];
  assert.equal(routeKey({ messages: first }), routeKey({ messages: later }));
  assert.notEqual(routeKey({ messages: first }), routeKey({ messages: first, cacheSalt: 'x' }));
});

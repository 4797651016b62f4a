'use strict';
// Tool calls without a server: a request's tools, toolChoice and tool turns, and a response's
// toolCalls, through generate.proto as the server decodes and encodes them. `npm test` runs it.

const assert = require('node:assert/strict');
const { test } = require('node:test');
const { loadBraid } = require('../index.js');

const { Stream } = loadBraid().Generate.service;
const wire = (request) => Stream.requestDeserialize(Stream.requestSerialize(request));

test('tools, a toolChoice and tool turns reach the server as generate.proto has them', () => {
  const parameters = JSON.stringify({ type: 'object', properties: { city: { type: 'string' } } });
  const request = wire({
    messages: [
      { role: 'user', content: 'Weather in Oslo?' },
      { role: 'assistant', toolCalls: [{ id: 'call_1', name: 'get_weather', arguments: '{"city":"Oslo"}' }] },
      { role: 'tool', toolCallId: 'call_1', content: 'sunny' },
    ],
    tools: [{ name: 'get_weather', description: 'The weather', parameters }],
    toolChoice: { function: 'get_weather' },
  });
  assert.deepEqual(request.tools, [{ name: 'get_weather', description: 'The weather', parameters }]);
  assert.equal(request.toolChoice.function, 'get_weather');
  assert.equal(request.toolChoice.choice, 'function');
  assert.equal(request.messages[1].toolCalls[0].arguments, '{"city":"Oslo"}');
  assert.equal(request.messages[2].toolCallId, 'call_1');
  const required = wire({ prompt: 'hi', toolChoice: { mode: 'TOOL_CHOICE_MODE_REQUIRED', disableParallelToolCalls: true } });
  assert.equal(required.toolChoice.mode, 'TOOL_CHOICE_MODE_REQUIRED');
  assert.equal(required.toolChoice.disableParallelToolCalls, true);
});

test('a message carries its tool calls whole', () => {
  const call = { id: 'call_2', name: 'get_weather', arguments: '{"city":"Oslo"}' };
  const message = Stream.responseDeserialize(Stream.responseSerialize({ toolCalls: [call] }));
  assert.deepEqual(message.toolCalls, [call]);
});

test('--tools and --tool-choice set the request fields, as the server decodes them', () => {
  const fs = require('node:fs');
  const os = require('node:os');
  const path = require('node:path');
  const { parse } = require('../cli.js');
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'braid-tools-')), 'tools.json');
  const parameters = { type: 'object', properties: { city: { type: 'string' } } };
  fs.writeFileSync(file, JSON.stringify([{ type: 'function', function: { name: 'get_weather', parameters } }]));
  const named = wire(parse(['--chat', '--tools', file, '--tool-choice', 'get_weather', 'hi']).request);
  assert.deepEqual(named.tools, [{ name: 'get_weather', description: '', parameters: JSON.stringify(parameters) }]);
  assert.equal(named.toolChoice.function, 'get_weather');
  const required = wire(parse(['--chat', '--tools', file, '--tool-choice', 'required', 'hi']).request);
  assert.equal(required.toolChoice.mode, 'TOOL_CHOICE_MODE_REQUIRED');
  fs.rmSync(path.dirname(file), { recursive: true, force: true });
});

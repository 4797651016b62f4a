'use strict';
// The constraint helpers without a server: each makes the Constraint generate.proto describes, as the
// server decodes it. `npm test` runs it.

const assert = require('node:assert/strict');
const { test } = require('node:test');
const { choice, grammar, jsonObject, jsonSchema, loadBraid, regex } = require('../index.js');

const { Stream } = loadBraid().Generate.service;
const sent = (constraint) => {
  const request = Stream.requestDeserialize(Stream.requestSerialize({ prompt: 'hi', constraint }));
  return request.constraint;
};

test('each helper makes its kind of Constraint', () => {
  const schema = { type: 'object', properties: { n: { type: 'integer' } } };
  assert.deepEqual(sent(jsonSchema(schema)), { jsonSchema: JSON.stringify(schema), kind: 'jsonSchema' });
  assert.deepEqual(sent(jsonSchema('{"type": "string"}')), { jsonSchema: '{"type": "string"}', kind: 'jsonSchema' });
  assert.deepEqual(sent(jsonObject()), { jsonObject: true, kind: 'jsonObject' });
  assert.deepEqual(sent(regex('[0-9]+')), { regex: '[0-9]+', kind: 'regex' });
  assert.deepEqual(sent(choice(new Set(['yes', 'no']))), { choice: { choices: ['yes', 'no'] }, kind: 'choice' });
  const gbnf = { grammar: { syntax: 'GRAMMAR_SYNTAX_GBNF', text: 'root ::= "a"' }, kind: 'grammar' };
  assert.deepEqual(sent(grammar('root ::= "a"', 'gbnf')), gbnf);
  assert.deepEqual(sent(grammar('root ::= "a"', 'GRAMMAR_SYNTAX_GBNF')), gbnf); // the enum's name, as responses carry
  assert.equal(sent(grammar('start: "a"')).grammar.syntax, 'GRAMMAR_SYNTAX_LARK'); // the default
});

test('grammar() refuses a syntax generate.proto does not name', () => {
  assert.throws(() => grammar('x', 'ebnf'), { name: 'RangeError', message: 'expected lark|gbnf, not "ebnf"' });
  assert.throws(() => grammar('x', 'unspecified'), RangeError);
});

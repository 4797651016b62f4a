'use strict';
// The command line without a braid server: its flags against generate.proto and the README, and
// what it prints for the messages of a fake Generate service. `npm test` runs it.

const assert = require('node:assert/strict');
const { execFile } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { after, before, test } = require('node:test');
const { grpc, loadBraid } = require('../index.js');
const { CONSTRAINT_FLAGS, FLAGS, TOOL_FLAGS, parse, usage } = require('../cli.js');

const braid = loadBraid();
const INPUT = ['prompt', 'messages']; // the prompt argument, --chat and --system
const fieldsOf = (type) => type.field.filter((field) => !INPUT.includes(field.name));

test('every GenerateRequest field has a flag', () => {
  const flagged = new Set([...FLAGS, ...CONSTRAINT_FLAGS, ...TOOL_FLAGS].map((flag) => flag.field)); // constraint: one of a group
  const missing = fieldsOf(braid.GenerateRequest.type).filter((field) => !flagged.has(field.name));
  assert.deepEqual(missing.map((field) => field.name), [], 'add them to REQUEST_FLAGS in cli.js');
});

test('every kind of Constraint has a flag', () => {
  const kinds = CONSTRAINT_FLAGS.map((flag) => flag.kind);
  const fields = braid.Constraint.type.field.map((field) => field.name);
  assert.deepEqual(fields, kinds, 'add them to CONSTRAINT_FLAGS in cli.js');
});

// Files for --json-schema and --grammar.
const files = fs.mkdtempSync(path.join(os.tmpdir(), 'braid-node-'));
const SCHEMA = '{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}';
const GBNF = 'root ::= "yes" | "no"';
fs.writeFileSync(path.join(files, 'schema.json'), SCHEMA);
fs.writeFileSync(path.join(files, 'yes.gbnf'), GBNF);
after(() => fs.rmSync(files, { recursive: true, force: true }));

test('each constraint flag sets its kind of constraint, as the server decodes the request', () => {
  const values = {
    jsonSchema: [path.join(files, 'schema.json')], jsonObject: [], regex: ['[0-9]{3}'], choice: ['yes,no'],
    grammar: [path.join(files, 'yes.gbnf'), '--grammar-syntax', 'gbnf'],
  };
  const { Stream } = braid.Generate.service;
  const sent = CONSTRAINT_FLAGS.map(({ flag, kind }) => {
    const request = parse([`--${flag}`, ...values[kind], 'hi']).request;
    const { constraint } = Stream.requestDeserialize(Stream.requestSerialize(request));
    assert.equal(constraint.kind, kind, flag);
    return [kind, constraint[kind]];
  });
  assert.deepEqual(Object.fromEntries(sent), {
    jsonSchema: SCHEMA, jsonObject: true, regex: '[0-9]{3}', choice: { choices: ['yes', 'no'] },
    grammar: { syntax: 'GRAMMAR_SYNTAX_GBNF', text: GBNF },
  });
  const lark = parse(['--grammar', path.join(files, 'yes.gbnf'), 'hi']).request.constraint.grammar.syntax;
  assert.equal(lark, 'GRAMMAR_SYNTAX_LARK'); // the default, as braid-client's
  assert.equal(parse(['hi']).request.constraint, undefined); // none: the server's default
});

test('each flag sets its field, as the server decodes the request', () => {
  // A value of each type (TYPE_MESSAGE: the map logit_bias); integers otherwise.
  const sample = { TYPE_BOOL: [], TYPE_FLOAT: ['0.5'], TYPE_STRING: ['x'], TYPE_ENUM: ['batch'], TYPE_MESSAGE: ['5=-1'] };
  const argv = FLAGS.flatMap(({ flag, field }) => {
    const { type } = fieldsOf(braid.GenerateRequest.type).find((f) => f.name === field);
    return [`--${flag}`, ...(sample[type] ?? ['3'])];
  });
  const { Stream } = braid.Generate.service;
  const sent = Stream.requestDeserialize(Stream.requestSerialize(parse([...argv, 'hi']).request));
  const defaults = Stream.requestDeserialize(Buffer.alloc(0));
  for (const { field } of FLAGS) assert.notDeepEqual(sent[field], defaults[field], field);
  assert.deepEqual(sent.logitBias, { 5: -1 });
  assert.equal(sent.priority, 'PRIORITY_BATCH');
});

test('flags read as braid-client reads them', () => {
  const args = parse([
    ...['--target', 'h:1', '--max-tokens', '5', '--cancel-after', '2', '--seed', '18446744073709551615'],
    ...['--system', 's', '--stop', 'a', '--stop', 'b', '--logit-bias', '42=-100', '--logit-bias', '7=2.5', '-n', '2', 'hi'],
  ]);
  assert.equal(args.target, 'h:1');
  assert.equal(args.cancelAfter, 2);
  assert.deepEqual(args.request, {
    messages: [{ role: 'system', content: 's' }, { role: 'user', content: 'hi' }],
    maxNewTokens: 5, seed: '18446744073709551615', stop: ['a', 'b'], logitBias: { 42: -100, 7: 2.5 }, n: 2,
  });
  const greedy = parse(['--temperature', '0.5', '--ignore-eos', 'x']).request;
  assert.deepEqual(greedy, { prompt: 'x', temperature: 0.5, ignoreEos: true });
});

test('--prompt-token-id sends the prompt as ids, with no prompt argument', () => {
  const { request } = parse(['--prompt-token-id', '5', '--prompt-token-id', '6', '--skip-detokenize']);
  assert.deepEqual(request, { promptTokenIds: [5, 6], skipDetokenize: true });
});

test('--target: repeated or comma-separated addresses are replicas; a resolver\'s target is one', () => {
  const target = (...values) => parse([...values.flatMap((value) => ['--target', value]), 'hi']).target;
  assert.equal(target('10.0.0.1:1,localhost:2', '10.0.0.3:3'), 'ipv4:10.0.0.1:1,127.0.0.1:2,10.0.0.3:3');
  assert.equal(target('[::1]:1,[::1]:2'), 'ipv6:[::1]:1,[::1]:2');
  assert.equal(target('dns:///braid.default.svc:50051'), 'dns:///braid.default.svc:50051');
  assert.equal(target('ipv4:10.0.0.1:1,10.0.0.2:2'), 'ipv4:10.0.0.1:1,10.0.0.2:2');
  assert.equal(target('braid:50051'), 'braid:50051');
});

test('--help and the README list every flag', () => {
  const readme = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
  for (const { flag } of [...FLAGS, ...CONSTRAINT_FLAGS, ...TOOL_FLAGS, { flag: 'grammar-syntax' }]) {
    assert.match(usage(), new RegExp(`--${flag}\\b`), flag);
    assert.match(readme, new RegExp(`^\\| .*\`--${flag}\\b`, 'm'), `--${flag} is missing from the README's flag table`);
  }
});

// A fake Generate service: two samples with logprobs (and the prompt's) after a queue position, or an error.
const received = [];
let server;
let target;

const logprob = (tokenId, value, rank) => ({
  logprob: value, rank, top: [{ tokenId, logprob: value }, { tokenId: 260, logprob: -4 }],
});
const final = (index, reason, extra) => ({
  index, finishReason: reason, requestId: 'r1', seed: String(7 + index),
  usage: { promptTokens: 5, generatedTokens: 2, cachedTokens: 3, truncatedTokens: 1 },
  timings: { queueMs: 1, timeToFirstTokenMs: 2, totalMs: 3, tokensPerSecond: 4 }, ...extra,
});
const REPLIES = [
  { queuePosition: 1 },
  { index: 0, text: ' Paris', tokenIds: [7042], logprobs: [logprob(7042, -0.25, 1)],
    promptTokenIds: [1, 2], promptLogprobs: [logprob(2, -2, 3)] },
  { index: 1, text: ' Lyon', tokenIds: [9], logprobs: [logprob(9, -3.5, 4)] },
  final(0, 'FINISH_REASON_STOP_SEQUENCE', { stopSequence: '.', tokenIds: [30], logprobs: [logprob(30, -0.5, 1)] }),
  final(1, 'FINISH_REASON_MAX_TOKENS', { text: '!', tokenIds: [17], logprobs: [logprob(17, -1, 2)] }),
];
const CONSTRAINED = [ // what a constrained request gets back
  { text: 'y', tokenIds: [88] },
  final(0, 'FINISH_REASON_CONSTRAINT', { text: 'es', tokenIds: [274] }),
];

before(async () => {
  server = new grpc.Server();
  server.addService(braid.Generate.service, {
    Stream(call) {
      received.push(call.request);
      if (call.request.prompt === 'fail') {
        call.emit('error', { code: grpc.status.INVALID_ARGUMENT, details: 'top_logprobs: 50 is more than 20' });
        return;
      }
      const replies = call.request.constraint ? CONSTRAINED : REPLIES;
      for (const reply of replies) call.write(reply);
      call.end();
    },
  });
  const port = await new Promise((resolve, reject) => {
    const credentials = grpc.ServerCredentials.createInsecure();
    server.bindAsync('127.0.0.1:0', credentials, (error, p) => (error ? reject(error) : resolve(p)));
  });
  target = `127.0.0.1:${port}`;
});

after(() => server?.forceShutdown());

function cli(...args) {
  const argv = [path.join(__dirname, '..', 'cli.js'), '--target', target, ...args];
  return new Promise((resolve) => {
    execFile(process.execPath, argv, (error, stdout, stderr) => resolve({ code: error?.code ?? 0, stdout, stderr }));
  });
}

test('samples, logprobs, queue position and stats as the CLI prints them', async () => {
  const flags = ['-n', '2', '--top-logprobs', '2', '--prompt-logprobs', '--report-queue', '--stats'];
  const { code, stdout, stderr } = await cli(...flags, 'hi');
  assert.equal(code, 0, stderr);
  const { prompt, n, topLogprobs, promptLogprobs, reportQueue } = received.at(-1);
  assert.deepEqual({ prompt, n, topLogprobs, promptLogprobs, reportQueue },
    { prompt: 'hi', n: 2, topLogprobs: 2, promptLogprobs: true, reportQueue: true });
  assert.equal(stdout, '--- sample 0 ---\n Paris\n--- sample 1 ---\n Lyon!\n');
  const lines = stderr.split('\n');
  assert.equal(lines[0], '[queue position 1]');
  assert.ok(lines.includes('[sample 0] prompt logprobs: 1 tokens, mean -2.000, lowest -2.000'), stderr);
  assert.match(stderr, /^ +2 +-2\.000 +rank 3 +top: 2 -2\.000, 260 -4\.000$/m);
  assert.ok(lines.includes('[sample 1] logprobs: 2 tokens, mean -2.250, lowest -3.500'), stderr);
  assert.match(stderr, /^ +7042 " Paris" +-0\.250 +rank 1 +top: 7042 -0\.250, 260 -4\.000$/m);
  assert.match(stderr, /^ +9 " Lyon" +-3\.500 +rank 4 +top: 9 -3\.500, 260 -4\.000$/m);
  const stopped = '[sample 0] finish_reason: STOP_SEQUENCE (stop sequence ".")  request_id: r1  seed: 7';
  assert.ok(lines.includes(stopped), stderr);
  assert.ok(lines.includes('[sample 0] usage: 5 prompt tokens (3 from the cache, 1 cut), 2 generated tokens'), stderr);
  assert.ok(lines.includes('[sample 1] finish_reason: MAX_TOKENS  request_id: r1  seed: 8'), stderr);
});

test('an error prints one line, its status in words, and exits 1; a bad flag value exits 2', async () => {
  const failed = await cli('--top-logprobs', '50', 'fail');
  assert.equal(failed.code, 1);
  assert.equal(failed.stderr, 'braid-node: invalid argument: top_logprobs: 50 is more than 20\n');
  assert.equal(failed.stdout, ''); // reported once, though grpc-js emits 'error' and then 'end'
  const bad = await cli('--logit-bias', 'forty-two', 'hi');
  assert.equal(bad.code, 2);
  assert.match(bad.stderr, /^--logit-bias: expected KEY=VALUE, not "forty-two"/);
  const hosts = await cli('--target', '10.0.0.1:1,braid:2', 'hi'); // a name among several: not for gRPC's ipv4:
  assert.equal(hosts.code, 2);
  assert.match(hosts.stderr, /^--target: "braid:2" among several addresses: give each as ip:port/);
});

test('--choice sends the choices and the stats show finish reason CONSTRAINT', async () => {
  const { code, stdout, stderr } = await cli('--choice', 'yes,no', '--stats', 'Is it?');
  assert.equal(code, 0, stderr);
  assert.deepEqual(received.at(-1).constraint, { choice: { choices: ['yes', 'no'] }, kind: 'choice' });
  assert.equal(stdout, 'yes\n');
  assert.match(stderr, /^finish_reason: CONSTRAINT {2}request_id: r1/m);
});

test('--stats start on a line of their own after the text, stdout and stderr into one pipe', async () => {
  const { code, stdout, err: stderr } = await new Promise((resolve) => {
    const command = `"${process.execPath}" "${path.join(__dirname, '..', 'cli.js')}" --target ${target} ` +
      '--choice yes,no --stats hi 2>&1';
    execFile('/bin/sh', ['-c', command], (error, out, err) => resolve({ code: error?.code ?? 0, stdout: out, err }));
  });
  assert.equal(code, 0, stderr);
  assert.match(stdout, /^yes\nfinish_reason: CONSTRAINT {2}request_id: r1/);
});

test('two constraint flags, a bad --grammar-syntax or a missing file exit 2, naming the flags', async () => {
  const both = await cli('--regex', '[0-9]+', '--json-object', '--choice', 'a,b', 'hi');
  assert.equal(both.code, 2);
  assert.match(both.stderr, /^--json-object, --regex, --choice: give one output constraint at most\n/);
  const syntax = await cli('--grammar', path.join(files, 'yes.gbnf'), '--grammar-syntax', 'ebnf', 'hi');
  assert.equal(syntax.code, 2);
  assert.match(syntax.stderr, /^--grammar-syntax: expected lark\|gbnf, not "ebnf"\n/);
  const missing = await cli('--json-schema', path.join(files, 'none.json'), 'hi');
  assert.equal(missing.code, 2);
  assert.match(missing.stderr, /^--json-schema: ENOENT: no such file or directory/);
});

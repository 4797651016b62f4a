#!/usr/bin/env node
'use strict';
/**
 * braid-node: stream a generation from a braid server to the terminal.
 *
 *   node cli.js [--target host:port] [--max-new-tokens N] [--cancel-after N] "prompt"
 *
 * --target may be given again, or list several ip:port addresses separated by commas: calls then go
 * round robin over the replicas, and a stream whose replica dies is resumed on another.
 * Tokens are printed as they arrive. Ctrl-C (SIGINT) cancels the stream on the server and exits
 * 130; --cancel-after N cancels it after N generated tokens and exits 0, as a completed stream does.
 * Every GenerateRequest field has a flag (REQUEST_FLAGS), typed by generate.proto; its constraint
 * has one flag per kind of Constraint (CONSTRAINT_FLAGS), at most one of them given; its tools and
 * tool_choice one each (TOOL_FLAGS).
 */

const fs = require('node:fs');
const { parseArgs } = require('node:util');
const { Client, channelTarget, describe, finishReasonName, fromServiceError, isCancelled, loadBraid, enumValues } =
  require('./index.js');
const { choice, grammar, jsonObject, jsonSchema, regex } = require('./index.js'); // a constraint of each kind

const PROG = 'braid-node';
const EXIT_FAILED = 1; // a call failed
const EXIT_USAGE = 2;
const EXIT_INTERRUPTED = 130; // the shell's code for a process ended by SIGINT

const kebab = (name) => name.replace(/[A-Z]/g, (letter) => `-${letter.toLowerCase()}`);

// One flag per GenerateRequest field but the input (prompt is the argument; messages come of --chat
// and --system), named as braid-client's: the field in kebab-case unless `flag` says otherwise.
// Its value is parsed as the field's type in generate.proto says; repeated fields repeat the flag.
const REQUEST_FLAGS = [
  { field: 'maxNewTokens', alias: 'max-tokens', help: 'the most tokens to generate (or --max-tokens N)' },
  { field: 'minNewTokens', help: 'no end-of-sequence or stop token before N tokens' },
  { field: 'temperature', metavar: 'T', help: '0 (default) is greedy' },
  { field: 'topP', metavar: 'P', help: 'keep the most likely tokens adding up to probability P' },
  { field: 'topK', metavar: 'K', help: 'keep the K most likely tokens' },
  { field: 'minP', metavar: 'P', help: "drop tokens less likely than P times the top token" },
  { field: 'typicalP', metavar: 'P', help: 'locally typical sampling: keep the tokens nearest the entropy, up to mass P' },
  { field: 'repetitionPenalty', help: 'divide the logits of tokens seen before (0 to 10)' },
  { field: 'presencePenalty', help: "OpenAI's, over generated tokens: -2 to 2" },
  { field: 'frequencyPenalty', help: "OpenAI's, over generated tokens: -2 to 2" },
  { field: 'logitBias', metavar: 'ID=BIAS', help: "add BIAS (-100 to 100) to token ID's logit (repeatable)" },
  { field: 'seed', metavar: 'S', help: 'sampling seed (sample i of -n is seeded S + i)' },
  { field: 'stop', help: 'a stop string (repeatable)' },
  { field: 'stopTokenIds', flag: 'stop-token-id', metavar: 'ID', help: 'a stop token id (repeatable)' },
  { field: 'includeStopSequence', help: 'send the stop string that ended the generation as text' },
  { field: 'ignoreEos', help: 'keep generating past end-of-sequence, up to --max-new-tokens' },
  { field: 'requestId', metavar: 'ID', help: 'the id to run under (default: the server assigns one)' },
  { field: 'priority', help: 'queue priority under load' },
  { field: 'timeoutMs', metavar: 'MS', help: 'end the generation with finish reason DEADLINE after MS' },
  { field: 'cacheSalt', help: 'share cached prompt prefixes only with requests of the same salt' },
  { field: 'logprobs', help: "print each token's log probability and rank (to stderr)" },
  { field: 'topLogprobs', metavar: 'K', help: 'and the K (0-20) most likely tokens at each step' },
  { field: 'promptLogprobs', help: "print each prompt token's log probability too (to stderr)" },
  { field: 'truncateInputTokens', help: 'keep at most the last N prompt tokens (a chat: its latest turns)' },
  { field: 'badWords', flag: 'bad-word', help: 'a word never to generate (repeatable)' },
  { field: 'reportQueue', help: 'print the queue position while waiting (to stderr)' },
  { field: 'n', short: 'n', help: 'N samples of the prompt (1-16), printed one after another' },
  { field: 'resumeTokenIds', flag: 'resume-token-id', metavar: 'ID',
    help: "a token id a broken stream had delivered, to go on from (repeatable, in order; with its --seed)" },
  { field: 'disableSpeculation', help: 'no speculative decoding for this request (the tokens are the same)' },
  { field: 'adapter', metavar: 'NAME', help: "a loaded LoRA adapter to generate with (ModelInfo's adapters)" },
  { field: 'promptTokenIds', flag: 'prompt-token-id', metavar: 'ID',
    help: 'a prompt token id, instead of the prompt (repeatable, in order)' },
  { field: 'skipDetokenize', help: 'receive token ids only, no text: prints the ids' },
  { field: 'enableThinking', help: "set the chat template's enable_thinking (a reasoning model's switch) true" },
  { field: 'maxReasoningTokens', help: "a reasoning model's budget: braid closes its reasoning after N tokens" },
];

// GenerateRequest.constraint: a flag per kind of Constraint (its oneof), named as braid-client's, at
// most one of them given; `build` makes the constraint of the flag's value (and --grammar-syntax's).
const readText = (file) => fs.readFileSync(file, 'utf8');
const CONSTRAINT_FLAGS = [
  { kind: 'jsonSchema', metavar: 'FILE', help: 'the output is JSON valid against this schema file',
    build: (file) => jsonSchema(readText(file)) },
  { kind: 'jsonObject', help: 'the output is any JSON object', build: () => jsonObject() },
  { kind: 'regex', metavar: 'PATTERN', help: 'the whole output matches this regular expression',
    build: (pattern) => regex(pattern) },
  { kind: 'choice', metavar: 'A,B,C', help: 'the output is exactly one of these comma-separated strings',
    build: (text) => choice(text.split(',')) },
  { kind: 'grammar', metavar: 'FILE', help: 'the output is a sentence of this grammar (--grammar-syntax)',
    build: (file, syntax) => grammar(readText(file), syntax) },
].map((spec) => ({ field: 'constraint', flag: kebab(spec.kind), ...spec }));

// GenerateRequest.tools and tool_choice: a file of tools, and the choice; each call the model makes is
// printed as a JSON line after the text.
const TOOL_MODES = ['auto', 'none', 'required'];
const TOOL_FLAGS = [
  { field: 'tools', metavar: 'FILE', help: 'a JSON file of a list of tools: {name, description, parameters}',
    build: (file) => JSON.parse(readText(file)).map(toolOf) },
  { field: 'toolChoice', metavar: 'auto|none|required|NAME', help: 'whether the model must call a tool, or which',
    build: (text) => (TOOL_MODES.includes(text) ? { mode: `TOOL_CHOICE_MODE_${text.toUpperCase()}` } : { function: text }) },
].map((spec) => ({ flag: kebab(spec.field), ...spec }));

/** A tool as generate.proto has it, from {name, description, parameters} or OpenAI's {function: {...}}. */
function toolOf(value) {
  const { name, description = '', parameters } = value.function ?? value;
  const schema = parameters === undefined || typeof parameters === 'string' ? parameters : JSON.stringify(parameters);
  return { name, description, ...(schema !== undefined && { parameters: schema }) };
}

const CLI_FLAGS = [
  ['--target HOST:PORT', 'the braid server (env BRAID_TARGET; default localhost:50051); repeated, or'],
  ['', 'IP:PORT,IP:PORT: replicas to balance over'],
  ['--chat', 'send the prompt as one user message of a chat'],
  ['--system TEXT', 'a system message first (implies --chat)'],
  ['--cancel-after N', 'cancel the stream after N generated tokens (exit 0)'],
  ['--stats', 'print finish reason, usage and timings to stderr'],
  ['-h, --help', 'this help'],
];

function usageError(message) {
  process.stderr.write(`${message}\n\nusage: node cli.js [options] "prompt" (--help lists them)\n`);
  process.exit(EXIT_USAGE);
}

function expected(what, text) {
  return new RangeError(`expected ${what}, not ${JSON.stringify(text)}`);
}

function matching(pattern, convert, what) {
  return (text) => {
    if (!pattern.test(text)) throw expected(what, text);
    return convert(text);
  };
}

// Scalar types of the proto: the text of a flag's value to the value proto-loader sends.
const SCALARS = {
  TYPE_INT32: { metavar: 'N', parse: matching(/^-?\d+$/, Number, 'an integer') },
  TYPE_UINT32: { metavar: 'N', parse: matching(/^\d+$/, Number, 'a non-negative integer') },
  TYPE_UINT64: { metavar: 'N', parse: matching(/^\d+$/, String, 'a non-negative integer') }, // exact, as a string
  TYPE_FLOAT: { metavar: 'X', parse: matching(/^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i, Number, 'a number') },
  TYPE_STRING: { metavar: 'TEXT', parse: (text) => text },
  TYPE_BOOL: { metavar: '', parse: (present) => present },
};

/** An enum flag's value: 'batch' for PRIORITY_BATCH; the UNSPECIFIED value is the default, not a choice. */
function enumType(braid, typeName) {
  const values = enumValues(braid, typeName);
  const metavar = Object.keys(values).join('|');
  const parse = (text) => {
    if (!Object.hasOwn(values, text)) throw expected(metavar, text);
    return values[text];
  };
  return { metavar, parse };
}

/** How a GenerateRequest field's flag reads its value: { metavar, parse, repeated }. */
function fieldType(braid, field) {
  const repeated = field.label === 'LABEL_REPEATED';
  if (field.type === 'TYPE_ENUM') return { ...enumType(braid, field.typeName), repeated };
  const entry = braid.GenerateRequest.type.nestedType.find((t) => t.name === field.typeName && t.options?.mapEntry);
  if (entry) {
    // A map: KEY=VALUE, repeatable; logit_bias's 42=-100.
    const [key, value] = entry.field.map((f) => SCALARS[f.type]);
    const metavar = `${key.metavar}=${value.metavar}`;
    const parse = (text) => {
      const [, k, v] = /^([^=]*)=(.*)$/.exec(text) ?? [];
      if (k === undefined) throw expected('KEY=VALUE', text);
      return [key.parse(k), value.parse(v)];
    };
    return { metavar, parse, repeated: true, map: true };
  }
  if (!SCALARS[field.type]) throw new Error(`braid-node has no flag type for ${field.name} (${field.type})`);
  return { ...SCALARS[field.type], repeated };
}

function requestFlags(braid) {
  const fields = new Map(braid.GenerateRequest.type.field.map((f) => [f.name, f]));
  return REQUEST_FLAGS.map((spec) => {
    const field = fields.get(spec.field);
    if (!field) throw new Error(`generate.proto's GenerateRequest has no field ${spec.field}`);
    const type = fieldType(braid, field);
    return { flag: kebab(spec.field), ...type, ...spec };
  });
}

function checkConstraintFlags(braid) {
  const kinds = braid.Constraint.type.field.map((f) => f.name);
  const unknown = CONSTRAINT_FLAGS.find(({ kind }) => !kinds.includes(kind));
  if (unknown) throw new Error(`generate.proto's Constraint has no field ${unknown.kind}`);
}

const BRAID = loadBraid();
const FLAGS = requestFlags(BRAID);
const GRAMMAR_SYNTAX = enumType(BRAID, 'GrammarSyntax');
checkConstraintFlags(BRAID);

const OPTIONS = {
  target: { type: 'string', multiple: true, default: [process.env.BRAID_TARGET || 'localhost:50051'] },
  chat: { type: 'boolean', default: false },
  system: { type: 'string' },
  'cancel-after': { type: 'string' },
  stats: { type: 'boolean', default: false },
  help: { type: 'boolean', short: 'h', default: false },
  'grammar-syntax': { type: 'string', default: 'lark' },
};
for (const { flag, alias, short, metavar, repeated } of FLAGS) {
  const option = { type: metavar ? 'string' : 'boolean', multiple: repeated, ...(short && { short }) };
  OPTIONS[flag] = option;
  if (alias) OPTIONS[alias] = option;
}
for (const { flag, metavar } of [...CONSTRAINT_FLAGS, ...TOOL_FLAGS]) OPTIONS[flag] = { type: metavar ? 'string' : 'boolean' };

function usage() {
  const line = ([flag, help]) => `  ${flag.padEnd(30)} ${help}`;
  const flagLine = ({ flag, short, metavar, help }) => [
    `${short ? `-${short}, ` : ''}--${flag}${metavar ? ` ${metavar}` : ''}`,
    help,
  ];
  const { metavar } = GRAMMAR_SYNTAX;
  const syntax = { flag: 'grammar-syntax', metavar, help: "--grammar's dialect (default lark)" };
  return [
    'usage: node cli.js [options] "prompt"',
    '',
    ...CLI_FLAGS.map(line),
    '',
    "generation (GenerateRequest's fields; unset: the server's default):",
    ...FLAGS.map(flagLine).map(line),
    '',
    'output constraint (GenerateRequest.constraint; one of):',
    ...[...CONSTRAINT_FLAGS, syntax].map(flagLine).map(line),
    '',
    'tool calls (GenerateRequest.tools; each call is printed as a JSON line):',
    ...TOOL_FLAGS.map(flagLine).map(line),
    '',
    'Ctrl-C cancels the generation on the server and exits 130.',
  ].join('\n');
}

/** parse(text), or exit 2 with what is wrong with --flag's value. */
function flagValue(flag, parse, text) {
  try {
    return parse(text);
  } catch (error) {
    return usageError(`--${flag}: ${error.message}`);
  }
}

/** The GenerateRequest fields the flags in `values` set; fields left out keep the server's default. */
function requestOf(values) {
  const request = {};
  for (const { field, flag, alias, parse, map } of FLAGS) {
    const value = values[flag] ?? (alias && values[alias]);
    if (value === undefined) continue;
    const parsed = [value].flat().map((text) => flagValue(flag, parse, text));
    request[field] = map ? Object.fromEntries(parsed) : Array.isArray(value) ? parsed : parsed[0];
  }
  return request;
}

/** The constraint the flags in `values` ask for (at most one of CONSTRAINT_FLAGS), or undefined. */
function constraintOf(values) {
  const given = CONSTRAINT_FLAGS.filter(({ flag }) => values[flag] !== undefined);
  if (given.length > 1) {
    usageError(`${given.map(({ flag }) => `--${flag}`).join(', ')}: give one output constraint at most`);
  }
  const syntax = flagValue('grammar-syntax', GRAMMAR_SYNTAX.parse, values['grammar-syntax']);
  if (given.length === 0) return undefined;
  const [{ flag, build }] = given;
  return flagValue(flag, (text) => build(text, syntax), values[flag]);
}

// A target naming its resolver ('dns:///name:port', 'ipv4:a:p,b:p') is one target, commas and all.
const RESOLVER_SCHEME = /^(dns|ipv4|ipv6|unix):/;

/** --target's values (repeated, or comma-separated addresses) as one channel target. */
function targetOf(values) {
  const addresses = values.flatMap((value) => (RESOLVER_SCHEME.test(value) ? [value] : value.split(',')));
  return flagValue('target', channelTarget, addresses.filter(Boolean));
}

/** The command line to { target, cancelAfter, stats, request }; exits 2 on a bad flag. */
function parse(argv) {
  let parsed;
  try {
    parsed = parseArgs({ args: argv, options: OPTIONS, allowPositionals: true });
  } catch (error) {
    usageError(error.message);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    process.stdout.write(`${usage()}\n`);
    process.exit(0);
  }
  const ids = values['prompt-token-id'] !== undefined; // the prompt as token ids: no argument needed
  if (positionals.length !== 1 && !(ids && positionals.length === 0)) usageError('one prompt is needed (quote it)');
  const [prompt] = positionals;
  const system = values.system === undefined ? [] : [{ role: 'system', content: values.system }];
  const chat = values.chat || system.length > 0;
  const text = chat ? { messages: [...system, { role: 'user', content: prompt }] } : { prompt };
  const input = prompt === undefined ? {} : text;
  const cancelAfter = values['cancel-after'];
  const constraint = constraintOf(values);
  const tools = {};
  for (const { field, flag, build } of TOOL_FLAGS) {
    if (values[flag] !== undefined) tools[field] = flagValue(flag, build, values[flag]);
  }
  return {
    target: targetOf(values.target),
    stats: values.stats,
    cancelAfter:
      cancelAfter === undefined ? undefined : flagValue('cancel-after', SCALARS.TYPE_UINT32.parse, cancelAfter),
    request: { ...input, ...requestOf(values), ...(constraint && { constraint }), ...tools },
  };
}

const fixed = (x) => x.toFixed(3);

/** A summary line, then a line per token: id, the text its message added, logprob, rank, top list. */
function printLogprobs(title, tokens) {
  const values = tokens.map((t) => t.logprob);
  const mean = values.reduce((a, b) => a + b, 0) / values.length;
  const lines = [`${title}: ${values.length} tokens, mean ${fixed(mean)}, lowest ${fixed(Math.min(...values))}`];
  for (const { id, text, logprob, rank, top } of tokens) {
    const shown = text === undefined ? '' : JSON.stringify(text);
    const alternatives = top.map((t) => `${t.tokenId} ${fixed(t.logprob)}`).join(', ');
    lines.push(
      `  ${String(id).padStart(6)} ${shown.padEnd(14)} ${fixed(logprob).padStart(8)}  rank ${rank}` +
        (alternatives && `  top: ${alternatives}`),
    );
  }
  process.stderr.write(`${lines.join('\n')}\n`);
}

function printStats(final, label) {
  const { usage, timings } = final;
  const ms = (x) => `${x.toFixed(1)} ms`;
  const stopped = final.stopSequence ? ` (stop sequence ${JSON.stringify(final.stopSequence)})` : '';
  process.stderr.write(
    `${label}finish_reason: ${finishReasonName(final.finishReason)}${stopped}  request_id: ${final.requestId}  seed: ${final.seed}\n` +
      `${label}usage: ${usage.promptTokens} prompt tokens (${usage.cachedTokens} from the cache, ` +
      `${usage.truncatedTokens} cut), ${usage.generatedTokens} generated tokens\n` +
      `${label}timings: queue ${ms(timings.queueMs)}, first token ${ms(timings.timeToFirstTokenMs)}, ` +
      `total ${ms(timings.totalMs)}, ${timings.tokensPerSecond.toFixed(1)} tokens/s\n`,
  );
}

/** Streams one generation (n samples of it); resolves to the exit code. */
function run({ target, request, cancelAfter, stats }) {
  const client = new Client(target);
  const call = client.stream(request);
  const wanted = request.n || 1; // samples
  const many = wanted > 1; // then each sample is printed whole, once the stream ends
  const samples = []; // by index: { text, tokens and promptTokens (with logprobs), final }
  let generated = 0;
  let finished = 0;
  let cancelledAfter = false;
  let interrupted = false;

  const onSigint = () => {
    interrupted = true;
    call.cancel();
  };
  process.once('SIGINT', onSigint);

  call.on('resumed', (error) => process.stderr.write(`[resumed after ${describe(error)}]\n`));
  call.on('data', (message) => {
    if (message.queuePosition) process.stderr.write(`[queue position ${message.queuePosition}]\n`);
    const sample = (samples[message.index] ??= { text: '', tokens: [], promptTokens: [], toolCalls: [], final: null });
    sample.toolCalls.push(...message.toolCalls);
    const shown = request.skipDetokenize ? message.tokenIds.map((id) => `${id} `).join('') : message.text;
    if (many) sample.text += shown;
    else process.stdout.write(shown);
    message.logprobs.forEach((logprob, i) => {
      const text = message.tokenIds.length === 1 ? message.text : undefined; // one token's text, if known
      sample.tokens.push({ id: message.tokenIds[i], text, ...logprob });
    });
    message.promptLogprobs.forEach((logprob, i) => {
      sample.promptTokens.push({ id: message.promptTokenIds[i + 1], ...logprob }); // the first has none
    });
    generated += message.tokenIds.length;
    if (message.finishReason !== 'FINISH_REASON_UNSPECIFIED') {
      sample.final = message;
      finished += 1;
    }
    if (cancelAfter !== undefined && generated >= cancelAfter && finished < wanted && !cancelledAfter) {
      cancelledAfter = true;
      call.cancel();
    }
  });

  const report = () => {
    if (!many && samples.length) process.stdout.write('\n'); // after the text streamed so far
    samples.forEach(({ text, tokens, promptTokens, toolCalls, final }, index) => {
      const label = many ? `[sample ${index}] ` : '';
      if (many) process.stdout.write(`--- sample ${index} ---\n${text}\n`);
      for (const { id, name, arguments: args } of toolCalls) {
        process.stdout.write(`${JSON.stringify({ id, name, arguments: args })}\n`);
      }
      if (promptTokens.length) printLogprobs(`${label}prompt logprobs`, promptTokens);
      if (tokens.length) printLogprobs(`${label}logprobs`, tokens);
      if (stats && final) printStats(final, label);
    });
  };

  return new Promise((resolve) => {
    let settled = false; // a failed call emits 'error', then 'end': it is reported once
    const finish = (code, note) => {
      if (settled) return;
      settled = true;
      report();
      if (note) process.stderr.write(`${note}\n`);
      process.removeListener('SIGINT', onSigint);
      client.close(); // lets the process exit once the cancellation has gone out
      resolve(code);
    };
    call.on('end', () => finish(0));
    call.on('error', (error) => {
      if (isCancelled(error) && interrupted) finish(EXIT_INTERRUPTED, '[cancelled]');
      else if (isCancelled(error) && cancelledAfter) finish(0, `[cancelled after ${generated} tokens]`);
      else finish(EXIT_FAILED, `${PROG}: ${fromServiceError(error).message}`); // 'braid-node: invalid argument: ...'
    });
  });
}

if (require.main === module) {
  run(parse(process.argv.slice(2))).then((code) => {
    process.exitCode = code;
  });
}

module.exports = { CONSTRAINT_FLAGS, FLAGS, TOOL_FLAGS, parse, run, usage };

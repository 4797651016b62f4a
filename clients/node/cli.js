#!/usr/bin/env node
'use strict';
/**
 * braid-node: stream a generation from a braid server to the terminal.
 *
 *   node cli.js [--target host:port] [--max-tokens N] [--cancel-after N] "prompt"
 *
 * Tokens are printed as they arrive. Ctrl-C (SIGINT) cancels the stream on the server and exits
 * 130; --cancel-after N cancels it after N generated tokens and exits 0, as a completed stream does.
 */

const { parseArgs } = require('node:util');
const { Client, isCancelled } = require('./index.js');

const EXIT_USAGE = 2;
const EXIT_INTERRUPTED = 130; // the shell's code for a process ended by SIGINT

const USAGE = `usage: node cli.js [options] "prompt"

  --target HOST:PORT   the braid server (env BRAID_TARGET; default localhost:50051)
  --max-tokens N       max_new_tokens (default: the server's)
  --cancel-after N     cancel the stream after N generated tokens (exit 0)
  --temperature T      0 is greedy (default)
  --seed S             sampling seed
  --ignore-eos         keep generating past end-of-sequence (up to --max-tokens)
  --chat               send the prompt as one user message of a chat
  --stats              print finish reason, usage and timings to stderr
  -h, --help           this help

Ctrl-C cancels the generation on the server and exits 130.`;

const OPTIONS = {
  target: { type: 'string', default: process.env.BRAID_TARGET || 'localhost:50051' },
  'max-tokens': { type: 'string' },
  'cancel-after': { type: 'string' },
  temperature: { type: 'string' },
  seed: { type: 'string' },
  chat: { type: 'boolean', default: false },
  'ignore-eos': { type: 'boolean', default: false },
  stats: { type: 'boolean', default: false },
  help: { type: 'boolean', short: 'h', default: false },
};

function usageError(message) {
  process.stderr.write(`${message}\n\n${USAGE}\n`);
  process.exit(EXIT_USAGE);
}

function digits(name, value) {
  if (value !== undefined && !/^\d+$/.test(value)) {
    usageError(`--${name} must be a non-negative integer, not ${JSON.stringify(value)}`);
  }
  return value;
}

function nonNegativeInt(name, value) {
  return value === undefined ? undefined : Number(digits(name, value));
}

function parse(argv) {
  let parsed;
  try {
    parsed = parseArgs({ args: argv, options: OPTIONS, allowPositionals: true });
  } catch (error) {
    usageError(error.message);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (positionals.length !== 1) usageError('one prompt is needed (quote it)');
  const temperature = values.temperature === undefined ? undefined : Number(values.temperature);
  if (Number.isNaN(temperature)) usageError('--temperature must be a number');
  return {
    target: values.target,
    prompt: positionals[0],
    chat: values.chat,
    ignoreEos: values['ignore-eos'],
    stats: values.stats,
    maxTokens: nonNegativeInt('max-tokens', values['max-tokens']),
    cancelAfter: nonNegativeInt('cancel-after', values['cancel-after']),
    temperature,
    seed: digits('seed', values.seed), // a uint64: kept as a string, exact
  };
}

function buildRequest(args) {
  const request = args.chat ? { messages: [{ role: 'user', content: args.prompt }] } : { prompt: args.prompt };
  if (args.maxTokens !== undefined) request.maxNewTokens = args.maxTokens;
  if (args.temperature !== undefined) request.temperature = args.temperature;
  if (args.seed !== undefined) request.seed = args.seed;
  if (args.ignoreEos) request.ignoreEos = true;
  return request;
}

function printStats(final) {
  const { usage, timings } = final;
  process.stderr.write(
    `finish_reason: ${final.finishReason}  request_id: ${final.requestId}  seed: ${final.seed}\n` +
      `usage: ${usage.promptTokens} prompt tokens, ${usage.generatedTokens} generated tokens\n` +
      `timings: first token ${timings.timeToFirstTokenMs.toFixed(1)} ms, total ${timings.totalMs.toFixed(1)} ms, ` +
      `${timings.tokensPerSecond.toFixed(1)} tokens/s\n`,
  );
}

/** Streams one generation; resolves to the exit code. */
function run(args) {
  const client = new Client(args.target);
  const call = client.stream(buildRequest(args));
  let tokens = 0;
  let cancelledAfter = false;
  let interrupted = false;
  let final = null;

  const onSigint = () => {
    interrupted = true;
    call.cancel();
  };
  process.once('SIGINT', onSigint);

  call.on('data', (message) => {
    process.stdout.write(message.text);
    tokens += message.tokenIds.length;
    if (message.finishReason !== 'FINISH_REASON_UNSPECIFIED') final = message;
    if (args.cancelAfter !== undefined && tokens >= args.cancelAfter && !final && !cancelledAfter) {
      cancelledAfter = true;
      call.cancel();
    }
  });

  return new Promise((resolve) => {
    const finish = (code) => {
      process.removeListener('SIGINT', onSigint);
      client.close(); // lets the process exit once the cancellation has gone out
      resolve(code);
    };
    call.on('end', () => {
      process.stdout.write('\n');
      if (args.stats && final) printStats(final);
      finish(0);
    });
    call.on('error', (error) => {
      process.stdout.write('\n');
      if (isCancelled(error) && interrupted) {
        process.stderr.write('[cancelled]\n');
        finish(EXIT_INTERRUPTED);
      } else if (isCancelled(error) && cancelledAfter) {
        process.stderr.write(`[cancelled after ${tokens} tokens]\n`);
        finish(0);
      } else {
        process.stderr.write(`error: ${error.code} ${error.details || error.message}\n`);
        finish(1);
      }
    });
  });
}

if (require.main === module) {
  run(parse(process.argv.slice(2))).then((code) => {
    process.exitCode = code;
  });
}

module.exports = { parse, buildRequest, run };

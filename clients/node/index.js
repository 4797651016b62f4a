'use strict';
/**
 * braid's Node.js client: stream LLM text generation from a braid server over gRPC.
 *
 *   const { Client } = require('@braid/client');
 *   const client = new Client('localhost:50051');
 *   const call = client.stream({ prompt: 'Once upon a time', maxNewTokens: 32 });
 *   for await (const message of call) process.stdout.write(message.text);
 *   client.close();
 *
 * The contract, protos/braid/v1/generate.proto, is loaded at run time with
 * @grpc/proto-loader: there is no generated code to keep in step with it. The package
 * ships its own copy (`npm pack` copies it in); in the repository it is read from the
 * root's protos/.
 * Field names are camelCase (maxNewTokens, finishReason, tokenIds), enums are
 * their names ('FINISH_REASON_EOS'), and 64-bit integers are decimal strings. A failed call
 * fails with a BraidError by its status (errors.js: BadRequestError with the field at fault,
 * OverloadedError with retryAfter, ...).
 * jsonSchema(), jsonObject(), regex(), choice() and grammar() make a request's
 * constraint: { prompt, constraint: choice(['yes', 'no']) }.
 *
 * Several replicas: new Client(['10.0.0.1:50051', '10.0.0.2:50051']) or
 * new Client('dns:///braid.default.svc:50051') sends each call to the next ready one (round
 * robin), retries a call refused before it began, and resumes a stream that broke mid-way
 * (generation.js).
 */

const fs = require('node:fs');
const net = require('node:net');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { Generation, finishReasonName } = require('./generation.js');
const { ROUTE_KEY_HEADER, routeKey } = require('./routing.js');
const errors = require('./errors.js');

const { fromServiceError } = errors;

const PROTO_FILE = 'braid/v1/generate.proto';
const PROTO_DIR = [path.join(__dirname, 'protos'), path.resolve(__dirname, '..', '..', 'protos')].find((dir) =>
  fs.existsSync(path.join(dir, PROTO_FILE)),
);
const HEALTH_STATUS = ['UNKNOWN', 'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN'];

// gRPC's own load balancing and retries, through the channel's service config (as braid-client's
// SERVICE_CONFIG): each call (not each connection) goes to the next ready address (round_robin),
// and a call that fails with UNAVAILABLE, or RESOURCE_EXHAUSTED (after the server's
// grpc-retry-pushback-ms), before its response headers is tried again; grpc-js commits a call at
// its headers, so nothing is duplicated. A stream that breaks later is resumed by Generation.
const SERVICE_CONFIG = {
  loadBalancingConfig: [{ round_robin: {} }],
  methodConfig: [{
    name: [{ service: 'braid.v1.Generate' }],
    retryPolicy: {
      maxAttempts: 4, initialBackoff: '0.1s', maxBackoff: '2s', backoffMultiplier: 2,
      retryableStatusCodes: ['UNAVAILABLE', 'RESOURCE_EXHAUSTED'],
    },
  }],
};
const DEFAULT_CHANNEL_OPTIONS = {
  'grpc.service_config': JSON.stringify(SERVICE_CONFIG),
  'grpc.enable_retries': 1,
  'grpc.keepalive_time_ms': 30000, // notice a dead server or proxy within a minute on an idle stream
  'grpc.keepalive_timeout_ms': 10000,
};

/** 'ipv4' for '10.0.0.1:50051', 'ipv6' for '[::1]:50051', null for anything else ('host:50051'). */
function addressScheme(address) {
  const [, v6, v4] = /^(?:\[([^\]]+)\]|([^:[\]]+)):\d+$/.exec(address) ?? [];
  if (v6) return net.isIPv6(v6) ? 'ipv6' : null;
  return v4 && net.isIPv4(v4) ? 'ipv4' : null;
}

/**
 * One gRPC target for one address or several: 'host:port', 'dns:///name:port' (every address the
 * name resolves to), or a list of 'ip:port' ('localhost:port' too), joined as 'ipv4:a:p,b:p' (or
 * 'ipv6:[a]:p,[b]:p'). Throws a RangeError for a list that is empty, or not all IPv4 or all IPv6.
 */
function channelTarget(target) {
  if (typeof target === 'string') return target;
  const addresses = [...target].map((a) => (a.startsWith('localhost:') ? `127.0.0.1:${a.slice('localhost:'.length)}` : a));
  if (addresses.length === 0) throw new RangeError('no address to connect to');
  if (addresses.length === 1) return addresses[0];
  const scheme = addressScheme(addresses[0]);
  const odd = addresses.find((address) => !scheme || addressScheme(address) !== scheme);
  if (odd) {
    throw new RangeError(`${JSON.stringify(odd)} among several addresses: give each as ip:port, ` +
      "all IPv4 or all IPv6 ([::1]:50051), or give one 'dns:///name:port'");
  }
  return `${scheme}:${addresses.join(',')}`;
}

const LOADER_OPTIONS = {
  keepCase: false, // maxNewTokens, not max_new_tokens
  longs: String, // uint64 seed and counters: exact, as decimal strings
  enums: String, // 'FINISH_REASON_MAX_TOKENS', not 1
  defaults: true, // every field present, at its default where unset
  oneofs: true,
};

/** Loads braid.v1 from the .proto: { Generate, GenerateRequest, ... }. */
function loadBraid(protoDir = PROTO_DIR) {
  const definition = protoLoader.loadSync(PROTO_FILE, { ...LOADER_OPTIONS, includeDirs: [protoDir] });
  return grpc.loadPackageDefinition(definition).braid.v1;
}

let bundled; // loadBraid() of PROTO_DIR, loaded on first use by the helpers below

/** An enum's values but UNSPECIFIED by their short names: { lark: 'GRAMMAR_SYNTAX_LARK', gbnf: ... }. */
function enumValues(braid, typeName) {
  const [unspecified, ...names] = braid[typeName].type.value.map((v) => v.name);
  const prefix = unspecified.slice(0, -'UNSPECIFIED'.length);
  return Object.fromEntries(names.map((name) => [name.slice(prefix.length).toLowerCase(), name]));
}

// A request's constraint, one of these (generate.proto's Constraint): { prompt, constraint: regex('[0-9]+') }.

/** A constraint: the output is one JSON value valid against this JSON Schema (an object or its text). */
function jsonSchema(schema) {
  return { jsonSchema: typeof schema === 'string' ? schema : JSON.stringify(schema) };
}

/** A constraint: the output is any one JSON object. */
function jsonObject() {
  return { jsonObject: true };
}

/** A constraint: the whole output matches this regular expression. */
function regex(pattern) {
  return { regex: pattern };
}

/** A constraint: the output is exactly one of these strings. */
function choice(choices) {
  return { choice: { choices: [...choices] } };
}

/** A constraint: the output is a sentence of this grammar, in syntax 'lark' or 'gbnf' (or its enum name). */
function grammar(text, syntax = 'lark') {
  const syntaxes = enumValues((bundled ??= loadBraid()), 'GrammarSyntax');
  const name = syntaxes[syntax] ?? Object.values(syntaxes).find((value) => value === syntax);
  if (!name) throw new RangeError(`expected ${Object.keys(syntaxes).join('|')}, not ${JSON.stringify(syntax)}`);
  return { grammar: { syntax: name, text } };
}

// grpc.health.v1 without its .proto: HealthCheckRequest is {1: string service} and
// HealthCheckResponse is {1: enum status}, so both are hand-encoded here.
function encodeHealthRequest(service) {
  const bytes = Buffer.from(service, 'utf8');
  if (bytes.length === 0) return Buffer.alloc(0);
  if (bytes.length > 127) throw new RangeError('service name too long');
  return Buffer.concat([Buffer.from([0x0a, bytes.length]), bytes]);
}

function decodeHealthResponse(buffer) {
  // One varint field 1, or nothing (status 0, UNKNOWN).
  const status = buffer.length >= 2 && buffer[0] === 0x08 ? buffer[1] : 0;
  return HEALTH_STATUS[status] ?? String(status);
}

/** True for the error a stream ends with after call.cancel() (or a closed channel). */
function isCancelled(error) {
  return Boolean(error) && error.code === grpc.status.CANCELLED;
}

/** An error's gRPC status by name, and its details: 'INVALID_ARGUMENT: top_logprobs: 50 is more than 20'. */
function describe(error) {
  return `${grpc.status[error.code] ?? 'UNKNOWN'}: ${error.details || error.message}`;
}

class Client {
  /**
   * Opens a channel to a braid server, or to several replicas.
   *
   * @param {string | string[]} target host:port of the server; 'dns:///name:port' to balance over
   *   every address the name resolves to; or several 'ip:port' addresses to balance over (see
   *   channelTarget). Calls go round robin over the ready ones, and are retried on UNAVAILABLE
   *   before they begin.
   * @param {object} [options]
   * @param {grpc.ChannelCredentials} [options.credentials] default: plaintext.
   * @param {string} [options.apiKey] sent with every call as `authorization: Bearer <apiKey>`.
   * @param {object} [options.channelOptions] grpc-js channel options, added to (and overriding)
   *   DEFAULT_CHANNEL_OPTIONS: the service config, keepalive.
   * @param {boolean} [options.resume] default true: a stream of one sample that breaks mid-way
   *   (its server died, its connection dropped) is resumed from the tokens it delivered, on
   *   whichever server the channel reaches, so the caller reads one unbroken stream.
   * @param {boolean} [options.routeKeys] default true: every Stream call carries a
   *   `braid-route-key` header (routing.js), so a proxy that hashes it sends calls that start
   *   alike to the replica whose prefix cache holds their start.
   */
  constructor(target = 'localhost:50051', { credentials, apiKey, channelOptions, resume = true, routeKeys = true } = {}) {
    const braid = loadBraid();
    this.target = channelTarget(target);
    this.resume = resume;
    this.routeKeys = routeKeys;
    const options = { ...DEFAULT_CHANNEL_OPTIONS, ...channelOptions };
    this.stub = new braid.Generate(this.target, credentials ?? grpc.credentials.createInsecure(), options);
    this.apiKey = apiKey;
  }

  metadata() {
    const metadata = new grpc.Metadata();
    if (this.apiKey) metadata.set('authorization', `Bearer ${this.apiKey}`);
    return metadata;
  }

  static callOptions(timeoutMs) {
    return timeoutMs === undefined ? {} : { deadline: Date.now() + timeoutMs };
  }

  /**
   * Starts a generation and returns its Generation: a readable stream of GenerateResponse messages.
   *
   * Read it with `for await (const message of call)` or with events ('data', 'end', 'error',
   * 'metadata', 'status', 'resumed'). The last message carries finishReason, usage, requestId, seed
   * and timings; with n > 1 every message carries its sample's index and each sample ends with its
   * own last message. `call.cancel()` cancels the session on the server; the call then ends
   * with an error whose code is grpc.status.CANCELLED (see isCancelled). A stream of one sample
   * that breaks mid-way is resumed (the client's `resume`): `call.resumes` counts the times.
   *
   * @param {object} request GenerateRequest fields: prompt, messages ([{role, content}]) or
   *   promptTokenIds (a prompt already tokenized; skipDetokenize then, or any time, sends ids only),
   *   maxNewTokens, temperature, topP, topK, minP, repetitionPenalty, presencePenalty,
   *   frequencyPenalty, logitBias ({tokenId: bias}), seed, stop, includeStopSequence,
   *   stopTokenIds, ignoreEos, requestId, minNewTokens, priority, timeoutMs, cacheSalt,
   *   logprobs, topLogprobs (messages then carry logprobs, one per token id),
   *   truncateInputTokens, badWords, reportQueue (messages then carry queuePosition while
   *   waiting), n, constraint (jsonSchema(), jsonObject(), regex(), choice() or grammar(); a
   *   completed match ends with FINISH_REASON_CONSTRAINT), tools ([{name, description,
   *   parameters}], parameters a JSON Schema as JSON text) and toolChoice ({mode:
   *   'TOOL_CHOICE_MODE_REQUIRED'} or {function: name}; left out: auto): messages then carry
   *   toolCalls ([{id, name, arguments}], each call whole and once), and a chat's messages may
   *   carry an assistant's toolCalls and a tool result's toolCallId. A stream with tools is not
   *   resumed (the server reads calls from the whole output).
   * @param {object} [options]
   * @param {number} [options.timeoutMs] deadline of the call (of a resumed call too: one deadline).
   * @param {string} [options.routeKey] the `braid-route-key` header, e.g. a conversation id;
   *   default: routeKey(request), the same for calls that start alike (none if routeKeys is false).
   * @returns {Generation}
   */
  stream(request, { timeoutMs, routeKey: key } = {}) {
    const options = Client.callOptions(timeoutMs);
    const metadata = this.metadata();
    key = key ?? (this.routeKeys ? routeKey(request) : undefined);
    if (key) metadata.set(ROUTE_KEY_HEADER, key);
    // a resumed call carries the same key: it goes where the proxy now sends that key
    const resume = this.resume && !request.tools?.length; // the server refuses resumeTokenIds with tools
    return new Generation((req) => this.stub.Stream(req, metadata.clone(), options), request, { resume });
  }

  /**
   * Runs a generation to its end: resolves to { text, tokenIds, finishReason, final, toolCalls },
   * finishReason the name of final's ('MAX_TOKENS', 'EOS', ...), toolCalls every message's.
   */
  async generate(request, options) {
    let text = '';
    const tokenIds = [];
    const toolCalls = [];
    let final = null;
    for await (const message of this.stream(request, options)) {
      text += message.text;
      tokenIds.push(...message.tokenIds);
      toolCalls.push(...(message.toolCalls ?? []));
      if (message.finishReason !== 'FINISH_REASON_UNSPECIFIED') final = message;
    }
    return { text, tokenIds, finishReason: finishReasonName(final?.finishReason), final, toolCalls };
  }

  unary(method, request, timeoutMs) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata(), Client.callOptions(timeoutMs), (error, response) =>
        error ? reject(fromServiceError(error)) : resolve(response),
      );
    });
  }

  /**
   * Resolves to a TokenizeResponse ({ tokenIds, pieces, offsets }) for { text } or { messages };
   * with { text, returnOffsets: true }, offsets holds each token's { start, end } characters. A
   * chat's tools ([{name, description, parameters}], as stream's) and enableThinking are rendered
   * as a generation's: its tokenIds are that generation's prompt.
   */
  tokenize(request, { timeoutMs } = {}) {
    return this.unary('Tokenize', request, timeoutMs);
  }

  /**
   * Resolves to a DetokenizeResponse ({ text, heldBackTokens }) for these token ids: the text ends
   * on a whole character, and heldBackTokens of the last ids end in part of one.
   */
  detokenize(tokenIds, { timeoutMs } = {}) {
    return this.unary('Detokenize', { tokenIds: [...tokenIds] }, timeoutMs);
  }

  /**
   * Resolves to an EmbedResponse ({ embeddings: [{ values, promptTokens, truncatedTokens }],
   * promptTokens, requestId, pooling }) for `inputs`: a text, an array of texts, or an array of
   * token id arrays, one embedding per input in order. Options: pooling ('last' or 'mean'; unset:
   * the model's), normalize (unset: unit length), dimensions (keep the leading ones),
   * truncateInputTokens (keep each input's last tokens).
   */
  embed(inputs, { pooling, normalize, dimensions = 0, truncateInputTokens = 0, timeoutMs } = {}) {
    const items = typeof inputs === 'string' ? [inputs] : [...inputs];
    const texts = items.every((item) => typeof item === 'string');
    const request = {
      texts: texts ? items : [],
      tokenIds: texts ? [] : items.map((ids) => ({ ids: [...ids] })),
      pooling: pooling ? `POOLING_${pooling.toUpperCase()}` : 'POOLING_UNSPECIFIED',
      dimensions,
      truncateInputTokens,
    };
    if (normalize !== undefined) request.normalize = normalize;
    return this.unary('Embed', request, timeoutMs);
  }

  /**
   * The prefix cache's events (SubscribeKvEvents) after sequence `afterSequence`, as they come,
   * until the server stops: an async iterable of KvEvent ({ sequence, stored: { hash, parentHash,
   * numTokens, cacheSalt, adapterKey }, evicted: { hash }, resync: { oldestSequence } }, one of
   * the three set, the others null; sequences are decimal strings, hashes Buffers). An event with
   * resync says the events asked for are gone: drop what you know of this server. Ending the loop
   * (break, return) cancels the call; its errors are BraidErrors, as every call's.
   */
  async *kvEvents(afterSequence = 0, { timeoutMs } = {}) {
    const call = this.stub.SubscribeKvEvents(
      { afterSequence: String(afterSequence) }, this.metadata(), Client.callOptions(timeoutMs),
    );
    try {
      for await (const event of call) yield event;
    } catch (error) {
      throw fromServiceError(error);
    } finally {
      call.cancel();
    }
  }

  /** Resolves to a ModelInfoResponse. */
  modelInfo({ timeoutMs } = {}) {
    return this.unary('ModelInfo', {}, timeoutMs);
  }

  /** Resolves to a ServerStatusResponse: sessionsActive, sessionsFinished.cancelled, ... */
  serverStatus({ timeoutMs } = {}) {
    return this.unary('ServerStatus', {}, timeoutMs);
  }

  /**
   * Cancels the generations started with these request ids (by calls with this client's
   * credentials); resolves to the ids that were running or queued. Each aborted stream still ends
   * normally, its last message's finishReason FINISH_REASON_CANCELLED.
   */
  async abort(requestIds, { timeoutMs } = {}) {
    const { aborted } = await this.unary('Abort', { requestIds: [...requestIds] }, timeoutMs);
    return aborted;
  }

  /** Resolves to the grpc.health.v1 status of `service` ('' is the whole server): 'SERVING', ... */
  health(service = '', { timeoutMs } = {}) {
    return new Promise((resolve, reject) => {
      this.stub.makeUnaryRequest(
        '/grpc.health.v1.Health/Check',
        encodeHealthRequest,
        decodeHealthResponse,
        service,
        this.metadata(),
        Client.callOptions(timeoutMs),
        (error, status) => (error ? reject(fromServiceError(error)) : resolve(status)),
      );
    });
  }

  /** Closes the channel; a stream still running on it is cancelled. */
  close() {
    this.stub.close();
  }
}

module.exports = {
  Client, Generation, describe, isCancelled, finishReasonName, loadBraid, enumValues, grpc, PROTO_DIR,
  channelTarget, SERVICE_CONFIG, DEFAULT_CHANNEL_OPTIONS, routeKey, ROUTE_KEY_HEADER,
  jsonSchema, jsonObject, regex, choice, grammar,
  ...errors, // BraidError, BadRequestError, OverloadedError, ..., fromServiceError
};

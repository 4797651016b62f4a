'use strict';
/**
 * The errors a failed braid call rejects or fails with, one class per kind of failure, as the
 * Python client's (braid.client.errors).
 *
 * Every call of the Client, and a Generation mid-stream, fails with a BraidError: a subclass by the
 * call's gRPC status (BadRequestError for INVALID_ARGUMENT, OverloadedError for RESOURCE_EXHAUSTED,
 * ...) with what grpc-js's own error had (code, details, metadata) and the google.rpc details braid
 * attaches in its grpc-status-details-bin trailer: the field at fault of a bad request, the delay
 * to wait when the server is full. Those are decoded here by hand (google.rpc.Status, BadRequest and
 * RetryInfo are a few fields each), so the client needs no protobuf runtime of its own.
 */

const grpc = require('@grpc/grpc-js');

const DETAILS_KEY = 'grpc-status-details-bin';
const PUSHBACK_KEY = 'grpc-retry-pushback-ms';
const BAD_REQUEST = 'google.rpc.BadRequest';
const RETRY_INFO = 'google.rpc.RetryInfo';

/** The fields of one protobuf message: [number, value], a BigInt for a varint, a Buffer for bytes. */
function* wireFields(buffer) {
  let at = 0;
  const varint = () => {
    let value = 0n;
    for (let shift = 0n; ; shift += 7n) {
      if (at >= buffer.length) throw new RangeError('truncated varint');
      const byte = buffer[at++];
      value |= BigInt(byte & 0x7f) << shift;
      if (byte < 0x80) return value;
    }
  };
  while (at < buffer.length) {
    const key = Number(varint());
    const [number, wireType] = [key >>> 3, key & 7];
    if (wireType === 0) yield [number, varint()];
    else if (wireType === 2) {
      const length = Number(varint()); // read before `at`, which it moves
      const end = at + length;
      if (end > buffer.length) throw new RangeError('truncated field');
      yield [number, buffer.subarray(at, end)];
      at = end;
    } else if (wireType === 1 || wireType === 5) at += wireType === 1 ? 8 : 4; // fixed64, fixed32: unused here
    else throw new RangeError(`wire type ${wireType}`);
  }
}

/** One message's fields by number: { 1: [values], 2: [values], ... }. */
function decodeFields(buffer) {
  const fields = {};
  for (const [number, value] of wireFields(buffer)) (fields[number] ??= []).push(value);
  return fields;
}

const text = (bytes) => (bytes ? bytes.toString('utf8') : '');

/**
 * google.rpc.Status from its bytes: { code, message, details: [{ type, value }] } (type: the Any's
 * type name, e.g. 'google.rpc.BadRequest'; value: its bytes).
 */
function decodeStatus(buffer) {
  const fields = decodeFields(buffer);
  const details = (fields[3] ?? []).map((any) => {
    const { 1: [typeUrl] = [], 2: [value] = [] } = decodeFields(any);
    return { type: text(typeUrl).split('/').pop(), value: value ?? Buffer.alloc(0) };
  });
  return { code: Number(BigInt.asIntN(32, fields[1]?.[0] ?? 0n)), message: text(fields[2]?.[0]), details };
}

/** google.rpc.BadRequest's field violations: [{ field, description }]. */
function decodeBadRequest(buffer) {
  return (decodeFields(buffer)[1] ?? []).map((violation) => {
    const { 1: [field] = [], 2: [description] = [] } = decodeFields(violation);
    return { field: text(field), description: text(description) };
  });
}

/** google.rpc.RetryInfo's retry_delay in seconds, or null without one. */
function decodeRetryDelay(buffer) {
  const [delay] = decodeFields(buffer)[1] ?? [];
  if (!delay) return null;
  const { 1: [seconds = 0n] = [], 2: [nanos = 0n] = [] } = decodeFields(delay);
  return Number(BigInt.asIntN(64, seconds)) + Number(BigInt.asIntN(32, nanos)) / 1e9;
}

/**
 * The google.rpc.Status in an error's grpc-status-details-bin trailer, or null: none there, bytes
 * that do not parse, or a status that contradicts the call's own code.
 */
function richStatus(code, metadata) {
  const [bytes] = metadata?.get?.(DETAILS_KEY) ?? [];
  if (!Buffer.isBuffer(bytes)) return null;
  try {
    const status = decodeStatus(bytes);
    return status.code === code ? status : null;
  } catch {
    return null;
  }
}

/** A status code's name in words: 'invalid argument' for INVALID_ARGUMENT. */
function inWords(code) {
  return (grpc.status[code] ?? 'UNKNOWN').toLowerCase().replaceAll('_', ' ');
}

/**
 * A failed braid call: `code` (grpc.status.INVALID_ARGUMENT, ...), `codeName` ('INVALID_ARGUMENT'),
 * `details` (the status message), `metadata` (the trailers, a grpc.Metadata), and `status`, the
 * google.rpc.Status the server attached ({ code, message, details }; null without one). Its
 * `message` is one line: 'invalid argument: temperature: -1 is outside [0.0, 100.0]'; `cause` is
 * grpc-js's own error.
 */
class BraidError extends Error {
  constructor({ code = grpc.status.UNKNOWN, details = '', metadata = new grpc.Metadata() } = {}, options = {}) {
    super('', options);
    this.code = code;
    this.codeName = grpc.status[code] ?? 'UNKNOWN';
    this.details = details;
    this.metadata = metadata;
    this.status = richStatus(code, metadata);
    this.message = `${inWords(code)}: ${this.reason()}`;
  }

  get name() {
    return this.constructor.name;
  }

  /** The details on one line (and what a subclass adds). */
  reason() {
    return (this.details ?? '').split('\n').join(' ');
  }

  /** The bytes of each detail of this type ('google.rpc.BadRequest') that the server attached. */
  detailsOf(type) {
    return (this.status?.details ?? []).filter((detail) => detail.type === type).map((detail) => detail.value);
  }
}

/**
 * INVALID_ARGUMENT: a request field is wrong. `field` names it ('temperature', 'constraint.regex',
 * ...; null if the server named none), `description` says what is wrong with it (the details where
 * no field is named), and `violations` has every { field, description } of the server's
 * google.rpc.BadRequest.
 */
class BadRequestError extends BraidError {
  constructor(error, options) {
    super(error, options);
    this.violations = this.detailsOf(BAD_REQUEST).flatMap(decodeBadRequest);
    this.field = this.violations[0]?.field ?? null;
    this.description = this.violations[0]?.description ?? this.details;
  }
}

/**
 * RESOURCE_EXHAUSTED: the server's queue is full. `retryAfter` is how many seconds it asks the caller
 * to wait before sending the call again (its google.rpc.RetryInfo, or grpc-retry-pushback-ms), or
 * null. The channel's retry policy has tried again already before the call fails with it.
 */
class OverloadedError extends BraidError {
  constructor(error, options) {
    super(error, options);
    const [delay] = this.detailsOf(RETRY_INFO).map(decodeRetryDelay).filter((seconds) => seconds !== null);
    const [pushback] = this.metadata?.get?.(PUSHBACK_KEY) ?? [];
    const pushbackMs = typeof pushback === 'string' && /^\d+$/.test(pushback) ? Number(pushback) : null;
    this.retryAfter = delay ?? (pushbackMs === null ? null : pushbackMs / 1000);
    if (this.retryAfter !== null) this.message += ` (retry after ${this.retryAfter} s)`;
  }
}

/** UNAVAILABLE: no server took the call, or its stream broke and could not be resumed. */
class UnavailableError extends BraidError {}

/** DEADLINE_EXCEEDED: the call's deadline ({ timeoutMs }) passed; its generation was stopped. */
class DeadlineExceededError extends BraidError {}

/** CANCELLED: the call was cancelled (call.cancel(), a closed client, or the server); see isCancelled. */
class CallCancelledError extends BraidError {}

/** NOT_FOUND: e.g. health() of a service the server does not have. */
class NotFoundError extends BraidError {}

/** PERMISSION_DENIED: the credentials may not make this call. */
class PermissionDeniedError extends BraidError {}

/** UNAUTHENTICATED: no API key, or a wrong one (new Client(target, { apiKey })). */
class UnauthenticatedError extends BraidError {}

/** INTERNAL: the server failed (its log says why); a proxy may also report a reset stream so. */
class InternalError extends BraidError {}

const ERRORS = {
  [grpc.status.INVALID_ARGUMENT]: BadRequestError,
  [grpc.status.RESOURCE_EXHAUSTED]: OverloadedError,
  [grpc.status.UNAVAILABLE]: UnavailableError,
  [grpc.status.DEADLINE_EXCEEDED]: DeadlineExceededError,
  [grpc.status.CANCELLED]: CallCancelledError,
  [grpc.status.NOT_FOUND]: NotFoundError,
  [grpc.status.PERMISSION_DENIED]: PermissionDeniedError,
  [grpc.status.UNAUTHENTICATED]: UnauthenticatedError,
  [grpc.status.INTERNAL]: InternalError,
}; // any other status (UNKNOWN, UNIMPLEMENTED, ...) is a plain BraidError

/** The BraidError of a grpc-js error ({ code, details, metadata }); a BraidError is returned as it is. */
function fromServiceError(error) {
  if (error instanceof BraidError) return error;
  const Kind = ERRORS[error?.code] ?? BraidError;
  const code = typeof error?.code === 'number' ? error.code : grpc.status.UNKNOWN;
  return new Kind({ code, details: error?.details ?? error?.message ?? String(error), metadata: error?.metadata },
    { cause: error });
}

module.exports = {
  BraidError, BadRequestError, OverloadedError, UnavailableError, DeadlineExceededError, CallCancelledError,
  NotFoundError, PermissionDeniedError, UnauthenticatedError, InternalError, fromServiceError,
};

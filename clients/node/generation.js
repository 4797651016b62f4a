'use strict';
/**
 * Generation: one Stream call as its caller sees it, a readable stream of GenerateResponse
 * messages that outlives the replica serving it.
 *
 * A stream of one sample that breaks after it began (its server died, its connection dropped:
 * UNAVAILABLE; INTERNAL with RST_STREAM, or UNKNOWN "No status information received", when a
 * proxy cut it or ended it with no status) is started again with the same
 * request, the token ids it delivered as resume_token_ids and the seed of its first response
 * headers (braid-seed); the server skips those tokens and goes on exactly as the broken stream
 * would have, so the caller reads one unbroken stream. A call that fails before it began is
 * gRPC's to retry (the channel's retry policy), not this.
 */

const { Readable } = require('node:stream');
const grpc = require('@grpc/grpc-js');
const { fromServiceError } = require('./errors.js');

const SEED_KEY = 'braid-seed';
const MAX_RESUMES = 3;
const FINISH_REASON_PREFIX = 'FINISH_REASON_';

/**
 * A finish reason's name, as both braid clients show it: the FinishReason value without its
 * prefix ('MAX_TOKENS' for 'FINISH_REASON_MAX_TOKENS'); null for none (UNSPECIFIED, or no message).
 */
function finishReasonName(finishReason) {
  if (finishReason === undefined || finishReason === null || finishReason === 'FINISH_REASON_UNSPECIFIED') return null;
  const name = String(finishReason);
  return name.startsWith(FINISH_REASON_PREFIX) ? name.slice(FINISH_REASON_PREFIX.length) : name;
}

/**
 * Whether a failed stream broke (its server or connection went away) rather than failed. A proxy
 * whose replica died or drained can reset the stream (grpc-js: INTERNAL "Received RST_STREAM ...",
 * also for an END_STREAM with no trailers) or end it with trailers but no grpc-status (UNKNOWN
 * "No status information received"; HAProxy did so in braid's rolling-restart test).
 */
function isBroken(error) {
  const details = error.details ?? '';
  const cut = (error.code === grpc.status.INTERNAL && details.includes('RST_STREAM')) ||
    (error.code === grpc.status.UNKNOWN && details.includes('No status information received'));
  return error.code === grpc.status.UNAVAILABLE || cut;
}

/** The request that resumes a broken stream of `request`, which delivered these token ids. */
function resumedRequest(request, deliveredTokenIds, seed) {
  return { ...request, seed, resumeTokenIds: [...(request.resumeTokenIds ?? []), ...deliveredTokenIds] };
}

class Generation extends Readable {
  #start; // request => a Stream call (grpc.ClientReadableStream)
  #request;
  #canResume;
  #call; // the call now streaming
  #isCallDone = false; // #call has ended, or failed
  #seed = null; // from the first response headers
  #tokenIds = []; // delivered so far (one sample)
  #samples; // the request's n
  #finals = new Set(); // the samples whose final message came
  #isCancelled = false;

  /**
   * Starts a Stream call of `request`; with `resume`, and one sample, a broken call is resumed.
   * Events: 'data' (a GenerateResponse), 'end', 'error', 'metadata' (the first call's response
   * headers), 'status' (the last call's), and 'resumed' (the error that broke the stream, once a
   * call resuming it has started).
   */
  constructor(start, request, { resume = true } = {}) {
    super({ objectMode: true });
    this.#start = start;
    this.#request = request;
    this.#canResume = resume && !(request.n > 1);
    this.#samples = request.n > 1 ? request.n : 1;
    this.resumes = 0; // times the stream was resumed
    this.final = null; // the message that ended it (with n > 1: the last sample's)
    this.#follow(start(request));
  }

  /** The name of the finish reason that ended the stream ('MAX_TOKENS', 'EOS', ...), or null before it. */
  get finishReason() {
    return finishReasonName(this.final?.finishReason);
  }

  #follow(call) {
    this.#call = call;
    this.#isCallDone = false;
    const isCurrent = () => call === this.#call;
    call.on('metadata', (metadata) => {
      if (this.resumes > 0 || !isCurrent()) return; // one stream: its first headers
      const [seed] = metadata.get(SEED_KEY);
      if (typeof seed === 'string' && /^\d+$/.test(seed)) this.#seed = seed;
      this.emit('metadata', metadata);
    });
    call.on('data', (message) => {
      if (!isCurrent() || this.destroyed) return;
      if (this.#canResume) this.#tokenIds.push(...message.tokenIds);
      if (message.finishReason !== 'FINISH_REASON_UNSPECIFIED') {
        this.final = message;
        this.#finals.add(message.index ?? 0);
      }
      if (!this.push(message)) call.pause(); // until _read() asks for more
    });
    call.on('end', () => {
      if (!isCurrent() || this.#isCallDone) return; // a failed call also ends; its error is handled
      this.#isCallDone = true;
      this.push(null);
    });
    call.on('error', (error) => {
      if (!isCurrent()) return;
      this.#isCallDone = true;
      if (this.#hasEnded(error)) {
        this.push(null);
        return;
      }
      if (!this.#isResumable(error)) {
        this.destroy(fromServiceError(error)); // a BraidError by its status (errors.js)
        return;
      }
      this.resumes += 1;
      this.#follow(this.#start(resumedRequest(this.#request, this.#tokenIds, this.#seed)));
      this.emit('resumed', fromServiceError(error));
    });
    call.on('status', (status) => {
      if (isCurrent()) this.emit('status', status);
    });
  }

  /**
   * Whether the stream broke after every sample's final message: a proxy whose replica exited just
   * then ends the stream with no status (the rolling-restart test saw so). The final messages say
   * how it ended, and every token came before them, so the stream has ended; only its OK status was
   * lost. (The Python client does the same.)
   */
  #hasEnded(error) {
    return this.#finals.size >= this.#samples && isBroken(error);
  }

  /** Whether this broken call can be resumed: not cancelled, begun (gRPC retries the rest), not ended. */
  #isResumable(error) {
    return this.#canResume && !this.#isCancelled && this.#seed !== null && this.final === null &&
      this.resumes < MAX_RESUMES && isBroken(error);
  }

  _read() {
    this.#call.resume();
  }

  _destroy(error, callback) {
    if (!this.#isCallDone) this.cancel(); // left early (a break out of for await): the session goes too
    callback(error);
  }

  /** Cancels the call, and so the session on the server; the stream then fails with CANCELLED
   * (a CallCancelledError; see isCancelled). */
  cancel() {
    this.#isCancelled = true;
    this.#call.cancel();
  }

  /** The address of the server now streaming. */
  getPeer() {
    return this.#call.getPeer();
  }
}

module.exports = { Generation, finishReasonName, isBroken, resumedRequest, MAX_RESUMES };

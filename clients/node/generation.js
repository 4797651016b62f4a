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
 * would have, so the caller reads one unbroken stream. A call refused before it began
 * (UNAVAILABLE) is gRPC's to retry (the channel's retry policy); one a proxy or a server's shutdown
 * cut before its headers, having delivered nothing, is sent again as it was. Each resume waits
 * first (RESUME_BACKOFF_MS, doubled each time), as the Python client's does.
 */

const { Readable } = require('node:stream');
const grpc = require('@grpc/grpc-js');
const { fromServiceError } = require('./errors.js');

const SEED_KEY = 'braid-seed';
const MAX_RESUMES = 3;
// Before the first resume; doubled before each further one. A proxy that balances by least
// connections sends a call straight back to a replica that has just drained its streams until its
// health check takes it out: a call resumed at once was cut there again (the Python client's reason).
const RESUME_BACKOFF_MS = 250;
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
 * Whether a proxy, the network or a server's shutdown cut the stream. A proxy whose replica died
 * or drained can reset the stream (grpc-js: INTERNAL "Received RST_STREAM ...", also for an
 * END_STREAM with no trailers) or end it with trailers but no grpc-status (UNKNOWN "No status
 * information received"; HAProxy did so in braid's rolling-restart test). A call that reached a
 * server as it shut down, before any handler took it, ends with gRPC's own CANCELLED "CANCELLED"
 * (grpc/grpc#41785: it should be UNAVAILABLE; HAProxy passes it on). braid's server never ends a
 * call with CANCELLED itself, and this client's own cancel() ("Cancelled on client") is told apart
 * first.
 */
function isCut(error) {
  const details = error.details ?? '';
  return (error.code === grpc.status.INTERNAL && details.includes('RST_STREAM')) ||
    (error.code === grpc.status.UNKNOWN && details.includes('No status information received')) ||
    (error.code === grpc.status.CANCELLED && details === 'CANCELLED');
}

/** Whether a failed stream broke (its server or connection went away) rather than failed. */
function isBroken(error) {
  return error.code === grpc.status.UNAVAILABLE || isCut(error);
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
  #hasHeaders = false; // the first response headers came
  #tokenIds = []; // delivered so far (one sample)
  #samples; // the request's n
  #finals = new Set(); // the samples whose final message came
  #isCancelled = false;
  #resumeTimer = null; // a resume waiting out its backoff
  #lastCall; // the last call started (#call is null while a resume waits)

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
    this.#lastCall = call;
    this.#isCallDone = false;
    const isCurrent = () => call === this.#call;
    call.on('metadata', (metadata) => {
      // one stream: its first headers (a call sent again after a cut before its headers gives them)
      if (this.#hasHeaders || !isCurrent()) return;
      this.#hasHeaders = true;
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
      // begun: resumed from its tokens, with its seed; cut before its headers: sent again as it was
      const request = this.#seed === null ? this.#request : resumedRequest(this.#request, this.#tokenIds, this.#seed);
      this.#call = null; // the broken call's own status is not the stream's
      this.#resumeTimer = setTimeout(() => {
        this.#resumeTimer = null;
        this.resumes += 1;
        this.#follow(this.#start(request));
        this.emit('resumed', fromServiceError(error));
      }, RESUME_BACKOFF_MS * 2 ** this.resumes);
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

  /**
   * Whether this broken call can be resumed: not cancelled, not ended, begun (gRPC's retry policy
   * sends a refused one again), or cut before its headers with nothing delivered.
   */
  #isResumable(error) {
    return this.#canResume && !this.#isCancelled && this.final === null && this.resumes < MAX_RESUMES &&
      isBroken(error) && (this.#seed !== null || (this.#tokenIds.length === 0 && isCut(error)));
  }

  _read() {
    this.#call?.resume(); // none between a broken call and the one resuming it
  }

  _destroy(error, callback) {
    if (!this.#isCallDone || this.#resumeTimer !== null) this.cancel(); // left early (a break out of for await): the session goes too
    callback(error);
  }

  /** Cancels the call, and so the session on the server; the stream then fails with CANCELLED
   * (a CallCancelledError; see isCancelled). */
  cancel() {
    this.#isCancelled = true;
    if (this.#resumeTimer !== null) { // between two calls: none to cancel, so fail as a cancelled call does
      clearTimeout(this.#resumeTimer);
      this.#resumeTimer = null;
      if (!this.destroyed) this.destroy(fromServiceError({ code: grpc.status.CANCELLED, details: 'Cancelled on client' }));
      return;
    }
    this.#call.cancel();
  }

  /** The address of the server now streaming (the last one's while a resume waits out its backoff). */
  getPeer() {
    return (this.#call ?? this.#lastCall).getPeer();
  }
}

module.exports = { Generation, finishReasonName, isBroken, isCut, resumedRequest, MAX_RESUMES, RESUME_BACKOFF_MS };

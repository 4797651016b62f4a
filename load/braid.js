// k6 load test for braid: many concurrent Generate/Stream calls, with stream latency and error rate.
//
//   k6 run -e BRAID_TARGET=localhost:50051 load/braid.js
//
// braid serves gRPC reflection, so no .proto is needed. Settings (all optional, with -e NAME=value):
//   BRAID_TARGET        host:port of the server (default localhost:50051)
//   BRAID_VUS           concurrent streams: each virtual user runs one stream at a time (default 8)
//   BRAID_DURATION      how long to run (default 30s)
//   BRAID_MAX_TOKENS    max_new_tokens of each request (default 32)
//   BRAID_PROMPT        the prompt (default: a short story opening)
//   BRAID_TTFT_P95_MS   threshold: 95th percentile of time to first token, ms (default 5000)
//   BRAID_ERROR_RATE    threshold: highest share of failed streams (default 0.01)

import grpc from 'k6/net/grpc';
import { check } from 'k6';
import { Counter, Rate, Trend } from 'k6/metrics';

const TARGET = __ENV.BRAID_TARGET || 'localhost:50051';
const MAX_TOKENS = parseInt(__ENV.BRAID_MAX_TOKENS || '32', 10);
const PROMPT = __ENV.BRAID_PROMPT || 'Once upon a time, in a small village by the sea,';

export const options = {
  scenarios: {
    streams: {
      executor: 'constant-vus',
      vus: parseInt(__ENV.BRAID_VUS || '8', 10),
      duration: __ENV.BRAID_DURATION || '30s',
      gracefulStop: '30s', // let the last streams finish
    },
  },
  thresholds: {
    braid_stream_errors: [`rate<=${__ENV.BRAID_ERROR_RATE || '0.01'}`],
    braid_time_to_first_token: [`p(95)<${__ENV.BRAID_TTFT_P95_MS || '5000'}`],
    braid_streams_completed: ['count>0'],
  },
};

// Time from sending the request to the first message of the stream (the first token).
const timeToFirstToken = new Trend('braid_time_to_first_token', true);
// Time from sending the request to the end of the stream.
const streamDuration = new Trend('braid_stream_duration', true);
// Generated tokens per second of each stream, measured by the client (first message to last).
const tokensPerSecond = new Trend('braid_tokens_per_second');
// Share of streams that failed: an error status, or an end without a final message.
const streamErrors = new Rate('braid_stream_errors');
const streamsCompleted = new Counter('braid_streams_completed');
const tokensReceived = new Counter('braid_tokens');

const client = new grpc.Client();
let errorsLogged = 0; // per VU: the first few errors are logged, then only counted

export default function () {
  if (__ITER === 0) {
    client.connect(TARGET, { plaintext: true, reflect: true, timeout: '30s' });
  }
  const stream = new grpc.Stream(client, 'braid.v1.Generate/Stream');
  const start = Date.now();
  let first = null;
  let tokens = 0;
  let final = null;
  let failed = false;

  stream.on('data', (message) => {
    const now = Date.now();
    if (first === null) {
      first = now;
      timeToFirstToken.add(now - start);
    }
    tokens += (message.tokenIds || []).length;
    if (message.finishReason && message.finishReason !== 'FINISH_REASON_UNSPECIFIED') final = message;
  });

  stream.on('error', (error) => {
    failed = true;
    if (errorsLogged++ < 5) console.warn(`stream error: ${error.code} ${error.message}`);
  });

  stream.on('end', () => {
    const end = Date.now();
    const ok = check(final, {
      'stream ends with a finish reason': (f) => f !== null,
      'finish reason is not an error': (f) => f !== null && f.finishReason !== 'FINISH_REASON_ERROR',
    });
    streamErrors.add(failed || !ok);
    if (failed || !ok) return;
    streamDuration.add(end - start);
    streamsCompleted.add(1);
    tokensReceived.add(tokens);
    if (tokens > 1 && end > first) tokensPerSecond.add(((tokens - 1) * 1000) / (end - first));
  });

  stream.write({ prompt: PROMPT, max_new_tokens: MAX_TOKENS, ignore_eos: true });
  stream.end();
}

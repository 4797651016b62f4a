'use strict';
/**
 * The routing key: which replica's prefix cache a call should find warm (the Python client's
 * braid.client.routing computes the same; docs/deployment.md, "Prefix-affinity routing").
 *
 *   head     = the prompt's UTF-8 bytes; for a chat, for each message up to and including the
 *              first one whose role is "user": role, a 0 byte, content, a 0 byte (UTF-8); for
 *              promptTokenIds, each id as 4 bytes, little-endian two's complement
 *   material = cacheSalt's UTF-8 bytes, a 0 byte, the first 1,024 bytes of head
 *   key      = the first 16 hex digits (lower case) of SHA-256(material)
 *
 * Sent as the `braid-route-key` header of every Stream call; the proxies hash it to pick a replica.
 */

const crypto = require('node:crypto');

const ROUTE_KEY_HEADER = 'braid-route-key';
const HEAD_BYTES = 1024;
const KEY_HEX_DIGITS = 16;
const ZERO = Buffer.from([0]);

function head(request) {
  const ids = request.promptTokenIds ?? [];
  if (ids.length > 0) {
    const bytes = Buffer.alloc(4 * Math.min(ids.length, HEAD_BYTES / 4));
    for (let i = 0; i < bytes.length / 4; i++) bytes.writeInt32LE(ids[i], 4 * i);
    return bytes;
  }
  const messages = request.messages ?? [];
  if (messages.length === 0) return Buffer.from(request.prompt ?? '', 'utf8');
  const parts = [];
  for (const { role = '', content = '' } of messages) {
    parts.push(Buffer.from(role, 'utf8'), ZERO, Buffer.from(content, 'utf8'), ZERO);
    if (role === 'user') break;
  }
  return Buffer.concat(parts);
}

/** The request's routing key: 16 hex digits from its cacheSalt and the start of its prompt. */
function routeKey(request) {
  const material = Buffer.concat([Buffer.from(request.cacheSalt ?? '', 'utf8'), ZERO, head(request).subarray(0, HEAD_BYTES)]);
  return crypto.createHash('sha256').update(material).digest('hex').slice(0, KEY_HEX_DIGITS);
}

module.exports = { routeKey, ROUTE_KEY_HEADER, HEAD_BYTES };

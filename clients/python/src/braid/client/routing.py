"""The routing key: which replica's prefix cache a call should find warm.

A braid replica caches the KV of the prompts it has seen, so calls that start alike are cheapest on
the replica that served the first. Braid's clients send each Stream call a `braid-route-key` header
that depends only on what decides that cache's reuse, the request's cache_salt and the start of its
prompt, and the proxies hash it to pick a replica (HAProxy `balance hdr(braid-route-key)`, Envoy's
ring hash; docs/deployment.md, "Prefix-affinity routing").

The key, in any language (clients/node/routing.js computes the same):

    head     = the prompt's UTF-8 bytes; for a chat, for each message up to and including the
               first one whose role is "user": role, a 0 byte, content, a 0 byte (UTF-8); for
               prompt_token_ids, each id as 4 bytes, little-endian two's complement
    material = cache_salt's UTF-8 bytes, a 0 byte, the first 1,024 bytes of head
    key      = the first 16 hex digits (lower case) of SHA-256(material)

1,024 bytes is about 250 tokens: a shared system prompt, or a conversation's first turn, decides it,
and every later turn of the conversation keeps it.
"""

from __future__ import annotations

import hashlib

from braid.v1 import generate_pb2 as pb

ROUTE_KEY_HEADER = "braid-route-key"
HEAD_BYTES = 1024
KEY_HEX_DIGITS = 16


def _head(request: pb.GenerateRequest) -> bytes:
    if request.prompt_token_ids:
        return b"".join(t.to_bytes(4, "little", signed=True) for t in request.prompt_token_ids[: HEAD_BYTES // 4])
    if not request.messages:
        return request.prompt.encode()
    parts = []
    for message in request.messages:
        parts += [message.role.encode(), b"\0", message.content.encode(), b"\0"]
        if message.role == "user":
            break
    return b"".join(parts)


def route_key(request: pb.GenerateRequest) -> str:
    """The request's routing key: 16 hex digits from its cache_salt and the start of its prompt."""
    material = request.cache_salt.encode() + b"\0" + _head(request)[:HEAD_BYTES]
    return hashlib.sha256(material).hexdigest()[:KEY_HEX_DIGITS]

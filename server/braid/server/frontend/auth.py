"""The API key (--api-key) as every front end checks it: gRPC's `authorization` metadata and
HTTP's `Authorization` header are read by the same parser; Anthropic's clients send the key alone,
in an `x-api-key` header."""

from __future__ import annotations

import hmac
from typing import Sequence


def bearer_matches(authorization: Sequence[str | bytes], api_key: bytes) -> bool:
    """Whether the call's `authorization` values are exactly one `Bearer <api_key>`, the scheme in
    any case (RFC 9110 11.1: auth schemes are case-insensitive). Two values are refused rather than
    one picked: a proxy that adds its own must not decide which key counts."""
    if len(authorization) != 1:
        return False
    scheme, _, key = _bytes(authorization[0]).partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(b" "), api_key)


def key_matches(keys: Sequence[str | bytes], api_key: bytes) -> bool:
    """Whether the call's `x-api-key` values are exactly one, the key (two are refused, as above)."""
    return len(keys) == 1 and hmac.compare_digest(_bytes(keys[0]).strip(b" "), api_key)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value

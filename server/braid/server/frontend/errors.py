"""What every front end sends back of an error's text: at most MAX_MESSAGE_CHARS of it."""

from __future__ import annotations

# The most characters of an error's message (and of a field's description or name) braid sends: a
# default gRPC client takes at most 8 KB of trailers, and past that it sees RESOURCE_EXHAUSTED
# "received metadata size exceeds limit" instead of braid's status; the message goes there twice
# (grpc-message and, in the details, grpc-status-details-bin). HTTP's errors are capped alike.
MAX_MESSAGE_CHARS = 1000


def capped(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"

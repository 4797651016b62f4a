"""What a front end's request log line echoes of a request (a request_id it named, and over HTTP its
`user`, its path and the parameter an error names) goes through `echoed`: at most MAX_ECHO_CHARS of
it, with a marker where it was cut, so a client cannot write a megabyte (or a second line) into the
log. The lines themselves are each front end's (grpc/request_log.py, http/observed.py)."""

from __future__ import annotations

MAX_ECHO_CHARS = 256
# control characters (a newline would begin a forged line of the text log) shown escaped, as repr shows them
_ESCAPED = {c: repr(chr(c))[1:-1] for c in (*range(0x20), 0x7F)}


def echoed(text: str) -> str:
    """A client's string as the log echoes it: its first MAX_ECHO_CHARS characters, control
    characters and lone surrogates escaped, and `…[N more chars]` where it was cut."""
    cut = len(text) - MAX_ECHO_CHARS
    shown = text[:MAX_ECHO_CHARS].translate(_ESCAPED)
    shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, which no log stream encodes
    return shown + f"…[{cut} more chars]" if cut > 0 else shown

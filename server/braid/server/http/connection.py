"""One HTTP connection: uvicorn's httptools protocol with the bounds it lacks.

uvicorn bounds neither a request's head nor the time it takes to arrive on its httptools parser (h11's
max_incomplete_event_size bounds the head's size only, and h11 is pure Python), and it times out only
a connection idle between requests (timeout_keep_alive). So a client could send 200 MiB of headers,
or hold a connection (and a task, and up to --max-message-bytes of body) open forever by sending a
byte a second. Here, as nginx and Envoy bound them:

- a request's head (request line and headers) over --http-max-header-bytes, or with more than
  --http-max-headers headers, gets 431 and the connection is closed; the parser never holds more
  than the bound and one read (at most 256 KiB) of a head;
- a head not in --http-header-timeout after the connection opened or after the request's first
  byte, or a body not in --http-body-timeout after its head, gets 408 (where no response has begun)
  and the connection is closed, so the handler reading the body sees the client gone.

The error is in OpenAI's shape, or in Anthropic's for a path under /v1/messages (as far as the path
has arrived: a head cut before its path ends is answered in OpenAI's).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from braid.server.config import ServerConfig
from braid.server.http.errors import error_body, is_anthropic


class BoundedHttp(HttpToolsProtocol):
    settings: ServerConfig  # set by `bounded`, for each server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0  # of the head being read, as received
        self._reading_head = True
        self._began = False  # whether a byte of the request being read has come
        self._refused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.settings.http_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.settings.http_max_header_bytes and not self._refused:
            self._refuse(431, f"the request's head is over {self.settings.http_max_header_bytes} bytes", "headers")

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # (the parser stops on a request refused mid-read: nothing more to say)
            super().send_400_response(msg)

    # the parser's callbacks, in a request's order

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head, self._began = True, True
        if self._deadline is None:  # a pipelined request, or one after a keep-alive wait
            self._head_bytes = 0
            self._arm(self.settings.http_header_timeout)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        super().on_header(name, value)
        if len(self.headers) > self.settings.http_max_headers:
            self._refuse(431, f"the request has more than {self.settings.http_max_headers} headers", "headers")

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.settings.http_max_header_bytes:
            self._refuse(431, f"the request's head is over {self.settings.http_max_header_bytes} bytes", "headers")
            return
        self._reading_head = False
        self._disarm()
        self._arm(self.settings.http_body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._began = False
        super().on_message_complete()

    # the bounds

    def _arm(self, seconds: float) -> None:
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._reading_head:
            if self._began:
                self._refuse(408, f"the request's head took over {self.settings.http_header_timeout} s", None)
            else:  # a connection that never sent a byte: closed, nothing to answer
                self._refused = True
                self.transport.close()
        else:
            self._refuse(408, f"the request's body took over {self.settings.http_body_timeout} s", "body")

    def _refuse(self, status: int, message: str, param: str | None) -> None:
        """Answers `status` with OpenAI's error JSON, where no response to the request has begun, and
        closes the connection; the request's handler, if it runs, sees its client gone."""
        self._refused = True
        self._disarm()
        cycle = self.cycle
        answered = cycle is not None and not cycle.response_complete and cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # its handler's reads end, its writes go nowhere
            cycle.message_event.set()
        if not answered and not self.transport.is_closing():
            anthropic = is_anthropic(getattr(self, "url", b"").decode("latin-1").partition("?")[0])
            self.transport.write(_response(status, message, param, anthropic))
        self.transport.close()


def bounded(settings: ServerConfig) -> type[BoundedHttp]:
    """The protocol class for uvicorn.Config(http=...), bound by these settings."""
    return type("BoundedHttp", (BoundedHttp,), {"settings": settings})


def _response(status: int, message: str, param: str | None, anthropic: bool) -> bytes:
    body = json.dumps(error_body(status, "invalid_request_error", message, param, anthropic)).encode()
    head = [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return STATUS_LINE[status] + b"\r\n".join(head) + b"\r\n\r\n" + body

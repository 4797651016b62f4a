"""The HTTP front end under hostile traffic, in process: output that made the tool-call parser
quadratic, bodies that got 500s, strings the request log echoed whole, and (over real sockets, on
127.0.0.1, against uvicorn in this process over the fake engine) heads that were never bounded and
reads that never timed out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import select
import socket
import threading

import grpc
import pytest
from starlette.testclient import TestClient
from test_servicer import FakeEngine

from braid.server.config import ServerConfig, SettingError
from braid.server.grpc.errors import ErrorInterceptor
from braid.server.grpc.request_log import RequestLogInterceptor
from braid.server.grpc.servicer import GenerateServicer
from braid.server.frontend.request_log import MAX_ECHO_CHARS, echoed
from braid.server.frontend import tools
from braid.server.http.app import OpenAIApi
from braid.server.http.server import HttpFrontEnd
from braid.v1 import generate_pb2 as pb
from braid.v1 import generate_pb2_grpc as pb_grpc


HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def app(**config) -> TestClient:
    return TestClient(OpenAIApi(FakeEngine(), ServerConfig(**config)).app)


# ---- 13: the tool-call parser, linear and off the event loop ---------------------------------------


class Counted(str):
    """A text whose searches count the characters they pass over, and check that each begins where
    the last one stopped or after: a scan that never goes back."""

    def __new__(cls, text: str) -> Counted:
        counted = super().__new__(cls, text)
        counted.read, counted.at = 0, 0
        return counted

    def find(self, sub, start=0, end=None):  # noqa: D102 (str's)
        assert start >= self.at, f"a search went back from {self.at} to {start}"
        found = str.find(self, sub, start, len(self) if end is None else end)
        self.at = len(self) if found < 0 else found + len(sub)
        self.read += self.at - start
        return found


HOSTILE = {  # each with n spaces where a regex with \s* on both sides of a lazy group rescanned them
    "one call, spaces inside": lambda n: "<tool_call>x" + " " * n + "y",
    "closed, spaces inside": lambda n: "<tool_call>" + " " * n + "</tool_call>",
    "a call, then an open one": lambda n: '<tool_call>{"name": "f"}</tool_call><tool_call>' + " " * n,
    "many opens": lambda n: "<tool_call> " * (n // 12),
}


@pytest.mark.parametrize("shape", HOSTILE)
def test_the_tool_call_scan_reads_each_character_once_at_any_size(shape):
    for n in (16_000, 64_000, 256_000, 1_024_000):  # the same work per character at every size
        text = Counted(HOSTILE[shape](n))
        assert tools.parse_tool_calls(text) == (text, [])  # no call in it: all content
        assert text.read == len(text)  # each character passed over once, by searches that never went back


def test_a_64000_space_call_and_json_nested_past_the_parsers_depth_are_content():
    text = "<tool_call>x" + " " * 64_000 + "y"
    assert tools.parse_tool_calls(text) == (text, [])
    spaced = '<tool_call>{"name": "f",' + " " * 64_000 + '"arguments": {"a": 1}}</tool_call>'
    assert tools.parse_tool_calls("Hi " + spaced) == ("Hi", [tools.ToolCall("f", '{"a": 1}')])
    for deep in ("<tool_call>" + "[" * 100_000, '{"name": "f", "arguments": ' + "[" * 100_000):
        assert tools.parse_tool_calls(deep) == (deep, [])
    assert tools.forced_calls("[" * 100_000, None) == []


def held_from_whole(text: str) -> int:
    """tools.held_from as it was, reading the whole text at every call: the reference."""
    if tools.HERMES_OPEN in text:
        return text.index(tools.HERMES_OPEN)
    stripped = text.lstrip()
    if stripped.startswith(("{", "<|python_tag|>")) or (stripped and "<|python_tag|>".startswith(stripped)):
        return 0
    for k in range(min(len(tools.HERMES_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(tools.HERMES_OPEN[:k]):
            return len(text) - k
    return len(text)


def test_a_streams_hold_back_reads_its_text_once_in_all_and_holds_back_what_it_did():
    rng = random.Random(0)
    pieces = ["<tool", "_call>", "</tool_call>", " ", "\n", "{", "}", "<|python", "_tag|>", "<", "hi", "<|"]
    for _ in range(300):
        held, text = tools.HeldBack(), ""
        for _ in range(rng.randrange(1, 12)):
            text += rng.choice(pieces)
            assert held(text) == held_from_whole(text), repr(text)
    for piece in (" abc", "    "):  # a long stream: its searches read each character once, and a tag's length more
        held, text, read = tools.HeldBack(), "", 0
        for _ in range(20_000):
            text += piece
            counted = Counted(text)
            assert held(counted) == len(text)
            read += counted.read
        assert len(text) <= read <= len(text) + len(tools.HERMES_OPEN) * 20_000


def test_tool_calls_are_read_off_the_event_loop(monkeypatch):
    on_loop = []
    parse = tools.parse_tool_calls

    def watched(text):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse(text)

    monkeypatch.setattr(tools, "parse_tool_calls", watched)
    http = app()
    body = {"messages": HI, "tools": TOOLS, "tool_choice": "auto", "n": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and list(response.iter_lines())
    assert on_loop and not any(on_loop), on_loop


# ---- 14: bad input is 400 naming the parameter, never a 500 -----------------------------------------


def deep_schema(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * (levels // 2) + "{}" + "}}" * (levels // 2)


CHAT = '{"messages": [{"role": "user", "content": "hi"}], '
PROMPT = '{"prompt": "hi", '
BAD = [  # (route, body, the param named)
    ("chat", "[" * 100_000, "body"),
    ("chat", "{" + '"a": {' * 100_000, "body"),
    (
        "chat",
        CHAT + '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % deep_schema(900),
        "tools[0].function.parameters",
    ),
    (
        "chat",
        CHAT
        + '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % deep_schema(900),
        "response_format.json_schema.schema",
    ),
    ("chat", CHAT + '"user": ' + "[" * 200 + "]" * 200 + "}", "user"),
    ("chat", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (
        "chat",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
        "messages[0].content[0].text",
    ),
    ("chat", '{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages[0].role"),
    ("chat", CHAT + '"stop": "\\ud800"}', "stop"),
    ("chat", CHAT + '"stop": ["x", "\\ud800"]}', "stop[1]"),
    ("chat", CHAT + '"logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("chat", CHAT + '"max_tokens": 2147483648}', "max_tokens"),
    ("chat", CHAT + '"max_completion_tokens": 2147483648}', "max_completion_tokens"),
    ("chat", CHAT + '"n": 1e10}', "n"),
    ("chat", CHAT + '"seed": 18446744073709551616}', "seed"),
    ("chat", CHAT + '"logprobs": true, "top_logprobs": -1}', "top_logprobs"),
    ("chat", CHAT + '"logit_bias": {"2147483648": 1}}', "logit_bias[2147483648]"),
    ("chat", CHAT + '"min_tokens": 2147483648}', "min_tokens"),
    ("chat", CHAT + '"top_k": 2147483648}', "top_k"),
    ("chat", CHAT + '"top_k": -2147483649}', "top_k"),
    ("chat", CHAT + '"stop_token_ids": [1, 2147483648]}', "stop_token_ids[1]"),
    ("completions", "[" * 100_000, "body"),
    (
        "completions",
        PROMPT
        + '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % deep_schema(900),
        "response_format.json_schema.schema",
    ),
    ("completions", '{"prompt": "\\ud800"}', "prompt"),
    ("completions", '{"prompt": ["\\ud800"]}', "prompt[0]"),
    ("completions", PROMPT + '"stop": "\\udc00"}', "stop"),
    ("completions", PROMPT + '"max_tokens": 2147483648}', "max_tokens"),
    ("completions", PROMPT + '"n": 1e10}', "n"),
    ("completions", PROMPT + '"seed": 18446744073709551616}', "seed"),
    ("completions", PROMPT + '"logprobs": 4294967296}', "logprobs"),
    ("completions", PROMPT + '"logit_bias": {"2147483648": 1}}', "logit_bias[2147483648]"),
    ("completions", PROMPT + '"min_tokens": 2147483648}', "min_tokens"),
    ("completions", PROMPT + '"top_k": 2147483648}', "top_k"),
    ("completions", PROMPT + '"stop_token_ids": [-2147483649]}', "stop_token_ids[0]"),
]


@pytest.mark.parametrize("route, body, param", BAD, ids=[f"{r}:{p}:{i}" for i, (r, _, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_parameter(route, body, param):
    http = app()
    response = http.post(f"/v1/{route.replace('chat', 'chat/completions')}", content=body.encode())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "invalid_request_error"
    assert http.post("/v1/chat/completions", json={"messages": HI}).status_code == 200  # and the app goes on


def test_a_body_not_in_utf8_is_400_naming_the_body():
    http = app()
    for raw in ('{"prompt": "\\ud800"}'.encode("utf-16"), b'{"prompt": "\xff"}'):
        response = http.post("/v1/completions", content=raw)
        assert response.status_code == 400 and response.json()["error"]["param"] == "body", response.text
    with_bom = b'\xef\xbb\xbf{"prompt": "hi"}'  # a BOM is let through
    assert http.post("/v1/completions", content=with_bom).status_code == 200


# ---- 17: the request log echoes at most MAX_ECHO_CHARS of what a client wrote ---------------------


def test_echoed_cuts_a_string_with_a_marker_and_escapes_what_would_break_the_line():
    assert echoed("alice") == "alice"
    long = echoed("u" * 1_000_000)
    assert long == "u" * MAX_ECHO_CHARS + f"…[{1_000_000 - MAX_ECHO_CHARS} more chars]"
    assert echoed("a\nb\x00\ud800") == "a\\nb\\x00\\ud800"


def test_a_megabyte_user_field_is_a_short_log_line(caplog):
    http = app()
    with caplog.at_level(logging.INFO, logger="braid.server.http.app"):
        assert http.post("/v1/chat/completions", json={"messages": HI, "user": "u" * 1_000_000}).status_code == 200
        http.post("/v1/chat/completions", json={"messages": HI, "logit_bias": {"7" * 1_000_000: 1}})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HTTP ")]
    assert len(lines) == 2 and all(len(line) < 2 * MAX_ECHO_CHARS + 500 for line in lines), [len(x) for x in lines]
    assert "user=" + "u" * MAX_ECHO_CHARS + "…[" in lines[0] and "param=logit_bias[777" in lines[1]
    fields = [r.fields for r in caplog.records if r.getMessage().startswith("HTTP ")]
    assert fields[0]["user"].endswith(f"…[{1_000_000 - MAX_ECHO_CHARS} more chars]")


def test_a_megabyte_grpc_request_id_is_a_short_log_line(caplog):
    async def go():
        server = grpc.aio.server(interceptors=[RequestLogInterceptor(), ErrorInterceptor()])
        pb_grpc.add_GenerateServicer_to_server(GenerateServicer(FakeEngine(), ServerConfig()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError):  # refused (over 128 bytes), and logged all the same
                    [
                        m
                        async for m in pb_grpc.GenerateStub(channel).Stream(
                            pb.GenerateRequest(prompt="hi", request_id="r" * 1_000_000)
                        )
                    ]
        finally:
            await server.stop(0)

    with caplog.at_level(logging.INFO, logger="braid.server.grpc.request_log"):
        asyncio.run(go())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Stream ")]
    assert len(line) < MAX_ECHO_CHARS + 500 and "r" * MAX_ECHO_CHARS + "…[" in line


# ---- 16: bounds on a connection's head and its read times, over real sockets ----------------------


@pytest.mark.parametrize(
    "name", ["http_max_header_bytes", "http_max_headers", "http_header_timeout", "http_body_timeout"]
)
def test_each_bound_is_a_flag_that_must_be_positive(name):
    assert getattr(ServerConfig(), name) > 0
    with pytest.raises(SettingError, match=f"--{name.replace('_', '-')} 0: must be positive"):
        ServerConfig(**{name: 0})


@contextlib.contextmanager
def serving(**config):
    """uvicorn as braid serves it (http/server.py), in this process on 127.0.0.1, over the fake engine."""
    front = HttpFrontEnd(ServerConfig(host="127.0.0.1", **config))
    front.bind()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(front.start(FakeEngine()), loop).result(30)
        yield front.port
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def answer(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (the socket's timeout fails the test);
    what came before a reset, if it resets it."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def trickle(sock: socket.socket, data: bytes, most: int) -> tuple[int, bytes]:
    """Sends data a byte at a time, 50 ms apart, until the server closes the connection (or `most`
    bytes): the bytes it took and what it answered."""
    for sent in range(min(most, len(data))):
        try:
            sock.sendall(data[sent : sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            return sent, b""
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            return sent + 1, answer(sock)
    return most, b""


POST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def test_a_head_over_the_bound_is_431_and_closed():
    with serving(http_max_header_bytes=8192, http_max_headers=20) as port:
        with connect(port) as sock:  # one huge header, sent as fast as the server takes it
            sock.sendall(POST)
            sent = 0
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < 50 << 20:
                    sock.sendall(b"x-big: " + b"a" * 65536)
                    sent += 65536
            assert sent < 50 << 20  # refused long before 50 MiB
            head = answer(sock).split(b"\r\n", 1)[0]
            assert head in (b"HTTP/1.1 431 Request Header Fields Too Large", b"")  # (a reset may drop it)
        with connect(port) as sock:  # a head just over the bound, in one write
            sock.sendall(POST + b"x-big: " + b"a" * 8192 + b"\r\n\r\n")
            response = answer(sock)
            assert (
                response.startswith(b"HTTP/1.1 431 ")
                and json.loads(response.split(b"\r\n\r\n")[1])["error"]["param"] == "headers"
            )
        with connect(port) as sock:  # too many small headers
            sock.sendall(POST + b"".join(b"x-%d: 1\r\n" % i for i in range(21)) + b"\r\n")
            assert answer(sock).startswith(b"HTTP/1.1 431 ")
        with connect(port) as sock:  # and within both bounds, a call goes through
            body = json.dumps({"messages": HI}).encode()
            sock.sendall(
                POST
                + b"".join(b"x-%d: 1\r\n" % i for i in range(16))
                + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
                + body
            )
            assert answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_slow_head_is_408_and_closed():
    with serving(http_header_timeout=0.3) as port:
        with connect(port) as sock:
            sent, response = trickle(sock, POST + b"x-slow: 1\r\n" * 100, most=400)
            assert sent < 400 and response.startswith(b"HTTP/1.1 408 ")
        with connect(port) as sock:  # a connection that sends nothing is closed too
            assert answer(sock) == b""


def test_a_slow_body_is_408_and_closed_and_the_server_goes_on():
    with serving(http_body_timeout=0.3) as port:
        with connect(port) as sock:
            sock.sendall(POST + b"content-length: 4000000\r\n\r\n")
            sent, response = trickle(sock, b"[" * 400, most=400)
            assert sent < 400 and response.startswith(b"HTTP/1.1 408 ")
            assert json.loads(response.split(b"\r\n\r\n")[1])["error"]["param"] == "body"
        with connect(port) as sock:  # a body that stalls
            sock.sendall(POST + b"content-length: 100\r\n\r\n{")
            assert answer(sock).startswith(b"HTTP/1.1 408 ")
        with connect(port) as sock:
            body = json.dumps({"messages": HI}).encode()
            sock.sendall(POST + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            assert answer(sock).startswith(b"HTTP/1.1 200 ")

"""The HTTP front end under hostile traffic, in process: output that made the tool-call parser
quadratic, bodies that got 500s, strings the request log echoed whole, and (over real sockets, on
127.0.0.1, against uvicorn in this process over the fake engine) heads that were never bounded and
reads that never timed out."""

from __future__ import annotations

import asyncio
import random

import pytest
from starlette.testclient import TestClient
from test_servicer import FakeEngine

from braid.server.config import ServerConfig
from braid.server.http import tools
from braid.server.http.app import OpenAIApi

pytestmark = pytest.mark.unit  # torch-free and in-process: make test-unit

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

"""A reasoning model's reasoning as each front end renders it, over a fake engine whose sessions
send reasoning, then an answer (engine/reasoning.py splits them; each front end only renders the
two parts): gRPC's GenerateResponse.reasoning and Usage.reasoning_tokens, OpenAI chat's
reasoning_content, Anthropic's thinking blocks, the Responses API's reasoning item; and the budgets
each API's fields ask for, bad values named as that API names them."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from test_anthropic_app import events, requests_of, serve
from test_servicer import FakeEngine, _served

from braid.server.engine.types import Delta, FinishReason
from braid.v1 import generate_pb2 as pb

THOUGHT = ["Let me", " see."]
ANSWER = "It is 4."


class ThinkingEngine(FakeEngine):
    """Every session reasons (THOUGHT, a token each), answers (ANSWER, one token), and ends EOS."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.finish = [], FinishReason.EOS

    def _end(self, handle, reason, error=None, field=None) -> None:
        for i, piece in enumerate(THOUGHT):
            handle.loop.call_soon_threadsafe(handle.push, Delta("", [10 + i], reasoning=piece))
        handle.loop.call_soon_threadsafe(handle.push, Delta(ANSWER, [20]))
        push = handle.push

        def finished(event) -> None:  # the Finished with its reasoning counted
            push(dataclasses.replace(event, generated_tokens=3, reasoning_tokens=2))

        handle.push = finished
        super()._end(handle, reason, error, field)


def stream(engine: FakeEngine, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """One Stream call's messages, from a fresh in-process gRPC server over `engine`."""

    async def go():
        async with _served(engine) as stub:
            return [m async for m in stub.Stream(request)]

    return asyncio.run(go())


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "2+2?"}]}


def test_grpc_streams_the_reasoning_apart_and_counts_it():
    messages = stream(ThinkingEngine(), pb.GenerateRequest(prompt="2+2?"))
    assert "".join(m.reasoning for m in messages) == "".join(THOUGHT)
    assert "".join(m.text for m in messages) == ANSWER
    assert messages[-1].usage.reasoning_tokens == 2


def test_grpc_enable_thinking_and_the_budget_reach_the_engine():
    engine = ThinkingEngine()
    stream(engine, pb.GenerateRequest(messages=[pb.Message(role="user", content="hi")], enable_thinking=False))
    stream(engine, pb.GenerateRequest(prompt="hi", max_reasoning_tokens=0))
    stream(engine, pb.GenerateRequest(prompt="hi"))
    off, budget, neither = engine.submitted
    assert json.loads(off.chat_template_kwargs) == {"enable_thinking": False}
    assert (budget.params.max_reasoning_tokens, neither.params.max_reasoning_tokens) == (0, None)
    assert neither.chat_template_kwargs == ""


def test_openai_chat_sends_reasoning_content_whole_and_streamed():
    _, http = serve(ThinkingEngine())
    whole = http.post("/v1/chat/completions", json=CHAT).json()
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("".join(THOUGHT), ANSWER)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d) == "".join(THOUGHT)
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_openai_reasoning_effort_is_a_budget_and_a_bad_one_is_named():
    engine = ThinkingEngine()
    seen = requests_of(engine)
    _, http = serve(engine)
    for effort, budget in (("low", 1024), ("high", 16384), ("none", 0)):
        assert http.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": effort}).status_code == 200
        assert seen[-1].params.max_reasoning_tokens == budget
    http.post("/v1/chat/completions", json={**CHAT, "max_reasoning_tokens": 7})
    assert seen[-1].params.max_reasoning_tokens == 7
    for bad, param in (
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
        ({"max_reasoning_tokens": 5, "reasoning_effort": "low"}, "max_reasoning_tokens"),
    ):
        response = http.post("/v1/chat/completions", json={**CHAT, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


MESSAGE = {"model": "fake", "max_tokens": 64, "messages": [{"role": "user", "content": "2+2?"}]}


def test_anthropic_sends_a_thinking_block_before_the_text():
    _, http = serve(ThinkingEngine())
    body = {**MESSAGE, "thinking": {"type": "enabled", "budget_tokens": 32}}
    whole = http.post("/v1/messages", json=body).json()
    assert whole["content"] == [
        {"type": "thinking", "thinking": "".join(THOUGHT), "signature": ""},
        {"type": "text", "text": ANSWER},
    ]
    streamed = events(http, body)
    starts = [d["content_block"]["type"] for n, d in streamed if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = [d["delta"]["thinking"] for n, d in streamed if n == "content_block_delta" and d["index"] == 0]
    assert "".join(thinking) == "".join(THOUGHT)


def test_the_responses_api_sends_a_reasoning_item_before_the_message():
    _, http = serve(ThinkingEngine())
    body = {"model": "fake", "input": "2+2?", "reasoning": {"effort": "low"}}
    whole = http.post("/v1/responses", json=body).json()
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "".join(THOUGHT)}
    ]
    assert message["content"][0]["text"] == ANSWER
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert whole["reasoning"]["effort"] == "low"
    streamed = events(http, body, "/v1/responses")
    deltas = [d["delta"] for n, d in streamed if n == "response.reasoning_text.delta"]
    assert "".join(deltas) == "".join(THOUGHT)
    done = [d["text"] for n, d in streamed if n == "response.reasoning_text.done"]
    assert done == ["".join(THOUGHT)]


def test_a_reasoning_item_sent_back_is_dropped():
    engine = ThinkingEngine()
    seen = requests_of(engine)
    _, http = serve(engine)
    earlier = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]}
    items = [
        {"role": "user", "content": "hi"},
        earlier,
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert http.post("/v1/responses", json={"model": "fake", "input": items}).status_code == 200
    assert [m.role for m in seen[-1].messages] == ["user", "assistant", "user"]


@pytest.mark.parametrize("effort", ["extreme", ""])
def test_a_bad_reasoning_effort_is_named_as_the_responses_api_names_it(effort):
    _, http = serve(ThinkingEngine())
    response = http.post("/v1/responses", json={"model": "fake", "input": "hi", "reasoning": {"effort": effort}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning.effort"

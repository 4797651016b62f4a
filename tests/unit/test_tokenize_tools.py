"""Tokenize of a chat with tools and enable_thinking (TokenizeRequest.tools, .enable_thinking), through
the servicer over the fake engine: the engine tokenizes the chat with the messages, tools and template
variables a Stream of the same chat gives it (GenerateRequest's plan: the tools for a template that
renders them, else in the system message), and the fields that need a chat, or are a tool's, are
refused naming them. Real tokens on real servers: tests/test_tools_grpc.py (a template that renders
tools) and tests/test_reasoning.py (one that does not, with the thinking switch)."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest

from braid.server.grpc import convert
from braid.v1 import generate_pb2 as pb
from test_servicer import INFO, FakeEngine, call  # noqa: F401  (call: the module's fixture)
from test_tool_calls_grpc import HI, TIME, VOCAB, WEATHER


@pytest.mark.parametrize("takes_tools", [True, False])
def test_a_chat_is_tokenized_with_the_tools_and_thinking_its_generation_renders(call, takes_tools):  # noqa: F811
    engine = FakeEngine()
    engine.info = dataclasses.replace(INFO, chat_template_takes_tools=takes_tools)
    fields = dict(messages=HI, tools=[WEATHER, TIME], enable_thinking=False)
    call(engine, "Tokenize", pb.TokenizeRequest(**fields))
    ((prompt, messages, tools, template_kwargs),) = engine.tokenized
    generation, _ = convert.planned_from_pb(pb.GenerateRequest(**fields), 256, VOCAB, None, takes_tools)
    assert (messages, tools, template_kwargs) == (
        generation.messages,
        generation.tools,
        generation.chat_template_kwargs,
    )
    assert prompt is None and json.loads(template_kwargs) == {"enable_thinking": False}
    if takes_tools:  # the template renders them
        assert [t["function"]["name"] for t in json.loads(tools)] == ["get_weather", "get_time"]
        assert messages == convert.messages_from_pb(HI)
    else:  # the template would drop them: they are in the system message, as a generation's are
        assert tools == "" and messages[0].role == "system" and "get_weather" in messages[0].content


def test_a_text_or_a_chat_without_tools_is_tokenized_as_before(call):  # noqa: F811
    engine = FakeEngine()
    call(engine, "Tokenize", pb.TokenizeRequest(text="ab"))
    call(engine, "Tokenize", pb.TokenizeRequest(messages=HI))
    assert [(t[0], t[2], t[3]) for t in engine.tokenized] == [("ab", "", ""), (None, "", "")]


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(text="ab", tools=[WEATHER]), "tools"),
        (dict(text="ab", tools=[WEATHER], return_offsets=True), "tools"),
        (dict(text="ab", enable_thinking=True), "enable_thinking"),
        (dict(messages=HI, tools=[WEATHER, WEATHER]), "tools"),
        (dict(messages=HI, tools=[WEATHER, pb.Tool(description="no name")]), "tools[1].name"),
        (dict(messages=HI, tools=[pb.Tool(name="f", parameters="{not json")]), "tools[0].parameters"),
        (dict(messages=HI, tools=[pb.Tool(name="f", parameters="[1, 2]")]), "tools[0].parameters"),
    ],
)
def test_a_bad_field_is_invalid_argument_naming_it(call, fields, field):  # noqa: F811
    engine = FakeEngine()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(engine, "Tokenize", pb.TokenizeRequest(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ": "), err.value.details()
    assert engine.tokenized == []

"""Tool calls over gRPC (GenerateRequest.tools, tool_choice; GenerateResponse.tool_calls): the
protobuf request as the engine's, checked with its fields named, planned exactly as OpenAI's chat
plans the same request (frontend/tool_plan.py serves both), and calls read back from fixed outputs
through the servicer over the fake engine. End to end on a tiny Qwen3: tests/test_tools_grpc.py."""

from __future__ import annotations

import json

import grpc
import pytest

from braid.server.grpc import convert
from braid.server.engine.types import FinishReason, InvalidArgument
from braid.server.frontend.tool_plan import CallReader, ToolPlan
from braid.server.http.anthropic_protocol import MessagesRequest
from braid.server.http.anthropic_requests import messages_plan
from braid.server.http.protocol import ChatRequest
from braid.server.http.requests import chat_plan
from braid.v1 import generate_pb2 as pb
from test_servicer import FakeEngine, call  # noqa: F401  (call: the module's fixture)

SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(name="get_weather", description="The weather in a city", parameters=json.dumps(SCHEMA))
TIME = pb.Tool(name="get_time", parameters='{"type": "object", "properties": {"tz": {"type": "string"}}}')
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": json.loads(TIME.parameters)}},
]
HI = [pb.Message(role="user", content="What is the weather?")]
VOCAB = 1000


def planned(**fields):
    return convert.planned_from_pb(pb.GenerateRequest(**{"messages": HI, **fields}), 256, VOCAB, None)


def chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "What is the weather?"}])
    return chat_plan(ChatRequest.model_validate({"model": "m", "messages": messages, **body}), 256, VOCAB)


@pytest.mark.parametrize(
    "grpc_choice, openai_choice",
    [
        (None, {}),
        (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO), {"tool_choice": "auto"}),
        (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE), {"tool_choice": "none"}),
        (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), {"tool_choice": "required"}),
        (
            pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED, disable_parallel_tool_calls=True),
            {"tool_choice": "required", "parallel_tool_calls": False},
        ),
        (pb.ToolChoice(function="get_time"), {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ],
)
def test_the_same_tools_plan_the_same_request_over_grpc_and_openais_chat(grpc_choice, openai_choice):
    """The tools the template renders, the forced call's constraint and how output is read back."""
    req, tools = planned(tools=[WEATHER, TIME], **({"tool_choice": grpc_choice} if grpc_choice else {}))
    plan = chat(tools=OPENAI_TOOLS, **openai_choice)
    assert tools == plan.tool_plan
    assert (req.tools, req.constraint, req.messages) == (
        plan.request.tools,
        plan.request.constraint,
        plan.request.messages,
    )
    if tools.mode == "forced":
        assert req.constraint is not None and req.constraint.field == "tools"


def test_tool_turns_reach_the_template_as_openais_chat_gives_them():
    turns = [
        *HI,
        pb.Message(
            role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"unit": "c"}')]
        ),
        pb.Message(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    req, _ = planned(messages=turns, tools=[WEATHER])
    call_1 = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    openai = chat(
        messages=[
            {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call_1]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=OPENAI_TOOLS[:1],
    )
    assert req.messages == openai.request.messages and req.tools == openai.request.tools


def test_tools_go_into_the_system_message_where_the_template_does_not_render_them():
    request = pb.GenerateRequest(messages=HI, tools=[WEATHER])
    req, tools = convert.planned_from_pb(request, 256, VOCAB, None, takes_tools=False)
    system, user = req.messages
    assert system.role == "system" and "get_weather" in system.content and req.tools == "" and tools.mode == "auto"
    # a prompt has no template: the tools are for reading the output alone
    req, _ = convert.planned_from_pb(pb.GenerateRequest(prompt="hi", tools=[WEATHER]), 256, VOCAB, None, False)
    assert req.messages == () and req.prompt == "hi"


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(tools=[WEATHER, pb.Tool(description="no name")]), "tools[1].name"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=[pb.Tool(name="f", parameters="{not json")]), "tools[0].parameters"),
        (dict(tools=[pb.Tool(name="f", parameters="[1, 2]")]), "tools[0].parameters"),
        (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(function="nope")), "tool_choice.function"),
        (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(function="")), "tool_choice.function"),
        (dict(tools=[WEATHER], tool_choice=pb.ToolChoice(mode=99)), "tool_choice.mode"),
        (dict(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)), "tool_choice"),
        (dict(tool_choice=pb.ToolChoice(function="get_weather")), "tool_choice"),
        (
            dict(
                tools=[WEATHER],
                tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                constraint=pb.Constraint(json_object=True),
            ),
            "tool_choice",
        ),
        (dict(messages=[*HI, pb.Message(role="tool", content="sunny")]), "messages[1].tool_call_id"),
        (dict(tools=[WEATHER], skip_detokenize=True), "tools"),
        (dict(tools=[WEATHER], resume_token_ids=[5]), "resume_token_ids"),
    ],
)
def test_a_bad_tool_field_is_named_as_the_proto_names_it(fields, field):
    with pytest.raises(InvalidArgument) as caught:
        planned(**fields)
    assert caught.value.field == field, caught.value


def test_the_same_rules_name_openais_and_anthropics_fields():
    with pytest.raises(InvalidArgument) as caught:
        chat(tools=[{"type": "function", "function": {"name": ""}}])
    assert caught.value.field == "tools[0].function.name"
    with pytest.raises(InvalidArgument) as caught:
        chat(tools=OPENAI_TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.field == "tool_choice" and "response_format" in caught.value.description
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidArgument) as caught:
        messages_plan(
            MessagesRequest.model_validate({**body, "tools": [{"name": "", "input_schema": {}}]}), 256, VOCAB, True
        )
    assert caught.value.field == "tools[0].name"


def test_a_forced_list_sends_each_call_as_its_json_object_closes():
    reader = CallReader(ToolPlan("forced", None, ("get_weather", "get_time")))
    pieces = [
        '[{"name":"get_weather","arguments":{"unit":"c",',
        '"days":1}}',
        ',{"name":"get_time","arguments":{"tz":"}{\\"\\\\',  # brackets, a quote and a backslash in a string
        '"}}',
        "]",
    ]
    reads = [reader.feed(p) for p in pieces]
    assert [len(r.calls) for r in reads] == [0, 1, 0, 1, 0] and not any(r.content for r in reads)
    first, second = reads[1].calls[0], reads[3].calls[0]
    assert (first.name, json.loads(first.arguments)) == ("get_weather", {"unit": "c", "days": 1})
    assert (second.name, json.loads(second.arguments)) == ("get_time", {"tz": '}{"\\'})
    last = reader.end()
    assert last.calls == () and reader.calls == [first, second] and reader.has_calls
    assert first.id.startswith("call_") and first.id != second.id


def test_without_tools_the_reader_passes_the_text_as_it_comes():
    reader = CallReader(ToolPlan())
    assert reader.feed("<tool_call>").content == "<tool_call>" and reader.end().content == ""
    assert reader.text == "<tool_call>" and not reader.calls


def stream(call, texts, finish=FinishReason.EOS, **fields):  # noqa: F811
    engine = FakeEngine()
    engine.tokens, engine.texts, engine.finish = list(range(10, 10 + len(texts))), texts, finish
    messages, _ = call(engine, "Stream", pb.GenerateRequest(**{"messages": HI, **fields}))
    calls = [c for m in messages for c in m.tool_calls]
    return messages, "".join(m.text for m in messages), calls


def test_auto_calls_are_parsed_from_the_output_and_come_in_the_final_message_not_as_text(call):  # noqa: F811
    texts = [
        "Let me check.",
        " <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"unit": "c", "days": 2}}</tool_call>',
    ]
    messages, text, calls = stream(call, texts, tools=[WEATHER])
    assert text == "Let me check. "  # up to where a call might begin; the call itself is never text
    (found,) = messages[-1].tool_calls
    assert calls == [found] and messages[-1].finish_reason == pb.FINISH_REASON_EOS
    assert (found.name, json.loads(found.arguments)) == ("get_weather", {"unit": "c", "days": 2})
    assert found.id.startswith("call_") and [t for m in messages for t in m.token_ids] == [10, 11, 12, 13]


@pytest.mark.parametrize(
    "texts",
    [
        ['{"not": ', '"a call"}'],  # held back (it begins as Llama 3's calls do), then all of it text
        ["Hi <tool_call>", "{broken</tool_call>"],
        ['<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "<tool_call>{broken</tool_call>"],
    ],
)
def test_auto_output_that_holds_no_well_formed_call_is_all_text(call, texts):  # noqa: F811
    _, text, calls = stream(call, texts, tools=[WEATHER, TIME])
    assert text == "".join(texts) and calls == []


def test_a_named_call_is_the_final_messages_with_no_text(call):  # noqa: F811
    messages, text, calls = stream(
        call, ['{"unit":', '"f","days":3}'], FinishReason.CONSTRAINT, tools=[WEATHER, TIME],
        tool_choice=pb.ToolChoice(function="get_weather"),
    )  # fmt: skip
    assert text == "" and messages[-1].finish_reason == pb.FINISH_REASON_CONSTRAINT
    (found,) = messages[-1].tool_calls
    assert calls == [found] and (found.name, found.arguments) == ("get_weather", '{"unit":"f","days":3}')


def test_a_required_list_cut_short_sends_its_calls_as_far_as_they_got(call):  # noqa: F811
    texts = ['[{"name":"get_weather","arguments":{"unit":"c","days":1}}', ',{"name":"get_we']
    messages, text, calls = stream(
        call, texts, FinishReason.MAX_TOKENS, tools=[WEATHER, TIME],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
    )  # fmt: skip
    assert text == "" and messages[-1].finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"unit": "c", "days": 1}'), ("get_weather", "")]


def test_each_sample_reads_its_own_calls(call):  # noqa: F811
    texts = ['<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>']
    messages, _, calls = stream(call, texts, tools=[TIME], n=2)
    assert sorted(m.index for m in messages if m.tool_calls) == [0, 1] and len({c.id for c in calls}) == 2


def test_a_bad_tool_field_is_invalid_argument_over_the_wire(call):  # noqa: F811
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(FakeEngine(), "Stream", pb.GenerateRequest(messages=HI, tools=[WEATHER, pb.Tool(parameters="{}")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tools[1].name: ")


def test_the_forced_call_reaches_the_engine_as_its_constraint(call):  # noqa: F811
    engine = FakeEngine()
    choice = pb.ToolChoice(function="get_weather")
    call(engine, "Stream", pb.GenerateRequest(messages=HI, tools=[WEATHER], tool_choice=choice))
    (submitted,) = engine.submitted
    assert json.loads(submitted.constraint.text)["properties"] == SCHEMA["properties"]
    assert json.loads(submitted.tools)[0]["function"]["name"] == "get_weather"

"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) in process over the fake
engine client: the body's mapping onto chat's domain messages, the event sequence, stop reasons,
errors in Anthropic's shape naming the parameter, x-api-key, and hostile bodies. The official SDK
against a real server: tests/test_anthropic.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from starlette.testclient import TestClient
from test_http_hostile import answer, connect, serving
from test_servicer import FakeEngine

from braid.server.config import ServerConfig
from braid.server.engine.types import Delta, Finished, FinishReason, Timings
from braid.server.http.anthropic_protocol import MessagesRequest
from braid.server.http.anthropic_requests import messages_plan
from braid.server.http.app import OpenAIApi

HI = [{"role": "user", "content": "hi"}]
BODY = {"model": "fake", "max_tokens": 16, "messages": HI}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def serve(engine: FakeEngine | None = None, **config) -> tuple[OpenAIApi, TestClient]:
    api = OpenAIApi(engine or FakeEngine(), ServerConfig(**config))
    return api, TestClient(api.app)


def requests_of(engine: FakeEngine) -> list:
    """The GenerationRequests the engine is given, from now on."""
    seen, submit = [], engine.submit
    engine.submit = lambda ticket, request, *rest, **kw: seen.append(request) or submit(ticket, request, *rest, **kw)
    return seen


def saying(engine: FakeEngine, text: str) -> FakeEngine:
    """The engine's sessions write `text` (in one delta), then end as the engine's sessions do."""
    engine.tokens, submit = [], engine.submit

    def submitted(ticket, request, loop, matcher=None):
        handles = submit(ticket, request, loop, matcher)
        for handle in handles:  # the fake ends its sessions on the loop: this text comes first
            handle.push(Delta(text, [9]))
        return handles

    engine.submit = submitted
    return engine


def events(http: TestClient, body: dict, path: str = "/v1/messages") -> list[tuple[str, dict]]:
    """A streamed message's (event, data) pairs, in order (or another stream's with `event:` lines)."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data) and all(d["type"] == n for n, d in zip(names, data))
    return list(zip(names, data))


def test_a_message_whole_and_streamed():
    _, http = serve()
    whole = http.post("/v1/messages", json=BODY).json()
    assert whole["id"].startswith("msg_") and (whole["type"], whole["role"], whole["model"]) == (
        "message",
        "assistant",
        "fake",
    )
    assert whole["content"] == [{"type": "text", "text": " 5 6 7"}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("max_tokens", None)
    assert whole["usage"] == {"input_tokens": 3, "output_tokens": 3}
    streamed = events(http, BODY)
    assert [name for name, _ in streamed] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = streamed[0][1]["message"]
    assert start["content"] == [] and start["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert streamed[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert streamed[3][1]["delta"] == {"type": "text_delta", "text": " 5 6 7"}
    assert streamed[5][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert streamed[5][1]["usage"] == {"output_tokens": 3}


class StopsOn(FakeEngine):
    """Sessions end on the stop string `stop`."""

    def __init__(self, stop: str) -> None:
        super().__init__()
        self.finish, self.stop = FinishReason.STOP_SEQUENCE, stop

    def _end(self, handle, reason, error=None, field=None) -> None:
        ended = Finished(reason, 3, 3, Timings(1.0, 2.0, 3.0, 4.0), stop_sequence=self.stop)
        self.books.finish(reason, active=0)
        handle.loop.call_soon_threadsafe(handle.push, ended)


@pytest.mark.parametrize(
    "finish, reason",
    [(FinishReason.EOS, "end_turn"), (FinishReason.STOP_TOKEN, "end_turn"), (FinishReason.MAX_TOKENS, "max_tokens")],
)
def test_each_end_is_its_stop_reason(finish, reason):
    engine = FakeEngine()
    engine.finish = finish
    _, http = serve(engine)
    assert http.post("/v1/messages", json=BODY).json()["stop_reason"] == reason


def test_a_stop_sequence_is_named_in_the_message_and_its_delta():
    engine = StopsOn("END")
    seen = requests_of(engine)
    _, http = serve(engine)
    whole = http.post("/v1/messages", json={**BODY, "stop_sequences": ["END", "STOP"]}).json()
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")
    assert seen[0].params.stop == ("END", "STOP")
    delta = events(http, {**BODY, "stop_sequences": ["END"]})[-2][1]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_system_tool_use_and_tool_result_turns_are_chats_domain_messages():
    engine = FakeEngine()
    seen = requests_of(engine)
    _, http = serve(engine)
    body = {
        **BODY,
        "system": [
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": " Really.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        "metadata": {"user_id": "u-1"},
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
    }
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200 and "braid-ignored-fields" not in response.headers
    (request,) = seen
    assert [(m.role, m.content, m.tool_call_id) for m in request.messages] == [
        ("system", "Be brief. Really.", ""),
        ("user", "Weather in Oslo?", ""),
        ("assistant", "Let me look.", ""),
        ("tool", "sunny", "toolu_1"),
        ("tool", "Error: no such city", "toolu_2"),
        ("user", "Thanks.", ""),
    ]
    (call,) = json.loads(request.messages[2].tool_calls)
    assert call == {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    (tool,) = json.loads(request.tools)
    assert tool["function"] == {
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    }
    p = request.params
    assert (p.temperature, p.top_k, p.max_new_tokens) == (0.5, 5, 16) and abs(p.top_p - 0.9) < 1e-6
    assert request.request_id.startswith("msg_")


def plan(**body):
    return messages_plan(MessagesRequest.model_validate({**BODY, **body}), 64, 49152, True)


def test_tool_choice_maps_onto_chats_modes_and_any_and_tool_are_constrained():
    tools = [WEATHER, {**WEATHER, "name": "get_time"}]
    assert (plan(tools=tools).tools, plan(tools=tools).request.constraint) == ("auto", None)
    assert plan(tools=tools, tool_choice={"type": "auto"}).tools == "auto"
    assert plan(tools=tools, tool_choice={"type": "none"}).tools is None
    forced = plan(tools=tools, tool_choice={"type": "any"})
    assert (forced.tools, forced.function) == ("forced", None) and "maxItems" not in forced.request.constraint.text
    single = plan(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert json.loads(single.request.constraint.text)["maxItems"] == 1
    named = plan(tools=tools, tool_choice={"type": "tool", "name": "get_time"})
    assert (named.tools, named.function) == ("forced", "get_time")
    assert json.loads(named.request.constraint.text)["required"] == ["city"]


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    constrained = plan(output_config={"format": {"type": "json_schema", "schema": schema}}).request.constraint
    assert constrained.kind == "json_schema" and json.loads(constrained.text) == schema


def test_thinking_is_the_templates_switch_and_its_budget_the_reasoning_budget():
    enabled = plan(max_tokens=100, thinking={"type": "enabled", "budget_tokens": 40}).request
    assert json.loads(enabled.chat_template_kwargs) == {"enable_thinking": True}
    assert enabled.params.max_reasoning_tokens == 40
    disabled = plan(thinking={"type": "disabled"}).request
    assert json.loads(disabled.chat_template_kwargs) == {"enable_thinking": False}
    assert disabled.params.max_reasoning_tokens is None
    adaptive = plan(thinking={"type": "adaptive"}).request  # the template's default, and no budget
    assert (adaptive.chat_template_kwargs, adaptive.params.max_reasoning_tokens) == ("", None)
    history = [
        *HI,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "Hi!"},
            ],
        },
        *HI,
    ]
    turns = plan(messages=history).request.messages
    assert [(m.role, m.content) for m in turns][1] == ("assistant", "Hi!")  # the thinking dropped


def test_a_forced_tool_call_streams_its_input_as_input_json_deltas():
    engine = saying(FakeEngine(), '{"city": "Oslo"}')
    engine.finish = FinishReason.CONSTRAINT  # a whole call
    _, http = serve(engine)
    body = {**BODY, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    streamed = events(http, body)
    assert [n for n, _ in streamed][1:5] == ["content_block_start", "ping", "content_block_delta", "content_block_stop"]
    start = streamed[1][1]["content_block"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "get_weather", {})
    assert start["id"].startswith("toolu_")
    assert streamed[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}
    assert streamed[-2][1]["delta"]["stop_reason"] == "tool_use"
    whole = http.post("/v1/messages", json=body).json()
    assert [(b["type"], b["input"]) for b in whole["content"]] == [("tool_use", {"city": "Oslo"})]
    assert whole["stop_reason"] == "tool_use"


def test_a_forced_call_cut_by_max_tokens_is_a_tool_use_with_stop_reason_max_tokens():
    _, http = serve(saying(FakeEngine(), '[{"name":"get_weather","arguments":{"city":"Os'))  # then max_tokens
    body = {**BODY, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    whole = http.post("/v1/messages", json=body).json()
    assert whole["stop_reason"] == "max_tokens"
    assert [(b["type"], b["name"], b["input"]) for b in whole["content"]] == [("tool_use", "get_weather", {})]


def test_auto_tool_calls_are_parsed_from_free_output_into_tool_use_blocks():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine = saying(FakeEngine(), "Looking. " + call)
    engine.finish = FinishReason.EOS
    _, http = serve(engine)
    whole = http.post("/v1/messages", json={**BODY, "tools": [WEATHER]}).json()
    assert whole["stop_reason"] == "tool_use"
    text, use = whole["content"]
    assert text == {"type": "text", "text": "Looking. "}
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", {"city": "Oslo"})
    assert use["id"].startswith("toolu_")
    streamed = [d for n, d in events(http, {**BODY, "tools": [WEATHER]}) if n.startswith("content_block")]
    assert [(d["type"], d["index"]) for d in streamed] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]


@pytest.mark.parametrize("takes_tools", [True, False])
def test_count_tokens_counts_the_prompt_its_message_would_have_tools_and_thinking_included(takes_tools):
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, chat_template_takes_tools=takes_tools)
    _, http = serve(engine)
    body = {"model": "fake", "messages": HI, "system": "Be brief.", "tools": [WEATHER], "max_tokns": 1}
    thinking = {"thinking": {"type": "disabled"}}
    response = http.post("/v1/messages/count_tokens", json={**body, **thinking})
    assert response.status_code == 200 and response.json() == {"input_tokens": 2}  # the fake's two tokens
    assert response.headers["braid-ignored-fields"] == "max_tokns"
    message = messages_plan(
        MessagesRequest.model_validate({**body, **thinking, "max_tokens": 16}), 16, 100, takes_tools
    )
    ((_, messages, tools, template_kwargs),) = engine.tokenized
    assert (messages, tools, template_kwargs) == (
        message.request.messages,
        message.request.tools,
        message.request.chat_template_kwargs,
    )
    assert json.loads(template_kwargs) == {"enable_thinking": False}
    if takes_tools:  # the template renders them
        assert messages[0].content == "Be brief." and json.loads(tools)[0]["function"]["name"] == "get_weather"
    else:  # the template would drop them: in the system message, as the message's
        assert tools == "" and "Be brief." in messages[0].content and "get_weather" in messages[0].content


def test_count_tokens_refuses_a_bad_message():
    _, http = serve()
    refused = http.post(
        "/v1/messages/count_tokens", json={"model": "fake", "messages": [{"role": "bot", "content": "x"}]}
    )
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("messages[0].role: ")


BAD = [  # (body beside model, max_tokens and messages; the parameter the message names)
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2147483648}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}],
                }
            ]
        },
        "messages[0].content[0].content[0].type",
    ),
    (
        {"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
        "messages[1].content[0].id",
    ),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),  # not under max_tokens
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "regex", "schema": {}}}}, "output_config.format.type"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences[1]"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"stream": [1]}, "stream"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{p}:{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_400_in_anthropics_shape_naming_the_parameter(extra, param):
    _, http = serve()
    body = {k: v for k, v in {**BODY, **extra}.items() if v is not None}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ": "), error
    assert http.post("/v1/messages", json=BODY).status_code == 200  # and the app goes on


ASKED = '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
HOSTILE = [  # (body, the parameter its error names)
    ("[" * 100_000, "body"),
    ('{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (
        '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
        "messages[0].content[0].text",
    ),
    (ASKED + '"system": ' + "[" * 300 + "]" * 300 + "}", "system"),
    (
        ASKED
        + '"tools": [{"name": "f", "input_schema": '
        + '{"type": "object", "properties": {"a": ' * 450
        + "{}"
        + "}}" * 450
        + "}]}",
        "tools[0].input_schema",
    ),
    (ASKED + '"tools": [{"name": "f", "input_schema": {"properties": {"\\ud800": {}}}}]}', "tools[0].input_schema"),
    (
        ASKED + '"output_config": {"format": {"type": "json_schema", "schema": {"enum": ["\\udc00"]}}}}',
        "output_config.format.schema",
    ),
    ('{"model": "m", "max_tokens": 1e400, "messages": []}', "max_tokens"),
    (
        '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": ['
        + '{"type": "text", "text": "x"},' * 2000
        + "7]}]}",
        "messages[0].content",
    ),
    (b'{"model": "\xff"}', "body"),
]


@pytest.mark.parametrize("body, param", HOSTILE, ids=[f"{p}:{i}" for i, (_, p) in enumerate(HOSTILE)])
def test_a_hostile_body_is_400_naming_the_parameter_never_500(body, param):
    _, http = serve()
    response = http.post("/v1/messages", content=body if isinstance(body, bytes) else body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param + ": "), error


def test_errors_before_and_around_generation_answer_in_anthropics_shape():
    engine = FakeEngine(max_queued=1)
    engine.books.reserve()  # the one place is taken
    api, http = serve(engine, max_message_bytes=1000)
    limited = http.post("/v1/messages", json=BODY)
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
    assert int(limited.headers["retry-after"]) >= 1
    big = http.post("/v1/messages", json={**BODY, "system": "x" * 2000})
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    assert http.get("/v1/messages").json()["error"]["type"] == "invalid_request_error"
    missing = http.post("/v1/messages/nothing", json=BODY)
    assert missing.status_code == 404 and missing.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no route /v1/messages/nothing"},
    }
    api.draining = True
    draining = http.post("/v1/messages", json=BODY)
    assert draining.status_code == 503 and draining.json()["error"]["type"] == "overloaded_error"
    assert "error" in http.post("/v1/chat/completions", json={"messages": HI}).json()  # OpenAI's shape stays


def test_an_engine_failure_mid_stream_is_an_error_event_and_no_message_stop():
    engine = FakeEngine()
    engine.finish, engine.error = FinishReason.ERROR, "forward pass failed: boom"
    _, http = serve(engine)
    streamed = events(http, BODY)
    assert streamed[0][0] == "message_start" and "message_stop" not in [n for n, _ in streamed]
    assert streamed[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "forward pass failed: boom"}},
    )
    whole = http.post("/v1/messages", json=BODY)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "api_error"


def test_the_api_key_is_x_api_key_or_bearer_and_every_key_sent_must_be_right():
    _, http = serve(api_key="k")
    for headers, status in [
        ({}, 401),
        ({"x-api-key": "k"}, 200),
        ({"Authorization": "Bearer k"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({"x-api-key": "k", "Authorization": "Bearer wrong"}, 401),
        ({"x-api-key": "wrong", "Authorization": "Bearer k"}, 401),
    ]:
        response = http.post("/v1/messages", json=BODY, headers=headers)
        assert response.status_code == status, headers
        if status == 401:
            assert response.json()["error"]["type"] == "authentication_error"
    twice = http.post("/v1/messages", json=BODY, headers=[("x-api-key", "k"), ("x-api-key", "other")])
    assert twice.status_code == 401
    assert http.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200  # every route takes it


def closing_cancels(path: str, body: dict, first: str) -> None:
    """A stream closed after its first line (`first`) cancels its session, and not before."""
    engine = FakeEngine()
    engine.hold = True  # the session waits, as a long generation would
    aborted = []
    engine._abort = lambda session_id, reason: aborted.append((session_id, reason))
    _, http = serve(engine)
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines) == first
        assert not aborted
    assert set(aborted) == {(1, FinishReason.CANCELLED)}


def test_closing_a_stream_cancels_its_session():
    closing_cancels("/v1/messages", BODY, "event: message_start")


def test_unknown_fields_are_named_and_strict_refuses_them_naming_the_path():
    _, http = serve()
    response = http.post("/v1/messages", json={**BODY, "service_tier": "auto"})
    assert response.status_code == 200 and response.headers["braid-ignored-fields"] == "service_tier"
    _, strict = serve(strict_request_fields=True)
    body = {**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": []}]}]}
    refused = strict.post("/v1/messages", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("messages[0].content[0].citations: ")
    assert strict.post("/v1/messages", json={**BODY, "thinking": {"type": "disabled"}}).status_code == 200


def test_an_adapter_named_as_the_model_runs_and_answers_under_its_name():
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, model_name="smol", served_model_names=("smol",))
    engine.load_lora("sql", "/adapters/sql")
    seen = requests_of(engine)
    _, http = serve(engine)
    assert http.post("/v1/messages", json={**BODY, "model": "sql"}).json()["model"] == "sql"
    assert seen[0].adapter == "sql"


def test_a_head_over_the_bound_on_a_messages_path_is_431_in_anthropics_shape():
    with serving(http_max_header_bytes=8192, http_max_headers=20) as port:
        for path, shape in ((b"/v1/messages", "type"), (b"/v1/chat/completions", "error")):
            with connect(port) as sock:
                sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
                response = answer(sock)
            body = json.loads(response.split(b"\r\n\r\n")[1])
            assert response.startswith(b"HTTP/1.1 431 ") and shape in body
        assert body["error"]["type"] == "invalid_request_error"

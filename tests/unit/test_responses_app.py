"""OpenAI's Responses API (/v1/responses, stateless) in process over the fake engine client: each
input item's mapping onto chat's domain messages, the event sequence, incomplete on
max_output_tokens, refusals naming the field as the Responses API spells it, and hostile bodies.
The official SDK against a real server: tests/test_responses.py."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from test_anthropic_app import closing_cancels, requests_of, saying, serve
from test_anthropic_app import events as named_events
from test_servicer import FakeEngine

from braid.server.engine.types import FinishReason
from braid.server.http.requests import Plan
from braid.server.http.responses_protocol import ResponsesRequest
from braid.server.http.responses_requests import responses_plan

BODY = {"model": "fake", "input": "hi"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def events(http: TestClient, body: dict) -> list[tuple[str, dict]]:
    """A streamed response's (event, data) pairs, in order, their sequence numbers checked."""
    streamed = named_events(http, body, "/v1/responses")
    assert [d["sequence_number"] for _, d in streamed] == list(range(len(streamed)))
    return streamed


def test_a_response_whole_and_streamed_is_incomplete_at_max_output_tokens():
    _, http = serve()  # the fake's sessions end at max_tokens
    whole = http.post("/v1/responses", json=BODY).json()
    assert whole["id"].startswith("resp_") and (whole["object"], whole["model"]) == ("response", "fake")
    assert (whole["status"], whole["incomplete_details"], whole["error"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
        None,
    )
    (message,) = whole["output"]
    assert message["id"].startswith("msg_") and (message["type"], message["role"], message["status"]) == (
        "message",
        "assistant",
        "incomplete",
    )
    assert message["content"] == [{"type": "output_text", "text": " 5 6 7", "annotations": []}]
    assert whole["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 6,
    }
    assert (whole["tools"], whole["tool_choice"], whole["parallel_tool_calls"], whole["store"]) == (
        [],
        "auto",
        True,
        False,
    )
    streamed = events(http, BODY)
    assert [n for n, _ in streamed] == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.incomplete"]
    created = streamed[0][1]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    added = streamed[2][1]["item"]
    assert added == {**message, "id": added["id"], "status": "in_progress", "content": []}
    assert streamed[4][1]["delta"] == " 5 6 7" and streamed[5][1]["text"] == " 5 6 7"
    last = streamed[-1][1]["response"]
    assert last["status"] == "incomplete" and last["output"][0]["content"][0]["text"] == " 5 6 7"


@pytest.mark.parametrize("finish", [FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.CONSTRAINT])
def test_any_other_end_is_completed(finish):
    engine = FakeEngine()
    engine.finish = finish
    _, http = serve(engine)
    whole = http.post("/v1/responses", json=BODY).json()
    assert (whole["status"], whole["incomplete_details"]) == ("completed", None)
    assert whole["output"][0]["status"] == "completed" and whole["completed_at"] >= whole["created_at"]
    assert events(http, BODY)[-1][0] == "response.completed"


def test_every_input_item_kind_maps_onto_chats_domain_messages():
    engine = FakeEngine()
    seen = requests_of(engine)
    _, http = serve(engine)
    body = {
        "model": "fake",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_3", "output": "?"},
            {"role": "system", "content": "Answer now."},
        ],
        "tools": [WEATHER],
        "metadata": {"team": "a"},
        "user": "u-1",
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 16,
        "store": False,
        "reasoning": {"effort": None, "summary": "auto"},
    }
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200 and "braid-ignored-fields" not in response.headers
    (request,) = seen
    assert [(m.role, m.content, m.tool_call_id) for m in request.messages] == [
        ("system", "Be brief.", ""),
        ("system", "Use tools.", ""),
        ("user", "Weather in Oslo?", ""),
        ("assistant", "Let me look.", ""),
        ("tool", "sunny", "call_1"),
        ("tool", "rain", "call_2"),
        ("assistant", "", ""),
        ("tool", "?", "call_3"),
        ("system", "Answer now.", ""),
    ]
    calls = json.loads(request.messages[3].tool_calls)
    assert [(c["id"], c["function"]) for c in calls] == [
        ("call_1", {"name": "get_weather", "arguments": '{"city": "Oslo"}'}),
        ("call_2", {"name": "get_weather", "arguments": '{"city": "Bergen"}'}),
    ]
    assert json.loads(request.messages[6].tool_calls)[0]["id"] == "call_3"
    (tool,) = json.loads(request.tools)
    assert tool["function"] == {k: v for k, v in WEATHER.items() if k != "type"}
    p = request.params
    assert (p.temperature, p.max_new_tokens) == (0.5, 16) and abs(p.top_p - 0.9) < 1e-6
    whole = response.json()
    assert (whole["metadata"], whole["user"], whole["instructions"], whole["max_output_tokens"]) == (
        {"team": "a"},
        "u-1",
        "Be brief.",
        16,
    )
    assert whole["tools"] == [WEATHER] and whole["temperature"] == 0.5


def plan(**body) -> Plan:
    return responses_plan(ResponsesRequest.model_validate({**BODY, **body}), 64, 49152, True)[0]


def test_tool_choice_and_text_format_map_onto_chats_modes_and_constraints():
    tools = [WEATHER, {**WEATHER, "name": "get_time"}]
    assert (plan(tools=tools).tools, plan(tools=tools).request.constraint) == ("auto", None)
    assert plan(tools=tools, tool_choice="none").tools is None
    forced = plan(tools=tools, tool_choice="required")
    assert (forced.tools, forced.function) == ("forced", None) and "maxItems" not in forced.request.constraint.text
    single = plan(tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.request.constraint.text)["maxItems"] == 1
    named = plan(tools=tools, tool_choice={"type": "function", "name": "get_time"})
    assert (named.tools, named.function) == ("forced", "get_time")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    constrained = plan(text={"format": fmt}).request.constraint
    assert constrained.kind == "json_schema" and json.loads(constrained.text) == schema
    assert plan(text={"format": {"type": "json_object"}}).request.constraint.kind == "json_object"
    assert plan(text={"format": {"type": "text"}}).request.constraint is None
    assert plan(reasoning={"effort": "none"}).request.request_id.startswith("resp_")


def test_a_forced_call_streams_its_arguments_as_a_function_call_item():
    engine = saying(FakeEngine(), '{"city": "Oslo"}')
    engine.finish = FinishReason.CONSTRAINT  # a whole call
    _, http = serve(engine)
    body = {**BODY, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    streamed = events(http, body)
    assert [n for n, _ in streamed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = streamed[2][1]["item"]
    assert (added["type"], added["name"], added["arguments"], added["status"]) == (
        "function_call",
        "get_weather",
        "",
        "in_progress",
    )
    assert added["id"].startswith("fc_") and added["call_id"].startswith("call_")
    assert streamed[3][1]["delta"] == '{"city": "Oslo"}' and streamed[4][1]["arguments"] == '{"city": "Oslo"}'
    done = streamed[5][1]["item"]
    assert done == {**added, "arguments": '{"city": "Oslo"}', "status": "completed"}
    assert streamed[-1][1]["response"]["output"] == [done]
    (call,) = http.post("/v1/responses", json=body).json()["output"]
    assert (call["type"], call["arguments"], call["status"]) == ("function_call", '{"city": "Oslo"}', "completed")


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_function_call():
    _, http = serve(saying(FakeEngine(), '[{"name":"get_weather","arguments":{"city":"Os'))  # then max_tokens
    whole = http.post("/v1/responses", json={**BODY, "tools": [WEATHER], "tool_choice": "required"}).json()
    assert (whole["status"], whole["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    (call,) = whole["output"]
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "incomplete")


def test_auto_tool_calls_are_parsed_from_free_output_after_the_text():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine = saying(FakeEngine(), "Looking. " + call)
    engine.finish = FinishReason.EOS
    _, http = serve(engine)
    whole = http.post("/v1/responses", json={**BODY, "tools": [WEATHER]}).json()
    message, use = whole["output"]
    assert message["content"][0]["text"] == "Looking. " and message["status"] == "completed"
    assert (use["type"], use["name"], json.loads(use["arguments"])) == (
        "function_call",
        "get_weather",
        {"city": "Oslo"},
    )
    streamed = events(http, {**BODY, "tools": [WEATHER]})
    items = [(n, d["output_index"]) for n, d in streamed if n.startswith("response.output_item")]
    assert items == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 1),
    ]


def test_nothing_said_is_one_empty_message():
    engine = FakeEngine()
    engine.tokens, engine.finish = [], FinishReason.EOS
    _, http = serve(engine)
    (message,) = http.post("/v1/responses", json=BODY).json()["output"]
    assert message["content"] == [{"type": "output_text", "text": "", "annotations": []}]
    assert [n for n, _ in events(http, BODY)][2:-1] == [n for n in TEXT_EVENTS if n != "response.output_text.delta"]


def test_store_is_taken_and_named_as_ignored_and_unknown_fields_as_chats():
    _, http = serve()
    stored = http.post("/v1/responses", json={**BODY, "store": True, "service_tier": "auto"})
    assert stored.status_code == 200 and stored.headers["braid-ignored-fields"] == "service_tier, store"
    assert stored.json()["store"] is False
    _, strict = serve(strict_request_fields=True)
    body = {**BODY, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "cache": 1}]}]}
    refused = strict.post("/v1/responses", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[0].content[0].cache"
    assert strict.post("/v1/responses", json={**BODY, "store": True}).status_code == 200


BAD = [  # (body beside model and input; the parameter the error names)
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2147483648}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"content": "x"}]}, "input[0].type"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": ["hi", {"role": "user", "content": "x"}, {"role": "user", "content": 5}]}, "input[0]"),
    (
        {
            "input": [
                {"role": "user", "content": "x"},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}],
                },
            ]
        },
        "input[1].content[1].type",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
        "input[0].output[0].type",
    ),
    ({"input": [{"role": "user", "content": "x" * 2_000_000}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "regex"}}}, "text.format.type"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        "tool_choice",
    ),
    ({"metadata": {"a": 5}}, "metadata.a"),
    ({"stream": [1]}, "stream"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{p}:{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_400_in_openais_shape_naming_the_parameter(extra, param):
    _, http = serve()
    body = {k: v for k, v in {**BODY, **extra}.items() if v is not None}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert error["message"].startswith(param + ": ")
    assert http.post("/v1/responses", json=BODY).status_code == 200  # and the app goes on


ASKED = '{"model": "m", "input": "hi", '
HOSTILE = [  # (body, the parameter its error names)
    ("[" * 100_000, "body"),
    ('{"model": "m", "input": "\\ud800"}', "input"),
    (
        '{"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a\\udfffb"}]}]}',
        "input[0].content[0].text",
    ),
    ('{"model": "m", "input": ' + "[" * 300 + "]" * 300 + "}", "input"),
    (
        ASKED
        + '"tools": [{"type": "function", "name": "f", "parameters": '
        + '{"type": "object", "properties": {"a": ' * 450
        + "{}"
        + "}}" * 450
        + "}]}",
        "tools[0].parameters",
    ),
    (
        ASKED + '"tools": [{"type": "function", "name": "f", "parameters": {"properties": {"\\ud800": {}}}}]}',
        "tools[0].parameters",
    ),
    (
        ASKED + '"text": {"format": {"type": "json_schema", "name": "x", "schema": {"enum": ["\\udc00"]}}}}',
        "text.format.schema",
    ),
    ('{"model": "m", "max_output_tokens": 1e400, "input": "hi"}', "max_output_tokens"),
    (b'{"model": "\xff"}', "body"),
]


@pytest.mark.parametrize("body, param", HOSTILE, ids=[f"{p}:{i}" for i, (_, p) in enumerate(HOSTILE)])
def test_a_hostile_body_is_400_naming_the_parameter_never_500(body, param):
    _, http = serve()
    response = http.post("/v1/responses", content=body if isinstance(body, bytes) else body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_an_engine_failure_mid_stream_is_response_failed_and_nothing_after():
    engine = FakeEngine()
    engine.finish, engine.error = FinishReason.ERROR, "forward pass failed: boom"
    _, http = serve(engine)
    streamed = events(http, BODY)
    assert streamed[0][0] == "response.created" and streamed[-1][0] == "response.failed"
    assert not {"response.completed", "response.incomplete"} & {n for n, _ in streamed}
    failed = streamed[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {
        "code": "server_error",
        "message": "forward pass failed: boom",
        "param": None,
        "type": "internal_error",
    }
    whole = http.post("/v1/responses", json=BODY)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "internal_error"


def test_a_field_the_engine_finds_invalid_is_named_as_the_responses_api_names_it():
    engine = FakeEngine()
    engine.finish, engine.error = FinishReason.INVALID_REQUEST, "cannot be compiled"
    engine.error_field = "response_format.json_schema.schema"
    _, http = serve(engine)
    body = {**BODY, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}
    whole = http.post("/v1/responses", json=body)
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "text.format.schema"
    failed = events(http, body)[-1][1]["response"]["error"]
    assert (failed["code"], failed["param"]) == ("invalid_prompt", "text.format.schema")


def test_errors_before_generation_and_the_api_key():
    engine = FakeEngine(max_queued=1)
    engine.books.reserve()  # the one place is taken
    api, http = serve(engine, max_message_bytes=1000, api_key="k")
    key = {"Authorization": "Bearer k"}
    assert http.post("/v1/responses", json=BODY).status_code == 401
    assert http.post("/v1/responses", json=BODY, headers={"x-api-key": "wrong"}).status_code == 401
    limited = http.post("/v1/responses", json=BODY, headers=key)
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
    big = http.post("/v1/responses", json={**BODY, "input": "x" * 2000}, headers=key)
    assert big.status_code == 413 and "error" in big.json()
    assert http.get("/v1/responses", headers=key).status_code == 405
    api.draining = True
    assert http.post("/v1/responses", json=BODY, headers=key).status_code == 503


def test_closing_a_stream_cancels_its_session():
    closing_cancels("/v1/responses", BODY, "event: response.created")


def test_an_adapter_named_as_the_model_runs_and_answers_under_its_name():
    engine = FakeEngine()
    engine.load_lora("sql", "/adapters/sql")
    seen = requests_of(engine)
    _, http = serve(engine)
    assert http.post("/v1/responses", json={**BODY, "model": "sql"}).json()["model"] == "sql"
    assert seen[0].adapter == "sql" and seen[0].request_id.startswith("resp_")

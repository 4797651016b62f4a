"""OpenAI's requests to braid's, and tool calls read back from output: pure functions, no server."""

from __future__ import annotations

import json

import pytest

from braid.server.engine.types import RANGED, InvalidArgument
from braid.server.frontend import tools
from braid.server.http.choices import ChatChoice
from braid.server.http.protocol import ChatRequest, CompletionRequest, shown, unknown_fields
from braid.server.http.requests import chat_plan, completion_plan


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [{"role": "user", "content": "hi"}]


def chat(**body):
    return chat_plan(ChatRequest.model_validate({"model": "m", "messages": CHAT, **body}), 256, 1000)


def test_openai_fields_become_braids_sampling_params():
    plan = chat(
        max_completion_tokens=9,
        temperature=0.5,
        top_p=0.9,
        stop="x",
        seed=3,
        n=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"7": 5.0},
        logprobs=True,
        top_logprobs=2,
        top_k=4,
        min_p=0.1,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=1,
        cache_salt="s",
        priority="batch",
    )
    p, req = plan.request.params, plan.request
    # as over gRPC, floats pass through the .proto's float32
    assert (p.max_new_tokens, p.temperature, p.top_p, p.stop, p.seed, req.n) == (
        9,
        0.5,
        pytest.approx(0.9),
        ("x",),
        3,
        2,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, ((7, 5.0),))
    assert (p.logprobs, p.top_logprobs, p.top_k) == (True, 2, 4)
    assert (p.min_p, p.repetition_penalty) == (pytest.approx(0.1), pytest.approx(1.1))
    assert (p.ignore_eos, p.min_new_tokens, req.cache_salt, req.priority.name) == (True, 1, "s", "BATCH")
    assert chat().request.params.temperature == 1.0  # OpenAI's default, not braid's greedy 0


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=2), "top_p"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(n=100), "n"),
        (dict(n=0), "n"),
        (dict(stop=["s"] * 20), "stop"),
        (dict(seed=-1), "seed"),
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(frequency_penalty=-5), "frequency_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias[x]"),
        (dict(logit_bias={"5000": 1}), "logit_bias[5000]"),
        (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(typical_p=0), "typical_p"),
        (dict(typical_p=1.5), "typical_p"),
        (dict(repetition_penalty=-1), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
        ),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    ],
)
def test_a_bad_parameter_is_named_as_openai_names_it(body, param):
    with pytest.raises(InvalidArgument) as caught:
        chat(**body)
    assert caught.value.field == param


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(echo=True), "echo"),
        (dict(logprobs=50), "logprobs"),
        (dict(prompt=["a", "b"]), "prompt"),
        (dict(max_tokens=-2), "max_tokens"),
        (dict(typical_p=0.0), "typical_p"),
    ],
)
def test_a_bad_completion_parameter_is_named(body, param):
    with pytest.raises(InvalidArgument) as caught:
        completion_plan(CompletionRequest.model_validate({"prompt": "hi", **body}), 256, 1000)
    assert caught.value.field == param


@pytest.mark.parametrize(
    "prompt, ids, text",
    [([5, 0, 999], (5, 0, 999), None), ([[7, 8]], (7, 8), None), (["hi"], (), "hi"), ("hi", (), "hi")],
)
def test_a_completion_prompt_of_token_ids_becomes_prompt_token_ids(prompt, ids, text):
    req = completion_plan(CompletionRequest.model_validate({"prompt": prompt}), 256, 1000).request
    assert (req.prompt_token_ids, req.prompt) == (ids, text)


@pytest.mark.parametrize(
    "prompt, param, says",
    [
        ([1, 2, 3, 1000], "prompt[3]", "outside the vocabulary"),
        ([4, -1], "prompt[1]", "outside the vocabulary"),
        ([[1, 1000]], "prompt[0][1]", "outside the vocabulary"),
        ([], "prompt", "must not be empty"),
        ([[]], "prompt[0]", "must not be empty"),
        ([[1, 2], [3, 4]], "prompt", "2 prompts"),
        (["a", "b"], "prompt", "2 prompts"),
    ],
)
def test_a_bad_prompt_of_token_ids_is_named_as_openai_names_it(prompt, param, says):
    with pytest.raises(InvalidArgument) as caught:
        completion_plan(CompletionRequest.model_validate({"prompt": prompt}), 256, 1000)
    assert caught.value.field == param and says in caught.value.description


def test_response_formats_and_forced_tools_become_constraints():
    assert chat(response_format={"type": "json_object"}).request.constraint.kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).request.constraint
    assert (c.kind, json.loads(c.text)) == ("json_schema", schema)
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.request.constraint.text) == {
        **WEATHER["function"]["parameters"],
        "x-guidance": {"whitespace_flexible": False},
    }
    assert (named.tools, named.function) == ("forced", "get_weather")
    assert json.loads(named.request.tools)[0]["function"]["name"] == "get_weather"  # rendered by the template
    required = chat(tools=[WEATHER], tool_choice="required")
    assert json.loads(required.request.constraint.text)["type"] == "array"
    assert chat(tools=[WEATHER]).tools == "auto" and chat(tools=[WEATHER]).request.constraint is None
    assert chat(tools=[WEATHER], tool_choice="none").request.tools == ""


def test_tool_turns_reach_the_template_with_their_calls_and_ids():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    plan = chat(
        tools=[WEATHER],
        messages=[
            *CHAT,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assistant, tool = plan.request.messages[1:]
    assert json.loads(assistant.tool_calls) == [call] and (tool.role, tool.tool_call_id) == ("tool", "call_1")


def test_hermes_tool_calls_are_parsed_with_the_content_before_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tools.parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_llama3_json_tool_calls_are_parsed():
    content, calls = tools.parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _, calls = tools.parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in calls] == ["a", "b"]


@pytest.mark.parametrize("text", ["plain text", '{"not": "a call"}', "<tool_call>{broken</tool_call>", ""])
def test_output_with_no_well_formed_call_is_all_content(text):
    assert tools.parse_tool_calls(text) == (text, [])


def test_a_stream_holds_back_only_what_may_begin_a_call():
    assert tools.held_from("Hello <tool") == len("Hello ")
    assert tools.held_from("Hello") == 5
    assert tools.held_from('  {"name"') == 0
    assert tools.held_from("a <tool_call>{") == 2


def test_streamed_auto_choice_sends_content_then_the_calls_at_its_end():
    choice = ChatChoice(chat(tools=[WEATHER]))
    pieces = ["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    deltas = [choice.feed(p) for p in pieces]
    assert "".join(d["content"] for d in deltas if d) == "Sure. "
    last = choice.end()
    assert last["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice.message()["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_named_call_streams_its_arguments_as_they_come():
    choice = ChatChoice(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    first, second = choice.feed('{"city": '), choice.feed('"Oslo"}')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second["tool_calls"][0]["function"] == {"arguments": '"Oslo"}'} and "id" not in second["tool_calls"][0]
    assert choice.end() is None and json.loads(choice.message()["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Oslo"
    }


# A tool whose parameters refer to their own $defs, and to their own root: pydantic writes such
# schemas for nested models (issue 39, item 15)
ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            },
            "required": ["items"],
            "$defs": {"Item": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        },
    },
}


def _compile_error(constraint) -> str:
    """llguidance's error for the constraint ("" when it compiles), as the engine compiles it."""
    import llguidance

    from braid.server.engine.grammars import grammar_text

    return llguidance.LLMatcher.validate_grammar(grammar_text(constraint))


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "order"}}], ids=["required", "named"]
)
def test_a_forced_call_of_a_tool_whose_parameters_use_defs_compiles_and_means_the_same(choice):
    import jsonschema

    plan = chat(tools=[WEATHER, ORDER], tool_choice=choice)
    assert _compile_error(plan.request.constraint) == ""
    schema = json.loads(plan.request.constraint.text)
    good = {"items": [{"x": 1}], "then": {"items": []}}
    bad = {"items": [{"x": 1}], "then": {"items": [{"x": "one"}]}}  # the nested order's item is no Item
    if choice == "required":
        good, bad = [{"name": "order", "arguments": good}], [{"name": "order", "arguments": bad}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    assert chat(tools=[WEATHER, ORDER]).request.constraint is None  # auto: no constraint at all


def test_a_forced_schema_leaves_refs_inside_data_and_tools_without_refs_as_they_are():
    enum = {"type": "object", "properties": {"a": {"enum": [{"$ref": "#/x"}]}}}
    tool = {"type": "function", "function": {"name": "e", "parameters": enum}}
    schema = tools.forced_schema([WEATHER, tool], None)
    assert "$defs" not in schema and schema["items"]["anyOf"][1]["properties"]["arguments"] == enum


def test_a_forced_call_cut_short_comes_back_as_its_calls_so_far_never_as_content():
    names = ("get_weather", "order")
    required = ChatChoice(chat(tools=[WEATHER, ORDER], tool_choice="required"))
    streamed = required.feed(
        '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"order","arguments":{"items":[{"x"'
    )
    # the whole call as its JSON closed; the one cut short at the end, as far as it got
    assert [(c["index"], c["function"]) for c in streamed["tool_calls"]] == [
        (0, {"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    ]
    last = required.end()
    assert [(c["index"], c["function"]) for c in last["tool_calls"]] == [
        (1, {"name": "order", "arguments": '{"items":[{"x"'})
    ]
    assert not required.has_calls  # finish_reason length, not tool_calls
    message = required.message()
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == list(names)
    # cut inside a name: the one tool it can begin; inside the first key: the only tool
    for text, expected in [('[{"name":"ord', "order"), ('[{"name":"get_weather"', "get_weather")]:
        assert [c.name for c in tools.cut_calls(text, None, names)] == [expected]
    assert [c.name for c in tools.cut_calls('[{"na', None, ("get_weather",))] == []
    deep = '[{"name":"order","arguments":{"items":' + "[" * 5000  # past json's recursion limit: cut all the same
    assert [(c.name, c.arguments) for c in tools.cut_calls(deep, None, names)] == [("order", deep[29:])]
    named = ChatChoice(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    streamed = named.feed('{"city": "Os')
    assert named.end() is None and not named.has_calls  # its arguments went out as they came
    assert named.message()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Os'}
    assert streamed["tool_calls"][0]["id"] == named.message()["tool_calls"][0]["id"]


def test_tools_go_into_the_system_message_where_the_template_does_not_render_them():
    body = ChatRequest.model_validate({"model": "m", "messages": CHAT, "tools": [WEATHER]})
    plan = chat_plan(body, 256, 1000, takes_tools=False)
    system, user = plan.request.messages
    assert system.role == "system" and plan.request.tools == "" and user.content == "hi"
    assert json.dumps(WEATHER["function"]["parameters"], separators=(",", ":")) in system.content
    assert "<tool_call>" in system.content  # the shape parse_tool_calls reads back
    _, calls = tools.parse_tool_calls(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert calls[0].name == "get_weather"
    own = ChatRequest.model_validate(
        {"messages": [{"role": "system", "content": "Be brief."}, *CHAT], "tools": [WEATHER], "tool_choice": "required"}
    )
    system, _ = chat_plan(own, 256, 1000, takes_tools=False).request.messages
    assert system.content.startswith("Be brief.\n\n") and "get_weather" in system.content
    assert chat_plan(body, 256, 1000).request.messages == (plan.request.messages[1],)  # a template that takes them
    none = ChatRequest.model_validate({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert len(chat_plan(none, 256, 1000, takes_tools=False).request.messages) == 1


def test_unknown_fields_are_named_at_any_depth_and_chat_template_kwargs_is_known():
    body = ChatRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi", "refusal": None, "cache_control": {"type": "x"}}],
            "max_tokns": 9,
            "tools": [{"type": "function", "function": {"name": "f", "strictt": True}}],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert unknown_fields(body) == ["max_tokns", "messages[0].cache_control", "tools[0].function.strictt"]
    assert json.loads(chat_plan(body, 256, 1000).request.chat_template_kwargs) == {"enable_thinking": False}
    assert chat(max_tokens=3).request.chat_template_kwargs == ""
    assert shown("a\n\u00e9" + "x" * 200) == "a\\n\\u00e9" + "x" * 88 + "..."


def test_each_sampling_parameter_is_a_body_field_of_chat_and_completions_read_by_its_name():
    for model in (ChatRequest, CompletionRequest):
        missing = [param.name for param in RANGED if param.name not in model.model_fields]
        assert not missing, f"http/protocol.py's {model.__name__} has no {missing}"
    assert chat().request.params.typical_p == 1.0
    assert chat(typical_p=0.5).request.params.typical_p == 0.5
    completion = completion_plan(CompletionRequest.model_validate({"prompt": "hi", "typical_p": 0.2}), 256, 1000)
    assert completion.request.params.typical_p == pytest.approx(0.2)  # as the .proto's float32

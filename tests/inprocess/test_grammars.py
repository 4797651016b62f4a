"""The constraint compiler (engine/grammars.py) on the embedded model's vocabulary: cached by text,
refused with the field named, and bounded in time."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from braid.server.engine.grammars import Grammars
from braid.server.engine.types import Constraint, InvalidArgument


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


# The tests of what a compile finds run with no time limit (compile_timeout_s=None): under load a
# compile (the first builds llguidance's tokenizer too) can pass the default 5 s, and the test then
# got the limit's refusal instead of what it checks. The limit has its own test.


def test_a_constraint_compiles_once_and_each_session_gets_its_own_matcher(tokenizer):
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=None)
    regex = Constraint("regex", "(yes|no)", "constraint.regex")
    first, second = grammars.matcher(regex), grammars.matcher(regex)
    assert grammars.num_compiled == 1 and first is not second
    assert first.consume_token(tokenizer.encode("yes")[0]) and not second.is_error()


def test_a_compile_past_its_time_limit_is_invalid_argument_naming_the_field(tokenizer):
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=1e-6)
    grammars.tokenizer()  # built at start-up, not part of a request's compile
    schema = Constraint(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', "constraint.json_schema"
    )
    with pytest.raises(InvalidArgument) as err:
        grammars.matcher(schema)
    assert err.value.field == "constraint.json_schema" and "did not compile within" in err.value.description


def _deep_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def test_a_schema_nested_past_pythons_recursion_limit_is_invalid_argument(tokenizer):
    # json.loads raised RecursionError at 1,000 levels: INTERNAL with a traceback in the log.
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=None)
    for depth in (300, 1000, 5000):
        with pytest.raises(InvalidArgument) as err:
            grammars.matcher(Constraint("json_schema", _deep_schema(depth), "constraint.json_schema"))
        assert err.value.field == "constraint.json_schema"


def _optional_properties(n: int) -> Constraint:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    return Constraint("json_schema", json.dumps(schema), "constraint.json_schema")


def test_a_schema_the_matcher_cannot_run_is_refused_before_its_stream_starts(tokenizer):
    # 500 optional properties compiled, then failed the session at its first token with a 13 KB
    # parser dump ("Current row has 2007 items; max is 2000"). No compile timeout: 3,000 properties
    # take seconds to compile, past the default 5 s on a loaded machine, and this is the probe's
    # refusal, not the timeout's (the test above has that).
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=None)
    for n in (500, 3000):
        with pytest.raises(InvalidArgument) as err:
            grammars.matcher(_optional_properties(n))
        assert err.value.field == "constraint.json_schema"
        assert "limits" in err.value.description and len(err.value.description) <= 600, err.value.description
    assert not grammars.matcher(_optional_properties(100)).is_error()  # a smaller one runs


def test_the_cache_is_bounded_by_the_memory_its_templates_hold(tokenizer):
    # 256 entries of ~27 MB each (65,000-character regexes) let one client take a server to 6 GB.
    rng = random.Random(0)
    budget = 60 * 2**20
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=60, cache_bytes=budget)
    regexes = ["".join(rng.choice("abcdefghij") for _ in range(65_000)) for _ in range(5)]
    for regex in regexes:
        grammars.matcher(Constraint("regex", regex, "constraint.regex"))
        assert grammars.cached_bytes <= budget
    kept = len(grammars._templates)
    assert 1 <= kept < len(regexes), kept  # each entry's cost was measured: tens of MB, not its text
    assert grammars.cached_bytes >= kept * 5 * 2**20
    grammars.matcher(Constraint("regex", regexes[-1], "constraint.regex"))  # the newest is still cached
    assert grammars.num_compiled == len(regexes)

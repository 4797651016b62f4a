"""The constraint compiler (engine/grammars.py) on the embedded model's vocabulary: cached by text,
refused with the field named, and bounded in time."""

from __future__ import annotations

import json
import random
import threading

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from braid.server.config import EngineConfig
from braid.server.engine import grammars as grammars_module
from braid.server.engine.engine import Engine
from braid.server.engine.grammars import Grammars
from braid.server.engine.types import Constraint, InvalidArgument
from unit.engine_fakes import INFO, NumberTokenizer, ScriptedRunner


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    """llguidance's tokenizer of the embedded model's vocabulary, as Grammars builds it (0.6 s of CPU
    each time), built once for the module."""
    return grammars_module._llguidance_tokenizer(tokenizer, 49152, [2])


def _grammars(tokenizer, llg_tokenizer, **config) -> Grammars:
    """Grammars over the embedded model's vocabulary with llguidance's tokenizer of it already built:
    for the tests of what a compile does, not of building it (those make a Grammars of their own)."""
    grammars = Grammars(tokenizer, [2], 49152, **config)
    grammars._tokenizer = llg_tokenizer
    return grammars


# The tests of what a compile finds run with no time limit (compile_timeout_s=None): under load a
# compile can pass the default 5 s, and the test then got the limit's refusal instead of what it
# checks. The limit has its own test.


def test_a_constraint_compiles_once_and_each_session_gets_its_own_matcher(tokenizer, llg_tokenizer):
    grammars = _grammars(tokenizer, llg_tokenizer, compile_timeout_s=None)
    regex = Constraint("regex", "(yes|no)", "constraint.regex")
    first, second = grammars.matcher(regex), grammars.matcher(regex)
    assert grammars.num_compiled == 1 and first is not second
    assert first.consume_token(tokenizer.encode("yes")[0]) and not second.is_error()


def test_a_compile_past_its_time_limit_is_invalid_argument_naming_the_field(tokenizer, llg_tokenizer):
    """The compile is held until the call has given up on it. Left to run, a small schema's compile
    could finish inside even a 1e-6 s limit: the caller's thread, descheduled between handing the
    compile to the pool and waiting on it, found it done (a failure seen on a busy 2-core machine)."""
    grammars = _grammars(tokenizer, llg_tokenizer, compile_timeout_s=1e-6)
    compile_, released = grammars._compile, threading.Event()

    def held(text: str):
        released.wait(timeout=60)  # a bound on the pool thread only: the call under test never waits on it
        return compile_(text)

    grammars._compile = held
    schema = Constraint(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', "constraint.json_schema"
    )
    try:
        with pytest.raises(InvalidArgument) as err:
            grammars.matcher(schema)
    finally:
        released.set()
    assert err.value.field == "constraint.json_schema" and "did not compile within" in err.value.description


def _deep_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def test_a_schema_nested_past_pythons_recursion_limit_is_invalid_argument(tokenizer, llg_tokenizer):
    # json.loads raised RecursionError at 1,000 levels: INTERNAL with a traceback in the log.
    grammars = _grammars(tokenizer, llg_tokenizer, compile_timeout_s=None)
    for depth in (300, 1000, 5000):
        with pytest.raises(InvalidArgument) as err:
            grammars.matcher(Constraint("json_schema", _deep_schema(depth), "constraint.json_schema"))
        assert err.value.field == "constraint.json_schema"


def _optional_properties(n: int) -> Constraint:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    return Constraint("json_schema", json.dumps(schema), "constraint.json_schema")


def test_a_schema_the_matcher_cannot_run_is_refused_before_its_stream_starts(tokenizer, llg_tokenizer):
    # 500 optional properties compiled, then failed the session at its first token with a 13 KB
    # parser dump ("Current row has 2007 items; max is 2000"). No compile timeout: 3,000 properties
    # take seconds to compile, past the default 5 s on a loaded machine, and this is the probe's
    # refusal, not the timeout's (the test above has that).
    grammars = _grammars(tokenizer, llg_tokenizer, compile_timeout_s=None)
    for n in (500, 3000):
        with pytest.raises(InvalidArgument) as err:
            grammars.matcher(_optional_properties(n))
        assert err.value.field == "constraint.json_schema"
        assert "limits" in err.value.description and len(err.value.description) <= 600, err.value.description
    assert not grammars.matcher(_optional_properties(100)).is_error()  # a smaller one runs


def test_the_cache_is_bounded_by_the_memory_its_templates_hold(tokenizer, llg_tokenizer):
    # 256 entries of ~27 MB each (65,000-character regexes) let one client take a server to 6 GB.
    rng = random.Random(0)
    budget = 60 * 2**20
    grammars = _grammars(tokenizer, llg_tokenizer, compile_timeout_s=60, cache_bytes=budget)
    regexes = ["".join(rng.choice("abcdefghij") for _ in range(65_000)) for _ in range(5)]
    for regex in regexes:
        grammars.matcher(Constraint("regex", regex, "constraint.regex"))
        assert grammars.cached_bytes <= budget
    kept = len(grammars._templates)
    assert 1 <= kept < len(regexes), kept  # each entry's cost was measured: tens of MB, not its text
    assert grammars.cached_bytes >= kept * 5 * 2**20
    grammars.matcher(Constraint("regex", regexes[-1], "constraint.regex"))  # the newest is still cached
    assert grammars.num_compiled == len(regexes)


def test_an_engine_starts_without_building_the_constraint_tokenizer(tokenizer):
    # Every start built it in a thread of its own: 0.8 s of CPU on a slow core, for servers that may
    # never be sent a constraint. The first constrained call builds it now.
    grammars = Grammars(tokenizer, [2], 49152)
    built = threading.Event()
    grammars.tokenizer = built.set  # type: ignore[method-assign]
    Engine(EngineConfig(max_wait_ms=0), ScriptedRunner(), NumberTokenizer(), INFO, grammars)
    assert not built.wait(0.5)


def test_the_first_constrained_call_builds_the_tokenizer_outside_the_compile_time_limit(tokenizer, monkeypatch):
    # Built on the compile's pool thread, its 0.4 s would count against --constraint-compile-timeout:
    # it is built on the calling thread, before the compile is timed.
    threads = []
    build = grammars_module._llguidance_tokenizer

    def spy(*args):
        threads.append(threading.current_thread())
        return build(*args)

    monkeypatch.setattr(grammars_module, "_llguidance_tokenizer", spy)
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=None)
    grammars.matcher(Constraint("regex", "(yes|no)", "constraint.regex"))
    grammars.matcher(Constraint("regex", "(a|b)", "constraint.regex"))
    assert threads == [threading.current_thread()]


def test_the_constraint_tokenizer_is_llguidances_own(tokenizer, llg_tokenizer):
    # built from the Rust tokenizer's JSON without llguidance.hf's copy of it: the same vocabulary,
    # token bytes, special tokens and tokenization
    ours = llg_tokenizer  # grammars_module._llguidance_tokenizer's
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152, eos_token=[2])
    assert (ours.vocab_size, ours.eos_tokens, ours.is_canonical) == (
        theirs.vocab_size,
        theirs.eos_tokens,
        theirs.is_canonical,
    )
    for token in range(ours.vocab_size):
        assert ours.decode_bytes([token]) == theirs.decode_bytes([token]), token
        assert ours.is_special_token(token) == theirs.is_special_token(token), token
    text = 'Le {"café": [1, 2.5e-3]} <|im_start|>user\n  naïve\t😀'
    assert ours.tokenize_str(text, parse_special=True) == theirs.tokenize_str(text, parse_special=True)


def test_a_tokenizer_with_truncation_set_is_copied_as_llguidance_does(tokenizer):
    truncated = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    truncated.backend_tokenizer.enable_truncation(8)
    built = grammars_module._llguidance_tokenizer(truncated, 49152, [2])
    assert len(built.tokenize_str("one two three four five six seven eight nine ten eleven")) > 8
    assert truncated.backend_tokenizer.truncation is not None  # the model's own tokenizer untouched

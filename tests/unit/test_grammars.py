"""The constraint compiler (engine/grammars.py) on the embedded model's vocabulary: cached by text,
refused with the field named, and bounded in time."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from braid.server.engine.grammars import Grammars
from braid.server.engine.types import Constraint, InvalidArgument


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def test_a_constraint_compiles_once_and_each_session_gets_its_own_matcher(tokenizer):
    grammars = Grammars(tokenizer, [2], 49152)
    regex = Constraint("regex", "(yes|no)", "constraint.regex")
    first, second = grammars.matcher(regex), grammars.matcher(regex)
    assert grammars.num_compiled == 1 and first is not second
    assert first.consume_token(tokenizer.encode("yes")[0]) and not second.is_error()


def test_a_compile_past_its_time_limit_is_invalid_argument_naming_the_field(tokenizer):
    grammars = Grammars(tokenizer, [2], 49152, compile_timeout_s=1e-6)
    grammars.tokenizer()  # built at start-up, not part of a request's compile
    schema = Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}',
                        "constraint.json_schema")
    with pytest.raises(InvalidArgument) as err:
        grammars.matcher(schema)
    assert err.value.field == "constraint.json_schema" and "did not compile within" in err.value.description

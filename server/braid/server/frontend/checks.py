"""The checks every front end makes of a request, on the engine's GenerationRequest (as TGI's router
checks one request for every route): exactly one of prompt, messages and prompt_token_ids, sizes and
counts, ranges, strings, the logit bias, token ids. A front end translates its own request into a
GenerationRequest as it came (defaults applied, nothing clipped), then calls `check_request`; a
constraint is checked as it is made (`constraint`, `choice`). The engine checks the prompt's length
once it is tokenized.

The checks name braid's fields (the engine's, which the .proto shares); `spelling` names each as the
calling front end does (over OpenAI's HTTP API, max_new_tokens is max_tokens). What a field's error
says is the same from every front end.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Sequence

from braid.server.engine.types import RANGED, Constraint, GenerationRequest, InvalidArgument, Turn, text_bytes

# the sampling parameters' limits are declared with them (runner/rows.py's Sampling); these named here too
from braid.server.engine.types import MAX_REPETITION_PENALTY as MAX_REPETITION_PENALTY
from braid.server.engine.types import MAX_TEMPERATURE as MAX_TEMPERATURE

MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 64
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_BYTES = 128
MAX_CACHE_SALT_BYTES = 256
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 16
MAX_TEXT_BYTES = 1 << 20  # a prompt, or all messages together
MAX_TOKEN_IDS = MAX_TEXT_BYTES  # prompt_token_ids, Detokenize's ids: what a text of MAX_TEXT_BYTES may hold
MAX_CONSTRAINT_BYTES = 64 << 10  # a schema, regex or grammar
MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 1024

# OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) as a reasoning budget
# (max_reasoning_tokens): "none" thinks not at all
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}

# braid's name of a field (`max_new_tokens`, `stop[1]`, `messages[0].role`) -> the front end's
Spelling = Callable[[str], str]


def braids(field: str) -> str:
    """braid's own spelling, the .proto's: a field as the checks name it."""
    return field


def check_request(req: GenerationRequest, vocab_size: int, spelling: Spelling = braids) -> None:
    """Checks every field of the request but its constraint; an error names the field in `spelling`."""
    try:
        _check(req, vocab_size)
    except InvalidArgument as exc:
        raise InvalidArgument(spelling(exc.field), exc.description) from None


def _check(req: GenerationRequest, vocab_size: int) -> None:
    p = req.params
    _prompt(req, vocab_size)
    if p.max_new_tokens < 0:
        raise InvalidArgument("max_new_tokens", f"{p.max_new_tokens} is negative")
    if p.min_new_tokens < 0:
        raise InvalidArgument("min_new_tokens", f"{p.min_new_tokens} is negative")
    if p.min_new_tokens > p.max_new_tokens:
        raise InvalidArgument("min_new_tokens", f"{p.min_new_tokens} is more than max_new_tokens ({p.max_new_tokens})")
    for param in RANGED:  # temperature, top_p, ...: each against the range it is declared with
        lo, hi, lo_open, _ = param.limits
        in_range(param.name, getattr(p, param.name), lo, vocab_size if hi is None else hi, lo_open)
    _logit_bias(p.logit_bias, vocab_size)
    if req.n > MAX_SAMPLES:
        raise InvalidArgument("n", f"{req.n} samples; at most {MAX_SAMPLES}")
    if p.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"{p.top_logprobs} is more than {MAX_TOP_LOGPROBS}")
    _strings("stop", p.stop, MAX_STOP_STRINGS)
    if p.stop and p.skip_detokenize:
        raise InvalidArgument("stop", "stop strings match text, and skip_detokenize makes none: use stop_token_ids")
    _strings("bad_words", p.bad_words, MAX_BAD_WORDS)
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("stop_token_ids", f"{len(p.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    in_vocabulary("stop_token_ids", p.stop_token_ids, vocab_size)
    check_request_id(req.request_id)
    if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument("cache_salt", f"is {len(req.cache_salt.encode())} bytes; at most {MAX_CACHE_SALT_BYTES}")
    if req.resume_token_ids and req.n > 1:
        raise InvalidArgument("resume_token_ids", "resume one sample at a time (n = 1)")
    in_vocabulary("resume_token_ids", req.resume_token_ids, vocab_size)
    if p.max_reasoning_tokens is not None and p.max_reasoning_tokens < 0:
        raise InvalidArgument("max_reasoning_tokens", f"{p.max_reasoning_tokens} is negative")


def sampling_values(given: Callable[[str], float | None]) -> dict[str, Any]:
    """The numeric sampling parameters (temperature, top_p, ...: engine/types.RANGED) of a front
    end's request, copied by name: given(name) is the request's value, None where it leaves the
    field unset. Unset is the parameter's default, and so is 0 where the .proto cannot tell 0 from
    unset (Limits.zero_unset). Nothing is checked here: check_request checks them."""
    values: dict[str, Any] = {}
    for param in RANGED:
        value = given(param.name)
        unset = value is None or (value == 0 and param.limits.zero_unset)
        values[param.name] = param.default if unset else value
    return values


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_BYTES or not all(" " <= c <= "~" for c in request_id):
        # it travels back as gRPC metadata, which holds printable ASCII only
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_BYTES} printable ASCII characters")


def effort_budget(effort: str | None, field: str) -> int | None:
    """A reasoning effort's budget (EFFORT_BUDGETS; None: no budget); an unknown effort names `field`."""
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidArgument(field, f"{effort!r}: one of {', '.join(EFFORT_BUDGETS)}")
    return EFFORT_BUDGETS[effort]


def with_enable_thinking(template_kwargs: str, enable_thinking: bool | None) -> str:
    """The chat template's variables (a JSON object's text, or "") with enable_thinking set, where
    the request sets it; a variable the caller set by name is kept."""
    if enable_thinking is None:
        return template_kwargs
    kwargs = json.loads(template_kwargs) if template_kwargs else {}
    return json.dumps({"enable_thinking": enable_thinking, **kwargs})


def _prompt(req: GenerationRequest, vocab_size: int) -> None:
    """Exactly one of prompt, messages and prompt_token_ids, each within its limits."""
    ids = req.prompt_token_ids
    if not ids:
        if not req.prompt and not req.messages:
            raise InvalidArgument("prompt", "set one of prompt, messages and prompt_token_ids")
        check_text(req.prompt or "", req.messages, "prompt")
        return
    if req.prompt or req.messages:
        raise InvalidArgument("prompt_token_ids", "set one of prompt, messages and prompt_token_ids, not more")
    check_token_ids("prompt_token_ids", ids, vocab_size)


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Ids given instead of a text (a prompt's, Detokenize's): as many as a text of MAX_TEXT_BYTES
    could have at most (a token covers a byte or more), each inside the vocabulary."""
    if len(token_ids) > MAX_TOKEN_IDS:
        raise InvalidArgument(name, f"{len(token_ids)} ids; at most {MAX_TOKEN_IDS}")
    in_vocabulary(name, token_ids, vocab_size)


def check_text(text: str, messages: Sequence[Turn], text_field: str) -> None:
    """Exactly one of a text (`text_field`: a prompt, Tokenize's text) and messages, of at most
    MAX_TEXT_BYTES, and every message with its role."""
    if text and messages:
        raise InvalidArgument(text_field, f"set either {text_field} or messages, not both")
    if not text and not messages:
        raise InvalidArgument(text_field, f"set {text_field} or messages")
    size = text_bytes(text, messages)
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument(text_field if text else "messages", f"is {size} bytes; at most {MAX_TEXT_BYTES}")
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidArgument(f"messages[{i}].role", "is required")


def in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    if math.isnan(value) or value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise InvalidArgument(name, f"{value} is outside {bracket}{lo}, {hi}]")


def constraint(kind: str, text: str, field: str) -> Constraint:
    """A constraint whose text is a schema, a regex or a grammar (`kind`), from the request's
    `field` (the front end's name), its size checked (the engine's compiler checks the rest)."""
    if not text:
        raise InvalidArgument(field, "is empty")
    size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(field, f"is {size} bytes; at most {MAX_CONSTRAINT_BYTES}")
    return Constraint(kind, text, field)


def choice(choices: Sequence[str], field: str) -> Constraint:
    """A constraint to one of `choices`, from the request's `field` (the front end's name)."""
    if not choices or len(choices) > MAX_CHOICES:
        raise InvalidArgument(field, f"{len(choices)} choices; 1 to {MAX_CHOICES}")
    for i, text in enumerate(choices):
        if not text or len(text.encode()) > MAX_CHOICE_BYTES:
            raise InvalidArgument(f"{field}[{i}]", f"must be 1 to {MAX_CHOICE_BYTES} bytes")
    return Constraint("choice", json.dumps(list(choices)), field)


def _strings(name: str, values: Sequence[str], most: int) -> None:
    """A list of strings (stop, bad_words): at most `most`, none empty or over MAX_STOP_BYTES."""
    if len(values) > most:
        raise InvalidArgument(name, f"{len(values)} strings; at most {most}")
    for i, value in enumerate(values):
        if not value:
            raise InvalidArgument(f"{name}[{i}]", "is empty")
        if len(value.encode()) > MAX_STOP_BYTES:
            raise InvalidArgument(f"{name}[{i}]", f"is longer than {MAX_STOP_BYTES} bytes")


def in_vocabulary(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{name}[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")


def _logit_bias(bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument("logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in bias:
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"logit_bias[{token}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
        in_range(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

"""Structured output: a request's constraint compiled into a matcher that says, at every step, which
tokens keep the output a prefix of something the constraint accepts.

The compiler and the matchers are llguidance's (chosen by measurement, docs/grammar_libs.md): it
compiles a new JSON schema in about 2 ms where xgrammar took 0.25-3.5 s, bounds its own work per
grammar and per step ("fuel"), and keeps special tokens out of masks. braid's own part is only the
glue: one tokenizer view built once, a cache of compiled templates keyed by the constraint's text
(a cached constraint costs a deep copy), a wall-clock limit on compiling, and errors as
INVALID_ARGUMENT naming the field.

Matchers are handed to the runner in its rows, which fills their token masks during the forward
pass; the engine advances them with each accepted token (engine/output.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Sequence

import llguidance
import llguidance.hf
from braid.server.engine.types import Constraint, InvalidArgument

_LOGGER = logging.getLogger(__name__)

# Compiled templates kept: a template costs tens of KB, and requests that share a schema share one.
CACHE_SIZE = 256


def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text (cheap: the compiler checks the rest). Raises
    InvalidArgument naming the constraint's field where the conversion fails."""
    try:
        return _grammar_text(constraint.kind, constraint.text)
    except ValueError as exc:  # not JSON, not a schema, a grammar that does not parse
        raise InvalidArgument(constraint.field, str(exc)) from None


def _grammar_text(kind: str, text: str) -> str:
    if kind == "json_schema":
        schema = json.loads(text)  # a JSONDecodeError is a ValueError
        if not isinstance(schema, (dict, bool)):
            raise ValueError("is not a JSON Schema (an object or a boolean)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)  # text: the choices as a JSON list
    return llguidance.grammar_from(kind, text)  # "lark" or "gbnf"


class Grammars:
    """Compiles constraints into matchers; any thread may call `matcher`."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int], vocab_size: int,
                 compile_timeout_s: float = 5.0) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # Compiling runs here, so a call can stop waiting for it; llguidance drops the GIL meanwhile.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="braid-grammar")
        self.num_compiled = 0

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: built once (about half a second), on first use."""
        with self._lock:
            if self._tokenizer is None:
                started = time.monotonic()
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos_token_ids)
                _LOGGER.info("constraint tokenizer ready in %.2f s", time.monotonic() - started)
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for one session. Raises InvalidArgument naming the constraint's field for
        a constraint the compiler rejects or cannot compile within compile_timeout_s."""
        text = grammar_text(constraint)
        with self._lock:
            template = self._templates.get(text)
            if template is not None:
                self._templates.move_to_end(text)
                return template.deep_copy()
        future = self._pool.submit(self._compile, text)
        try:
            template = future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidArgument(constraint.field, f"did not compile within {self.compile_timeout_s:g} s "
                                  "(--constraint-compile-timeout)") from None
        if template.is_error():
            raise InvalidArgument(constraint.field, template.get_error())
        with self._lock:
            self._templates[text] = template
            while len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        return template.deep_copy()

    def _compile(self, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask builds the lexer: fail here, not in a pass
        self.num_compiled += 1
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""Structured output: a request's constraint compiled into a matcher that says, at every step, which
tokens keep the output a prefix of something the constraint accepts.

The compiler and the matchers are llguidance's (chosen by measurement, docs/grammar_libs.md): it
compiles a new JSON schema in about 2 ms where xgrammar took 0.25-3.5 s, bounds its own work per
grammar and per step ("fuel"), and keeps special tokens out of masks. braid's own part is only the
glue: one tokenizer view built once, a cache of compiled templates keyed by the constraint's text
(a cached constraint costs a deep copy) and bounded by the memory they hold, a wall-clock limit on
compiling, a probe of the first tokens so that a constraint the matcher cannot run is refused before
its stream starts, and errors as INVALID_ARGUMENT naming the field, short enough for any status.

Matchers are handed to the runner in its rows, which fills their token masks during the forward
pass; the engine advances them with each accepted token (engine/output.py).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence, cast

import llguidance
import llguidance.hf
from braid.server.engine.tokenizer import HfTokenizer
from braid.server.engine.types import Constraint, InvalidArgument

_LOGGER = logging.getLogger(__name__)

# The compiled templates kept, by the memory they hold (--constraint-cache-memory). An entry costs
# from tens of KB (a small schema) to tens of MB (a 65,000-character literal regex: 27 MB).
DEFAULT_CACHE_BYTES = 256 * 2**20
# Compiles run at most this many at a time, on threads of their own.
COMPILE_THREADS = 2
# llguidance's limits as they are, but errors without its parser-state dumps (13-80 KB each).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# A compiler or matcher message is cut to this many characters: it goes into a gRPC status, whose
# whole trailer a default client caps at 8 KB (past it the client sees RESOURCE_EXHAUSTED).
MAX_ERROR_CHARS = 500
# The probe: a few of the first allowed tokens, at each of the first steps (see _probe); it costs
# 5-40 ms once per distinct constraint (cached after), most of it computing masks.
PROBE_TOKENS = 8
PROBE_STEPS = 6


def short(message: str) -> str:
    """A compiler's or matcher's message, cut to MAX_ERROR_CHARS on one line."""
    line = " ".join(message.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"


def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text (cheap: the compiler checks the rest). Raises
    InvalidArgument naming the constraint's field where the conversion fails."""
    try:
        return _grammar_text(constraint.kind, constraint.text)
    except RecursionError:  # json.loads (or the schema compiler) past Python's recursion limit
        raise InvalidArgument(constraint.field, "is nested too deeply") from None
    except ValueError as exc:  # not JSON, not a schema, a grammar that does not parse
        raise InvalidArgument(constraint.field, short(str(exc))) from None


def _grammar_text(kind: str, text: str) -> str:
    if kind == "json_schema":
        schema = json.loads(text)  # a JSONDecodeError is a ValueError
        if not isinstance(schema, (dict, bool)):
            raise ValueError("is not a JSON Schema (an object or a boolean)")
        # a boolean schema is a JSON Schema too, and llguidance takes it; its stub says str or dict
        return llguidance.LLMatcher.grammar_from_json_schema(schema)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)  # text: the choices as a JSON list
    return llguidance.grammar_from(cast(llguidance.GrammarFormat, kind), text)  # "lark" or "gbnf"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _allocator() -> Callable[[], int] | None:
    """glibc's count of the bytes malloc has handed out (llguidance's Rust code allocates through
    it), or None where there is no mallinfo2 (musl, macOS)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2

    def allocated() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return allocated


_allocated = _allocator()


Matcher = llguidance.LLMatcher  # a constraint compiled for one session: what it may generate next


class Grammars:
    """Compiles constraints into matchers; any thread may call `matcher`."""

    def __init__(
        self,
        hf_tokenizer: HfTokenizer,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        compile_timeout_s: float | None = 5.0,  # None: no limit (tests of what a compile finds)
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # text -> (template, the bytes it holds), least recently used first
        self._templates: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self.cached_bytes = 0
        # Compiling runs here, so a call can stop waiting for it; llguidance drops the GIL meanwhile.
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="braid-grammar")
        self.num_compiled = 0

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: built once, by the first constrained call (0.4 s of
        CPU for the embedded model's 49,152 tokens on a slow core). Every start built it, in a thread
        of its own: 0.8 s of a tiny server's 2.4 s of CPU, paid by the many servers (and the hundreds
        the tests start) that are never sent a constraint."""
        with self._lock:
            if self._tokenizer is None:
                started = time.monotonic()
                self._tokenizer = _llguidance_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids)
                _LOGGER.info("constraint tokenizer ready in %.2f s", time.monotonic() - started)
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for one session. Raises InvalidArgument naming the constraint's field for
        a constraint the compiler rejects, cannot compile within compile_timeout_s, or whose matcher
        fails on its first tokens. Blocks while it compiles: call it off the event loop."""
        text = grammar_text(constraint)
        with self._lock:
            entry = self._templates.get(text)
            if entry is not None:
                self._templates.move_to_end(text)
                return entry[0].deep_copy()
        self.tokenizer()  # the first constrained call builds it, outside the compile's time limit
        future = self._pool.submit(self._compile, text)
        try:
            template, cost = future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidArgument(
                constraint.field, f"did not compile within {self.compile_timeout_s:g} s (--constraint-compile-timeout)"
            ) from None
        if template.is_error():
            raise InvalidArgument(constraint.field, short(template.get_error()))
        failure = _probe(template, self._eos_token_ids)
        if failure is not None:
            raise InvalidArgument(constraint.field, f"goes past the constraint engine's limits: {short(failure)}")
        self._keep(text, template, cost)
        return template.deep_copy()

    def _keep(self, text: str, template: llguidance.LLMatcher, cost: int) -> None:
        """Caches a template, dropping the least recently used ones while the cache holds more than
        cache_bytes (a template bigger than that is not kept at all)."""
        if cost > self.cache_bytes:
            return
        with self._lock:
            if text in self._templates:
                return
            self._templates[text] = (template, cost)
            self.cached_bytes += cost
            while self.cached_bytes > self.cache_bytes:
                _, (_, dropped) = self._templates.popitem(last=False)
                self.cached_bytes -= dropped

    def _compile(self, text: str) -> tuple[llguidance.LLMatcher, int]:
        """A template and the bytes it holds: what malloc handed out while it was built (an upper
        bound while another compile runs beside it), and at least the grammar's own text."""
        before = _allocated() if _allocated else 0
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0, limits=LIMITS)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask builds the lexer: fail here, not in a pass
        grew = _allocated() - before if _allocated else 0
        self.num_compiled += 1
        return matcher, max(grew, len(text))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _llguidance_tokenizer(hf_tokenizer: HfTokenizer, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance.hf.from_tokenizer's tokenizer, without its copy of the Rust tokenizer (a third of
    the build) where there is nothing to take off it: the copy exists to turn padding and truncation
    off before it is written out as JSON, and braid never turns them on."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos_token_ids)


def _probe(template: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> str | None:
    """The matcher's error, if one shows on its first tokens: a grammar can compile and still
    need more than llguidance's limits allow at its first step (a schema of 500 optional
    properties: "Current row has 2007 items; max is 2000" once `{` is consumed). For PROBE_STEPS
    steps, consumes each of up to PROBE_TOKENS allowed tokens (spread over the mask) in a copy,
    then goes on from the first that worked, with the tokens the grammar forces after it (a
    required property's name). Costs a few milliseconds; a matcher that fails later still ends
    its session with INVALID_ARGUMENT (FinishReason.INVALID_REQUEST)."""
    state = template.deep_copy()
    eos = set(eos_token_ids)
    for _ in range(PROBE_STEPS):
        mask = state.compute_bitmask()
        if state.is_error():
            return state.get_error()
        allowed = [t for t in _allowed(mask) if t not in eos]
        if not allowed:
            return None
        step = max(1, len(allowed) // PROBE_TOKENS)
        following: llguidance.LLMatcher | None = None
        for token in allowed[::step][:PROBE_TOKENS]:
            tried = state.deep_copy()
            if not tried.consume_token(token):
                return tried.get_error() or f"token {token} was allowed, then refused"
            following = following or tried
        assert following is not None  # allowed is not empty: one token at least was tried
        state = following
        forced = state.compute_ff_tokens()
        if forced and not state.consume_tokens(forced):
            return state.get_error() or "a forced token was refused"
    return None


def _allowed(mask: bytes) -> list[int]:
    """The token ids a bitmask allows (bit t % 32 of little-endian word t // 32)."""
    ids = []
    for i, byte in enumerate(mask):
        while byte:
            low = byte & -byte
            ids.append(i * 8 + low.bit_length() - 1)
            byte ^= low
    return ids

"""Fault injection for resilience tests, through the ports: BRAID_INJECT_FAULT=<where>:<value>.

Kept out of the production package: `python -m braid_testing.serve` (which BraidProcess runs when its
environment names a fault) hands these to the composition root (cli.main's `ports`), which wraps the
runner, the tokenizer and the constraint compiler in them; `braid serve` wraps nothing.

`pass:<id>` raises inside the forward pass of any batch that feeds token <id> (only that pass's
sessions must fail); `thread:<id>` kills the model thread itself (the server must turn NOT_SERVING and
exit non-zero); `delay:<ms>` makes every forward pass take <ms> longer, a slow model, so a test's
stream outlasts its deadline or grace period however fast the machine; `tokenize:<ms>` makes every
request's tokenization take <ms> longer, so a call can end while its prompt is being tokenized;
`compile:<path>` holds every request's constraint compile until the file <path> exists (a slow
compile that the test ends when it has seen what it needs, not after a fixed delay it must outwait);
`hold:<path>` holds every forward pass while the file <path> exists, so that a test can keep a call's
sessions in the engine, unfinished, for as long as it needs them there (a held model, not a slow one
that a fast machine would outrun).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Sequence

ENV = "BRAID_INJECT_FAULT"
_LOGGER = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


class InjectedThreadDeath(BaseException):
    pass


@dataclass(frozen=True)
class Faults:
    where: str | None = None
    token_id: int = -1
    delay_s: float = 0.0
    release: str = ""  # compile's file (held until it exists), hold's (held while it exists)

    @classmethod
    def from_env(cls) -> Faults:
        spec = os.environ.get(ENV)
        if not spec:
            return cls()
        where, _, value = spec.partition(":")
        try:
            if where in ("delay", "tokenize"):
                return cls(where, delay_s=float(value) / 1000)
            if where in ("pass", "thread"):
                return cls(where, int(value))
            if where in ("compile", "hold") and value:
                return cls(where, release=value)
        except ValueError:
            pass
        raise ValueError(
            f"{ENV}={spec!r}: expected pass:<token id>, thread:<token id>, delay:<ms>, tokenize:<ms>, compile:<path> or hold:<path>"
        )

    def runner(self, runner):
        return _FaultyRunner(runner, self) if self.where in ("pass", "thread", "delay", "hold") else runner

    def tokenizer(self, tokenizer):
        return _SlowTokenizer(tokenizer, self.delay_s) if self.where == "tokenize" else tokenizer

    def grammars(self, grammars):
        return _HeldGrammars(grammars, Path(self.release)) if self.where == "compile" else grammars


class _Wrapped:
    """Everything of the wrapped object, but what the subclass overrides."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _FaultyRunner(_Wrapped):
    def __init__(self, runner, faults: Faults) -> None:
        super().__init__(runner)
        self._faults = faults

    def run(self, rows: Sequence):
        faults = self._faults
        if faults.where == "delay":
            time.sleep(faults.delay_s)
        while faults.where == "hold" and os.path.exists(faults.release):
            time.sleep(0.01)
        hit = any(faults.token_id in row.token_ids for row in rows)
        if faults.where == "thread" and hit:
            raise InjectedThreadDeath(f"injected by {ENV}")
        if faults.where == "pass" and hit:
            raise InjectedFault(f"injected by {ENV}")
        return self._inner.run(rows)


class _SlowTokenizer(_Wrapped):
    def __init__(self, tokenizer, delay_s: float) -> None:
        super().__init__(tokenizer)
        self._delay_s = delay_s

    def encode(self, prompt, messages, tools="", template_kwargs=""):
        time.sleep(self._delay_s)
        return self._inner.encode(prompt, messages, tools, template_kwargs)


class _HeldGrammars(_Wrapped):
    def __init__(self, grammars, release: Path) -> None:
        super().__init__(grammars)
        self._release = release

    def matcher(self, constraint):
        _LOGGER.info("%s: a compile held until %s exists", ENV, self._release)  # a test can see it started
        while not self._release.exists():
            time.sleep(0.01)
        return self._inner.matcher(constraint)

"""Fault injection for resilience tests: BRAID_INJECT_FAULT=<where>:<value>.

`pass:<id>` raises inside the forward pass of any batch that feeds token <id> (only that pass's
sessions must fail); `thread:<id>` kills the model thread itself (the server must turn NOT_SERVING and
exit non-zero); `delay:<ms>` makes every forward pass take <ms> longer, a slow model, so a test's
stream outlasts its deadline or grace period however fast the machine; `tokenize:<ms>` makes every
request's tokenization take <ms> longer, so a call can end while its prompt is being tokenized;
`compile:<ms>` makes every request's constraint take <ms> longer to compile (a slow compile).
Unset, it costs one attribute check per pass.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence

ENV = "BRAID_INJECT_FAULT"
_LOGGER = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


class InjectedThreadDeath(BaseException):
    pass


@dataclass(frozen=True)
class FaultInjector:
    where: str | None = None
    token_id: int = -1
    delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = os.environ.get(ENV)
        if not spec:
            return cls()
        where, _, value = spec.partition(":")
        if where in ("delay", "tokenize", "compile"):
            return cls(where, delay_s=float(value) / 1000)
        if where not in ("pass", "thread"):
            raise ValueError(f"{ENV}={spec!r}: expected pass:<token id>, thread:<token id>, delay:<ms>, "
                             "tokenize:<ms> or compile:<ms>")
        return cls(where, int(value))

    def _hit(self, work: Sequence) -> bool:
        return any(self.token_id in w.session.token_ids[w.session.num_cached:] for w in work)

    def before_tokenize(self) -> None:
        if self.where == "tokenize":
            time.sleep(self.delay_s)

    def before_compile(self) -> None:
        if self.where == "compile":
            _LOGGER.info("%s: a compile held for %g s", ENV, self.delay_s)  # a test can see it started
            time.sleep(self.delay_s)

    def before_pass(self, work: Sequence) -> None:
        if self.where == "delay":
            time.sleep(self.delay_s)
        if self.where == "thread" and self._hit(work):
            raise InjectedThreadDeath(f"injected by {ENV}")

    def inside_pass(self, work: Sequence) -> None:
        if self.where == "pass" and self._hit(work):
            raise InjectedFault(f"injected by {ENV}")

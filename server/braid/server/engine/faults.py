"""Fault injection for resilience tests: BRAID_INJECT_FAULT=<where>:<token id>.

`pass:<id>` raises inside the forward pass of any batch that feeds token <id> (only that pass's
sessions must fail); `thread:<id>` kills the model thread itself (the server must turn NOT_SERVING and
exit non-zero). Unset, it costs one attribute check per pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

ENV = "BRAID_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


class InjectedThreadDeath(BaseException):
    pass


@dataclass(frozen=True)
class FaultInjector:
    where: str | None = None
    token_id: int = -1

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = os.environ.get(ENV)
        if not spec:
            return cls()
        where, _, token = spec.partition(":")
        if where not in ("pass", "thread"):
            raise ValueError(f"{ENV}={spec!r}: expected pass:<token id> or thread:<token id>")
        return cls(where, int(token))

    def _hit(self, work: Sequence) -> bool:
        return any(self.token_id in w.session.token_ids[w.session.num_cached:] for w in work)

    def before_pass(self, work: Sequence) -> None:
        if self.where == "thread" and self._hit(work):
            raise InjectedThreadDeath(f"injected by {ENV}")

    def inside_pass(self, work: Sequence) -> None:
        if self.where == "pass" and self._hit(work):
            raise InjectedFault(f"injected by {ENV}")

"""Each constrained session's matcher, on the model thread, from the session's add until it ends.

A request's constraint is compiled at admission (engine/grammars.py) into a matcher for each of its
sessions; this keeps them by session id. The matcher holds the answer only: while a reasoning model
reasons (engine/reasoning.py) its constraint waits, and `of` gives none; at the opening of an
output that may open a reasoning, the start marker's first token is allowed besides, and never
reaches the matcher (`taking`). The runner fills the matcher's token masks in its rows
(engine/core.py), the output advances it with each token (engine/output.py), and the speculator
cuts proposals it forbids (`proposals`, engine/speculation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from braid.server.engine.grammars import Matcher, short
from braid.server.engine.reasoning import Phase, Reasoning, Reasonings
from braid.server.engine.types import GenerationRequest, InvalidArgument

if TYPE_CHECKING:
    from braid.server.engine.session import Session


@dataclass
class _Constrained:
    matcher: Matcher
    field: str  # the request field the constraint came in (constraint.regex, ...)


class Constraints:
    """The constrained sessions' matchers, by session id (model thread only)."""

    def __init__(self, reasonings: Reasonings) -> None:
        self.reasonings = reasonings  # while a session reasons, its constraint waits
        self._sessions: dict[int, _Constrained] = {}

    def add(self, session_id: int, matcher: Matcher, field: str) -> None:
        self._sessions[session_id] = _Constrained(matcher, field)

    def of(self, s: Session) -> Matcher | None:
        """The matcher that holds the session's next token: none without a constraint, and none
        while the model reasons (a constraint applies to the answer)."""
        constrained = self._sessions.get(s.id)
        if constrained is None:
            return None
        reasoning = self.reasonings.of(s)
        if reasoning is not None and not reasoning.applies_constraint:
            return None
        return constrained.matcher

    def taking(self, s: Session, token: int) -> Matcher | None:
        """The matcher that takes `token`, the session's next (read before the session's reasoning
        takes it): none without a constraint, for a reasoning's tokens and for its markers."""
        constrained = self._sessions.get(s.id)
        if constrained is None:
            return None
        reasoning = self.reasonings.of(s)
        return constrained.matcher if reasoning is None or reasoning.holds(token) else None

    def proposals(self, s: Session, proposals: Sequence[int]) -> tuple[int, ...]:
        """The first of a speculator's proposals that the session's constraint allows, in order.
        None from a start marker that would open a reasoning: the constraint must not check the
        reasoning's tokens. (A guard: at the opening a session has generated nothing, and only
        decoding sessions propose; the pass that computes the prompt's end samples the marker.)"""
        matcher = self.of(s)
        if not proposals or matcher is None:
            return tuple(proposals)
        reasoning = self.reasonings.of(s)
        if reasoning is not None and proposals[0] in reasoning.opening_tokens():
            return ()
        return tuple(proposals[: matcher.validate_tokens(list(proposals))])

    def failure(self, s: Session) -> tuple[str, str]:
        """Why the session's constraint refused a token, short enough for a gRPC status, and the
        request field the constraint came in."""
        constrained = self._sessions.get(s.id)
        error = constrained.matcher.get_error() if constrained is not None else None
        field = constrained.field if constrained is not None else ""
        return "goes past the constraint engine's limits: " + short(error or "a token was refused"), field

    def release(self, s: Session) -> None:
        """The session has ended: its matcher goes."""
        self._sessions.pop(s.id, None)

    def session_ids(self) -> set[int]:
        return set(self._sessions)


def check_resumed(
    request: GenerationRequest, matcher: Matcher, reasoning: Reasoning | None, eos_token_ids: Sequence[int]
) -> None:
    """resume_token_ids must be output the constraint allows: walked in a copy of the matcher (and
    past a reasoning's tokens, in `reasoning`, a fresh one this walk may advance) as the model
    thread will replay them (a stop token or a completing end-of-sequence ends them)."""
    if not request.resume_token_ids:
        return
    walk = matcher.deep_copy()
    for i, token in enumerate(request.resume_token_ids):
        holds = reasoning is None or reasoning.holds(token)
        if token in request.params.stop_token_ids:
            return
        if token in eos_token_ids and (walk.is_accepting() if holds else not request.params.ignore_eos):
            return
        opening = reasoning.forced() if reasoning is not None and reasoning.phase is Phase.OPENING else ()
        if opening and token != opening[0]:  # the rest of a start marker, which braid writes
            raise InvalidArgument(
                "resume_token_ids", f"token {i} ({token}) is not the rest of the reasoning's start marker"
            )
        if reasoning is not None:
            reasoning.add(token)
        if holds and not walk.consume_token(token):
            raise InvalidArgument(
                "resume_token_ids",
                f"token {i} ({token}) is not output the request's constraint allows after the ones before it",
            )

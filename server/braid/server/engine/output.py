"""A session's output: stop rules, text that is safe to send, and the events that carry them to
the session's event loop, one wake-up per loop per step. Its per-session state (tokens not yet in
an event, the last queue position sent) is kept by session id until the session ends."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from braid.server.engine.constraints import Constraints
from braid.server.engine.handle import SessionHandle
from braid.server.engine.reasoning import Reasonings
from braid.server.engine.session import Session
from braid.server.engine.types import Delta, Event, Finished, FinishReason, Queued, Timings
from braid.server.runner.rows import TokenLogprob

if TYPE_CHECKING:
    from braid.server.engine.speculation import Speculation


@dataclass
class _Unsent:
    """A session's generated tokens not yet in a Delta, and their logprobs where asked for."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Output:
    """Model thread only. Its events are taken once a step (`take`) and handed to the sessions'
    event loops by `deliver`."""

    def __init__(
        self, eos_token_ids: Sequence[int], max_seq_len: int, constraints: Constraints, reasonings: Reasonings
    ) -> None:
        """constraints and reasonings: the sessions' matchers and reasonings, which their tokens advance."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.constraints, self.reasonings = constraints, reasonings
        self._outbox: list[tuple[SessionHandle, Event]] = []
        self._unsent: dict[int, _Unsent] = {}  # by session id: generated, not yet in an event
        self._queue_reported: dict[int, tuple[int, float]] = {}  # the last queue position sent, and when

    def add_token(self, s: Session, token: int, logprob: TokenLogprob | None = None) -> FinishReason | None:
        """Appends a generated token (and its runner.rows.TokenLogprob, when the session asked for
        them); returns why the session ends with it, or None and sends the text it released."""
        s.token_ids.append(token)
        unsent = self._unsent.setdefault(s.id, _Unsent())
        unsent.token_ids.append(token)
        if logprob is not None:
            unsent.logprobs.append(logprob)
        reason = self._stop_reason(s, token)
        if reason is None:
            self._delta(s, s.detokenizer.take())
        return reason

    def add_forced(self, s: Session, logprobs: bool) -> FinishReason | None:
        """Takes the tokens a reasoning forces (its end marker, at its budget) as generated, with a
        log probability of 0 each where the session asked for them; returns why they end it."""
        reasoning = self.reasonings.of(s)
        assert reasoning is not None
        for token in reasoning.forced():
            reason = self.add_token(s, token, TokenLogprob(0.0, 1) if logprobs else None)
            if reason is not None:
                return reason
        return None

    def replay(self, s: Session, resumed: Sequence[int]) -> FinishReason | None:
        """Takes a resumed session's delivered tokens as generated, sending none of them: its
        client has them and the text they released. Returns why they end it, if they do."""
        reasoning = self.reasonings.of(s)
        for token in resumed:
            s.token_ids.append(token)
            reason = self._stop_reason(s, token)
            # released by the broken stream; where the token ended it, the rest of the text too (the
            # final message, which carried the token, carried that text: a stop string's tail)
            released = s.detokenizer.take(final=reason is not None)
            if reasoning is not None:
                reasoning.text.feed(released, final=reason is not None)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, s: Session, token: int) -> FinishReason | None:
        # read before the reasoning takes the token: its tokens and markers are free, the constraint waits
        p, matcher = s.params, self.constraints.taking(s, token)
        reasoning = self.reasonings.of(s)
        if reasoning is not None:
            reasoning.add(token)
        if token in p.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if matcher is not None:  # the constraint decides where the output may end, and advances
            if token in self.eos_token_ids and matcher.is_accepting():
                return FinishReason.CONSTRAINT
            if not matcher.consume_token(token):  # past llguidance's limits: the request's fault
                return FinishReason.INVALID_REQUEST
        elif token in self.eos_token_ids and not p.ignore_eos:
            return FinishReason.EOS
        s.detokenizer.add(token)
        if s.detokenizer.stopped:
            return FinishReason.STOP_SEQUENCE
        if matcher is not None and matcher.is_stopped():  # complete, and nothing could follow
            return FinishReason.CONSTRAINT
        if s.num_generated >= p.max_new_tokens or len(s.token_ids) >= self.max_seq_len:
            return FinishReason.MAX_TOKENS
        return None

    def finish(
        self,
        s: Session,
        reason: FinishReason,
        error: str | None,
        error_field: str | None = None,
        speculation: Speculation | None = None,
    ) -> Finished:
        """The session's last events. Whatever the reason, the text so far goes out: the tail held
        back in case it began a stop string, and tokens not yet delivered (a deadline ends the
        stream "with the text so far"). speculation: its proposals' counts (--speculative)."""
        self._delta(s, s.detokenizer.take(final=True), final=True)
        self._queue_reported.pop(s.id, None)
        reasoning = self.reasonings.of(s)
        finished = Finished(
            reason=reason,
            prompt_tokens=s.num_prompt,
            generated_tokens=s.num_generated,
            timings=_timings(s),
            error=error,
            error_field=error_field,
            cached_tokens=s.cached_tokens or 0,
            stop_sequence=s.detokenizer.stop_sequence,
            truncated_tokens=s.truncated_tokens,
            proposed_tokens=speculation.num_proposed if speculation else 0,
            accepted_tokens=speculation.num_accepted if speculation else 0,
            reasoning_tokens=reasoning.num_tokens if reasoning is not None else 0,
            embedding=s.embedding.vector() if s.embedding is not None and s.num_cached >= s.num_prompt else None,
        )
        self._outbox.append((s.handle, finished))
        return finished

    def queued(self, s: Session, position: int, now: float) -> None:
        """Tells a waiting session's client where it stands, when that changed and at most once a
        second (report_queue)."""
        last, at = self._queue_reported.get(s.id, (0, float("-inf")))
        if position != last and now - at >= 1.0:
            self._queue_reported[s.id] = (position, now)
            self._outbox.append((s.handle, Queued(position)))

    def _delta(self, s: Session, text: str, final: bool = False) -> None:
        reasoning, splitter = "", self.reasonings.of(s)
        if splitter is not None:  # the text apart: the reasoning's, and the answer's
            reasoning, text = splitter.text.feed(text, final)
        unsent = self._unsent.pop(s.id, None) or _Unsent()
        if not text and not reasoning and not unsent.token_ids:
            return
        delta = Delta(text, unsent.token_ids, unsent.logprobs, reasoning=reasoning)
        if s.prompt_scores is not None and unsent.token_ids:  # the first token: the prompt's scores go with it
            delta.prompt_token_ids, delta.prompt_logprobs = list(s.prompt_ids), s.prompt_scores
            s.prompt_scores = None
        self._outbox.append((s.handle, delta))
        s.handle.note_emitted(len(unsent.token_ids))

    def session_ids(self) -> set[int]:
        """The sessions it keeps state for."""
        return set(self._unsent) | set(self._queue_reported)

    def take(self) -> list[tuple[SessionHandle, Event]]:
        """The events made since the last take, in order."""
        events, self._outbox = self._outbox, []
        return events


def deliver(events: list[tuple[SessionHandle, Event]]) -> None:
    """Hands a step's events to their sessions' event loops: one wake-up per loop per step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[SessionHandle, Event]]] = {}
    for handle, event in events:
        by_loop.setdefault(handle.loop, []).append((handle, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _push(items: list[tuple[SessionHandle, Event]]) -> None:
    for handle, event in items:
        handle.push(event)


def _timings(s: Session) -> Timings:
    now = time.monotonic()
    ms = 1000.0
    started = s.started if s.started is not None else now
    first = s.first_token if s.first_token is not None else now
    decode_s = now - first
    rate = (s.num_generated - 1) / decode_s if s.num_generated > 1 and decode_s > 0 else 0.0
    return Timings(
        queue_ms=(started - s.arrived) * ms,
        time_to_first_token_ms=(first - s.arrived) * ms,
        total_ms=(now - s.arrived) * ms,
        tokens_per_second=rate,
    )

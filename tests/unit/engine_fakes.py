"""Fakes that drive the engine core in process, in milliseconds, as vLLM's tests/v1/core/utils.py
drives its scheduler: a scripted runner behind the engine's Runner port, a tokenizer whose text is
its token ids, and `Harness`, which makes sessions through the real admission and steps the core.

Text is token ids: "5 6 7" tokenizes to [5, 6, 7], and token 9 decodes to " 9".
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Sequence

from braid.server.config import EngineConfig
from braid.server.engine.client import Add, EngineClient, ToLoop, apply
from braid.server.engine.handle import SessionHandle
from braid.server.engine.types import (
    Constraint,
    Delta,
    Event,
    Finished,
    GenerationRequest,
    Message,
    Mode,
    ModelInfo,
    SamplingParams,
)
from braid.server.runner.rows import AdapterInfo, Row, Sampled, Sampling

EOS = 2
# what the Harness's client reports of its model (ModelInfo): only its name matters here, which no
# LoRA adapter may take
INFO = ModelInfo(
    "harness", "scripted", 512, 1000, "float32", "cpu", Mode.CONTINUOUS, 4, (EOS,), False, 0, {}, 0, "", ""
)


class ScriptedRunner:
    """The Runner port, scripted: every row that samples gets `next_token(row)` (default: its last
    token + 1, skipping EOS). Records each pass's rows in `passes`."""

    def __init__(
        self,
        num_pages: int = 256,
        page_size: int = 16,
        max_seq_len: int = 512,
        vocab_size: int = 1000,
        next_token: Callable[[Row], int] | None = None,
    ) -> None:
        self.num_pages, self.page_size, self.max_seq_len, self.vocab_size = (
            num_pages,
            page_size,
            max_seq_len,
            vocab_size,
        )
        self.next_token = next_token or _count_up
        self.passes: list[list[Row]] = []
        self.adapters: set[int] = set()  # resident LoRA adapters' ids

    def load_adapter(self, adapter_id: int, name: str, path: str, max_rank: int) -> AdapterInfo:
        self.adapters.add(adapter_id)
        return AdapterInfo(name, path, 8, 16.0, 2.0, ("q_proj",))

    def unload_adapter(self, adapter_id: int) -> None:
        self.adapters.remove(adapter_id)

    def random_state(self, sampling: Sampling, skip: int = 0) -> object:
        return None

    def run(self, rows: Sequence[Row]) -> list[Sampled | None]:
        self.passes.append(list(rows))
        return [
            self._verify(row) if row.num_proposals else Sampled(self.next_token(row)) if row.sample else None
            for row in rows
        ]

    def _verify(self, row: Row) -> Sampled:
        """A row with proposals, as the runner verifies it: the next token after each of its last
        num_proposals + 1 tokens, kept while it equals the next proposal."""
        k = row.num_proposals
        own, proposals = list(row.token_ids[: len(row.token_ids) - k]), list(row.token_ids[len(row.token_ids) - k :])
        picked = []
        for j in range(k + 1):
            picked.append(
                self.next_token(
                    dataclasses.replace(
                        row, token_ids=own + proposals[:j], num_proposals=0, history=list(row.history) + proposals[:j]
                    )
                )
            )
            if j == k or picked[-1] != proposals[j]:
                break
        return Sampled(picked[0], more=tuple((t, None) for t in picked[1:]))


def _count_up(row: Row) -> int:
    token = (row.token_ids[-1] + 1) % 1000
    return token + 1 if token == EOS else token


class NumberTokenizer:
    """Text is token ids separated by spaces; engine/tokenizer.py's interface."""

    eos_token_ids = (EOS,)
    has_chat_template = False
    hf_tokenizer = None
    reasoning_markers = None  # engine/reasoning.py's Markers: a test's reasoning model sets them

    def min_tokens(self, text_bytes: int) -> int:
        return 0

    def encode(
        self, prompt: str | None, messages: Sequence[Message], tools: str = "", template_kwargs: str = ""
    ) -> list[int]:
        return [int(t) for t in (prompt or " ".join(m.content for m in messages)).split()]

    def encode_chat(self, messages: Sequence[Message], tools: str = "", template_kwargs: str = "") -> list[int]:
        return self.encode(None, messages)

    def encode_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.encode(w, ())) for w in words)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(f" {t}" for t in token_ids)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]


class Harness:
    """An EngineClient over a ScriptedRunner, its core stepped by hand, with sessions made by the
    real admission (messages to the model thread are applied at once). The tests of the
    in-process tier (tests/in_process.py) give it a real model runner and tokenizer instead."""

    def __init__(self, runner=None, draft=None, tokenizer=None, **config) -> None:
        """runner: a ScriptedRunner (default) or any runner behind the engine's Runner port; draft:
        --speculative draft's runner (config: speculative="draft", draft_model="..."); tokenizer:
        engine/tokenizer.py's interface (default: NumberTokenizer)."""
        self.runner = runner or ScriptedRunner()
        tokenizer = tokenizer or NumberTokenizer()
        self.config = EngineConfig(**{"max_wait_ms": 0, **config})
        info = dataclasses.replace(INFO, mode=self.config.mode)
        self.client = EngineClient(
            self.config, self.runner, tokenizer, info, grammars=None, post=self._apply, draft=draft
        )
        self.core, self.books, self.adapters = self.client.core, self.client.books, self.client.adapters
        self.admission = self.client.admission
        self.loop = asyncio.new_event_loop()  # the handles' loop: never run, the events are read here
        self.events: dict[int, list[Event]] = {}
        self.unread: dict[int, int] = {}  # session id: tokens its client has not read (stop_reading)
        self.now = time.monotonic()  # the core's clock, advanced by step(); sessions arrive on it too

    def _apply(self, message: ToLoop) -> None:
        """The client's messages (a session added, aborted) applied to the core at once. A session
        arrives at the core's clock, not the real one its handle read: a batched scheduler's wait
        (now - arrived) then counts steps, whatever the machine's load took between them."""
        if isinstance(message, Add):
            message.session.arrived = self.now
        apply(self.core, message)

    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(
        self,
        prompt: str,
        n: int = 1,
        resume: Sequence[int] = (),
        deadline: float | None = None,
        adapter: str = "",
        messages: Sequence[Message] = (),
        prompt_token_ids: Sequence[int] = (),
        cache_salt: str = "",
        matcher=None,
        **params,
    ) -> list[SessionHandle]:
        """A request queued as the edge queues it (its sessions added to the core). matcher: a
        constraint's compiled matcher (the request then has a json_object constraint)."""
        request = GenerationRequest(
            prompt=prompt,
            messages=tuple(messages),
            prompt_token_ids=tuple(prompt_token_ids),
            params=SamplingParams(**params),
            request_id=f"r{len(self.events)}",
            n=n,
            resume_token_ids=tuple(resume),
            deadline=deadline,
            adapter=adapter,
            cache_salt=cache_salt,
            constraint=None if matcher is None else Constraint("json_object", "", "constraint.json_object"),
        )
        ticket = self.client.admit(prompt, request.messages, token_ids=request.prompt_token_ids)
        handles = self.client.submit(ticket, request, self.loop, matcher)
        for h in handles:
            self.events.setdefault(h.session_id, [])
        self._collect(self.core.take_events())
        return handles

    def step(self, dt: float = 0.001) -> bool:
        """One step, `dt` seconds after the last; its events sorted by session. True if it ran a pass.
        After it the books balance, and no component keeps state for a session that has ended."""
        self.now += dt
        step = self.core.step(self.now)
        self._collect(step.events)
        assert self.core.books_balance() == (0, 0, 0), self.core.books_balance()
        assert not self.core.leftovers(), self.core.leftovers()
        return step.ran

    def run(self, max_steps: int = 10_000) -> int:
        """Steps until no session is left; returns how many steps ran a pass."""
        passes = 0
        for _ in range(max_steps):
            if not self.core.sessions:
                return passes
            passes += self.step()
        raise AssertionError(f"sessions left after {max_steps} steps: {list(self.core.sessions)}")

    def abort(self, handle: SessionHandle, reason) -> None:
        self.core.abort(handle.session_id, reason)
        self._collect(self.core.take_events())
        assert not self.core.leftovers(), self.core.leftovers()

    def stop_reading(self, handle: SessionHandle) -> None:
        """From now on the session's client reads nothing (its backlog grows until it is paused)."""
        self.unread.setdefault(handle.session_id, 0)

    def read(self, handle: SessionHandle) -> None:
        """The client reads its backlog, and everything after it at once, as the others do."""
        handle.note_sent(self.unread.pop(handle.session_id))

    def _collect(self, events: list[tuple[SessionHandle, Event]]) -> None:
        """Records the events as a client that reads everything at once (no session is paused for
        its backlog), but those told to stop_reading."""
        for handle, event in events:
            self.events.setdefault(handle.session_id, []).append(event)
            if isinstance(event, Delta):
                if handle.session_id in self.unread:
                    self.unread[handle.session_id] += len(event.token_ids)
                else:
                    handle.note_sent(len(event.token_ids))

    def tokens(self, handle: SessionHandle) -> list[int]:
        return [t for e in self.events[handle.session_id] if isinstance(e, Delta) for t in e.token_ids]

    def text(self, handle: SessionHandle) -> str:
        return "".join(e.text for e in self.events[handle.session_id] if isinstance(e, Delta))

    def finished(self, handle: SessionHandle) -> Finished | None:
        ends = [e for e in self.events[handle.session_id] if isinstance(e, Finished)]
        assert len(ends) <= 1, ends
        return ends[0] if ends else None

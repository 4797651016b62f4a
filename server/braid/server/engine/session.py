"""A session: one Stream call's state on the model thread.

A Session holds what every session has: its tokens, its place in the scheduler, its pages, its
timings. A feature's state lives with the component that owns the feature, keyed by session id,
from the session's add until it ends: the constraint's matcher (engine/constraints.py), the
reasoning's phase and text (engine/reasoning.py), proposals (engine/speculation.py), the output not
yet sent and the last queue report (engine/output.py), a paused client (engine/scheduler.py).
Admission hands that state over with the session (`Features`); the engine core gives each part to
its component (engine/core.py, `add`), and `EngineCore.leftovers` checks that none outlives its
session.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from braid.server.engine.types import Pooling, Priority, SamplingParams

if TYPE_CHECKING:
    from braid.server.engine.detokenizer import IncrementalDetokenizer
    from braid.server.engine.embedding import Embedding
    from braid.server.engine.grammars import Matcher
    from braid.server.engine.handle import SessionHandle
    from braid.server.engine.reasoning import Reasoning
    from braid.server.runner.rows import TokenLogprob


class SessionStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Session:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    handle: SessionHandle
    detokenizer: IncrementalDetokenizer
    rng: object  # the runner's random state for this session (Row.rng)
    deadline: float | None = None
    priority: Priority = Priority.INTERACTIVE
    token_ids: list[int] = field(default_factory=list)  # prompt, then every generated token
    num_cached: int = 0  # tokens whose keys and values are in the cache
    cache_salt: str = ""  # prefixes are shared only between sessions with the same salt
    adapter: int = 0  # its LoRA adapter's load id (Row.adapter; engine/adapters.py), 0: the base model
    adapter_key: str = ""  # and its part of the prefix cache's keys ("": the base model)
    pages: list[int] = field(default_factory=list)  # KV-cache page table, while running (engine/pages.py)
    page_keys: list[bytes] = field(default_factory=list)  # names of its full pages, computed as needed
    cached_tokens: int | None = None  # prompt tokens found in the cache when first admitted
    preemptions: int = 0  # times its pages were taken back, to be recomputed later
    truncated_tokens: int = 0  # prompt tokens cut by truncate_input_tokens
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete (bad_words)
    parent: Session | None = None  # sample 0 of the same request (n > 1): held until it has the prompt
    # prompt_logprobs: a runner.rows.TokenLogprob per prompt position scored so far, until they are
    # sent with the first token; None when not asked for, or sent
    prompt_scores: list[TokenLogprob] | None = None
    embedding: Embedding | None = None  # an Embed input's session: prompt only, pooled (engine/embedding.py)

    def banned_by_bad_words(self) -> list[int]:
        """The tokens that would complete a bad word now: a word's last token, wherever the tokens
        so far end with the rest of it."""
        return [
            w[-1]
            for w in self.bad_words
            if len(w) == 1 or (len(self.token_ids) >= len(w) - 1 and self.token_ids[1 - len(w) :] == list(w[:-1]))
        ]

    status: SessionStatus = SessionStatus.WAITING
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # first forward pass
    first_token: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to feed to the model: the rest of the prompt, or the last sampled token."""
        return len(self.token_ids) - self.num_cached

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may take its prompt's pages from the prefix cache: not while it must
        score the prompt (prompt_logprobs) or mean-pool it (an embedding), which means computing
        every position. (A last-token embedding needs only its last, which is always computed.)"""
        return self.prompt_scores is None and (self.embedding is None or self.embedding.pooling is Pooling.LAST)

    def prompt_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens that positions [start, end) predict, to be scored (prompt_logprobs)."""
        if self.prompt_scores is None:
            return []
        return self.token_ids[start + 1 : min(end, self.num_prompt - 1) + 1]

    @property
    def is_prefilling(self) -> bool:
        """Its prompt is still being computed, or recomputed after a preemption (then with the
        tokens it had generated)."""
        return self.num_cached < self.num_prompt or self.num_uncached > 1


@dataclass(frozen=True)
class Features:
    """A new session's per-feature state, as admission made it. The engine core gives each part to
    the component that owns its feature (`EngineCore.add`), which keeps it by session id until the
    session ends: a new feature adds its part here, and its state to its own component."""

    matcher: Matcher | None = None  # its constraint compiled (engine/grammars.py); held by engine/constraints.py
    constraint_field: str = ""  # the request field its constraint came in (constraint.regex, ...)
    reasoning: Reasoning | None = None  # a reasoning model's phase and text split (engine/reasoning.py)
    resumed: tuple[int, ...] = ()  # resume_token_ids, replayed when the model thread takes it


NO_FEATURES = Features()

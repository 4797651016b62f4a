"""Speculative decoding, the engine's side: which tokens a session proposes for the next pass.

A decoding session's row feeds its last token and k proposals; the pass computes logits at all
k + 1 positions, and the runner samples them in order exactly as k + 1 plain steps would (the same
transforms, one random draw per token), keeping proposals while each equals what was sampled
(runner/model_runner.py, `_verify`). So the tokens are those of plain decoding, greedy or seeded;
speculation only decides how many one pass yields.

The n-gram proposer (prompt lookup, as vLLM's ngram_proposer and llama.cpp's lookup): find an
earlier place where the session's last n tokens occurred, in its prompt or its output, and propose
the tokens that followed there. It needs no second model and wins where the output copies the
input: edits, extraction, code, answers quoting a passage. Which place: a copy goes on from where
the last one left off, so the place nearest after the session's copy point (where its last
proposals came from, moved on by what was accepted) goes first, then the latest anywhere; and where
no run of --ngram-min tokens matches, the last token alone matching just after the copy point (a
word the output changed, then the passage again: "rises" -> "rose", " in the hills").

A session proposes only where every proposed position would be sampled as plain decoding samples
it with the same bans: not while min_new_tokens still bans the end, and not with bad_words (whose
bans depend on the tokens before each position). A constraint's matcher cuts proposals it forbids.
A session proposes at most its *window* of tokens: --speculative-tokens at first, one more than it
last had confirmed (at least 2) after a rejection, doubled after a verification that confirmed them
all, so a long copy gets long proposals and paraphrase gets short ones (each rejected proposal is a
row of the pass spent for nothing). With a draft model, a verification that confirms nothing also
rests the session's proposals for 1, 2, 4 ... 32 steps: a draft's proposals cost a draft pass. An
n-gram's cost only their rows, and where the output copies its input again after a change, the
very next lookup is the likeliest to hit: its first miss in a row is free, and only from the
second on does it rest, 1, 2, 4, then 8 steps at most (so output that never repeats its input,
a random model's, wastes few rows). (Replaying the copy-heavy benchmark's greedy outputs through
both rules, with a pass's measured cost per proposal row: the copy point, the 2-token window floor
and the free first miss each gave 3-4% more output tokens per second, together 7%; end to end
about 2%, within the runs' spread: docs/benchmarks.md.)
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from braid.server.engine.pages import Pages
from braid.server.engine.ports import Runner
from braid.server.engine.session import Session
from braid.server.runner.rows import Row, Sampling

if TYPE_CHECKING:
    from braid.server.engine.constraints import Constraints

_LOGGER = logging.getLogger(__name__)
GREEDY = Sampling()  # the draft proposes its most likely tokens

MAX_REST = 32  # steps a draft session that keeps missing waits between tries
MAX_NGRAM_REST = 8  # and an n-gram one, whose misses cost only their rows
NEAR_COPY = 4  # tokens after the copy point where the last token alone may match


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: Sequence[int], k: int, copy_at: int | None = None) -> tuple[list[int], int]:
        """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens`
        (max_n down to min_n tokens) that occurred before: the one ending nearest at or after
        `copy_at` (an index into tokens), else the latest; else, the last token alone within
        NEAR_COPY tokens after copy_at. Returns them and the index in tokens of the first; ([], -1)
        if nothing matched."""
        if k <= 0 or len(tokens) < 2:
            return [], -1
        packed = array("i", tokens)
        data, size = packed.tobytes(), packed.itemsize  # searched by bytes.find and rfind, in C
        at, n = self._match(data, size, copy_at)
        if at < 0:
            return [], -1
        follow = at // size + n
        return list(tokens[follow : follow + k]), follow

    def _match(self, data: bytes, size: int, copy_at: int | None) -> tuple[int, int]:
        """Where (a byte offset into data) the run of last tokens that proposes occurred before,
        and its length in tokens; (-1, 0) if none did."""
        end = len(data) - size  # a match must end before the last token
        for n in range(min(self.max_n, len(data) // size - 1), self.min_n - 1, -1):
            suffix = data[-n * size :]
            at = -1 if copy_at is None else _find(data, suffix, max(0, copy_at - n) * size, end, size)
            if at < 0:
                at = _rfind(data, suffix, end, size)
            if at >= 0:
                return at, n
        if copy_at is not None and self.min_n > 1:
            near = min(end, (copy_at + NEAR_COPY) * size)
            return _find(data, data[-size:], max(0, copy_at - 1) * size, near, size), 1
        return -1, 0


def _find(data: bytes, pattern: bytes, start: int, stop: int, size: int) -> int:
    """The first whole-token occurrence of pattern in data[start:stop] (byte offsets), or -1."""
    while (at := data.find(pattern, start, stop)) >= 0 and at % size:
        start = at + 1  # a match across token boundaries: look further on
    return at


def _rfind(data: bytes, pattern: bytes, stop: int, size: int) -> int:
    """The last whole-token occurrence of pattern in data[:stop] (byte offsets), or -1."""
    while (at := data.rfind(pattern, 0, stop)) >= 0 and at % size:
        stop = at + len(pattern) - 1  # a match across token boundaries: look further back
    return at


class DraftProposer:
    """Proposals of a smaller model with the same vocabulary (--draft-model), run greedily on its own
    runner and KV cache: one pass catches each session's draft cache up with its tokens and proposes
    the first token, then a pass per further token, every session that asks in each.

    The draft's cache keeps its keys and values across steps: after a verification, what it had
    fed beyond the session's tokens stays valid as far as the kept tokens equal it (they are the
    draft's own proposals), and only the rest is fed again."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.pages = Pages(runner.num_pages, runner.page_size, prefix_caching=False)
        self._drafts: dict[int, _Draft] = {}

    def propose_all(self, asks: list[tuple[Session, int]]) -> list[list[int]]:
        drafts = []
        for s, k in asks:
            d = self._draft(s)
            k = min(k, self.runner.max_seq_len - len(s.token_ids))
            if k > 0 and self.pages.grow(d, len(s.token_ids) - d.num_cached + k - 1):
                drafts.append((d, k))
        out: dict[int, list[int]] = {}
        try:
            out = self._run(drafts)
        except Exception:  # the draft is an optimisation: a failure costs proposals, never a session
            _LOGGER.exception("draft model pass failed")
        return [out.get(s.id, []) for s, _ in asks]

    def _run(self, drafts: list[tuple[_Draft, int]]) -> dict[int, list[int]]:
        rows = [
            Row(
                pages=d.pages,
                start=d.num_cached,
                token_ids=d.token_ids[d.num_cached :],
                sample=True,
                sampling=GREEDY,
                rng=None,
                is_prompt=len(d.token_ids) - d.num_cached > 1,
            )
            for d, _ in drafts
        ]
        proposed: dict[int, list[int]] = {d.id: [] for d, _ in drafts}
        for step in range(max((k for _, k in drafts), default=0)):
            for (d, _), sampled in zip([x for x in drafts if x[1] > step], self.runner.run(rows)):
                assert sampled is not None and sampled.token is not None  # every row samples
                proposed[d.id].append(sampled.token)
            live = [(d, k) for d, k in drafts if k > step + 1]
            rows = [
                Row(
                    pages=d.pages,
                    start=len(d.token_ids) + step,
                    token_ids=proposed[d.id][-1:],
                    sample=True,
                    sampling=GREEDY,
                    rng=None,
                )
                for d, _ in live
            ]
        for d, k in drafts:  # fed: its tokens, and every proposal but the last
            d.num_cached, d.base, d.tail = len(d.token_ids) + k - 1, len(d.token_ids), proposed[d.id][:-1]
        return proposed

    def _draft(self, s: Session) -> _Draft:
        """The session's draft cache, rolled back to what still holds its tokens."""
        d = self._drafts.get(s.id)
        if d is None:
            d = self._drafts[s.id] = _Draft(s.id, s.token_ids)
            self.pages.admit(d)
        d.token_ids = s.token_ids
        kept = next(
            (i for i, t in enumerate(d.tail) if d.base + i >= len(s.token_ids) or s.token_ids[d.base + i] != t),
            len(d.tail),
        )
        d.num_cached = min(d.num_cached, d.base + kept, len(s.token_ids) - 1)
        d.base, d.tail = d.num_cached, []
        return d

    def session_ids(self) -> set[int]:
        return set(self._drafts)

    def release(self, s: Session) -> None:
        d = self._drafts.pop(s.id, None)
        if d is not None:
            self.pages.release(d)


@dataclass(eq=False)
class _Draft:
    """A session's state in the draft's cache (engine/pages.py's Holder)."""

    id: int
    token_ids: list[int]  # the session's tokens
    num_cached: int = 0  # positions the draft's cache holds
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)
    cache_salt: str = ""
    adapter_key: str = ""  # the draft runs without LoRA adapters, and never shares its pages
    reads_prefix_cache: bool = False
    base: int = 0  # len(token_ids) when it last proposed
    tail: list[int] = field(default_factory=list)  # what it fed after them then


@dataclass
class Speculation:
    """A session's speculative decoding: proposals verified and confirmed so far, and the back-off
    after passes that confirmed none (proposals rest for `rest` more steps)."""

    num_proposed: int = 0
    num_accepted: int = 0
    misses: int = 0  # verifications in a row that confirmed no proposal
    window: int = 0  # the most it proposes next (0: --speculative-tokens)
    rest: int = 0
    copy_at: int | None = None  # the n-gram's copy point: where in token_ids its next proposal would start


class Speculator:
    """Proposals for the scheduler, and the back-off of sessions whose proposals miss; each
    session's Speculation, from its first proposal until it ends (release)."""

    def __init__(
        self,
        proposer: NgramProposer | DraftProposer,
        max_tokens: int,
        max_seq_len: int,
        constraints: Constraints | None = None,
    ) -> None:
        """constraints: the sessions' matchers, which cut their proposals."""
        self.proposer = proposer
        self.constraints = constraints
        self.max_tokens = max_tokens  # --speculative-tokens
        self.max_seq_len = max_seq_len
        # misses in a row that cost no rest, and the longest rest (the module's docstring)
        draft = isinstance(proposer, DraftProposer)
        self.free_misses, self.max_rest = (0, MAX_REST) if draft else (1, MAX_NGRAM_REST)
        self._sessions: dict[int, Speculation] = {}

    def of(self, s: Session) -> Speculation:
        """The session's speculation (made at its first ask)."""
        spec = self._sessions.get(s.id)
        if spec is None:
            spec = self._sessions[s.id] = Speculation()
        return spec

    def wants(self, s: Session, limit: int) -> int:
        """How many proposals the session may make for its next pass, at most `limit`: none while
        it rests; never past max_new_tokens or the context, so every proposal could be kept."""
        p = s.params
        if p.disable_speculation or s.bad_words or s.num_generated < p.min_new_tokens:
            return 0
        spec = self.of(s)
        if spec.rest > 0:
            spec.rest -= 1
            return 0
        return max(
            0,
            min(
                limit,
                spec.window or self.max_tokens,
                p.max_new_tokens - s.num_generated - 1,
                self.max_seq_len - len(s.token_ids) - 1,
            ),
        )

    def propose(self, asks: list[tuple[Session, int]]) -> list[tuple[int, ...]]:
        """Each (session, k)'s proposals, at most k, cut where its constraint forbids them."""
        if isinstance(self.proposer, DraftProposer):
            found = self.proposer.propose_all(asks)
        else:
            found = []
            for s, k in asks:
                spec = self.of(s)
                proposals, follow = self.proposer.propose(s.token_ids, k, spec.copy_at)
                if proposals:  # where it copies from now; where nothing matched, the copy point stays
                    spec.copy_at = follow
                found.append(proposals)
        if self.constraints is None:
            return [tuple(proposals) for proposals in found]
        return [self.constraints.proposals(s, proposals) for (s, _), proposals in zip(asks, found)]

    def release(self, s: Session) -> Speculation | None:
        """The session has ended: what the proposer kept for it goes; its speculation (None if it
        never asked), for its final counts."""
        if isinstance(self.proposer, DraftProposer):
            self.proposer.release(s)
        return self._sessions.pop(s.id, None)

    def session_ids(self) -> set[int]:
        """The sessions it keeps state for (a draft's cache among them)."""
        drafts = self.proposer.session_ids() if isinstance(self.proposer, DraftProposer) else set()
        return set(self._sessions) | drafts

    def verified(self, s: Speculation, proposed: int, accepted: int) -> None:
        """A session's pass verified `proposed` proposals and confirmed `accepted`: its window,
        copy point and rest for the next."""
        s.num_proposed += proposed
        s.num_accepted += accepted
        s.window = min(self.max_tokens, 2 * proposed if accepted == proposed else max(accepted + 1, 2))
        if s.copy_at is not None:  # past what it copied, and the token sampled after
            s.copy_at += accepted + 1
        s.misses = 0 if accepted else s.misses + 1
        paid = s.misses - self.free_misses  # misses that rest it: 1, 2, 4 ... steps
        s.rest = min(2 ** (paid - 1), self.max_rest) if paid > 0 else 0

"""Speculative decoding, the engine's side: which tokens a session proposes for the next pass.

A decoding session's row feeds its last token and k proposals; the pass computes logits at all
k + 1 positions, and the runner samples them in order exactly as k + 1 plain steps would (the same
transforms, one random draw per token), keeping proposals while each equals what was sampled
(runner/model_runner.py, `_verify`). So the tokens are those of plain decoding, greedy or seeded;
speculation only decides how many one pass yields.

The n-gram proposer (prompt lookup, as vLLM's ngram_proposer and llama.cpp's lookup): find the
latest earlier place where the session's last n tokens occurred, in its prompt or its output, and
propose the tokens that followed there. It needs no second model and wins where the output copies
the input: edits, extraction, code, answers quoting a passage.

A session proposes only where every proposed position would be sampled as plain decoding samples
it with the same bans: not while min_new_tokens still bans the end, and not with bad_words (whose
bans depend on the tokens before each position). A constraint's matcher cuts proposals it forbids.
A session proposes at most its *window* of tokens: --speculative-tokens at first, one more than it
last had confirmed after a rejection, doubled after a verification that confirmed them all, so a
long copy gets long proposals and paraphrase gets short ones (each rejected proposal is a row of
the pass spent for nothing). A verification that confirms nothing rests the session's proposals
for 1, 2, 4 ... 32 steps.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Sequence

from braid.server.engine.pages import Pages
from braid.server.engine.ports import Runner
from braid.server.engine.session import Session
from braid.server.runner.rows import Row, Sampling

_LOGGER = logging.getLogger(__name__)
GREEDY = Sampling()  # the draft proposes its most likely tokens

MAX_REST = 32  # steps a session that keeps missing waits between tries


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n tokens) that occurred before; [] if none did."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        packed = array("i", tokens)
        data, size = packed.tobytes(), packed.itemsize  # searched by bytes.rfind, in C
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = data[-n * size :]
            end = len(data) - size  # a match must end before the last token
            while (at := data.rfind(suffix, 0, end)) >= 0:
                if at % size == 0:
                    follow = at // size + n
                    return list(tokens[follow : follow + k])
                end = at + len(suffix) - 1  # a match across token boundaries: look further back
        return []


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


class Speculator:
    """Proposals for the scheduler, and the back-off of sessions whose proposals miss."""

    def __init__(self, proposer: NgramProposer | DraftProposer, max_tokens: int, max_seq_len: int) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens  # --speculative-tokens
        self.max_seq_len = max_seq_len

    def wants(self, s: Session, limit: int) -> int:
        """How many proposals the session may make for its next pass, at most `limit`: none while
        it rests; never past max_new_tokens or the context, so every proposal could be kept."""
        p = s.params
        if p.disable_speculation or s.bad_words or s.num_generated < p.min_new_tokens:
            return 0
        if s.rest > 0:
            s.rest -= 1
            return 0
        return max(
            0,
            min(
                limit,
                s.window or self.max_tokens,
                p.max_new_tokens - s.num_generated - 1,
                self.max_seq_len - len(s.token_ids) - 1,
            ),
        )

    def propose(self, asks: list[tuple[Session, int]]) -> list[tuple[int, ...]]:
        """Each (session, k)'s proposals, at most k, cut where its constraint forbids them."""
        if isinstance(self.proposer, DraftProposer):
            found = self.proposer.propose_all(asks)
        else:
            found = [self.proposer.propose(s.token_ids, k) for s, k in asks]
        out = []
        for (s, _), proposals in zip(asks, found):
            if proposals and s.matcher is not None:  # the ones the constraint allows, in order
                proposals = proposals[: s.matcher.validate_tokens(proposals)]
            out.append(tuple(proposals))
        return out

    def release(self, s: Session) -> None:
        """The session has ended: what the proposer kept for it goes."""
        if isinstance(self.proposer, DraftProposer):
            self.proposer.release(s)

    def verified(self, s: Session, proposed: int, accepted: int) -> None:
        s.num_proposed += proposed
        s.num_accepted += accepted
        s.window = min(self.max_tokens, 2 * proposed) if accepted == proposed else accepted + 1
        if accepted:
            s.misses = 0
        else:
            s.misses += 1
            s.rest = min(2 ** (s.misses - 1), MAX_REST)

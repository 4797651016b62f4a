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

from array import array
from typing import Sequence

from braid.server.engine.session import Session

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
            suffix = data[-n * size:]
            end = len(data) - size  # a match must end before the last token
            while (at := data.rfind(suffix, 0, end)) >= 0:
                if at % size == 0:
                    follow = at // size + n
                    return list(tokens[follow:follow + k])
                end = at + len(suffix) - 1  # a match across token boundaries: look further back
        return []


class Speculator:
    """Proposals for the scheduler, and the back-off of sessions whose proposals miss."""

    def __init__(self, proposer: NgramProposer, max_tokens: int, max_seq_len: int) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens  # --speculative-tokens
        self.max_seq_len = max_seq_len

    def propose(self, s: Session, limit: int) -> tuple[int, ...]:
        """At most `limit` (and --speculative-tokens) proposals for the session's next pass; never
        past max_new_tokens or the context, so every proposal could be kept."""
        p = s.params
        if p.disable_speculation or s.bad_words or s.num_generated < p.min_new_tokens:
            return ()
        if s.rest > 0:
            s.rest -= 1
            return ()
        k = min(limit, s.window or self.max_tokens, p.max_new_tokens - s.num_generated - 1,
                self.max_seq_len - len(s.token_ids) - 1)
        proposals = self.proposer.propose(s.token_ids, k)
        if proposals and s.matcher is not None:  # the ones the constraint allows, in order
            proposals = proposals[:s.matcher.validate_tokens(proposals)]
        return tuple(proposals)

    def verified(self, s: Session, proposed: int, accepted: int) -> None:
        s.num_proposed += proposed
        s.num_accepted += accepted
        s.window = min(self.max_tokens, 2 * proposed) if accepted == proposed else accepted + 1
        if accepted:
            s.misses = 0
        else:
            s.misses += 1
            s.rest = min(2 ** (s.misses - 1), MAX_REST)

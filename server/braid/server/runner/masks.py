"""Token masks of the constrained rows of a pass (GenerateRequest.constraint).

llguidance computes each row's mask of allowed tokens from its matcher, all rows in one call that
drops the GIL; braid starts that call on a thread just before the forward pass and collects it
just after, so the masks cost no time on the critical path while the pass takes longer than they
do (a mask takes ~20 us, a pass tens of ms). Unconstrained rows never wait for them.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Callable, Sequence

import llguidance
import llguidance.numpy as lln
import numpy as np
import torch

from braid.server.runner.rows import Row


@dataclass
class PassMasks:
    """The masks of a pass's constrained rows, filled on the masks' thread while the pass runs."""

    constrained: list[int]  # the constrained rows' places among the pass's plain sampling rows
    filling: concurrent.futures.Future | None  # their masks, in that order (llguidance's bitmask)
    walks: dict[int, concurrent.futures.Future]  # each constrained speculating row's (Masks.start_walk), by row
    unpack: Callable[[torch.Tensor], torch.Tensor]  # Masks.unpack, on the model thread

    def allowed(self) -> tuple[list[int], torch.Tensor] | None:
        """What sampler.sample's `allowed` takes: the constrained rows' places and [C, V] bool masks.
        Waits for the masks if they are still being filled."""
        return (self.constrained, self.unpack(self.filling.result())) if self.filling is not None else None

    def walk(self, row: int) -> torch.Tensor | None:
        return self.walks[row].result() if row in self.walks else None


class Masks:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor: llguidance.LLExecutor | None = None  # made on first use: its threads
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="braid-masks")
        self._shifts = torch.arange(32, dtype=torch.int32)

    def start_pass(self, rows: Sequence[Row], sampled: Sequence[int]) -> PassMasks:
        """Starts filling the masks of the constrained rows among `sampled` (the rows of a pass that
        sample): one mask each for plain rows, a walk along its proposals for a speculating row."""
        plain = [i for i in sampled if not rows[i].num_proposals]
        constrained = [k for k, i in enumerate(plain) if rows[i].matcher is not None]
        filling = self.start(
            [rows[plain[k]].matcher for k in constrained], [rows[plain[k]].also_allowed for k in constrained]
        )
        walks = {
            i: self.start_walk(rows[i].matcher, rows[i].token_ids[-rows[i].num_proposals :])
            for i in sampled
            if rows[i].num_proposals and rows[i].matcher is not None
        }
        return PassMasks(constrained, filling, walks, self.unpack)

    def start(
        self, matchers: Sequence[object], also_allowed: Sequence[Sequence[int]] = ()
    ) -> concurrent.futures.Future | None:
        """Starts filling the masks of these matchers (one per constrained row), or None if none;
        also_allowed: the tokens each row's mask allows besides (Row.also_allowed), by row."""
        if not matchers:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # (llguidance's numpy helpers, not its torch ones: importing those runs torch.compile, which
        # took a third of every start)
        bitmask = lln.allocate_token_bitmask(len(matchers), self.vocab_size)
        return self._thread.submit(self._fill, list(matchers), bitmask, list(also_allowed))

    def _fill(self, matchers: list, bitmask: np.ndarray, also_allowed: list[Sequence[int]]) -> torch.Tensor:
        lln.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        for i, tokens in enumerate(also_allowed):
            _allow(bitmask, i, tokens)
        return torch.from_numpy(bitmask)

    def start_walk(self, matcher: object, tokens: Sequence[int]) -> concurrent.futures.Future:
        """Starts filling a speculating row's masks: [len(tokens) + 1, V] bool, the tokens allowed
        before each of `tokens` and after the last, each after those before it. The matcher is
        walked along them and rolled back, so it ends as it began (the engine checked that it
        allows them). (A row with also_allowed never speculates: its token is the first after
        the prompt, sampled by the pass that computes the prompt's end.)"""
        return self._thread.submit(self._walk, matcher, list(tokens))

    def _walk(self, matcher, tokens: list[int]) -> torch.Tensor:
        bitmask = lln.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        consumed = 0
        try:
            for i in range(len(tokens) + 1):
                lln.fill_next_token_bitmask(matcher, bitmask, i)
                if i < len(tokens):
                    if not matcher.consume_token(tokens[i]):
                        break  # allows nothing past here: the rows left keep an empty mask, never used
                    consumed += 1
        finally:
            matcher.rollback(consumed)
        return self.unpack(torch.from_numpy(bitmask))

    def unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """[C, V] bool of llguidance's int32 bitmask [C, W]: token i is bit i % 32 of word i // 32."""
        unpacked = (bits.unsqueeze(-1) >> self._shifts) & 1  # [C, W, 32]
        return unpacked.view(bits.shape[0], -1)[:, : self.vocab_size].bool()


def _allow(bitmask: np.ndarray, row: int, tokens: Sequence[int]) -> None:
    """Sets `tokens`' bits in row `row` of llguidance's int32 bitmask [C, W] (token i: bit i % 32
    of word i // 32), as words without a sign."""
    words = bitmask.view(np.uint32)
    for token in tokens:
        words[row, token // 32] |= np.uint32(1 << (token % 32))

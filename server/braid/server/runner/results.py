"""What a pass gives each row, read off its logits: an embedding row its pooled vector, a row with
targets their log probabilities, a sampling row its token (sampler.sample), a speculating row its
kept proposals and the token after them (sampler.verify)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from braid.server.runner.batch import Packed
from braid.server.runner.masks import PassMasks
from braid.server.runner.rows import Row, Sampled
from braid.server.runner.sampler import sample, score, verify


def sample_rows(rows: Sequence[Row], packed: Packed, logits: torch.Tensor, masks: PassMasks) -> list[Sampled | None]:
    """Per row, what it sampled, scored or pooled, or None for a row that does none of these (a
    prompt chunk that does not reach the end of its prompt). logits: [L, V] float32, in
    packed.batch.logit_rows' order (modified in place)."""
    batch, sampled, scored = packed
    out: list[Sampled | None] = [None] * len(rows)
    if batch.pools:  # embedding rows: their pooled hidden states, and nothing else
        assert batch.pooled is not None
        for (i, *_), vector in zip(batch.pools, batch.pooled.cpu().tolist()):
            out[i] = Sampled(None, pooled=vector)
    if scored:  # the targets' rows come first; the sampled rows' logits are the rest
        for i, (begin, end) in scored.items():
            out[i] = Sampled(
                None, targets=tuple(score(logits[begin:end], rows[i].targets, rows[i].sampling.num_logprobs or 0))
            )
        logits = logits[max(end for _, end in scored.values()) :]
    # each sampling row's first logit row: a speculating row has one more per proposal
    first = dict(zip(sampled, itertools.accumulate((1 + rows[i].num_proposals for i in sampled), initial=0)))
    plain = [i for i in sampled if not rows[i].num_proposals]
    verified = [i for i in sampled if rows[i].num_proposals]
    tokens = sample(
        logits[[first[i] for i in plain]] if verified else logits, [rows[i] for i in plain], masks.allowed()
    )
    for i, token in zip(plain, tokens):
        out[i] = token._replace(targets=out[i].targets) if out[i] else token
    for i in verified:
        out[i] = verify(logits[first[i] : first[i] + rows[i].num_proposals + 1], rows[i], masks.walk(i))
    return out

"""Picks each row's next token from its logits, with that row's own parameters and seed."""

from __future__ import annotations

from typing import Sequence

import torch

from braid.server.engine.session import Session


def sample(logits: torch.Tensor, sessions: Sequence[Session], eos_token_ids: Sequence[int]) -> list[int]:
    """logits: [R, V] float32, one row per session (modified in place). Returns R token ids.

    Every sampled row draws exactly one uniform number from its session's generator per token, so
    a seeded session gets the same tokens whichever other sessions share its batch.
    """
    for row, s in enumerate(sessions):
        _penalise(logits[row], s, eos_token_ids)
    tokens = logits.argmax(dim=-1)
    sampled = [row for row, s in enumerate(sessions) if not s.params.is_greedy]
    if sampled:
        tokens[sampled] = _draw(logits[sampled], [sessions[r] for r in sampled])
    return tokens.tolist()


def _penalise(row: torch.Tensor, s: Session, eos_token_ids: Sequence[int]) -> None:
    p = s.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if s.num_generated < p.min_new_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            row[banned] = float("-inf")


def _draw(logits: torch.Tensor, sessions: Sequence[Session]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p over the sorted distribution, then one draw per row."""
    device = logits.device
    temps = torch.tensor([s.params.temperature for s in sessions], device=device).unsqueeze(1)
    top_k = torch.tensor([s.params.top_k or logits.shape[1] for s in sessions], device=device).unsqueeze(1)
    top_p = torch.tensor([s.params.top_p for s in sessions], device=device).unsqueeze(1)
    min_p = torch.tensor([s.params.min_p for s in sessions], device=device).unsqueeze(1)

    sorted_logits, order = (logits / temps).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(probs.shape[1], device=device).unsqueeze(0)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    drop = (rank >= top_k) | (before > top_p) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=s.rng) for s in sessions]).to(device).unsqueeze(1)
    choice = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=probs.shape[1] - 1)
    return order.gather(1, choice).squeeze(1)

"""The sampler's edge cases: temperatures so small that dividing by them overflows."""

from __future__ import annotations

import pytest
import torch

from braid.server.engine.session import Session
from braid.server.engine.types import GREEDY_BELOW_TEMPERATURE, SamplingParams
from braid.server.runner.sampler import sample


def _session(temperature: float, seed: int) -> Session:
    return Session(id=1, prompt_ids=[1], params=SamplingParams(temperature=temperature, seed=seed), handle=None,
                   detokenizer=None, rng=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-30, 1e-6, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_temperature_near_zero_is_greedy(temperature):
    torch.manual_seed(0)
    logits = torch.randn(8, 49152) * 20
    expected = logits.argmax(dim=-1).tolist()
    sessions = [_session(temperature, seed) for seed in range(8)]
    assert sample(logits.clone(), sessions, eos_token_ids=[2]) == expected


def test_a_small_but_real_temperature_still_samples_validly():
    logits = torch.zeros(1, 1000)
    logits[0, 7] = 1.0
    tokens = sample(logits, [_session(GREEDY_BELOW_TEMPERATURE, 0)], eos_token_ids=[2])
    assert tokens == [7]  # 1 / 1e-5 dominates: the most likely token, and no NaN on the way

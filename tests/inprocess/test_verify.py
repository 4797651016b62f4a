"""Speculative verification in the model runner, in process on a tiny random Llama: a row with
proposals yields exactly the tokens plain steps yield, greedy, seeded and with penalties, whether
its proposals are all right, all wrong or right for a while, and leaves the random state where
plain steps leave it."""

from __future__ import annotations

import pytest
import torch

from braid_testing.models import loaded, tiny_model
from braid.server.runner.model_runner import ModelRunner
from braid.server.runner.rows import Row, Sampling

PAGES = 16  # pages per sequence: 256 tokens
PROMPT = [5, 17, 99, 3, 250, 41, 41, 7, 300, 12, 5, 17]


@pytest.fixture(scope="module", params=[True, False], ids=["kernels-auto", "kernels-torch"])
def runner(request) -> ModelRunner:
    model = loaded(tiny_model(vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=None))
    return ModelRunner(
        model, torch.device("cpu"), torch.float32, num_pages=4 * PAGES, max_seq_len=512, allow_kernels=request.param
    )


def _prefill(runner, sampling, rng, slot: int) -> list[int]:
    pages = list(range(slot * PAGES, (slot + 1) * PAGES))
    [first] = runner.run(
        [
            Row(
                pages=pages,
                start=0,
                token_ids=PROMPT,
                sample=True,
                sampling=sampling,
                rng=rng,
                history=PROMPT,
                num_prompt=len(PROMPT),
                is_prompt=True,
            )
        ]
    )
    return [first.token]


def _plain(runner, sampling, n: int) -> tuple[list[int], float]:
    rng = runner.random_state(sampling)
    out = _prefill(runner, sampling, rng, 0)
    pages = list(range(PAGES))
    while len(out) < n:
        seq = PROMPT + out
        [s] = runner.run(
            [
                Row(
                    pages=pages,
                    start=len(seq) - 1,
                    token_ids=seq[-1:],
                    sample=True,
                    sampling=sampling,
                    rng=rng,
                    history=seq,
                    num_prompt=len(PROMPT),
                )
            ]
        )
        out.append(s.token)
    return out, torch.rand(1, generator=rng).item() if rng is not None else 0.0


def _speculative(runner, sampling, n: int, propose) -> tuple[list[int], float, int]:
    """Returns the tokens, the next number the generator would draw, and the passes it took."""
    rng = runner.random_state(sampling)
    out = _prefill(runner, sampling, rng, 1)
    pages = list(range(PAGES, 2 * PAGES))
    passes = 0
    while len(out) < n:
        seq = PROMPT + out
        proposals = propose(len(out))[: n - len(out) - 1]
        [s] = runner.run(
            [
                Row(
                    pages=pages,
                    start=len(seq) - 1,
                    token_ids=seq[-1:] + proposals,
                    sample=True,
                    sampling=sampling,
                    rng=rng,
                    history=seq,
                    num_prompt=len(PROMPT),
                    num_proposals=len(proposals),
                )
            ]
        )
        passes += 1
        kept = [s.token] + [t for t, _ in s.more]
        assert kept[:-1] == proposals[: len(kept) - 1], "kept a token that is not its proposal"
        out += kept
    return out, torch.rand(1, generator=rng).item() if rng is not None else 0.0, passes


SAMPLINGS = {
    "greedy": Sampling(),  # every position's argmax at once (sampler.verify's fast path)
    "greedy, penalised": Sampling(repetition_penalty=1.3),  # position by position: the history grows
    "seeded": Sampling(temperature=1.0, seed=7),
    "truncated": Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3),
    "penalised": Sampling(
        temperature=0.7,
        seed=11,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        logit_bias=((41, 3.0),),
    ),
}


@pytest.mark.parametrize("name", SAMPLINGS)
def test_verified_rows_give_the_tokens_of_plain_steps(runner, name):
    sampling = SAMPLINGS[name]
    n = 24
    expected, next_draw = _plain(runner, sampling, n)
    right = lambda i: expected[i : i + 4]  # noqa: E731
    wrong = lambda i: [(t + 1) % 512 for t in expected[i : i + 4]]  # noqa: E731
    half = lambda i: expected[i : i + 2] + [(t + 1) % 512 for t in expected[i + 2 : i + 4]]  # noqa: E731
    for propose in (right, wrong, half):
        tokens, draw, passes = _speculative(runner, sampling, n, propose)
        assert tokens == expected
        assert draw == next_draw  # one draw per token, as plain steps
    assert _speculative(runner, sampling, n, right)[2] <= -(-(n - 1) // 5)  # 5 tokens a pass


def test_logprobs_of_kept_tokens_are_the_targets(runner):
    sampling = Sampling(logprobs=True, top_logprobs=2)
    expected, _ = _plain(runner, sampling, 6)
    rng = runner.random_state(sampling)
    first = _prefill(runner, sampling, rng, 2)
    seq = PROMPT + first
    pages = list(range(2 * PAGES, 3 * PAGES))
    [s] = runner.run(
        [
            Row(
                pages=pages,
                start=len(seq) - 1,
                token_ids=seq[-1:] + expected[1:4],
                sample=True,
                sampling=sampling,
                rng=rng,
                history=seq,
                num_prompt=len(PROMPT),
                num_proposals=3,
            )
        ]
    )
    assert [s.token] + [t for t, _ in s.more] == expected[1:5]
    for token, logprob in [(s.token, s.logprob), *s.more]:
        assert logprob.rank == 1 and len(logprob.top) == 2 and logprob.top[0][0] == token

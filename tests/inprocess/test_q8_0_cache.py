"""--kv-cache-dtype q8_0 in process (tests/in_process.py), on the embedded model in its own formats, as
`braid serve` runs it (head_dim 64; the tiny model's 16 is not whole q8_0 blocks): keys and values in llama.cpp's blocks of 32 int8 and an fp16
scale, written and read by braid's C kernels. Everything that touches pages gives the tokens it gives
with a float cache: every mode and speculation the tokens of a sequential run, a prefix read from the
cache a cold run's, a preempted session its own. tests/test_kernels.py checks the attention itself, and
tests/test_precision.py what the cache costs in KL divergence (issue 40's bound)."""

from __future__ import annotations

import pytest

from braid.server.engine.types import FinishReason
from braid.server.model.loader import default_cache_dir, load
from in_process import Model, load_model, run
from unit.engine_fakes import Harness

SYSTEM = (
    "You are a careful assistant who answers questions about the sea, ships and the weather "
    "in plain words, briefly, and never makes anything up. "
) * 2  # about 50 tokens: three full pages
QUESTIONS = ["How far is the horizon?", "Why is the sea salty?", "What is a knot?"]
REQUESTS = [dict(prompt=SYSTEM + q, max_new_tokens=12, ignore_eos=True) for q in QUESTIONS]
# the embedded model's q8_0 keys and values: 30 layers x 3 heads x 2 blocks x 34 bytes x 2 a token
TOKEN_BYTES = 12240


# a KV cache of 64 MiB, 1,024 tokens a sequence, float32 rows: torch's kernels multiply float32 rows,
# and test_torchs_kernels_read_a_q8_0_cache_too compares their tokens with these. (These tests ran on the
# model's converted f32 folder: the same cache, but its 540 MB of fp32 matrices made each decode step
# about 4x the CPU of the Q4_1 blocks' (10.2 s against 2.6 s for 135 tokens, one thread, Zen 3).)
CACHE = dict(kv_cache_memory="64MiB", max_seq_len=1024, activations="float32")


@pytest.fixture(scope="module")
def embedded():
    """The embedded model in its own formats (Q4_1, a Q8_0 head), loaded once for the module's runners
    (braid's decoder only reads the loaded weights)."""
    return load(None, default_cache_dir())


def _runner(embedded, **config) -> Model:
    """The runner `braid serve` builds for the embedded model with config's EngineConfig fields."""
    return load_model(None, default_cache_dir(), embedded, **config)


@pytest.fixture(scope="module")
def q8(embedded):
    model = _runner(embedded, kv_cache_dtype="q8_0", **CACHE)
    assert model.runner.kv_dtype_name == "q8_0" and model.runner.kernels != "torch"
    return model


@pytest.fixture(scope="module")
def sequential(q8):
    return [o.token_ids for o in run(q8, REQUESTS, mode="sequential")[0]]


@pytest.mark.parametrize("mode", ["interleaved", "batched", "continuous"])
def test_every_mode_gives_the_sequential_tokens(q8, sequential, mode):
    outcomes, _ = run(q8, REQUESTS, mode=mode, max_batch_size=4, prefix_caching="off")
    assert [o.token_ids for o in outcomes] == sequential


def test_ngram_speculation_gives_the_sequential_tokens(q8, sequential):
    """Verification rows write keys into q8_0 pages that a rejected proposal leaves behind."""
    outcomes, _ = run(q8, REQUESTS, mode="continuous", speculative="ngram", speculative_tokens=6, ngram_min=1)
    assert [o.token_ids for o in outcomes] == sequential


def test_a_prefix_read_from_the_cache_gives_a_cold_runs_tokens(q8, sequential):
    """The first request's q8_0 pages of the system prompt are read back as they are by the next."""
    with Harness(q8.runner, tokenizer=q8.tokenizer, mode="continuous") as harness:
        tokens, cached = [], []
        for request in REQUESTS:
            (handle,) = harness.submit(**request)
            harness.run()
            tokens.append(harness.tokens(handle))
            cached.append(harness.finished(handle).cached_tokens)
    assert cached[0] == 0 and all(c >= 48 for c in cached[1:]), cached
    assert tokens == sequential


def test_preempted_sessions_resume_to_their_own_tokens(embedded):
    """A cache of 6 pages (96 tokens) and three sessions that grow to about 50 tokens (4 pages) each:
    no two of them fit at once, and each fits alone."""
    model = _runner(embedded, kv_cache_dtype="q8_0", kv_cache_memory=f"{6 * 16 * TOKEN_BYTES}B", max_seq_len=64)
    assert model.runner.num_pages == 6
    requests = [dict(prompt=q, max_new_tokens=45, ignore_eos=True) for q in QUESTIONS]
    alone = [run(model, [r], mode="sequential")[0][0].token_ids for r in requests]
    outcomes, stats = run(model, requests, mode="continuous", max_batch_size=4)
    assert [o.token_ids for o in outcomes] == alone
    assert all(o.final.reason == FinishReason.MAX_TOKENS for o in outcomes)
    assert stats.preemptions > 0 and stats.kv_pages_used == 0


def test_torchs_kernels_read_a_q8_0_cache_too(embedded, q8, sequential):
    """--kernels torch dequantizes the pages it gathers: the same sums as the C kernels' to fp32
    rounding, so the same greedy tokens here, in sequential and continuous mode alike."""
    model = _runner(embedded, kv_cache_dtype="q8_0", kernels="torch", **CACHE)
    assert model.runner.kernels == "torch" and model.runner.kv_dtype_name == "q8_0"
    assert [o.token_ids for o in run(model, REQUESTS[:2], mode="continuous")[0]] == sequential[:2]

"""The paged KV cache under memory pressure, in process (tests/in_process.py): preemption, admission
by the pages in use, and cancels at odd moments, over the tiny model's runner with a small cache.
The engine and the runner decide these; tests/test_prefix_cache.py keeps what crosses the wire
(cached tokens in Usage and the trailers, a chat's turns found again, a cancelled stream).
The harness checks the books after every step."""

from __future__ import annotations

import random

import pytest

from braid.server.engine.types import FinishReason
from in_process import run
from unit.engine_fakes import Harness

# the tiny model's keys and values in its default cache (--kv-cache-dtype auto: float16 on a CPU, its
# head_dim 16 not being whole q8_0 blocks; bfloat16 on CUDA): 2 layers x 2 heads x 16 x 2 bytes x 2
TOKEN_BYTES = 256
PAGE_TOKENS = 16
SYSTEM = (
    "You are a careful assistant who answers questions about the sea, ships and the weather "
    "in plain words, briefly, and never makes anything up. "
) * 4  # about 100 tokens


def _cache(pages: int) -> str:
    return f"{pages * PAGE_TOKENS * TOKEN_BYTES}B"


QUESTIONS = [f"Question {i}: how far is the horizon from a ship's mast {i} meters tall?" for i in range(4)]
# each grows to about 170 tokens (11 pages): two fit in the cache of 24 pages at once, four do not
GROWING = [dict(prompt=q, max_new_tokens=150, ignore_eos=True) for q in QUESTIONS]


@pytest.fixture(scope="module")
def crowded(tiny_dir, in_process):
    """The tiny model's runner with a cache of 24 pages (384 tokens), and the tokens each of GROWING
    gives alone on it (each run by itself, sequential mode), once for the module's modes."""
    model = in_process(tiny_dir, max_seq_len=256, kv_cache_memory=_cache(24))
    assert model.runner.num_pages == 24
    return model, [run(model, [r], mode="sequential")[0][0].token_ids for r in GROWING]


@pytest.mark.parametrize("mode", ["continuous", "batched"])
def test_sessions_preempted_for_memory_resume_to_the_same_tokens(crowded, mode):
    """A cache of 24 pages (384 tokens) and four sessions that grow to about 170 tokens each: the
    scheduler must preempt. Every session still ends normally, with the tokens it gives alone."""
    model, alone = crowded
    outcomes, stats = run(model, GROWING, mode=mode, max_batch_size=4, max_wait_ms=5000)
    assert [o.token_ids for o in outcomes] == alone
    assert all(o.final.reason == FinishReason.MAX_TOKENS for o in outcomes)
    assert stats.preemptions > 0 and stats.kv_pages_used == 0


def test_admission_is_by_the_pages_in_use_not_by_max_seq_len(tiny_dir, in_process):
    """A budget that holds two sessions of --max-seq-len (1,024 tokens) runs eight short ones at once."""
    model = in_process(tiny_dir, max_seq_len=1024, kv_cache_memory=_cache(2 * 1024 // PAGE_TOKENS))
    with Harness(model.runner, tokenizer=model.tokenizer, mode="continuous") as harness:
        handles = [
            h for i in range(8) for h in harness.submit(f"Short prompt {i}", max_new_tokens=150, ignore_eos=True)
        ]
        peak = 0
        while harness.core.sessions:
            harness.step()
            peak = max(peak, len(harness.core.scheduler.running))
        assert peak == 8
        assert all(harness.finished(h).reason == FinishReason.MAX_TOKENS for h in handles)


def test_cancels_at_odd_moments_under_memory_pressure_leave_no_page_held(tiny_dir, in_process):
    """Twelve sessions sharing a prefix in a cache too small for them all (64 pages): preemptions
    happen while half of them are cancelled at random steps, some while queued (or preempted) and
    some while running. The rest end normally, and afterwards no page is held."""
    model = in_process(tiny_dir, max_seq_len=512, kv_cache_memory=_cache(64))
    rng = random.Random(7)
    with Harness(model.runner, tokenizer=model.tokenizer, mode="continuous") as harness:
        handles = [
            h
            for i in range(12)
            for h in harness.submit(SYSTEM + f"Question {i}.", max_new_tokens=200, ignore_eos=True, cache_salt="storm")
        ]
        cut = {h.session_id: rng.randrange(0, 600) for h in handles[1::2]}
        where = []  # where each cancelled session was when its cancel came
        step = 0
        while harness.core.sessions:
            for h in handles[1::2]:
                if cut[h.session_id] == step and harness.finished(h) is None:
                    running = {s.id for s in harness.core.scheduler.running}
                    where.append("running" if h.session_id in running else "waiting")
                    harness.abort(h, FinishReason.CANCELLED)
            harness.step()
            step += 1
        stats = harness.books.snapshot()
        assert [harness.finished(h).reason for h in handles[::2]] == [FinishReason.MAX_TOKENS] * 6
        assert all(harness.finished(h).reason in (FinishReason.CANCELLED, FinishReason.MAX_TOKENS) for h in handles)
    assert {"running", "waiting"} <= set(where), where
    assert stats.kv_pages_used == 0 and stats.preemptions > 0

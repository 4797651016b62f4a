"""--kv-cache-dtype q8_0 as a user starts it: the embedded model serves with keys and values in
llama.cpp's q8_0 blocks, ModelInfo says so, and a prompt read from the cache gives a cold run's
tokens. A model whose head_dim is not whole blocks of 32 is refused at start, in one line.
tests/inprocess/test_q8_0_cache.py runs every mode, speculation and preemption over such a cache."""

from __future__ import annotations

from braid_testing.process import run_braid
from conftest import Server

SYSTEM = "You are a careful assistant who answers questions about the sea in plain words. " * 3


def test_the_flag_starts_and_model_info_says_q8_0():
    server = Server(
        ["--mode", "continuous", "--threads", "1", "--kv-cache-dtype", "q8_0", "--kv-cache-memory", "64MiB"]
    )
    try:
        with server.client() as client:
            info = client.model_info()
            cold = client.generate(SYSTEM + "What is a tide?", max_new_tokens=8, ignore_eos=True)
            warm = client.generate(SYSTEM + "What is a tide?", max_new_tokens=8, ignore_eos=True)
            status = client.server_status()
        # 30 layers x 3 KV heads x (2 blocks of 34 bytes) x keys and values: 12,240 bytes a token, 0.53x bf16's
        assert info.kv_cache_dtype == "q8_0" and status.kv_pages_total == 64 * 2**20 // (16 * 12240)
        assert warm.usage.cached_tokens > 0 and warm.token_ids == cold.token_ids
    finally:
        server.stop()


def test_a_head_dim_not_whole_blocks_is_refused_in_one_line(tiny_dir):
    out = run_braid("serve", "--model", str(tiny_dir), "--kv-cache-dtype", "q8_0")
    assert out.returncode == 1, out.stderr
    line = out.stderr.strip().splitlines()[-1]  # after start-up's log lines
    assert (
        line.startswith("braid: error: ")
        and "--kv-cache-dtype q8_0: the model's head_dim 16 is not a multiple of 32" in line
    ), line

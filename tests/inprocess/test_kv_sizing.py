"""How many KV-cache pages fit in --kv-cache-memory, and what auto and a fraction come to under a cgroup's
memory limit (fake cgroup trees, as in test_resources.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from braid.server.config import EngineConfig
from braid.server.runner.kv_cache import Q8_0, KVCache, auto_dtype, fit_pages, head_dim
from unit.test_resources import GiB, MiB, Host

CPU = torch.device("cpu")
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 (576 / 9).
SMOL = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9)
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # keys and values, fp32


def test_head_dim_is_stated_or_implied():
    assert head_dim(SMOL) == 64
    assert head_dim(SimpleNamespace(**vars(SMOL), head_dim=128)) == 128


def test_bytes_per_token():
    assert KVCache.bytes_per_token(30, 3, 64, torch.float32) == PER_TOKEN
    assert KVCache.bytes_per_token(30, 3, 64, torch.bfloat16) == PER_TOKEN // 2


def test_auto_is_q8_0_on_a_cpu_float16_where_heads_are_not_whole_blocks_and_the_compute_dtype_on_a_gpu():
    """--kv-cache-dtype auto (docs/benchmarks.md: the smallest cache within the quality bound)."""
    assert auto_dtype(CPU, torch.float32, 64) == Q8_0  # the embedded model, Llama 3.2 1B
    assert auto_dtype(CPU, torch.bfloat16, 128) == Q8_0
    assert auto_dtype(CPU, torch.float32, 16) == torch.float16  # the tests' tiny model
    assert auto_dtype(CPU, torch.float32, 80) == torch.float16
    assert auto_dtype(torch.device("cuda"), torch.bfloat16, 64) == torch.bfloat16


def test_the_budget_is_cut_into_pages():
    per_page = 16 * PER_TOKEN
    config = EngineConfig(kv_cache_memory=f"{300 * per_page + 100}B")
    assert fit_pages(config, SMOL, 4096, CPU, torch.float32) == 300
    assert (
        fit_pages(
            EngineConfig(kv_cache_memory=f"{300 * per_page + 100}B", kv_page_size=32), SMOL, 4096, CPU, torch.float32
        )
        == 150
    )
    assert fit_pages(config, SMOL, 4096, CPU, torch.bfloat16) == 600  # --kv-cache-dtype bfloat16: twice the pages


def test_a_budget_too_small_for_one_session_is_a_clear_error():
    with pytest.raises(ValueError, match="--kv-cache-memory 1MiB: one session of --max-seq-len 4096 tokens needs"):
        fit_pages(EngineConfig(kv_cache_memory="1MiB"), SMOL, 4096, CPU, torch.float32)


@pytest.mark.parametrize("size", [0, 8, 24])
def test_a_page_size_not_a_multiple_of_16_is_refused(size):
    with pytest.raises(ValueError, match=f"--kv-page-size {size}: expected a multiple of 16"):
        EngineConfig(kv_page_size=size)


# --- the budget: --kv-cache-memory auto (the default), and fractions, against the cgroup's limit -----------

PER_PAGE = 16 * PER_TOKEN  # 720 KiB
SESSION = 256 * PER_PAGE  # 4096 tokens: 180 MiB


def test_the_default_is_auto() -> None:
    assert EngineConfig().kv_cache_memory == "auto"


def test_auto_holds_every_session_at_full_length_where_memory_allows(tmp_path) -> None:
    host = Host(tmp_path, available_kb=64 * GiB // 1024)  # no cgroup limit, a big host
    config = EngineConfig(max_sessions=4)
    assert fit_pages(config, SMOL, 4096, CPU, torch.float32, host.proc) == 4 * 256
    # not the host's memory: before, half of it (32 GiB, 46,603 pages)
    assert fit_pages(EngineConfig(max_sessions=1), SMOL, 1024, CPU, torch.float32, host.proc) == 64
    # the tests' servers: 16 sessions of the tiny model's 1,024 tokens, 16,384 tokens, all of them
    assert fit_pages(EngineConfig(max_batch_size=16), SMOL, 1024, CPU, torch.float32, host.proc) == 16 * 64


def test_auto_holds_at_most_16384_tokens_and_at_least_one_session_of_max_seq_len(tmp_path) -> None:
    """The embedded model's default, 32 sessions of 4,096 fp32 tokens, reserved 5,760 MiB for 97 MB
    of weights: auto now holds 4 of them (16,384 tokens, 720 MiB), where 32 sessions of 500 tokens
    run unpreempted."""
    host = Host(tmp_path, available_kb=64 * GiB // 1024)
    pages = fit_pages(EngineConfig(), SMOL, 4096, CPU, torch.float32, host.proc)
    assert pages == 16384 // 16 and pages * PER_PAGE == 720 * MiB
    assert fit_pages(EngineConfig(), SMOL, 4096, CPU, torch.bfloat16, host.proc) == 1024  # the same tokens
    assert fit_pages(EngineConfig(max_sessions=64), SMOL, 512, CPU, torch.float32, host.proc) == 1024
    assert fit_pages(EngineConfig(max_sessions=2), SMOL, 4096, CPU, torch.float32, host.proc) == 2 * 256
    # a context past the cap: one session of it, whatever --max-sessions says
    assert fit_pages(EngineConfig(), SMOL, 32768, CPU, torch.float32, host.proc) == 32768 // 16


def test_auto_says_why_it_holds_fewer_sessions_than_max_sessions(tmp_path, caplog) -> None:
    caplog.set_level("INFO", logger="braid.server.runner.kv_cache")
    fit_pages(EngineConfig(), SMOL, 4096, CPU, torch.float32, Host(tmp_path, available_kb=64 * GiB // 1024).proc)
    assert (
        "KV cache: 1024 pages of 16 tokens (16384 tokens, 4 sessions of --max-seq-len), 720 MiB, float32; "
        "auto: 4 sessions of --max-seq-len, at most 16384 tokens (all --max-sessions 32 at full length would "
        "take 5760 MiB)" in caplog.text
    )


def test_auto_is_capped_by_half_of_what_the_cgroup_limit_leaves(tmp_path) -> None:
    host = Host(tmp_path, available_kb=64 * GiB // 1024)
    group = host.v2("/kubepods/pod1/braid")
    (group / "memory.max").write_text(str(1 * GiB))
    (group / "memory.current").write_text(str(256 * MiB))
    config = EngineConfig(max_sessions=32)  # 4 sessions of 4096 tokens: 720 MiB, over half of 768 MiB
    assert fit_pages(config, SMOL, 4096, CPU, torch.float32, host.proc) == int(0.5 * 768 * MiB // PER_PAGE)


def test_a_fraction_is_of_what_the_cgroup_limit_leaves(tmp_path) -> None:
    host = Host(tmp_path, available_kb=64 * GiB // 1024)
    (host.v1("memory", "/docker/x") / "memory.limit_in_bytes").write_text(str(GiB))
    assert fit_pages(EngineConfig(kv_cache_memory="0.5"), SMOL, 512, CPU, torch.float32, host.proc) == int(
        0.5 * GiB // PER_PAGE
    )


def test_a_limit_too_small_for_one_session_names_it(tmp_path) -> None:
    host = Host(tmp_path, available_kb=64 * GiB // 1024)
    (host.v2() / "memory.max").write_text(str(300 * MiB))
    with pytest.raises(
        ValueError,
        match="--kv-cache-memory auto: one session of --max-seq-len 4096 tokens needs "
        "180 MiB, and auto: 0.5 of 300 MiB, cgroup memory limit 300 MiB",
    ):
        fit_pages(EngineConfig(), SMOL, 4096, CPU, torch.float32, host.proc)


def test_bytes_past_the_limit_are_warned_of(tmp_path, caplog) -> None:
    host = Host(tmp_path, available_kb=64 * GiB // 1024)
    (host.v2() / "memory.max").write_text(str(GiB))
    assert (
        fit_pages(EngineConfig(kv_cache_memory="2GiB"), SMOL, 4096, CPU, torch.float32, host.proc)
        == 2 * GiB // PER_PAGE
    )
    assert "more than the 1024 MiB this process may still take (cgroup memory limit" in caplog.text

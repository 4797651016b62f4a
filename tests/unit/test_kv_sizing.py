"""How many KV-cache pages fit in --kv-cache-memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from braid.server.config import EngineConfig
from braid.server.runner.kv_cache import KVCache, fit_pages, head_dim

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


def test_the_budget_is_cut_into_pages():
    per_page = 16 * PER_TOKEN
    config = EngineConfig(kv_cache_memory=f"{300 * per_page + 100}B")
    assert fit_pages(config, SMOL, 4096, CPU, torch.float32) == 300
    assert fit_pages(EngineConfig(kv_cache_memory=f"{300 * per_page + 100}B", kv_page_size=32), SMOL, 4096, CPU,
                     torch.float32) == 150
    assert fit_pages(config, SMOL, 4096, CPU, torch.bfloat16) == 600  # --kv-cache-dtype bfloat16: twice the pages


def test_a_budget_too_small_for_one_session_is_a_clear_error():
    with pytest.raises(ValueError, match="--kv-cache-memory 1MiB: one session of --max-seq-len 4096 tokens needs"):
        fit_pages(EngineConfig(kv_cache_memory="1MiB"), SMOL, 4096, CPU, torch.float32)


@pytest.mark.parametrize("size", [0, 8, 24])
def test_a_page_size_not_a_multiple_of_16_is_refused(size):
    with pytest.raises(ValueError, match=f"--kv-page-size {size}: expected a multiple of 16"):
        EngineConfig(kv_page_size=size)

"""How many KV-cache slots fit: --max-sessions, or fewer where --kv-cache-memory holds fewer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from braid.server.config import EngineConfig
from braid.server.runner.kv_cache import KVCache, fit_slots, head_dim

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


def test_the_budget_caps_the_slots():
    per_slot = 4096 * PER_TOKEN
    config = EngineConfig(max_sessions=32, kv_cache_memory=f"{3 * per_slot + 100}B")
    assert fit_slots(config, SMOL, 4096, CPU, torch.float32) == 3
    assert fit_slots(EngineConfig(max_sessions=2, kv_cache_memory="64GiB"), SMOL, 4096, CPU, torch.float32) == 2


def test_a_budget_too_small_for_one_session_is_a_clear_error():
    with pytest.raises(ValueError, match="--kv-cache-memory 1MiB: one session of --max-seq-len 4096 tokens needs"):
        fit_slots(EngineConfig(kv_cache_memory="1MiB"), SMOL, 4096, CPU, torch.float32)

"""The KV cache commits memory only as positions are written, in small pages."""

from __future__ import annotations

import os

import torch

from braid.server.runner.kv_cache import KVCache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_fresh_slot_commits_only_the_pages_it_writes():
    # SmolLM2-135M's cache shape: 30 layers, 3 KV heads of 64, 4096 positions, 8 slots (4.5 GiB).
    cache = KVCache(num_layers=30, num_slots=8, num_kv_heads=3, max_seq_len=4096, head_dim=64,
                    dtype=torch.float32, device=torch.device("cpu"))
    before = _rss_bytes()
    for layer in range(30):  # a 40-token prompt in slot 5
        cache.k[layer][5, :, :40] = 1.0
        cache.v[layer][5, :, :40] = 1.0
    grown = _rss_bytes() - before
    # 180 (layer, head) regions of 40 x 256 bytes each: about 3 small pages apiece. With transparent
    # huge pages (numpy's zeros asks for them) each region committed 2 MiB: 360 MiB here, and on a
    # VM the first token of every fresh slot took 0.7 s.
    assert grown < 16 * 2**20, f"{grown / 2**20:.0f} MiB committed for a 40-token prompt"
    assert float(cache.k[0][5, 0, 39, 0]) == 1.0 and float(cache.k[0][4].abs().sum()) == 0.0

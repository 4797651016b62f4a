"""The KV cache's memory: fixed-size pages of keys and values, reserved once, written in place.

Which session holds which page, and which pages hold which prefix, is the engine's business
(engine/pages.py); the runner only reads and writes the pages a row's page table names.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from braid.server.config import EngineConfig, parse_memory

_LOGGER = logging.getLogger(__name__)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed cache memory. Never uninitialised: a decode step attends over a view that includes
    masked positions no session has written yet, and a masked NaN still poisons the result (its
    weight is 0, and 0 * NaN is NaN). On the CPU the memory is an anonymous mapping: the OS hands
    out zero pages as positions are first written, so memory is committed only as it is used.
    Small pages on purpose: numpy's zeros would ask for transparent huge pages, and then the first
    token of a fresh slot commits 2 MiB per layer and head; on a VM that cost 0.7 s per slot."""
    if device.type == "cpu":
        count = math.prod(shape)
        buffer = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
        return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Keys and values of every layer in pages of `page_size` positions, laid out
    [page, kv_head, position in page, head_dim]: within a page, a head's keys are contiguous, so
    attention reads a page at a time. A sequence's page table lists its pages in position order;
    position t lives at offset t % page_size of page table[t // page_size]. The memory is reserved
    once at start (the OS commits it as pages are first written)."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> int:
    """Bytes free for the cache now: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def head_dim(model_config) -> int:
    """A transformers config's attention head size (some state it, the rest imply it)."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def fit_pages(config: EngineConfig, model_config, max_seq_len: int, device: torch.device,
              dtype: torch.dtype) -> int:
    """KV-cache pages the --kv-cache-memory budget holds. At least one session of --max-seq-len
    tokens must fit, so a session admitted alone can always run to its end."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads  # GPT-2: none
    per_page = config.kv_page_size * KVCache.bytes_per_token(
        model_config.num_hidden_layers, kv_heads, head_dim(model_config), dtype)
    amount, is_fraction = parse_memory(config.kv_cache_memory)
    budget = amount * free_memory(device) if is_fraction else amount
    pages = int(budget // per_page)
    needed = -(-max_seq_len // config.kv_page_size)
    if pages < needed:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory}: one session of --max-seq-len "
                         f"{max_seq_len} tokens needs {needed * per_page / 2**20:.0f} MiB")
    _LOGGER.info("KV cache: %d pages of %d tokens (%d tokens, %d sessions of --max-seq-len), %.0f MiB, %s",
                 pages, config.kv_page_size, pages * config.kv_page_size, pages // needed, pages * per_page / 2**20,
                 str(dtype).removeprefix("torch."))
    return pages

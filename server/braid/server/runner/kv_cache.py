"""The KV cache: one slot per running session, allocated once and written in place."""

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
    """Keys and values of every layer, laid out [slot, kv_head, position, head_dim].

    A slot holds one session's whole context, so a session's keys are one contiguous view per
    head and a decode step over slots [lo, hi) attends to a view of the cache, never a copy. The
    memory is reserved once at start (pages are touched only as positions are written).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._free = list(range(num_slots))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free slot: keeping running slots low keeps the decode view [lo, hi) tight."""
        self._free.sort()
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        self._free.append(slot)


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


def fit_slots(config: EngineConfig, model_config, max_seq_len: int, device: torch.device,
              dtype: torch.dtype) -> int:
    """KV-cache slots: --max-sessions, or fewer where the --kv-cache-memory budget holds fewer.
    The cache is reserved at start, so the scheduler can never admit more than fits."""
    per_slot = max_seq_len * KVCache.bytes_per_token(model_config.num_hidden_layers,
                                                     model_config.num_key_value_heads, head_dim(model_config), dtype)
    amount, is_fraction = parse_memory(config.kv_cache_memory)
    budget = amount * free_memory(device) if is_fraction else amount
    slots = min(config.max_sessions, int(budget // per_slot))
    if slots < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory}: one session of --max-seq-len "
                         f"{max_seq_len} tokens needs {per_slot / 2**20:.0f} MiB")
    if slots < config.max_sessions:
        _LOGGER.warning("KV cache budget fits %d sessions of %d tokens, not --max-sessions %d", slots,
                        max_seq_len, config.max_sessions)
    _LOGGER.info("KV cache: %d slots x %d tokens, %.0f MiB", slots, max_seq_len, slots * per_slot / 2**20)
    return slots

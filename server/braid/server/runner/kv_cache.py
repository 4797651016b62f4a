"""The KV cache's memory: fixed-size pages of keys and values, reserved once, written in place.

Which session holds which page, and which pages hold which prefix, is the engine's business
(engine/pages.py); the runner only reads and writes the pages a row's page table names.
"""

from __future__ import annotations

import logging
import math
import mmap
from pathlib import Path

import torch

from braid.server import resources
from braid.server.config import EngineConfig, parse_memory
from braid.server.runner.precision import DTYPES

_LOGGER = logging.getLogger(__name__)

# --kv-cache-dtype q8_0: a page's rows are bytes, llama.cpp's block_q8_0 (-ctk q8_0 -ctv q8_0) per 32
# values of a head: the block's fp16 scale d, then 32 int8 q, each value d * q. 34 bytes for 32 values,
# 0.53x bf16's (an fp32 d would make it 0.56x, past the 0.55x the cache is for, and costs no precision
# that matters: the q are 8 bits). The C attention reads the blocks in place (csrc/attention.c).
Q8_0 = torch.uint8
KV_DTYPES = {**DTYPES, "q8_0": Q8_0}  # --kv-cache-dtype's choices but auto, as the pages hold them
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def auto_dtype(device: torch.device, dtype: torch.dtype, head_dim: int) -> torch.dtype:
    """--kv-cache-dtype auto: on the CPU q8_0, the smallest cache whose quality cost stays within
    the bound docs/benchmarks.md sets (the server's default, int8 rows and a q8_0 cache, diverges from
    float32 rows with an fp32 cache no more than llama.cpp's Q4_1 file from its F32, as
    tests/test_precision.py holds; the cache alone costs 0.0008 mean KLD, within 0.002); float16 where
    head_dim is not whole q8_0 blocks. On a GPU the compute dtype."""
    if device.type != "cpu":
        return dtype
    return torch.float16 if head_dim % Q8_BLOCK else Q8_0


def kv_dtype_name(dtype: torch.dtype) -> str:
    """--kv-cache-dtype's name of a cache dtype (ModelInfo.kv_cache_dtype)."""
    return "q8_0" if dtype == Q8_0 else str(dtype).removeprefix("torch.")


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one position of one KV head's keys (or values) in a cache of `dtype`. Raises
    ValueError, one line, for q8_0 with a head_dim that is not whole blocks."""
    if dtype != Q8_0:
        return head_dim * torch.empty((), dtype=dtype).element_size()
    if head_dim % Q8_BLOCK:
        raise ValueError(
            f"--kv-cache-dtype q8_0: the model's head_dim {head_dim} is not a multiple of {Q8_BLOCK} "
            "(q8_0 blocks); use bfloat16 or float16"
        )
    return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as q8_0 rows [..., D / 32 * 34] (uint8), bit for bit as llama.cpp's
    quantize_row_q8_0_ref and csrc/attention.c's kv_store_q8_0 make them: d = amax / 127 stored as
    fp16, q = x times the fp32 reciprocal of the unrounded d, rounded half away from zero."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d == 0, 0.0, 1.0 / d)
    whole = scaled.trunc()
    q = torch.where((scaled - whole).abs() == 0.5, whole + scaled.sign(), scaled.round())  # C's roundf
    rows = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=-1)
    return rows.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 rows [..., D / 32 * 34] as fp32 [..., D]: d * q, one fp32 rounding, as the C kernels read them."""
    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].view(torch.int8).float()
    return (d * q).reshape(*rows.shape[:-1], -1)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [..., D] as a cache of `dtype` holds them (rounded as torch's .to() does)."""
    return quantize_q8_0(x) if dtype == Q8_0 else x.to(dtype)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows [..., row bytes] as values [..., D] in `dtype`."""
    return dequantize_q8_0(rows).to(dtype) if rows.dtype == Q8_0 else rows.to(dtype)


def write_rows(pages: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """values [N, D] into rows `index` of a layer's pages [pages, KVH, P, row] viewed as [-1, row].
    Rows of a flat view: an advanced-index assignment here would have torch copy the whole cache
    of the layer (measured: ~4 ms, against 6 us)."""
    pages.view(-1, pages.shape[-1]).index_copy_(0, index, encode(values, pages.dtype))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed cache memory. Never uninitialised: a decode step attends over a view that includes
    masked positions no session has written yet, and a masked NaN still poisons the result (its
    weight is 0, and 0 * NaN is NaN). On the CPU the memory is an anonymous mapping: the OS hands
    out zero pages as positions are first written, so memory is committed only as it is used.
    Small pages on purpose: numpy's zeros would ask for transparent huge pages, and then the first
    token of a fresh slot commits 2 MiB per layer and head; on a VM that cost 0.7 s per slot."""
    if device.type == "cpu":
        count = math.prod(shape)
        buffer = mmap.mmap(-1, max(1, count * _element_size(dtype)))
        return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Keys and values of every layer in pages of `page_size` positions, laid out
    [page, kv_head, position in page, head_dim] (q8_0: [..., row bytes], head_dim / 32 blocks): within a page, a head's keys are contiguous, so
    attention reads a page at a time. A sequence's page table lists its pages in position order;
    position t lives at offset t % page_size of page table[t // page_size]. The memory is reserved
    once at start (the OS commits it as pages are first written)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_pages, num_kv_heads, page_size, row_bytes(head_dim, dtype) // _element_size(dtype))
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """The memory reserved for the pages, keys and values of every layer."""
        return sum(t.nbytes for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * row_bytes(head_dim, dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --kv-cache-memory auto (the default) sizes the cache for the model and --max-sessions, not the
# machine: pages for --max-sessions sessions of --max-seq-len, but for AUTO_TOKENS tokens at most, and
# for one session of --max-seq-len at least. Pages go to the tokens sessions have, not to their
# --max-seq-len, so the cap still runs 32 sessions of about 500 tokens (or 4 of the full 4,096) with
# none preempted, and past it the scheduler preempts, never fails. Without the cap, the embedded model's
# 32 sessions of 4,096 tokens reserved 5,760 MiB of fp32 keys and values for 97 MB of weights; with
# it, 720 MiB of fp32 (191 MiB of q8_0, auto's dtype on the CPU). llama.cpp's server shares one
# context (4,096 or the model's 8,192 tokens, f16) among its slots; vLLM takes 90% of a GPU (on a
# CPU, VLLM_CPU_KVCACHE_SPACE).
# The prefix cache keeps finished sessions' pages until they are needed, so whatever the budget, it
# is in the end resident: it is capped at AUTO_FRACTION of the memory the process may still take
# (what is left under its cgroup's limit, else the host's available memory), leaving the rest for
# the constraint cache, activations, the tokenizer and gRPC's buffers, and for the memory the first
# passes take (the kernels' packed weights are made after the budget is read).
AUTO_TOKENS = 16384
AUTO_FRACTION = 0.5


def auto_sessions(max_sessions: int, max_seq_len: int) -> int:
    """How many sessions of --max-seq-len --kv-cache-memory auto makes room for."""
    return max(1, min(max_sessions, AUTO_TOKENS // max_seq_len))


def free_memory(device: torch.device, proc: Path = Path("/proc")) -> resources.Memory:
    """Bytes the cache may take now, and where the figure comes from: the GPU's free memory, or what
    the process may still take of the host's (its cgroup's limit counted)."""
    if device.type == "cuda":
        return resources.Memory(torch.cuda.mem_get_info(device)[0], f"{device}'s free memory")
    return resources.available_memory(proc)


def head_dim(model_config) -> int:
    """A transformers config's attention head size (some state it, the rest imply it)."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def fit_pages(
    config: EngineConfig,
    model_config,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    proc: Path = Path("/proc"),
) -> int:
    """KV-cache pages the --kv-cache-memory budget holds. At least one session of --max-seq-len
    tokens must fit, so a session admitted alone can always run to its end."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads  # GPT-2: none
    per_page = config.kv_page_size * KVCache.bytes_per_token(
        model_config.num_hidden_layers, kv_heads, head_dim(model_config), dtype
    )
    needed = -(-max_seq_len // config.kv_page_size)  # pages of one session of --max-seq-len
    budget, why, available = _budget(config, needed * per_page, max_seq_len, device, proc)
    pages = int(budget // per_page)
    if pages < needed:
        raise ValueError(
            f"--kv-cache-memory {config.kv_cache_memory}: one session of --max-seq-len "
            f"{max_seq_len} tokens needs {needed * per_page / 2**20:.0f} MiB, and {why} "
            f"gives {budget / 2**20:.0f} MiB"
        )
    _LOGGER.info(
        "KV cache: %d pages of %d tokens (%d tokens, %d sessions of --max-seq-len), %.0f MiB, %s; %s",
        pages,
        config.kv_page_size,
        pages * config.kv_page_size,
        pages // needed,
        pages * per_page / 2**20,
        kv_dtype_name(dtype),
        why,
    )
    if available is not None and budget > available.available:
        _LOGGER.warning(
            "--kv-cache-memory %s is more than the %.0f MiB this process may still take (%s): as "
            "the prefix cache fills it, the process may be killed for want of memory",
            config.kv_cache_memory,
            available.available / 2**20,
            available.reason,
        )
    return pages


def _budget(
    config: EngineConfig, session_bytes: int, max_seq_len: int, device: torch.device, proc: Path
) -> tuple[float, str, resources.Memory | None]:
    """The cache's bytes, why, and the memory free (None where it was not needed for the budget and
    is not worth checking: the GPU's)."""
    if config.kv_cache_memory == "auto":
        free = free_memory(device, proc)
        sessions = auto_sessions(config.max_sessions, max_seq_len)
        wanted = sessions * session_bytes
        if sessions == config.max_sessions:
            why = f"auto: --max-sessions {sessions} sessions of --max-seq-len"
        else:
            why = (
                f"auto: {sessions} sessions of --max-seq-len, at most {AUTO_TOKENS} tokens (all --max-sessions "
                f"{config.max_sessions} at full length would take {config.max_sessions * session_bytes / 2**20:.0f} MiB)"
            )
        if wanted <= AUTO_FRACTION * free.available:
            return wanted, why, free
        return (
            AUTO_FRACTION * free.available,
            f"auto: {AUTO_FRACTION:g} of {free.available / 2**20:.0f} MiB, {free.reason} ({sessions} "
            f"sessions of --max-seq-len would take {wanted / 2**20:.0f} MiB)",
            free,
        )
    amount, is_fraction = parse_memory(config.kv_cache_memory)
    free = free_memory(device, proc) if is_fraction or device.type != "cuda" else None
    if is_fraction:
        return amount * free.available, f"{amount:g} of {free.available / 2**20:.0f} MiB, {free.reason}", free
    return amount, "--kv-cache-memory", free

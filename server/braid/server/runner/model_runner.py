"""The model runner: rows of new tokens in, one forward pass, next token ids out.

It never sees a session, a queue, a socket or a protobuf: the engine decides what runs and builds
the rows (runner/rows.py); the runner packs them into tensors, runs the decoder over its KV cache
and samples. It also owns what depends on the hardware: the device, torch's threads, and how many
KV-cache slots fit.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import LoadedModel
from braid.server.runner.kv_cache import KVCache, fit_slots
from braid.server.runner.llama import DecodeRows, ForwardBatch, LlamaDecoder, PrefillChunk
from braid.server.runner.rows import Row, Sampling
from braid.server.runner.sampler import random_state, sample

_LOGGER = logging.getLogger(__name__)


def pick_device(device: str) -> tuple[torch.device, torch.dtype]:
    """'auto' is CUDA with bf16 where there is a GPU, else the CPU with fp32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


class ModelRunner:
    def __init__(self, model: LoadedModel, device: torch.device, dtype: torch.dtype, num_slots: int,
                 max_seq_len: int, allow_kernels: bool = True) -> None:
        if model.architecture not in LlamaDecoder.SUPPORTED:
            raise ValueError(f"--model: architecture {model.architecture} is not supported; braid runs "
                             f"{', '.join(LlamaDecoder.SUPPORTED)}")
        self.device, self.dtype = device, dtype
        self.max_seq_len = max_seq_len
        self.decoder = LlamaDecoder(model.hf_model, max_seq_len, device, dtype, allow_kernels)
        self.cache = KVCache(self.decoder.num_layers, num_slots, self.decoder.num_kv_heads, max_seq_len,
                             self.decoder.head_dim, dtype, device)
        self.vocab_size = self.decoder.vocab_size
        self.num_parameters = sum(p.numel() for p in model.hf_model.parameters())

    @classmethod
    def build(cls, config: EngineConfig, model: LoadedModel) -> ModelRunner:
        """The runner --device, --threads, --kernels, --max-seq-len and --kv-cache-memory ask for."""
        device, dtype = pick_device(config.device)
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        context = getattr(model.hf_model.config, "max_position_embeddings", None) or 2048
        max_seq_len = min(config.max_seq_len, context)
        num_slots = fit_slots(config, model.hf_model.config, max_seq_len, device, dtype)
        return cls(model, device, dtype, num_slots, max_seq_len, allow_kernels=config.kernels == "auto")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @staticmethod
    def random_state(sampling: Sampling) -> object:
        """A sequence's random state for Row.rng, made once per sequence."""
        return random_state(sampling)

    def run(self, rows: Sequence[Row]) -> list[int | None]:
        """One forward pass. Returns, per row, the sampled token, or None for a row that does not
        sample (a prompt chunk that does not reach the end of its prompt)."""
        batch, sampled = self._build(rows)
        logits = self.decoder.forward(batch, self.cache)  # [R, V], rows in `sampled` order
        tokens: list[int | None] = [None] * len(rows)
        for i, token in zip(sampled, sample(logits, [rows[i] for i in sampled])):
            tokens[i] = token
        return tokens

    def _build(self, rows: Sequence[Row]) -> tuple[ForwardBatch, list[int]]:
        """Packs prompt chunks first, then one token per decoding row. Returns the batch and the
        indices of the rows that sample, in the order of its logit rows."""
        prefills = [i for i, r in enumerate(rows) if r.is_prompt or len(r.token_ids) > 1]
        decodes = [i for i, r in enumerate(rows) if not (r.is_prompt or len(r.token_ids) > 1)]
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[PrefillChunk] = []
        logit_rows: list[int] = []
        sampled: list[int] = []
        for i in prefills:
            r = rows[i]
            chunks.append(PrefillChunk(slot=r.slot, start=r.start, length=len(r.token_ids), offset=len(ids)))
            ids += r.token_ids
            positions += range(r.start, r.start + len(r.token_ids))
            if r.sample:
                logit_rows.append(len(ids) - 1)
                sampled.append(i)
        for i in decodes:
            r = rows[i]
            ids.append(r.token_ids[0])
            positions.append(r.start)
            if r.sample:
                logit_rows.append(len(ids) - 1)
                sampled.append(i)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            prefills=chunks,
            decode=self._decode_rows([rows[i] for i in decodes]) if decodes else None,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev))
        return batch, sampled

    def _decode_rows(self, decodes: list[Row]) -> DecodeRows:
        slots = [r.slot for r in decodes]
        lengths = [r.start + 1 for r in decodes]  # the new token included
        lo, hi = min(slots), max(slots)
        span = hi - lo + 1
        kv_len = max(lengths)
        dev = self.device
        contiguous = slots == list(range(lo, hi + 1))
        rows_in_span = None if contiguous else torch.tensor([s - lo for s in slots], device=dev)
        mask = None
        if not contiguous or any(n != kv_len for n in lengths):
            span_lengths = [1] * span  # holes see position 0 only, so their softmax is defined
            for slot, n in zip(slots, lengths):
                span_lengths[slot - lo] = n
            mask = (torch.arange(kv_len, device=dev).unsqueeze(0)
                    < torch.tensor(span_lengths, device=dev).unsqueeze(1)).view(span, 1, 1, kv_len)
        kv_heads, max_seq = self.decoder.num_kv_heads, self.cache.max_seq_len
        cache_index = [(slot * kv_heads + h) * max_seq + n - 1 for slot, n in zip(slots, lengths)
                       for h in range(kv_heads)]
        return DecodeRows(count=len(decodes), slots=torch.tensor(slots, dtype=torch.long, device=dev),
                          slot_lo=lo, span=span, cache_index=torch.tensor(cache_index, dtype=torch.long, device=dev),
                          rows_in_span=rows_in_span, kv_len=kv_len, mask=mask)

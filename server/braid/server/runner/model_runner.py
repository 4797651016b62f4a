"""The model runner: rows of new tokens in, one forward pass, next token ids out.

It never sees a session, a queue, a socket or a protobuf: the engine decides what runs and builds
the rows (runner/rows.py); the runner packs them into tensors, runs the decoder over its KV cache
and samples. It also owns what depends on the hardware: the device, torch's threads, and how many
KV-cache slots fit.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from braid.server.config import EngineConfig
from braid.server.model.loader import LoadedModel
from braid.server.runner.kernels import pick_ops
from braid.server.runner.kv_cache import KVCache, fit_slots
from braid.server.runner.llama import DecodeRows, ForwardBatch, LlamaDecoder, PrefillChunk
from braid.server.runner.precision import DTYPES, Precision
from braid.server.runner.rows import Row, Sampling
from braid.server.runner.sampler import random_state, sample

_LOGGER = logging.getLogger(__name__)


def pick_device(device: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device, and the dtype activations and the KV cache are computed in: float32 on a CPU
    (whatever the weights' format), --dtype on CUDA (auto: bfloat16)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if dev.type != "cuda":
        return dev, torch.float32
    return dev, DTYPES.get(dtype, torch.bfloat16)


class ModelRunner:
    def __init__(self, model: LoadedModel, device: torch.device, dtype: torch.dtype, num_slots: int,
                 max_seq_len: int, allow_kernels: bool = True, weight_dtype: str = "auto",
                 quantization: str = "auto") -> None:
        if model.architecture not in LlamaDecoder.SUPPORTED:
            raise ValueError(f"--model: architecture {model.architecture} is not supported; braid runs "
                             f"{', '.join(LlamaDecoder.SUPPORTED)}")
        self.device, self.dtype = device, dtype
        self.max_seq_len = max_seq_len
        ops = pick_ops(device, dtype, allow_kernels)
        precision = Precision(model, weight_dtype, quantization)
        self.decoder = LlamaDecoder(model.hf_model, max_seq_len, ops, precision)
        self.cache = KVCache(self.decoder.num_layers, num_slots, self.decoder.num_kv_heads, max_seq_len,
                             self.decoder.head_dim, dtype, device)
        self.vocab_size = self.decoder.vocab_size
        self.num_parameters = sum(p.numel() for p in model.hf_model.parameters())
        self.kernels = ops.isa or "torch"  # the C kernels' instruction set, or torch's ops
        self.quantization = quantization
        self.weight_formats = dict(precision.formats)  # tensors served in each format
        self.weight_bytes = self.decoder.weight_bytes
        _LOGGER.info("kernels: %s; weights: %s, %.0f MB", ops.name,
                     ", ".join(f"{n} {fmt}" for fmt, n in precision.formats.most_common()), self.weight_bytes / 1e6)

    @classmethod
    def build(cls, config: EngineConfig, model: LoadedModel) -> ModelRunner:
        """The runner --device, --dtype, --quantization, --threads, --kernels, --max-seq-len and
        --kv-cache-memory ask for."""
        device, dtype = pick_device(config.device, config.dtype)
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        context = getattr(model.hf_model.config, "max_position_embeddings", None) or 2048
        max_seq_len = min(config.max_seq_len, context)
        num_slots = fit_slots(config, model.hf_model.config, max_seq_len, device, dtype)
        return cls(model, device, dtype, num_slots, max_seq_len, allow_kernels=config.kernels == "auto",
                   weight_dtype=config.dtype, quantization=config.quantization)

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

    @torch.no_grad()
    def perplexity(self, token_ids: Sequence[int], chunk: int = 512) -> float:
        """exp of the mean negative log-likelihood of token_ids[1:], each given all before it: the
        text prefilled into slot 0 in chunks, with every position's logits kept. For measuring a
        format's quality (--quantization), not for serving."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        assert 1 < len(ids) <= self.max_seq_len
        nll = 0.0
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:start + chunk]
            n = len(piece)
            batch = ForwardBatch(input_ids=piece, positions=torch.arange(start, start + n, device=self.device),
                                 prefills=[PrefillChunk(slot=0, start=start, length=n, offset=0)], decode=None,
                                 logit_rows=torch.arange(n, device=self.device))
            targets = ids[start + 1:start + n + 1]
            logits = self.decoder.forward(batch, self.cache)[:len(targets)].float()
            nll -= torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum().item()
        return math.exp(nll / (len(ids) - 1))

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

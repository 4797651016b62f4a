"""The model runner: sessions' new tokens in, one forward pass, next token ids out.

It never sees a queue, a socket or a protobuf: the scheduler decides what runs, the runner only
builds the packed tensors, runs the decoder over its KV cache and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from braid.server.engine.session import Session
from braid.server.model.loader import LoadedModel
from braid.server.runner.kv_cache import KVCache
from braid.server.runner.llama import DecodeRows, ForwardBatch, LlamaDecoder, PrefillChunk
from braid.server.runner.sampler import sample

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Work:
    """Feed `num_tokens` of `session`'s uncached tokens to the model in the next forward pass."""

    session: Session
    num_tokens: int


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
        self.decoder = LlamaDecoder(model.hf_model, max_seq_len, device, dtype, allow_kernels)
        self.cache = KVCache(self.decoder.num_layers, num_slots, self.decoder.num_kv_heads, max_seq_len,
                             self.decoder.head_dim, dtype, device)
        self.eos_token_ids = model.eos_token_ids
        self.vocab_size = self.decoder.vocab_size
        self.num_parameters = sum(p.numel() for p in model.hf_model.parameters())

    def run(self, work: Sequence[Work]) -> list[int | None]:
        """One forward pass. Returns, per work item, the sampled token, or None for a prompt chunk
        that does not reach the end of its prompt."""
        batch, sampled_work = self._build(work)
        logits = self.decoder.forward(batch, self.cache)  # [R, V], rows in sampled_work order
        tokens = sample(logits, [w.session for w in sampled_work], self.eos_token_ids)
        by_work = {id(w): t for w, t in zip(sampled_work, tokens)}
        return [by_work.get(id(w)) for w in work]

    def _build(self, work: Sequence[Work]) -> tuple[ForwardBatch, list[Work]]:
        """Packs prompt chunks first, then one token per decoding session."""
        prefills = [w for w in work if w.session.is_prefilling or w.num_tokens > 1]
        decodes = [w for w in work if not (w.session.is_prefilling or w.num_tokens > 1)]
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[PrefillChunk] = []
        logit_rows: list[int] = []
        sampled_work: list[Work] = []
        for w in prefills:
            s, start = w.session, w.session.num_cached
            chunks.append(PrefillChunk(slot=s.slot, start=start, length=w.num_tokens, offset=len(ids)))
            ids += s.token_ids[start:start + w.num_tokens]
            positions += range(start, start + w.num_tokens)
            if start + w.num_tokens == len(s.token_ids):
                logit_rows.append(len(ids) - 1)
                sampled_work.append(w)
        for w in decodes:
            ids.append(w.session.token_ids[-1])
            positions.append(w.session.num_cached)
            logit_rows.append(len(ids) - 1)
            sampled_work.append(w)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            prefills=chunks,
            decode=self._decode_rows(decodes) if decodes else None,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev))
        return batch, sampled_work

    def _decode_rows(self, decodes: list[Work]) -> DecodeRows:
        slots = [w.session.slot for w in decodes]
        lengths = [w.session.num_cached + 1 for w in decodes]  # the new token included
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
        return DecodeRows(count=len(decodes), slots=torch.tensor(slots, dtype=torch.long, device=dev), slot_lo=lo, span=span,
                          cache_index=torch.tensor(cache_index, dtype=torch.long, device=dev),
                          rows_in_span=rows_in_span, kv_len=kv_len, mask=mask)

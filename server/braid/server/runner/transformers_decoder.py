"""The fallback decoder: any causal LM transformers runs, through the model's own forward.

braid has native decoders for a few families (runner/families.py); every other causal LM runs here,
behind the same interface as Decoder, so the runner, the scheduler, sessions, streaming,
sampling and constraints are the same for both. Keys and values still live in braid's paged KV
cache: for each sequence of a pass, its cached positions are gathered from its pages into a
transformers DynamicCache, the model runs the new tokens over it, and the new keys and values are
written back into the pages. So a row needs nothing but its page table: prefix sharing, preemption
and every scheduling mode work as with a native decoder. Prompt chunks run one at a time; the decode
rows of a pass run together, padded as transformers' batched generation pads. Slower (the past is
copied out of the pages every pass), but the model's own numbers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from braid.server.runner.kv_cache import KVCache, write_rows
from braid.server.runner.batch import ForwardBatch
from braid.server.runner.attention import gather


@dataclass
class _Sequence:
    """One sequence's tokens [offset, offset + length) of a packed batch, from position `start`."""

    offset: int
    length: int
    start: int
    pages: torch.Tensor  # [pages] long: its page table, covering [0, start + length)


class TransformersDecoder:
    """A transformers causal LM over braid's paged KV cache. The model is moved to the device and
    compute dtype once; its cache must be plain keys and values per layer (checked on a probe)."""

    def __init__(self, hf_model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import DynamicCache

        self._new_cache = DynamicCache
        self.model = hf_model.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = device, dtype
        architecture = type(hf_model).__name__
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        with torch.no_grad():  # one token: the cache's shape and the logits' width
            probe = self._new_cache()
            logits = self.model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=probe, use_cache=True
            ).logits
        shapes = {tuple(getattr(layer, "keys", None).shape) if _is_plain(layer) else None for layer in probe.layers}
        if None in shapes or len(shapes) != 1:
            raise ValueError(
                f"--model: architecture {architecture} keeps a cache braid cannot page (not one key and "
                "value tensor of one shape per layer)"
            )
        ((_, self.num_kv_heads, _, self.head_dim),) = shapes
        self.num_layers = len(probe.layers)
        self.vocab_size = logits.shape[-1]
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.huge_page_bytes = 0  # torch's own tensors, as torch allocates them

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Runs each prompt chunk on its own and the decode rows together, writes their keys/values
        into the cache, returns [R, V] float32 logits of batch.logit_rows."""
        out = torch.empty(batch.logit_rows.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)
        for seq in self._sequences(batch):
            in_seq = (batch.logit_rows >= seq.offset) & (batch.logit_rows < seq.offset + seq.length)
            wanted = in_seq.nonzero().squeeze(1)  # [W]: rows of out this sequence's logits fill
            logits = self._run(seq, batch, cache, batch.logit_rows[wanted] - seq.offset)
            out[wanted] = logits
        if batch.decode is not None and batch.decode.count > 1:
            first = batch.input_ids.shape[0] - batch.decode.count
            wanted = (batch.logit_rows >= first).nonzero().squeeze(1)
            out[wanted] = self._run_decodes(batch, cache)[batch.logit_rows[wanted] - first]
        return out

    def _run_decodes(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The decode rows' new tokens through the model in one pass; [B, V] logits. Each row's past
        is read from its pages into a [B, KVH, T, D] cache where a shorter row's tail is padding that
        the attention mask hides (as transformers' own batched generation pads), so its new key
        lands at T for every row; the row's own position (position_ids) is its length."""
        dec = batch.decode
        first = batch.input_ids.shape[0] - dec.count
        starts = batch.positions[first:]  # [B]: each row's cached length, its new token's position
        longest = int(starts.max())
        past = self._new_cache()
        if longest:
            past = self._new_cache(
                ddp_cache_data=[
                    (gather(k, dec.tables, longest, self.dtype), gather(v, dec.tables, longest, self.dtype))
                    for k, v in zip(cache.k, cache.v)
                ]
            )
        keys = torch.arange(longest + 1, device=self.device)
        mask = ((keys.unsqueeze(0) < starts.unsqueeze(1)) | (keys == longest)).long()  # [B, T + 1]
        kwargs = {"logits_to_keep": 1} if self._keeps_logits else {}
        logits = self.model(
            input_ids=batch.input_ids[first:].unsqueeze(1),
            position_ids=starts.unsqueeze(1),
            attention_mask=mask,
            past_key_values=past,
            use_cache=True,
            **kwargs,
        ).logits[:, -1]
        # [B, KVH, T + 1, D] -> the new rows [B KVH, D]
        self._store(
            past,
            cache,
            batch.kv_index[first * self.num_kv_heads :],
            lambda values: values[:, :, longest].reshape(-1, self.head_dim),
        )
        return logits.float()

    def _run(self, seq: _Sequence, batch: ForwardBatch, cache: KVCache, keep: torch.Tensor) -> torch.Tensor:
        """One sequence's new tokens through the model; [len(keep), V] logits at its tokens `keep`."""
        past = self._new_cache()
        if seq.start:
            table = seq.pages.unsqueeze(0)
            past = self._new_cache(
                ddp_cache_data=[
                    (gather(k, table, seq.start, self.dtype), gather(v, table, seq.start, self.dtype))
                    for k, v in zip(cache.k, cache.v)
                ]
            )  # [1, KVH, start, D] per layer
        rows = slice(seq.offset, seq.offset + seq.length)
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        logits = self.model(
            input_ids=batch.input_ids[rows].unsqueeze(0),
            position_ids=batch.positions[rows].unsqueeze(0),
            past_key_values=past,
            use_cache=True,
            **kwargs,
        ).logits[0]
        if not self._keeps_logits:
            logits = logits[keep]
        index = batch.kv_index[seq.offset * self.num_kv_heads : (seq.offset + seq.length) * self.num_kv_heads]
        new = slice(seq.start, seq.start + seq.length)
        # [1, KVH, T, D] -> the new rows [L KVH, D]
        self._store(past, cache, index, lambda values: values[0, :, new].transpose(0, 1).reshape(-1, self.head_dim))
        return logits.float()

    @staticmethod
    def _store(past, cache: KVCache, index: torch.Tensor, new_rows) -> None:
        """Writes each layer's new keys and values (new_rows: a layer's tensor -> [N, D]) into the
        pages, at index (the cache viewed as [-1, D])."""
        for layer, k_cache, v_cache in zip(past.layers, cache.k, cache.v):
            for values, pages in ((layer.keys, k_cache), (layer.values, v_cache)):
                write_rows(pages, index, new_rows(values))

    @staticmethod
    def _sequences(batch: ForwardBatch) -> list[_Sequence]:
        """The prompt chunks, each run on its own, and a decode row that is alone (it needs no
        padding nor mask)."""
        seqs = [_Sequence(c.offset, c.length, c.start, c.pages) for c in batch.prefills]
        dec = batch.decode
        if dec is not None and dec.count == 1:
            first = batch.input_ids.shape[0] - 1
            seqs.append(_Sequence(first, 1, int(batch.positions[first]), dec.tables[0]))
        return seqs


def _is_plain(layer) -> bool:
    """A cache layer holding all keys and values as [B, KVH, T, D] tensors (not a sliding window's
    last few, nor a recurrent state)."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer and isinstance(getattr(layer, "keys", None), torch.Tensor)

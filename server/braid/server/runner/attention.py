"""Attention over braid's paged KV cache, one layer of a packed batch: braid's C attention for every
row where it runs (each row by itself through its page table), else torch's, per prompt chunk and
once, batched, over all decoding rows, over the keys and values gathered from the pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from braid.server.runner.batch import ForwardBatch
from braid.server.runner.kernels.step import decode_attention
from braid.server.runner.kv_cache import decode, write_rows


@dataclass
class Attention:
    """A decoder's attention: its heads, scale and soft-capping (Family.gemma_attention: the config's
    scale, soft-capped scores and sliding windows, as transformers' eager attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None = None
    gemma: bool = False

    def __call__(
        self,
        qkv: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None,
        rows: tuple[torch.Tensor, bool] | None,
    ) -> torch.Tensor:
        """[N, H * D]. q, k, v: [N, heads, D] views of qkv [N, (H + 2 KVH) D], after RoPE; k_cache,
        v_cache: the layer's pages [pages, KVH, P, D]; window: a sliding-window layer's; rows: the
        pass's batch.row_tables() where braid's C attention runs, else None. Keys and values are
        written into the pages first, and attention always reads them back from there, so a prefix
        read from the cache and one just computed are the same numbers (in the cache's dtype)."""
        n, d = q.shape[0], self.head_dim
        out = torch.empty(n, self.num_heads * d, dtype=q.dtype, device=q.device)
        if rows is not None:  # braid's C attention, every row's bits its own (batch.row_tables; a chunk's in tiles)
            tables, shared = rows
            if shared:  # rows read each other's keys: all written first
                self._write_keys(k, v, batch.kv_index, k_cache, v_cache)
            decode_attention(
                qkv,
                self.num_heads,
                k_cache,
                v_cache,
                tables,
                batch.positions,
                out,
                self.scale,
                self.softcap,
                window,
                write=not shared,
            )
            return out
        self._write_keys(k, v, batch.kv_index, k_cache, v_cache)
        dec = batch.decode
        for c in batch.prefills:
            span = slice(c.offset, c.offset + c.length)
            end = c.start + c.length
            qc = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            kc = gather(k_cache, c.pages.unsqueeze(0), end, q.dtype)  # [1, KVH, T, D]
            vc = gather(v_cache, c.pages.unsqueeze(0), end, q.dtype)
            if self.gemma:
                o = self._gemma_attend(qc, kc, vc, _chunk_mask(c.start, c.length, q.device, window))
            elif c.start == 0:
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
            else:
                mask = _chunk_mask(c.start, c.length, q.device)
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
            out[span] = o[0].transpose(0, 1).reshape(c.length, -1)
        if dec is not None:
            span = slice(n - dec.count, n)
            group = self.num_heads // self.num_kv_heads
            # Grouped-query trick: the `group` query heads that share a KV head become `group` query
            # rows of that head, so no key or value is ever repeated.
            qd = q[span].view(dec.count, self.num_kv_heads, group, d)
            kd = gather(k_cache, dec.tables, dec.kv_len, q.dtype)  # [B, KVH, T, D]
            vd = gather(v_cache, dec.tables, dec.kv_len, q.dtype)
            if self.gemma:
                o = self._gemma_attend(qd, kd, vd, _decode_mask(batch.positions[span], dec.kv_len, window))
            else:
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask)  # [B, KVH, G, D]
            out[span] = o.reshape(dec.count, -1)
        return out

    def _gemma_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention with the config's scale and soft-capped scores (Family.gemma_attention), as
        transformers' eager attention. q: [B, H, L, D]; k, v: [B, KVH, T, D]; mask: [..., L, T] bool."""
        if q.shape[1] != k.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = softcap(scores, self.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _write_keys(
        self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Every row's key and value (k, v: [N, KVH, D]) into the pages, at index (batch.kv_index)."""
        write_rows(k_cache, index, k.reshape(-1, self.head_dim))
        write_rows(v_cache, index, v.reshape(-1, self.head_dim))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def gather(cache: torch.Tensor, tables: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, KVH, length, D]: the first `length` positions of each sequence's pages (tables [B, pages]),
    copied out of the cache [pages, KVH, P, D] (q8_0: its bytes, dequantized) in `dtype` (torch's attention reads one contiguous
    run per head; braid's C kernel reads the pages in place)."""
    b = tables.shape[0]
    _, kv_heads, page_size, row = cache.shape
    pages = cache[tables[:, : -(-length // page_size)]]  # [B, n, KVH, P, row]
    return decode(pages.transpose(1, 2).reshape(b, kv_heads, -1, row)[:, :, :length], dtype)


def _chunk_mask(start: int, length: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[L, start + L] bool: query i (at position start + i) sees keys at positions <= start + i
    (and, in a sliding window, > start + i - window)."""
    keys = torch.arange(start + length, device=device).unsqueeze(0)
    queries = torch.arange(start, start + length, device=device).unsqueeze(1)
    return (keys <= queries) & (keys > queries - window) if window else keys <= queries


def _decode_mask(positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, T] bool: decode row b (its new token at positions[b]) sees keys at positions
    <= positions[b] (and, in a sliding window, > positions[b] - window)."""
    keys = torch.arange(kv_len, device=positions.device).unsqueeze(0)
    at = positions.unsqueeze(1)
    seen = (keys <= at) & (keys > at - window) if window else keys <= at
    return seen.view(positions.shape[0], 1, 1, kv_len)

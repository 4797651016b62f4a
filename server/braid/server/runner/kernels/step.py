"""braid's C attention over the paged KV cache, and a whole pass in one C call (DecodeStep)."""

from __future__ import annotations

import torch

from braid.server.runner.kernels.extension import ACTIVATIONS, FORMAT_CODES, LAYER_FIELDS, _cpu_kernels

# Up to this many multiply-adds, a matmul's LoRA x A^T is done by every thread for every row itself
# instead of shared out and met at a barrier (decode_step.c, lora_down): one row's rank-16 products
# over a projection group of the embedded model are 9k-28k, 16 rows' over 4 adapters 147k-442k.
LORA_ALONE_MACS = 1 << 17
# a KV cache's dtypes, in C (uint8: q8_0 blocks, runner/kv_cache.py)
KV_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.uint8: "q8_0"}
# A pass of up to this many rows (a decode batch: --max-batch-size's 32 by default, and a speculation's
# proposals) reuses activation buffers kept between passes; a bigger one (a prompt chunk, up to
# --prefill-chunk rows) gets its own, freed when it returns. Kept, the largest pass's were held for the
# process's life: 62 MiB at the 1B shape after one 512-token chunk (benchmarks/memory_steps.py).
KEPT_SCRATCH_ROWS = 64


def _kv_format(cache: torch.Tensor) -> int:
    """The C format code of a KV cache tensor's dtype."""
    return FORMAT_CODES[KV_FORMATS[cache.dtype]]


def decode_attention(
    qkv: torch.Tensor,
    heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    write: bool = True,
) -> None:
    """The C kernel for the rows of a pass. qkv: [B, (H + 2 KVH) D], one row per token, after RoPE.
    Writes each row's key and value at positions[b], through its page table tables[b] ([B, pages]
    long), into the paged cache [pages, KVH, P, D] (q8_0: [pages, KVH, P, D / 32 * 34] bytes) (unless `write` is False: rows that read each
    other's keys, all written first), and its attention over positions [0, positions[b]] (the last
    `window` of them in a sliding window) into out [B, H D]: scores q.k * scale, soft-capped to
    softcap * tanh(score / softcap) if softcap."""
    b = qkv.shape[0]
    _, kv_heads, page_size, _ = k_cache.shape  # the last: D values, or a q8_0 row's bytes
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    assert qkv.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert tables.dtype == positions.dtype == torch.long and tables.is_contiguous() and positions.is_contiguous()
    q = qkv.data_ptr()
    k, v = q + heads * d * qkv.element_size(), q + (heads + kv_heads) * d * qkv.element_size()
    _cpu_kernels.decode_attention(
        q,
        k,
        v,
        qkv.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _kv_format(k_cache),
        tables.data_ptr(),
        tables.shape[1],
        positions.data_ptr(),
        b,
        heads,
        kv_heads,
        d,
        page_size,
        scale,
        softcap or 0.0,
        window or 0,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
        int(write),
    )


class DecodeStep:
    """Every layer of a pass in one call (_cpu_kernels.decode_step): no Python and no GIL between
    the layers' kernels. Holds the table of each layer's weight and cache pointers, and
    its own settings (LAYER_FIELDS); a field a layer does not have is 0."""

    def __init__(
        self,
        layers,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        softcap: float | None,
        activation: str,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> None:
        """layers: the decoder's LayerWeights; rope: (cos, signed sin) tables [max_seq, D] by
        LayerWeights.rope; scale, softcap: the attention's (softcap None: none)."""

        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        def row(w, k: torch.Tensor, v: torch.Tensor) -> list[int]:
            cos, sin = rope[w.rope]
            fields = dict(
                input_norm=ptr(w.input_norm),
                qkv=ptr(w.qkv.weight),
                qkv_format=w.qkv.code,
                qkv_bias=ptr(w.qkv.bias),
                o=ptr(w.o.weight),
                o_format=w.o.code,
                post_norm=ptr(w.post_norm),
                gate_up=ptr(w.gate_up.weight),
                gate_up_format=w.gate_up.code,
                down=ptr(w.down.weight),
                down_format=w.down.code,
                k_cache=ptr(k),
                v_cache=ptr(v),
                q_norm=ptr(w.q_norm),
                k_norm=ptr(w.k_norm),
                attn_out_norm=ptr(w.attn_out_norm),
                mlp_out_norm=ptr(w.mlp_out_norm),
                window=w.window or 0,
                cos=ptr(cos),
                sin=ptr(sin),
            )
            return [fields[name] for name in LAYER_FIELDS]

        self.table = torch.tensor([row(w, k, v) for w, k, v in zip(layers, k_cache, v_cache)], dtype=torch.long)
        self._keep = (layers, k_cache, v_cache, rope)  # the memory the table points into
        self.hidden = layers[0].qkv.in_features
        self.intermediate = layers[0].down.in_features
        self.shape = (
            num_heads,
            num_kv_heads,
            head_dim,
            self.intermediate,
            len(layers),
            k_cache[0].shape[2],
            _kv_format(k_cache[0]),
        )
        self.activation = ACTIVATIONS.index(activation)
        self.eps, self.scale, self.softcap = eps, scale, softcap or 0.0
        self._scratch: list[torch.Tensor] = []

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        lora: tuple[torch.Tensor, torch.Tensor, int] | None = None,
        shared: bool = False,
    ) -> None:
        """x: [B, hidden] embeddings, contiguous; tables: [B, pages] long, each row's page table;
        shared: whether rows read each other's keys (several rows of one sequence). lora: the rows' LoRA adapters (LoraPass.step_args: each row's index into the adapters'
        tables, or -1; the tables' addresses; their widest A^T), or None. On return x holds the last
        layer's residual stream."""
        b = x.shape[0]
        assert x.is_contiguous() and positions.is_contiguous() and tables.is_contiguous()
        h, qkv, attn, gate_up, act = self._scratch_for(x, b)
        _cpu_kernels.decode_step(
            b,
            self.hidden,
            *self.shape,
            self.activation,
            self.eps,
            self.scale,
            self.softcap,
            self.table.data_ptr(),
            positions.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            x.data_ptr(),
            h.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            gate_up.data_ptr(),
            act.data_ptr(),
            torch.get_num_threads(),
            *((lora[0].data_ptr(), lora[1].data_ptr(), lora[2]) if lora else (None, None, 0)),
            int(shared),
            LORA_ALONE_MACS,
        )

    def _scratch_for(self, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """The pass's activation buffers [rows, width] (h, qkv, attn, gate_up, act): the kept ones
        where they are big enough, else new ones, kept only up to KEPT_SCRATCH_ROWS rows."""
        if self._scratch and self._scratch[0].shape[0] >= rows:
            return self._scratch
        heads, kv_heads, d, inter = self.shape[:4]
        widths = (self.hidden, (heads + 2 * kv_heads) * d, heads * d, 2 * inter, inter)
        scratch = [x.new_empty(rows, w) for w in widths]
        if rows <= KEPT_SCRATCH_ROWS:
            self._scratch = scratch
        return scratch

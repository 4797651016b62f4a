"""braid's own decoder, for every family runner/families.py describes (Llama, Qwen, Gemma, ...),
that reads and writes braid's paged KV cache.

transformers loads the weights (safetensors, GGUF, hub); this module runs them. It exists because a
decode step must touch only the new tokens: every sequence of a batch writes its keys and values in
place into its own cache pages, and no step re-runs anything already cached.

One forward pass takes a *packed* batch: the new tokens of every sequence side by side, with no
padding (runner/batch.py). Linear layers run once over all of them; attention (runner/attention.py)
runs over each row's pages.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from braid.server.resources import release_freed_heap
from braid.server.runner.attention import Attention, softcap
from braid.server.runner.batch import ForwardBatch
from braid.server.runner.families import Family
from braid.server.runner.kernels.ops import activations_of, TorchOps
from braid.server.runner.kernels.packing import Linear
from braid.server.runner.kernels.step import DecodeStep
from braid.server.runner.kv_cache import KVCache, head_dim
from braid.server.runner.lora import LoraBase, LoraPass, Target
from braid.server.runner.precision import Precision, fuse


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (H + 2 KVH) D: q, k and v projections fused into one matmul
    o: Linear  # H D -> hidden
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 I: gate and up projections fused
    down: Linear  # I -> hidden
    q_norm: torch.Tensor | None = None  # [D]: Family.qk_norm's weights
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Family.sandwich_norms: on the attention's output
    mlp_out_norm: torch.Tensor | None = None  # and on the MLP's
    window: int | None = None  # a sliding-window layer's window (Family.gemma_attention)
    rope: str = ""  # which RoPE tables the layer reads (Gemma 3: its layer type's)


class Decoder:
    """Llama-style decoders (RMSNorm, RoPE, GQA, SwiGLU), each family's differences read from its
    Family (runner/families.py): Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        max_seq_len: int,
        ops: TorchOps,
        precision: Precision,
        family: Family = Family(),
    ) -> None:
        cfg = hf_model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.eps = cfg.rms_norm_eps
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        device, dtype = ops.device, ops.dtype

        # On a CPU with AVX-512 or AVX2, braid's own kernels run the decoder (runner/kernels/):
        # chosen once, by the caller.
        self.ops = ops
        # braid's C attention for every row (with the config's scale, soft-capping and sliding
        # windows), and the whole pass in one C call, every family's layer read from its LayerWeights
        self.fused_attention = self.ops.fused_decode and self.head_dim % 16 == 0
        self.one_call = self.fused_attention
        self.activation = family.activation
        self._act = self.ops.activation(family.activation)
        self.embed_scale = cfg.hidden_size**0.5 if family.embed_scale else None
        if family.gemma_attention:
            self.scale = cfg.query_pre_attn_scalar**-0.5
            self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
            self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        else:
            self.scale, self.attn_softcap, self.final_softcap = self.head_dim**-0.5, None, None
        self.attention = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.attn_softcap, family.gemma_attention
        )
        self._step: DecodeStep | None = None  # built on the first pass, for its cache
        self._step_cache: KVCache | None = None

        def linear(prefix: str, *names: str) -> Linear:
            """[out, in] linear layers, fused along out, as one layer; each matrix in the format
            `precision` serves it in."""
            weight = fuse([precision.matrix(f"{prefix}{n}.weight") for n in names])
            has_bias = f"{prefix}{names[0]}.bias" in precision.names
            bias = (
                torch.cat([precision.vector(f"{prefix}{n}.bias", dtype, device) for n in names]) if has_bias else None
            )
            return self.ops.linear(weight, bias)

        def vector(name: str) -> torch.Tensor:
            return precision.vector(name, dtype, device)

        def norm(name: str) -> torch.Tensor:
            """An RMSNorm's weight as it multiplies (Family.norm_offset: stored as w - 1)."""
            return vector(name) + 1 if family.norm_offset else vector(name)

        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers

        inner = hf_model.model
        # The embedding is the LM head's matrix: one copy for both where they are tied, and a
        # lookup is `columns` of it.
        self.embed = linear("model.", "embed_tokens")
        self.lm_head = linear("", "lm_head") if "lm_head.weight" in precision.names else self.embed
        self.final_norm = norm("model.norm.weight")
        self.layers: list[LayerWeights] = []
        per_type_rope = "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters
        for i in range(self.num_layers):
            layer, sandwich = f"model.layers.{i}.", family.sandwich_norms
            at, mlp = f"{layer}self_attn.", f"{layer}mlp."
            sliding = family.gemma_attention and layer_types[i] == "sliding_attention"
            self.layers.append(
                LayerWeights(
                    input_norm=norm(f"{layer}input_layernorm.weight"),
                    qkv=linear(at, *family.qkv),
                    o=linear(at, "o_proj"),
                    post_norm=norm(f"{layer}{'pre_feedforward' if sandwich else 'post_attention'}_layernorm.weight"),
                    gate_up=linear(mlp, *family.gate_up),
                    down=linear(mlp, "down_proj"),
                    q_norm=norm(f"{at}q_norm.weight") if family.qk_norm else None,
                    k_norm=norm(f"{at}k_norm.weight") if family.qk_norm else None,
                    attn_out_norm=norm(f"{layer}post_attention_layernorm.weight") if sandwich else None,
                    mlp_out_norm=norm(f"{layer}post_feedforward_layernorm.weight") if sandwich else None,
                    window=cfg.sliding_window if sliding else None,
                    rope=layer_types[i] if per_type_rope else "",
                )
            )
        self.lora_base = LoraBase(
            self._lora_targets(family), self.num_layers, family.gguf_architecture, self.num_heads, self.num_kv_heads
        )
        # what the matrices multiply: int8 or bf16 rows (--activations), or float32 ones
        self.activations = activations_of(self._matrices())
        # of the packed matrices, those moved into transparent huge pages (PackedLinear.huge_bytes)
        self.huge_page_bytes = sum(w.huge_bytes for w in self._matrices())
        self.weight_bytes = sum(w.nbytes for w in self._matrices()) + sum(
            t.nbytes for t in [self.final_norm, *(v for w in self.layers for v in (w.input_norm, w.post_norm))]
        )
        # RoPE tables for every position, from transformers' own rotary module (it knows every
        # scaling variant: linear, dynamic, yarn, llama3).
        positions = torch.arange(max_seq_len).unsqueeze(0)
        probe = torch.zeros(1, dtype=torch.float32)
        half = self.head_dim // 2
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (cos, signed sin) by LayerWeights.rope
        for kind in {w.rope for w in self.layers}:
            cos, sin = inner.rotary_emb(probe, positions, *([kind] if kind else []))
            # [max_seq, D]; sin with rotate_half's sign folded in: rope(x) = x * cos + roll(x, half) * signed_sin
            self.rope[kind] = (
                cos[0].to(device=device, dtype=dtype),
                torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).to(device=device, dtype=dtype),
            )
        # packing freed hundreds of transient copies of 1-100 MB, which glibc keeps: 144 MiB of the 1B
        # shape's 1.6 GB start, measured
        release_freed_heap()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Runs the packed batch, writes its keys/values into the cache, returns [R, V] logits."""
        if self.one_call:
            return self._one_call(batch, cache)
        n = batch.input_ids.shape[0]
        lora = batch.lora
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        tables = {kind: self.ops.rope_tables(cos, sin, batch.positions) for kind, (cos, sin) in self.rope.items()}
        rows = batch.row_tables() if self.fused_attention else None  # once a pass, not once a layer
        x = self._embed(batch.input_ids)  # [N, hidden], the residual stream
        for i, w in enumerate(self.layers):
            h = self._norm(x, w.input_norm)
            qkv = w.qkv(h)  # [N, (H + 2 KVH) D]
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            if w.q_norm is not None:
                self._head_norms(qkv, w)
            self.ops.rope_(qkv, heads + kv_heads, d, batch.positions, *tables[w.rope])
            q = qkv[:, : heads * d].view(n, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
            attn = self.attention(qkv, q, k, v, batch, cache.k[i], cache.v[i], w.window, rows)  # [N, H * D]
            self._add_output(x, attn, w.o, w.attn_out_norm, lora, i, "o")
            h = self._norm(x, w.post_norm)
            gate_up = w.gate_up(h)
            if lora is not None:
                lora.add(i, "gate_up", h, gate_up)
            self._add_output(x, self._act(gate_up), w.down, w.mlp_out_norm, lora, i, "down")
        self._pool(x, batch)
        return self._logits(x, batch.logit_rows)

    def _add_output(
        self,
        x: torch.Tensor,
        inp: torch.Tensor,
        linear: Linear,
        out_norm: torch.Tensor | None,
        lora: LoraPass | None,
        layer: int,
        module: str,
    ) -> None:
        """x += inp @ linear (its adapters' deltas, LoRA's `module`, added to the product), through
        the output's RMSNorm where the family has one (a sandwich norm, Gemma): the attention's and
        the MLP's outputs joining the residual stream, as csrc/decode_step.c's add_output."""
        if out_norm is None:
            linear.add_into(x, inp)  # in place: x += inp @ W
            if lora is not None:
                lora.add(layer, module, inp, x)
            return
        out = linear(inp)
        if lora is not None:
            lora.add(layer, module, inp, out)
        x += self._norm(out, out_norm)

    def _lora_targets(self, family: Family) -> dict[str, Target]:
        """The projections a LoRA adapter may target, by PEFT's module names, each as columns of
        the decoder's fused projections."""
        w = self.layers[0]
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden, inner = w.qkv.in_features, w.down.in_features
        if len(family.qkv) == 3:
            bounds = dict(zip(family.qkv, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))))
        else:
            bounds = {family.qkv[0]: (0, q + 2 * kv)}
        targets = {m: Target("qkv", b, e, hidden) for m, (b, e) in bounds.items()}
        targets["o_proj"] = Target("o", 0, hidden, q)
        if len(family.gate_up) == 2:
            targets.update(
                {
                    family.gate_up[0]: Target("gate_up", 0, inner, hidden),
                    family.gate_up[1]: Target("gate_up", inner, 2 * inner, hidden),
                }
            )
        else:
            targets[family.gate_up[0]] = Target("gate_up", 0, 2 * inner, hidden)
        targets["down_proj"] = Target("down", 0, hidden, inner)
        return targets

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed.columns(ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def _logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[R, V] float32 next-token logits of the packed rows `rows` of the residual stream x.
        R may be 0: a pass made only of prompt chunks that do not reach their prompt's end."""
        if rows.numel() == 0:
            return x.new_empty(0, self.vocab_size, dtype=torch.float32)
        logits = self.lm_head(self._norm(x[rows], self.final_norm)).float()
        return logits if self.final_softcap is None else softcap(logits, self.final_softcap)

    def _pool(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Embeddings: each of batch.pools' spans of the residual stream x after the final norm, its
        last row or the sum of its rows, into batch.pooled [P, hidden] float32."""
        if not batch.pools:
            return
        pooled = []
        for _, offset, length, mean in batch.pools:
            rows = x[offset : offset + length] if mean else x[offset + length - 1 : offset + length]
            pooled.append(self._norm(rows.contiguous(), self.final_norm).float().sum(0))
        batch.pooled = torch.stack(pooled)

    def _one_call(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The pass, prompt chunks, verifications and decode rows alike: every layer in one C call,
        its rows' LoRA deltas included. Every row attends by itself through its page table, so a
        position gets the same numbers whichever kind of row computes it (batch.row_tables)."""
        if self._step is None or self._step_cache is not cache:
            self._step = DecodeStep(
                self.layers,
                self.rope,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.eps,
                self.scale,
                self.attn_softcap,
                self.activation,
                cache.k,
                cache.v,
            )
            self._step_cache = cache
        x = self._embed(batch.input_ids).contiguous()  # [N, hidden]
        lora = batch.lora.step_args(x.shape[0]) if batch.lora is not None else None
        tables, shared = batch.row_tables()
        self._step(x, batch.positions, tables, lora, shared)
        self._pool(x, batch)
        return self._logits(x, batch.logit_rows)

    def _matrices(self) -> list[Linear]:
        """Every matrix once (a tied head is the embedding)."""
        heads = [self.embed] if self.lm_head is self.embed else [self.embed, self.lm_head]
        return heads + [m for w in self.layers for m in (w.qkv, w.o, w.gate_up, w.down)]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, self.eps)

    def _head_norms(self, qkv: torch.Tensor, w: LayerWeights) -> None:
        """Family.qk_norm, in place: RMSNorm over each head of q and of k in qkv [N, (H + 2 KVH) D]."""
        n, d, heads, kv_heads = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        for begin, count, weight in ((0, heads, w.q_norm), (heads, kv_heads, w.k_norm)):
            part = qkv[:, begin * d : (begin + count) * d]
            part.copy_(self._norm(part.reshape(n * count, d), weight).view(n, count * d))

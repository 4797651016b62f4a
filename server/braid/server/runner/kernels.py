"""The decoder's building blocks: braid's AVX-512 kernels on the CPU, torch's elsewhere.

On a CPU with AVX-512 (fp32), the linear layers, RMSNorm, SwiGLU, RoPE and the decode steps'
attention run in _cpu_kernels.c: weights are packed once into 32-column panels and streamed from
memory once per call whatever the number of rows, and each small op is one call instead of several
torch ops (see the C file for why and for the measurements). Elsewhere (CUDA, an older CPU, a build
without a C compiler, or --kernels torch) the same functions run torch's ops.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

_LOGGER = logging.getLogger(__name__)

PANEL = 32  # columns per packed panel (PackedLinear's layout)
LAYER_FIELDS = 9  # pointers per layer in DecodeStep's table, in the C enum's order

try:
    from braid.server.runner import _cpu_kernels
except ImportError:  # built without a C compiler: torch's kernels do the work
    _cpu_kernels = None
if _cpu_kernels is not None and (_cpu_kernels.PANEL, _cpu_kernels.LAYER_FIELDS) != (PANEL, LAYER_FIELDS):
    # A stale build of the extension: its memory layout is not this module's. Never run it.
    _LOGGER.error("braid's C kernels were built for panels of %d and %d fields per layer, this code has %d "
                  "and %d: rebuild them (make install); running torch's kernels", _cpu_kernels.PANEL,
                  _cpu_kernels.LAYER_FIELDS, PANEL, LAYER_FIELDS)
    _cpu_kernels = None


def kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and _cpu_kernels is not None
            and _cpu_kernels.has_avx512())


class Linear:
    """y = x @ W (+ bias), W given [in, out]. `add_into(y, x)` does y += x @ W in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight.contiguous(), bias
        self.in_features, self.out_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y.addmm_(x, self.weight) if self.bias is None else y.addmm_(x, self.weight).add_(self.bias)


class PackedLinear(Linear):
    """The weight packed into panels [ceil(out / 32), in, 32] (zero-padded), for _cpu_kernels.gemm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        k, n = weight.shape
        panels = -(-n // PANEL)
        padded = weight.new_zeros(k, panels * PANEL)
        padded[:, :n] = weight
        self.weight = padded.view(k, panels, PANEL).transpose(0, 1).contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.in_features, self.out_features = k, n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], self.out_features)
        self._gemm(x, y, accumulate=False)
        return y

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self._gemm(x, y, accumulate=True)
        return y

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        x = _rows(x)
        assert x.shape[1] == self.in_features and y.stride(-1) == 1
        if x.shape[0] == 0:  # no rows (a pass of prompt chunks that sample nothing): nothing to do,
            return           # as torch.mm does; the C kernel rejects M < 1
        _cpu_kernels.gemm(x.data_ptr(), x.stride(0), self.weight.data_ptr(), y.data_ptr(), y.stride(0),
                          x.shape[0], self.in_features, self.out_features, int(accumulate),
                          None if self.bias is None else self.bias.data_ptr(), torch.get_num_threads())


class TorchOps:
    """The decoder's small ops in torch: on CUDA, on a CPU without AVX-512, without the C extension,
    and with --kernels torch. Chosen once, by `pick_ops`."""

    name = "torch"
    fused_decode = False  # DecodeStep and decode_attention need the C kernels

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [N, hidden]."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [N, 2 I], gate then up. Returns silu(gate) * up, [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_tables(self, cos: torch.Tensor, signed_sin: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rope_` takes for a pass: the pass's rows of the tables, [N, D], looked up once per
        pass, not once per layer."""
        return cos[positions], signed_sin[positions]

    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor) -> None:
        """Rotary embedding, in place, on the first `heads` heads of each row of qkv [N, ...]:
        x * cos[pos] + roll(x, D / 2) * signed_sin[pos]."""
        n = qkv.shape[0]
        x = qkv[:, :heads * head_dim].view(n, heads, head_dim)
        c, s = cos.unsqueeze(1), signed_sin.unsqueeze(1)
        x.copy_(torch.addcmul(x * c, x.roll(head_dim // 2, dims=-1), s))


class CpuKernelOps(TorchOps):
    """The same ops in _cpu_kernels.c, for an AVX-512 CPU in fp32: one C call each instead of half
    a dozen torch ops, weights packed into panels."""

    name = "braid's AVX-512 kernels"
    fused_decode = True

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return PackedLinear(weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty_like(x)
        _cpu_kernels.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                              x.shape[0], x.shape[1], eps)
        return out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = _rows(gate_up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        _cpu_kernels.silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(), out.stride(0))
        return out

    def rope_tables(self, cos: torch.Tensor, signed_sin: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables [max_seq, D]: the C kernel looks positions up itself."""
        return cos, signed_sin

    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor) -> None:
        assert qkv.stride(-1) == 1 and positions.dtype == torch.long and positions.is_contiguous()
        _cpu_kernels.rope(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, head_dim, positions.data_ptr(),
                          cos.data_ptr(), signed_sin.data_ptr())


def pick_ops(device: torch.device, dtype: torch.dtype, allow_kernels: bool = True) -> TorchOps:
    """braid's C kernels where they run (and are allowed: --kernels auto), torch's elsewhere."""
    return CpuKernelOps() if allow_kernels and kernels_available(device, dtype) else TorchOps()


def decode_attention(qkv: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
    """The C kernel for the decode rows of a pass. qkv: [B, (H + 2 KVH) D], one row per sequence,
    after RoPE. Writes each sequence's new key and value at positions[b] of slot slots[b] of the cache
    [slots, KVH, max_seq, D], and its attention over positions [0, positions[b]] into out [B, H D]."""
    b = qkv.shape[0]
    kv_heads, max_seq, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    assert qkv.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slots.dtype == positions.dtype == torch.long and slots.is_contiguous() and positions.is_contiguous()
    q = qkv.data_ptr()
    k, v = q + heads * d * qkv.element_size(), q + (heads + kv_heads) * d * qkv.element_size()
    _cpu_kernels.decode_attention(q, k, v, qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                  slots.data_ptr(), positions.data_ptr(), b, heads, kv_heads, d, max_seq,
                                  d ** -0.5, out.data_ptr(), out.stride(0), torch.get_num_threads())


class DecodeStep:
    """Every layer of a decode-only pass in one call (_cpu_kernels.decode_step): no Python and no
    GIL between the layers' kernels. Holds the table of each layer's weight and cache pointers."""

    def __init__(self, layers, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: list[torch.Tensor],
                 v_cache: list[torch.Tensor]) -> None:
        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        self.table = torch.tensor([[ptr(w.input_norm), ptr(w.qkv.weight), ptr(w.qkv.bias), ptr(w.o.weight),
                                    ptr(w.post_norm), ptr(w.gate_up.weight), ptr(w.down.weight), ptr(k), ptr(v)]
                                   for w, k, v in zip(layers, k_cache, v_cache)], dtype=torch.long)
        assert self.table.shape[1] == LAYER_FIELDS
        self._keep = (layers, k_cache, v_cache, cos, signed_sin)  # the memory the table points into
        self.hidden = layers[0].qkv.in_features
        self.intermediate = layers[0].down.in_features
        self.shape = (num_heads, num_kv_heads, head_dim, self.intermediate, len(layers), k_cache[0].shape[2])
        self.eps, self.cos, self.sin = eps, cos, signed_sin
        self._scratch: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """x: [B, hidden] embeddings, contiguous; on return the last layer's residual stream."""
        b = x.shape[0]
        assert x.is_contiguous() and positions.is_contiguous() and slots.is_contiguous()
        if not self._scratch or self._scratch[0].shape[0] < b:
            heads, kv_heads, d, inter = self.shape[:4]
            widths = (self.hidden, (heads + 2 * kv_heads) * d, heads * d, 2 * inter, inter)
            self._scratch = [x.new_empty(b, w) for w in widths]
        h, qkv, attn, gate_up, act = self._scratch
        _cpu_kernels.decode_step(b, self.hidden, *self.shape, self.eps, self.table.data_ptr(),
                                 positions.data_ptr(), slots.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                                 x.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
                                 act.data_ptr(), torch.get_num_threads())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dim (rows may be strided), as the C kernels read it."""
    return x if x.stride(-1) == 1 else x.contiguous()

"""The decoder's small ops (RMSNorm, the gated activations, RoPE) and its linear layers' kind:
torch's (TorchOps) or braid's C kernels' (CpuKernelOps)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from braid.server.model.weights import Parts, Weight
from braid.server.runner.kernels.extension import _cpu_kernels
from braid.server.runner.kernels.packing import Linear, PackedLinear, PackedParts, rows_of


class TorchOps:
    """The decoder's small ops in torch: on CUDA, on a CPU without AVX-512 or AVX2, without the C
    extension, and with --kernels torch. Chosen once, by `pick_ops`. Weights are dequantized to
    the compute dtype."""

    name = "torch"
    isa: str | None = None
    activations = "float32"  # the paths that round rows: "float32" (none), or int8, bf16 or int8+bf16 (CpuKernelOps)
    fused_decode = False  # DecodeStep and decode_attention need the C kernels

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")) -> None:
        self.dtype, self.device = dtype, device

    def linear(self, weight: Weight | Parts, bias: torch.Tensor | None) -> Linear:
        """weight: [out, in], float or GGUF blocks."""
        return Linear(weight, bias, self.dtype, self.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [N, hidden]."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [N, 2 I], gate then up. Returns silu(gate) * up, [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [N, 2 I], gate then up. Returns gelu_tanh(gate) * up, [N, I] (Gemma's MLP)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def activation(self, name: str):
        """The gated activation a family's MLP runs (Family.activation), as a function of gate_up."""
        return {"silu": self.swiglu, "gelu_pytorch_tanh": self.geglu}[name]

    def rope_tables(
        self, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rope_` takes for a pass: the pass's rows of the tables, [N, D], looked up once per
        pass, not once per layer."""
        return cos[positions], signed_sin[positions]

    def rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> None:
        """Rotary embedding, in place, on the first `heads` heads of each row of qkv [N, ...]:
        x * cos[pos] + roll(x, D / 2) * signed_sin[pos]."""
        n = qkv.shape[0]
        x = qkv[:, : heads * head_dim].view(n, heads, head_dim)
        c, s = cos.unsqueeze(1), signed_sin.unsqueeze(1)
        x.copy_(torch.addcmul(x * c, x.roll(head_dim // 2, dims=-1), s))


class CpuKernelOps(TorchOps):
    """The same ops in braid's C kernels, on a CPU with AVX-512 or AVX2, activations in fp32: one C
    call each instead of half a dozen torch ops, weights packed into panels in their own format.
    activations "int8": a quantized matrix multiplies rows quantized to int8 per block (csrc/int8.c);
    "bf16": a bf16 matrix multiplies rows rounded to bf16 (csrc/bf16.c); "int8+bf16": both."""

    fused_decode = True

    def __init__(self, isa: str, activations: str = "float32") -> None:
        super().__init__(torch.float32, torch.device("cpu"))
        assert activations in ("int8", "bf16", "int8+bf16", "float32")
        self.isa, self.name, self.activations = isa, f"braid's {isa} kernels", activations

    def linear(self, weight: Weight | Parts, bias: torch.Tensor | None) -> Linear:
        paths = self.activations.split("+")
        packed = PackedParts if isinstance(weight, Parts) else PackedLinear
        return packed(weight, bias, int8="int8" in paths, bf16="bf16" in paths)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = rows_of(x)
        out = torch.empty_like(x)
        _cpu_kernels.rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps
        )
        return out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated(_cpu_kernels.silu_mul, gate_up)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _gated(_cpu_kernels.gelu_tanh_mul, gate_up)

    def rope_tables(
        self, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables [max_seq, D]: the C kernel looks positions up itself."""
        return cos, signed_sin

    def rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> None:
        assert qkv.stride(-1) == 1 and positions.dtype == torch.long and positions.is_contiguous()
        _cpu_kernels.rope(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
        )


def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up by a C kernel (silu_mul, gelu_tanh_mul); gate_up: [N, 2 I], gate then up."""
    gate_up = rows_of(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    kernel(gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(), out.stride(0))
    return out


def activations_of(layers: list[Linear]) -> str:
    """What a decoder's matrices multiply, for ModelInfo.activations: "int8", "bf16", "int8+bf16"
    (the paths some matrix runs, each on its formats), or "float32" where none rounds its rows."""
    rows = {getattr(layer, "rows", "float32") for layer in layers}
    return "+".join(path for path in ("int8", "bf16") if path in rows) or "float32"

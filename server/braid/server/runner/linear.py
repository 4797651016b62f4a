"""The decoder's linear layers and RMSNorm: braid's AVX-512 kernels on the CPU, torch elsewhere.

On a CPU with AVX-512, weights are packed once into 32-column panels and multiplied by
`_cpu_kernels.gemm`, which streams each weight from memory once per call whatever the number of rows
(see _cpu_kernels.c for why and for the measurements). Elsewhere (CUDA, an older CPU, or a build
without a C compiler) the same interface runs torch's matmuls on [in, out] weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

_LOGGER = logging.getLogger(__name__)

try:
    from braid.server.runner import _cpu_kernels
except ImportError:  # built without a C compiler: torch's kernels do the work
    _cpu_kernels = None

PANEL = 32  # columns per packed panel; must match _cpu_kernels.c


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
        if x.stride(-1) != 1:
            x = x.contiguous()
        assert x.shape[1] == self.in_features and y.stride(-1) == 1
        _cpu_kernels.gemm(x.data_ptr(), x.stride(0), self.weight.data_ptr(), y.data_ptr(), y.stride(0),
                          x.shape[0], self.in_features, self.out_features, int(accumulate),
                          None if self.bias is None else self.bias.data_ptr(), torch.get_num_threads())


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> Linear:
    return PackedLinear(weight, bias) if packed else Linear(weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, packed: bool) -> torch.Tensor:
    """x: [N, hidden]. The C kernel is one pass per row; torch's is half a dozen ops."""
    if not packed:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _cpu_kernels.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                          x.shape[0], x.shape[1], eps)
    return out

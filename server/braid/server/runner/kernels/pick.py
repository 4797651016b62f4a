"""Which build of braid's kernels runs (the best this CPU has, or BRAID_KERNELS_ISA's), and which
ops the decoder runs: braid's where they run, torch's elsewhere."""

from __future__ import annotations

import logging
import os

import torch

from braid.server.runner.kernels.extension import BUILDS, INT8, ISA_VARIABLE, _cpu_kernels, has_bf16_rows
from braid.server.runner.kernels.ops import CpuKernelOps, TorchOps
from braid.server.runner.kernels.selfcheck import passes_self_check

_LOGGER = logging.getLogger(__name__)
ACTIVATIONS_CHOICES = ("auto", "int8", "bf16", "float32")  # --activations (EngineConfig)


def kernels_isa() -> str | None:
    """The instruction set braid's kernels run in on this CPU: BRAID_KERNELS_ISA's if set, else
    the best the CPU has ('avx512_bf16', 'avx512_vnni', 'avx512', 'avx2_vnni', 'avx2'); None where they do
    not run.
    Selects it in the module."""
    if _cpu_kernels is None:
        return None
    wanted = os.environ.get(ISA_VARIABLE, "").strip().lower()
    supported = _cpu_kernels.isas()
    if wanted and wanted not in supported:
        raise ValueError(
            f"{ISA_VARIABLE}={wanted}: this CPU runs braid's kernels in "
            f"{', '.join(supported) or 'no instruction set'} (built: {BUILDS})"
        )
    for isa in [wanted] if wanted else supported:
        _cpu_kernels.select_isa(isa)
        if passes_self_check(isa):
            return isa
        if wanted:
            raise ValueError(f"{ISA_VARIABLE}={wanted}: braid's {wanted} kernels fail their check on this CPU")
    return None


def pick_ops(
    device: torch.device, dtype: torch.dtype, allow_kernels: bool = True, activations: str = "float32"
) -> TorchOps:
    """braid's C kernels where they run (and are allowed: --kernels auto), torch's elsewhere.
    dtype: the compute dtype torch's ops run in (the C kernels' is fp32). activations
    (--activations): int8 runs quantized matrices on int8 rows where the C kernels have that path;
    bf16 runs bf16 matrices on bf16 rows where the build has AVX-512 BF16; auto runs both where they
    are; float32, and torch's ops, run fp32 rows."""
    assert activations in ACTIVATIONS_CHOICES
    isa = kernels_isa() if allow_kernels and device.type == "cpu" else None
    if isa is None or dtype != torch.float32:
        if activations in ("int8", "bf16"):
            _LOGGER.warning(
                "--activations %s: only braid's C kernels have an %s path; running float32", activations, activations
            )
        return TorchOps(dtype, device)
    if activations == "bf16" and not has_bf16_rows():
        _LOGGER.warning(
            "--activations bf16: braid's %s kernels have no bf16 path (it needs AVX-512 BF16); running float32", isa
        )
    paths = [
        path
        for path, runs in (("int8", INT8 is not None), ("bf16", has_bf16_rows()))
        if runs and activations in ("auto", path)
    ]  # auto: each is the fastest its format has
    return CpuKernelOps(isa, "+".join(paths) or "float32")

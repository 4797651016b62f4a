"""Which format each weight matrix is served in: --dtype and --quantization applied to a loaded model.

Every matrix keeps its own format unless a flag says otherwise (`auto`): a GGUF file's Q8_0, Q4_0,
Q4_1, Q6_K and Q4_K blocks, a checkpoint's bf16 or f16. A GGUF tensor type braid's kernels cannot run
(Q5_*, Q2_K, Q3_K, Q5_K, the IQ types) is served dequantized to fp32, and start-up says so once per
type. Vectors (norms, biases) are
always in the compute dtype. What was picked is counted for ModelInfo.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter

import torch

from braid.server.model.loader import LoadedModel
from braid.server.model.weights import BLOCK_FORMATS, FLOAT_FORMATS, QBLOCK, Blocks, Parts, Weight, quantize_q8_0
from braid.server.runner.kernels.extension import PANEL
from braid.server.runner.kernels.packing import format_of

_LOGGER = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_FORMATS = {fmt: dtype for dtype, fmt in FLOAT_FORMATS.items()}


class Precision:
    def __init__(self, model: LoadedModel, dtype: str = "auto", quantization: str = "auto") -> None:
        self.dtype, self.quantization = dtype, quantization
        self._blocks, self._own = model.blocks, model.formats
        self._params = dict(model.hf_model.named_parameters())
        self.names = set(self._params)  # the model's parameters (a tied head is not one: it is the embedding)
        self.formats: Counter[str] = Counter()  # tensors served in each format
        self._told: set[str] = set()

    def matrix(self, name: str) -> Weight:
        """The parameter `name`, [out, in], in the format it is served in: a GGUF's block matrix in
        float (--quantization none, or q8_0 of another format) dequantized from its blocks, which
        alone hold its values (the loaded model keeps no float copy)."""
        value = self._params[name].detach()
        own = self._own.get(name) or FLOAT_FORMATS.get(value.dtype, "f32")
        blocks = self._blocks.get(name)
        if blocks is not None and self.quantization != "none":
            return self._served(blocks, blocks.format)
        if value.is_meta:
            value = blocks.dequantize()
        if own not in FLOAT_FORMATS.values() and own not in BLOCK_FORMATS:
            self._tell(
                own,
                f"{own} tensors (e.g. {name}) run dequantized to float32: braid's kernels have no "
                f"{own} format (they run {', '.join(BLOCK_FORMATS)}, bf16, f16, f32)",
            )
        if self.quantization == "q8_0":
            if value.shape[1] % QBLOCK == 0:
                return self._served(quantize_q8_0(value), "q8_0")
            self._tell(
                "q8_0-shape",
                f"{name} stays float: Q8_0 needs its input size ({value.shape[1]}) to be a multiple of {QBLOCK}",
            )
        # auto: its own float type (a GGUF's f16 tensor was widened to fp32 on loading: this is
        # exact); a quantized tensor dequantized: fp32
        target = DTYPES[self.dtype] if self.dtype != "auto" else DTYPE_FORMATS.get(own, torch.float32)
        return self._served(value.to(target), FLOAT_FORMATS[target])

    def vector(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A norm's weight or a bias, in the compute dtype: a copy, since a view would keep the
        whole loaded checkpoint (a memory-mapped file) resident."""
        self.formats[FLOAT_FORMATS.get(dtype, "f32")] += 1
        return (
            self._params[name].detach().to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        )

    def _served(self, weight: Weight, fmt: str) -> Weight:
        self.formats[fmt] += 1
        return weight

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            _LOGGER.warning(message)


def fuse(weights: list[Weight]) -> Weight | Parts:
    """Matrices stacked along out (q, k and v; gate and up) as one. Parts in different formats (a GGUF
    file may mix them: Q4_K_M's v in Q6_K beside q and k in Q4_K) stay in their own, each run of one
    format fused (Parts), where each part but the last fills whole panels of the kernels; else
    (a part's outputs not a multiple of 32) they are fused in fp32."""
    runs = [list(run) for _, run in itertools.groupby(weights, key=format_of)]
    fused = [Blocks.cat(run) if isinstance(run[0], Blocks) else torch.cat(run) for run in runs]
    if len(fused) == 1:
        return fused[0]
    if all(part.shape[0] % PANEL == 0 for part in fused[:-1]):
        return Parts(fused)
    _LOGGER.warning(
        "fusing matrices of formats %s in float32 (a part's outputs are not a multiple of %d)",
        [format_of(part) for part in fused],
        PANEL,
    )
    return Parts(fused).dequantize()

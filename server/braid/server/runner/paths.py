"""Which decoder runs a model: braid's own (runner/decoder.py) for the families it knows
(runner/families.py), on the ops --kernels and --activations pick, its weights in the formats
--dtype and --quantization ask for; else transformers' own forward (runner/transformers_decoder.py)."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import torch

from braid.server.model.loader import LoadedModel, float_model
from braid.server.model.weights import FLOAT_FORMATS
from braid.server.runner.decoder import Decoder
from braid.server.runner.families import native_family
from braid.server.runner.kernels.pick import pick_ops
from braid.server.runner.precision import Precision
from braid.server.runner.transformers_decoder import TransformersDecoder

_LOGGER = logging.getLogger(__name__)


@dataclass
class ModelPath:
    decoder: Decoder | TransformersDecoder
    path: str  # "braid" or "transformers"
    kernels: str  # the C kernels' instruction set, or "torch"
    quantization: str  # --quantization as served ("none" on the transformers path)
    activations: str  # what the matrices multiply: float32, int8 or bf16 rows
    formats: Counter[str]  # tensors served in each format
    ops: str  # what runs the matmuls, in words


def pick_path(
    model: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    allow_kernels: bool,
    weight_dtype: str,
    quantization: str,
    activations: str,
) -> ModelPath:
    family, why_not = native_family(model.hf_model)
    if family is not None:
        _LOGGER.info("model path: braid's native decoder (%s)", type(model.hf_model).__name__)
        ops = pick_ops(device, dtype, allow_kernels, activations)
        with _one_thread():
            precision = Precision(model, weight_dtype, quantization)
            decoder = Decoder(model.hf_model, max_seq_len, ops, precision, family)
        return ModelPath(
            decoder, "braid", ops.isa or "torch", quantization, decoder.activations, precision.formats, ops.name
        )
    _LOGGER.info(
        "model path: transformers (%s runs through its own forward: %s)", type(model.hf_model).__name__, why_not
    )
    if quantization == "q8_0":
        _LOGGER.warning("--quantization q8_0: the transformers path serves the weights as they are")
    hf_model = float_model(model)  # a GGUF's block matrices dequantized: transformers' modules run floats
    return ModelPath(
        TransformersDecoder(hf_model, device, dtype),
        "transformers",
        "torch",
        "none",
        "float32",
        Counter(FLOAT_FORMATS.get(p.dtype, str(p.dtype)) for p in hf_model.parameters()),
        "torch, in the model's own modules",
    )


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while the weights are packed: hundreds of small copies, each a parallel
    region that waits for all of torch's threads. Beside a busy process, a thread that finds no free
    core stalls every region: packing the embedded model took 9 to 28 s on two shared cores, against
    0.3 to 1.7 s on one thread (0.3 s either way on quiet cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

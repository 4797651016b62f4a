"""GGUF LoRA adapters, as llama.cpp's convert_lora_to_gguf.py writes them and llama.cpp reads them
(src/llama-adapter.cpp), read into the same matrices as a PEFT folder (lora.py).

Such a file's metadata says general.type = "adapter", adapter.type = "lora" and adapter.lora.alpha;
each targeted projection is two tensors named after the base model's, blk.{layer}.attn_q.weight.lora_a
[r, in] and .lora_b [out, r] (numpy's order; ggml's ne is reversed), in F32 (the converter's default),
F16, BF16 or Q8_0. The converter runs the base model's own tensor transforms on B A, which touch B's
rows only: for Llama, the q and k rows permuted as in the base model's GGUF file. braid serves its
rows in transformers' order, so B's rows are put back by the same tensor processor transformers
undoes that permutation with for the base (model/weights.py). The scale is llama.cpp's, alpha / r
(1 where alpha is 0): the converter keeps no use_rslora, so an rsLoRA adapter converted to GGUF runs
with another scale than in PEFT, in braid as in llama.cpp.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from braid.server.model.weights import gguf_type_name, row_order
from braid.server.runner.lora import Adapter, LoraBase, Matrix, build_adapter, check_rank

READ_TYPES = ("f32", "f16", "bf16", "q8_0")  # the types convert_lora_to_gguf.py writes (--outtype)
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def read_gguf_lora(
    path: str,
    name: str,
    base: LoraBase,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    round_bf16: bool = False,
) -> Adapter:
    """A GGUF LoRA adapter file, checked against the base model as read_peft checks a folder.
    Raises ValueError with one line naming the file, key or tensor at fault."""
    from gguf import GGUFReader, quants

    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from None

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else str(bytes(field.parts[-1]), encoding="utf-8")

    kind, adapter_type = text("general.type"), text("adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise ValueError(
            f"{path}: not a GGUF LoRA adapter (general.type is {kind!r}, adapter.type {adapter_type!r}; "
            "llama.cpp's convert_lora_to_gguf.py writes 'adapter' and 'lora')"
        )
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise ValueError(f"{path}: an activated LoRA (adapter.alora.invocation_tokens) is not supported")
    architecture = text("general.architecture")
    if architecture != base.gguf_architecture:
        raise ValueError(
            f"{path}: an adapter of a {architecture} model, but llama.cpp names this model {base.gguf_architecture}"
        )
    alpha_field = reader.fields.get("adapter.lora.alpha")
    if alpha_field is None:
        raise ValueError(f"{path}: adapter.lora.alpha is missing")
    alpha = float(alpha_field.parts[-1][0])
    modules = _modules(base)
    processor = _tensor_processor(base)
    matrices: list[Matrix] = []
    for tensor in reader.tensors:
        match = _NAME.match(tensor.name)
        module = modules.get(match[2]) if match else None
        if module is None:
            raise ValueError(
                f"{tensor.name}: not a LoRA matrix of a projection braid serves ({', '.join(base.targets)})"
            )
        layer, which = int(match[1]), match[3].upper()
        fmt = gguf_type_name(tensor.tensor_type)
        if fmt not in READ_TYPES:
            raise ValueError(f"{tensor.name}: type {fmt.upper()}; braid reads LoRA matrices in F32, F16, BF16 or Q8_0")
        # [r, in] or [out, r]; a copy, as the file is mapped read-only
        value = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if which == "B":
            order = row_order(processor, f"blk.{layer}.{match[2]}.weight", value.shape[0])
            if order is not None:
                value = value[order]
        matrices.append(Matrix(tensor.name, layer, module, which, torch.from_numpy(value)))
    a = [m for m in matrices if m.which == "A"]
    if not a:
        raise ValueError(f"{path}: holds no LoRA matrices")
    # llama.cpp takes each projection's rank from its lora_a; braid stacks one rank an adapter, so the
    # first's is every one's (build_adapter names a tensor of another)
    rank = a[0].value.shape[0]
    check_rank(f"{path}: rank r={rank} ({a[0].key})", rank, max_rank)
    scale = alpha / rank if alpha else 1.0
    return build_adapter(path, name, rank, alpha, scale, matrices, base, dtype, device, round_bf16)


def _modules(base: LoraBase) -> dict[str, str]:
    """llama.cpp's name of each projection braid serves (attn_q, ffn_down, ...) -> PEFT's (q_proj,
    down_proj, ...), by gguf-py's table for the architecture."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == base.gguf_architecture)
    names = get_tensor_name_map(arch, 1)
    modules = {}
    for module in base.targets:
        for parent in ("self_attn", "mlp"):
            gguf_name = names.get_name(f"model.layers.0.{parent}.{module}")
            if gguf_name is not None:
                modules[gguf_name.removeprefix("blk.0.")] = module
    return modules


def _tensor_processor(base: LoraBase):
    """transformers' tensor processor for the architecture: what undoes its converter's transforms
    (Llama's q and k rows' permutation) on the base model's GGUF tensors."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = {"num_attention_heads": base.num_heads, "num_key_value_heads": base.num_kv_heads}
    return TENSOR_PROCESSORS.get(base.gguf_architecture, TensorProcessor)(config=config)

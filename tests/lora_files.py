"""Random LoRA adapters in PEFT's own format, made by PEFT, for the tests and the benchmark: and the
base model with one merged in by PEFT (merge_and_unload), transformers' reference for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from braid_testing.models import fp32_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    rank: int = 8,
    targets=ALL_TARGETS,
    seed: int = 1,
    alpha: float = 16.0,
    rslora: bool = False,
    spread: float = 0.1,
    dtype: str = "float32",
) -> Path:
    """A random adapter for the model in base_dir, saved by PEFT into out_dir: A and B both random
    (B non-zero, unlike PEFT's default init), each entry N(0, spread); its matrices saved in dtype
    (bfloat16: as an adapter trained in it is, which braid's C step reads in half the bytes)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = fp32_model(base_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * spread)
    peft_model.save_pretrained(out_dir)
    if dtype != "float32":
        from safetensors.torch import load_file, save_file

        weights = out_dir / "adapter_model.safetensors"
        save_file({k: v.to(getattr(torch, dtype)) for k, v in load_file(str(weights)).items()}, str(weights))
    return out_dir


def merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base model with the adapter merged in by PEFT, saved with the base's tokenizer."""
    from peft import PeftModel

    model = fp32_model(base_dir)
    PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def peft_logits(base_dir: Path, adapter_dir: Path, ids: list[int]):
    """transformers + PEFT's logits at every position of ids, the adapter not merged."""
    import torch
    from peft import PeftModel

    model = fp32_model(base_dir)
    with torch.no_grad():
        return PeftModel.from_pretrained(model, adapter_dir)(torch.tensor([ids])).logits[0]


def edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def write_gguf_adapter(
    adapter_dir: Path, cfg, path: Path, outtype: str = "f32", leave_out: tuple[str, ...] = ()
) -> Path:
    """The PEFT adapter in adapter_dir as llama.cpp's convert_lora_to_gguf.py writes it (--outtype:
    f32, its default, f16, bf16 or q8_0) for the base model whose transformers config is cfg:
    general.type "adapter", adapter.type "lora" and adapter.lora.alpha; blk.N.<projection>.weight.lora_a
    [r, in] and .lora_b
    [out, r], B's rows of q and k permuted for Llama as the converter's LlamaModel.permute does; a
    matrix q8_0 cannot hold (a row not a multiple of 32) in F16, as the converter falls back.
    Compared once with the converter's own output (llama.cpp 0c1e57098b, the tiny Llama's rank-8
    adapter on every projection, f32, bf16 and q8_0): the same adapter keys, tensor names in the
    same order, types and bytes; it adds only general.name and the base model's card. Without the
    tensors named in leave_out (a broken file)."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, QuantError, get_tensor_name_map, quants
    from safetensors.torch import load_file

    arch = cfg.model_type  # llama.cpp's name for the tests' models (llama, qwen3) is transformers' model_type
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    qtype = GGMLQuantizationType[outtype.upper()]
    alpha = float(json.loads((adapter_dir / "adapter_config.json").read_text())["lora_alpha"])
    writer = GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
        value = tensor.float().numpy()
        if arch == "llama" and which.startswith("B") and module.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(value.shape)
        name = f"{names.get_name(module)}.weight.lora_{which[0].lower()}"
        if name in leave_out:
            continue
        try:
            raw, kind = quants.quantize(value, qtype), qtype
        except QuantError:
            raw, kind = quants.quantize(value, GGMLQuantizationType.F16), GGMLQuantizationType.F16
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_lora(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    values: dict | None = None,
    alpha: object = 16.0,
    arch: str = "llama",
    fill: bool = True,
) -> Path:
    """A GGUF LoRA file declaring F32 tensors of these shapes (numpy's order), its header as gguf-py's
    GGUFWriter writes it; each tensor's data the array in `values` where given, zeros elsewhere (a
    sparse file: a declared gigabyte takes no disk); fill=False: the file ends with its header, every
    tensor's data past the end. alpha: adapter.lora.alpha, a float32 (a str: written as a string)."""
    import numpy as np
    from gguf import GGUFWriter

    values = values or {}
    writer = GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    if isinstance(alpha, str):
        writer.add_string("adapter.lora.alpha", alpha)
    else:
        writer.add_float32("adapter.lora.alpha", float(alpha))
    for name, shape in shapes.items():
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    if fill:
        with open(path, "r+b") as f:
            at = -(-f.seek(0, 2) // 32) * 32  # the data, aligned as GGUFWriter aligns it
            for name, shape in shapes.items():
                if name in values:
                    f.seek(at)
                    f.write(np.asarray(values[name], dtype=np.float32).tobytes())
                at += -(-4 * int(np.prod(shape)) // 32) * 32
            f.truncate(at)
    return path


def write_safetensors_header(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A safetensors file declaring F32 tensors of these shapes, its data all zeros and sparse (a
    declared gigabyte takes no disk): the format's 8-byte header length, JSON header, then data."""
    import math
    import struct

    header, at = {}, 0
    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + at)
    return path

"""Random LoRA adapters in PEFT's own format, made by PEFT, for the tests and the benchmark: and the
base model with one merged in by PEFT (merge_and_unload), transformers' reference for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
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
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir


def peft_logits(base_dir: Path, adapter_dir: Path, ids: list[int]):
    """transformers + PEFT's logits at every position of ids, the adapter not merged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(model, adapter_dir)(torch.tensor([ids])).logits[0]


def edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))

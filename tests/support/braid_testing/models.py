"""Tiny random models for the tests and benchmarks: two layers of hidden size 64 of any architecture
braid serves, seeded, in memory or saved to a folder as braid loads one.

    model = tiny_model("qwen3", vocab_size=512, num_hidden_layers=4)  # a transformers model, eval mode
    path = save_model(tmp_path, model, tokenizer_from=smol_dir)  # with the embedded model's tokenizer
    runner = ModelRunner(loaded(model), ...)  # in process

Their weights are large enough for peaked logits (initializer_range 0.3), so greedy decoding has few
near-ties; Gemma's norms are drawn away from their zero init, so that dropping one shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# token ids as the embedded model's tokenizer has them; pad_token_id also zeroes its embedding row
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.3)
LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
# local layers of a 4-token window between global ones
GEMMA = dict(LLAMA_LIKE, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
# architecture -> transformers' model class, its config class, its tiny config
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024)),
    # learned positions offset by 2, ReLU, no RoPE: a model for the transformers path
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=1024,
        ),
    ),
    # head_dim stated, not hidden / heads, as Qwen3's own configs do
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(LLAMA_LIKE, head_dim=32, tie_word_embeddings=True)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", LLAMA_LIKE),
    # soft-capped attention scores and logits, caps low enough to bend them
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    ),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WITH_TEMPLATE = (*TOKENIZER_FILES, "chat_template.jinja")


def tiny_model(architecture: str = "llama", vocab_size: int = 49152, seed: int = 0, **overrides: Any):
    """A tiny random causal LM of `architecture` (ARCHITECTURES), seeded, in eval mode: by default
    with the embedded tokenizer's 49,152 tokens; `overrides`: any of its config's settings."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model_class, config_class, settings = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**(COMMON | settings | overrides | {"vocab_size": vocab_size}))
    model = getattr(transformers, model_class)(config).eval()
    if architecture.startswith("gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.5)
    return model


def save_model(path: Path, model, tokenizer_from: Path | None = None, files: tuple[str, ...] = TOKENIZER_FILES) -> Path:
    """The model saved into path where braid and transformers load it (its generation stops at token
    2), with `files` (the tokenizer's) copied from the folder tokenizer_from where they are there."""
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    for name in files if tokenizer_from is not None else ():
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def fp32_model(folder: Path):
    """transformers' model of the folder in fp32, in eval mode; of braid's converted GGUF folder
    (smol_dir), with its block matrices dequantized (loader.float_model): the folder keeps them
    only as blocks, and transformers' from_pretrained refuses it."""
    import torch
    from transformers import AutoModelForCausalLM

    from braid.server.model.conversion import BLOCKS_FILE
    from braid.server.model.loader import float_model, load

    if (folder / BLOCKS_FILE).is_file():
        return float_model(load(str(folder), folder.parent)).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def loaded(model, name: str = "tiny"):
    """The model as the loader gives it (braid.server.model.loader.LoadedModel), without a
    tokenizer: what a ModelRunner takes in process."""
    from braid.server.model.loader import LoadedModel

    return LoadedModel(
        hf_model=model, hf_tokenizer=None, name=name, architecture=type(model).__name__, eos_token_ids=(2,)
    )

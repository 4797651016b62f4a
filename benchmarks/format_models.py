"""The model files the weight-format benchmark serves, made once into ~/.cache/braid/bench/, and the
bytes of weights each one reads per decode step.

- SmolLM2-135M-Instruct: the embedded Q4_1 GGUF as shipped; braid's fp32 folder of it (what braid
  converts it to on first use); that folder saved in bf16; and GGUFs in F32 (converted from the fp32
  folder by llama.cpp's convert_hf_to_gguf.py), Q8_0 and BF16 (llama-quantize from the F32 one).
- A model of Llama-3.2-1B's shape with random weights (fixed seed) and SmolLM2's tokenizer, so
  vocabulary 49152 instead of 128256 (no 128k tokenizer can be had offline) and no llama3 rope
  scaling: ~1.07 B parameters. Saved in bf16; GGUFs in BF16 (converted), Q8_0 and Q4_0 with a Q8_0
  embedding (llama-quantize from the BF16 one).
- Small random models of Qwen3's and Gemma 3's structure, in bf16 (ab.py --model qwen3, gemma3), and
  one of OPT's, which runs through the transformers fallback (ab.py --model opt).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llamacpp

BENCH_DIR = Path.home() / ".cache" / "braid" / "bench"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SEED = 12
# Llama-3.2-1B's shape, but SmolLM2's vocabulary (its tokenizer is the one at hand offline).
LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
LLAMA_1B_NAME = "llama-3.2-1b-shape-random"


def smollm_fp32_folder(out: Path = BENCH_DIR / "SmolLM2-135M-Instruct-fp32") -> Path:
    """The embedded GGUF's weights as a plain fp32 safetensors folder (its quantized matrices
    dequantized, as transformers reads the file), with its tokenizer; made once. braid's converted
    folder keeps those matrices only as their blocks."""
    if (out / "config.json").is_file():
        return out
    from braid.server.model.loader import default_cache_dir, float_model, load, resolve

    _save(float_model(load(None, default_cache_dir())), Path(resolve(None, default_cache_dir())[1]), out)
    return out


def bf16_folder(fp32_folder: Path, out: Path) -> Path:
    """`fp32_folder` saved with bfloat16 weights, tokenizer files copied; made once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp32_folder, local_files_only=True, dtype=torch.bfloat16)
    _save(model, fp32_folder, out)
    return out


def llama_1b_folder(tokenizer_folder: Path, out: Path = BENCH_DIR / LLAMA_1B_NAME) -> Path:
    """A random Llama-3.2-1B-shaped model in bf16 (seed SEED), with the tokenizer of
    `tokenizer_folder`; made once (about a minute, 2 GB)."""
    return _random_folder("Llama", LLAMA_1B_SHAPE, tokenizer_folder, out)


# Small models of Qwen3's and Gemma 3's structure (per-head q/k norms; Gemma's sandwich norms, GeGLU,
# scaled embeddings, sliding-window layers five to one global, each kind with its own RoPE), random
# weights and SmolLM2's vocabulary, what ab.py measures those families' decode steps on (about 150 M
# parameters, 300 MB in bf16 each).
SMALL_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=3072,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
SMALL_MODELS = {
    "qwen3": ("Qwen3", dict(SMALL_SHAPE, head_dim=128)),
    "gemma3": ("Gemma3Text", dict(SMALL_SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=512)),
    # the same size through the transformers fallback (braid has no OPT decoder)
    "opt": (
        "OPT",
        dict(
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            ffn_dim=3072,
            word_embed_proj_dim=1024,
            max_position_embeddings=4096,
            vocab_size=49152,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        ),
    ),
}


def small_folder(kind: str, tokenizer_folder: Path) -> Path:
    """The random small model `kind` (a key of SMALL_MODELS) in bf16; made once."""
    architecture, shape = SMALL_MODELS[kind]
    return _random_folder(architecture, shape, tokenizer_folder, BENCH_DIR / f"{kind}-small-random")


def _random_folder(architecture: str, shape: dict, tokenizer_folder: Path, out: Path) -> Path:
    """transformers' <architecture>ForCausalLM of `shape`, random weights (seed SEED) in bf16, with
    the tokenizer of `tokenizer_folder`; made once."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = getattr(transformers, f"{architecture}Config")(**shape)
    model_class = getattr(transformers, f"{architecture.removesuffix('Text')}ForCausalLM")
    config.architectures = [model_class.__name__]
    model = model_class(config).to(torch.bfloat16)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    _save(model, tokenizer_folder, out)
    return out


@contextlib.contextmanager
def _staged(tokenizer_folder: Path, out: Path):
    """A staging folder to write a model into; with the tokenizer's files added, it is renamed to
    out when the block ends well: a half-made folder is never taken for a model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".making-", dir=out.parent))
    try:
        yield staging
        for name in TOKENIZER_FILES:
            if (tokenizer_folder / name).is_file():
                shutil.copy2(tokenizer_folder / name, staging / name)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save(model, tokenizer_folder: Path, out: Path) -> None:
    with _staged(tokenizer_folder, out) as staging:
        model.save_pretrained(staging)


def smollm_ggufs(llama: llamacpp.LlamaCpp, fp32_folder: Path) -> dict[str, Path]:
    """SmolLM2's GGUFs by type: F32 (converted from braid's fp32 folder), Q8_0 and BF16 from it."""
    f32 = llamacpp.convert(fp32_folder, BENCH_DIR / "SmolLM2-135M-Instruct.F32.gguf", "f32")
    return {
        "F32": f32,
        **{
            t: llamacpp.quantize(llama, f32, BENCH_DIR / f"SmolLM2-135M-Instruct.{t}.gguf", t) for t in ("Q8_0", "BF16")
        },
    }


def llama_1b_ggufs(llama: llamacpp.LlamaCpp, folder: Path) -> dict[str, Path]:
    """The 1B model's GGUFs by type: BF16 (converted), Q8_0 and Q4_0 from it. The Q4_0 one keeps its
    (tied) embedding in Q8_0, as the embedded SmolLM2 GGUF does, where llama-quantize would pick Q6_K:
    every matrix then is in a format both servers read natively."""
    bf16 = llamacpp.convert(folder, BENCH_DIR / f"{LLAMA_1B_NAME}.BF16.gguf", "bf16")
    q8_0 = llamacpp.quantize(llama, bf16, BENCH_DIR / f"{LLAMA_1B_NAME}.Q8_0.gguf", "Q8_0")
    q4_0 = llamacpp.quantize(
        llama, bf16, BENCH_DIR / f"{LLAMA_1B_NAME}.Q4_0-Q8_0-embedding.gguf", "Q4_0", embedding_type="Q8_0"
    )
    return {"BF16": bf16, "Q8_0": q8_0, "Q4_0": q4_0}


# ---------------------------------------------------------------- real shapes (sizes.py)


@dataclass(frozen=True)
class Shape:
    """A released model's shape, to be filled with random weights: the architecture, its config's
    sizes, and what it is named after."""

    key: str  # what --models takes
    title: str  # what the tables show
    architecture: str  # transformers' <architecture>Config and <architecture>ForCausalLM
    sizes: dict


# The shapes of Llama 3.2 1B and 3B, Llama 3.1 8B and Qwen3 1.7B (their config.json's sizes), but
# SmolLM2's vocabulary (49152 instead of 128256 and 151936: the tokenizer at hand offline) and no
# llama3 rope scaling. Qwen3's differs from Llama's where a decode step feels it: head_dim 128 with
# 16 query heads (the attention is twice as wide as the hidden size / heads), per-head q/k norms.
SHAPES = {
    shape.key: shape
    for shape in (
        Shape("1b", "Llama-3.2-1B shape", "Llama", LLAMA_1B_SHAPE),
        Shape(
            "3b",
            "Llama-3.2-3B shape",
            "Llama",
            dict(
                LLAMA_1B_SHAPE,
                hidden_size=3072,
                num_hidden_layers=28,
                num_attention_heads=24,
                head_dim=128,
                intermediate_size=8192,
            ),
        ),
        Shape(
            "8b",
            "Llama-3.1-8B shape",
            "Llama",
            dict(
                LLAMA_1B_SHAPE,
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                head_dim=128,
                intermediate_size=14336,
                tie_word_embeddings=False,
            ),
        ),
        Shape(
            "qwen3-1.7b",
            "Qwen3-1.7B shape",
            "Qwen3",
            dict(
                LLAMA_1B_SHAPE,
                num_hidden_layers=28,
                num_attention_heads=16,
                head_dim=128,
                intermediate_size=6144,
                rope_theta=1000000.0,
                max_position_embeddings=40960,
                rms_norm_eps=1e-6,
            ),
        ),
    )
}
SHARD_BYTES = 2 * 10**9  # the most a random checkpoint holds in memory while it is written


def shape_folder(shape: Shape, tokenizer_folder: Path) -> Path:
    """A random model of `shape` in bf16, written tensor by tensor into shards of SHARD_BYTES (an 8B
    model is never whole in memory), with the tokenizer of `tokenizer_folder`; made once. Weights
    are normal with transformers' initializer_range as their deviation, norms are ones (what
    transformers' own initialisation gives), each tensor drawn from seed SEED and its index."""
    out = BENCH_DIR / f"{shape.key}-shape-random"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    config = getattr(transformers, f"{shape.architecture}Config")(**shape.sizes)
    model_class = getattr(transformers, f"{shape.architecture}ForCausalLM")
    config.architectures = [model_class.__name__]
    with torch.device("meta"):
        names = [(name, tuple(p.shape)) for name, p in model_class(config).named_parameters()]
    with _staged(tokenizer_folder, out) as staging:
        shard: dict = {}
        names_in: list[list[str]] = [[]]  # the tensor names of each shard
        for index, (name, size) in enumerate(names):
            if shard and sum(t.nbytes for t in shard.values()) + math.prod(size) * 2 > SHARD_BYTES:
                save_file(shard, str(staging / f"shard-{len(names_in)}"), metadata={"format": "pt"})
                shard = {}
                names_in.append([])
            if name.endswith("norm.weight"):
                shard[name] = torch.ones(size, dtype=torch.bfloat16)
            else:
                generator = torch.Generator().manual_seed(SEED * 100_003 + index)
                shard[name] = torch.empty(size, dtype=torch.bfloat16).normal_(
                    0, config.initializer_range, generator=generator
                )
            names_in[-1].append(name)
        save_file(shard, str(staging / f"shard-{len(names_in)}"), metadata={"format": "pt"})
        del shard
        weight_map = {}
        for number, shard_names in enumerate(names_in, 1):
            file = f"model-{number:05d}-of-{len(names_in):05d}.safetensors"
            os.replace(staging / f"shard-{number}", staging / file)
            weight_map |= dict.fromkeys(shard_names, file)
        index_file = staging / "model.safetensors.index.json"
        index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        config.dtype = torch.bfloat16
        config.save_pretrained(staging)
        transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(staging)
    return out


GGUF_TYPES = ("Q4_K_M", "Q4_0", "Q8_0")  # as llama-quantize makes them, its own choices for every tensor
MORE_GGUF_TYPES = ("Q6_K",)  # made and measured when asked for by name (sizes.py --formats)


def shape_ggufs(
    llama: llamacpp.LlamaCpp | Exception, shape: Shape, folder: Path, types=GGUF_TYPES, f32: bool = False
) -> dict[str, Path]:
    """The shape's GGUFs by type, each of `types` quantized by llama-quantize (with its own choice of
    the embedding's and the head's types) from the BF16 one convert_hf_to_gguf.py makes of `folder`,
    and with `f32` the F32 one (the base llama-perplexity measures them against). The BF16 file is
    deleted once they are made: an 8B one is 16 GB."""
    stem = BENCH_DIR / f"{shape.key}-shape-random"
    wanted = {t: Path(f"{stem}.{t}.gguf") for t in (*types, *(["F32"] if f32 else []))}
    if not all(path.is_file() for path in wanted.values()):
        if isinstance(llama, Exception):
            raise llama
        bf16 = llamacpp.convert(folder, Path(f"{stem}.BF16.gguf"), "bf16")
        for gguf_type, path in wanted.items():
            llamacpp.quantize(llama, bf16, path, gguf_type, allow_requantize=gguf_type == "F32")
        bf16.unlink()
    return wanted


# ---------------------------------------------------------------- bytes per decode step


def weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor of a .gguf file or a safetensors folder,
    but the token embedding only when the output projection is tied to it (an untied embedding is
    read a row per token)."""
    sizes = _gguf_sizes(path) if path.suffix == ".gguf" else _safetensors_sizes(path)
    untied = {"output.weight", "lm_head.weight"} & sizes.keys()
    return sum(
        n for name, n in sizes.items() if not (untied and name in ("token_embd.weight", "model.embed_tokens.weight"))
    )


def describe_types(path: Path) -> str:
    """The tensor types of a GGUF file, most bytes first: "Q4_1 (Q8_0 token_embd, F32 norms)"-like."""
    from gguf import GGUFReader

    by_type: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return " + ".join(name for name, _ in sorted(by_type.items(), key=lambda kv: -kv[1]))


def _gguf_sizes(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}


def _safetensors_sizes(folder: Path) -> dict[str, int]:
    """Tensor byte sizes from the headers of a folder's model*.safetensors files (nothing else is read;
    braid keeps other files beside a converted GGUF's weights)."""
    sizes = {}
    for file in sorted(folder.glob("model*.safetensors")):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        sizes |= {
            name: meta["data_offsets"][1] - meta["data_offsets"][0]
            for name, meta in header.items()
            if name != "__metadata__"
        }
    return sizes

"""Tiny GGUF files of the architectures users bring, written as llama.cpp's convert_hf_to_gguf.py
writes a Hugging Face model: its metadata keys, tensor names and transforms for each architecture
(Gemma's norms stored + 1, GPT-2's Conv1D matrices transposed, a tied head left out), 2-D matrices
in GGUF's block formats (quantized by gguf-py) and every other tensor in f32.

    write_gguf(model, tmp / "qwen3.gguf", embedded_bpe(512))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, RopeScalingType, get_tensor_name_map, quants

# transformers' class -> GGUF's general.architecture
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
}
# the block format of each layer's matrices, alternating; the embedding and the head are Q8_0
LAYER_FORMATS = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
K_QUANTS = {"q6_k": 210, "q4_k": 144}  # bytes per super-block of 256 weights
# GPT-2's Conv1D weights are [in, out]: llama.cpp transposes them to [out, in]
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# sentencepiece token types (llama.cpp's SentencePieceTokenTypes)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
# a sentencepiece vocabulary's special tokens, by role, in their ids' order: Gemma's, and Phi-3's
# (Llama 2's, and a pad token: a Phi-3 file with none gets Phi3Config's, id 32000)
GEMMA_SPECIALS = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"}
PHI3_SPECIALS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<|endoftext|>"}


@dataclass
class Vocab:
    """A tokenizer as a GGUF file's tokenizer.ggml.* metadata holds it."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    pre: str
    tokens: list[str]
    token_types: list[int]
    bos: int
    eos: int
    unk: int | None = None
    pad: int | None = None
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    add_bos: bool = False


def embedded_bpe(size: int) -> Vocab:
    """The embedded model's byte-level BPE tokenizer, as its GGUF file holds it, cut to its first
    `size` tokens and the merges among them (so a model's embedding stays small)."""
    from transformers.integrations.gguf import read_gguf_metadata

    from braid.server.model.loader import embedded_gguf

    meta, _ = read_gguf_metadata(str(embedded_gguf()), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = meta["tokenizer.ggml.tokens"][:size]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if set(m.split(" ")) | {m.replace(" ", "")} <= kept]
    key = lambda name: meta[f"tokenizer.ggml.{name}"]  # noqa: E731
    return Vocab(
        "gpt2",
        key("pre"),
        tokens,
        key("token_type")[:size],
        key("bos_token_id"),
        key("eos_token_id"),
        key("unknown_token_id"),
        key("padding_token_id"),
        merges,
    )


def sentencepiece(text: str, specials: dict[str, str]) -> Vocab:
    """A sentencepiece vocabulary as llama.cpp writes one (tokenizer.ggml.model "llama"): the special
    tokens (role -> token: GEMMA_SPECIALS, PHI3_SPECIALS), the 256 byte tokens, then every character
    of `text` and every prefix of its words, with and without the leading '▁' (so each word of
    `text` is one token, merged from its characters)."""
    pieces = dict.fromkeys(sorted(set(text.replace(" ", "▁"))))
    for word in text.split():
        for spelled in (word, "▁" + word):
            for end in range(1, len(spelled) + 1):
                pieces[spelled[:end]] = None
    tokens = [*specials.values(), *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN if role == "unk" else CONTROL for role in specials] + [BYTE] * 256 + [NORMAL] * len(pieces)
    ids = {role: i for i, role in enumerate(specials)}
    return Vocab(
        "llama",
        "default",
        tokens,
        types,
        ids["bos"],
        ids["eos"],
        ids.get("unk"),
        ids.get("pad"),
        scores=[0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))],
        add_bos=True,
    )


def write_gguf(
    model,
    path: Path,
    vocab: Vocab,
    leave_out: tuple[str, ...] = (),
    layer_formats: tuple[GGMLQuantizationType, ...] = LAYER_FORMATS,
    tensor_formats: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """Writes `model` (a transformers causal LM of ARCHITECTURES) with `vocab`'s tokenizer as a
    GGUF file at path, each layer's matrices in layer_formats (alternating), but those of the kinds
    in tensor_formats ('attn_v': every layer's blk.N.attn_v.weight) in theirs, as llama.cpp's Q4_K_M
    keeps v in Q6_K beside q and k in Q4_K; without the tensors named in leave_out (a broken file)."""
    arch = ARCHITECTURES[type(model).__name__]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    for key, value in _hparams(arch, model.config).items():
        getattr(writer, f"add_{key}")(value)
    _write_vocab(writer, vocab)
    for name, value in [*_tensors(arch, model), *_extra_tensors(model.config)]:
        if name in leave_out:
            continue
        if value.ndim == 2:
            kind = _block_format(name, layer_formats, tensor_formats or {})
            fmt = kind.name.lower()
            # random K-quant blocks in the matrix's place: gguf-py cannot quantize to them
            raw = k_quant_bytes(fmt, *value.shape, seed=len(name)) if fmt in K_QUANTS else quants.quantize(value, kind)
            writer.add_tensor(name, raw, raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hparams(arch: str, cfg) -> dict[str, object]:
    """GGUFWriter.add_<key> -> value: the model metadata llama.cpp's converter writes for arch
    (its TextModel's, or the architecture's own set_gguf_parameters)."""
    if arch == "gpt2":
        return dict(
            block_count=cfg.n_layer,
            context_length=cfg.n_positions,
            embedding_length=cfg.n_embd,
            feed_forward_length=cfg.n_inner or 4 * cfg.n_embd,
            head_count=cfg.n_head,
            layer_norm_eps=cfg.layer_norm_epsilon,
        )
    hparams: dict[str, object] = dict(
        context_length=cfg.max_position_embeddings,
        embedding_length=cfg.hidden_size,
        block_count=cfg.num_hidden_layers,
        feed_forward_length=cfg.intermediate_size,
        head_count=cfg.num_attention_heads,
        head_count_kv=cfg.num_key_value_heads,
        layer_norm_rms_eps=cfg.rms_norm_eps,
    )
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: its global layers'
    if arch != "gemma2":  # Gemma 2's converter writes no RoPE base (llama.cpp's default is its 10,000)
        hparams["rope_freq_base"] = rope["rope_theta"]
    if rope.get("rope_type") in ("linear", "yarn"):  # TextModel.set_gguf_parameters
        hparams |= dict(rope_scaling_type=RopeScalingType(rope["rope_type"]), rope_scaling_factor=rope["factor"])
        if rope["rope_type"] == "yarn":
            hparams["rope_scaling_orig_ctx_len"] = rope["original_max_position_embeddings"]
    if rope.get("rope_type") == "longrope":
        hparams["rope_scaling_type"] = RopeScalingType.LONGROPE
    if arch == "phi3":  # Phi3MiniModel: LongRoPE's factors are tensors (_extra_tensors)
        rotated = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        return hparams | dict(
            rope_scaling_orig_ctx_len=cfg.original_max_position_embeddings,
            rope_dimension_count=rotated,
            sliding_window=cfg.sliding_window or 0,
        )
    hparams |= dict(key_length=cfg.head_dim, value_length=cfg.head_dim)
    if arch.startswith("gemma"):
        hparams["sliding_window"] = cfg.sliding_window
        if cfg.final_logit_softcapping:
            hparams["final_logit_softcapping"] = cfg.final_logit_softcapping
    if arch == "gemma2":
        hparams["attn_logit_softcapping"] = cfg.attn_logit_softcapping
    return hparams


def _write_vocab(writer: GGUFWriter, vocab: Vocab) -> None:
    """The tokenizer.ggml.* keys llama.cpp writes (_set_vocab_gpt2, _set_vocab_sentencepiece)."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        writer.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        writer.add_pad_token_id(vocab.pad)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_space_prefix(False)


def _tensors(arch: str, model) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 values) of each tensor, transformed as llama.cpp's converter does: Gemma's
    RMSNorm weights stored as the factor they multiply by (w + 1), GPT-2's Conv1D matrices as
    [out, in] and its tied head written as output.weight, any other tied head left out."""
    names = get_tensor_name_map(
        next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), model.config.num_hidden_layers
    )
    tied = model.config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        value = tensor.detach().float().numpy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            value = value + 1
        if arch == "gpt2" and hf_name.endswith(_CONV1D):
            value = value.T
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.permute
            heads = model.config.num_attention_heads if "q_proj" in hf_name else model.config.num_key_value_heads
            value = (
                value.reshape(heads, 2, value.shape[0] // heads // 2, value.shape[1])
                .swapaxes(1, 2)
                .reshape(value.shape)
            )
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        yield name, np.ascontiguousarray(value)
        if arch == "gpt2" and name == "token_embd.weight":
            yield "output.weight", value


def _extra_tensors(cfg) -> Iterator[tuple[str, np.ndarray]]:
    """The RoPE factors llama.cpp's converter writes as tensors: LongRoPE's two lists
    (Phi3MiniModel.generate_extra_tensors; the attention factor it also writes is the default), and
    Llama 3's scaling as a divisor per frequency (LlamaModel.generate_extra_tensors)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        for which in ("long", "short"):
            yield f"rope_factors_{which}.weight", np.array(rope[f"{which}_factor"], dtype=np.float32)
    if rope.get("rope_type") == "llama3":
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor, old = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        divisors = []
        for wavelen in 2 * math.pi / freqs:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(
                1.0 if wavelen < old / high else factor if wavelen > old / low else 1 / ((1 - smooth) / factor + smooth)
            )
        yield "rope_freqs.weight", np.array(divisors, dtype=np.float32)


def _block_format(
    name: str, layer_formats: tuple[GGMLQuantizationType, ...], tensor_formats: dict[str, GGMLQuantizationType]
) -> GGMLQuantizationType:
    """Q8_0 for the embedding and the head; each layer's matrices in layer_formats, alternating, or
    their kind's in tensor_formats."""
    if name.startswith("blk.") and name.split(".")[2] in tensor_formats:
        return tensor_formats[name.split(".")[2]]
    if name.startswith("blk."):
        return layer_formats[int(name.split(".")[1]) % len(layer_formats)]
    return GGMLQuantizationType.Q8_0


def k_quant_bytes(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """A random [n, k] matrix in Q6_K or Q4_K, as a GGUF file holds it (gguf-py cannot quantize
    to them): random bits, with small normal fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, K_QUANTS[fmt]), dtype=np.uint8)

    def f16(scale: float) -> np.ndarray:
        return (rng.random((n, k // 256)) * scale + scale / 10).astype(np.float16).view(np.uint8).reshape(n, -1, 2)

    if fmt == "q6_k":
        raw[..., 208:210] = f16(0.01)  # d, after ql, qh and the 16 int8 scales
    else:
        raw[..., 0:2], raw[..., 2:4] = f16(0.01), f16(0.005)  # d and dmin, ahead of the scales
    return raw.reshape(n, -1)

"""The decoder families braid runs natively, each as what sets it apart from Llama's.

Decoder (runner/decoder.py) reads a Family; it is never copied per family. A model braid has no
native family for, or one whose config asks for something its decoder does not do (another
activation, a length-dependent or partial RoPE), runs through transformers' own forward instead
(runner/transformers_decoder.py): slower, but the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Where a family's decoder layer differs from Llama's (RMSNorm, RoPE, GQA, SwiGLU)."""

    # the attention's input projections, fused into one matrix in this order (q, then k, then v);
    # Phi-3 stores them fused already
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    # the MLP's gate and up projections, fused (gate first); Phi-3 stores them fused already
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    # RMSNorm over each head of q and of k, after the projection and before RoPE (Qwen3):
    # weights self_attn.q_norm and self_attn.k_norm, [head_dim] each
    qk_norm: bool = False
    # Gemma: RMSNorm weights stored as w - 1 (served as 1 + w), embeddings scaled by sqrt(hidden),
    # gelu(tanh) gating the MLP
    norm_offset: bool = False
    embed_scale: bool = False
    activation: str = "silu"  # the config's hidden_act (or hidden_activation) this family runs
    # Gemma 2/3: the attention's and the MLP's outputs are normalized before they join the residual
    # stream (post_attention_layernorm, post_feedforward_layernorm; pre_feedforward_layernorm before the MLP)
    sandwich_norms: bool = False
    # Gemma 2/3: query_pre_attn_scalar's scale, soft-capped attention scores and logits, and the
    # config's layer_types: sliding-window layers (with their own RoPE, Gemma 3) between global ones
    gemma_attention: bool = False
    # what llama.cpp names the architecture (general.architecture of its GGUF files): a GGUF LoRA
    # adapter of the model says it (runner/lora_gguf.py)
    gguf_architecture: str = "llama"


_GEMMA = dict(
    norm_offset=True, embed_scale=True, activation="gelu_pytorch_tanh", sandwich_norms=True, gemma_attention=True
)
FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(gguf_architecture="qwen2"),
    "Qwen3ForCausalLM": Family(qk_norm=True, gguf_architecture="qwen3"),
    "Phi3ForCausalLM": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), gguf_architecture="phi3"),
    "Gemma2ForCausalLM": Family(**_GEMMA, gguf_architecture="gemma2"),
    "Gemma3ForCausalLM": Family(qk_norm=True, **_GEMMA, gguf_architecture="gemma3"),
}

# RoPE variants whose tables depend on the length of the sequence (transformers recomputes them as
# it grows): braid computes its tables once, so these run through transformers.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def native_family(hf_model) -> tuple[Family | None, str]:
    """The family braid runs this loaded model as, or None and why it runs through transformers.
    Keyed by the class transformers loaded, not the config's architectures list."""
    architecture = type(hf_model).__name__
    family = FAMILIES.get(architecture)
    if family is None:
        return None, f"braid has no native decoder for {architecture}"
    cfg = hf_model.config
    activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if activation != family.activation:
        return None, f"its activation is {activation} (braid's {architecture} runs {family.activation})"
    if getattr(cfg, "use_bidirectional_attention", False):
        return None, "its attention is bidirectional"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
        return None, f"its RoPE ({rope_type}) depends on the sequence length"
    partial = rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0
    if (partial or 1.0) != 1.0 or (getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None, "its RoPE rotates part of each head (partial_rotary_factor)"
    return family, ""


def attention_window(family: Family, model_config) -> int | None:
    """The sliding window of a config's attention, if any layer has one and the family's decoder
    does not run it: the decoder then serves at most this many tokens a session (each position sees
    all before it, as in the model)."""
    window = getattr(model_config, "sliding_window", None)
    if family.gemma_attention:
        return None
    layer_types = getattr(model_config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)

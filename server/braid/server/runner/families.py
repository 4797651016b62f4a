"""The decoder families braid runs natively, each as what sets it apart from Llama's.

LlamaDecoder (runner/llama.py) reads a Family; it is never copied per family. A model braid has no
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


FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Phi3ForCausalLM": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
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
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return None, f"its activation is {cfg.hidden_act} (braid's decoder runs silu)"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
        return None, f"its RoPE ({rope_type}) depends on the sequence length"
    partial = rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0
    if (partial or 1.0) != 1.0 or (getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None, "its RoPE rotates part of each head (partial_rotary_factor)"
    return family, ""


def attention_window(model_config) -> int | None:
    """The sliding window of a config's attention, if any layer has one: a native decoder serves
    at most this many tokens a session (each position then sees all before it, as in the model)."""
    window = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)

"""What a GGUF file says of its model that transformers' GGUF loader leaves out, put back on the config.

transformers maps a fixed list of each architecture's metadata keys onto its config
(`GGUF_CONFIG_MAPPING`) and drops every other key and the extra tensors. Some files then load as a
model that computes other tokens than the one llama.cpp runs from the same file:

- Gemma 3 (4B and up): its global layers' linear RoPE scaling (factor 8), so every position was off;
- Phi-3.5 and Phi-4-mini: LongRoPE's per-frequency factors (two tensors) and a RoPE that rotates
  part of each head (`rope.dimension_count`), so every position was off;
- Gemma 2 and 3: the soft-caps the file states (transformers' defaults happen to be Gemma 2's), and
  the attention's scale, which no key holds: llama.cpp takes the head size, or for the 27B models
  hidden size / heads (transformers' default, 256, is right only where the head size is 256);
- Llama 3.1 and up: its RoPE scaling, which the converter writes as a tensor of per-frequency
  divisors (rope_freqs);
- Phi-3: the sliding window; any file: YaRN or linear RoPE scaling.

braid reads these itself, with gguf-py, as llama.cpp's loader reads them (llama-model.cpp), and sets
them on the config before transformers builds the model. This is written by hand because it is the
gap between the two libraries; it goes once transformers maps these keys itself.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

# llama.cpp's LLM_TYPE_27B for these architectures (by their layer count): the attention's scale is
# then 1/sqrt(hidden_size / heads), else 1/sqrt(head_dim) (transformers' query_pre_attn_scalar)
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def restore(path: Path, config) -> list[str]:
    """Sets on `config` (transformers' config of the GGUF file at path) what the file states and
    transformers dropped. Returns what was set, a phrase each, for the start-up log."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()

    def key(name: str):
        field = reader.fields.get(f"{arch}.{name}")
        return None if field is None else field.contents()

    done: list[str] = []
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = key(name)
        if value is not None and hasattr(config, name) and getattr(config, name) != value:
            setattr(config, name, float(value))
            done.append(f"{name} {value:g}")
    pooling = key("pooling_type")  # an embedding model's (model/pooling.py reads it from here)
    if pooling is not None:
        config.gguf_pooling_type = int(pooling)
    window = key("attention.sliding_window")
    if arch == "phi3" and window and getattr(config, "sliding_window", None) != window:
        config.sliding_window = int(window)
        done.append(f"sliding window {window}")
    if arch in _27B_LAYERS:  # llama.cpp's f_attention_scale: no key holds it
        is_27b = config.num_hidden_layers == _27B_LAYERS[arch]
        scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
        if config.query_pre_attn_scalar != scalar:
            config.query_pre_attn_scalar = scalar
            done.append(f"query_pre_attn_scalar {scalar}" + (" (27B)" if is_27b else " (the head size)"))
    factors = {
        t.name: [float(x) for x in t.data]
        for t in reader.tensors
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
    }
    done += _restore_rope(path, config, key, factors)
    return done


def _restore_rope(path: Path, config, key, factors: dict[str, list[float]]) -> list[str]:
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):  # a model without RoPE (GPT-2)
        return []
    # Gemma 3 keeps one set per layer type: the file's scaling is its global layers' (llama.cpp
    # scales those only; the sliding layers keep their own base and no scaling)
    target = rope.get("full_attention", rope)
    done: list[str] = []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotated = key("rope.dimension_count")
    if rotated and rotated < head_dim:
        target["partial_rotary_factor"] = rotated / head_dim
        done.append(f"RoPE over {rotated} of {head_dim} dimensions")
    original = key("rope.scaling.original_context_length")
    kind = key("rope.scaling.type")
    if "rope_factors_long.weight" in factors:  # LongRoPE (Phi-3.5, Phi-4-mini): its factors are tensors
        target.update(
            rope_type="longrope",
            long_factor=factors["rope_factors_long.weight"],
            short_factor=factors.get("rope_factors_short.weight", factors["rope_factors_long.weight"]),
        )
        if original:
            config.original_max_position_embeddings = int(original)
            target["original_max_position_embeddings"] = int(original)
        done.append("LongRoPE factors")
    elif "rope_freqs.weight" in factors and "full_attention" not in rope:  # Llama 3.1 and up
        llama3 = _llama3_parameters(factors["rope_freqs.weight"], target.get("rope_theta", 10000.0), head_dim)
        if llama3 is None:
            _LOGGER.warning("%s: its rope_freqs tensor is not Llama 3's RoPE scaling; served without it", path.name)
        else:
            target.update(rope_type="llama3", **llama3)
            done.append(f"Llama 3 RoPE scaling x{llama3['factor']:g}")
    elif kind in ("linear", "yarn") and key("rope.scaling.factor"):
        target.update(rope_type=kind, factor=float(key("rope.scaling.factor")))
        if kind == "yarn":
            if original:
                target["original_max_position_embeddings"] = int(original)
            for gguf_name, name in (
                ("yarn_beta_fast", "beta_fast"),
                ("yarn_beta_slow", "beta_slow"),
                ("yarn_attn_factor", "attention_factor"),
            ):
                if key(f"rope.scaling.{gguf_name}") is not None:
                    target[name] = float(key(f"rope.scaling.{gguf_name}"))
        done.append(f"{kind} RoPE scaling x{target['factor']:g}")
    return done


def _llama3_parameters(factors: list[float], theta: float, head_dim: int) -> dict[str, float] | None:
    """Llama 3's RoPE scaling parameters from the per-frequency divisors llama.cpp's converter
    writes in their stead (LlamaModel.generate_extra_tensors), or None where they are not those of
    the low/high frequency factors 1 and 4 over 8,192 positions: every Llama 3.x's, and the
    converter's defaults. The largest divisor is the scaling factor."""
    factor, low, high, old = max(factors), 1.0, 4.0, 8192
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            expected.append(1.0)
        elif wavelen > old / low:
            expected.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    same = len(expected) == len(factors) and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(expected, factors))
    return (
        dict(factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=old)
        if same
        else None
    )

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
- Phi-3: the sliding window; Llama-family and Qwen files: YaRN or linear RoPE scaling.

braid reads these itself, with gguf-py, as llama.cpp's loader reads them (llama-model.cpp), and sets
them on the config before transformers builds the model. This is written by hand because it is the
gap between the two libraries; it goes once transformers maps these keys itself.
"""

from __future__ import annotations

from pathlib import Path

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
    factors = {t.name: [float(x) for x in t.data] for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    done += _restore_rope(config, key, factors)
    return done


def _restore_rope(config, key, factors: dict[str, list[float]]) -> list[str]:
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
        target.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                      short_factor=factors.get("rope_factors_short.weight", factors["rope_factors_long.weight"]))
        if original:
            config.original_max_position_embeddings = int(original)
            target["original_max_position_embeddings"] = int(original)
        done.append("LongRoPE factors")
    elif kind in ("linear", "yarn") and key("rope.scaling.factor"):
        target.update(rope_type=kind, factor=float(key("rope.scaling.factor")))
        if kind == "yarn":
            if original:
                target["original_max_position_embeddings"] = int(original)
            for gguf_name, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                    ("yarn_attn_factor", "attention_factor")):
                if key(f"rope.scaling.{gguf_name}") is not None:
                    target[name] = float(key(f"rope.scaling.{gguf_name}"))
        done.append(f"{kind} RoPE scaling x{target['factor']:g}")
    return done


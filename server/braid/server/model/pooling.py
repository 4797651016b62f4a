"""The pooling a model's embeddings are made with, where the model names one.

- A GGUF file: `<arch>.pooling_type` (llama.cpp's: 1 mean, 2 cls, 3 last, 4 rank), as
  convert_hf_to_gguf.py writes it for embedding models (Qwen3-Embedding: last).
- A sentence-transformers folder (or a hub id in the local cache): modules.json's Pooling module,
  whose config.json sets pooling_mode_lasttoken or pooling_mode_mean_tokens.

Else LAST, vLLM's default for a causal LM served as an embedding model: under causal attention
the last position is the only one that has seen the whole input. braid pools LAST and MEAN; a model
that names another pooling (CLS, rank) gets LAST, with a warning.

A GGUF's key is read where the loader reads the file's other keys (model/gguf_config.py), which
leaves it on the model's config as `gguf_pooling_type`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

_GGUF_POOLING = {1: "mean", 3: "last"}  # llama.cpp's llama_pooling_type
_GGUF_POOLING_NAMES = {0: "none", 2: "cls", 4: "rank"}


def model_pooling(path: str, model_config: object = None) -> tuple[str, str]:
    """The model's pooling ("last" or "mean", runner/rows.py's Pooling) and where it came from:
    "gguf", "sentence-transformers" or "default". model_config: transformers' config of the loaded
    model (a GGUF file's carries its pooling_type)."""
    named: tuple[str, int | str] | None = None
    try:
        if path.endswith(".gguf"):
            value = getattr(model_config, "gguf_pooling_type", None)
            named = ("gguf", int(value)) if value is not None else None
        else:
            mode = _sentence_transformers_mode(path)
            named = ("sentence-transformers", mode) if mode else None
    except (OSError, ValueError, KeyError) as exc:
        _LOGGER.warning("could not read the model's pooling from %s (%s): embeddings pool the last token", path, exc)
    if named is None:
        return "last", "default"
    source, value = named
    pooling = _GGUF_POOLING.get(value) if source == "gguf" else _ST_MODES.get(str(value))  # type: ignore[arg-type]
    if pooling is None:
        shown = _GGUF_POOLING_NAMES.get(value, value) if source == "gguf" else value  # type: ignore[call-overload]
        _LOGGER.warning("the model names %s pooling, which braid does not do: embeddings pool the last token", shown)
        return "last", "default"
    return pooling, source


_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean"}


def _sentence_transformers_mode(path: str) -> str | None:
    """The pooling mode that a sentence-transformers model's Pooling module sets (its config.json's
    first true pooling_mode_*), or None where there is none."""
    folder = Path(path)
    modules = folder / "modules.json"
    if not folder.is_dir():
        modules = _cached(path, "modules.json")
        if modules is None:
            return None
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith(".Pooling"):
            config = modules.parent / module.get("path", "") / "config.json"
            if not config.is_file() and not folder.is_dir():
                config = _cached(path, f"{module.get('path', '')}/config.json") or config
            settings = json.loads(config.read_text())
            on = [k.removeprefix("pooling_mode_") for k, v in settings.items() if k.startswith("pooling_mode_") and v]
            return on[0] if on else None
    return None


def _cached(repo: str, name: str) -> Path | None:
    """A hub model's file from the local cache, never the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, name)
    return Path(found) if isinstance(found, str) else None

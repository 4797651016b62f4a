"""The pooling a model's embeddings are made with, where the model names one.

- A GGUF file: `<arch>.pooling_type` (llama.cpp's: 1 mean, 2 cls, 3 last, 4 rank), as
  convert_hf_to_gguf.py writes it for embedding models (Qwen3-Embedding: last).
- A sentence-transformers folder (or a hub id in the local cache): modules.json's Pooling module,
  whose config.json sets pooling_mode_lasttoken or pooling_mode_mean_tokens.

Else LAST, vLLM's default for a causal LM served as an embedding model: under causal attention
the last position is the only one that has seen the whole input. braid pools LAST and MEAN; a model
that names another pooling (CLS, rank) gets LAST, with a warning.

The GGUF's header is read here by hand, its keys only: gguf-py parses the whole file (every tensor's
record, the vocabulary as numpy arrays), 20 s for the embedded model on a busy CPU.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

_GGUF_POOLING = {1: "mean", 3: "last"}  # llama.cpp's llama_pooling_type
_GGUF_POOLING_NAMES = {0: "none", 2: "cls", 4: "rank"}
# GGUF value types: the fixed sizes, by type (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def model_pooling(path: str) -> tuple[str, str]:
    """The model's pooling ("last" or "mean", runner/rows.py's Pooling) and where it came from:
    "gguf", "sentence-transformers" or "default"."""
    named: tuple[str, int | str] | None = None
    try:
        if path.endswith(".gguf") and Path(path).is_file():
            value = gguf_keys(Path(path), "pooling_type").get("pooling_type")
            named = ("gguf", int(value)) if value is not None else None
        else:
            mode = _sentence_transformers_mode(path)
            named = ("sentence-transformers", mode) if mode else None
    except (OSError, ValueError, KeyError, struct.error) as exc:
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


def gguf_keys(path: Path, *names: str) -> dict[str, object]:
    """The values of a GGUF file's keys `<arch>.<name>` (scalars only), read from its header."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        (version,) = struct.unpack_from("<I", m, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version}: braid reads 2 and up")
        (count,) = struct.unpack_from("<Q", m, 16)
        at, values = 24, {}
        for _ in range(count):
            key, at = _string(m, at)
            (kind,) = struct.unpack_from("<I", m, at)
            value, at = _value(m, at + 4, kind)
            values[key] = value
    arch = values.get("general.architecture")
    return {n: values[f"{arch}.{n}"] for n in names if f"{arch}.{n}" in values}


def _string(m: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, at)
    return m[at + 8 : at + 8 + n].decode("utf-8", "replace"), at + 8 + n


def _value(m: mmap.mmap, at: int, kind: int) -> tuple[object, int]:
    """A value of GGUF type `kind` at `at`, and where the next begins; an array is skipped (None)."""
    if kind in _FORMATS:
        return struct.unpack_from(_FORMATS[kind], m, at)[0], at + _SIZES[kind]
    if kind == 8:
        return _string(m, at)
    if kind == 9:
        item, n = struct.unpack_from("<IQ", m, at)
        at += 12
        if item in _SIZES:
            return None, at + n * _SIZES[item]
        for _ in range(n):
            _, at = _value(m, at, item)
        return None, at
    raise ValueError(f"unknown GGUF value type {kind}")

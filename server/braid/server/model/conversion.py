"""A GGUF file converted once into a folder braid loads: transformers' config and tokenizer, the
block matrices as the file holds them (model/weights.py), and in fp32 only the tensors braid does
not keep as blocks (norms, biases, a tensor in no block format braid runs).

Tensor by tensor: each is put in transformers' layout by transformers' own tensor processor (a
block matrix's rows reordered as its blocks, every other tensor dequantized first), written out
and dropped before the next, so a conversion holds at most one tensor in fp32, never the model
(transformers' GGUF loading held it twice: 6.9 GB at the 1B shape, about 7 bytes a parameter).
The block matrices are never written in fp32: an 8B Q4_K_M file's folder held 32 GB of them, which
nothing ran. Later starts read the folder (loader.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from braid.server.model.loader import missing_tensor, reading, shape_mismatch

if TYPE_CHECKING:
    from braid.server.model.weights import Blocks

_LOGGER = logging.getLogger(__name__)

# Part of a converted folder's name: raised when a conversion changes, so older ones are made again
# (2: the config keys transformers drops are read from the file; 3: no fp32 copy of the block matrices;
# 4: the K-quants' two levels of scales, not their fp32 products)
CONVERSION_VERSION = 4
# the tensors a converted GGUF keeps in fp32: not model.safetensors, so that transformers refuses the
# folder (it holds no fp32 block matrices) rather than loading it with those at random values
WEIGHTS_FILE = "gguf-floats.safetensors"
SOURCE_FILE = "braid-source.json"  # the converted file's path, size and time, as its folder's key took them
BLOCKS_FILE = "gguf-blocks.safetensors"  # a converted GGUF's quantized matrices, as the file has them
# The steps of a first conversion, each weighed by the seconds it took for the embedded model (two
# CPUs): reading the file is gguf-py parsing it (its 49,152-token vocabulary) once for all of them;
# the weights (each tensor in fp32, and its quantized blocks) move the bar tensor by tensor.
CONVERSION_STEPS = {
    "reading the file": 7,
    "tokenizer": 4,
    "config": 1,
    "weights": 14,
    "saving": 1,
}


def converted(gguf: Path, cache_dir: Path) -> Path:
    """The safetensors folder converted from `gguf`, made on first use."""
    from braid.server.model.weights import BLOCK_FORMATS

    stat = gguf.stat()
    source = {"path": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    # the block formats too: a braid that runs others keeps other matrices as blocks, the rest in fp32
    key = hashlib.sha256(
        f"{source['path']}:{source['size']}:{source['mtime_ns']}:{CONVERSION_VERSION}:{BLOCK_FORMATS}".encode()
    ).hexdigest()[:12]
    target = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    _LOGGER.info("converting %s once into %s", gguf.name, target)
    started = time.perf_counter()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer, GenerationConfig

    from braid.server.model import progress

    progress.quiet_libraries()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        with (
            progress.Steps(f"converting {gguf.name}", CONVERSION_STEPS) as bar,
            _parsed_once(gguf),
            reading(str(gguf), str(gguf.parent), (gguf.name,)),
        ):
            with bar.step("reading the file"):
                _parse(gguf)  # once, for every step after (_parsed_once)
            with bar.step("tokenizer"):
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            with bar.step("config"):
                config = _gguf_config(gguf)
            with bar.step("weights"):
                architecture = write_tensors(gguf, config, staging, bar.advance)
            with bar.step("saving"):
                config.architectures, config.dtype = [architecture], "float32"  # as transformers saved them
                config.save_pretrained(staging)
                GenerationConfig.from_model_config(config).save_pretrained(staging)
                tokenizer.save_pretrained(staging)
                (staging / SOURCE_FILE).write_text(json.dumps(source))
        os.replace(staging, target)  # atomic: a concurrent or interrupted start never sees half
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _LOGGER.info("converted %s in %.1f s", gguf.name, time.perf_counter() - started)
    remove_stale(target, source["path"])
    return target


def remove_stale(target: Path, mine: str) -> None:
    """Removes the folders converted before `target` (from the file at path `mine`) from a file
    that is gone, or from `mine` before it changed: nothing would load them again (the key names
    the file's path, size and time). Without this every reinstall of a model's package (a new
    venv, a fresh clone) left another whole conversion behind: 660 MB for the embedded model,
    about 4 bytes a parameter for a big one. Only folders that record their source are judged."""
    for folder in target.parent.iterdir():
        if folder == target or not (folder / SOURCE_FILE).is_file():
            continue
        try:
            path = json.loads((folder / SOURCE_FILE).read_text())["path"]
        except (OSError, ValueError, KeyError):
            continue
        if path == mine or not Path(path).exists():
            _LOGGER.info("removing %s, converted from a file that has changed or is gone", folder.name)
            shutil.rmtree(folder, ignore_errors=True)


def write_tensors(gguf: Path, config, folder: Path, advance: Callable[[float], None] = lambda fraction: None) -> str:
    """Writes the file's tensors into folder, one at a time: a matrix in a block format braid's
    kernels run as its blocks, as the file holds them (BLOCKS_FILE; sampled rows checked against
    gguf-py's dequantization, weights.stored_blocks), every other tensor dequantized to fp32 as
    transformers loads it (WEIGHTS_FILE).
    Refuses a file a tensor of the model is missing from, or has another shape in (transformers
    would leave it random, or log a table). Returns the model's class name."""
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from braid.server.model.tensor_file import TensorWriter
    from braid.server.model.weights import BLOCK_FORMATS, gguf_type_name, stored_blocks

    with torch.device("meta"):  # names and shapes only: no memory
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    architecture = type(skeleton).__name__
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}  # a tied head is not one
    reader = GGUFReader(str(gguf))
    processor = TENSOR_PROCESSORS.get(_architecture(reader), TensorProcessor)(config=config.to_dict())
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    parsed: dict = {"tensors": {}, "config": config.to_dict()}  # where some processors put what they make
    weights = TensorWriter(folder / WEIGHTS_FILE, len(reader.tensors))
    blocks = TensorWriter(folder / BLOCKS_FILE, 3 * len(reader.tensors))
    formats: dict[str, str] = {}
    kinds: dict[str, str] = {}
    mismatched: list[tuple[str, tuple, tuple]] = []  # (name, in the file, in the model)

    def fits(hf_name: str, shape: tuple) -> bool:
        if hf_name in shapes and shape != shapes[hf_name]:
            mismatched.append((hf_name, shape, shapes[hf_name]))
            return False
        return True

    for tensor in _released(reader, advance):
        kind = gguf_type_name(tensor.tensor_type)
        kept = kind in BLOCK_FORMATS and tensor.name in mapping
        b = stored_blocks(processor, tensor, kind, gguf.name) if kept else None
        if b is not None:  # a matrix kept as its blocks, never dequantized whole
            hf_name = mapping[tensor.name]
            formats[hf_name] = kind
            if fits(hf_name, b.shape):
                kinds[hf_name] = kind
                for part, t in (("d", b.d), ("m", b.m), ("q", b.q), ("s", b.s)):
                    if t is not None:
                        blocks.add(f"{hf_name}.{part}", t)
            continue
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=mapping,
            parsed_parameters=parsed,
        )
        if result.name not in mapping:
            continue
        hf_name = mapping[result.name]
        value = torch.from_numpy(_own(result.weights)).float()  # as transformers loads it
        formats[hf_name] = kind
        if fits(hf_name, tuple(value.shape)):
            weights.add(hf_name, value)
        del result, value
    for hf_name, value in parsed["tensors"].items():  # what a processor kept to the end (GPT-2's head)
        if fits(hf_name, tuple(value.shape)):
            weights.add(hf_name, value.float())
    if mismatched:
        raise shape_mismatch(str(gguf), "GGUF file", architecture, *min(mismatched))
    missing = sorted(set(shapes) - set(formats) - set(parsed["tensors"]))
    if missing:
        raise missing_tensor(str(gguf), "GGUF file", architecture, missing)
    if "lm_head.weight" not in formats and "model.embed_tokens.weight" in formats:
        formats["lm_head.weight"] = formats["model.embed_tokens.weight"]  # a tied head
    weights.close({"format": "pt"})
    # every tensor's GGUF type, and the block matrices' formats (BlockFile reads both; the block
    # formats of the braid that wrote it are in the folder's key)
    blocks.close({"formats": json.dumps(formats), "blocks": json.dumps(kinds)})
    return architecture


def _released(reader, advance: Callable[[float], None]) -> Iterator:
    """reader's tensors, each one's pages of the mapped file let go once it is done with: read in
    order, all of them would stay resident (the whole file) until the reader is dropped."""
    from braid.server.model import progress

    mapped = getattr(reader.data, "_mmap", None)
    for tensor in progress.counted(reader.tensors, advance):
        yield tensor
        if mapped is not None and hasattr(mapped, "madvise"):
            start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
            with contextlib.suppress(OSError, ValueError):
                mapped.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


def _own(array):
    """array, copied only where it is the file's own bytes (an f32 tensor: a read-only view of the
    mapped file) or not contiguous; a dequantized tensor is fresh already (transformers copies it
    again: one fp32 copy of the largest tensor more)."""
    import numpy as np

    return array if array.flags.c_contiguous and array.flags.writeable else np.copy(array)


def _architecture(reader) -> str:
    return str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")


class BlockFile(Mapping):
    """A converted GGUF's block matrices by parameter name, each read from BLOCKS_FILE when asked
    for, into memory of its own: the runner packs a matrix and drops it, so the file's matrices
    are never all resident beside their packed copies (they were: the 1B shape's start peaked at
    2.7 GB, for a server that then holds 1.6)."""

    def __init__(self, path: Path) -> None:
        from braid.server.model.tensor_file import TensorReader

        self.reader = TensorReader(path)
        self._kinds: dict[str, str] = json.loads(self.reader.metadata["blocks"])
        self.formats: dict[str, str] = json.loads(self.reader.metadata["formats"])  # every tensor's GGUF type

    def __getitem__(self, name: str) -> Blocks:
        from braid.server.model.weights import FOUR_BIT, Blocks, unpack_nibbles

        kind = self._kinds[name]
        m, s = (self.reader.get(f"{name}.{part}") if f"{name}.{part}" in self.reader.keys() else None for part in "ms")
        q = self.reader.get(f"{name}.q")
        return Blocks(kind, self.reader.get(f"{name}.d"), m, unpack_nibbles(q) if kind in FOUR_BIT else q, s)

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


@contextlib.contextmanager
def _parsed_once(gguf: Path) -> Iterator[None]:
    """For the length of a conversion, gguf-py parses the file once, and builds its tensor name
    map once per architecture. Each reader (the tokenizer's, the config's, braid's metadata, the
    weights') made a GGUFReader of its own, each parsing the whole 49,152-token vocabulary again
    (15-20 s each on two busy cores), and transformers builds gguf-py's name map once per
    submodule (397 times for SmolLM2); neither library lets a caller share them, so the two gguf-py
    functions are swapped for sharing ones (transformers and braid import them at call time) and
    put back after."""
    import gguf as gguf_py

    make_reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    readers: dict[Path, object] = {}

    def reader(path, mode="r"):
        if mode != "r" or Path(path).resolve() != gguf.resolve():
            return make_reader(path, mode)
        if gguf not in readers:
            readers[gguf] = make_reader(path, mode)
        return readers[gguf]

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = make_reader, name_map


def _parse(gguf: Path) -> None:
    import gguf as gguf_py

    gguf_py.GGUFReader(str(gguf))


def _gguf_config(gguf: Path):
    """transformers' config of a GGUF file, with the keys transformers drops read from the file
    (model/gguf_config.py)."""
    from transformers import AutoConfig

    from braid.server.model import gguf_config

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    restored = gguf_config.restore(gguf, config)
    if restored:
        _LOGGER.info(
            "%s: from the file's metadata, which transformers does not read: %s", gguf.name, ", ".join(restored)
        )
    return config

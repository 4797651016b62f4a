"""GGUF LoRA adapters, as llama.cpp's convert_lora_to_gguf.py writes them and llama.cpp reads them
(src/llama-adapter.cpp), read into the same matrices as a PEFT folder (lora.py).

Such a file's metadata says general.type = "adapter", adapter.type = "lora" and adapter.lora.alpha;
each targeted projection is two tensors named after the base model's, blk.{layer}.attn_q.weight.lora_a
[r, in] and .lora_b [out, r] (numpy's order; ggml's ne is reversed), in F32 (the converter's default),
F16, BF16 or Q8_0. The converter runs the base model's own tensor transforms on B A, which touch B's
rows only: for Llama, the q and k rows permuted as in the base model's GGUF file. braid serves its
rows in transformers' order, so B's rows are put back by the same tensor processor transformers
undoes that permutation with for the base (model/weights.py). The scale is llama.cpp's, alpha / r
(1 where alpha is 0): the converter keeps no use_rslora, so an rsLoRA adapter converted to GGUF runs
with another scale than in PEFT, in braid as in llama.cpp.

The file's header is read here, not by gguf-py's GGUFReader: an adapter's path comes from a caller
(LoadAdapter), and GGUFReader follows the lengths a header declares without checking them against the
file (an array of 2^40 bytes in a 60-byte file keeps it busy, and growing, for ever). Here every length
is checked against the bytes there are before it is followed, the header is at most MAX_HEADER_BYTES,
and each tensor's name, type and shape are checked against the base model, and its bytes against the
file's size, before any tensor's data is read.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Collection

import numpy as np
import torch

from braid.server.model.weights import gguf_type_name, row_order
from braid.server.runner.lora import (
    Adapter,
    LoraBase,
    Matrix,
    build_adapter,
    check_alpha,
    check_matrix,
    check_rank,
)

READ_TYPES = ("f32", "f16", "bf16", "q8_0")  # the types convert_lora_to_gguf.py writes (--outtype)
# llama.cpp's converter writes a few KiB of metadata and tensor list; a header longer than this is
# refused before more of it is read
MAX_HEADER_BYTES = 16 << 20
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


@dataclass(frozen=True)
class _Tensor:
    """A tensor as the header declares it: shape in numpy's order ([rows, columns]: ggml's ne
    reversed), where its bytes begin in the file and how many there are."""

    name: str
    kind: int  # GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_gguf_lora(
    path: str,
    name: str,
    base: LoraBase,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    round_bf16: bool = False,
) -> Adapter:
    """A GGUF LoRA adapter file, checked against the base model as read_peft checks a folder.
    Raises ValueError with one line naming the file, key or tensor at fault."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            metadata, tensors = _Header(f, path, size).read()
            alpha = _checked_metadata(path, metadata, base)
            found, rank = _checked_tensors(path, tensors, size, base, max_rank)
            matrices = _read_matrices(f, found, base)  # every tensor checked: now read
    except OSError as exc:
        raise ValueError(f"{path}: unreadable: {exc}") from None
    scale = alpha / rank if alpha else 1.0
    return build_adapter(path, name, rank, alpha, scale, matrices, base, dtype, device, round_bf16)


def _checked_metadata(path: str, metadata: dict[str, object], base: LoraBase) -> float:
    """The adapter's alpha, once the metadata says it is a plain LoRA adapter of this model's
    architecture. Raises ValueError naming the key at fault."""

    def text(key: str) -> str | None:
        value = metadata.get(key)
        return value if isinstance(value, str) else None

    kind, adapter_type = text("general.type"), text("adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise ValueError(
            f"{path}: not a GGUF LoRA adapter (general.type is {kind!r}, adapter.type {adapter_type!r}; "
            "llama.cpp's convert_lora_to_gguf.py writes 'adapter' and 'lora')"
        )
    if "adapter.alora.invocation_tokens" in metadata:
        raise ValueError(f"{path}: an activated LoRA (adapter.alora.invocation_tokens) is not supported")
    architecture = text("general.architecture")
    if architecture != base.gguf_architecture:
        raise ValueError(
            f"{path}: an adapter of a {architecture} model, but llama.cpp names this model {base.gguf_architecture}"
        )
    alpha = metadata.get("adapter.lora.alpha")
    if alpha is None:
        raise ValueError(f"{path}: adapter.lora.alpha is missing")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{path}: adapter.lora.alpha is not a number")
    check_alpha(f"{path}: adapter.lora.alpha", alpha, zero_allowed=True)
    return alpha


_Found = tuple[_Tensor, int, str, str]  # a tensor, its layer, its module (PEFT's name) and which: "A" or "B"


def _checked_tensors(
    path: str, tensors: list[_Tensor], size: int, base: LoraBase, max_rank: int
) -> tuple[list[_Found], int]:
    """Every tensor as the header declares it, checked against the base model (its name, type and
    shape) and the file (its bytes), and the adapter's rank. Raises ValueError naming the tensor."""
    from gguf import GGMLQuantizationType

    modules = _modules(base)
    found = []
    for tensor in tensors:
        match = _NAME.fullmatch(tensor.name)
        module = modules.get(match[2]) if match else None
        if match is None or module is None:
            raise ValueError(
                f"{tensor.name}: not a LoRA matrix of a projection braid serves ({', '.join(base.targets)})"
            )
        fmt = gguf_type_name(GGMLQuantizationType(tensor.kind))
        if fmt not in READ_TYPES:
            raise ValueError(f"{tensor.name}: type {fmt.upper()}; braid reads LoRA matrices in F32, F16, BF16 or Q8_0")
        if len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name}: {len(tensor.shape)} dimensions {list(tensor.shape)}, not a matrix's 2")
        found.append((tensor, int(match[1]), module, match[3].upper()))
    a = [t for t, _, _, which in found if which == "A"]
    if not a:
        raise ValueError(f"{path}: holds no LoRA matrices")
    # llama.cpp takes each projection's rank from its lora_a; braid stacks one rank an adapter, so the
    # first's is every one's (check_matrix names a tensor of another)
    rank = a[0].shape[0]
    check_rank(f"{path}: rank r={rank} ({a[0].name})", rank, max_rank)
    for tensor, layer, module, which in found:
        check_matrix(tensor.name, layer, module, which, tensor.shape, rank, base)
        if tensor.offset + tensor.nbytes > size:
            raise ValueError(
                f"{tensor.name}: its {tensor.nbytes} bytes at offset {tensor.offset} run past the end of the "
                f"file ({size} bytes)"
            )
    return found, rank


def _read_matrices(f: BinaryIO, found: list[_Found], base: LoraBase) -> list[Matrix]:
    """The checked tensors' values, as float32 in transformers' row order."""
    from gguf import GGMLQuantizationType, quants

    processor = _tensor_processor(base)
    matrices = []
    for tensor, layer, module, which in found:
        f.seek(tensor.offset)
        raw = np.frombuffer(f.read(tensor.nbytes), dtype=np.uint8).reshape(tensor.shape[0], -1)
        # [r, in] or [out, r]
        value = np.array(quants.dequantize(raw, GGMLQuantizationType(tensor.kind)), dtype=np.float32)
        if which == "B":
            order = row_order(processor, tensor.name.removesuffix(".lora_b"), value.shape[0])
            if order is not None:
                value = value[order]
        matrices.append(Matrix(tensor.name, layer, module, which, torch.from_numpy(value)))
    return matrices


class _Header:
    """A GGUF file's header (gguf-py's layout: magic, version, counts, metadata, tensor list), read
    with every length checked first: read() gives the metadata's scalars and strings by key (an
    array: its length) and the tensors as _Tensor."""

    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self._f, self._path, self._size = f, path, size
        self._end = min(size, MAX_HEADER_BYTES)
        self._at = 0
        self._where = "its magic"  # what is being read, for messages
        f.seek(0)

    def read(self) -> tuple[dict[str, object], list[_Tensor]]:
        from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

        if self._size < 4 or self._unpack("<I") != GGUF_MAGIC:
            raise ValueError(f"{self._path}: not a GGUF file")
        self._where = "its version"
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self._path}: GGUF version {version}; braid reads versions 2 and 3 (little-endian)")
        self._where = "its counts"
        num_tensors, num_values = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, object] = {}
        for _ in range(num_values):
            key = self._new_name("metadata entry", metadata)
            metadata[key] = self._value(self._unpack("<I"))
        tensors = []
        names: set[str] = set()
        for _ in range(num_tensors):
            tensor_name = self._new_name("tensor", names)
            names.add(tensor_name)
            num_dims = self._unpack("<I")
            if num_dims > 4:  # GGML_MAX_DIMS
                raise ValueError(f"{self._path}: tensor {tensor_name!r} has {num_dims} dimensions, past ggml's 4")
            ne = [self._unpack("<Q") for _ in range(num_dims)]
            raw_kind, offset = self._unpack("<I"), self._unpack("<Q")
            try:
                kind = GGMLQuantizationType(raw_kind)
            except ValueError:
                raise ValueError(f"{self._path}: tensor {tensor_name!r} has type {raw_kind}, not a ggml type") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if ne and ne[0] % block:
                raise ValueError(f"{tensor_name}: rows of {ne[0]}, not whole {kind.name} blocks of {block}")
            nbytes = math.prod(ne) // block * block_bytes
            tensors.append((tensor_name, kind, tuple(reversed(ne)), offset, nbytes))
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self._path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._at // alignment) * alignment  # the tensors' data, after the header's padding
        return metadata, [_Tensor(n, int(k), s, start + o, b) for n, k, s, o, b in tensors]

    def _new_name(self, what: str, seen: Collection[str]) -> str:
        """The next name in the header, a metadata entry's or a tensor's (`what`), if not `seen`."""
        self._where = f"{what} {len(seen)}"
        name = self._string()
        self._where = f"{what} {name!r}"
        if name in seen:
            raise ValueError(f"{self._path}: {what} {name!r} is there twice")
        return name

    def _need(self, n: int) -> None:
        """Raises ValueError unless the header's next n bytes are there."""
        if n > self._end - self._at:
            if self._end < self._size:
                raise ValueError(f"{self._path}: {self._where} runs past {MAX_HEADER_BYTES} bytes of header")
            raise ValueError(f"{self._path}: {self._where} runs past the end of the file ({self._size} bytes)")

    def _take(self, n: int) -> bytes:
        self._need(n)
        self._at += n
        return self._f.read(n)

    def _skip(self, n: int) -> None:
        self._need(n)
        self._at += n
        self._f.seek(self._at)

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        data = self._take(self._unpack("<Q"))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self._path}: {self._where}: a string that is not UTF-8") from None

    def _value(self, raw_type: int) -> object:
        """A metadata value: a scalar or string as it is; an array skipped, every element's length
        checked first, and given as its length (no metadata braid reads is an array)."""
        kind = _value_type(raw_type, f"{self._path}: {self._where}")
        if kind == "STRING":
            return self._string()
        if kind != "ARRAY":
            return self._unpack(_SCALARS[kind])
        item = _value_type(self._unpack("<I"), f"{self._path}: {self._where}'s items")
        length = self._unpack("<Q")
        if item in _SCALARS:
            self._skip(length * struct.calcsize(_SCALARS[item]))
        elif item == "STRING":
            self._need(length * 8)  # each is 8 bytes or more: a length the file cannot hold is refused at once
            for _ in range(length):
                self._skip(self._unpack("<Q"))
        else:
            raise ValueError(f"{self._path}: {self._where} is an array of arrays")
        return length


# how GGUF packs each scalar type (gguf-py's GGUFValueType names), little-endian
_SCALARS = {
    "UINT8": "<B",
    "INT8": "<b",
    "UINT16": "<H",
    "INT16": "<h",
    "UINT32": "<I",
    "INT32": "<i",
    "FLOAT32": "<f",
    "BOOL": "<?",
    "UINT64": "<Q",
    "INT64": "<q",
    "FLOAT64": "<d",
}


def _value_type(raw: int, what: str) -> str:
    """GGUF's name of a value type, or ValueError naming `what`."""
    from gguf import GGUFValueType

    try:
        return GGUFValueType(raw).name
    except ValueError:
        raise ValueError(f"{what}: value type {raw}, not a GGUF one") from None


def _modules(base: LoraBase) -> dict[str, str]:
    """llama.cpp's name of each projection braid serves (attn_q, ffn_down, ...) -> PEFT's (q_proj,
    down_proj, ...), by gguf-py's table for the architecture."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == base.gguf_architecture)
    names = get_tensor_name_map(arch, 1)
    modules = {}
    for module in base.targets:
        for parent in ("self_attn", "mlp"):
            gguf_name = names.get_name(f"model.layers.0.{parent}.{module}")
            if gguf_name is not None:
                modules[gguf_name.removeprefix("blk.0.")] = module
    return modules


def _tensor_processor(base: LoraBase):
    """transformers' tensor processor for the architecture: what undoes its converter's transforms
    (Llama's q and k rows' permutation) on the base model's GGUF tensors."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = {"num_attention_heads": base.num_heads, "num_key_value_heads": base.num_kv_heads}
    return TENSOR_PROCESSORS.get(base.gguf_architecture, TensorProcessor)(config=config)

"""safetensors files written and read one tensor at a time, so that neither holds a model in memory.

safetensors' own `save_file` takes every tensor at once, and its `safe_open` maps the whole file: a
tensor read from it is a view whose pages stay resident until every view and the handle are gone.
Converting a GGUF file with them held the whole model in fp32 (6.9 GB at the 1B shape), and a start
kept every quantized matrix's pages resident beside the runner's packed copy of it. Here a tensor
is written as it comes, the header (names, dtypes, shapes, offsets) into room left at the start
once all are known; and a tensor is read into memory of its own, freed with it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
_ROOM_PER_TENSOR = 320  # header bytes left for each tensor: its name, dtype, shape and offsets
PADDING = "__padding__."  # names of the bytes that align a tensor after a smaller type's


class TensorWriter:
    """A safetensors file at path, written tensor by tensor (`add`), finished by `close`."""

    def __init__(self, path: Path, num_tensors: int) -> None:
        self.path = path
        self._room = -(-(4096 + _ROOM_PER_TENSOR * num_tensors) // 8) * 8  # a multiple of 8: aligned data
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close)
        self._file.seek(8 + self._room)
        self._entries: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        pad = -self._offset % tensor.element_size()  # each tensor at a multiple of its element's size
        if pad:
            self._write(f"{PADDING}{len(self._entries)}", torch.zeros(pad, dtype=torch.uint8))
        self._write(name, tensor)

    def close(self, metadata: dict[str, str] | None = None) -> None:
        header = json.dumps(
            {**({"__metadata__": metadata} if metadata else {}), **self._entries}, separators=(",", ":")
        ).encode()
        if len(header) <= self._room:  # spaces after the JSON are part of the format (alignment)
            self._file.seek(0)
            self._file.write(self._room.to_bytes(8, "little") + header.ljust(self._room))
            self._file.close()
            return
        self._file.close()  # more than the room left: the data moves after the header, once
        staging = self.path.with_suffix(".header")
        header = header.ljust(-(-len(header) // 8) * 8)
        with open(self.path, "rb") as data, open(staging, "wb") as out:
            out.write(len(header).to_bytes(8, "little") + header)
            data.seek(8 + self._room)
            shutil.copyfileobj(data, out, 1 << 24)
        os.replace(staging, self.path)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self._entries[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        if size:
            self._file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        self._offset += size


class TensorReader:
    """A safetensors file's tensors, each read into memory of its own when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._start = 8 + size
        self._entries = {n: e for n, e in header.items() if not n.startswith(PADDING)}
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if path.stat().st_size < self._start + end:
            raise ValueError(
                f"{path.name} is cut short: {path.stat().st_size} bytes, its header says {self._start + end}"
            )

    def keys(self) -> set[str]:
        return set(self._entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            if end > begin and f.readinto(data.numpy().data) != end - begin:
                raise ValueError(f"{self.path.name}: {name} is cut short")
        return data.view(_BY_NAME[entry["dtype"]]).reshape(entry["shape"])

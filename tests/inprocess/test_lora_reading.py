"""LoRA adapter files read as a hostile caller may write them (LoadAdapter names any path on the
server): runner/lora.py's PEFT folders and runner/lora_gguf.py's GGUF files, read directly against a
tiny Llama's projections, with no model and no server. Every size a file declares is checked before
it is read; every mistake is one ValueError naming the file, the setting or the tensor, which the
engine turns into INVALID_ARGUMENT (issue 39, items 18 and 19)."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from braid.server.runner.lora import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, LoraBase, Target, read_peft
from braid.server.runner.lora_gguf import read_gguf_lora
from lora_files import write_gguf_lora, write_safetensors_header

RANK = 8
# a tiny Llama: hidden 64, 4 heads of 16 (q 64 wide) and 2 KV heads (k and v 32 wide), MLP 128, 2 layers
BASE = LoraBase(
    targets={
        "q_proj": Target("qkv", 0, 64, 64),
        "k_proj": Target("qkv", 64, 96, 64),
        "v_proj": Target("qkv", 96, 128, 64),
        "o_proj": Target("o", 0, 64, 64),
        "gate_proj": Target("gate_up", 0, 128, 64),
        "up_proj": Target("gate_up", 128, 256, 64),
        "down_proj": Target("down", 0, 64, 128),
    },
    num_layers=2,
    gguf_architecture="llama",
    num_heads=4,
    num_kv_heads=2,
)
PEFT_KEY = "base_model.model.model.layers.0.self_attn.v_proj.lora_{}.weight"
GGUF_NAME = "blk.0.attn_v.weight.lora_{}"


def _matrices(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """v_proj's A [r, 64] and B [32, r]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(RANK, 64, generator=generator), torch.randn(32, RANK, generator=generator)


def _peft(folder: Path, config: object = None, tensors: dict | None = None) -> Path:
    """A PEFT folder: `config` as adapter_config.json (a str: its text as it is), v_proj's matrices."""
    folder.mkdir(exist_ok=True)
    if config is None:
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["v_proj"]}
    (folder / CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    a, b = _matrices()
    save_file(tensors or {PEFT_KEY.format("A"): a, PEFT_KEY.format("B"): b}, str(folder / WEIGHTS_FILE))
    return folder


def _read(path: Path):
    reader = read_gguf_lora if path.suffix == ".gguf" else read_peft
    return reader(str(path), "x", BASE, 64, torch.float32, torch.device("cpu"))


def _refused(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        _read(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def _refused_reading_little(path: Path) -> str:
    """The error, where reading the file allocated less than 4 MiB (numpy's arrays, which the GGUF
    reader reads into, counted by tracemalloc) however much the file declares."""
    tracemalloc.start()
    try:
        message = _refused(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse {path.name}"
    return message


def test_good_adapters_read_the_same_from_a_folder_and_a_gguf_file_of_every_type(tmp_path):
    """The reader the checks run in still reads: the same matrices as a PEFT folder and as GGUF files
    in each type llama.cpp's converter writes (v_proj: rows that llama.cpp does not permute)."""
    from gguf import GGMLQuantizationType

    a, b = _matrices()
    folder = _read(_peft(tmp_path / "peft"))
    want = folder.layers[0]["qkv"]
    assert want.at.shape == (64, RANK) and torch.equal(want.at, a.t()) and folder.info.scale == 2.0
    for kind, tolerance in (("F32", 0), ("F16", 2e-3), ("BF16", 2e-2), ("Q8_0", 2e-2)):
        path = _gguf_of_type(tmp_path / f"{kind}.gguf", {"a": a.numpy(), "b": b.numpy()}, GGMLQuantizationType[kind])
        read = _read(path)
        got = read.layers[0]["qkv"]
        assert read.info.rank == RANK and read.info.scale == 2.0, kind
        assert torch.allclose(got.at, want.at, atol=tolerance * 4, rtol=tolerance), kind
        assert torch.allclose(got.parts[0][4], want.parts[0][4], atol=tolerance * 8, rtol=tolerance), kind


def _gguf_of_type(path: Path, values: dict[str, np.ndarray], qtype) -> Path:
    """A GGUF LoRA file of v_proj's lora_a and lora_b (`values`), in qtype, as the converter writes it
    (a matrix whose rows qtype cannot hold, B's of 8 in Q8_0's blocks of 32, in F16)."""
    from gguf import GGMLQuantizationType, GGUFWriter, QuantError, quants

    writer = GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 16.0)
    for which, value in values.items():
        try:
            raw, kind = quants.quantize(value, qtype), qtype
        except QuantError:
            raw, kind = quants.quantize(value, GGMLQuantizationType.F16), GGMLQuantizationType.F16
        writer.add_tensor(GGUF_NAME.format(which), raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_huge_sparse_adapter_config_is_refused_by_its_size_unread(tmp_path):
    """Issue 39 item 18: a 20 GB adapter_config.json (sparse: no disk) was read whole, and the server
    was OOM-killed. It is refused by its size, naming the file, before a byte of it is read."""
    folder = _peft(tmp_path / "huge")
    with open(folder / CONFIG_FILE, "r+b") as f:
        f.truncate(20 << 30)
    message = _refused_reading_little(folder)
    assert f"{folder / CONFIG_FILE}: {20 << 30} bytes" in message and str(MAX_CONFIG_BYTES) in message


@pytest.mark.parametrize(
    "config, field",
    [
        ("[1, 2]", "a JSON list, expected an object"),
        ('"lora"', "a JSON str, expected an object"),
        ("[" * 100_000, "JSON nested too deep"),
        ('{"r": 8, "lora_alpha": ' + "[" * 100_000, "JSON nested too deep"),
        ("{not json", "not JSON"),
        ({"r": 8, "lora_alpha": math.nan}, "lora_alpha is nan"),
        ({"r": 8, "lora_alpha": math.inf}, "lora_alpha is inf"),
        ({"r": 8, "lora_alpha": 1e308}, "lora_alpha is 1e+308"),
        ({"r": 8, "lora_alpha": 10**400}, "lora_alpha is 1000000000"),
        ({"r": 8, "lora_alpha": -16}, "lora_alpha is -16"),
        ({"r": 8, "lora_alpha": 0}, "lora_alpha is 0"),
        ({"r": 8, "lora_alpha": "16"}, "lora_alpha is '16', expected a number"),
        ({"r": 8, "lora_alpha": True}, "lora_alpha is True, expected a number"),
        ({"r": 8}, "lora_alpha is None, expected a number"),
        ({"r": "8", "lora_alpha": 16}, "r is '8', expected a number"),
        ({"r": 8.0, "lora_alpha": 16}, "r is 8.0, expected a number"),
        ({"r": 0, "lora_alpha": 16}, "rank r=0 must be positive"),
        ({"r": 8, "lora_alpha": 16, "use_rslora": "yes"}, "use_rslora is 'yes', expected true or false"),
        ({"r": 8, "lora_alpha": 16, "use_dora": [[]] * 1000}, "use_dora=[[], [], "),
    ],
)
def test_a_bad_adapter_config_is_refused_naming_the_field(tmp_path, config, field):
    """Issue 39 item 19: lora_alpha NaN or 1e308 loaded (every greedy token id 0, every logprob NaN),
    and a config that is not an object, or nested 100,000 deep, got INTERNAL. Each is one line naming
    the file and the field; a long value is cut short."""
    folder = _peft(tmp_path / "bad", config)
    message = _refused(folder)
    assert message.startswith(str(folder)) and field in message and len(message) < 300, message


def test_an_r_that_is_not_the_matrices_rank_is_refused_naming_it(tmp_path):
    folder = _peft(tmp_path / "r4", {"r": 4, "lora_alpha": 16})
    assert _refused(folder) == f"{PEFT_KEY.format('A')}: shape [8, 64], but this model with r=4 needs [4, 64]"


def test_matrices_that_are_not_finite_are_refused_naming_the_tensor(tmp_path):
    a, b = _matrices()
    b[3, 1] = math.nan
    folder = _peft(tmp_path / "nan", tensors={PEFT_KEY.format("A"): a, PEFT_KEY.format("B"): b})
    assert _refused(folder) == f"{PEFT_KEY.format('B')}: not every value times the scale 2 is a finite float32 number"
    big = _peft(tmp_path / "big", tensors={PEFT_KEY.format("A"): a, PEFT_KEY.format("B"): torch.full((32, RANK), 3e38)})
    assert "lora_B.weight: not every value times the scale 2" in _refused(big)


def test_a_safetensors_matrix_of_the_wrong_shape_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """Item 18's rule for PEFT's weights too: every matrix's dtype and shape are checked from the
    file's header before any is read (a 256 MiB matrix declared, never read)."""
    import safetensors
    import safetensors.torch

    opened = safetensors.safe_open
    read: list[str] = []

    class Counting:
        """safe_open, counting the tensors read from it."""

        def __init__(self, *args, **kwargs):
            self._file = opened(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self._file.get_tensor(key)

        def get_tensors(self, *args, **kwargs):  # load_file's way: every tensor at once
            tensors = self._file.get_tensors(*args, **kwargs)
            read.extend(tensors)
            return tensors

        def __getattr__(self, name):
            return getattr(self._file, name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    monkeypatch.setattr(safetensors.torch, "safe_open", Counting)  # what load_file reads with
    folder = _peft(tmp_path / "wide")
    write_safetensors_header(
        folder / WEIGHTS_FILE, {PEFT_KEY.format("A"): (RANK, 8 << 20), PEFT_KEY.format("B"): (32, RANK)}
    )
    assert _refused(folder) == f"{PEFT_KEY.format('A')}: shape [8, 8388608], but this model with r=8 needs [8, 64]"
    assert read == []


@pytest.mark.parametrize(
    "alpha, shown",
    [(math.nan, "nan"), (math.inf, "inf"), (-1.0, "-1.0"), (1e30, "1.0000000150474662e+30"), ("16", None)],
)
def test_a_gguf_adapter_with_a_bad_alpha_is_refused_naming_it(tmp_path, alpha, shown):
    a, b = _matrices()
    path = write_gguf_lora(
        tmp_path / "alpha.gguf",
        {GGUF_NAME.format("a"): (RANK, 64), GGUF_NAME.format("b"): (32, RANK)},
        {GGUF_NAME.format("a"): a.numpy(), GGUF_NAME.format("b"): b.numpy()},
        alpha=alpha,
    )
    message = _refused(path)
    if shown is None:
        assert message == f"{path}: adapter.lora.alpha is not a number"
    else:
        assert message == f"{path}: adapter.lora.alpha is {shown}; it must be a finite number in [0, 65536]"


def test_a_gguf_tensor_declared_huge_is_refused_before_its_data_is_read(tmp_path):
    """Issue 39 item 18: a GGUF adapter declaring a 2 GiB tensor was read into memory before its
    shape was checked (RSS +3.7 GB). Here one declares 256 MiB (a sparse file: every byte of it there),
    and is refused by its shape with under 4 MiB allocated."""
    path = write_gguf_lora(
        tmp_path / "huge.gguf", {GGUF_NAME.format("a"): (RANK, 8 << 20), GGUF_NAME.format("b"): (32, RANK)}
    )
    assert path.stat().st_size > 256 << 20
    message = _refused_reading_little(path)
    assert message == f"{GGUF_NAME.format('a')}: shape [8, 8388608], but this model with r=8 needs [8, 64]"


def test_a_gguf_tensor_whose_data_lies_past_the_end_is_refused_naming_it(tmp_path):
    """Shapes the model takes, but the file ends with its header: refused by the bytes the header
    declares against the file's size, naming the tensor, before any is read."""
    path = write_gguf_lora(
        tmp_path / "short.gguf", {GGUF_NAME.format("a"): (RANK, 64), GGUF_NAME.format("b"): (32, RANK)}, fill=False
    )
    size = path.stat().st_size
    message = _refused(path)
    assert message.startswith(f"{GGUF_NAME.format('a')}: its 2048 bytes at offset ")
    assert message.endswith(f"run past the end of the file ({size} bytes)")


def _header(values: bytes, num_values: int = 1, num_tensors: int = 0) -> bytes:
    return struct.pack("<IIQQ", 0x46554747, 3, num_tensors, num_values) + values


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    "header, message",
    [
        # an array of 2^40 bytes in a 60-byte file: gguf-py's reader walks it for ever, growing
        pytest.param(
            _header(_key("general.tags") + struct.pack("<IIQ", 9, 0, 1 << 40)),
            "metadata entry 'general.tags' runs past",
            id="2^40-byte-array",
        ),
        pytest.param(
            _header(_key("general.tags") + struct.pack("<IIQ", 9, 8, 1 << 60)),
            "metadata entry 'general.tags' runs past",
            id="2^60-strings",  # each at least 8 bytes
        ),
        pytest.param(
            _header(_key("general.name") + struct.pack("<IQ", 8, 1 << 62)),
            "metadata entry 'general.name' runs past",
            id="2^62-byte-string",
        ),
        pytest.param(_header(b"", num_values=1 << 62), "metadata entry 0 runs past", id="2^62-entries"),
        pytest.param(
            _header(_key("general.name") + struct.pack("<I", 99)),
            "metadata entry 'general.name': value type 99",
            id="no-such-type",
        ),
        pytest.param(
            _header(_key("x") + struct.pack("<IIQ", 9, 9, 1)), "metadata entry 'x' is an array of arrays", id="nested"
        ),
        pytest.param(
            _header(_key("x") + struct.pack("<B", 0) * 5, num_values=2), "metadata entry 1 runs past", id="cut-short"
        ),
        pytest.param(_header(b"", num_values=0, num_tensors=1 << 62), "tensor 0 runs past", id="2^62-tensors"),
        pytest.param(
            _header(_key("t") + struct.pack("<I", 9) + struct.pack("<Q", 1) * 9, num_values=0, num_tensors=1),
            "tensor 't' has 9 dimensions",
            id="9-dimensions",
        ),
        pytest.param(b"GGUF" + struct.pack("<I", 1), "GGUF version 1", id="version-1"),
        pytest.param(b"PK\x03\x04", "not a GGUF file", id="zip"),
        pytest.param(b"", "not a GGUF file", id="empty"),
    ],
)
def test_a_gguf_header_is_read_only_as_far_as_the_file_holds_it(tmp_path, header, message):
    """Every length a GGUF header declares is checked against the bytes left before it is followed:
    a tiny file declaring terabytes is refused at once, naming what ran past."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(header)
    got = _refused_reading_little(path)
    assert got.startswith(f"{path}: ") and message in got, got


def test_a_gguf_header_past_its_cap_is_refused_unread(tmp_path):
    """A metadata string of 1 GiB (a sparse file) is refused by the header's cap, not read."""
    path = tmp_path / "long.gguf"
    path.write_bytes(_header(_key("general.name") + struct.pack("<IQ", 8, 1 << 30)))
    with open(path, "r+b") as f:
        f.truncate(2 << 30)
    assert "metadata entry 'general.name' runs past 16777216 bytes of header" in _refused_reading_little(path)

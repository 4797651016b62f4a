"""LoRA adapters on braid's decoder: PEFT's format read and checked against the base model (and
llama.cpp's GGUF files, lora_gguf.py, checked by the same build_adapter), and the low-rank deltas
of a pass's rows added to the projections they target.

A PEFT adapter changes a projection W [out, in] to W + scale * B A, with A [r, in] and B [out, r]
(scale: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora). The base weights stay as they are
served (f32, bf16, Q8_0, ...): each target projection's output gets `scale * (x A^T) B^T` added for
the rows that run with the adapter.

An adapter's matrices are stacked at load, per layer and per fused projection of the decoder (qkv,
o, gate_up, down): one At [in, R] (the A^T of every module it targets in that group, side by side)
and one block-diagonal Bt [R, out] (each module's B^T times the scale, in its own rows and its
projection's columns). The runner packs a pass's tokens grouped by adapter (model_runner.py), so
each adapter's tokens are one or two runs of rows, and adds per run

    t = x[run] @ At              # [n, R]: every module's x A^T at once
    out[run, columns] += t @ Bt  # the group's columns it targets: q, k, v; gate, up; o; down

Rows with different adapters and with none share the pass: a run touches only its own rows, and
base rows get nothing added. The cost follows the adapters a pass uses, not those resident.
(A masked product over every adapter at once, punica's shape as dense matmuls, takes fewer calls
but multiplies every token by every adapter: measured slower from 4 adapters at 16 rows.)
A pass with prompt chunks, or on torch's ops, runs these as torch matmuls. A decode-only pass on
braid's C kernels keeps its one C call (csrc/decode_step.c): each adapter's `table` points that call
at its matrices (in bf16 where every value is a bf16 one: half the bytes), the threads share out
x A^T (one barrier per group targeted) or, for a few rows, each does it all itself, and every row's delta is added panel by panel by the thread
that computed the panel, with no call or thread wake-up of its own (two torch matmuls per run and
group cost more than the arithmetic: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from braid.server.runner.kernels.extension import FORMAT_CODES, LORA_FIELDS, PANEL
from braid.server.runner.rows import AdapterInfo

GROUPS = ("qkv", "o", "gate_up", "down")  # the decoder's fused projections, in a layer's order
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT writes an adapter_config.json of about 1 KB (tens of KB with a rank_pattern for every layer):
# a bigger one is refused by its size, before it is read
MAX_CONFIG_BYTES = 1 << 20
# lora_alpha's bounds: PEFT's adapters use 8 to a few hundred; past this the deltas swamp the model
# (and at 1e308 overflow to inf: every greedy token id 0, every logprob NaN)
MAX_ALPHA = 65536.0
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the float types a matrix may be in
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
    r"\.weight$"
)


@dataclass(frozen=True)
class Target:
    """A projection an adapter may target: columns [begin, end) of its fused group's output, fed
    `in_features` wide."""

    group: str
    begin: int
    end: int
    in_features: int


@dataclass
class _Stacked:
    """One adapter's matrices for one layer's projection group: x @ at gives every module's
    x A^T side by side; parts add each module's columns times its B^T into its output columns."""

    at: torch.Tensor  # [in, R]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # (columns begin, end, output begin, end, Bt [cols, out])
    rank: int
    modules: list[tuple[int, int]]  # each module's output columns [begin, end), in at's order


@dataclass
class Adapter:
    info: AdapterInfo
    layers: list[dict[str, _Stacked]]  # per layer, by group (GROUPS) it targets there
    bf16: bool = False  # whether its every value is a bf16 one: the C step reads them so
    table: torch.Tensor = field(init=False)  # the C decode step's view of it (_step_table)
    panels: list[torch.Tensor] = field(
        init=False
    )  # its A^T and B^T as the step reads them, which the table points into
    cols: int = field(init=False)  # its widest A^T's columns

    def __post_init__(self) -> None:
        self.table, self.panels = _step_table(self.layers, torch.bfloat16 if self.bf16 else torch.float32)
        self.cols = max((m.at.shape[1] for layer in self.layers for m in layer.values()), default=1)

    @property
    def nbytes(self) -> int:
        return sum(
            m.at.nbytes + sum(p[4].nbytes for p in m.parts) for layer in self.layers for m in layer.values()
        ) + sum(p.nbytes for p in self.panels)


@dataclass(frozen=True)
class LoraBase:
    """The base model as an adapter is checked against and mapped onto: the projections it may
    target, its layers, and what a GGUF adapter's rows depend on: the architecture llama.cpp names
    the model by (general.architecture) and its heads (llama.cpp permutes Llama's q and k rows)."""

    targets: dict[str, Target]
    num_layers: int
    gguf_architecture: str
    num_heads: int
    num_kv_heads: int


def read_peft(
    path: str,
    name: str,
    base: LoraBase,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    round_bf16: bool = False,
) -> Adapter:
    """A PEFT adapter folder, checked against the base model's projections. Raises ValueError with
    one line naming the file, setting or tensor at fault. round_bf16: round A and B times the scale
    to bf16 values (where the base's rows are rounded too: --activations int8 or bf16)."""
    from safetensors import safe_open

    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(config_file)
    rank = _setting(config_file, config, "r", int)
    check_rank(f"{config_file}: rank r={rank}", rank, max_rank)
    alpha = _setting(config_file, config, "lora_alpha", (int, float))
    check_alpha(f"{config_file}: lora_alpha", alpha, zero_allowed=False)
    rslora = config.get("use_rslora")
    if rslora is not None and not isinstance(rslora, bool):
        raise ValueError(f"{config_file}: use_rslora is {_shown(rslora)}, expected true or false")
    for key, allowed in (
        ("peft_type", ("LORA", None)),
        ("fan_in_fan_out", (False, None)),
        ("bias", ("none", None)),
        ("use_dora", (False, None)),
        ("modules_to_save", (None, [])),
        ("rank_pattern", ({}, None)),
        ("alpha_pattern", ({}, None)),
    ):
        if config.get(key) not in allowed:
            raise ValueError(
                f"{config_file}: {key}={_shown(config.get(key))} is not supported (braid serves plain LoRA "
                f"on {', '.join(base.targets)})"
            )
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    try:
        tensors = safe_open(str(weights_file), framework="pt")  # its header: no matrix is read yet
    except Exception as exc:  # safetensors' own error: a header that is not one, data past the end
        raise ValueError(f"{weights_file}: unreadable: {exc}") from None
    with tensors:
        found = []
        for key in sorted(tensors.keys()):
            match = _KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"{key}: not a LoRA matrix of a projection braid serves ({', '.join(base.targets)})")
            header = tensors.get_slice(key)
            if header.get_dtype() not in FLOAT_DTYPES:
                raise ValueError(f"{key}: dtype {header.get_dtype()} is not a float type")
            check_matrix(key, int(match[1]), match[2], match[3], header.get_shape(), rank, base)
            found.append((key, int(match[1]), match[2], match[3]))
        # every matrix checked: now read
        matrices = [Matrix(*where, tensors.get_tensor(where[0])) for where in found]
    return build_adapter(path, name, rank, alpha, scale, matrices, base, dtype, device, round_bf16)


@dataclass(frozen=True)
class Matrix:
    """One of an adapter file's matrices: its name in the file (for messages), the layer and the
    projection (PEFT's module name) it belongs to, and which: A [r, in] or B [out, r], rows in
    transformers' order."""

    key: str
    layer: int
    module: str
    which: str  # "A" or "B"
    value: torch.Tensor


def check_rank(what: str, rank: int, max_rank: int) -> None:
    """Raises ValueError naming `what` unless 0 < rank <= max_rank."""
    if not 0 < rank <= max_rank:
        raise ValueError(f"{what} is past --max-lora-rank {max_rank}" if rank > 0 else f"{what} must be positive")


def check_alpha(what: str, alpha: float, zero_allowed: bool) -> None:
    """Raises ValueError naming `what` unless alpha is a number in (0, MAX_ALPHA] (NaN is in no
    range), or 0 where zero_allowed (llama.cpp's "none": scale 1; in PEFT 0 would undo the adapter)."""
    if not (0 <= alpha <= MAX_ALPHA and (alpha > 0 or zero_allowed)):
        bounds = f"{'[' if zero_allowed else '('}0, {MAX_ALPHA:g}]"
        raise ValueError(f"{what} is {_shown(alpha)}; it must be a finite number in {bounds}")


def check_matrix(key: str, layer: int, module: str, which: str, shape, rank: int, base: LoraBase) -> None:
    """Raises ValueError naming the matrix `key` (lora_A [r, in] or lora_B [out, r] of `module` in
    `layer`, as its file's header declares it) unless the base model has that projection and layer
    and `shape` is what they and rank r need. The readers call it before they read the matrix: a
    header may declare any size."""
    target = base.targets.get(module)
    if target is None:
        raise ValueError(f"{key}: {module} is not a projection of this model ({', '.join(base.targets)})")
    if layer >= base.num_layers:
        raise ValueError(f"{key}: layer {layer}, but the model has {base.num_layers}")
    want = (rank, target.in_features) if which == "A" else (target.end - target.begin, rank)
    if tuple(shape) != want:
        raise ValueError(f"{key}: shape {list(shape)}, but this model with r={rank} needs {list(want)}")


def build_adapter(
    path: str,
    name: str,
    rank: int,
    alpha: float,
    scale: float,
    matrices: list[Matrix],
    base: LoraBase,
    dtype: torch.dtype,
    device: torch.device,
    round_bf16: bool,
) -> Adapter:
    """An adapter file's matrices (read_peft's, lora_gguf.py's), each checked by check_matrix
    before it was read, checked together (every A with its B, every value finite) and stacked.
    Raises ValueError with one line naming the tensor at fault."""
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for m in matrices:
        value = m.value.to(device=device, dtype=torch.float32)
        if m.which == "B":
            value = value * scale
        if not bool(torch.isfinite(value).all()):
            scaled = f" times the scale {scale:g}" if m.which == "B" else ""
            raise ValueError(f"{m.key}: not every value{scaled} is a finite float32 number")
        (a if m.which == "A" else b)[m.layer, m.module] = value
    for key in set(a) ^ set(b):
        layer, module = key
        raise ValueError(f"layer {layer} {module}: lora_{'B' if key in a else 'A'} is missing")
    if not a:
        raise ValueError(f"{path}: holds no LoRA matrices")
    modules = tuple(m for m in base.targets if any(k[1] == m for k in a))
    info = AdapterInfo(
        name=name, path=str(path), rank=rank, alpha=float(alpha), scale=float(scale), target_modules=modules
    )
    # the C step reads an adapter whose every value (B's times the scale) is a bf16 one in bf16: the
    # same values in half the bytes, and bytes are most of what the deltas cost (docs/benchmarks.md).
    # An adapter saved in bf16 is so where its scale is a power of two. One in fp32 is rounded to bf16
    # only where the base model's rows are rounded anyway (int8 or bf16 rows: --activations), whose
    # error is far larger than a delta's relative 2^-9; on fp32 rows it stays fp32, and its tokens
    # are PEFT's (tests/test_lora.py). Every path (torch's matmuls, the C step) reads the same values.
    if round_bf16:
        for stacked in (a, b):
            for key, value in stacked.items():
                stacked[key] = value.to(torch.bfloat16).to(torch.float32)
    bf16 = round_bf16 or all(torch.equal(v, v.to(torch.bfloat16).to(torch.float32)) for v in (*a.values(), *b.values()))
    return Adapter(info, [_stack(layer, a, b, base.targets, dtype) for layer in range(base.num_layers)], bf16)


def _stack(
    layer: int,
    a: dict[tuple[int, str], torch.Tensor],
    b: dict[tuple[int, str], torch.Tensor],
    targets: dict[str, Target],
    dtype: torch.dtype,
) -> dict[str, _Stacked]:
    """One layer's matrices, stacked per group (see the module's docstring)."""
    stacked = {}
    for group in GROUPS:
        modules = [m for m, t in targets.items() if t.group == group and (layer, m) in a]
        if not modules:
            continue
        rank = a[layer, modules[0]].shape[0]
        at = torch.cat([a[layer, m].t() for m in modules], dim=1).to(dtype).contiguous()
        # one block-diagonal B^T for the group's modules (zeros where a module's rows meet another's
        # columns): one product instead of one per module, for fewer calls, which cost more than
        # bytes at these ranks (docs/benchmarks.md); not yet measured against the per-module form on
        # a quiet machine
        begin, end = min(targets[m].begin for m in modules), max(targets[m].end for m in modules)
        bt = torch.zeros(rank * len(modules), end - begin, dtype=dtype, device=at.device)
        for j, m in enumerate(modules):
            bt[j * rank : (j + 1) * rank, targets[m].begin - begin : targets[m].end - begin] = b[layer, m].t()
        stacked[group] = _Stacked(
            at, [(0, rank * len(modules), begin, end, bt)], rank, [(targets[m].begin, targets[m].end) for m in modules]
        )
    return stacked


def _step_table(layers: list[dict[str, _Stacked]], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """[layers, GROUPS, LORA_FIELDS] long: the adapter's matrices as the C decode step reads them
    (csrc/kernels.h), and the memory it points into, in dtype (float32, or bfloat16 where every value
    is a bf16 one): each group's A^T, its rows padded to 16 columns (whole vector loads), and each
    module's B^T again, in the matmul's 32-column panels (one contiguous read per panel, where the
    block-diagonal Bt's rows are a group's width apart: read so, they cost the step more than the
    arithmetic). Meaningful where the matrices are float32 on the CPU, the only place the step runs."""
    table = torch.zeros(len(layers), len(GROUPS), len(LORA_FIELDS), dtype=torch.long)
    panels: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        for g, group in enumerate(GROUPS):
            m = layer.get(group)
            if m is None or m.at.dtype != torch.float32 or m.at.device.type != "cpu":
                continue
            _, _, begin, _, bt = m.parts[0]
            cols = m.at.shape[1]
            at = torch.zeros(m.at.shape[0], -(-cols // 16) * 16, dtype=dtype)
            at[:, :cols] = m.at
            panels.append(at)
            row = [at.data_ptr(), cols, m.rank]
            for j, (col_begin, col_end) in enumerate(m.modules):
                first, last = col_begin // PANEL, (col_end - 1) // PANEL
                packed = torch.zeros(m.rank, (last + 1 - first) * PANEL)  # [rank, the panels' columns]
                packed[:, col_begin - first * PANEL : col_end - first * PANEL] = bt[
                    j * m.rank : (j + 1) * m.rank, col_begin - begin : col_end - begin
                ]
                # [panels, rank, 32]
                packed = packed.view(m.rank, -1, PANEL).transpose(0, 1).to(dtype).contiguous()
                panels.append(packed)
                row += [packed.data_ptr(), col_begin, col_end]
            row += [0, 0, 0] * (3 - len(m.modules)) + [FORMAT_CODES["bf16" if dtype == torch.bfloat16 else "f32"]]
            table[i, g] = torch.tensor(row, dtype=torch.long)
    return table, panels


def _read_config(config_file: Path) -> dict:
    """adapter_config.json's object, its size checked before it is read (and no more than the cap
    read: a file may grow, or say 0 bytes and hold more). Raises ValueError naming the file."""
    too_big = f"a LoRA adapter's config is at most {MAX_CONFIG_BYTES} bytes"
    try:
        size = config_file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{config_file}: {size} bytes; {too_big}")
        with config_file.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{config_file}: unreadable: {exc}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{config_file}: more than {MAX_CONFIG_BYTES} bytes; {too_big}")
    try:
        config = json.loads(text)
    except RecursionError:
        raise ValueError(f"{config_file}: JSON nested too deep") from None
    except ValueError as exc:
        raise ValueError(f"{config_file}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: a JSON {type(config).__name__}, expected an object")
    return config


def _setting(config_file: Path, config: dict, key: str, kind) -> int | float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{config_file}: {key} is {_shown(value)}, expected a number")
    return value


def _shown(value: object) -> str:
    """A config value in an error message, cut short (a value may be a megabyte)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class LoraPass:
    """What a pass needs to add its rows' deltas: runs of packed rows [begin, end), each with the
    adapter its rows run with (rows outside every run run with none)."""

    runs: list[tuple[Adapter, int, int]]

    def step_args(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What the C decode step takes (DecodeStep): each of the `rows` rows' index into the
        adapters' tables (-1: none), the tables' addresses, and the widest adapter's A^T."""
        adapters = list({id(a): a for a, _, _ in self.runs}.values())
        index = torch.full((rows,), -1, dtype=torch.long)
        for adapter, begin, end in self.runs:
            index[begin:end] = adapters.index(adapter)
        tables = torch.tensor([a.table.data_ptr() for a in adapters], dtype=torch.long)
        return index, tables, max(a.cols for a in adapters)

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += x A^T B^T scale, per run, for layer's projection group; out [N, group's width] (for
        o and down, the residual stream itself: the delta joins it as the projection's output does)."""
        for adapter, begin, end in self.runs:
            m = adapter.layers[layer].get(group)
            if m is None:
                continue
            rows = slice(begin, end)
            t = torch.mm(x[rows], m.at)  # [n, R]
            for col_begin, col_end, out_begin, out_end, bt in m.parts:
                out[rows, out_begin:out_end].addmm_(t[:, col_begin:col_end], bt)

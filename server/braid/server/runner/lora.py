"""LoRA adapters on braid's decoder: PEFT's format read and checked against the base model, and the
low-rank deltas of a pass's rows added to the projections they target.

A PEFT adapter changes a projection W [out, in] to W + scale * B A, with A [r, in] and B [out, r]
(scale: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora). The base weights stay as they are
served (f32, bf16, Q8_0, ...): each target projection's output gets `scale * (x A^T) B^T` added for
the rows that run with the adapter.

Every resident adapter's matrices are stacked, per layer and per fused projection of the decoder
(qkv, o, gate_up, down), into one At [in, R] and one Bt [R, out] (an adapter's B lands in its own
rows of Bt, in the columns of the projection it targets, zero elsewhere). A pass then adds, per
projection,

    out += ((x @ At) * mask) @ Bt        # x [N, in], mask [N, R]: 1 where token n's adapter owns column r

so rows with different adapters, and rows with none (an all-zero mask row adds exactly 0), share one
pass with two small matmuls per projection whatever the mix: punica's grouped delta, as plain dense
matmuls. These run as torch matmuls on braid's C-kernel path as well: rank 8 to 64 against hidden
sizes in the hundreds or thousands, they are a few percent of the pass's multiply-adds, and their
float32 weights need none of the block formats the C kernels exist for.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from braid.server.runner.rows import AdapterInfo

GROUPS = ("qkv", "o", "gate_up", "down")  # the decoder's fused projections, in a layer's order
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")


@dataclass(frozen=True)
class Target:
    """A projection an adapter may target: columns [begin, end) of its fused group's output, fed
    `in_features` wide."""

    group: str
    begin: int
    end: int
    in_features: int


@dataclass
class Adapter:
    """One adapter's matrices, per (layer, module): A [r, in], and B [out, r] times its scale."""

    info: AdapterInfo
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values()))


def read_peft(path: str, name: str, targets: dict[str, Target], num_layers: int, max_rank: int,
              dtype: torch.dtype, device: torch.device) -> Adapter:
    """A PEFT adapter folder, checked against the base model's projections. Raises ValueError with
    one line naming the file, setting or tensor at fault."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: unreadable: {exc}") from None
    rank, alpha = _setting(config, "r", int), _setting(config, "lora_alpha", (int, float))
    if not 0 < rank <= max_rank:
        raise ValueError(f"{config_file}: rank r={rank} is past --max-lora-rank {max_rank}" if rank > 0
                         else f"{config_file}: rank r={rank} must be positive")
    for key, allowed in (("peft_type", ("LORA", None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None)),
                         ("use_dora", (False, None)), ("modules_to_save", (None, [])), ("rank_pattern", ({}, None)),
                         ("alpha_pattern", ({}, None))):
        if config.get(key) not in allowed:
            raise ValueError(f"{config_file}: {key}={config.get(key)!r} is not supported (braid serves plain LoRA "
                             f"on {', '.join(targets)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:
        raise ValueError(f"{weights_file}: unreadable: {exc}") from None
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key, value in sorted(tensors.items()):
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{key}: not a LoRA matrix of a projection braid serves ({', '.join(targets)})")
        layer, module, which = int(match[1]), match[2], match[3]
        target = targets.get(module)
        if target is None:
            raise ValueError(f"{key}: {module} is not a projection of this model ({', '.join(targets)})")
        if layer >= num_layers:
            raise ValueError(f"{key}: layer {layer}, but the model has {num_layers}")
        want = (rank, target.in_features) if which == "A" else (target.end - target.begin, rank)
        if tuple(value.shape) != want:
            raise ValueError(f"{key}: shape {list(value.shape)}, but this model with r={rank} needs {list(want)}")
        if not value.is_floating_point():
            raise ValueError(f"{key}: dtype {value.dtype} is not a float type")
        value = value.to(device=device, dtype=torch.float32)
        (a if which == "A" else b)[layer, module] = value if which == "A" else value * scale
    for key in set(a) ^ set(b):
        layer, module = key
        raise ValueError(f"layer {layer} {module}: lora_{'B' if key in a else 'A'} is missing")
    if not a:
        raise ValueError(f"{weights_file}: holds no LoRA matrices")
    modules = tuple(m for m in targets if any(k[1] == m for k in a))
    info = AdapterInfo(name=name, path=str(path), rank=rank, alpha=float(alpha), scale=float(scale),
                       target_modules=modules)
    return Adapter(info, {k: v.to(dtype) for k, v in a.items()}, {k: v.to(dtype) for k, v in b.items()})


def _setting(config: dict, key: str, kind) -> int | float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{CONFIG_FILE}: {key} is {value!r}, expected a number")
    return value


@dataclass
class _Stacked:
    at: torch.Tensor  # [in, R]
    bt: torch.Tensor  # [R, out]


class LoraStack:
    """Every resident adapter's matrices stacked per layer and group (see the module's docstring),
    with the adapter each column belongs to. Immutable: the runner builds a new one when an adapter
    is loaded or unloaded, and a pass uses the one it started with."""

    def __init__(self, adapters: dict[int, Adapter], targets: dict[str, Target], widths: dict[str, int],
                 num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        """widths: each group's output size."""
        self.ids = frozenset(adapters)
        self.layers: list[dict[str, _Stacked]] = [{} for _ in range(num_layers)]
        self.owners: dict[str, torch.Tensor] = {}  # group -> [R] long: the adapter id of each column
        for group in GROUPS:
            modules = [m for m, t in targets.items() if t.group == group]
            blocks = [(adapter_id, module) for adapter_id, adapter in sorted(adapters.items()) for module in modules
                      if module in adapter.info.target_modules]
            if not blocks:
                continue
            ranks = [adapters[i].info.rank for i, _ in blocks]
            self.owners[group] = torch.tensor([i for (i, _), r in zip(blocks, ranks) for _ in range(r)],
                                              dtype=torch.long, device=device)
            in_features = targets[modules[0]].in_features
            for layer in range(num_layers):
                at = torch.zeros(in_features, sum(ranks), dtype=dtype, device=device)
                bt = torch.zeros(sum(ranks), widths[group], dtype=dtype, device=device)
                column = 0
                for (adapter_id, module), rank in zip(blocks, ranks):
                    adapter, target = adapters[adapter_id], targets[module]
                    if (layer, module) in adapter.a:
                        at[:, column:column + rank] = adapter.a[layer, module].t()
                        bt[column:column + rank, target.begin:target.end] = adapter.b[layer, module].t()
                    column += rank
                self.layers[layer][group] = _Stacked(at, bt)

    def masks(self, token_adapters: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Per group, [N, R]: 1 where packed token n's adapter (token_adapters [N], 0: none) owns
        column r."""
        return {group: (token_adapters.unsqueeze(1) == owners.unsqueeze(0)).to(dtype)
                for group, owners in self.owners.items()}


@dataclass
class LoraPass:
    """What a pass needs to add its rows' deltas: the stack, and each group's mask for its tokens."""

    stack: LoraStack
    masks: dict[str, torch.Tensor]

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += ((x @ At) * mask) @ Bt for layer's projection group; out [N, group's width] (for o
        and down, the residual stream itself: the delta joins it as the projection's output does)."""
        mask = self.masks.get(group)
        if mask is None:
            return
        m = self.stack.layers[layer][group]
        out.addmm_(torch.mm(x, m.at).mul_(mask), m.bt)

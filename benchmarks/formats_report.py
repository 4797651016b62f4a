"""The weight-format benchmark's results: one Outcome per configuration, saved as JSON, written as the
FORMATS_HEADING section of docs/benchmarks.md, with issue 26's ratios worked out from them."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from metrics import Row, spread
from report import FORMATS_HEADING, machine_table

MIB = 2**20
QUICK = " (a quick run: fewer tokens, one repeat)"
SMOLLM, LLAMA_1B = "SmolLM2-135M", "1B (Llama-3.2 shape, random)"
# What a configuration is to issue 26's ratios (Outcome.role): braid's default on the model's own GGUF
# file, braid's fp32 path, and llama.cpp on that same file.
DEFAULT, FP32, SAME_FILE = "braid default", "braid fp32", "llama.cpp same file"
BEST_LLAMA, BOUND = "llama.cpp's fastest format", "bandwidth bound"


@dataclass(frozen=True)
class Target:
    """One of issue 26's ratios: braid's default over `against`, at `streams`, at least `at_least`
    (more than it, if `strict`)."""

    model: str
    streams: int
    against: str  # a role, BEST_LLAMA or BOUND
    at_least: float
    strict: bool = False


TARGETS = (
    Target(SMOLLM, 16, BEST_LLAMA, 1.5),
    Target(SMOLLM, 32, BEST_LLAMA, 1.5),
    Target(SMOLLM, 1, SAME_FILE, 1.3),
    Target(SMOLLM, 16, FP32, 1.0, strict=True),
    Target(LLAMA_1B, 16, BEST_LLAMA, 1.5),
    Target(LLAMA_1B, 1, SAME_FILE, 1.2),
    Target(LLAMA_1B, 1, BOUND, 0.7),
)


@dataclass
class Outcome:
    """One server configuration: what it read per decode step, what it held, what it did."""

    model: str
    system: str  # "braid" or "llama.cpp"
    weights: str  # the format as the table shows it
    command: str  # the server's flags that choose the model file and its format
    bytes_per_step: int = 0
    rss_mib: float | None = None
    rows: dict[int, Row] = field(default_factory=dict)  # by streams at once (1: the single stream)
    error: str | None = None
    role: str = ""  # DEFAULT, FP32, SAME_FILE or none

    def tok_s(self, streams: int) -> float | None:
        """The figure the table shows: the median of the repeats (median_row's row is the upper of two)."""
        row = self.rows.get(streams)
        if row is None:
            return None
        return statistics.median(row.repeats) if row.repeats else row.tokens_per_s


@dataclass
class FormatResults:
    machine: dict
    settings: dict
    command: str
    bandwidth_gbs: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M %Z"))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> FormatResults:
        data = json.loads(path.read_text())
        data["outcomes"] = [_outcome(o) for o in data["outcomes"]]
        return cls(**data)

    @property
    def streams(self) -> list[int]:
        """The stream counts measured, fewest first (runs saved before --streams: 1 and 16)."""
        return self.settings.get("streams", [1, 16])


def _outcome(saved: dict) -> Outcome:
    """An Outcome from its JSON; a run saved before --streams has `single` and `multi` (16 streams)."""
    saved = dict(saved)
    rows = {int(n): Row(**row) for n, row in saved.pop("rows", {}).items()}
    for key, streams in (("single", 1), ("multi", 16)):
        if row := saved.pop(key, None):
            rows[streams] = Row(**row)
    return Outcome(**saved, rows=rows)


def bound_tok_s(bandwidth_gbs: float, bytes_per_step: int) -> float:
    """One stream's tokens/s if a decode step took only the time to read its weights once."""
    return bandwidth_gbs * 1e9 / bytes_per_step if bytes_per_step else float("nan")


def table(results: FormatResults) -> str:
    disturbed_above = results.settings.get("disturbed_above", float("inf"))
    many = [n for n in results.streams if n > 1]

    def tok_s(row: Row | None) -> str:
        if row is None:
            return "-"
        return spread(row.repeats) + (" (disturbed)" if row.other_cpu > disturbed_above else "")

    lines = [
        "| model | system | weights | server flags | MiB read per step | 1 stream tok/s | bound tok/s "
        "| of bound |" + "".join(f" {n} streams tok/s |" for n in many) + " RSS MiB |",
        "|---|---|---|---|---:|---:|---:|---:|" + "---:|" * len(many) + "---:|",
    ]
    for o in results.outcomes:
        bound = bound_tok_s(results.bandwidth_gbs, o.bytes_per_step)
        single = o.tok_s(1)
        share = f"{single / bound:.0%}" if single and bound == bound else "-"
        mib = f"{o.bytes_per_step / MIB:,.0f}" if o.bytes_per_step else "-"
        rss = f"{o.rss_mib:,.0f}" if o.rss_mib else "-"
        cells = [tok_s(o.rows.get(n)) for n in (1, *many)]
        if o.error:  # in the first cell it left empty
            empty = next((i for i, cell in enumerate(cells) if cell == "-"), len(cells) - 1)
            cells[empty] = f"failed: {_cell(o.error)}"
        bound_cell = f"{bound:.1f}" if bound == bound else "-"
        lines.append(
            f"| {o.model} | {o.system} | {o.weights} | `{o.command}` | {mib} | {cells[0]} "
            f"| {bound_cell} | {share} |" + "".join(f" {c} |" for c in cells[1:]) + f" {rss} |"
        )
    return "\n".join(lines)


def targets_table(results: FormatResults) -> str:
    """Issue 26's ratios, each braid default's figure over what it is set against: met, missed, or
    not measured (its model, stream count or configuration was not in the run, or failed), and
    (disturbed) where a figure it rests on is."""
    disturbed_above = results.settings.get("disturbed_above", float("inf"))
    lines = [
        "| model | streams | braid default tok/s | against | their tok/s | ratio | target | met |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for target in TARGETS:
        if target.model not in {o.model for o in results.outcomes}:
            continue
        ours, theirs, against, rows = _target_figures(results, target)
        ratio = ours / theirs if ours and theirs else None
        if ratio is None:
            shown, met = "-", "not measured"
        elif target.against == BOUND:
            shown, met = f"{ratio:.0%}", "yes" if ratio >= target.at_least else "**no**"
        else:
            passed = ratio > target.at_least if target.strict else ratio >= target.at_least
            shown, met = f"{ratio:.2f}x", "yes" if passed else "**no**"
        if ratio is not None and any(row.other_cpu > disturbed_above for row in rows):
            met += " (disturbed)"
        wanted = (
            f"≥ {target.at_least:.0%}"
            if target.against == BOUND
            else f"{'>' if target.strict else '≥'} {target.at_least:g}x"
        )
        lines.append(
            f"| {target.model} | {target.streams} | {_figure(ours)} | {against} | {_figure(theirs)} "
            f"| {shown} | {wanted} | {met} |"
        )
    return "\n".join(lines)


def _target_figures(results: FormatResults, target: Target) -> tuple[float | None, float | None, str, list[Row]]:
    """braid default's tok/s, the figure it is set against, what that figure is, and the rows both
    came from (the rows of every llama.cpp format, for its fastest)."""
    mine = [o for o in results.outcomes if o.model == target.model]
    default = next((o for o in mine if o.role == DEFAULT), None)
    ours = default.tok_s(target.streams) if default else None
    rows = [default.rows[target.streams]] if ours else []
    if target.against == BOUND:
        bound = bound_tok_s(results.bandwidth_gbs, default.bytes_per_step) if default else None
        return ours, bound if bound == bound else None, BOUND, rows
    if target.against == BEST_LLAMA:
        llama = [o for o in mine if o.system == "llama.cpp"]
        measured = [(o.tok_s(target.streams), o) for o in llama if o.tok_s(target.streams)]
        if not measured:
            return ours, None, BEST_LLAMA, rows
        best, o = max(measured, key=lambda m: m[0])
        missing = len(llama) - len(measured)  # a fastest of fewer formats is said to be so
        label = f"llama.cpp {o.weights} (its fastest" + (
            f"; {missing} of its {len(llama)} formats not measured)" if missing else ")"
        )
        return ours, best, label, rows + [m.rows[target.streams] for _, m in measured]
    other = next((o for o in mine if o.role == target.against), None)
    if other is None or not other.tok_s(target.streams):
        return ours, None, other and f"{other.system} {other.weights}" or target.against, rows
    return ours, other.tok_s(target.streams), f"{other.system} {other.weights}", rows + [other.rows[target.streams]]


def _figure(value: float | None) -> str:
    return f"{value:.1f}" if value else "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: FormatResults) -> str:
    s = results.settings
    threads = results.machine.get("threads")
    machine = {
        **results.machine,
        "read bandwidth": f"{results.bandwidth_gbs:.1f} GB/s ({threads} threads, "
        "numpy sum over 512 MiB, best of 5 at the start and 5 at the end)",
    }
    notes = "\n".join(f"- {n}" for n in results.notes)
    many = ", ".join(str(n) for n in results.streams if n > 1) or "(none)"
    return f"""{FORMATS_HEADING}

> One run on {results.started} (braid commit `{results.machine.get("braid_commit")}`), every
> configuration on the same machine in the same run{QUICK if s.get("quick") else ""}.

    {results.command}

Output tokens/s from the client side, greedy, `ignore_eos`, bench.py's prompts (fixed seed, exact
token lengths): **1 stream**, one ~40-token prompt, {s["single_new_tokens"]} new tokens; **{many} streams**,
as many prompts of 30-60 tokens sent at once, {s["multi_new_tokens"]} new tokens each, the
wall time counting their prefill. Median of {s["repeats"]} run(s), with the range; a run during
which other processes used over {s["disturbed_above"]} cores is run once more, and a figure made only
of such runs is marked (disturbed). braid runs in continuous mode over gRPC
(`--max-batch-size {s["braid_max_batch_size"]} --threads {threads}`);
llama.cpp is `llama-server --parallel {s.get("llama_parallel", 16)} -t {threads}` (a slot for each stream of
the most at once, each its own KV cache). One server of each configuration measures every stream count.

**MiB read per step** sums the weight tensors of the served format (from the GGUF's tensor sizes, or
the safetensors headers; braid's `--quantization q8_0` counts as llama.cpp's Q8_0 GGUF of the same
model, braid's fp32 as its fp32 folder): the tied embedding counts once, as the output projection.
**bound tok/s** = read bandwidth ÷ that: what one stream could reach if a decode step did nothing
but read its weights once. **RSS** is the server's VmRSS after a warm-up of
{s.get("warm_up_requests", 16)} short requests at once (llama.cpp maps its GGUF, so its RSS counts the file
pages it touched).

SmolLM2-135M-Instruct is the embedded GGUF (Q4_1 with a Q8_0 embedding), braid's fp32 folder of it,
that folder saved in bf16, and llama.cpp's F32 GGUF of that folder (`convert_hf_to_gguf.py`)
quantized by `llama-quantize` to Q8_0 and BF16: the same weights, rounded to each format. The 1B model
has Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied
embeddings, rope theta 500000) but SmolLM2's tokenizer, so a 49152-token vocabulary instead of
128256 (no 128k tokenizer can be had offline) and no llama3 rope scaling: 1.07 B parameters,
random (seed {s["seed"]}), saved in bf16, converted to a BF16 GGUF and quantized to Q8_0, and to
Q4_0 with its tied embedding in Q8_0 (`--token-embedding-type q8_0 --output-tensor-type q8_0`;
llama-quantize's default there is Q6_K), as the embedded SmolLM2 GGUF has it.

{table(results)}

Issue 26's ratios from this run: braid's default (the model's own GGUF file, `--dtype auto
--quantization auto`) over llama.cpp's fastest format at that stream count, over llama.cpp on the same
file, over braid's fp32 path, and its 1-stream figure as a share of the bound:

{targets_table(results)}

{machine_table(machine)}
{notes}
"""

"""The run's results: saved as JSON, printed as markdown tables, written to docs/benchmarks.md with
the ratios issue 3 asks for, and plotted to docs/benchmarks.png."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from metrics import Row, spread

MODES = ("sequential", "interleaved", "batched", "continuous")
HF_SEQUENTIAL = "HF generate, one at a time"
HF_STATIC = "HF generate, static batch"
HF_CONTINUOUS = "HF generate_batch"
LLAMA_CPP = "llama.cpp server"
TARGETS = "targets"


# Each benchmark that writes docs/benchmarks.md owns one `## ` section of it, found by its heading and
# replaced in place (with_section); the page's other sections are written by hand.
BENCH_HEADING = "## Scheduling modes against transformers and llama.cpp (make bench)"  # bench.py's section
FORMATS_HEADING = "## Weight formats against llama.cpp (make bench-formats)"  # benchmarks/formats.py's
PREFIX_HEADING = "## Prefix sharing and the paged KV cache (make bench-prefix)"  # benchmarks/prefix.py's
GPU_CHECK_HEADING = "## CUDA (make gpu-check)"  # benchmarks/gpu_check.py's section
SIZES_HEADING = "## Model sizes against llama.cpp (make bench-sizes)"  # benchmarks/sizes.py's


def braid(mode: str) -> str:
    return f"braid {mode}"


def section(text: str, heading: str) -> str:
    """The markdown section that starts at the line `heading`, up to the next `## ` heading; "" if none."""
    lines = text.splitlines()
    start, end = _section_span(lines, heading)
    return "\n".join(lines[start:end]).rstrip("\n") + "\n" if start is not None else ""


def headings(text: str) -> list[str]:
    """The page's `## ` headings, in order."""
    return [line.rstrip() for line in text.splitlines() if line.startswith("## ")]


def with_others_kept(new: str, old: str) -> str:
    """`new` (a page of sections) with every section of `old` it does not have kept as it was: those
    other benchmarks write, and those written by hand."""
    for heading in headings(old):
        if heading not in headings(new):
            new = with_section(new, heading, section(old, heading))
    return new


def write_section(path: Path, heading: str, body: str) -> None:
    """Writes `body` as the section `heading` of the file at path (with_section), the rest kept."""
    old = path.read_text() if path.is_file() else ""
    path.write_text(with_section(old, heading, body))


def with_section(text: str, heading: str, body: str) -> str:
    """`text` with its section `heading` replaced by `body` (which starts with the heading), or with
    `body` appended at the end when it has no such section."""
    lines = text.splitlines()
    start, end = _section_span(lines, heading)
    if start is None:
        start = end = len(lines)
    before, after = "\n".join(lines[:start]).rstrip("\n"), "\n".join(lines[end:]).strip("\n")
    return "\n\n".join(part for part in (before, body.strip("\n"), after) if part) + "\n"


def _section_span(lines: list[str], heading: str) -> tuple[int | None, int]:
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        return None, len(lines)
    return start, next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))


@dataclass
class Results:
    machine: dict
    settings: dict
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    titles: dict[str, str] = field(default_factory=dict)  # workload name -> its title
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M %Z"))

    def find(self, system: str, workload: str) -> Row | None:
        return next((r for r in self.rows if r.system == system and r.workload == workload), None)

    def add(self, row: Row) -> None:
        """Adds a row, replacing an earlier one of the same system and workload."""
        self.rows = [r for r in self.rows if (r.system, r.workload) != (row.system, row.workload)]
        self.rows.append(row)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Results:
        data = json.loads(path.read_text())
        data["rows"] = [Row(**r) for r in data["rows"]]
        return cls(**data)

    def merge(self, other: Results) -> None:
        """`other`'s rows replace this run's rows of the same system and workload."""
        for row in other.rows:
            self.add(row)
        self.titles |= other.titles
        self.notes += [n for n in other.notes if n not in self.notes]


# ---------------------------------------------------------------- tables


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def workload_table(results: Results, workload: str) -> str:
    rows = [r for r in results.rows if r.workload == workload]
    if not rows:
        return ""
    lines = [
        "| system | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| wall s | other CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    disturbed_above = results.settings.get("disturbed_above", math.inf)
    for r in rows:
        other = f"{r.other_cpu:.2f}" + (" (disturbed)" if r.other_cpu > disturbed_above else "")
        lines.append(
            f"| {r.system} | {spread(r.repeats)} | {r.requests_per_s:.2f} | {_ms(r.ttft_p50_ms)} "
            f"| {_ms(r.ttft_p99_ms)} | {_ms(r.tpot_p50_ms)} | {_ms(r.tpot_p99_ms)} | {r.wall_s:.1f} "
            f"| {other} |"
        )
    return "\n".join(lines)


def sweep_levels(results: Results) -> list[int]:
    return sorted({r.concurrency for r in results.rows if r.workload.startswith("sweep-")})


def sweep_table(results: Results, metric: str = "tokens_per_s", digits: int = 1) -> str:
    levels = sweep_levels(results)
    systems = list(dict.fromkeys(r.system for r in results.rows if r.workload.startswith("sweep-")))
    if not levels:
        return ""
    lines = ["| system \\ streams | " + " | ".join(str(n) for n in levels) + " |", "|---|" + "---:|" * len(levels)]
    for system in systems:
        cells = []
        for n in levels:
            row = results.find(system, f"sweep-{n}")
            cells.append(f"{getattr(row, metric):,.{digits}f}" if row else "-")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_MACHINE_LABELS = {
    "cpu_model": "CPU",
    "cores": "cores",
    "memory_gb": "memory (GB)",
    "os": "OS",
    "threads": "threads per system",
    "python": "Python",
    "torch": "torch",
    "transformers": "transformers",
    "grpcio": "grpcio",
    "braid_commit": "braid commit",
    "llama_cpp": "llama.cpp build",
    "vector_isa": "vector ISA",
}


def machine_table(machine: dict) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {_MACHINE_LABELS.get(key, key)} | {value} |" for key, value in machine.items()]
    return "\n".join(lines)


# ---------------------------------------------------------------- ratios and targets


@dataclass
class Ratio:
    label: str
    value: float | None
    target: str = ""
    met: bool | None = None


def _ratio(
    results: Results,
    label: str,
    num: tuple[str, str],
    den: tuple[str, str],
    metric: str = "tokens_per_s",
    target: float | None = None,
    below: bool = False,
) -> Ratio:
    a, b = results.find(*num), results.find(*den)
    if a is None or b is None or not getattr(b, metric):
        return Ratio(label, None)
    value = getattr(a, metric) / getattr(b, metric)
    if target is None:
        return Ratio(label, value)
    return Ratio(label, value, f"{'<' if below else '≥'} {target:g}", value < target if below else value >= target)


def ratios(results: Results) -> list[Ratio]:
    t = TARGETS
    count = results.settings.get("count", 16)
    return [
        _ratio(results, "continuous ÷ HF static batch, tok/s", (braid("continuous"), t), (HF_STATIC, t), target=2),
        _ratio(results, "continuous ÷ llama.cpp server, tok/s", (braid("continuous"), t), (LLAMA_CPP, t), target=1),
        _ratio(results, "continuous ÷ HF generate_batch, tok/s", (braid("continuous"), t), (HF_CONTINUOUS, t)),
        _ratio(results, "batched ÷ sequential, tok/s", (braid("batched"), t), (braid("sequential"), t), target=5),
        _ratio(results, "continuous ÷ sequential, tok/s", (braid("continuous"), t), (braid("sequential"), t)),
        _ratio(
            results, "interleaved ÷ sequential, tok/s", (braid("interleaved"), t), (braid("sequential"), t), target=0.9
        ),
        _ratio(
            results,
            f"interleaved ÷ sequential, TTFT of the last of {count}",
            (braid("interleaved"), t),
            (braid("sequential"), t),
            metric="ttft_max_ms",
            target=0.1,
            below=True,
        ),
    ]


def absolute_targets(results: Results) -> list[Ratio]:
    single = results.find(braid("sequential"), "single")
    continuous = results.find(braid("continuous"), TARGETS)
    return [
        Ratio(
            "sequential, one stream, tok/s",
            single and single.tokens_per_s,
            "≥ 35",
            single and single.tokens_per_s >= 35,
        ),
        Ratio(
            f"continuous, {results.settings.get('count', 16)} streams, tok/s",
            continuous and continuous.tokens_per_s,
            "≥ 250",
            continuous and continuous.tokens_per_s >= 250,
        ),
    ]


def ratio_table(items: list[Ratio], issue: int = 3) -> str:
    lines = [f"| | measured | issue {issue} target | met |", "|---|---:|---|---|"]
    for r in items:
        value = "not measured" if r.value is None else f"{r.value:.2f}"
        met = "" if r.met is None or r.value is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.label} | {value} | {r.target} | {met} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the whole report


def tables(results: Results) -> str:
    parts = []
    for name, title in results.titles.items():
        if not name.startswith("sweep-") and (table := workload_table(results, name)):
            parts.append(f"### {title}\n\n{table}")
    if sweep := sweep_table(results):
        parts.append("### Concurrency sweep (closed loop), output tok/s\n\n" + sweep)
        parts.append("### Concurrency sweep, TTFT p50 ms\n\n" + sweep_table(results, "ttft_p50_ms", 0))
        parts.append("### Concurrency sweep, TPOT p50 ms\n\n" + sweep_table(results, "tpot_p50_ms", 1))
    return "\n\n".join(parts)


def markdown(results: Results, plot_name: str | None) -> str:
    s = results.settings
    plot = f"![throughput against concurrency]({plot_name})\n\n" if plot_name else ""
    notes = "".join(f"- {n}\n" for n in results.notes)
    return f"""{BENCH_HEADING}

> One run on {results.started} (braid commit `{results.machine.get("braid_commit")}`), every system
> on the same machine in the same run. A shared VM's speed drifts (on the 2-core VM of issue 3, by
> about 20% over tens of minutes): compare the rows of one run, not figures from different runs.

Every figure is measured from the client side: braid over gRPC (its Python `AsyncClient`, asyncio,
one stream per request), llama.cpp over HTTP (streamed `/completion`), Hugging Face transformers
in-process (their best case: no server, no network). Same model folder (SmolLM2-135M-Instruct, the
embedded GGUF dequantised to fp32), same prompts (built from a fixed seed, exact token lengths),
greedy, `ignore_eos`, {s.get("new_tokens")} new tokens per request, every count checked.

### Reproduce

    make bench                                  # everything (installs the `bench` extra)
    make bench BENCH_ARGS="--quick"             # a short run
    .venv/bin/python benchmarks/bench.py --modes continuous --workloads targets --skip-peers

`--help` lists the options: `--modes`, `--workloads`, `--skip-peers`, `--skip-llama-cpp`,
`--repeats`, `--threads`, `--sweep-level-budget` (sweep levels estimated to take longer are
skipped, and said so below), `--report-from` (rewrite this section from saved results, which every
run keeps in `~/.cache/braid/bench/`). llama.cpp is built on first use (about 5 minutes on 2 idle
cores) into `~/.cache/braid/llama.cpp/`; nothing of it is in the repo. A full run takes about
35-40 minutes on this machine at braid's current speed.

### Machine

{machine_table(results.machine)}

Settings: {", ".join(f"{k} {v}" for k, v in s.items())}.

### Targets: one stream, 16 streams, batches

The targets workload is {s.get("count", 16)} requests of 30-60 prompt tokens sent at once.

{ratio_table(absolute_targets(results) + ratios(results))}

### gRPC overhead

This harness measures every system from its client only. What gRPC costs braid is measured apart,
by `benchmarks/grpc_overhead.py`: the same workload through the engine in-process (its model loop
on the main thread, as in the server) and through `braid serve`, alternated, medians:

    .venv/bin/python benchmarks/grpc_overhead.py --mode continuous --workload targets --repeats 5
    .venv/bin/python benchmarks/grpc_overhead.py --mode sequential --workload single --repeats 5

### Results

{plot}Output tok/s is all generated tokens over the wall time (first request sent to last token
received); with repeats it is the median, with the range in brackets, and the other columns are
from the median repeat. TTFT is from sending a request to its first token; TPOT is
(last token − first token) / (tokens − 1) per stream. "other CPU" is how many cores other
processes on the machine used meanwhile (the runs share 2 cores with whoever else is working);
a run with more than {s.get("disturbed_above", 0.3)} is repeated.

{tables(results)}

### Notes

{notes}- The client (this benchmark's Python process) runs on the same 2 cores as the server it drives,
  as does llama.cpp's HTTP client; the in-process HF peers have no client to pay for.
- llama.cpp gets the prompts as token ids (so its prompt lengths are exactly braid's) and
  `cache_prompt: false`, and braid a fresh `cache_salt` per request: the workloads repeat their prompts,
  which would otherwise hit either prefix cache. Prefix sharing is measured on its own below.
- The HF peers force exact counts with `min_new_tokens = max_new_tokens` (`generate`) and
  `eos_token_id = -1` (`generate_batch`); all requests of a peer arrive at the start, so
  one-at-a-time's TTFT includes the wait for the requests before it.
"""


def plot(results: Results, path: Path) -> bool:
    """Throughput and TTFT against concurrency per system, HF peers as horizontal lines; False
    without matplotlib or sweep results."""
    levels = sweep_levels(results)
    if not levels:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    systems = list(dict.fromkeys(r.system for r in results.rows if r.workload.startswith("sweep-")))
    colours = {braid(m): f"C{i}" for i, m in enumerate(MODES)} | {LLAMA_CPP: "C4"}
    for system in systems:
        points = [(n, row) for n in levels if (row := results.find(system, f"sweep-{n}"))]
        style = dict(
            linestyle="--" if system == LLAMA_CPP else "-", marker="o", label=system, color=colours.get(system)
        )
        tput.plot([n for n, _ in points], [r.tokens_per_s for _, r in points], **style)
        ttft.plot([n for n, _ in points], [r.ttft_p50_ms for _, r in points], **style)
    for peer, colour in ((HF_STATIC, "grey"), (HF_CONTINUOUS, "tab:brown"), (HF_SEQUENTIAL, "black")):
        if row := results.find(peer, TARGETS):
            tput.axhline(row.tokens_per_s, color=colour, linestyle=":", label=f"{peer} ({row.num_requests} at once)")
    for axis, label in ((tput, "output tokens/s"), (ttft, "TTFT p50 (ms, log)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(n) for n in levels])
        axis.set_xlabel("concurrent streams (closed loop)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    ttft.set_yscale("log")
    tput.legend(fontsize=7)
    fig.suptitle(
        f"SmolLM2-135M fp32, {results.machine.get('cores')} CPU cores, {results.settings.get('new_tokens')} "
        f"new tokens per request (braid {results.machine.get('braid_commit')}, {results.started})",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

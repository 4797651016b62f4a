"""The weight-format benchmark's results: one Outcome per configuration, saved as JSON, written as the
"Weight formats (issue 12)" section of docs/benchmarks.md."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from metrics import Row, spread
from report import FORMATS_HEADING, machine_table

MIB = 2**20
QUICK = " (a quick run: fewer tokens, one repeat)"


@dataclass
class Outcome:
    """One server configuration: what it read per decode step, what it held, what it did."""

    model: str
    system: str  # "braid" or "llama.cpp"
    weights: str  # the format as the table shows it
    command: str  # the server's flags that choose the model file and its format
    bytes_per_step: int = 0
    rss_mib: float | None = None
    single: Row | None = None
    multi: Row | None = None
    error: str | None = None


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
        data["outcomes"] = [Outcome(**{**o, "single": o["single"] and Row(**o["single"]),
                                       "multi": o["multi"] and Row(**o["multi"])}) for o in data["outcomes"]]
        return cls(**data)


def bound_tok_s(bandwidth_gbs: float, bytes_per_step: int) -> float:
    """One stream's tokens/s if a decode step took only the time to read its weights once."""
    return bandwidth_gbs * 1e9 / bytes_per_step if bytes_per_step else float("nan")


def table(results: FormatResults) -> str:
    disturbed_above = results.settings.get("disturbed_above", float("inf"))

    def tok_s(row: Row | None) -> str:
        if row is None:
            return "-"
        return spread(row.repeats) + (" (disturbed)" if row.other_cpu > disturbed_above else "")

    lines = ["| model | system | weights | server flags | MiB read per step | 1 stream tok/s | bound tok/s "
             "| of bound | 16 streams tok/s | RSS MiB |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for o in results.outcomes:
        bound = bound_tok_s(results.bandwidth_gbs, o.bytes_per_step)
        share = f"{o.single.tokens_per_s / bound:.0%}" if o.single and bound == bound else "-"
        mib = f"{o.bytes_per_step / MIB:,.0f}" if o.bytes_per_step else "-"
        rss = f"{o.rss_mib:,.0f}" if o.rss_mib else "-"
        single, multi = tok_s(o.single), tok_s(o.multi)
        if o.error:  # in the first cell it left empty
            failed = f"failed: {_cell(o.error)}"
            single, multi = (single, failed) if o.single else (failed, multi)
        bound_cell = f"{bound:.1f}" if bound == bound else "-"
        lines.append(f"| {o.model} | {o.system} | {o.weights} | `{o.command}` | {mib} | {single} "
                     f"| {bound_cell} | {share} | {multi} | {rss} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: FormatResults) -> str:
    s = results.settings
    threads = results.machine.get("threads")
    machine = {**results.machine, "read bandwidth": f"{results.bandwidth_gbs:.1f} GB/s ({threads} threads, "
               "numpy sum over 512 MiB, best of 5 at the start and 5 at the end)"}
    notes = "\n".join(f"- {n}" for n in results.notes)
    return f"""{FORMATS_HEADING}

> One run on {results.started} (braid commit `{results.machine.get('braid_commit')}`), every
> configuration on the same machine in the same run{QUICK if s.get('quick') else ''}.

    {results.command}

Output tokens/s from the client side, greedy, `ignore_eos`, bench.py's prompts (fixed seed, exact
token lengths): **1 stream**, one ~40-token prompt, {s['single_new_tokens']} new tokens; **16
streams**, 16 prompts of 30-60 tokens sent at once, {s['multi_new_tokens']} new tokens each, the
wall time counting their prefill. Median of {s['repeats']} run(s), with the range; a run during
which other processes used over {s['disturbed_above']} cores is run once more, and a figure made only
of such runs is marked (disturbed). braid runs in continuous mode over gRPC
(`--max-batch-size {s['braid_max_batch_size']} --threads {threads}`);
llama.cpp is `llama-server --parallel 16 -t {threads}`.

**MiB read per step** sums the weight tensors of the served format (from the GGUF's tensor sizes, or
the safetensors headers; braid's `--quantization q8_0` counts as llama.cpp's Q8_0 GGUF of the same
model, braid's fp32 as its fp32 folder): the tied embedding counts once, as the output projection.
**bound tok/s** = read bandwidth ÷ that: what one stream could reach if a decode step did nothing
but read its weights once. **RSS** is the server's VmRSS after a warm-up of 16 short requests
(llama.cpp maps its GGUF, so its RSS counts the file pages it touched).

SmolLM2-135M-Instruct is the embedded GGUF (Q4_1 with a Q8_0 embedding), braid's fp32 folder of it,
that folder saved in bf16, and llama.cpp's F32 GGUF of that folder (`convert_hf_to_gguf.py`)
quantized by `llama-quantize` to Q8_0 and BF16: the same weights, rounded to each format. The 1B model
has Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied
embeddings, rope theta 500000) but SmolLM2's tokenizer, so a 49152-token vocabulary instead of
128256 (no 128k tokenizer can be had offline) and no llama3 rope scaling: 1.07 B parameters,
random (seed {s['seed']}), saved in bf16, converted to a BF16 GGUF and quantized to Q8_0, and to
Q4_0 with its tied embedding in Q8_0 (`--token-embedding-type q8_0 --output-tensor-type q8_0`;
llama-quantize's default there is Q6_K), as the embedded SmolLM2 GGUF has it.

{table(results)}

{machine_table(machine)}
{notes}
"""

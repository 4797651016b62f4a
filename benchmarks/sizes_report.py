"""The real-shapes benchmark's results (sizes.py): one SizeOutcome per server configuration and one
Quality per file and system, saved as JSON, written as the SIZES_HEADING section of docs/benchmarks.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from formats_report import MIB, QUICK, FormatResults, Outcome, _cell, bound_tok_s
from metrics import Row, spread
from report import SIZES_HEADING, machine_table


@dataclass
class Prefill:
    """One prompt length: alone, and while the loaded streams decode."""

    prompt_tokens: int
    ttft_s: float | None = None  # alone
    loaded_ttft_s: float | None = None  # another prompt of that length, while the streams decode
    loaded_tpot_ms: float | None = None  # the median stream's time per token over that prefill
    loaded_stall_ms: float | None = None  # the longest gap between two tokens of a stream in it
    streams_ended: int = 0  # streams that had run out of new tokens before the prefill ended


@dataclass
class SizeOutcome(Outcome):
    model_key: str = ""
    file_types: str = ""  # the GGUF's tensor types, most bytes first
    streams: list[int] = field(default_factory=list)
    peak_rss_mib: float | None = None  # VmHWM at the end: the most it held
    kv_dtype: str = ""
    kv_tokens: int | None = None  # tokens of KV cache the server holds
    kv_bytes_per_token: float | None = None
    prefill: list[Prefill] = field(default_factory=list)


@dataclass
class Quality:
    model: str
    system: str
    weights: str
    kld: float | None = None
    same_top: float | None = None
    positions: int = 0
    error: str | None = None


@dataclass
class SizeResults(FormatResults):
    outcomes: list[SizeOutcome] = field(default_factory=list)
    quality: list[Quality] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> SizeResults:
        data = json.loads(path.read_text())
        data["outcomes"] = [_outcome(o) for o in data["outcomes"]]
        data["quality"] = [Quality(**q) for q in data["quality"]]
        return cls(**data)

    @classmethod
    def merge(cls, runs: list[SizeResults]) -> SizeResults:
        """Several runs as one section (the 1B shape's quick run and the 8B's, say): the first run's
        machine and settings, every run's rows, its command, start and bandwidth in the notes."""
        first = runs[0]
        merged = cls(first.machine, first.settings, first.command, first.bandwidth_gbs, started=first.started)
        for run in runs:
            merged.outcomes += run.outcomes
            merged.quality += run.quality
            merged.notes += run.notes
        if len(runs) > 1:
            merged.command = "\n    ".join(run.command for run in runs)
            merged.notes.append(
                "Runs: "
                + "; ".join(f"{run.started}, read bandwidth {run.bandwidth_gbs:.1f} GB/s" for run in runs)
                + " (each row's share of the bound uses its own run's bandwidth)."
            )
            for run in runs:
                for outcome in run.outcomes:
                    outcome.bandwidth_gbs = run.bandwidth_gbs
        return merged


def _outcome(saved: dict) -> SizeOutcome:
    saved = dict(saved)
    rows = {int(n): Row(**row) for n, row in saved.pop("rows", {}).items()}
    prefill = [Prefill(**p) for p in saved.pop("prefill", [])]
    return SizeOutcome(**saved, rows=rows, prefill=prefill)


def _s(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None and value == value else "-"


def _failed(o) -> str:
    return f"failed: {_cell(o.error)}" if o.error and not o.error.startswith("not run") else _cell(o.error or "")


def decode_table(results: SizeResults) -> str:
    counts = sorted({n for o in results.outcomes for n in o.streams} | {1})
    many = [n for n in counts if n > 1]
    disturbed_above = results.settings.get("disturbed_above", math.inf)
    lines = [
        "| model | weights (tensor types) | system | MiB read per token | 1 stream tok/s | bound tok/s | of bound |"
        + "".join(f" {n} streams tok/s |" for n in many),
        "|---|---|---|---:|---:|---:|---:|" + "---:|" * len(many),
    ]
    for o in results.outcomes:
        bound = bound_tok_s(getattr(o, "bandwidth_gbs", results.bandwidth_gbs), o.bytes_per_step)
        single = o.tok_s(1)
        share = f"{single / bound:.0%}" if single and bound == bound else "-"

        def cell(n: int) -> str:
            row = o.rows.get(n)
            if row is None:
                return "-" if n in o.streams or not o.streams else "not run"
            return spread(row.repeats) + (" (disturbed)" if row.other_cpu > disturbed_above else "")

        cells = [cell(n) for n in counts]
        if o.error:
            cells[0] = _failed(o)
        mib = f"{o.bytes_per_step / MIB:,.0f}" if o.bytes_per_step else "-"
        lines.append(
            f"| {o.model} | {o.weights} ({o.file_types or '?'}) | {o.system} | {mib} | {cells[0]} "
            f"| {_s(bound, 1)} | {share} |" + "".join(f" {c} |" for c in cells[1:])
        )
    return "\n".join(lines)


def prefill_table(results: SizeResults) -> str:
    loaded = results.settings.get("loaded_streams", 8)
    lines = [
        f"| model | weights | system | prompt tokens | TTFT alone s | prompt tok/s alone | TTFT with {loaded} "
        f"decoding s | prompt tok/s | their TPOT meanwhile ms | their longest gap ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in results.outcomes:
        if o.error and not o.prefill:
            continue
        for p in o.prefill:
            alone = p.prompt_tokens / p.ttft_s if p.ttft_s else None
            with_load = p.prompt_tokens / p.loaded_ttft_s if p.loaded_ttft_s else None
            ended = f" ({p.streams_ended} had ended)" if p.streams_ended else ""
            lines.append(
                f"| {o.model} | {o.weights} | {o.system} | {p.prompt_tokens:,} | {_s(p.ttft_s)} | {_s(alone, 0)} "
                f"| {_s(p.loaded_ttft_s)} | {_s(with_load, 0)} | {_s(p.loaded_tpot_ms, 0)}{ended} "
                f"| {_s(p.loaded_stall_ms, 0)} |"
            )
    return "\n".join(lines)


def memory_table(results: SizeResults) -> str:
    lines = [
        "| model | weights | system | server flags | RSS after warm-up MiB | peak RSS MiB | KV dtype | KV tokens "
        "| KV bytes a token |",
        "|---|---|---|---|---:|---:|---|---:|---:|",
    ]
    for o in results.outcomes:
        if o.error and not o.rss_mib:
            continue
        lines.append(
            f"| {o.model} | {o.weights} | {o.system} | `{o.command}` | {_s(o.rss_mib, 0)} | {_s(o.peak_rss_mib, 0)} "
            f"| {o.kv_dtype or '-'} | {o.kv_tokens or '-'} | {_s(o.kv_bytes_per_token, 0)} |"
        )
    return "\n".join(lines)


def quality_table(results: SizeResults) -> str:
    lines = [
        "| model | weights | braid default: mean KLD | same top | llama.cpp: mean KLD | same top |",
        "|---|---|---:|---:|---:|---:|",
    ]
    keys = list(dict.fromkeys((q.model, q.weights) for q in results.quality))
    for model, weights in keys:
        cells = []
        for system in ("braid", "llama.cpp"):
            q = next((q for q in results.quality if (q.model, q.weights, q.system) == (model, weights, system)), None)
            if q is None:
                cells += ["-", "-"]
            elif q.error:
                cells += [_cell(q.error), "-"]
            else:
                cells += [f"{q.kld:.4f}", f"{q.same_top:.1%}"]
        lines.append(f"| {model} | {weights} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: SizeResults) -> str:
    parts = [decode_table(results), prefill_table(results), memory_table(results)]
    if results.quality:
        parts.append(quality_table(results))
    return "\n\n".join(parts)


def _who(results: SizeResults) -> str:
    systems = {o.system for o in results.outcomes}
    return "braid and llama.cpp on the same files" if len(systems) > 1 else f"{', '.join(sorted(systems))} alone"


def _kv_dtype(settings: dict) -> str:
    chosen = settings.get("braid_kv_dtype", "auto")
    return "its default KV dtype" if chosen == "auto" else f"`--kv-cache-dtype {chosen}`"


def markdown(results: SizeResults) -> str:
    s = results.settings
    threads = results.machine.get("threads")
    machine = {
        **results.machine,
        "read bandwidth": f"{results.bandwidth_gbs:.1f} GB/s ({threads} threads, numpy sum over 512 MiB, "
        "best of 5 at the start and 5 at the end)",
    }
    notes = "\n".join(f"- {n}" for n in results.notes)
    prompts = ", ".join(f"{n:,}" for n in s.get("prompts", [])) or "(none: --skip-prefill)"
    quality = (
        f"""
### Quality

Mean KL divergence and same-top-token rate over `{s["quality_text"]}` in chunks of {s["quality_chunk"]}
tokens, each scoring its second half, as `llama-perplexity --kl-divergence -c {s["quality_chunk"]}` does.
**braid default**: the GGUF file served by braid's defaults (`--dtype auto --quantization auto
--activations auto`) against float32 rows on the bf16 checkpoint (`--dtype float32 --quantization none
--activations float32`), in process (`ModelRunner`, as the server builds it). **llama.cpp**: its
`llama-perplexity --kl-divergence` of the same file against its F32 GGUF's logits. Both references
hold the same weights (the bf16 checkpoint's values); the two columns tokenize and chunk the text each
their own way, so compare each column down its formats more than across.

**On random weights these figures say little about a real model's quality**: a random model's
next-token distributions are nearly flat, so small roundings can move the top token and KL divergence
is tiny in absolute terms. What they do show is whether each server computes each format faithfully
(a broken kernel or a misread block shows as a KLD orders of magnitude above its neighbours), and how
the formats rank against each other on the same weights.

{quality_table(results)}
"""
        if results.quality
        else ""
    )
    return f"""{SIZES_HEADING}

> {results.started} (braid commit `{results.machine.get("braid_commit")}`), {_who(results)} on the
> same machine in the same run{QUICK if s.get("quick") else ""}.

    {results.command}

**The weights are random** (seed {s["seed"]}, normal with deviation 0.02, norms 1), in the exact
shapes of the models named (hidden size, layers, heads, KV heads, head size, intermediate size,
tied or untied embeddings), with SmolLM2's tokenizer: a 49,152-token vocabulary instead of Llama's
128,256 (no 128k tokenizer can be had offline; the embedding and head are then smaller, 0.1-0.4 GB
in bf16), and no llama3 rope scaling. Speed depends on shapes, not on values, so the speed figures
hold for the real models less their larger vocabulary; each checkpoint is written in bf16 and made
into GGUF by llama.cpp's `convert_hf_to_gguf.py` (BF16) and `llama-quantize` (Q4_K_M, Q4_0, Q8_0, its
own choice of type for every tensor, so the table names the types each file holds).

**Decode**: output tokens/s from the client side, greedy, `ignore_eos`: 1 stream, a ~40-token prompt,
{s["single_new_tokens"]} new tokens; N streams, N prompts of 30-60 tokens at once, {s["multi_new_tokens"]}
new tokens each, the wall time counting their prefill. Median of {s["repeats"]} run(s) with the range.
**bound tok/s** = read bandwidth ÷ the weights a token reads (every tensor; a tied embedding once,
as the head): what one stream could reach if a step did nothing but read its weights once.

**Prefill**: prompts of {prompts} tokens, each its own (nothing cached: braid's every request has
its own `cache_salt` and `--prefix-caching off`, llama.cpp `cache_prompt: false` and `--cache-ram 0`),
2 new tokens;
TTFT is the client's time to the first token, prompt tok/s the prompt's tokens over it. Alone, then
another prompt of the same length while {s.get("loaded_streams", 8)} streams decode (each started and past its
first tokens first); **their TPOT meanwhile** is the median stream's time per token from its last
token before the prompt was sent to its first after the prompt's first token, **their longest gap**
the longest wait between two tokens of one of them then.

**Memory**: both servers hold {s["context"]:,} tokens of KV cache shared by up to {s["sessions"]}
sessions, each up to {s["max_seq_len"]:,} tokens (llama.cpp `-c {s["context"]} -np {s["sessions"]}
--kv-unified`; braid `--max-sessions {s["sessions"]} --max-seq-len {s["max_seq_len"]}` and
`--kv-cache-memory` of {s["context"]:,} tokens in {_kv_dtype(s)}); **KV tokens** and **bytes a
token** are what each reports (braid's ModelInfo and ServerStatus, llama.cpp's log). RSS is VmRSS
after the warm-up, peak RSS VmHWM at the end (llama.cpp maps its GGUF: its RSS counts the file pages it
touched, and its KV cache is resident from the start; braid's KV pages become resident as they are
first used; braid's first start on a GGUF file converts it, once, to a cached folder).

{"" if s.get("memory_only") else decode_table(results)}

{"" if s.get("memory_only") else prefill_table(results)}

{memory_table(results)}
{quality}
{machine_table(machine)}
{notes}
"""

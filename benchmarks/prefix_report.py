"""The prefix benchmark's results (issue 13): saved as JSON, written as the section
PREFIX_HEADING of docs/benchmarks.md, with the issue's targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from report import PREFIX_HEADING, Ratio, Results, machine_table, ratio_table, workload_table

PREFIX = "prefix"  # the shared-prefix workload's name
BRAID_COLD = "braid, cold: a cache salt per request"
BRAID_WARM = "braid, warm: one salt, the prefix cached"
LLAMA_COLD = "llama.cpp, cache_prompt false"
LLAMA_WARM = "llama.cpp, cache_prompt true, warm"
COUNTERS = (
    "prompt_tokens_cached",
    "prompt_tokens_computed",
    "kv_pages_used",
    "kv_pages_cached",
    "preemptions",
    "kv_evictions",
)  # ServerStatus's, shown after each run


@dataclass
class PrefixResults(Results):
    capacity: dict = field(default_factory=dict)  # "paged", "slot" -> what the capacity run saw
    chat: dict = field(default_factory=dict)  # "warm", "cold" -> the 4th turn of every run
    counters: dict = field(default_factory=dict)  # run label -> ServerStatus's counters after it


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def _target(label: str, value: float | None, target: float, shown: str, at_most: bool = False) -> Ratio:
    if value is None:
        return Ratio(label, None, shown)
    return Ratio(label, value, shown, value <= target if at_most else value >= target)


def targets(results: PrefixResults) -> list[Ratio]:
    paged, slot = results.capacity.get("paged"), results.capacity.get("slot")
    cold, warm = results.find(BRAID_COLD, PREFIX), results.find(BRAID_WARM, PREFIX)
    llama_cold, llama_warm = results.find(LLAMA_COLD, PREFIX), results.find(LLAMA_WARM, PREFIX)
    chat = results.chat

    def ratio(a, b, metric: str) -> float | None:
        return getattr(a, metric) / getattr(b, metric) if a and b else None

    return [
        _target(
            "capacity: sessions admitted at once, paged ÷ slot cache",
            paged["admitted"] / slot["admitted"] if paged and slot else None,
            8,
            "≥ 8",
        ),
        _target("shared prefix: TTFT p50, warm ÷ cold", ratio(warm, cold, "ttft_p50_ms"), 0.2, "≤ 1/5", True),
        _target("shared prefix: output tok/s, warm ÷ cold", ratio(warm, cold, "tokens_per_s"), 2, "≥ 2"),
        _target(
            "chat: 4th turn's TTFT p50, warm ÷ cold",
            _median(chat["warm"], "ttft_ms") / _median(chat["cold"], "ttft_ms") if chat else None,
            1 / 3,
            "≤ 1/3",
            True,
        ),
        Ratio("llama.cpp, shared prefix: TTFT p50, warm ÷ cold", ratio(llama_warm, llama_cold, "ttft_p50_ms")),
        Ratio("llama.cpp, shared prefix: output tok/s, warm ÷ cold", ratio(llama_warm, llama_cold, "tokens_per_s")),
    ]


def capacity_table(results: PrefixResults) -> str:
    lines = ["| server | sessions admitted at once | KV pages used at the peak | how |", "|---|---:|---:|---|"]
    for key, server in (
        ("paged", f"braid, paged (`{results.machine.get('braid_commit')}`)"),
        ("slot", f"braid, a slot per session (`{results.settings.get('slot_commit')}`)"),
    ):
        if run := results.capacity.get(key):
            pages = (
                f"{run['kv_pages_used']:,} of {run['kv_pages_total']:,} × {run['kv_page_tokens']} tokens"
                if run.get("kv_pages_total")
                else "-"
            )
            lines.append(f"| {server} | {run['admitted']} | {pages} | {run['how']} |")
    return "\n".join(lines)


def chat_table(results: PrefixResults) -> str:
    lines = [
        "| 4th turn | TTFT p50 ms | TTFT of each run, ms | prompt tokens | from the cache |",
        "|---|---:|---|---:|---:|",
    ]
    for key, label in (("warm", "warm: the chat's own salt"), ("cold", "cold: a fresh salt")):
        runs = results.chat.get(key, [])
        if runs:
            each = ", ".join(f"{run['ttft_ms']:,.0f}" for run in runs)
            lines.append(
                f"| {label} | {_median(runs, 'ttft_ms'):,.0f} | {each} | {runs[-1]['prompt_tokens']:,} "
                f"| {runs[-1]['cached_tokens']:,} |"
            )
    return "\n".join(lines)


def counters_table(results: PrefixResults) -> str:
    lines = ["| after the last run of | " + " | ".join(COUNTERS) + " |", "|---|" + "---:|" * len(COUNTERS)]
    for label, counts in results.counters.items():
        lines.append(f"| {label} | " + " | ".join(f"{counts[name]:,}" for name in COUNTERS) + " |")
    return "\n".join(lines)


def _capacity(results: PrefixResults) -> str:
    s = results.settings
    return f"""**Capacity.** {s["capacity_sessions"]} sessions of {s["session_prompt"]} prompt tokens +
{s["session_new"]} new tokens (200 tokens each; distinct prompts and cache salts, so nothing is shared) are sent at
once to a server started with `{" ".join(s["capacity_flags"])}`.
The figure is the peak of ServerStatus's `sessions_active`, polled every {s["poll_ms"]:g} ms until it
has not risen for {s["plateau_s"]:g} s after a session ended. The slot cache is braid at
`{s["slot_commit"]}`, before paging, run from a `git archive` of its `server/` (with torch's
kernels: the C kernels are not built there; capacity does not depend on them).

{capacity_table(results)}"""


def _prefix(results: PrefixResults) -> str:
    s = results.settings
    low, high = s["question_tokens"]
    return f"""**Shared prefix.** {s["count"]} requests sent at once, each a {s["prefix_tokens"]:,}-token prefix
(the same for all) and its own {low}-{high}-token question, greedy, `ignore_eos`, {s["new_tokens"]} new tokens.
Warm: after a warm-up of {s["count"]} other questions on the same prefix, each run with new
questions; braid with one `cache_salt`, llama.cpp with `cache_prompt: true` (each of its
`--parallel {s["count"]}` slots then holds the prefix). Cold: braid with a fresh salt per request
(nothing shared, nothing cached), llama.cpp with `cache_prompt: false`. Median of {s["repeats"]}
run(s) by output tok/s, with the range.

{workload_table(results, PREFIX)}"""


def _chat(results: PrefixResults) -> str:
    s = results.settings
    low, high = s["question_tokens"]
    return f"""**Multi-turn chat.** {s["chat_turns"]} turns through `messages` and the chat template: a
{s["chat_system_tokens"]}-token system message, questions of {low}-{high} tokens, each turn adding
the model's own answer (greedy, up to {s["chat_answer_tokens"]} tokens) and the next question, all
under the chat's own salt; the 4th turn's messages are then sent again under a fresh salt (cold).
{s["repeats"]} chat(s); "from the cache" is the last one's `usage.cached_tokens`.

{chat_table(results)}"""


def markdown(results: PrefixResults) -> str:
    s = results.settings
    quick = " (a quick run: fewer requests and tokens, one run each)" if s.get("quick") else ""
    measured = (
        (_capacity, results.capacity),
        (_prefix, [r for r in results.rows if r.workload == PREFIX]),
        (_chat, results.chat),
    )
    parts = "\n\n".join(part(results) for part, rows in measured if rows)
    notes = "".join(f"- {n}\n" for n in results.notes)
    kv_dtype = s.get("kv_cache_dtype", "its default dtype")
    return f"""{PREFIX_HEADING}

> One run on {results.started} (braid commit `{results.machine.get("braid_commit")}`), every figure
> from the same machine in the same run{quick}.

    make bench-prefix                           # or: .venv/bin/python benchmarks/prefix.py [--quick]
    {s["command"]}

braid runs the embedded SmolLM2-135M-Instruct GGUF (Q4_1) in continuous mode over gRPC with its
defaults (`--kv-page-size 16 --prefix-caching on`, the KV cache in {kv_dtype}); llama.cpp's
`llama-server` serves the same GGUF file. Figures are from the client side; TTFT is from sending
a request to its first token.

{parts}

**ServerStatus after each part** (the counts are that part's; pages are the state it left):

{counters_table(results)}

{ratio_table(targets(results), issue=13)}

{machine_table(results.machine)}
{notes}"""

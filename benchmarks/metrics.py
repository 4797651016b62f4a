"""What one stream measured, what a workload adds up to (one Row), and the one percentile function."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class StreamTiming:
    """One request as its client saw it; times in seconds on one monotonic clock."""

    sent: float  # when the request was sent (for "all at once": the workload's start)
    first: float  # when its first token arrived
    last: float  # when its last token arrived
    num_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (t_last - t_first) / (n - 1)."""
        return (self.last - self.first) / (self.num_tokens - 1) if self.num_tokens > 1 else None


@dataclass
class Row:
    """One system on one workload (the median of its repeats)."""

    system: str  # "braid sequential", "HF generate (static batch)", "llama.cpp server", ...
    workload: str
    concurrency: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_max_ms: float  # the last request to be served (the 16th of 16 at once)
    other_cpu: float = 0.0  # cores busy with other processes during the run (contention)
    repeats: list[float] = field(default_factory=list)  # tokens/s of every repeat


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    system: str, workload, timings: list[StreamTiming], wall_s: float, prompt_tokens: int, other_cpu: float = 0.0
) -> Row:
    output_tokens = sum(t.num_tokens for t in timings)
    ttfts = [t.ttft_s * 1000 for t in timings]
    tpots = [t.tpot_s * 1000 for t in timings if t.tpot_s is not None]
    return Row(
        system=system,
        workload=workload.name,
        concurrency=workload.concurrency,
        num_requests=len(timings),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        wall_s=wall_s,
        tokens_per_s=output_tokens / wall_s,
        requests_per_s=len(timings) / wall_s,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        ttft_max_ms=max(ttfts),
        other_cpu=other_cpu,
        repeats=[output_tokens / wall_s],
    )


def median_row(rows: list[Row]) -> Row:
    """The repeat with the median throughput (the upper one of two), so that its figures belong
    together; it lists the throughput of every repeat."""
    chosen = sorted(rows, key=lambda r: r.tokens_per_s)[len(rows) // 2]
    chosen.repeats = [r.tokens_per_s for r in rows]
    return chosen


def spread(values: list[float]) -> str:
    """ "123 (118-130)" for repeats, "123" for one value."""
    if len(values) < 2:
        return f"{values[0]:.1f}" if values else "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

"""Sharing the cores: one stream's decode speed while other processes compete for the CPUs.

For each server (the default, `--threads 1`, and any --variant), measures one greedy stream's
decode tokens/s with the machine quiet, beside 1 and 3 busy processes (`while 1: pass`), and with
the server started inside a cgroup whose CPU quota is --quota CPUs (cgroup v2 `cpu.max`, else v1
`cpu.cfs_quota_us`; needs root). Conditions take turns within each repeat, so a figure and the
quiet one it is compared with are measured minutes apart at most; the table gives the median of the
repeats and the ratios the issue sets targets for.

    .venv/bin/python benchmarks/neighbours.py                     # ~3 min on 2 cores
    .venv/bin/python benchmarks/neighbours.py --variant "spin 300000:GOMP_SPINCOUNT=300000"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from braid.client import Client
from braid_server import BraidProcess

from machine import CpuMeter, describe, wait_until_quiet

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
CONDITIONS = ("quiet", "1 busy", "3 busy")
BUSY = {"1 busy": 1, "3 busy": 3}  # busy processes beside the server, by condition


@dataclass
class Server:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens a measurement waits for, at most")
    parser.add_argument(
        "--window-s",
        type=float,
        default=4.0,
        help="a measurement ends after this long even with fewer tokens (a collapsed server)",
    )
    parser.add_argument("--quota", type=float, default=0.5, help="CPUs of the cgroup quota (0: skip)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help='another server, "NAME:ENV=VALUE,...[:FLAG VALUE ...]", e.g. "spin 0:GOMP_SPINCOUNT=0"',
    )
    parser.add_argument("--only-variants", action="store_true", help="leave out the default and --threads 1")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.25,
        help="before each measurement, wait (at most --quiet-wait-s) until other processes use fewer cores than this",
    )
    parser.add_argument("--quiet-wait-s", type=float, default=5.0)
    parser.add_argument(
        "--conditions",
        default=",".join(CONDITIONS),
        help=f"which of {', '.join(CONDITIONS)} to measure (the quota: --quota)",
    )
    return parser.parse_args(argv)


def servers(args: argparse.Namespace) -> list[Server]:
    chosen = [] if args.only_variants else [Server("default", []), Server("--threads 1", ["--threads", "1"])]
    for spec in args.variant:
        name, _, rest = spec.partition(":")
        env_text, _, flags = rest.partition(":")
        env = dict(pair.split("=", 1) for pair in env_text.split(",") if pair)
        chosen.append(Server(name, flags.split(), env))
    return chosen


def decode_speed(target: str, tokens: int, window_s: float) -> float:
    """One greedy stream's decode tokens/s: tokens after the first over the time they took, ended
    after `tokens` tokens or `window_s` seconds from the first, whichever comes sooner."""
    with (
        Client(target) as client,
        client.stream(PROMPT, max_new_tokens=tokens + 1, ignore_eos=True, temperature=0) as generation,
    ):
        first = last = 0.0
        count = 0
        for message in generation:
            if not message.token_ids:
                continue
            last = time.perf_counter()
            first = first or last
            count += len(message.token_ids)
            if last - first >= window_s:
                break
    return (count - 1) / (last - first) if count > 1 and last > first else float("nan")


@contextlib.contextmanager
def busy(count: int):
    """`count` processes spinning on a core each, stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let the scheduler see them
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


class QuotaGroup:
    """A cgroup with a CPU quota of `cpus` (v2 where the cpu controller is on, else v1), made for
    the run and removed after it. `holding()` puts this process in it while a server starts, so
    the server starts under the quota, as in a container with a CPU limit."""

    def __init__(self, cpus: float) -> None:
        period = 100_000
        quota = int(cpus * period)
        v2 = Path("/sys/fs/cgroup")
        if "cpu" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else False:
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu")  # children get cpu.max
            self.path = Path(tempfile.mkdtemp(prefix="braid-neighbours-", dir=v2))
            (self.path / "cpu.max").write_text(f"{quota} {period}")
            self.kind = f"cgroup v2 cpu.max {quota} {period}"
        else:
            self.path = Path(tempfile.mkdtemp(prefix="braid-neighbours-", dir="/sys/fs/cgroup/cpu"))
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            self.kind = f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"
        self._home = self._own_cgroup()

    def _own_cgroup(self) -> Path:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if ("cpu" in controllers.split(",")) if self.path.parent.name == "cpu" else hierarchy == "0":
                return self.path.parent / path.lstrip("/")
        return self.path.parent

    @contextlib.contextmanager
    def holding(self):
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (self._home / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def start(server: Server, log_dir: Path, group: QuotaGroup | None = None) -> BraidProcess:
    """A healthy server (started inside `group` if given), past its first-call costs."""
    log = log_dir / f"{server.name.replace(' ', '_').replace('/', '_')}{'-quota' if group else ''}.log"
    with group.holding() if group else contextlib.nullcontext():
        process = BraidProcess(server.args, env=server.env, log_path=log)
    with Client(process.target) as client:
        threads = client.model_info().threads
    decode_speed(process.target, 8, 2.0)
    print(f"  {server.name}{' (in the quota)' if group else ''}: ModelInfo.threads {threads}", file=sys.stderr)
    return process


def measure(
    args, chosen: list[Server], columns: list[str], group: QuotaGroup | None, log_dir: Path
) -> tuple[dict[tuple[str, str], list[float]], list[float]]:
    """Every server's speed in every column, `args.repeats` times, the columns taking turns; and
    the cores other processes used during each measurement."""
    speeds: dict[tuple[str, str], list[float]] = {}
    other: list[float] = []
    with contextlib.ExitStack() as stack:
        running: dict[tuple[str, bool], BraidProcess] = {}
        for server in chosen:
            for in_quota in (False, True) if group else (False,):
                process = start(server, log_dir, group if in_quota else None)
                stack.callback(process.stop)
                running[server.name, in_quota] = process
        ours = [process.pid for process in running.values()]  # idle beside the one measured: not "other"
        for repeat in range(args.repeats):
            for server in chosen:
                for column in columns:
                    in_quota = column.startswith("quota")
                    wait_until_quiet(ours, threshold=args.quiet_below, max_wait_s=args.quiet_wait_s, sample_s=0.5)
                    with busy(BUSY.get(column, 0)) as pids:
                        meter = CpuMeter([*ours, *pids])
                        meter.start()
                        speed = decode_speed(running[server.name, in_quota].target, args.tokens, args.window_s)
                        other.append(meter.stop())
                    speeds.setdefault((server.name, column), []).append(speed)
                    print(
                        f"  repeat {repeat + 1} {server.name:>15} {column:>14}: {speed:6.1f} tok/s "
                        f"(other processes: {other[-1]:.2f} cores)",
                        file=sys.stderr,
                    )
    return speeds, other


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = servers(args)
    group = None
    if args.quota > 0:
        try:
            group = QuotaGroup(args.quota)
        except OSError as exc:
            print(f"no CPU quota: cannot make a cgroup here ({exc})", file=sys.stderr)
    columns = [*args.conditions.split(","), *([f"quota {args.quota:g} CPU"] if group else [])]
    log_dir = Path(tempfile.mkdtemp(prefix="braid-neighbours-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    try:
        speeds, other = measure(args, chosen, columns, group, log_dir)
    finally:
        if group:
            group.remove()
    print(report(args, chosen, columns, speeds, other, group))
    return 0


def report(
    args, chosen: list[Server], columns: list[str], speeds: dict, other: list[float], group: QuotaGroup | None
) -> str:
    """The medians, and the ratios the issue sets targets for: each server beside busy processes
    over its own quiet speed, and in the quota over `--threads 1` in the quota."""
    median = {key: statistics.median(values) for key, values in speeds.items()}
    quota = columns[-1] if group else None
    ratios = [(f"{c} / quiet", c, "quiet") for c in columns if "busy" in c and "quiet" in columns]
    machine = describe(0)
    lines = [
        f"{machine.cpu_model}, {machine.cores} cores, torch {machine.torch}, braid {machine.braid_commit}; "
        f"`python benchmarks/neighbours.py {' '.join(argv_text())}`; one stream's decode tokens/s, median "
        f"of {args.repeats} repeats (best quiet in brackets); other processes' CPU during the measurements: "
        f"median {statistics.median(other):.2f} cores" + (f"; quota: {group.kind}" if group else ""),
        "",
        "| server | "
        + " | ".join([*columns, *(r[0] for r in ratios)])
        + (" | quota / quota `--threads 1`" if group else "")
        + " |",
        "|---|" + "---:|" * (len(columns) + len(ratios) + bool(group)),
    ]
    for server in chosen:
        cells = [
            f"{median[server.name, c]:.1f}" + (f" ({max(speeds[server.name, c]):.0f})" if c == "quiet" else "")
            for c in columns
        ]
        cells += [f"{median[server.name, c] / median[server.name, base]:.2f}" for _, c, base in ratios]
        if group:
            reference = median.get(("--threads 1", quota))
            cells.append(f"{median[server.name, quota] / reference:.2f}" if reference else "")
        lines.append(f"| {server.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def argv_text() -> list[str]:
    return [a if " " not in a else repr(a) for a in sys.argv[1:]]


if __name__ == "__main__":
    sys.exit(main())

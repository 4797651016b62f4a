"""braid's benchmark (issue 3): the real gRPC server in each scheduling mode against its peers, on
one machine in one run. Prints markdown tables and writes docs/benchmarks.md and docs/benchmarks.png.

    .venv/bin/python benchmarks/bench.py                  # everything (make bench)
    .venv/bin/python benchmarks/bench.py --quick          # a short run
    .venv/bin/python benchmarks/bench.py --modes continuous --workloads targets --skip-peers
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import braid_server
import drive
import format_models
import llamacpp
import machine
import peers
import report
import workloads
from metrics import Row, StreamTiming, median_row, summarize
from report import Results

DOCS = machine.REPO / "docs"
RESULTS_DIR = Path.home() / ".cache" / "braid" / "bench"
WORKLOAD_GROUPS = ("single", "targets", "mixed", "poisson", "sweep")
PEER_WORKLOADS = ("single", "targets", "mixed")  # in-process peers cannot take arrivals or a sweep
DISTURBED_ABOVE = 0.3  # cores used by other processes during a run that make it worth repeating
RETRIES = 1  # extra runs allowed when a run was disturbed (more rarely help: contention here lasts minutes)
REPEAT_BUDGET_S = 60.0  # no further repeat once a workload's runs have taken this long
QUIET_WAIT_S = 30.0  # longest wait for other processes to calm down before a run
LLAMA_PARALLEL = 16
MAX_BATCH_SIZE = 32

RunOnce = Callable[[], Awaitable[tuple[list[StreamTiming], float]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests instead of 16, a short sweep, no repeats")
    parser.add_argument("--modes", default=",".join(report.MODES), help="braid modes to run, comma-separated")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOAD_GROUPS),
        help=f"workloads to run, comma-separated, of: {', '.join(WORKLOAD_GROUPS)}",
    )
    parser.add_argument("--skip-peers", action="store_true", help="no HF transformers and no llama.cpp")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp")
    parser.add_argument(
        "--build-llama-cpp",
        action="store_true",
        help="rebuild llama.cpp even if a build is found (it is built anyway when absent)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every system (default: one per core)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the single and targets workloads")
    parser.add_argument(
        "--sweep-level-budget",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="skip a sweep level estimated to take longer (0: run every level)",
    )
    parser.add_argument("--poisson-rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--output", type=Path, default=DOCS / "benchmarks.md", help="the markdown page to write")
    parser.add_argument("--no-docs", action="store_true", help="print the tables only")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="JSON",
        help="carry on an interrupted run: keep its saved rows, run the rest, save to it",
    )
    parser.add_argument(
        "--report-from",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="write the report from saved results (later files replace earlier rows)",
    )
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one measurement


async def measure(
    system: str, workload: workloads.Workload, run_once: RunOnce, pids: list[int], budget_s: float = REPEAT_BUDGET_S
) -> Row:
    """Runs the workload up to `repeats` times while the repeats take under `budget_s`, and again
    when other processes disturbed a run; the median of the undisturbed runs, or of all of them if
    none was."""
    prompt_tokens = sum(len(r.prompt_ids) for r in workload.requests)
    clean: list[Row] = []
    disturbed: list[Row] = []
    started = time.monotonic()
    while len(clean) < workload.repeats and len(disturbed) <= RETRIES:
        if clean and time.monotonic() - started > budget_s:
            break
        machine.wait_until_quiet(pids, threshold=DISTURBED_ABOVE, max_wait_s=QUIET_WAIT_S)
        meter = machine.CpuMeter(pids)
        meter.start()
        timings, wall_s = await run_once()
        other_cpu = meter.stop()
        drive.check_counts(system, workload.requests, timings)
        row = summarize(system, workload, timings, wall_s, prompt_tokens, other_cpu)
        (disturbed if other_cpu > DISTURBED_ABOVE else clean).append(row)
        log(
            f"  {system:32s} {workload.name:10s} {row.tokens_per_s:8.1f} tok/s  TTFT p50 {row.ttft_p50_ms:8.0f} ms"
            f"  other CPU {other_cpu:.2f}{'  (disturbed)' if other_cpu > DISTURBED_ABOVE else ''}"
        )
    return median_row(clean or disturbed)


# ---------------------------------------------------------------- systems


def reused(system: str, workload: workloads.Workload, results: Results) -> Row | None:
    """The row of an identical workload already measured for this system, under this workload's name."""
    row = results.find(system, workload.same_as) if workload.same_as else None
    return dataclasses.replace(row, workload=workload.name) if row else None


def too_long(system: str, workload: workloads.Workload, args, results: Results) -> bool:
    """Whether a sweep level would take longer than --sweep-level-budget at the best throughput this
    system has shown so far (sequential modes at 32 streams take minutes); notes it if so."""
    best = max((r.tokens_per_s for r in results.rows if r.system == system), default=0.0)
    if not workload.name.startswith("sweep-") or not best or not args.sweep_level_budget:
        return False
    estimate_s = sum(r.max_new_tokens for r in workload.requests) / best
    if estimate_s <= args.sweep_level_budget:
        return False
    note = (
        f"{system}: {workload.name} not run (estimated {estimate_s:.0f} s at {best:.1f} tok/s, over "
        f"--sweep-level-budget {args.sweep_level_budget:g} s)."
    )
    log("  " + note)
    results.notes.append(note)
    return True


async def run_workloads(
    system: str, selected: list[workloads.Workload], send, pids: list[int], args, results: Results, save
) -> None:
    """Every selected workload against one running server, through `send`."""
    for workload in selected:
        if results.find(system, workload.name):  # kept from the run being resumed
            continue
        row = reused(system, workload, results)
        if row is None and too_long(system, workload, args, results):
            continue
        results.add(row or await measure(system, workload, lambda w=workload: drive.run(w, send), pids))
        save()


async def bench_braid(
    mode: str, selected: list[workloads.Workload], warm: list[workloads.Request], args, results: Results, save
) -> None:
    system = report.braid(mode)
    if all(results.find(system, w.name) for w in selected):  # all kept from the run being resumed
        return
    commit = machine.braid_commit()
    log(f"{system}: starting the server (braid {commit})")
    if commit != results.machine["braid_commit"]:  # others are editing the server meanwhile
        results.notes.append(f"{system} ran braid {commit} (the run started at {results.machine['braid_commit']}).")
    log_path = Path(tempfile.gettempdir()) / f"braid-bench-{mode}.log"
    async with braid_server.running(mode, threads=args.threads, max_batch_size=MAX_BATCH_SIZE, log_path=log_path) as (
        client,
        pid,
    ):
        send = braid_server.sender(client)
        await braid_server.warm_up(send, warm)
        await run_workloads(system, selected, send, [pid], args, results, save)


async def bench_hf(model_path: str, selected: list[workloads.Workload], args, results: Results, save) -> None:
    log("HF transformers peers: loading the model in-process")
    hf = peers.load(model_path, args.threads)
    for peer, system in (
        (peers.SEQUENTIAL, report.HF_SEQUENTIAL),
        (peers.STATIC, report.HF_STATIC),
        (peers.CONTINUOUS, report.HF_CONTINUOUS),
    ):
        for workload in (w for w in selected if w.name in PEER_WORKLOADS):
            if results.find(system, workload.name):  # kept from the run being resumed
                continue
            peers.warm_up(peer, hf, workload.requests)

            async def run_once(w=workload, p=peer):
                return peers.run(p, hf, w.requests)

            results.add(await measure(system, workload, run_once, []))
            save()


async def bench_llama_cpp(
    selected: list[workloads.Workload], warm: list[workloads.Request], args, results: Results, save
) -> None:
    llama = prepare_llama_cpp(args, results)
    if llama is None:
        return
    import httpx

    from braid.server.model.loader import embedded_gguf

    gguf = llamacpp.f32_gguf(llama, embedded_gguf())
    longest = max(len(r.prompt_ids) + r.max_new_tokens for w in selected for r in w.requests)
    context = llamacpp.context_size(LLAMA_PARALLEL, longest)
    log(f"{report.LLAMA_CPP}: --parallel {LLAMA_PARALLEL} -c {context}, {gguf.name}")
    log_path = Path(tempfile.gettempdir()) / "braid-bench-llama-server.log"
    with llamacpp.running_server(
        llama,
        gguf,
        braid_server.free_port(),
        parallel=LLAMA_PARALLEL,
        context=context,
        threads=args.threads,
        log_path=log_path,
    ) as (url, pid):
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
            send = llamacpp.sender(http, url)
            await braid_server.warm_up(send, warm)
            await run_workloads(report.LLAMA_CPP, selected, send, [pid], args, results, save)


def prepare_llama_cpp(args, results: Results) -> llamacpp.LlamaCpp | None:
    """The llama.cpp build: found, or built now; None (and a clear note) when it cannot be had."""
    llama = None if args.build_llama_cpp else llamacpp.find()
    if llama is None:
        log("llama.cpp: no build found; building it now (about 5 minutes on 2 cores)")
        try:
            llama = llamacpp.build()
        except Exception as exc:  # no network, no compiler: the rest of the benchmark still runs
            note = f"llama.cpp is ABSENT from this run: the build failed ({exc}); see {llamacpp.cache_dir()}/build.log"
            log(note)
            results.notes.append(note)
            return None
    results.machine["llama_cpp"] = llama.build_info
    return llama


# ---------------------------------------------------------------- the run


def select_workloads(all_workloads: dict[str, workloads.Workload], names: str) -> list[workloads.Workload]:
    groups = [n.strip() for n in names.split(",") if n.strip()]
    unknown = set(groups) - set(WORKLOAD_GROUPS)
    if unknown:
        sys.exit(f"unknown workloads: {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOAD_GROUPS)}")
    return [w for w in all_workloads.values() if w.name.split("-")[0] in groups]


async def run_all(args) -> Results:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    from braid.server.model.loader import default_cache_dir, resolve

    model_name, model_path, _ = resolve(None, default_cache_dir())
    all_workloads = workloads.build(
        AutoTokenizer.from_pretrained(model_path, local_files_only=True),
        quick=args.quick,
        poisson_rate=args.poisson_rate,
        repeats=1 if args.quick else args.repeats,
    )
    selected = select_workloads(all_workloads, args.workloads)
    warm = all_workloads["targets"].requests[:4]
    settings = {
        "model": model_name,
        "dtype": "float32",
        "new_tokens": workloads.NEW_TOKENS,
        "count": all_workloads["targets"].num_requests,
        "poisson_rate": args.poisson_rate,
        "braid_max_batch_size": MAX_BATCH_SIZE,
        "llama_cpp_parallel": LLAMA_PARALLEL,
        "quick": args.quick,
        "disturbed_above": DISTURBED_ABOVE,
    }
    if args.resume:
        json_path, results = args.resume, Results.load(args.resume)
        log(f"resuming {json_path}: {len(results.rows)} rows are kept and not run again")
    else:
        results = Results(
            machine.describe(args.threads).as_dict(), settings, titles={w.name: w.title for w in all_workloads.values()}
        )
        json_path = RESULTS_DIR / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
        log(f"results are saved as they come to {json_path}")

    def save() -> None:
        results.save(json_path)

    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        await bench_braid(mode, selected, warm, args, results, save)
    if not args.skip_peers:
        # transformers needs the weights in fp32: braid's converted folder keeps the quantized matrices as blocks
        await bench_hf(str(format_models.smollm_fp32_folder()), selected, args, results, save)
        if args.skip_llama_cpp:
            results.notes.append("llama.cpp was skipped (--skip-llama-cpp).")
        else:
            await bench_llama_cpp(selected, warm, args, results, save)
    save()
    return results


def write_docs(results: Results, output: Path) -> None:
    """Writes this run's section of the page (report.BENCH_HEADING), in place, leaving every other
    section as it was: other benchmarks' and those written by hand."""
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_path = output.with_suffix(".png")
    has_plot = report.plot(results, plot_path)
    text = report.markdown(results, plot_path.name if has_plot else None)
    report.write_section(output, report.BENCH_HEADING, text)
    log(f"wrote the section {report.BENCH_HEADING!r} of {output}" + (f" and {plot_path}" if has_plot else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:
        results = Results.load(args.report_from[0])
        for path in args.report_from[1:]:
            results.merge(Results.load(path))
    else:
        results = asyncio.run(run_all(args))
    print(f"\nmachine: {results.machine}\n")
    print(report.tables(results))
    print("\n" + report.ratio_table(report.absolute_targets(results) + report.ratios(results)))
    if not args.no_docs:
        write_docs(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""braid's weight-format benchmark (issues 12 and 26): braid and llama.cpp's server on the same models
in fp32, bf16, Q8_0 and Q4_0/Q4_1, side by side in one run, at 1 stream, 16 and 32, beside the bound
that memory bandwidth sets and the server's resident memory, with issue 26's ratios worked out.
Appends (or replaces) its section of docs/benchmarks.md (report.FORMATS_HEADING).

    .venv/bin/python benchmarks/formats.py                # everything, 3 repeats (about 60 min)
    .venv/bin/python benchmarks/formats.py --quick        # fewer tokens, one repeat
    .venv/bin/python benchmarks/formats.py --models smollm --systems llama.cpp --no-docs
    .venv/bin/python benchmarks/formats.py --models 1b --streams 1,16 --quick --no-docs

Model files are made once into ~/.cache/braid/bench/ (format_models.py); llama.cpp is built once
into ~/.cache/braid/llama.cpp/ (llamacpp.py). A configuration that fails is reported with its
error, and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import bench
import braid_server
import drive
import format_models
import llamacpp
import machine
import report
import workloads
from formats_report import DEFAULT, FP32, LLAMA_1B, SAME_FILE, SMOLLM, FormatResults, Outcome, markdown, table

MODELS = {"smollm": SMOLLM, "1b": LLAMA_1B}
SYSTEMS = ("braid", "llama.cpp")
STREAMS = (1, 16, 32)  # streams at once: 1 is the single-stream workload, more are prompts sent together
BRAID_FORMAT_FLAGS = ("--dtype", "--quantization")


@dataclass(frozen=True)
class Config:
    model: str
    system: str
    weights: str  # the format, as the table shows it
    served: str  # key of the file or folder the server loads (see Files)
    counted: str  # key of the file or folder whose tensor bytes a decode step reads
    flags: tuple[str, ...] = ()  # braid's format flags
    role: str = ""  # what it is to issue 26's ratios (formats_report.TARGETS)


FP32_FLAGS = ("--dtype", "float32", "--quantization", "none")
AUTO = ("--dtype", "auto", "--quantization", "auto")
Q8_0 = ("--dtype", "auto", "--quantization", "q8_0")
CONFIGS = (
    Config(SMOLLM, "braid", "fp32", "smollm.gguf", "smollm.fp32", FP32_FLAGS, FP32),
    Config(SMOLLM, "braid", "Q4_1 + Q8_0 embedding (native)", "smollm.gguf", "smollm.gguf", AUTO, DEFAULT),
    Config(SMOLLM, "braid", "Q8_0 (quantized at load)", "smollm.fp32", "smollm.Q8_0", Q8_0),
    Config(SMOLLM, "braid", "bf16 (safetensors)", "smollm.bf16", "smollm.bf16", AUTO),
    Config(SMOLLM, "llama.cpp", "Q4_1 + Q8_0 embedding", "smollm.gguf", "smollm.gguf", role=SAME_FILE),
    Config(SMOLLM, "llama.cpp", "Q8_0", "smollm.Q8_0", "smollm.Q8_0"),
    Config(SMOLLM, "llama.cpp", "BF16", "smollm.BF16", "smollm.BF16"),
    Config(LLAMA_1B, "braid", "Q4_0 + Q8_0 embedding (native)", "1b.Q4_0", "1b.Q4_0", AUTO, DEFAULT),
    Config(LLAMA_1B, "braid", "Q8_0 (native)", "1b.Q8_0", "1b.Q8_0", AUTO),
    Config(LLAMA_1B, "braid", "bf16 (safetensors)", "1b.bf16", "1b.bf16", AUTO),
    Config(LLAMA_1B, "llama.cpp", "Q4_0 + Q8_0 embedding", "1b.Q4_0", "1b.Q4_0", role=SAME_FILE),
    Config(LLAMA_1B, "llama.cpp", "Q8_0", "1b.Q8_0", "1b.Q8_0"),
    Config(LLAMA_1B, "llama.cpp", "BF16", "1b.BF16", "1b.BF16"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 and 16 new tokens instead of 128 and 64, one run each")
    parser.add_argument(
        "--streams",
        default=",".join(map(str, STREAMS)),
        help="stream counts to measure, comma-separated (1: one ~40-token prompt; N: N prompts "
        "of 30-60 tokens at once); issue 26's ratios need 1,16,32",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is quoted")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of: {', '.join(MODELS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"of: {', '.join(SYSTEMS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every server")
    parser.add_argument(
        "--output", type=Path, default=bench.DOCS / "benchmarks.md", help="the page to add the section to"
    )
    parser.add_argument("--no-docs", action="store_true", help="print the section only")
    parser.add_argument(
        "--report-from",
        type=Path,
        metavar="JSON",
        help="write the section from a run's saved results (~/.cache/braid/bench/formats-*.json)",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------- model files


class Files:
    """The files and folders the configurations serve, by key ("smollm.bf16", "1b.Q4_0"); a key whose
    making failed raises its error when looked up, so that only the configurations that need it fail."""

    def __init__(self) -> None:
        self._paths: dict[str, Path] = {}
        self._errors: dict[str, str] = {}

    def make(self, keys: list[str], build: Callable[[], dict[str, Path]]) -> None:
        try:
            self._paths |= build()
        except Exception as exc:  # noqa: BLE001 - reported in the table, the rest still runs
            bench.log(f"could not make {', '.join(keys)}: {exc}")
            self._errors |= {key: f"making the model file failed: {exc}" for key in keys}

    def __getitem__(self, key: str) -> Path:
        if key in self._errors:
            raise RuntimeError(self._errors[key])
        return self._paths[key]


def make_files(models: set[str], llama: llamacpp.LlamaCpp | Exception) -> Files:
    from braid.server.model.loader import embedded_gguf

    def llama_cpp() -> llamacpp.LlamaCpp:
        if isinstance(llama, Exception):
            raise llama
        return llama

    def prefixed(prefix: str, paths: dict[str, Path]) -> dict[str, Path]:
        return {f"{prefix}.{key}": path for key, path in paths.items()}

    files = Files()
    files.make(
        ["smollm.gguf", "smollm.fp32"],
        lambda: {"smollm.gguf": embedded_gguf(), "smollm.fp32": format_models.smollm_fp32_folder()},
    )
    fp32 = files["smollm.fp32"]  # the tokenizer too: without it nothing runs
    if SMOLLM in models:
        files.make(
            ["smollm.bf16"],
            lambda: {
                "smollm.bf16": format_models.bf16_folder(fp32, format_models.BENCH_DIR / "SmolLM2-135M-Instruct-bf16")
            },
        )
        files.make(
            ["smollm.Q8_0", "smollm.BF16"], lambda: prefixed("smollm", format_models.smollm_ggufs(llama_cpp(), fp32))
        )
    if LLAMA_1B in models:
        files.make(["1b.bf16"], lambda: {"1b.bf16": format_models.llama_1b_folder(fp32)})
        files.make(
            ["1b.BF16", "1b.Q8_0", "1b.Q4_0"],
            lambda: prefixed("1b", format_models.llama_1b_ggufs(llama_cpp(), files["1b.bf16"])),
        )
    return files


def find_or_build_llama_cpp() -> llamacpp.LlamaCpp | Exception:
    try:
        return llamacpp.find() or llamacpp.build()
    except Exception as exc:  # noqa: BLE001 - the llama.cpp rows then say why
        return RuntimeError(f"llama.cpp could not be built: {exc} (see {llamacpp.cache_dir()}/build.log)")


# ---------------------------------------------------------------- one configuration


def build_workloads(tokenizer, streams: list[int], *, quick: bool, repeats: int) -> dict[int, workloads.Workload]:
    """A workload for each stream count: at 1, bench.py's single prompt; at N, N prompts drawn after
    it (the same seed draws them in the same order, so that the first 16 are bench.py's targets
    prompts and every N's prompts start with those of a smaller N), with this benchmark's token counts."""
    maker = workloads.PromptMaker(tokenizer)
    single_new, multi_new = new_tokens(quick)
    single = replace(maker.prompt(40), max_new_tokens=single_new)
    prompts = [replace(r, max_new_tokens=multi_new) for r in maker.batch(max(streams), 30, 60)]
    return {
        n: workloads.Workload("1-stream", f"1 stream, {single_new} new tokens", [single], 1, repeats=repeats)
        if n == 1
        else workloads.Workload(
            f"{n}-streams", f"{n} at once, {multi_new} new tokens each", prompts[:n], n, repeats=repeats
        )
        for n in streams
    }


def new_tokens(quick: bool) -> tuple[int, int]:
    """New tokens per request at 1 stream and at more."""
    return (32, 16) if quick else (128, 64)


async def measure_server(name: str, outcome: Outcome, send, pid: int, measured: dict[int, workloads.Workload]) -> None:
    """Warms the server up with as many short requests as the most streams at once, notes its RSS,
    then measures each workload, fewest streams first."""
    await braid_server.warm_up(send, warm_up_requests(measured))
    outcome.rss_mib = await machine.rss_at_rest_mib(pid)
    for streams, workload in sorted(measured.items()):
        outcome.rows[streams] = await bench.measure(
            name, workload, lambda w=workload: drive.run(w, send), [pid], budget_s=math.inf
        )


def warm_up_requests(measured: dict[int, workloads.Workload]) -> list[workloads.Request]:
    return [replace(r, max_new_tokens=8) for r in measured[max(measured)].requests]


def braid_max_batch_size(measured: dict[int, workloads.Workload]) -> int:
    return max(bench.MAX_BATCH_SIZE, *measured)


async def run_braid(config: Config, outcome: Outcome, served: Path, args, measured) -> None:
    log_path = Path(tempfile.gettempdir()) / f"braid-formats-{_slug(config)}.log"
    try:
        async with braid_server.running(
            "continuous",
            threads=args.threads,
            max_batch_size=braid_max_batch_size(measured),
            log_path=log_path,
            extra_args=["--model", str(served), *config.flags],
            start_timeout=900,
        ) as (client, pid):
            await measure_server(_name(config), outcome, braid_server.sender(client), pid, measured)
    except Exception as exc:
        raise _with_log(exc, log_path) from exc


async def run_llama_cpp(
    config: Config, outcome: Outcome, served: Path, llama: llamacpp.LlamaCpp, args, measured
) -> None:
    import httpx

    parallel = max(measured)  # a slot for every stream of the most at once
    longest = max(len(r.prompt_ids) + r.max_new_tokens for w in measured.values() for r in w.requests)
    log_path = Path(tempfile.gettempdir()) / f"braid-formats-{_slug(config)}.log"
    try:
        with llamacpp.running_server(
            llama,
            served,
            braid_server.free_port(),
            parallel=parallel,
            context=llamacpp.context_size(parallel, longest),
            threads=args.threads,
            log_path=log_path,
        ) as (url, pid):
            async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=2 * parallel)) as http:
                await measure_server(_name(config), outcome, llamacpp.sender(http, url), pid, measured)
    except Exception as exc:
        raise _with_log(exc, log_path) from exc


async def run_config(config: Config, files: Files, llama, has_flags: bool, args, measured) -> Outcome:
    flags = config.flags if has_flags or config.system != "braid" else ()
    outcome = Outcome(config.model, config.system, config.weights, command=_command(config, flags), role=config.role)
    bench.log(f"{_name(config)}: starting")
    try:
        outcome.bytes_per_step = format_models.weight_bytes(files[config.counted])
        served = files[config.served]
        if config.system == "braid":
            outcome.command = f"--model {served.name} {outcome.command}"
            if config.flags and not has_flags and config.weights != "fp32":
                raise RuntimeError(f"this braid has no {' or '.join(BRAID_FORMAT_FLAGS)} flag yet")
            await run_braid(config, outcome, served, args, measured)
        else:
            outcome.command = f"-m {served.name}"
            if isinstance(llama, Exception):
                raise llama
            await run_llama_cpp(config, outcome, served, llama, args, measured)
    except Exception as exc:  # noqa: BLE001 - one failed configuration is a row, not the end of the run
        outcome.error = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        bench.log(f"{_name(config)}: FAILED: {outcome.error}")
    return outcome


def _name(config: Config) -> str:
    return f"{config.model.split()[0]} {config.system} {config.weights}"


def _slug(config: Config) -> str:
    return "".join(c if c.isalnum() else "-" for c in _name(config)).strip("-").lower()


def _command(config: Config, flags: tuple[str, ...]) -> str:
    if config.system == "braid":
        return " ".join(flags) or "(no format flags)"  # after its --model, once the file is known
    return ""  # llama.cpp's: its -m, once the file is known


def _with_log(exc: Exception, log_path: Path) -> Exception:
    """`exc`, with the last line of the server's log where that says why (an error, a traceback's end)."""
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.is_file() else []
    last = lines[-1].strip() if lines else ""
    if any(word in last.lower() for word in ("error", "exception", "abort", "failed", "not supported")):
        return RuntimeError(f"{str(exc).strip()}: {last}")
    return exc


# ---------------------------------------------------------------- the run


def braid_has_format_flags() -> bool:
    from braid_server import BRAID

    help_text = subprocess.run([str(BRAID), "serve", "--help"], capture_output=True, text=True).stdout
    return all(flag in help_text for flag in BRAID_FORMAT_FLAGS)


def _stream_counts(value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        sys.exit(f"--streams takes stream counts of 1 or more, comma-separated, not {value!r}")
    return counts


def _chosen(value: str, known, what: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    if unknown := set(chosen) - set(known):
        sys.exit(f"unknown {what}: {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    return chosen


async def run_all(args, command: str) -> FormatResults:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    models = {MODELS[m] for m in _chosen(args.models, MODELS, "models")}
    systems = set(_chosen(args.systems, SYSTEMS, "systems"))
    streams = sorted(set(_stream_counts(args.streams)))
    configs = [c for c in CONFIGS if c.model in models and c.system in systems]
    repeats = 1 if args.quick else args.repeats
    has_flags = braid_has_format_flags()

    llama = find_or_build_llama_cpp()
    files = make_files(models, llama)
    tokenizer = AutoTokenizer.from_pretrained(files["smollm.fp32"], local_files_only=True)
    measured = build_workloads(tokenizer, streams, quick=args.quick, repeats=repeats)
    single_new, multi_new = new_tokens(args.quick)

    info = machine.describe(args.threads).as_dict()
    info["vector_isa"] = machine.vector_isa()
    info["llama_cpp"] = getattr(llama, "build_info", f"absent ({llama})")
    settings = {
        "streams": streams,
        "single_new_tokens": single_new,
        "multi_new_tokens": multi_new,
        "repeats": repeats,
        "quick": args.quick,
        "braid_max_batch_size": braid_max_batch_size(measured),
        "llama_parallel": max(streams),
        "warm_up_requests": len(warm_up_requests(measured)),
        "seed": format_models.SEED,
        "disturbed_above": bench.DISTURBED_ABOVE,
    }
    results = FormatResults(info, settings, command)
    if not has_flags:
        results.notes.append(
            "This braid has no --dtype/--quantization flags yet: its fp32 row ran without "
            "them (the fp32 path it always had), the other braid rows could not run."
        )
    machine.wait_until_quiet([], threshold=bench.DISTURBED_ABOVE, max_wait_s=bench.QUIET_WAIT_S)
    results.bandwidth_gbs = machine.read_bandwidth_gbs(args.threads)
    bench.log(f"read bandwidth: {results.bandwidth_gbs:.1f} GB/s with {args.threads} threads")

    json_path = format_models.BENCH_DIR / f"formats-{time.strftime('%Y%m%d-%H%M%S')}.json"
    bench.log(f"results are saved as they come to {json_path}")
    for config in configs:
        results.outcomes.append(await run_config(config, files, llama, has_flags, args, measured))
        results.save(json_path)
    # Measured again at the end, when the machine may be quieter: the better of the two is the bound.
    machine.wait_until_quiet([], threshold=bench.DISTURBED_ABOVE, max_wait_s=bench.QUIET_WAIT_S)
    results.bandwidth_gbs = max(results.bandwidth_gbs, machine.read_bandwidth_gbs(args.threads))
    results.save(json_path)
    if results.machine["braid_commit"] != machine.braid_commit():
        results.notes.append(f"braid's server/ changed during the run (now {machine.braid_commit()}).")
    return results


def load(path: Path) -> FormatResults:
    """A run's saved results; one saved before configurations had roles gets them from CONFIGS."""
    results = FormatResults.load(path)
    roles = {(c.model, c.system, c.weights): c.role for c in CONFIGS}
    for outcome in results.outcomes:
        outcome.role = outcome.role or roles.get((outcome.model, outcome.system, outcome.weights), "")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = ".venv/bin/python benchmarks/formats.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = load(args.report_from) if args.report_from else asyncio.run(run_all(args, command.strip()))
    print("\n" + table(results) + "\n")
    if not args.no_docs:
        report.write_section(args.output, report.FORMATS_HEADING, markdown(results))
        bench.log(f"wrote the section {report.FORMATS_HEADING!r} of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a served braid's memory goes, step by step through one start (issue 40).

Starts `braid serve` in a child process of this script, as cli.main does, with snapshots of its
memory taken at each step: Python and braid's CLI imported, torch imported, transformers imported,
the model loaded (`loader.load`), the runner built (`ModelRunner.build`), the engine built, then,
asked for by this script over SIGUSR1, the server SERVING, idle a while, after its first request,
after a warm-up of concurrent requests, idle 3 s after them, and after a malloc_trim(0) of its own
(what glibc's heaps still held free). A snapshot is /proc/self/smaps split by kind of mapping
(glibc's main heap, its other arenas, the KV cache's mapping, other anonymous mappings, shared
libraries, other mapped files), VmRSS, VmHWM, the thread count and glibc's mallinfo2 (bytes in use
and free in its arenas). Several starts give the median of each figure.

    .venv/bin/python benchmarks/memory_steps.py [--model FILE] [--starts 3] [-- braid serve flags]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
_ARENA = 64 * MIB  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heap is a 64 MiB-aligned reservation
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
KINDS = ("heap", "arenas", "kv_cache", "anon_other", "libraries", "files", "stacks")


def smaps(pid: int | str = "self", kv_starts: set[int] = frozenset()) -> dict[str, float]:
    """Resident MiB of the process by kind of mapping (KINDS), and anonymous MiB in all."""
    rss = dict.fromkeys(KINDS, 0.0)
    anonymous = 0.0
    kind = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        header = _MAPPING.match(line)
        if header:
            start, end, _perms, name = int(header[1], 16), int(header[2], 16), header[3], header[4]
            kind = _kind(start, end - start, name, kv_starts)
        elif line.startswith("Rss:"):
            rss[kind] += int(line.split()[1]) / 1024
        elif line.startswith("Anonymous:"):
            anonymous += int(line.split()[1]) / 1024
    return {**rss, "anonymous": anonymous}


def _kind(start: int, size: int, name: str, kv_starts: set[int]) -> str:
    if start in kv_starts:  # braid's KV cache: shared anonymous mappings (named /dev/zero)
        return "kv_cache"
    if name == "[heap]":
        return "heap"
    if name.startswith("[stack"):
        return "stacks"
    if name.startswith("["):  # [vdso], [vvar], [anon:...]
        return "anon_other"
    if name:
        return "libraries" if ".so" in Path(name).name else "files"
    if start % _ARENA == 0 and size <= _ARENA:  # the used part of an arena's reservation (the rest is ---p)
        return "arenas"
    return "anon_other"


def status(pid: int | str = "self") -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
        elif key == "Threads":
            fields[key] = int(value)
    return fields


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def mallinfo() -> dict[str, float]:
    """glibc's arenas (main and threads'): bytes obtained by brk/mmap for them (arena), held in large
    mmap'd chunks (hblkhd), in use (uordblks) and free inside them (fordblks), in MiB."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {f"malloc_{k}": getattr(info, k) / MIB for k in ("arena", "hblkhd", "uordblks", "fordblks")}


# --- the child: braid serve with snapshots ---------------------------------------------------------


def _child(out_path: str, argv: list[str]) -> int:
    out = open(out_path, "a")  # noqa: SIM115 (written until the process ends)
    kv: set[int] = set()  # where the KV cache's tensors start

    def snapshot(step: str) -> None:
        row = {"step": step, **status(), **smaps(kv_starts=kv), **mallinfo()}
        out.write(json.dumps(row) + "\n")
        out.flush()

    from braid.server import cli, resources

    snapshot("python and braid's CLI")
    resources.bound_spinning()  # as cli.main does, before torch loads libgomp
    return _serve_with_snapshots(cli, argv, snapshot, kv)


def _serve_with_snapshots(cli, argv, snapshot, kv) -> int:
    import torch  # noqa: F401

    snapshot("torch imported")
    import transformers  # noqa: F401

    snapshot("transformers imported")
    from braid.server.model import loader
    from braid.server.runner.model_runner import ModelRunner

    load, build, build_engine = loader.load, ModelRunner.build.__func__, cli.build_engine

    def load_with_snapshot(*args, **kwargs):
        model = load(*args, **kwargs)
        snapshot("model loaded")
        return model

    def build_with_snapshot(cls, *args, **kwargs):
        runner = build(cls, *args, **kwargs)
        kv.update(t.data_ptr() for t in (*runner.cache.k, *runner.cache.v))
        snapshot("runner built")
        return runner

    def build_engine_with_snapshot(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        snapshot("engine built")
        return engine

    loader.load = load_with_snapshot
    ModelRunner.build = classmethod(build_with_snapshot)
    cli.build_engine = build_engine_with_snapshot
    step_file = Path(os.environ["BRAID_STEP_FILE"] + ".step")  # the step the parent asks a snapshot of
    signal.signal(signal.SIGUSR1, lambda signum, frame: _asked(step_file.read_text(), snapshot))
    return cli.main(["serve", *argv])


def _asked(step: str, snapshot) -> None:
    """The parent's step; "malloc_trim": first hand glibc's free pages back, to show what they held."""
    if step == "malloc_trim":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if step == "tensors":
        _print_tensors()
    snapshot(step)


def _print_tensors(count: int = 12) -> None:
    """The largest tensors made since the server froze its objects (gc.freeze in app.py): what the
    requests left alive."""
    import gc

    import torch

    seen: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            seen.setdefault(obj.untyped_storage().data_ptr(), obj)
    for t in sorted(seen.values(), key=lambda t: -t.untyped_storage().nbytes())[:count]:
        print(f"tensor {t.untyped_storage().nbytes() / MIB:8.1f} MiB {tuple(t.shape)} {t.dtype}", flush=True)


def largest_files(pid: int | str = "self", count: int = 8) -> list[tuple[str, float]]:
    """The mapped files (shared libraries included) holding the most resident MiB."""
    held: dict[str, float] = {}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        header = _MAPPING.match(line)
        if header:
            name = header[4]
        elif line.startswith("Rss:") and name and not name.startswith("["):
            held[name] = held.get(name, 0.0) + int(line.split()[1]) / 1024
    return sorted(held.items(), key=lambda item: -item[1])[:count]


# --- the parent: one start, driven --------------------------------------------------------------


def one_start(flags: list[str], requests: int, files: bool = False) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from braid_testing.process import free_port

    from braid.client import Client

    port = free_port()
    out_path = tempfile.mktemp(prefix="braid-memory-steps-", suffix=".jsonl")
    log = open(out_path + ".log", "w")  # noqa: SIM115
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", out_path, "--", "--port", str(port), "--log-level", "warning", *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def ask(step: str) -> None:
        lines = _lines(out_path)
        Path(out_path + ".step").write_text(step)
        os.kill(child.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while len(_lines(out_path)) == len(lines) and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        with Client(f"127.0.0.1:{port}") as client:
            _wait_serving(client, child)
            ask("serving")
            time.sleep(5)
            ask("idle 5 s")
            client.generate("Hello, my name is", max_new_tokens=16, temperature=0)
            ask("first request")
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(requests) as pool:
                # 30-60 tokens each, as benchmarks/sizes.py's warm-up
                prompts = [
                    f"Request {i}: tell me about " + "the number and its story, " * (5 + i % 6) for i in range(requests)
                ]
                list(pool.map(lambda p: client.generate(p, max_new_tokens=16, temperature=0), prompts))
            ask(f"{requests} requests at once")
            time.sleep(3)
            ask("idle 3 s after them")
            if files:
                print("\n".join(f"{mib:8.1f} MiB  {name}" for name, mib in largest_files(child.pid)))
            ask("malloc_trim")
            if files:
                ask("tensors")
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        log.close()
    return _lines(out_path)


def _lines(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _wait_serving(client, child) -> None:
    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"braid serve exited {child.returncode}")
        try:
            if client._health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError("braid serve not SERVING")


def table(starts: list[list[dict]]) -> str:
    columns = ["VmRSS", "VmHWM", *KINDS, "anonymous", "malloc_arena", "malloc_fordblks", "Threads"]
    lines = ["| step | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for i, row in enumerate(starts[0]):
        values = [[start[i].get(c, float("nan")) for start in starts if i < len(start)] for c in columns]
        lines.append(f"| {row['step']} | " + " | ".join(f"{statistics.median(v):,.0f}" for v in values) + " |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        os.environ["BRAID_STEP_FILE"] = sys.argv[2]
        return _child(sys.argv[2], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="braid serve --model (default: the embedded model)")
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16, help="the warm-up's requests at once")
    parser.add_argument("--json", type=Path, help="write every start's rows here")
    parser.add_argument(
        "--files", action="store_true", help="print the mapped files holding the most, after the warm-up"
    )
    parser.add_argument("flags", nargs="*", help="more braid serve flags (after --)")
    args = parser.parse_args()
    flags = ["--threads", str(args.threads), *(["--model", args.model] if args.model else []), *args.flags]
    starts = [one_start(flags, args.requests, args.files) for _ in range(args.starts)]
    if args.json:
        args.json.write_text(json.dumps(starts, indent=1))
    print(f"braid serve {' '.join(flags)}: MiB, the median of {len(starts)} starts")
    print(table(starts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

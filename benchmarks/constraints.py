"""What structured output costs (issue 15), one run on one machine:

1. 16 streams at once, all constrained by one JSON schema, against 16 unconstrained streams of the
   same prompts: output tok/s, medians of --repeats runs, interleaved. Every stream generates
   exactly 64 tokens (the schema asks for a long string, so no constrained stream ends early).
2. Compile time of each schema of tests/test_constraints.py: cold (first time) and cached, in
   process, with braid's own compiler (engine/grammars.py) on the embedded model's vocabulary.

    .venv/bin/python benchmarks/constraints.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from braid.client import AsyncClient, json_schema
from braid.server.engine.grammars import Grammars
from braid.server.engine.types import Constraint
from braid.server.model.loader import default_cache_dir, resolve
from braid_server import BraidProcess

import workloads
from features import tokens_per_second  # 64 new tokens per stream, ignore_eos, a fresh cache_salt each

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_constraints import SCHEMAS  # noqa: E402  (the schemas the tests validate against)

LONG_STRING = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "story"],
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "minLength": 400, "maxLength": 800},
    },
}


def compile_times(tokenizer) -> dict[str, tuple[float, float]]:
    """Per schema: (cold, cached) milliseconds to get a session's matcher."""
    grammars = Grammars(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    grammars.tokenizer()  # built once at start-up by the server, not per request
    times = {}
    for name, schema in {**SCHEMAS, "long string (benchmark)": LONG_STRING}.items():
        constraint = Constraint("json_schema", json.dumps(schema), "constraint.json_schema")
        measured = []
        for _ in range(2):
            start = time.perf_counter()
            grammars.matcher(constraint)
            measured.append((time.perf_counter() - start) * 1000)
        times[name] = (measured[0], measured[1])
    grammars.close()
    return times


async def main(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve(None, default_cache_dir())[1])
    for name, (cold, cached) in compile_times(tokenizer).items():
        print(f"compile {name}: cold {cold:.2f} ms, cached {cached:.3f} ms")
    requests = workloads.PromptMaker(tokenizer).batch(16, 30, 60)
    constraint = json_schema(LONG_STRING)
    server = BraidProcess(["--mode", "continuous", "--threads", str(args.threads), "--log-level", "warning"])
    try:
        async with AsyncClient(server.target) as client:
            await tokens_per_second(client, requests[:4])  # warm-up
            await tokens_per_second(client, requests[:4], constraint=constraint)
            plain, constrained = [], []
            for _ in range(args.repeats):
                plain.append(await tokens_per_second(client, requests))
                constrained.append(await tokens_per_second(client, requests, constraint=constraint))
    finally:
        server.stop()
    a, b = statistics.median(plain), statistics.median(constrained)
    print(
        f"16 streams, output tok/s: {a:.1f} unconstrained, {b:.1f} all JSON-schema constrained ({b / a:.3f}x); "
        f"runs: {[round(x, 1) for x in plain]} / {[round(x, 1) for x in constrained]}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    asyncio.run(main(parser.parse_args()))

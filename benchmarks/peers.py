"""Hugging Face transformers peers, run in-process (their best case: no server, no network), on the
same model folder braid serves, in fp32, with the same prompts and exactly the same token counts.

- `generate`, one request at a time (requests that arrive together wait for those before them);
- `generate` on one left-padded static batch of all the requests;
- transformers' own continuous batching, `generate_batch`, with its manager kept between calls
  (`persistent_manager=True`): made and sized by a warm-up call on the same requests, so that the
  ~5-15 s it takes to start one is not measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from metrics import StreamTiming
from workloads import Request

SEQUENTIAL, STATIC, CONTINUOUS = "sequential", "static", "generate_batch"


@dataclass
class HFModel:
    model: object  # transformers PreTrainedModel, fp32 on the CPU
    pad_token_id: int


def load(model_path: str, threads: int) -> HFModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype="float32")
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFModel(model, pad)


class _StepClock:
    """A transformers streamer that only notes when each generation step's tokens come out."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.step_times.append(time.perf_counter())
        self._seen_prompt = True  # generate() puts the prompt first

    def end(self) -> None:
        pass


def warm_up(peer: str, hf: HFModel, requests: list[Request]) -> None:
    """Runs what a measured run will run once, unmeasured; generate_batch gets a fresh manager sized
    for these requests."""
    if peer == CONTINUOUS:
        hf.model.destroy_cached_continuous_batching_manager()
        run(peer, hf, requests)
    else:
        run(peer, hf, [replace(r, max_new_tokens=8) for r in requests[:2]])


def run(peer: str, hf: HFModel, requests: list[Request]) -> tuple[list[StreamTiming], float]:
    """Every request's timing (all requests arrive at the start) and the wall time. (No
    inference_mode here: generate_batch's own thread would then find inference tensors.)"""
    return {SEQUENTIAL: _one_at_a_time, STATIC: _static_batch, CONTINUOUS: _generate_batch}[peer](hf, requests)


def _one_at_a_time(hf: HFModel, requests: list[Request]) -> tuple[list[StreamTiming], float]:
    start = time.perf_counter()
    timings = []
    for request in requests:
        clock = _StepClock()
        _generate(hf, [request.prompt_ids], request.max_new_tokens, clock)
        timings.append(StreamTiming(start, clock.step_times[0], clock.step_times[-1], len(clock.step_times)))
    return timings, timings[-1].last - start


def _static_batch(hf: HFModel, requests: list[Request]) -> tuple[list[StreamTiming], float]:
    start = time.perf_counter()
    clock = _StepClock()
    _generate(hf, [r.prompt_ids for r in requests], max(r.max_new_tokens for r in requests), clock)
    steps = clock.step_times
    return [StreamTiming(start, steps[0], steps[-1], len(steps)) for _ in requests], steps[-1] - start


def _generate(hf: HFModel, prompts: list[list[int]], max_new_tokens: int, clock: _StepClock) -> None:
    """Greedy generate on left-padded prompts; min_new_tokens makes the token count exact."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[hf.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=hf.pad_token_id,
        streamer=clock,
    )


def _generate_batch(hf: HFModel, requests: list[Request]) -> tuple[list[StreamTiming], float]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(r.max_new_tokens for r in requests),
        do_sample=False,
        eos_token_id=-1,  # -1: no end-of-sequence, every request runs to the end
        pad_token_id=hf.pad_token_id,
    )
    start = time.perf_counter()
    outputs = hf.model.generate_batch(
        inputs=[r.prompt_ids for r in requests],
        generation_config=config,
        record_timestamps=True,
        persistent_manager=True,
        warmup=False,
    )
    failed = [out.error for out in outputs.values() if out.error is not None]
    if failed or len(outputs) != len(requests):
        raise RuntimeError(f"generate_batch: {len(outputs)} of {len(requests)} requests came back; {failed[:1]}")
    timings = [
        StreamTiming(start, out.timestamps[0], out.timestamps[-1], len(out.generated_tokens))
        for out in outputs.values()
    ]
    return timings, max(t.last for t in timings) - start

"""Protobuf in, checked domain objects out, and back: the only place that knows both."""

from __future__ import annotations

import json
import math
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Mapping, Sequence

from braid.server.engine.types import (
    Constraint,
    EngineStats,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidArgument,
    Message,
    ModelInfo,
    Priority,
    SamplingParams,
    Turn,
    text_bytes,
)
from braid.server.runner.rows import AdapterInfo
from braid.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from braid.server.runner.rows import TokenLogprob

MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 64
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_BYTES = 128
MAX_CACHE_SALT_BYTES = 256
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI's
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 16
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_TEXT_BYTES = 1 << 20  # a prompt, or all messages together
MAX_CONSTRAINT_BYTES = 64 << 10  # a schema, regex or grammar
MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 1024
_GRAMMAR_SYNTAX = {pb.GRAMMAR_SYNTAX_LARK: "lark", pb.GRAMMAR_SYNTAX_GBNF: "gbnf"}


def messages_from_pb(messages: Sequence[pb.Message], field_name: str = "messages") -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidArgument(f"{field_name}[{i}].role", "is required")
        out.append(Message(role=m.role, content=m.content))
    return tuple(out)


def _exactly_one(text: str, messages: Sequence[Turn], text_field: str) -> None:
    if text and messages:
        raise InvalidArgument(text_field, f"set either {text_field} or messages, not both")
    if not text and not messages:
        raise InvalidArgument(text_field, f"set {text_field} or messages")


def _in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    if math.isnan(value) or value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise InvalidArgument(name, f"{value} is outside {bracket}{lo}, {hi}]")


def request_from_pb(
    req: pb.GenerateRequest, default_max_new_tokens: int, vocab_size: int, time_remaining: float | None
) -> GenerationRequest:
    """Checks every field (the engine checks the prompt's length once it is tokenized)."""
    _exactly_one(req.prompt, req.messages, "prompt")
    _not_too_long(req.prompt, req.messages, "prompt")
    if req.max_new_tokens < 0:
        raise InvalidArgument("max_new_tokens", f"{req.max_new_tokens} is negative")
    if req.min_new_tokens < 0:
        raise InvalidArgument("min_new_tokens", f"{req.min_new_tokens} is negative")
    max_new = req.max_new_tokens or default_max_new_tokens
    if req.min_new_tokens > max_new:
        raise InvalidArgument("min_new_tokens", f"{req.min_new_tokens} is more than max_new_tokens ({max_new})")
    _in_range("temperature", req.temperature, 0.0, MAX_TEMPERATURE)
    _in_range("top_p", req.top_p, 0.0, 1.0)
    _in_range("top_k", req.top_k, 0, vocab_size)
    _in_range("min_p", req.min_p, 0.0, 1.0)
    if req.repetition_penalty != 0.0:
        _in_range("repetition_penalty", req.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
    _in_range("presence_penalty", req.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _in_range("frequency_penalty", req.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    logit_bias = _logit_bias(req.logit_bias, vocab_size)
    if req.n > MAX_SAMPLES:
        raise InvalidArgument("n", f"{req.n} samples; at most {MAX_SAMPLES}")
    if req.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"{req.top_logprobs} is more than {MAX_TOP_LOGPROBS}")
    _strings("stop", req.stop, MAX_STOP_STRINGS)
    _strings("bad_words", req.bad_words, MAX_BAD_WORDS)
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("stop_token_ids", f"{len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    for i, t in enumerate(req.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")
    if len(req.request_id) > MAX_REQUEST_ID_BYTES or not all(" " <= c <= "~" for c in req.request_id):
        # it travels back as gRPC metadata, which holds printable ASCII only
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_BYTES} printable ASCII characters")
    if req.priority not in (pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH):
        raise InvalidArgument("priority", f"{req.priority} is not a Priority")
    if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument("cache_salt", f"is {len(req.cache_salt.encode())} bytes; at most {MAX_CACHE_SALT_BYTES}")
    deadlines = [t for t in (time_remaining, req.timeout_ms / 1000 if req.timeout_ms else None) if t is not None]
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=req.min_new_tokens,
        temperature=req.temperature,
        top_p=req.top_p or 1.0,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=logit_bias,
        seed=req.seed if req.HasField("seed") else secrets.randbits(63),
        stop=tuple(req.stop),
        include_stop_sequence=req.include_stop_sequence,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs or req.top_logprobs > 0,
        top_logprobs=req.top_logprobs,
        truncate_input_tokens=req.truncate_input_tokens,
        bad_words=tuple(req.bad_words),
        report_queue=req.report_queue,
        prompt_logprobs=req.prompt_logprobs,
        clip_max_new_tokens=req.max_new_tokens == 0,
        disable_speculation=req.disable_speculation,
    )
    return GenerationRequest(
        prompt=req.prompt or None,
        messages=messages_from_pb(req.messages),
        params=params,
        request_id=req.request_id or uuid.uuid4().hex,
        deadline=time.monotonic() + min(deadlines) if deadlines else None,
        priority=Priority.BATCH if req.priority == pb.PRIORITY_BATCH else Priority.INTERACTIVE,
        cache_salt=req.cache_salt,
        n=req.n or 1,
        constraint=constraint_from_pb(req),
        resume_token_ids=_resume_token_ids(req, vocab_size),
        adapter=req.adapter,
    )


def _resume_token_ids(req: pb.GenerateRequest, vocab_size: int) -> tuple[int, ...]:
    if req.resume_token_ids and req.n > 1:
        raise InvalidArgument("resume_token_ids", "resume one sample at a time (n = 1)")
    for i, t in enumerate(req.resume_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"resume_token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")
    return tuple(req.resume_token_ids)


def constraint_from_pb(req: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint, its sizes checked (the engine's compiler checks the rest)."""
    if not req.HasField("constraint"):
        return None
    c = req.constraint
    kind: str | None = c.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint", "set one of json_schema, json_object, regex, choice and grammar")
    if kind == "json_object":
        if not c.json_object:
            raise InvalidArgument("constraint.json_object", "must be true (or leave the constraint out)")
        return Constraint("json_object", "", "constraint.json_object")
    if kind == "choice":
        choices = list(c.choice.choices)
        if not choices or len(choices) > MAX_CHOICES:
            raise InvalidArgument("constraint.choice.choices", f"{len(choices)} choices; 1 to {MAX_CHOICES}")
        for i, choice in enumerate(choices):
            if not choice or len(choice.encode()) > MAX_CHOICE_BYTES:
                raise InvalidArgument(f"constraint.choice.choices[{i}]", f"must be 1 to {MAX_CHOICE_BYTES} bytes")
        return Constraint("choice", json.dumps(choices), "constraint.choice.choices")
    if kind == "grammar":
        if c.grammar.syntax not in _GRAMMAR_SYNTAX:
            raise InvalidArgument(
                "constraint.grammar.syntax", "name the grammar's dialect: GRAMMAR_SYNTAX_LARK or GRAMMAR_SYNTAX_GBNF"
            )
        kind, text, field = _GRAMMAR_SYNTAX[c.grammar.syntax], c.grammar.text, "constraint.grammar.text"
    else:
        text, field = getattr(c, kind), f"constraint.{kind}"
    if not text:
        raise InvalidArgument(field, "is empty")
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(field, f"is {len(text.encode())} bytes; at most {MAX_CONSTRAINT_BYTES}")
    return Constraint(kind, text, field)


def _strings(name: str, values: Sequence[str], most: int) -> None:
    """A repeated string field (stop, bad_words): at most `most`, none empty or over MAX_STOP_BYTES."""
    if len(values) > most:
        raise InvalidArgument(name, f"{len(values)} strings; at most {most}")
    for i, value in enumerate(values):
        if not value:
            raise InvalidArgument(f"{name}[{i}]", "is empty")
        if len(value.encode()) > MAX_STOP_BYTES:
            raise InvalidArgument(f"{name}[{i}]", f"is longer than {MAX_STOP_BYTES} bytes")


def _logit_bias(bias: Mapping[int, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument("logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"logit_bias[{token}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
        _in_range(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted(bias.items()))


def _not_too_long(text: str, messages: Sequence[Turn], text_field: str) -> None:
    size = text_bytes(text, messages)
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument(text_field if text else "messages", f"is {size} bytes; at most {MAX_TEXT_BYTES}")


def tokenize_args_from_pb(req: pb.TokenizeRequest) -> tuple[str | None, tuple[Message, ...]]:
    _exactly_one(req.text, req.messages, "text")
    _not_too_long(req.text, req.messages, "text")
    return req.text or None, messages_from_pb(req.messages)


def final_to_pb(finished: Finished, request_id: str, seed: int) -> pb.GenerateResponse:
    t = finished.timings
    return pb.GenerateResponse(
        finish_reason=pb.FinishReason.ValueType(finished.reason.value),
        usage=pb.Usage(
            prompt_tokens=finished.prompt_tokens,
            generated_tokens=finished.generated_tokens,
            cached_tokens=finished.cached_tokens,
            truncated_tokens=finished.truncated_tokens,
            proposed_tokens=finished.proposed_tokens,
            accepted_tokens=finished.accepted_tokens,
        ),
        request_id=request_id,
        seed=seed,
        stop_sequence=finished.stop_sequence,
        timings=pb.Timings(
            queue_ms=t.queue_ms,
            time_to_first_token_ms=t.time_to_first_token_ms,
            total_ms=t.total_ms,
            tokens_per_second=t.tokens_per_second,
        ),
    )


def logprobs_to_pb(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    """runner.rows.TokenLogprob (read by attribute: the edge imports no runner but for its type) to protobuf."""
    return [
        pb.TokenLogprob(logprob=lp.logprob, rank=lp.rank, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        for lp in logprobs
    ]


def adapter_to_pb(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=info.name,
        path=info.path,
        rank=info.rank,
        alpha=info.alpha,
        scale=info.scale,
        target_modules=info.target_modules,
    )


def model_info_to_pb(info: ModelInfo, adapters: Sequence[AdapterInfo] = ()) -> pb.ModelInfoResponse:
    """adapters: the LoRA adapters loaded now."""
    return pb.ModelInfoResponse(
        adapters=[adapter_to_pb(a) for a in adapters],
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
        model_name=info.model_name,
        architecture=info.architecture,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        device=info.device,
        mode=pb.SchedulingMode.Value("SCHEDULING_MODE_" + info.mode.name),
        max_batch_size=info.max_batch_size,
        eos_token_ids=info.eos_token_ids,
        has_chat_template=info.has_chat_template,
        parameters=info.parameters,
        weight_formats=info.weight_formats,
        weight_bytes=info.weight_bytes,
        quantization=info.quantization,
        kernels=info.kernels,
        kv_cache_dtype=info.kv_cache_dtype,
        prefix_caching=info.prefix_caching,
        runner=info.runner,
        activations=info.activations,
        threads=info.threads,
        speculative=info.speculative,
        speculative_tokens=info.speculative_tokens,
        draft_model=info.draft_model,
        served_model_names=info.served_model_names or (info.model_name,),
        model_path=info.model_path,
        kv_cache_bytes=info.kv_cache_bytes,
    )


def stats_to_pb(stats: EngineStats, info: ModelInfo, uptime_s: float) -> pb.ServerStatusResponse:
    f = stats.finished
    return pb.ServerStatusResponse(
        sessions_active=stats.sessions_active,
        sessions_queued=stats.sessions_queued,
        tokens_generated=stats.tokens_generated,
        prompt_tokens=stats.prompt_tokens,
        sessions_finished=pb.FinishCounts(
            max_tokens=f[FinishReason.MAX_TOKENS],
            eos=f[FinishReason.EOS],
            stop_sequence=f[FinishReason.STOP_SEQUENCE],
            stop_token=f[FinishReason.STOP_TOKEN],
            cancelled=f[FinishReason.CANCELLED],
            deadline=f[FinishReason.DEADLINE],
            error=f[FinishReason.ERROR],
            constraint=f[FinishReason.CONSTRAINT],
            invalid_request=f[FinishReason.INVALID_REQUEST],
        ),
        forward_passes=stats.forward_passes,
        uptime_seconds=uptime_s,
        mode=pb.SchedulingMode.Value("SCHEDULING_MODE_" + info.mode.name),
        sessions_submitted=stats.sessions_submitted,
        sessions_paused=stats.sessions_paused,
        prompt_tokens_cached=stats.prompt_tokens_cached,
        prompt_tokens_computed=stats.prompt_tokens,
        preemptions=stats.preemptions,
        kv_evictions=stats.kv_evictions,
        kv_pages_total=stats.kv_pages_total,
        kv_pages_used=stats.kv_pages_used,
        kv_pages_cached=stats.kv_pages_cached,
        kv_page_tokens=stats.kv_page_tokens,
        prefix_hit_ratio=stats.prompt_tokens_cached / max(1, stats.prompt_tokens_cached + stats.prompt_tokens),
        speculative_proposed_tokens=stats.speculative_proposed_tokens,
        speculative_accepted_tokens=stats.speculative_accepted_tokens,
        speculative_acceptance_rate=stats.speculative_accepted_tokens / max(1, stats.speculative_proposed_tokens),
    )

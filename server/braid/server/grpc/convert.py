"""Protobuf in, domain objects out, and back: the only place that knows both. A request is checked
by the checks every front end shares (frontend/checks.py) once it is the engine's; here, only what
protobuf alone can get wrong (an enum value the .proto does not name, a oneof left unset)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Sequence

from google.protobuf import message as protobuf

from braid.server.engine.types import (
    AdapterInfo,
    Constraint,
    EmbeddingRequest,
    EngineStats,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidArgument,
    Message,
    ModelInfo,
    Pooling,
    Priority,
    SamplingParams,
    TokenLogprob,
)
from braid.server.engine.kv_events import KvEvent, PageEvicted, PageStored
from braid.server.frontend import checks, tool_plan
from braid.server.frontend.embeddings import check_embedding
from braid.server.frontend.tools import ToolCall
from braid.v1 import generate_pb2 as pb

_GRAMMAR_SYNTAX = {pb.GRAMMAR_SYNTAX_LARK: "lark", pb.GRAMMAR_SYNTAX_GBNF: "gbnf"}


_TOOL_CHOICE_MODES = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: None,
    pb.TOOL_CHOICE_MODE_AUTO: tool_plan.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: tool_plan.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: tool_plan.REQUIRED,
}


def messages_from_pb(messages: Sequence[pb.Message]) -> tuple[Message, ...]:
    """The chat's turns, an assistant's calls as OpenAI's chat gives them to the template."""
    return tuple(
        Message(role=m.role, content=m.content, tool_calls=_calls_json(m.tool_calls), tool_call_id=m.tool_call_id)
        for m in messages
    )


def _calls_json(calls: Sequence[pb.ToolCall]) -> str:
    if not calls:
        return ""
    made = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return json.dumps(made)


def request_from_pb(
    req: pb.GenerateRequest, default_max_new_tokens: int, vocab_size: int, time_remaining: float | None
) -> GenerationRequest:
    """The request, every field checked (the engine checks the prompt's length once it is tokenized)."""
    return planned_from_pb(req, default_max_new_tokens, vocab_size, time_remaining)[0]


def planned_from_pb(
    req: pb.GenerateRequest,
    default_max_new_tokens: int,
    vocab_size: int,
    time_remaining: float | None,
    takes_tools: bool = True,
) -> tuple[GenerationRequest, tool_plan.ToolPlan]:
    """The request, every field checked, with its tools (tool_plan.plan_tools: a forced call's
    constraint, the tools for the chat template, or in its system message where it does not render
    them, takes_tools False) and how its output is read for calls."""
    deadlines = [t for t in (time_remaining, req.timeout_ms / 1000 if req.timeout_ms else None) if t is not None]
    params = SamplingParams(
        max_new_tokens=req.max_new_tokens or default_max_new_tokens,
        min_new_tokens=req.min_new_tokens,
        **checks.sampling_values(lambda name: _given(req, name)),
        logit_bias=tuple(sorted(req.logit_bias.items())),
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
        skip_detokenize=req.skip_detokenize,
        max_reasoning_tokens=req.max_reasoning_tokens if req.HasField("max_reasoning_tokens") else None,
    )
    request = GenerationRequest(
        prompt=req.prompt or None,
        messages=messages_from_pb(req.messages),
        params=params,
        request_id=req.request_id or uuid.uuid4().hex,
        deadline=time.monotonic() + min(deadlines) if deadlines else None,
        priority=Priority.BATCH if req.priority == pb.PRIORITY_BATCH else Priority.INTERACTIVE,
        cache_salt=req.cache_salt,
        n=req.n or 1,
        resume_token_ids=tuple(req.resume_token_ids),
        adapter=req.adapter,
        prompt_token_ids=tuple(req.prompt_token_ids),
        chat_template_kwargs=checks.with_enable_thinking(
            "", req.enable_thinking if req.HasField("enable_thinking") else None
        ),
    )
    checks.check_request(request, vocab_size)
    if req.priority not in (pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH):
        raise InvalidArgument("priority", f"{req.priority} is not a Priority")
    request = dataclasses.replace(request, constraint=constraint_from_pb(req))
    return tool_plan.plan_tools(request, *tools_from_pb(req), takes_tools=takes_tools)


def _given(req: protobuf.Message, name: str) -> float | None:
    """A sampling parameter's field (checks.sampling_values): its value, or None where the field
    has presence (proto3 `optional`) and is unset."""
    value: float = getattr(req, name)
    has_presence = req.DESCRIPTOR.fields_by_name[name].has_presence
    return value if not has_presence or req.HasField(name) else None


def tools_from_pb(req: pb.GenerateRequest) -> tuple[list[dict[str, Any]], str | None, str | None, bool]:
    """The request's tools as OpenAI's definitions (what chat templates take), its tool_choice's
    mode or function, and whether a required call may be several."""
    definitions = definitions_from_pb(req.tools)
    choice = req.tool_choice
    which = choice.WhichOneof("choice") if req.HasField("tool_choice") else None
    if which == "mode" and choice.mode not in _TOOL_CHOICE_MODES:
        raise InvalidArgument("tool_choice.mode", f"{choice.mode} is not a ToolChoiceMode")
    mode = _TOOL_CHOICE_MODES[choice.mode] if which == "mode" else None
    return definitions, mode, choice.function if which == "function" else None, not choice.disable_parallel_tool_calls


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(field, f"is not JSON: {exc}") from None


def definitions_from_pb(tools: Sequence[pb.Tool]) -> list[dict[str, Any]]:
    """Tools as OpenAI's definitions, what chat templates take."""
    definitions = []
    for i, tool in enumerate(tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = _json(tool.parameters, f"tools[{i}].parameters")
        definitions.append({"type": "function", "function": function})
    return definitions


def tool_calls_to_pb(calls: Sequence[ToolCall]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


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
        return checks.choice(c.choice.choices, "constraint.choice.choices")
    if kind == "grammar":
        if c.grammar.syntax not in _GRAMMAR_SYNTAX:
            raise InvalidArgument(
                "constraint.grammar.syntax", "name the grammar's dialect: GRAMMAR_SYNTAX_LARK or GRAMMAR_SYNTAX_GBNF"
            )
        return checks.constraint(_GRAMMAR_SYNTAX[c.grammar.syntax], c.grammar.text, "constraint.grammar.text")
    return checks.constraint(kind, getattr(c, kind), f"constraint.{kind}")


def tokenize_args_from_pb(
    req: pb.TokenizeRequest, takes_tools: bool = True
) -> tuple[str | None, tuple[Message, ...], bool, str, str]:
    """The engine's tokenize arguments (after its ticket): text, messages, offsets, and a chat's
    tools and template variables as a GenerateRequest's become them (takes_tools: whether the
    model's chat template renders tools, ModelInfo's chat_template_takes_tools)."""
    messages = messages_from_pb(req.messages)
    checks.check_text(req.text, messages, "text")
    enable_thinking = req.enable_thinking if req.HasField("enable_thinking") else None
    if not messages and req.tools:
        raise InvalidArgument("tools", "are rendered with a chat: send messages, not text")
    if not messages and enable_thinking is not None:
        raise InvalidArgument("enable_thinking", "is the chat template's: send messages, not text")
    messages, tools = tool_plan.tokenized_tools(messages, definitions_from_pb(req.tools), takes_tools)
    template_kwargs = checks.with_enable_thinking("", enable_thinking)
    return req.text or None, messages, req.return_offsets, tools, template_kwargs


def tokenize_to_pb(ids: list[int], pieces: list[str], offsets: list[tuple[int, int]]) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(
        token_ids=ids, pieces=pieces, offsets=[pb.TokenOffset(start=start, end=end) for start, end in offsets]
    )


def detokenize_args_from_pb(req: pb.DetokenizeRequest, vocab_size: int) -> list[int]:
    ids = list(req.token_ids)
    checks.check_token_ids("token_ids", ids, vocab_size)
    return ids


def embedding_from_pb(req: pb.EmbedRequest, info: ModelInfo, time_remaining: float | None) -> EmbeddingRequest:
    """An Embed call's request, every field checked (the engine checks each input's length once
    it is tokenized)."""
    if req.pooling not in (pb.POOLING_UNSPECIFIED, pb.POOLING_LAST, pb.POOLING_MEAN):
        raise InvalidArgument("pooling", f"{req.pooling} is not a Pooling")
    if req.priority not in (pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH):
        raise InvalidArgument("priority", f"{req.priority} is not a Priority")
    request = EmbeddingRequest(
        texts=tuple(req.texts),
        token_ids=tuple(tuple(t.ids) for t in req.token_ids),
        request_id=req.request_id or uuid.uuid4().hex,
        pooling=Pooling(req.pooling) if req.pooling else None,
        normalize=req.normalize if req.HasField("normalize") else True,
        dimensions=req.dimensions,
        truncate_input_tokens=req.truncate_input_tokens,
        deadline=time.monotonic() + time_remaining if time_remaining is not None else None,
        priority=Priority.BATCH if req.priority == pb.PRIORITY_BATCH else Priority.INTERACTIVE,
    )
    check_embedding(request, info)
    return request


def embeddings_to_pb(request: EmbeddingRequest, finished: Sequence[Finished], pooling: Pooling) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=[
            pb.Embedding(values=f.embedding, prompt_tokens=f.prompt_tokens, truncated_tokens=f.truncated_tokens)
            for f in finished
        ],
        prompt_tokens=sum(f.prompt_tokens for f in finished),
        request_id=request.request_id,
        pooling=pb.Pooling.Value("POOLING_" + pooling.name),
    )


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
            reasoning_tokens=finished.reasoning_tokens,
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
    """The engine's TokenLogprob (the runner's, re-exported) to protobuf."""
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
        embedding_dimensions=info.embedding_dimensions,
        embedding_pooling=pb.Pooling.Value("POOLING_" + info.embedding_pooling.name),
        embedding_pooling_source=info.embedding_pooling_source,
    )


def kv_event_to_pb(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, PageStored):
        stored = pb.KvPageStored(
            hash=event.key,
            parent_hash=event.parent,
            num_tokens=event.num_tokens,
            cache_salt=event.cache_salt,
            adapter_key=event.adapter_key,
        )
        return pb.KvEvent(sequence=event.sequence, stored=stored)
    if isinstance(event, PageEvicted):
        return pb.KvEvent(sequence=event.sequence, evicted=pb.KvPageEvicted(hash=event.key))
    return pb.KvEvent(sequence=event.sequence, resync=pb.KvResync(oldest_sequence=event.sequence + 1))


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

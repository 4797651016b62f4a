"""OpenAI's requests to braid's GenerationRequest, built directly and checked by the checks every
front end shares (frontend/checks.py), so a field means the same over HTTP as over gRPC and is checked
once; an error names the OpenAI parameter it came from."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
import struct
import uuid
from dataclasses import dataclass

from braid.server.engine.types import Constraint, GenerationRequest, InvalidArgument, Message, Priority, SamplingParams
from braid.server.frontend import checks
from braid.server.frontend.tool_plan import ToolPlan, plan_tools
from braid.server.http.protocol import ChatMessage, ChatRequest, CompletionRequest, NamedToolChoice, ResponseFormat

OPENAI_TEMPERATURE = 1.0  # OpenAI's default where a request leaves it out (braid's gRPC default: 0, greedy)


@dataclass(frozen=True)
class Plan:
    """A checked request and how its output is read back: `tools` is how tool calls are found
    (None: plain content; "auto": parsed from free output; "forced": the output is the call, of
    `function` or, with None, of any tool)."""

    request: GenerationRequest
    tools: str | None = None
    function: str | None = None
    include_usage: bool = False
    logprobs: bool = False
    tool_names: tuple[str, ...] = ()

    @property
    def tool_plan(self) -> ToolPlan:
        """How its output is read for tool calls, as every front end reads it (frontend/tool_plan.py)."""
        return ToolPlan(self.tools, self.function, self.tool_names)


def chat_plan(body: ChatRequest, default_max_new_tokens: int, vocab_size: int, takes_tools: bool = True) -> Plan:
    """takes_tools: whether the model's chat template renders `tools` (ModelInfo's
    chat_template_takes_tools); where it does not, they go into the system message."""
    messages = tuple(_message(i, m) for i, m in enumerate(body.messages))
    if not messages:
        raise InvalidArgument("messages", "must not be empty")
    if body.top_logprobs and not body.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    max_tokens = _one_of_max(body)
    req = _generation_request(
        body,
        max_tokens,
        default_max_new_tokens,
        vocab_size,
        is_chat=True,
        messages=messages,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
    )
    choice, function = _tool_choice(body)
    budget = _reasoning_budget(body)
    req = dataclasses.replace(
        req,
        params=dataclasses.replace(req.params, max_reasoning_tokens=budget),
        constraint=_format_constraint(body.response_format),
        chat_template_kwargs=json.dumps(body.chat_template_kwargs) if body.chat_template_kwargs else "",
    )
    req, tools = plan_tools(
        req,
        [t.model_dump(exclude_none=True) for t in body.tools or ()],
        choice,
        function,
        parallel=body.parallel_tool_calls is not False,
        takes_tools=takes_tools,
        spelling=openai_name,
    )
    return Plan(req, tools.mode, tools.function, _include_usage(body), body.logprobs, tools.names)


def _reasoning_budget(body: ChatRequest) -> int | None:
    """The reasoning budget a chat asks for: reasoning_effort's, or max_reasoning_tokens."""
    if body.max_reasoning_tokens is None:
        return checks.effort_budget(body.reasoning_effort, "reasoning_effort")
    if body.reasoning_effort is not None:
        raise InvalidArgument("max_reasoning_tokens", "set reasoning_effort or max_reasoning_tokens, not both")
    if body.max_reasoning_tokens < 0:
        raise InvalidArgument("max_reasoning_tokens", f"{body.max_reasoning_tokens} is negative")
    return body.max_reasoning_tokens


def completion_plan(body: CompletionRequest, default_max_new_tokens: int, vocab_size: int) -> Plan:
    prompt, ids, ids_name = _completion_prompt(body.prompt)
    if body.echo:
        raise InvalidArgument("echo", "is not supported")
    if body.suffix:
        raise InvalidArgument("suffix", "is not supported")
    if body.best_of not in (None, 1, body.n):
        raise InvalidArgument("best_of", "is not supported; use n")
    if body.logprobs is not None and body.logprobs < 0:
        raise InvalidArgument("logprobs", f"{body.logprobs} is negative")
    req = _generation_request(
        body,
        body.max_tokens,
        default_max_new_tokens,
        vocab_size,
        is_chat=False,
        prompt=prompt,
        prompt_token_ids=ids,
        ids_name=ids_name,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )
    req = dataclasses.replace(req, constraint=_format_constraint(body.response_format))
    return Plan(req, include_usage=_include_usage(body), logprobs=body.logprobs is not None)


def _completion_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> tuple[str, tuple[int, ...], str]:
    """A completion's one prompt: its text, or its token ids (OpenAI's prompt: [1, 2, 3]) and how
    OpenAI names them (`prompt`, or `prompt[0]` for a batch of one). A batch of several prompts is
    refused: braid takes one per request."""
    if isinstance(prompt, str):
        return prompt, (), "prompt"
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    ids = tuple(t for t in prompt if isinstance(t, int))
    if len(ids) == len(prompt):
        return "", ids, "prompt"
    if len(prompt) != 1:
        raise InvalidArgument("prompt", f"{len(prompt)} prompts; braid takes one per request (use n for samples)")
    (one,) = prompt
    if isinstance(one, str):
        return one, (), "prompt"
    if isinstance(one, list) and one:
        return "", tuple(one), "prompt[0]"
    raise InvalidArgument("prompt[0]", "must not be empty")


def _one_of_max(body: ChatRequest) -> int | None:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidArgument("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _include_usage(body: ChatRequest | CompletionRequest) -> bool:
    if body.stream_options is not None and not body.stream:
        raise InvalidArgument("stream_options", "is only for stream: true")
    return body.stream_options is not None and body.stream_options.include_usage


def _generation_request(
    body: ChatRequest | CompletionRequest,
    max_tokens: int | None,
    default_max_new_tokens: int,
    vocab_size: int,
    is_chat: bool,
    logprobs: bool,
    top_logprobs: int,
    prompt: str = "",
    messages: tuple[Message, ...] = (),
    prompt_token_ids: tuple[int, ...] = (),
    ids_name: str = "prompt",
) -> GenerationRequest:
    """The body as braid's request, checked as gRPC's is (frontend/checks.py), its errors named as
    OpenAI names the parameter."""
    max_name = _max_name(body, is_chat)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(max_name, f"{max_tokens} is less than 1")
    if body.top_p == 0.0:  # OpenAI's top_p is in (0, 1]; braid's 0 means 'unset'
        raise InvalidArgument("top_p", "0.0 is outside (0.0, 1.0]")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    logit_bias, n = _logit_bias(body.logit_bias), _samples(body.n)
    for param, bounds, value in (
        (max_name, _INT32, max_tokens or 0),
        ("min_tokens", _INT32, body.min_tokens),
        ("n", _UINT32, n),
        ("seed", _UINT64, body.seed or 0),
        ("top_logprobs" if is_chat else "logprobs", _UINT32, top_logprobs),
        *((f"stop_token_ids[{i}]", _INT32, t) for i, t in enumerate(body.stop_token_ids or ())),
    ):
        _fits(param, bounds, value)
    params = SamplingParams(
        max_new_tokens=max_tokens or default_max_new_tokens,
        min_new_tokens=body.min_tokens,
        **checks.sampling_values(functools.partial(_given, body)),
        logit_bias=tuple(sorted((token, _float32(bias)) for token, bias in logit_bias.items())),
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        stop=tuple(stop),
        include_stop_sequence=body.include_stop_str_in_output,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
        clip_max_new_tokens=not max_tokens,
    )
    req = GenerationRequest(
        prompt=prompt or None,
        messages=messages,
        prompt_token_ids=prompt_token_ids,
        params=params,
        request_id=("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex,
        priority=Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE,
        cache_salt=body.cache_salt,
        n=n,
    )
    spelling = functools.partial(openai_name, max_name=max_name, is_chat=is_chat, ids_name=ids_name)
    checks.check_request(req, vocab_size, spelling)
    return req


def _given(body: ChatRequest | CompletionRequest, name: str) -> float | None:
    """A sampling parameter of the body by its name (checks.sampling_values), as the .proto would
    hold it: an integer within int32, a float as float32. Left out, temperature is OpenAI's default."""
    value = getattr(body, name)
    if value is None:
        return OPENAI_TEMPERATURE if name == "temperature" else None
    return _fits(name, _INT32, value) if isinstance(value, int) else _float32(value)


# The .proto's types, as gRPC's wire holds each field: an integer out of its type is refused naming
# the parameter (JSON's integers have no bound), and a float is the .proto's float32, so a value
# means over HTTP what it means over gRPC.
_INT32 = (-(1 << 31), (1 << 31) - 1)
_UINT32 = (0, (1 << 32) - 1)
_UINT64 = (0, (1 << 64) - 1)


def _fits(param: str, bounds: tuple[int, int], value: int) -> int:
    """value, if it is within `bounds`; else an error naming `param`."""
    lo, hi = bounds
    if value < lo:
        raise InvalidArgument(param, f"{value} is less than {lo}")
    if value > hi:
        raise InvalidArgument(param, f"{value} is more than {hi}")
    return value


def _float32(value: float) -> float:
    """value as a float32 holds it (past float32's range: infinity)."""
    rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    return rounded


def _max_name(body: ChatRequest | CompletionRequest, is_chat: bool) -> str:
    chat_max = is_chat and isinstance(body, ChatRequest) and body.max_completion_tokens is not None
    return "max_completion_tokens" if chat_max else "max_tokens"


# braid's field names -> OpenAI's, where they differ
_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "include_stop_sequence": "include_stop_str_in_output",
}


def openai_name(field: str, max_name: str = "max_tokens", is_chat: bool = True, ids_name: str = "prompt") -> str:
    """braid's name of a request field as OpenAI names the parameter (a checks.Spelling); a
    completion's prompt_token_ids are its prompt given as ids, named `ids_name` (prompt[3])."""
    tool = _TOOL_FIELD.fullmatch(field)
    if tool:  # braid's tools[i].name: OpenAI's tools[i].function.name
        return f"{tool[1]}.function.{tool[2]}"
    if field == "tool_choice.function":
        return "tool_choice.function.name"
    head, dot, rest = field.partition(".")
    if head == "max_new_tokens":
        return max_name
    if head == "top_logprobs" and not is_chat:
        return "logprobs"
    if head == "constraint":
        return "response_format"
    if head == "prompt" and is_chat:
        return "messages"
    if head.startswith("prompt_token_ids"):  # (only a completion's: a chat's prompt is its messages)
        return ids_name + head.removeprefix("prompt_token_ids") + dot + rest
    return _RENAMES.get(head, head) + dot + rest


_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.(name|parameters)")


def openai_error(exc: InvalidArgument) -> InvalidArgument:
    """An InvalidArgument about a field of braid's request (the engine's), named as OpenAI names it."""
    return InvalidArgument(openai_name(exc.field), exc.description)


def _samples(n: int | None) -> int:
    if n is not None and n < 1:
        raise InvalidArgument("n", f"{n} is less than 1")
    if n is not None and n > checks.MAX_SAMPLES:  # (before _fits sees 1e10)
        raise InvalidArgument("n", f"{n} samples; at most {checks.MAX_SAMPLES}")
    return n or 1


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument(f"logit_bias[{key}]", f"{key!r} is not a token id") from None
        out[_fits(f"logit_bias[{key}]", _INT32, token)] = value  # the .proto's map<int32, float>
    return out


def _message(i: int, m: ChatMessage) -> Message:
    field = f"messages[{i}]"
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise InvalidArgument(f"{field}.content[{j}].type", f"{part.type!r}: braid takes text parts only")
            texts.append(part.text)
        content = "".join(texts)
    else:
        content = m.content or ""
    calls = json.dumps([c.model_dump() for c in m.tool_calls]) if m.tool_calls else ""
    return Message(role=m.role, content=content, tool_calls=calls, tool_call_id=m.tool_call_id or "")


def _tool_choice(body: ChatRequest) -> tuple[str | None, str | None]:
    """The body's tool_choice as tool_plan takes it: a mode, or the named function."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return None, body.tool_choice.function.name
    return body.tool_choice, None


def _format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", "", "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidArgument("response_format.json_schema.schema", "is required for type json_schema")
    # braid holds every schema strictly, strict: true or not: its output always validates
    return checks.constraint("json_schema", json.dumps(fmt.json_schema.schema_), "response_format.json_schema.schema")

"""Building braid.v1 requests from plain Python values, shared by the sync and async clients."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from typing_extensions import Unpack

from braid.v1 import generate_pb2 as pb

# A chat turn: ("user", "hi"), {"role": "user", "content": "hi"} or a braid.v1 Message. A dict may
# carry OpenAI's tool turns too: an assistant's "tool_calls" (each a ToolCall, OpenAI's
# {"id", "type": "function", "function": {"name", "arguments"}} or {"id", "name", "arguments"}),
# a tool result's "tool_call_id".
MessageLike = tuple[str, str] | Mapping[str, Any] | pb.Message
# A tool: a braid.v1 Tool (tool()), OpenAI's {"type": "function", "function": {"name",
# "description", "parameters"}} or its function alone; parameters a JSON Schema, as a dict or text.
ToolLike = pb.Tool | Mapping[str, Any]
# A tool_choice: "auto", "none", "required", OpenAI's {"type": "function", "function": {"name": ...}},
# or a braid.v1 ToolChoice (function_choice(name)).
ToolChoiceLike = str | Mapping[str, Any] | pb.ToolChoice
Chat = Iterable[MessageLike]

# GenerateRequest fields that `**params` may set: all but the input (prompt, messages).
PARAMS = tuple(f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.name not in ("prompt", "messages"))


class GenerateParams(TypedDict, total=False):
    """The GenerateRequest fields that stream() and generate() take as keyword arguments.

    One key per field but prompt and messages; protos/braid/v1/generate.proto documents
    each. None, like leaving a key out, keeps the server's default. A single string is
    accepted for stop and bad_words, and a single int for stop_token_ids and
    resume_token_ids. prompt_token_ids is the third kind of input, instead of prompt and
    messages.
    """

    max_new_tokens: int | None
    min_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: int | Sequence[int] | None
    ignore_eos: bool | None
    request_id: str | None
    priority: pb.Priority.ValueType | None  # pb.PRIORITY_BATCH, pb.Priority.Value("PRIORITY_BATCH")
    timeout_ms: int | None
    cache_salt: str | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int, float] | None  # token id -> bias
    include_stop_sequence: bool | None
    logprobs: bool | None
    top_logprobs: int | None
    truncate_input_tokens: int | None
    bad_words: str | Sequence[str] | None
    report_queue: bool | None
    n: int | None
    prompt_logprobs: bool | None
    constraint: pb.Constraint | None  # json_schema(...), json_object(), regex(...), choice(...), grammar(...)
    resume_token_ids: int | Sequence[int] | None  # the token ids a broken stream delivered, sent with its seed
    adapter: str | None  # a loaded LoRA adapter's name (ModelInfoResponse.adapters)
    disable_speculation: bool | None  # no speculative decoding for this request (the tokens are the same)
    prompt_token_ids: Sequence[int] | None  # a prompt already tokenized, instead of prompt and messages
    skip_detokenize: bool | None  # token_ids only, no text (stop strings then are refused)
    tools: Sequence[ToolLike] | None  # functions the model may call; calls come back in tool_calls
    tool_choice: ToolChoiceLike | None  # "auto" (the default with tools), "none", "required", a function
    enable_thinking: bool | None  # the chat template's switch: False turns a reasoning model's thinking off
    max_reasoning_tokens: int | None  # a reasoning model's budget: braid closes its reasoning there
    typical_p: float | None  # locally typical sampling, in (0, 1]; 1 (the default) is off


def json_schema(schema: Mapping[str, object] | str) -> pb.Constraint:
    """A constraint: the output is one JSON value valid against this JSON Schema (a dict or its text)."""
    return pb.Constraint(json_schema=schema if isinstance(schema, str) else json.dumps(schema))


def json_object() -> pb.Constraint:
    """A constraint: the output is any one JSON object."""
    return pb.Constraint(json_object=True)


def regex(pattern: str) -> pb.Constraint:
    """A constraint: the whole output matches this regular expression."""
    return pb.Constraint(regex=pattern)


def choice(choices: Iterable[str]) -> pb.Constraint:
    """A constraint: the output is exactly one of these strings."""
    return pb.Constraint(choice=pb.Choice(choices=list(choices)))


def grammar(text: str, syntax: str = "lark") -> pb.Constraint:
    """A constraint: the output is a sentence of this grammar, in syntax "lark" or "gbnf"."""
    syntax_value = pb.GrammarSyntax.Value(f"GRAMMAR_SYNTAX_{syntax.upper()}")
    return pb.Constraint(grammar=pb.Grammar(text=text, syntax=syntax_value))


def tool(name: str, description: str = "", parameters: Mapping[str, Any] | str | None = None) -> pb.Tool:
    """A tool the model may call: its name, what it does, and a JSON Schema of its arguments (a dict
    or its text; None: any object)."""
    schema = "" if parameters is None else parameters if isinstance(parameters, str) else json.dumps(parameters)
    return pb.Tool(name=name, description=description, parameters=schema)


def to_tool(value: ToolLike) -> pb.Tool:
    """Converts a tool (ToolLike) to a braid.v1 Tool."""
    if isinstance(value, pb.Tool):
        return value
    function = value.get("function", value)
    return tool(function["name"], function.get("description") or "", function.get("parameters"))


def function_choice(name: str) -> pb.ToolChoice:
    """A tool_choice: the model must call this tool, its arguments valid against its schema."""
    return pb.ToolChoice(function=name)


def to_tool_choice(value: ToolChoiceLike) -> pb.ToolChoice:
    """Converts a tool_choice (ToolChoiceLike) to a braid.v1 ToolChoice."""
    if isinstance(value, pb.ToolChoice):
        return value
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice {value!r}: one of auto, none and required (a function: function_choice())")
        return pb.ToolChoice(mode=pb.ToolChoiceMode.Value(f"TOOL_CHOICE_MODE_{value.upper()}"))
    return function_choice(value["function"]["name"])


def to_tool_call(value: pb.ToolCall | Mapping[str, Any]) -> pb.ToolCall:
    """Converts an earlier call (OpenAI's, or {"id", "name", "arguments"}) to a braid.v1 ToolCall."""
    if isinstance(value, pb.ToolCall):
        return value
    function = value.get("function", value)
    arguments = function.get("arguments") or "{}"
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return pb.ToolCall(id=value.get("id") or "", name=function["name"], arguments=text)


def to_message(turn: MessageLike) -> pb.Message:
    """Converts one chat turn to a braid.v1 Message."""
    if isinstance(turn, pb.Message):
        return turn
    if isinstance(turn, Mapping):
        return pb.Message(
            role=turn["role"],
            content=turn.get("content") or "",
            tool_call_id=turn.get("tool_call_id") or "",
            tool_calls=[to_tool_call(c) for c in turn.get("tool_calls") or ()],
        )
    role, content = turn
    return pb.Message(role=role, content=content)


def to_messages(messages: Chat) -> list[pb.Message]:
    """Converts a chat to braid.v1 Messages."""
    return [to_message(turn) for turn in messages]


def _check_one_input(text_name: str, text: str | None, messages: object, token_ids: object = None) -> None:
    if sum(given is not None for given in (text, messages, token_ids)) != 1:
        names = f"{text_name}, messages and prompt_token_ids" if token_ids is not None else f"{text_name} and messages"
        raise ValueError(f"set exactly one of {names}")


def build_request(
    prompt: str | None = None, *, messages: Chat | None = None, **params: Unpack[GenerateParams]
) -> pb.GenerateRequest:
    """Builds a GenerateRequest from a prompt, a chat or token ids (params' prompt_token_ids) and
    GenerateRequest fields (GenerateParams).

    Params left out or None keep the proto default (the server's default).

    Raises:
        ValueError: not exactly one of prompt, messages and prompt_token_ids is given.
        TypeError: a param is not a GenerateRequest field (a caller mypy does not check).
    """
    _check_one_input("prompt", prompt, messages, params.get("prompt_token_ids"))
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise TypeError(f"unknown GenerateRequest parameter(s): {', '.join(unknown)}")
    request = pb.GenerateRequest(prompt=prompt or "", messages=to_messages(messages or ()))
    request.tools.extend(to_tool(t) for t in params.pop("tools", None) or ())
    tool_choice = params.pop("tool_choice", None)
    if tool_choice is not None:
        request.tool_choice.CopyFrom(to_tool_choice(tool_choice))
    for name, value in params.items():
        if value is None:
            continue
        field = getattr(request, name)
        if isinstance(field, (str, int, float, bool)):
            setattr(request, name, value)
        elif isinstance(field, pb.Constraint) and isinstance(value, pb.Constraint):
            field.CopyFrom(value)
        elif hasattr(field, "update"):  # a map (logit_bias: token id -> bias)
            field.update(value)
        else:  # a repeated field
            field.extend([value] if isinstance(value, (str, int)) else value)
    return request


def build_tokenize_request(
    text: str | None = None,
    *,
    messages: Chat | None = None,
    return_offsets: bool = False,
    tools: Sequence[ToolLike] | None = None,
    enable_thinking: bool | None = None,
) -> pb.TokenizeRequest:
    """Builds a TokenizeRequest; exactly one of text and messages must be given (return_offsets:
    with text only; tools and enable_thinking: with messages, rendered as a generation's)."""
    _check_one_input("text", text, messages)
    request = pb.TokenizeRequest(
        text=text or "",
        messages=to_messages(messages or ()),
        return_offsets=return_offsets,
        tools=[to_tool(t) for t in tools or ()],
    )
    if enable_thinking is not None:
        request.enable_thinking = enable_thinking
    return request


_POOLINGS = {None: pb.POOLING_UNSPECIFIED, "last": pb.POOLING_LAST, "mean": pb.POOLING_MEAN}


def build_embed_request(
    inputs: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    dimensions: int = 0,
    truncate_input_tokens: int = 0,
    request_id: str = "",
) -> pb.EmbedRequest:
    """Builds an EmbedRequest: one text, a list of texts, or a list of token id lists (each one
    input); pooling "last" or "mean" (None: the model's); normalize None: the server's default
    (true)."""
    if pooling not in _POOLINGS:
        raise ValueError(f"pooling must be 'last', 'mean' or None, not {pooling!r}")
    items: list[str | Sequence[int]] = [inputs] if isinstance(inputs, str) else list(inputs)
    texts = [t for t in items if isinstance(t, str)]
    id_lists = [list(t) for t in items if not isinstance(t, str)]
    if texts and id_lists:
        raise ValueError("inputs are all texts or all token id lists, not a mix")
    request = pb.EmbedRequest(
        texts=texts,
        token_ids=[pb.TokenIds(ids=ids) for ids in id_lists],
        pooling=_POOLINGS[pooling],
        dimensions=dimensions,
        truncate_input_tokens=truncate_input_tokens,
        request_id=request_id,
    )
    if normalize is not None:
        request.normalize = normalize
    return request

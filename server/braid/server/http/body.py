"""A request's body, from bytes to its pydantic model: JSON, an object, no deeper than
MAX_JSON_DEPTH, with no lone surrogate in any string, and pydantic's errors named as OpenAI names a
parameter (`messages[0].role`). Everything here grows with the body (up to --max-message-bytes), so
`read` runs it off the event loop.

Why by hand: json.loads has no depth option (past about 1,000 levels it raises RecursionError, and
json.dumps and pydantic give up at their own depths later), and a lone surrogate (`"\\ud800"`, valid
JSON) is a str that no UTF-8 encoder takes: protobuf, the tokenizer and the response's own JSON all
raised on one. One iterative walk refuses both, naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import pydantic
from starlette.requests import ClientDisconnect, Request

from braid.server.engine.types import InvalidArgument
from braid.server.http.errors import ApiError

Body = TypeVar("Body", bound=pydantic.BaseModel)

# serde_json's default recursion limit (the constraint compiler reads schemas with it); far deeper
# than any real schema or message, and well inside what json, pydantic and protobuf can take
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how one gets into JSON text: raw UTF-8 cannot hold it
# where a client's own JSON schema begins: a fault below one is named by the schema's field
_SCHEMA_ROOTS = (
    ("tools", int, "function", "parameters"),
    ("response_format", "json_schema", "schema"),
    ("tools", int, "input_schema"),  # Anthropic's
    ("output_config", "format", "schema"),
    ("tools", int, "parameters"),  # the Responses API's
    ("text", "format", "schema"),
)

Path = tuple[Any, ...]  # a linked list, (key, parent path) or (): one tuple per value walked, not a copy per depth


async def read(request: Request, model: type[Body], most_bytes: int) -> Body:
    """The body as `model`, read up to `most_bytes` (--max-message-bytes, as over gRPC), then
    decoded and checked off the event loop: that work grows with the body."""
    body, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > most_bytes:
                raise ApiError(
                    413, "invalid_request_error", f"the body is over {most_bytes} bytes (--max-message-bytes)", "body"
                )
            body.append(chunk)
    except ClientDisconnect:  # gone, or cut off by --http-body-timeout (http/connection.py)
        raise ApiError(499, "client_closed_request", "the client disconnected before its body was sent") from None
    return await asyncio.to_thread(decode, b"".join(body), model)


def decode(raw: bytes, model: type[Body]) -> Body:
    """The body as `model`, or InvalidArgument naming the field at fault."""
    try:
        text = raw.decode("utf-8-sig")  # JSON between systems is UTF-8 (RFC 8259); a BOM is let through
    except UnicodeDecodeError as exc:
        raise InvalidArgument("body", f"is not UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise InvalidArgument("body", f"is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        raise InvalidArgument("body", f"is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("body", "must be a JSON object")
    # walked only where the text could hold what the walk looks for: deep enough, or a surrogate's escape
    strings = _SURROGATE_ESCAPE.search(text) is not None
    if strings or text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        check(data, strings)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidArgument(param(first["loc"]), first["msg"]) from None


def check(data: dict[str, Any], strings: bool = True) -> None:
    """Refuses JSON nested past MAX_JSON_DEPTH and (with `strings`) strings, keys too, that hold a
    lone surrogate, naming the field: one pass over the containers, without recursion."""
    stack: list[tuple[Any, int, Path]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(_name(path, whole=False), f"is nested more than {MAX_JSON_DEPTH} levels deep")
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, (key, path)))
            elif strings and isinstance(item, str) and _has_surrogate(item):
                raise InvalidArgument(
                    _name((key, path)), "holds a lone surrogate (\\ud800 to \\udfff), which is not text"
                )
            if strings and isinstance(key, str) and _has_surrogate(key):
                raise InvalidArgument(_name(path), "has a key that holds a lone surrogate, which is not text")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _name(path: Path, whole: bool = True) -> str:
    """The parameter a path names: itself (whole) or its top-level field, or, below a client's
    schema, the schema's field (its own keys are no parameter)."""
    parts: list[Any] = []
    while path:
        key, path = path
        parts.append(key)
    parts.reverse()
    for root in _SCHEMA_ROOTS:
        head = parts[: len(root)]
        if len(head) == len(root) and all(r is int and isinstance(p, int) or r == p for r, p in zip(root, head)):
            return param(tuple(head))
    return param(tuple(parts if whole else parts[:1]))


def param(loc: tuple[int | str, ...]) -> str:
    """pydantic's location of an error as OpenAI names a parameter: messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            part in ("str", "list[str]", "list[ContentPart]", "function-after", "NamedToolChoice")
            or "literal" in str(part)
            or "[" in str(part)
        ):
            continue  # the branch of a union pydantic tried, not a field
        else:
            out += ("." if out else "") + str(part)
    return out or "body"

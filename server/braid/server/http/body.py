"""A request's body, from bytes to its pydantic model: JSON, an object, no deeper than
MAX_JSON_DEPTH, with no lone surrogate in any string, and pydantic's errors named as OpenAI names a
parameter (`messages[0].role`). Everything here grows with the body (up to --max-message-bytes), so
app.py runs it off the event loop.

Why by hand: json.loads has no depth option (past about 1,000 levels it raises RecursionError, and
json.dumps and pydantic give up at their own depths later), and a lone surrogate (`"\\ud800"`, valid
JSON) is a str that no UTF-8 encoder takes: protobuf, the tokenizer and the response's own JSON all
raised on one. One iterative walk refuses both, naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import pydantic

from braid.server.engine.types import InvalidArgument

Body = TypeVar("Body", bound=pydantic.BaseModel)

# serde_json's default recursion limit (the constraint compiler reads schemas with it); far deeper
# than any real schema or message, and well inside what json, pydantic and protobuf can take
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")
# where a client's own JSON schema begins: a fault below one is named by the schema's field
_SCHEMA_ROOTS = (("tools", int, "function", "parameters"), ("response_format", "json_schema", "schema"))

Path = tuple[Any, ...]  # a linked list, (key, parent path) or (): one tuple per value walked, not a copy per depth


def decode(raw: bytes, model: type[Body]) -> Body:
    """The body as `model`, or InvalidArgument naming the field at fault."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidArgument("body", f"is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # UnicodeDecodeError (not UTF-8) included
        raise InvalidArgument("body", f"is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("body", "must be a JSON object")
    check(data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidArgument(param(first["loc"]), first["msg"]) from None


def check(data: dict[str, Any]) -> None:
    """Refuses JSON nested past MAX_JSON_DEPTH and strings (keys too) that hold a lone surrogate,
    naming the field: one pass over the values, without recursion."""
    stack: list[tuple[Any, int, Path]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise InvalidArgument(_name(path), "holds a lone surrogate (\\ud800 to \\udfff), which is not text")
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(_name(path, whole=False), f"is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    raise InvalidArgument(_name(path), "has a key that holds a lone surrogate, which is not text")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, (key, path)))
        elif isinstance(value, list):
            stack.extend(
                (item, depth + 1, (i, path)) for i, item in enumerate(value) if isinstance(item, (str, dict, list))
            )


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

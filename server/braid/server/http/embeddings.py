"""OpenAI's embeddings API (POST /v1/embeddings) to braid's EmbeddingRequest and back: `input` as a
string, a list of strings, a list of token ids or a list of lists; `encoding_format` float or
base64 (little-endian float32, as the openai SDK asks for and decodes by default); `dimensions`;
vLLM's extras `normalize`, `truncate_prompt_tokens` and braid's `pooling`. Checked by the checks
every front end shares (frontend/embeddings.py), each error naming OpenAI's parameter (`input[2]`)."""

from __future__ import annotations

import base64
import re
import struct
import uuid
from typing import Any, Callable, Literal, Sequence

from pydantic import StrictInt

from braid.server.engine.types import EmbeddingRequest, Finished, InvalidArgument, ModelInfo, Pooling, Priority
from braid.server.frontend.embeddings import check_embedding
from braid.server.http.protocol import _Body


class EmbeddingsRequest(_Body):
    input: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras, and braid's pooling and priority
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    pooling: Literal["last", "mean"] | None = None
    priority: Literal["interactive", "batch"] | None = None


def embedding_request(body: EmbeddingsRequest, info: ModelInfo) -> EmbeddingRequest:
    """The body as braid's request, every field checked, an error naming OpenAI's parameter."""
    texts: tuple[str, ...] = ()
    ids: tuple[tuple[int, ...], ...] = ()
    value = body.input
    if isinstance(value, str):
        texts = (value,)
    else:  # pydantic made it all strings, all ids or all lists
        strings = [t for t in value if isinstance(t, str)]
        numbers = [t for t in value if isinstance(t, int)]
        if value and len(numbers) == len(value):
            ids = (tuple(numbers),)  # one input of ids (OpenAI's [1, 2, 3]): its ids are input[j]
        elif len(strings) == len(value):
            texts = tuple(strings)
        else:
            ids = tuple(tuple(t) for t in value if isinstance(t, list))
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidArgument("dimensions", f"{body.dimensions} is less than 1")
    req = EmbeddingRequest(
        texts=texts,
        token_ids=ids,
        request_id=f"embd-{uuid.uuid4().hex}",
        pooling=Pooling[body.pooling.upper()] if body.pooling else None,
        normalize=body.normalize is not False,
        dimensions=body.dimensions or 0,
        truncate_input_tokens=body.truncate_prompt_tokens or 0,
        priority=Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE,
    )
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < 0:
        raise InvalidArgument("truncate_prompt_tokens", f"{body.truncate_prompt_tokens} is negative")
    check_embedding(req, info, spelling(body))
    return req


def spelling(body: EmbeddingsRequest) -> Callable[[str], str]:
    """The body's Spelling of braid's fields (openai_name), for the engine's errors too."""
    one_list = bool(body.input) and not isinstance(body.input, str) and isinstance(body.input[0], int)
    return lambda field: openai_name(field, one_list)


_INDEXED = re.compile(r"(texts|token_ids)((?:\[\d+\])*)")


def openai_name(field: str, one_list: bool = False) -> str:
    """braid's name of an embedding request's field as OpenAI names it: texts[i] and token_ids[i]
    are input[i]; one list of ids is input itself (token_ids[0][j]: input[j])."""
    indexed = _INDEXED.fullmatch(field)
    if indexed:
        index = indexed[2].removeprefix("[0]") if one_list else indexed[2]
        return "input" + index
    return {"truncate_input_tokens": "truncate_prompt_tokens"}.get(field, field)


def embeddings_body(
    finished: Sequence[Finished], model: str, encoding_format: str, request_id: str = ""
) -> dict[str, Any]:
    """OpenAI's response: a list of embeddings in input order, and usage."""
    tokens = sum(f.prompt_tokens for f in finished)
    return {
        "object": "list",
        "id": request_id,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(f.embedding or [], encoding_format)}
            for i, f in enumerate(finished)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # float32, little-endian: what the openai SDK decodes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector

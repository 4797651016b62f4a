"""Mistakes that `mypy --strict` rejects (tests/test_client_typing.py): each `# error:` comment is the start of
the one error mypy reports on its line.

Never run, only type-checked.
"""

from __future__ import annotations

from braid.client import AsyncClient, Client


async def main() -> None:
    with Client() as client:
        client.generate("Hi", max_new_tokens="lots")  # error: Argument "max_new_tokens" to "generate"
        client.stream("Hi", max_tokens=8)  # error: Unexpected keyword argument "max_tokens"
        client.generate("Hi", logit_bias={"42": -100.0})  # error: Dict entry 0 has incompatible type "str"
    async with AsyncClient() as client_async:
        await client_async.generate("Hi", temprature=0.5)  # error: Unexpected keyword argument "temprature"
        client_async.stream("Hi", stop_token_ids=["</s>"])  # error: List item 0 has incompatible type "str"

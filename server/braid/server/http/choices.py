"""One choice (one of a request's n samples) as OpenAI sends it: its text read as content or as
tool calls, its finish reason, its logprobs, and its usage."""

from __future__ import annotations

from typing import Any

from braid.server.engine.types import Delta, Finished, FinishReason, TokenLogprob
from braid.server.frontend import tools
from braid.server.frontend.tool_plan import CallReader, new_call_id
from braid.server.http.requests import Plan

_LENGTH = {FinishReason.MAX_TOKENS}


def openai_call(call: tools.ToolCall, index: int | None = None) -> dict[str, Any]:
    """A tool call as OpenAI sends one (with its index, in a stream's delta)."""
    sent = {
        "id": call.id or new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return sent if index is None else {"index": index, **sent}


def finish_reason(finished: Finished, has_calls: bool) -> str:
    """OpenAI's name for how a choice ended: `length` where max_tokens cut it (a forced tool call
    included, its calls sent as far as they got), `tool_calls` where it holds whole calls, else
    `stop` (an end of sequence, a stop string or token, a completed constraint, a cancel)."""
    if finished.reason in _LENGTH:
        return "length"
    return "tool_calls" if has_calls else "stop"


def usage(finals: list[Finished]) -> dict[str, Any]:
    """The usage of a request's choices: the prompt counted once, the completions summed."""
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(f.generated_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens if finals else 0},
        "completion_tokens_details": {"reasoning_tokens": sum(f.reasoning_tokens for f in finals)},
    }


class ChatChoice:
    """A chat choice's deltas as its tokens arrive (`feed`), and what is left at its end (`end`):
    its output read as every front end reads it (tool_plan.CallReader), in OpenAI's shape. Content
    is sent as it comes; where tool calls may be in it (`auto`), the text that might begin a call is
    held back until the choice ends and is parsed; a named function's arguments stream as they come,
    OpenAI's way; a forced list's calls (`required`) are sent each as its JSON closes, as gRPC sends
    them: its index, id and name with its whole arguments in one delta."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._reader = CallReader(plan.tool_plan)
        self._sent = 0  # characters of a named call's arguments sent
        self._reasoning: list[str] = []  # a reasoning model's reasoning (engine/reasoning.py), apart

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def text(self) -> str:
        return self._reader.text

    @property
    def calls(self) -> list[tools.ToolCall]:
        return self._reader.calls

    @property
    def cut(self) -> bool:
        """A forced call cut short: its calls are as far as they got."""
        return self._reader.cut

    @property
    def has_calls(self) -> bool:
        """Whether the choice ends in whole tool calls (finish_reason `tool_calls`)."""
        return self._reader.has_calls

    def feed(self, text: str, reasoning: str = "") -> dict[str, Any] | None:
        """The delta of new output: its answer's `text`, read for tool calls, and a reasoning
        model's `reasoning` as vLLM and DeepSeek send it (reasoning_content)."""
        if reasoning:
            self._reasoning.append(reasoning)
        thought = {"reasoning_content": reasoning} if reasoning else {}
        if not text:
            return thought or None
        read = self._reader.feed(text)
        if self._plan.tools == "forced" and self._plan.function is not None:
            # a named call: its arguments stream as they come, OpenAI's way
            head = {} if self._sent else {"id": self._reader.named_id, "type": "function"}
            function = {"arguments": text} if self._sent else {"name": self._plan.function, "arguments": text}
            self._sent += len(text)
            return {**thought, "tool_calls": [{"index": 0, **head, "function": function}]}
        delta: dict[str, Any] = {**thought, "content": read.content} if read.content else thought
        if read.calls:  # a forced list's calls that closed
            delta = {**delta, "tool_calls": self._indexed(read.calls)}
        return delta or None

    def end(self) -> dict[str, Any] | None:
        """The last delta: the tool calls not sent yet (in `auto`, all found in the whole text; of a
        forced list, those a cut left unclosed), or the content held back."""
        read = self._reader.end()
        if self._plan.tools == "forced" and self._plan.function is not None:
            return None if self._sent else {"tool_calls": [openai_call(self.calls[0], 0)]}
        if read.calls:
            return {"tool_calls": self._indexed(read.calls)}
        return {"content": read.content} if read.content else None

    def _indexed(self, new: tuple[tools.ToolCall, ...]) -> list[dict[str, Any]]:
        """The calls just read, the last of the choice's calls, each with its index among them."""
        first = len(self.calls) - len(new)
        return [openai_call(c, first + i) for i, c in enumerate(new)]

    def message(self) -> dict[str, Any]:
        """The whole choice's message (a response that is not streamed), after `end`."""
        thought = {"reasoning_content": self.reasoning} if self._reasoning else {}
        if self.calls:
            content = self._reader.content or None
            calls = [openai_call(c) for c in self.calls]
            return {"role": "assistant", "content": content, **thought, "tool_calls": calls}
        return {"role": "assistant", "content": self.text, **thought}


def token_logprobs(deltas: list[Delta]) -> tuple[list[int], list[TokenLogprob]]:
    """The tokens of these deltas and their TokenLogprob, in order."""
    ids: list[int] = []
    lps: list[TokenLogprob] = []
    for d in deltas:
        ids.extend(d.token_ids)
        lps.extend(d.logprobs)
    return ids, lps


def logprob_ids(ids: list[int], lps: list[TokenLogprob]) -> list[int]:
    """Every token id whose text the logprobs name: the chosen ones and their alternatives."""
    return list(dict.fromkeys([*ids, *(t for lp in lps for t, _ in lp.top)]))


def chat_logprobs(ids: list[int], lps: list[TokenLogprob], piece: dict[int, str]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = piece[token_id]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]} for t, lp in zip(ids, lps)
        ]
    }


def completion_logprobs(ids: list[int], lps: list[TokenLogprob], piece: dict[int, str], offset: int) -> dict[str, Any]:
    offsets, at = [], offset
    for t in ids:
        offsets.append(at)
        at += len(piece[t])
    return {
        "tokens": [piece[t] for t in ids],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{piece[a]: v for a, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }

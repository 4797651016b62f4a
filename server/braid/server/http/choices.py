"""One choice (one of a request's n samples) as OpenAI sends it: its text read as content or as
tool calls, its finish reason, its logprobs, and its usage."""

from __future__ import annotations

import uuid
from typing import Any

from braid.server.engine.types import Delta, Finished, FinishReason, TokenLogprob
from braid.server.frontend import tools
from braid.server.http.requests import Plan

_LENGTH = {FinishReason.MAX_TOKENS}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


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
    }


class ChatChoice:
    """A chat choice's deltas as its tokens arrive (`feed`), and what is left at its end (`end`).
    Content is sent as it comes; where tool calls may be in it (`auto`), the text that might begin
    a call is held back until the choice ends and is parsed."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self.text = ""
        self._sent = 0  # characters of text sent as content (auto) or as arguments (a named call)
        self.calls: list[tools.ToolCall] = []
        self.cut = False  # a forced call cut short: its calls are as far as they got
        self._call_id = new_call_id()
        self._held = tools.HeldBack()  # where a tool call may begin, read as the text grows

    @property
    def has_calls(self) -> bool:
        """Whether the choice ends in whole tool calls (finish_reason `tool_calls`)."""
        return bool(self.calls) and not self.cut

    def feed(self, text: str) -> dict[str, Any] | None:
        self.text += text
        if self._plan.tools is None:
            return {"content": text} if text else None
        if self._plan.tools == "forced" and self._plan.function is not None:
            # a named call: its arguments stream as they come, OpenAI's way
            head = {} if self._sent else {"id": self._call_id, "type": "function"}
            function = {"arguments": text} if self._sent else {"name": self._plan.function, "arguments": text}
            self._sent += len(text)
            return {"tool_calls": [{"index": 0, **head, "function": function}]}
        if self._plan.tools == "auto":
            held = self._held(self.text)
            if held > self._sent:
                content, self._sent = self.text[self._sent : held], held
                return {"content": content}
        return None

    def end(self) -> dict[str, Any] | None:
        """The last delta: tool calls found in the whole text, or the content held back."""
        plan = self._plan
        if plan.tools == "forced":
            self.calls = tools.forced_calls(self.text, plan.function)
            self.cut = not self.calls
            if self.cut:  # by max_tokens, say: sent as tool calls all the same, as OpenAI does, never as content
                self.calls = tools.cut_calls(self.text, plan.function, plan.tool_names)
            if plan.function is not None:
                self.calls = [tools.ToolCall(plan.function, self.calls[0].arguments, self._call_id)]
                return None if self._sent else {"tool_calls": [openai_call(self.calls[0], 0)]}
            return {"tool_calls": [openai_call(c, i) for i, c in enumerate(self.calls)]} if self.calls else None
        if plan.tools == "auto":
            _, self.calls = tools.parse_tool_calls(self.text)
            if self.calls:
                return {"tool_calls": [openai_call(c, i) for i, c in enumerate(self.calls)]}
            rest, self._sent = self.text[self._sent :], len(self.text)
            return {"content": rest} if rest else None
        return None

    def message(self) -> dict[str, Any]:
        """The whole choice's message (a response that is not streamed), after `end`."""
        if self.calls:
            content, _ = tools.parse_tool_calls(self.text) if self._plan.tools == "auto" else ("", [])
            return {"role": "assistant", "content": content or None, "tool_calls": [openai_call(c) for c in self.calls]}
        return {"role": "assistant", "content": self.text}


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

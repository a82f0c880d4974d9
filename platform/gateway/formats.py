"""OpenAI response and stream-chunk bodies (field order mirrors OpenAI's and vLLM's servers)."""

import json
import secrets
from dataclasses import dataclass, field

from contract.protocol import Usage

# The request fields every served model takes (docs/api.md), as OpenRouter lists them per model.
SUPPORTED_PARAMETERS = [
    "max_tokens", "temperature", "top_p", "stop", "seed", "n", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "response_format", "structured_outputs", "tools", "tool_choice",
    "parallel_tool_calls",
]  # fmt: skip


def model_entry(model) -> dict:
    """A /v1/models entry: OpenAI's fields, then what the model supports (OpenRouter's extra fields)."""
    inputs = ["text", "image"] if getattr(model, "accepts_images", False) else ["text"]
    return {
        "id": model.model_id,
        "object": "model",
        "created": int(model.created_at.timestamp()),
        "owned_by": "gemma-platform",
        "context_length": model.context_length,
        "architecture": {"input_modalities": inputs, "output_modalities": ["text"]},
        "supported_parameters": SUPPORTED_PARAMETERS,
    }


def usage_body(usage: Usage) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens the engine's
    prefix cache served (always present, as in OpenAI's replies, so clients need not test for it)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class ChoiceOutput:
    """One choice of a non-streamed reply, as collected from the relay."""

    texts: list[str] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    tool_calls: list[dict] | None = None


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list) -> dict:
    """OpenAI's chat `logprobs` object from the worker's [token, logprob, top] entries."""
    content = [
        dict(_token_entry(token, logprob), top_logprobs=[_token_entry(t, lp) for t, lp in top])
        for token, logprob, top in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list, offset: int) -> dict:
    """OpenAI's legacy completions `logprobs` object; `offset`: characters of text before these tokens."""
    tokens, offsets = [], []
    for token, _, _ in entries:
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [dict(top) or {token: logprob} for token, logprob, top in entries],
        "text_offset": offsets,
    }


def _message_tool_calls(calls: list[dict]) -> list[dict]:
    return [
        {"id": tool_call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]


def completion_body(kind: str, rid: str, created: int, model: str, outputs: list[ChoiceOutput], usage: Usage) -> dict:
    choices = []
    for index, output in enumerate(outputs):
        finish_reason = output.finish_reason or usage.finish_reason or "stop"
        text = "".join(output.texts)
        if kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if output.tool_calls:
                message["content"] = text or None
                message["tool_calls"] = _message_tool_calls(output.tool_calls)
            logprobs = chat_logprobs(output.logprobs) if output.logprobs is not None else None
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            logprobs = completion_logprobs(output.logprobs, 0) if output.logprobs is not None else None
            choices.append({"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason})
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """Builds the SSE frames of one streamed response."""

    def __init__(self, kind: str, rid: str, created: int, model: str, include_usage: bool):
        self.kind, self.include_usage = kind, include_usage
        self._head = {
            "id": rid,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self._offsets: dict[int, int] = {}  # completions: text characters sent per choice

    def _frame(self, choices: list, usage: dict | None = None) -> bytes:
        body = dict(self._head, choices=choices)
        if self.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, index: int, delta: dict | None, finish_reason: str | None, logprobs=None) -> dict:
        """A chat choice with `delta`, or a completion choice with `delta["content"]` as its text."""
        if self.kind == "chat":
            return {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}
        text = (delta or {}).get("content") or ""
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, n: int = 1) -> bytes:
        if self.kind != "chat":
            return b""
        return b"".join(self._frame([self._choice(i, {"role": "assistant", "content": ""}, None)]) for i in range(n))

    def delta(self, text: str, index: int = 0, logprobs: list | None = None) -> bytes:
        formatted = None
        if logprobs is not None:
            if self.kind == "chat":
                formatted = chat_logprobs(logprobs)
            else:
                formatted = completion_logprobs(logprobs, self._offsets.get(index, 0))
                self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return self._frame([self._choice(index, {"content": text}, None, formatted)])

    def tool_calls(self, index: int, calls: list[dict]) -> bytes:
        """A choice's tool calls in OpenAI's streamed shape: per call, a chunk with its id, type, name
        and empty arguments, then one with the arguments."""
        frames = []
        for position, call in enumerate(calls):
            opening = {"index": position, "id": tool_call_id(), "type": "function",
                       "function": {"name": call["name"], "arguments": ""}}  # fmt: skip
            arguments = {"index": position, "function": {"arguments": call["arguments"]}}
            frames.append(self._frame([self._choice(index, {"tool_calls": [opening]}, None)]))
            frames.append(self._frame([self._choice(index, {"tool_calls": [arguments]}, None)]))
        return b"".join(frames)

    def closing(self, usage: Usage, choices: list[dict] | None = None) -> bytes:
        """Each choice's last chunk (its tool calls, then its finish reason), the usage chunk, [DONE]."""
        frames = b""
        for index, choice in enumerate(choices or [{"finish_reason": usage.finish_reason}]):
            if choice.get("tool_calls") and self.kind == "chat":
                frames += self.tool_calls(index, choice["tool_calls"])
            finish_reason = choice.get("finish_reason") or "stop"
            frames += self._frame([self._choice(index, None, finish_reason)])
        if self.include_usage:
            frames += self._frame([], usage_body(usage))
        return frames + b"data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"

    @staticmethod
    def keepalive() -> bytes:
        return b": keep-alive\n\n"

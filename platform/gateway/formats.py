"""OpenAI response and stream-chunk bodies (field order mirrors OpenAI's and vLLM's servers)."""

import json

from workers.protocol import Usage


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def completion_body(kind: str, rid: str, created: int, model: str, text: str, usage: Usage) -> dict:
    finish_reason = usage.finish_reason or "stop"
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
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

    def _frame(self, choices: list, usage: dict | None = None) -> bytes:
        body = dict(self._head, choices=choices)
        if self.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> bytes:
        return self._frame([self._choice(None, None, role=True)]) if self.kind == "chat" else b""

    def delta(self, text: str) -> bytes:
        return self._frame([self._choice(text, None)])

    def closing(self, usage: Usage) -> bytes:
        frames = self._frame([self._choice(None if self.kind == "chat" else "", usage.finish_reason or "stop")])
        if self.include_usage:
            frames += self._frame([], usage_body(usage))
        return frames + b"data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"

    @staticmethod
    def keepalive() -> bytes:
        return b": keep-alive\n\n"

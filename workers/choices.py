"""One choice of a request as the worker relays it: text not yet written, logprobs, and the tool
calls read out of it (``RequestInput.tool_mode``).

Tool calls are parsed here, where the text is whole at the end of the choice, once per choice; the
gateway receives them ready-made in the request's done entry (contract/protocol.py). While a choice
may hold a call its text is held back, so a call never reaches the client as content:
- ``required``/``named``: the engine was constrained to a JSON array of ``{name, parameters}`` (or
  to the named function's arguments), so all of the text is the call;
- ``auto``: the model's own syntax, Gemma 4's ``<|tool_call>call:NAME{ARGS}<tool_call|>``; text is
  streamed up to the first marker (and a possible start of one at the end of the text so far).
Text that turns out to hold no call (a forced call cut short by max_tokens) is sent as content.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)

TOOL_CALL_START = "<|tool_call>"
# Some Gemma 4 checkpoints end a call with <turn|> instead of <tool_call|> (vLLM's gemma4_utils).
_GEMMA4_CALL = re.compile(r"<\|tool_call>call:([\w.-]+)\{(.*?)\}(?:<tool_call\|>|<turn\|>|$)", re.DOTALL)


class Choice:
    """Output of one choice (index ``index``) not yet written to Redis."""

    __slots__ = ("index", "texts", "tokens", "logprobs", "finish_reason", "held", "holding")

    def __init__(self, index: int, holding: bool) -> None:
        self.index = index
        self.texts: list[str] = []
        self.tokens = 0
        self.logprobs: list | None = None
        self.finish_reason: str | None = None
        self.held: list[str] = []  # text that may hold a tool call
        self.holding = holding  # all text is held from now on

    def pending(self) -> bool:
        return bool(self.texts or self.tokens)

    def add_text(self, text: str, tool_mode: str) -> str:
        """Take new text; returns the part that may go out as content now."""
        if self.holding:
            self.held.append(text)
            return ""
        if tool_mode != "auto":
            self.texts.append(text)
            return text
        pending = "".join(self.held) + text
        self.held.clear()
        start = pending.find(TOOL_CALL_START)
        if start >= 0:
            self.holding = True
            self.held.append(pending[start:])
            visible = pending[:start]
        else:
            keep = _partial_marker_length(pending)
            visible = pending[: len(pending) - keep]
            if keep:
                self.held.append(pending[-keep:])
        if visible:
            self.texts.append(visible)
        return visible

    def finish(self, tool_mode: str, tool_name: str) -> dict:
        """The choice's end: its finish reason and tool calls; held text without a call becomes content."""
        held = "".join(self.held)
        self.held.clear()
        calls = parse_tool_calls(held, tool_mode, tool_name) if held else []
        if not calls and held:
            self.texts.append(held)
        result: dict = {"finish_reason": "tool_calls" if calls else (self.finish_reason or "stop")}
        if calls:
            result["tool_calls"] = calls
        return result


def _partial_marker_length(text: str) -> int:
    """Characters at the end of ``text`` that could begin TOOL_CALL_START."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0


def parse_tool_calls(text: str, mode: str, name: str) -> list[dict]:
    """Tool calls as [{"name", "arguments" (a JSON string)}]; [] when ``text`` holds none (a cut-off
    or malformed output)."""
    try:
        # strict=False: the engine's JSON grammar lets a raw control character into a string (seen with
        # xgrammar on a random model); the arguments go out re-encoded, as valid JSON.
        if mode == "named":
            arguments = json.loads(text, strict=False)
            return [{"name": name, "arguments": json.dumps(arguments)}] if isinstance(arguments, dict) else []
        if mode == "required":
            calls = json.loads(text, strict=False)
            return [
                {"name": call["name"], "arguments": json.dumps(call.get("parameters") or {})}
                for call in calls
                if isinstance(call, dict) and isinstance(call.get("name"), str)
            ]
        if mode == "auto":
            return [_gemma4_call(match.group(1), match.group(2)) for match in _GEMMA4_CALL.finditer(text)]
    except (ValueError, TypeError, RecursionError) as exc:
        log.info("no tool call parsed from a %s choice: %s", mode, exc)
    return []


def _gemma4_call(name: str, raw_arguments: str) -> dict:
    from vllm.parser.gemma4 import _parse_gemma4_args  # vLLM's parser of Gemma 4's argument syntax

    return {"name": name, "arguments": json.dumps(_parse_gemma4_args(raw_arguments))}


def compact_logprobs(logprobs: list, token_ids: list[int], top: int) -> list:
    """vLLM's per-token logprobs (dicts token id -> Logprob) as [token, logprob, [[token, logprob], ...]]
    with the ``top`` most likely alternatives in rank order (the chosen token is always first)."""
    compact = []
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        chosen = candidates.get(token_id)
        ranked = sorted(
            (entry for entry in candidates.values() if entry.rank is not None and entry.rank <= top),
            key=lambda entry: entry.rank,
        )
        compact.append(
            [
                _token(chosen),
                _finite(chosen.logprob if chosen is not None else None),
                [[_token(entry), _finite(entry.logprob)] for entry in ranked[:top]],
            ]
        )
    return compact


def _token(entry) -> str:
    return (entry.decoded_token or "") if entry is not None else ""


def _finite(value: float | None) -> float:
    # JSON has no -inf: a token with probability 0 (masked by a grammar) gets OpenAI's floor.
    if value is None or value != value or value < -9999.0:
        return -9999.0
    return value

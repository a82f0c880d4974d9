"""Closed-loop load generator for OpenAI-compatible streaming endpoints.

``run_level`` keeps ``concurrency`` streamed chat completions in flight until ``requests`` have been
sent, and records, per request, when each chunk with completion text arrived and the usage the
server reported (``stream_options.include_usage``). aiohttp is used rather than httpx: on a 2-core
machine the client shares the CPU with the server it measures, and aiohttp spends less per chunk.

Ad hoc use against any server::

    python -m benchmarks.loadgen --url http://127.0.0.1:8000/v1 --model tiny-gemma4 \
        --api-key KEY --concurrency 8 --requests 32 --output-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from benchmarks.stats import LevelSummary, RequestResult, summarize

# A fixed prompt; each request starts with its own number so that requests do not share a prefix
# beyond the chat template (prefix caching would otherwise skip most of every prefill).
PROMPT_WORDS = (
    "Write a long and detailed story about a lighthouse keeper who discovers a mysterious map in an old "
    "chest, and describe every step of the journey that follows across the sea, the islands, the storms "
    "and the people met along the way, with vivid details about the weather, the ship and the crew."
).split()


def prompt_text(index: int, words: int) -> str:
    """The prompt of request ``index``: its number, then ``words`` words of the fixed text (cycled)."""
    body = [PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(words)]
    return f"Request {index}. " + " ".join(body)


@dataclass(frozen=True)
class Workload:
    """What every request asks: a chat completion of exactly ``output_tokens`` tokens (ignore_eos)."""

    model: str
    prompt_words: int = 96
    output_tokens: int = 64

    def body(self, index: int) -> dict:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt_text(index, self.prompt_words)}],
            "max_tokens": self.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


class SSEParser:
    """Incremental parser of a ``text/event-stream`` body: feed bytes, get the events' data strings.

    Follows the SSE rules the OpenAI servers rely on: lines end with LF, CRLF or CR; ``data:`` lines
    of one event are joined with LF; a blank line ends the event; lines starting with ``:`` are
    comments (keep-alives); other fields (event, id, retry) are ignored.
    """

    def __init__(self) -> None:
        self._buffer = ""
        # A read may end inside a multi-byte character: decode incrementally.
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes | str) -> list[str]:
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across two reads
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()  # an unfinished line stays buffered
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events


def chunk_content(payload: dict) -> str:
    """The completion text a chat or completion chunk carries ('' when none)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def apply_event(result: RequestResult, data: str, now: float) -> bool:
    """Record one SSE event into ``result``; True when the stream is finished ([DONE])."""
    if data == "[DONE]":
        return True
    payload = json.loads(data)
    if "error" in payload and "choices" not in payload:
        error = payload["error"]
        result.error = f"stream error: {error.get('message') if isinstance(error, dict) else error}"
        return False
    if chunk_content(payload):
        result.chunk_times.append(now)
    usage = payload.get("usage")
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return False


async def _post(session: aiohttp.ClientSession, url: str, headers: dict, body: dict):
    """POST, retrying once when a pooled keep-alive connection turns out closed by the server before
    any reply (the race every HTTP client meets; the openai SDK retries connection errors too)."""
    try:
        return await session.post(url, json=body, headers=headers)
    except aiohttp.ServerDisconnectedError:
        return await session.post(url, json=body, headers=headers)


async def stream_one(session: aiohttp.ClientSession, url: str, headers: dict, body: dict) -> RequestResult:
    """Send one streamed request and time its chunks; never raises (errors are recorded)."""
    result = RequestResult(sent_at=time.perf_counter(), ended_at=0.0)
    try:
        async with await _post(session, url, headers, body) as response:
            result.headers_at = time.perf_counter()
            result.request_id = response.headers.get("X-Request-Id")
            if response.status != 200:
                text = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {text}"
                return result
            parser, done = SSEParser(), False
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    done = apply_event(result, data, now) or done
            if not done and result.error is None:
                result.error = "stream ended without [DONE]"
            elif result.error is None and not result.completion_tokens:
                result.error = "no usage in the stream"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended_at = time.perf_counter()
    return result


async def run_level_async(
    url: str,
    headers: dict,
    make_body: Callable[[int], dict],
    concurrency: int,
    requests: int,
    first_index: int = 0,
    timeout_s: float = 600,
) -> tuple[list[RequestResult], float]:
    """Run ``requests`` requests, ``concurrency`` at a time; returns the results and the wall time."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    results: list[RequestResult] = []
    next_index = iter(range(first_index, first_index + requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for index in next_index:  # the shared iterator hands each index out once
            results.append(await stream_one(session, url, headers, make_body(index)))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        duration = time.perf_counter() - started
    return results, duration


def run_requests(
    base_url: str, api_key: str | None, workload: Workload, concurrency: int, requests: int, first_index: int = 0
) -> tuple[list[RequestResult], float]:
    """Run one level against ``base_url`` (ending in /v1); the raw results and the wall time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/chat/completions"
    return asyncio.run(run_level_async(url, headers, workload.body, concurrency, requests, first_index=first_index))


def run_level(
    target: str,
    base_url: str,
    api_key: str | None,
    workload: Workload,
    concurrency: int,
    requests: int,
    first_index: int = 0,
) -> LevelSummary:
    """Run one level against ``base_url`` (ending in /v1) and summarise it."""
    results, duration = run_requests(base_url, api_key, workload, concurrency, requests, first_index)
    return summarize(target, concurrency, results, duration, workload.output_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="base URL ending in /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=96)
    args = parser.parse_args(argv)
    workload = Workload(args.model, prompt_words=args.prompt_words, output_tokens=args.output_tokens)
    summary = run_level("adhoc", args.url, args.api_key, workload, args.concurrency, args.requests)
    print(json.dumps(summary.as_dict(), indent=2))
    return 1 if summary.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

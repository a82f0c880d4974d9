"""A worker's claims of its requests, made on the engine's event loop in batches.

A worker claims a request before running it: one script takes the request's input (``GETDEL``) and
records the worker's identity as its claimer (``req:<rid>:claim``), so a request whose input is gone
always names its claimer, whose heartbeat the gateway then watches until the request starts. A
request whose input is already gone (the gateway took it back, or its input expired after the queue
deadline) is not run.

The claims are made on the engine's event loop, not by the Celery tasks: every claim asked for while
one batch is on its way to Redis goes in the next, as one script call for all of them. A wave of
tasks (clients of one level that ended together) costs one round trip instead of one per task, and
a task makes no Redis call of its own: it hands its request id to the loop and returns
(workers/requestpool.py), so the consumer's thread takes the rest of the wave without waiting on Redis.
"""

from __future__ import annotations

import asyncio

import redis.asyncio

from contract import protocol
from contract.outage import through_outage

# How long a batch of claims is retried through a Redis outage. A claim whose reply was lost reads
# as None when retried (its input is gone): the gateway ends that request at its claim-to-start
# bound (WORKER_START_TIMEOUT_SECONDS).
REDIS_RETRY_SECONDS = 30.0

# KEYS: input and claim key of each request, in pairs; ARGV: the worker's identity, the claim's TTL.
# One reply per request: its input, or nil (Lua false) where there was none to take.
CLAIM_SCRIPT = """
local inputs = {}
for i = 1, #KEYS, 2 do
  local raw = redis.call('GETDEL', KEYS[i])
  if raw then redis.call('SET', KEYS[i + 1], ARGV[1], 'EX', ARGV[2]) end
  inputs[#inputs + 1] = raw
end
return inputs
"""


def claim_keys(rids: list[str]) -> list[str]:
    """The script's KEYS for ``rids``."""
    return [key for rid in rids for key in (protocol.input_key(rid), protocol.claim_key(rid))]


async def claim_requests(client: redis.asyncio.Redis, rids: list[str], worker: str) -> list[str | None]:
    """Claim ``rids`` for ``worker`` (its identity) in one round trip: each one's input, or None where
    the gateway took it back (or another worker claimed it) first."""
    claim = client.register_script(CLAIM_SCRIPT)
    return list(await claim(keys=claim_keys(rids), args=[worker, protocol.REQUEST_TTL]))


class ClaimBatcher:
    """The claims of one worker, on its engine's event loop (see the module docstring)."""

    def __init__(self, client: redis.asyncio.Redis, worker: str, *, retry_seconds: float = REDIS_RETRY_SECONDS):
        self.client, self.worker, self.retry_seconds = client, worker, retry_seconds
        self.batches = 0  # round trips so far
        self._asked: list[tuple[str, asyncio.Future]] = []
        self._claiming: asyncio.Task | None = None

    async def claim(self, rid: str) -> str | None:
        """Request ``rid``'s input, now claimed by this worker; None if there was none to take."""
        answer = asyncio.get_running_loop().create_future()
        self._asked.append((rid, answer))
        if self._claiming is None:
            self._claiming = asyncio.create_task(self._claim_asked(), name="claims")
        return await answer

    async def _claim_asked(self) -> None:
        """Claim what was asked for, one batch at a time, until nothing more is."""
        try:
            while self._asked:
                batch, self._asked = self._asked, []
                await self._claim_batch(batch)
        finally:
            self._claiming = None

    async def _claim_batch(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        rids = [rid for rid, _ in batch]
        try:
            inputs = await through_outage(
                lambda: claim_requests(self.client, rids, self.worker),
                seconds=self.retry_seconds, what=f"claiming {len(rids)} request(s)",
            )  # fmt: skip
        except Exception as exc:
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            return
        self.batches += 1
        for (_, answer), raw in zip(batch, inputs, strict=True):
            if not answer.done():  # a claim given up (the relay stopping) leaves its request to the gateway
                answer.set_result(raw)

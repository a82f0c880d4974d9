"""Fault-injection soak: the failures the platform must survive, repeated against the live CPU stack.

    python -m benchmarks.faults [--rounds 3] [--streams 4] [--faults worker-kill,redis-restart,web-kill,disconnect]
    make faults ARGS="--rounds 3"

The stack is the benchmarks' (benchmarks/platform_stack.py: gunicorn → Redis → Celery worker with the
vLLM CPU engine and the tiny model, and beat) on a database of its own (``gemma_faults``, re-created
each run) and a Redis server of its own (an embedded redis-server in .run/faults/, which the Redis
fault restarts). Each round of a fault starts STREAMS streamed completions (MAX_TOKENS tokens each,
so most are still generating), waits until every one has streamed text, injects the fault and
follows every request to its end; then it waits for the ledger and counts, per fault:

- requests: tried; still streaming when the fault came (the tiny model finishes some first; in the
  disconnect fault the clients have left by then); ok (to ``[DONE]`` with its usage, no error);
  ended with an explicit error (an error event, or the connection cut under a killed web process);
  hung (no end within HANG_SECONDS);
  not stopped (a request whose client is gone that its worker did not stop within STOP_SECONDS);
- usage: requests with exactly one ledger row; lost (no row once the stack settled); billed other
  than told (an ok request whose row differs from the usage its client got);
- reservations still held once its row is written (``resv:<id>``).

Faults:

- ``worker-kill``: SIGKILL the pool's only worker and its engine mid-stream, then start it again
  (its streams end with an explicit ``worker_lost`` error: no worker is left to continue them);
- ``worker-kill-continue``: the same with a second worker in the pool (started for the round,
  stopped after it): the killed worker's streams continue on the other one, with no error;
- ``redis-restart``: stop Redis (SIGTERM: it writes its snapshot) mid-stream, start it on the same port;
- ``web-kill``: SIGKILL every web process mid-stream (gunicorn starts new ones);
- ``disconnect``: every client goes away mid-stream.

For the last two the engine is held (SIGSTOP) from the fault until the worker has stopped every
request, as the end-to-end tests do: the tiny model would otherwise finish a request before the
worker hears that no one reads it, and the round would show nothing about stopping it.

A script, not a test: a round of every fault takes minutes on a 2-core machine (each worker kill
costs an engine start). The per-fault tests of the suite are listed in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.procs import ROOT

FAULTS = ("worker-kill", "worker-kill-continue", "redis-restart", "web-kill", "disconnect")
MODEL_NAME = "tiny-gemma4"
DATABASE = "gemma_faults"
MAX_TOKENS = 1500
# Bounds, not timings: a request not ended this long after the fault counts as hung; a row not
# written this long after every request ended counts as lost.
HANG_SECONDS = 180.0
SETTLE_SECONDS = 180.0
# A request whose client is gone (a killed web process, a disconnect) must be stopped by its worker
# within this bound while the engine is held (its lease lapses after READER_LEASE_SECONDS).
STOP_SECONDS = 120.0
STREAMING_SECONDS = 300.0
STACK_ENV = {
    # As in the end-to-end tests: heartbeats every 2 s; a lost worker is declared after 12 s.
    "WORKER_HEARTBEAT_TIMEOUT": "12",
    "SSE_KEEPALIVE_SECONDS": "1",
    # A killed web process's requests are stopped once its lease on them lapses.
    "READER_LEASE_SECONDS": "20",
}


@dataclass
class Outcome:
    """What one client saw of its request."""

    request_id: str = ""
    status: int | None = None
    usage: dict | None = None
    error: str | None = None  # the code of an error event
    cut: str | None = None  # a transport error: the connection was cut
    done: bool = False  # saw data: [DONE]
    streaming: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.cut is None and self.usage is not None


def _stream(base_url: str, key: str, outcome: Outcome, leave_after_text: bool) -> None:
    body = {"model": MODEL_NAME, "prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with httpx.stream("POST", f"{base_url}/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=httpx.Timeout(HANG_SECONDS, connect=30)) as response:  # fmt: skip
            outcome.request_id = response.headers.get("x-request-id", "")
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    outcome.done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    outcome.error = (chunk.get("error") or {}).get("code") or outcome.error
                    outcome.usage = chunk.get("usage") or outcome.usage
                    if any(choice.get("text") for choice in chunk.get("choices") or []):
                        outcome.streaming.set()
                        if leave_after_text:
                            return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        outcome.cut = type(exc).__name__
    finally:
        outcome.streaming.set()  # a request that ended before it streamed is not waited for
        outcome.finished.set()


class Soak:
    """The stack, its private Redis and the faults injected into them."""

    def __init__(self, stack, redis_server) -> None:
        self.stack, self.redis_server = stack, redis_server
        self.web, self.worker = stack.children[0], stack.children[1]

    def prepare(self, fault: str) -> None:
        """Before a round's requests: the second worker of the continuation fault."""
        if fault == "worker-kill-continue":
            from benchmarks.platform_stack import POOL

            started = time.time()
            self.stack.stack.start_worker(
                "spare", POOL, model=self.stack.model_name, model_path=self.stack.model_dir, pod="bench-spare",
                concurrency=self.stack.worker_concurrency, loglevel="WARNING",
            )  # fmt: skip
            self.stack.stack.wait_ready(POOL, count=2, since=started)

    def inject(self, fault: str) -> None:
        if fault in ("worker-kill", "worker-kill-continue"):
            self.worker.send(signal.SIGKILL)  # the whole group: the Celery worker and its engine
        elif fault == "redis-restart":
            self.redis_server.stop()
            self.redis_server.start()
        elif fault == "web-kill":
            import psutil

            # The engine holds still until the worker stops the requests no one reads any more (their
            # gateway's lease lapses after READER_LEASE_SECONDS): left running, it would finish them first.
            self._engine(suspend=True)
            for process in psutil.Process(self.web.pid).children():
                process.kill()
        elif fault == "disconnect":
            # The clients left by themselves; the engine holds still until the worker stops their requests.
            self._engine(suspend=True)

    def recover(self, fault: str, outcomes: list[Outcome]) -> int:
        """Bring the stack back to serving after a fault. Returns, for the faults that hold the engine,
        how many requests the worker did not stop (no end written) within STOP_SECONDS."""
        not_stopped = 0
        if fault in ("web-kill", "disconnect"):
            not_stopped = self._wait_ended([o.request_id for o in outcomes if o.request_id])
            self._engine(suspend=False)
        if fault in ("worker-kill", "worker-kill-continue"):
            from benchmarks.platform_stack import POOL

            self.worker.process.wait()
            since = time.time()
            self.worker.start()
            # Both workers heartbeat after the restart: the restarted one is ready, not only the spare.
            self.stack.stack.wait_ready(POOL, count=2 if fault == "worker-kill-continue" else 1, since=since)
        if fault == "worker-kill-continue":
            self.stack.stack.stop("spare")
        self.web.wait_http(f"{self.stack.base_url.removesuffix('/v1')}/healthz", 120)
        return not_stopped

    def _engine(self, *, suspend: bool) -> None:
        """SIGSTOP (or SIGCONT) the worker's vLLM engine processes; the worker itself goes on."""
        import psutil

        for process in psutil.Process(self.worker.pid).children(recursive=True):
            if not process.name().startswith("VLLM::"):
                continue
            if suspend:
                process.suspend()
            else:
                process.resume()

    def _wait_ended(self, request_ids: list[str]) -> int:
        """Wait until every request has its end (a done entry) in Redis; how many had none by STOP_SECONDS."""
        import redis

        from contract import protocol

        client = redis.Redis.from_url(self.stack.env["REDIS_URL"], decode_responses=True)

        def ended(request_id: str) -> bool:
            return any(fields.get("t") == "done" for _, fields in client.xrange(protocol.events_key(request_id)))

        stop_by = time.monotonic() + STOP_SECONDS
        pending = list(request_ids)
        while pending and time.monotonic() < stop_by:
            pending = [request_id for request_id in pending if not ended(request_id)]
            time.sleep(0.5)
        client.close()
        return len(pending)

    def round(self, fault: str, streams: int) -> dict:
        self.prepare(fault)
        outcomes = [Outcome() for _ in range(streams)]
        clients = [
            threading.Thread(
                target=_stream, args=(self.stack.base_url, self.stack.api_key, o, fault == "disconnect"), daemon=True
            )  # fmt: skip
            for o in outcomes
        ]
        for client in clients:
            client.start()
        streaming_by = time.monotonic() + STREAMING_SECONDS
        for outcome in outcomes:
            outcome.streaming.wait(max(0.0, streaming_by - time.monotonic()))
        mid_stream = sum(not o.finished.is_set() for o in outcomes)
        self.inject(fault)
        hang_by = time.monotonic() + HANG_SECONDS
        for client in clients:
            client.join(max(0.0, hang_by - time.monotonic()))
        hung = sum(not o.finished.is_set() for o in outcomes)
        not_stopped = self.recover(fault, outcomes)
        return {"fault": fault, "mid_stream_at_fault": mid_stream, "hung": hung, "not_stopped": not_stopped,
                **self._usage(outcomes)}  # fmt: skip

    def _usage(self, outcomes: list[Outcome]) -> dict:
        import psycopg
        import redis

        ids = [o.request_id for o in outcomes if o.request_id]
        rows: dict[str, list[tuple[str, int]]] = {}
        settle_by = time.monotonic() + SETTLE_SECONDS
        with psycopg.connect(self.stack.env["DATABASE_URL"], autocommit=True) as conn:
            while True:
                rows = {}
                for request_id, status, completion in conn.execute(
                    "SELECT request_id, status, completion_tokens FROM ledger_usagerecord WHERE request_id = ANY(%s)",
                    (ids,),
                ):
                    rows.setdefault(request_id, []).append((status, completion))
                if len(rows) == len(ids) or time.monotonic() > settle_by:
                    break
                time.sleep(1)
        client = redis.Redis.from_url(self.stack.env["REDIS_URL"], decode_responses=True)
        held = sum(client.exists(f"resv:{request_id}") for request_id in rows)
        client.close()
        told = {o.request_id: o.usage["completion_tokens"] for o in outcomes if o.ok}
        statuses: dict[str, int] = {}
        for entries in rows.values():
            for status, _ in entries:
                statuses[status] = statuses.get(status, 0) + 1
        return {
            "tried": len(outcomes),
            "ok": sum(o.ok for o in outcomes),
            "explicit_error": sum(not o.ok and (o.error is not None or o.cut is not None) for o in outcomes),
            "no_request_id": len(outcomes) - len(ids),
            "rows_exactly_once": sum(len(entries) == 1 for entries in rows.values()),
            "usage_lost": len(ids) - len(rows),
            "counted_twice": sum(len(entries) > 1 for entries in rows.values()),
            "billed_other_than_told": sum(rows[i][0][1] != tokens for i, tokens in told.items() if i in rows),
            "reservations_held": held,
            "row_statuses": statuses,
            "errors_seen": sorted({o.error or o.cut for o in outcomes if o.error or o.cut}),
        }


COLUMNS = ("tried", "mid_stream_at_fault", "ok", "explicit_error", "hung", "not_stopped", "rows_exactly_once",
           "usage_lost", "counted_twice", "billed_other_than_told", "reservations_held")  # fmt: skip


def summary(results: list[dict]) -> str:
    """A markdown table: one line per fault, its rounds added up."""
    lines = ["| fault | rounds | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " | ledger statuses |",
             "|---|--:|" + "--:|" * len(COLUMNS) + "---|"]  # fmt: skip
    for fault in dict.fromkeys(r["fault"] for r in results):
        rounds = [r for r in results if r["fault"] == fault]
        totals = [str(sum(r[c] for r in rounds)) for c in COLUMNS]
        statuses: dict[str, int] = {}
        for r in rounds:
            for status, n in r["row_statuses"].items():
                statuses[status] = statuses.get(status, 0) + n
        described = ", ".join(f"{status} {n}" for status, n in sorted(statuses.items()))
        lines.append(f"| {fault} | {len(rounds)} | " + " | ".join(totals) + f" | {described} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each fault")
    parser.add_argument("--streams", type=int, default=4, help="streamed requests in flight at each fault")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    args = parser.parse_args(argv)
    faults = [name.strip() for name in args.faults.split(",") if name.strip()]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(sorted(unknown))}")

    from benchmarks.platform_stack import PlatformStack
    from deploy.local.services import EmbeddedRedis
    from workers.tinymodel import build_tiny_model

    model_dir = str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))
    redis_server = EmbeddedRedis(ROOT / ".run" / "faults")
    os.environ["REDIS_URL"] = redis_server.start()  # the stack's Redis: this one, which the soak restarts
    results = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        with PlatformStack(model_dir, MODEL_NAME, extra_env=STACK_ENV, database=DATABASE) as stack:
            soak = Soak(stack, redis_server)
            for n in range(args.rounds):
                for fault in faults:
                    result = soak.round(fault, args.streams)
                    results.append(result)
                    print(json.dumps({"round": n + 1, **result}), flush=True)
    finally:
        redis_server.stop()
    print(f"\n{args.rounds} round(s) of {args.streams} streams per fault, {MAX_TOKENS} tokens asked, from {started}:\n")
    print(summary(results))
    bad = sum(r["hung"] + r["not_stopped"] + r["usage_lost"] + r["counted_twice"] + r["billed_other_than_told"]
              for r in results)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

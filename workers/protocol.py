"""The Redis contract between the gateway (web) and the GPU workers.

Per request (all keys expire after REQUEST_TTL seconds):
  req:<rid>:in      JSON input written by the gateway before dispatch (prompt ids, params, who pays).
  req:<rid>:claim   identity of the worker that claimed the request: set in the same script that takes
                    (GETDEL) the input, so a request whose input is gone always names its claimer.
  req:<rid>:ev      Redis Stream of events written by the worker, read by the gateway:
                      t=start  w=<worker identity>
                      t=delta  x=<text> n=<new completion tokens>      (coalesced: one per flush interval)
                      t=done   u=<usage JSON>
                      t=error  m=<message> c=<code>
  req:<rid>:cancel  set by the gateway when the client went away; the worker aborts the engine request.
  req:<rid>:reader  the gateway's lease on the request (READER_LEASE_SECONDS), set at enqueue and
                    renewed while it relays; a worker aborts a request whose lease it saw lapse.
Ledger:
  ledger:pending    hash rid -> usage JSON; written by the worker in the same MULTI as the done event,
                    drained into PostgreSQL (idempotent on rid) by the gateway and a periodic task.
Pools and workers (a worker's identity is its Celery node name plus a nonce drawn at each process
start, `worker_identity`: a worker restarted under the same node name is a new worker here, and the
requests its previous process claimed or started are lost, not taken for its own):
  pool:<pool>:workers  sorted set worker identity -> last heartbeat (unix seconds)
  worker:<identity>    hash: node, pool, pod, model, state (starting|ready|draining|stopped), in_flight,
                       slots, tps, updated
  pool:<pool>:drain    set of pod names asked to drain
  pool:<pool>:waiting  count of requests held at a gateway waiting for a worker (scale from zero)
"""

import json
import os
import secrets
from dataclasses import asdict, dataclass, field

REQUEST_TTL = 3600
# The gateway holds a lease on each request it relays (req:<rid>:reader, set at enqueue, renewed
# while it reads); a worker stops a request whose lease lapsed: the web process that relayed it died,
# so no one reads what it generates (it is billed for what it generated, as for a disconnect).
READER_LEASE_SECONDS = float(os.environ.get("READER_LEASE_SECONDS", "60"))


def input_key(rid: str) -> str:
    return f"req:{rid}:in"


def claim_key(rid: str) -> str:
    return f"req:{rid}:claim"


def events_key(rid: str) -> str:
    return f"req:{rid}:ev"


def cancel_key(rid: str) -> str:
    return f"req:{rid}:cancel"


def reader_key(rid: str) -> str:
    return f"req:{rid}:reader"


LEDGER_PENDING = "ledger:pending"


def pool_workers_key(pool: str) -> str:
    return f"pool:{pool}:workers"


def worker_key(name: str) -> str:
    return f"worker:{name}"


def worker_identity(node: str) -> str:
    """A worker process's identity in Redis: its Celery node name (``worker@%h``, for people and
    for Celery's remote control) and a nonce of this process start."""
    return f"{node}#{secrets.token_hex(4)}"


def pool_drain_key(pool: str) -> str:
    return f"pool:{pool}:drain"


def pool_waiting_key(pool: str) -> str:
    return f"pool:{pool}:waiting"


def queue_name(pool: str) -> str:
    return f"pool.{pool}"


@dataclass
class RequestInput:
    """What a worker needs to run one request; stored at input_key(rid)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: dict
    tenant_id: int
    key_id: int
    enqueued_at: float
    cache_salt: str = ""

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> "RequestInput":
        return cls(**json.loads(raw))


@dataclass
class Usage:
    """One request's metered usage, as the engine counted it. Becomes one ledger row."""

    request_id: str
    tenant_id: int
    key_id: int
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: int = 0
    ttft_ms: int | None = None
    total_ms: int = 0
    finish_reason: str | None = None
    # ok | cancelled (client went away) | error | worker_lost
    status: str = "ok"
    worker: str = ""
    finished_at: float = 0.0
    extra: dict = field(default_factory=dict)

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> "Usage":
        return cls(**json.loads(raw))

"""The Redis contract between the gateway (web) and the GPU workers.

Both sides import it from `contract`, the one package of platform/ a worker imports (with the task
message, the settle script and the adapter store beside it): a change here changes both sides, which
a rolling upgrade runs at different versions for a while, so each side reads what the other's
previous or next version writes (`RequestInput.loads`, `Usage.loads`).

Per request (all keys expire after REQUEST_TTL seconds). A request runs as one attempt, or several
when the workers running it are lost (a continuation: the prompt plus the tokens already generated,
on another worker); the keys of an attempt are named by `attempt_id` (the request id, then
`<rid>~<n>` for the n-th continuation), those of the request by its id:
  req:<aid>:in      JSON input written by the gateway before dispatch (prompt ids, params, who pays,
                    a multimodal request's images).
  req:<aid>:claim   identity of the worker that claimed the request: set in the same script that takes
                    (GETDEL) the input, so a request whose input is gone always names its claimer.
  req:<aid>:ev      Redis Stream of events written by the worker, read by the gateway:
                      t=start  w=<worker identity>
                      t=delta  x=<text> n=<new completion tokens>      (coalesced: one per flush interval)
                               [i=<choice index>, when n > 1] [l=<logprobs JSON>, when asked for:
                               a list of [token, logprob, [[token, logprob], ...]] per token]
                               [k=<the new token ids, comma-separated>, when n = 1: what a
                               continuation appends to the prompt]
                      t=done   u=<usage JSON> [c=<choices JSON>, when n > 1 or tools are parsed: per
                               choice {"finish_reason": ..., "tool_calls": [{"name", "arguments"}]}]
                      t=error  m=<message> c=<code>
  req:<aid>:cancel  set by the gateway when the client went away or the attempt's worker was given
                    up for lost; the worker aborts the engine request.
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
                       slots, tps, updated, lora ("1" when its engine runs LoRA adapters,
                       ENGINE_LORA; absent or "0": it refuses requests with one), adapters
                       (comma-separated ids of the LoRA adapters its engine holds), kv_tokens (the
                       tokens its engine's KV cache holds; 0: unknown)
Queues: pool.<pool> (every worker of the pool) and worker.<identity> (that worker only: the gateway's
route step sends each request to the one it chose, gateway/routing.py).
  pool:<pool>:drain    set of pod names asked to drain
  pool:<pool>:waiting  count of requests held at a gateway waiting for a worker (scale from zero)
Adapters:
  adapters:deleted     sorted set adapter id -> when it was deleted (unix seconds; entries kept a
                       day): a worker whose engine loaded one of them unloads it and refuses requests
                       naming it (workers/adapters.py)
"""

import json
import os
import secrets
from dataclasses import dataclass, field, fields
from typing import ClassVar

REQUEST_TTL = 3600
# The gateway holds a lease on each request it relays (req:<rid>:reader, set at enqueue, renewed
# while it reads); a worker stops a request whose lease lapsed: the web process that relayed it died,
# so no one reads what it generates (it is billed for what it generated, as for a disconnect).
READER_LEASE_SECONDS = float(os.environ.get("READER_LEASE_SECONDS", "60"))


def attempt_id(request: "RequestInput") -> str:
    """The id of the request's current attempt: its own id, then ``<rid>~<n>`` for its n-th
    continuation (the keys, task and engine request of that attempt)."""
    return request.request_id if not request.attempt else f"{request.request_id}~{request.attempt}"


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


def fresh_workers(client, pool: str, since: float) -> dict[str, dict]:
    """The heartbeat records (``worker:<identity>`` hashes, plus ``seen``: the last heartbeat, unix
    seconds) of the workers of ``pool`` that heartbeat at or after ``since``, by identity. ``client``
    is a synchronous redis client that decodes responses; the records come in one round trip."""
    scored = client.zrangebyscore(pool_workers_key(pool), since, "+inf", withscores=True)
    pipe = client.pipeline(transaction=False)
    for name, _ in scored:
        pipe.hgetall(worker_key(name))
    records = pipe.execute() if scored else []
    return {name: {**record, "seen": seen} for (name, seen), record in zip(scored, records, strict=True)}


ADAPTERS_DELETED = "adapters:deleted"
ADAPTERS_DELETED_KEEP_SECONDS = 86400


def runs_lora(record: dict) -> bool:
    """Whether a worker's heartbeat record says its engine runs LoRA adapters (the `lora` field)."""
    return record.get("lora") == "1"


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


def worker_queue_name(identity: str) -> str:
    """The queue only this worker process consumes: the requests the route step sent to it (gateway/routing.py)."""
    return f"worker.{identity}"


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
    # How the worker reads tool calls out of each choice (gateway/structured.py ToolSpec): "" none,
    # "auto" (the model's own call syntax), "required" (a JSON array of {name, parameters}), "named"
    # (the JSON arguments of `tool_name`).
    tool_mode: str = ""
    tool_name: str = ""
    # A tenant's LoRA adapter to run with (0: the base model): its stable id (the engine's LoRA id)
    # and the digest of its files in the adapter store (workers/adapters.py).
    adapter_id: int = 0
    adapter_digest: str = ""
    # The worker whose own queue the request was sent to (gateway/routing.py); "" for the pool's queue.
    routed_to: str = ""
    # A continuation (`attempt` > 0, see the module docstring): the completion tokens of the earlier
    # attempts, appended to prompt_token_ids and billed as completion, and the workers that ran them
    # (comma-separated), named with this attempt's worker in the request's one ledger row.
    attempt: int = 0
    continued_tokens: int = 0
    earlier_workers: str = ""
    # The images of a multimodal chat request, in prompt order (gateway/images.py): each
    # {"data": base64 of a PNG, JPEG or WebP file, at most the model's largest input, "tokens": the
    # prompt tokens it takes}. Each is one placeholder token in prompt_token_ids, which the engine
    # expands into its `tokens` tokens.
    images: list[dict] = field(default_factory=list)
    # Fields of the stored input this version does not know (set by `loads`, never stored).
    unknown_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def engine_prompt_tokens(self) -> int:
        """The prompt's length as the engine prefills it (images expanded; a continuation's earlier
        completion tokens included)."""
        return len(self.prompt_token_ids) + sum(image["tokens"] - 1 for image in self.images)

    @property
    def prompt_tokens(self) -> int:
        """The prompt the client sent, as the engine counts it: what the request is billed as prompt."""
        return self.engine_prompt_tokens - self.continued_tokens

    def dumps(self) -> str:
        return _dumps(self)

    @classmethod
    def loads(cls, raw: str) -> "RequestInput":
        """The stored input. Fields this version does not know (a newer gateway during a rolling
        upgrade) are named in `unknown_fields`: the worker refuses such a request at once (an error
        the client sees now) rather than run it without what they ask for, or fail the task and leave
        the gateway to wait out the start timeout."""
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        request = cls(**{name: value for name, value in data.items() if name in known})
        request.unknown_fields = tuple(sorted(set(data) - known))  # type: ignore[misc]  # per instance, never a field
        return request


@dataclass
class Usage:
    """One request's metered usage, as the engine counted it. Becomes one ledger row."""

    request_id: str
    tenant_id: int
    key_id: int
    model: str
    prompt_tokens: int = 0
    # Of prompt_tokens, those the engine served from its prefix cache (vLLM's num_cached_tokens).
    cached_tokens: int = 0
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
        return _dumps(self)

    @classmethod
    def loads(cls, raw: str) -> "Usage":
        """The stored usage. A field missing (an entry written before it existed) takes its default;
        a field this version does not know (a newer worker's, during a rolling upgrade) is dropped,
        so the entry is still billed rather than stuck in the pending buffer."""
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in known})


def _dumps(record: RequestInput | Usage) -> str:
    """The record's fields as compact JSON. Not ``dataclasses.asdict``, which deep-copies every value
    first: a prompt's token ids one by one, ~10x the cost of the encoding (one input and one usage
    entry per request, on the gateway's and the worker's hot paths)."""
    return json.dumps({f.name: getattr(record, f.name) for f in fields(record)}, separators=(",", ":"))

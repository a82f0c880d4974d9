"""The pool scaler's decisions, as pure functions of (spec, demand, cluster view, status, clock).

Nothing here talks to Kubernetes or the control plane: `poolscaler.py` gathers the inputs, calls
`plan()`, carries out the returned `Plan` and writes its `PoolState` back to the ModelPool status.
Keeping the state in the status (not in the process) lets a restarted operator resume a drain.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The annotation the ReplicaSet controller reads to pick which pod to delete on scale-down
# (lower cost first; default 0). Beta and on by default since Kubernetes 1.22.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DELETION_COST_DRAINING = "-1000"
# Our own mark: when this operator asked the control plane to drain the pod. It is the durable
# record of "drain requested and not yet cancelled", read back to clean up stale drains.
DRAIN_MARK_ANNOTATION = "hosting.gemma.dev/drain-requested-at"

# Float noise guard for ceil() of ratios such as 12 / 4 * 1.0.
_EPSILON = 1e-9


class InvalidSpecError(ValueError):
    """The ModelPool spec cannot be acted on; only a spec change fixes it."""


class DemandFormatError(ValueError):
    """The control plane answered, but not with the demand document the operator expects."""


# --------------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    model: str
    pool: str
    gpu_kind: str
    worker_deployment: str
    min_replicas: int = 1
    max_replicas: int
    target_queue_wait_seconds: float = 5.0
    target_tokens_per_second_per_replica: float | None = None
    scale_down_cooldown_seconds: float = 300.0
    allow_scale_to_zero: bool = False
    drain_timeout_seconds: float = 600.0
    # Warm spare nodes: placeholder pods of `spare_deployment` (lowest priority, one GPU each) that
    # keep that many GPU nodes up with the worker image pulled, so a scale-up preempts one and its
    # worker starts on a ready node instead of waiting for a new one. See spare_replicas().
    warm_spare_nodes: int = 0
    spare_deployment: str | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> PoolSpec:
        """Parse and validate a ModelPool `.spec` (the CRD's defaults apply when a field is absent).

        The CRD schema validates the same rules at admission; they are checked again here because
        an older CRD, a `kubectl replace` of the CRD or a test API server may not have.
        """
        parsed = cls(
            model=_required_str(spec, "model"),
            pool=_required_str(spec, "pool"),
            gpu_kind=_required_str(spec, "gpuKind"),
            worker_deployment=_required_str(spec, "workerDeployment"),
            min_replicas=_int(spec, "minReplicas", 1),
            max_replicas=_int(spec, "maxReplicas", None),
            target_queue_wait_seconds=_number(spec, "targetQueueWaitSeconds", 5.0),
            target_tokens_per_second_per_replica=_optional_number(spec, "targetTokensPerSecondPerReplica"),
            scale_down_cooldown_seconds=_number(spec, "scaleDownCooldownSeconds", 300.0),
            allow_scale_to_zero=_bool(spec, "allowScaleToZero", False),
            drain_timeout_seconds=_number(spec, "drainTimeoutSeconds", 600.0),
            warm_spare_nodes=_int(spec, "warmSpareNodes", 0),
            spare_deployment=_optional_str(spec, "spareDeployment"),
        )
        parsed._check()
        return parsed

    def _check(self) -> None:
        tokens_target = self.target_tokens_per_second_per_replica
        rules = (
            (self.min_replicas < 0, "minReplicas must be >= 0"),
            (self.max_replicas < 1, "maxReplicas must be >= 1"),
            (self.min_replicas > self.max_replicas, "minReplicas must not exceed maxReplicas"),
            (
                self.min_replicas == 0 and not self.allow_scale_to_zero,
                "minReplicas may be 0 only when allowScaleToZero is true",
            ),
            (self.target_queue_wait_seconds <= 0, "targetQueueWaitSeconds must be > 0"),
            (
                tokens_target is not None and tokens_target <= 0,
                "targetTokensPerSecondPerReplica must be > 0",
            ),
            (self.scale_down_cooldown_seconds < 0, "scaleDownCooldownSeconds must be >= 0"),
            (self.drain_timeout_seconds < 0, "drainTimeoutSeconds must be >= 0"),
            (self.warm_spare_nodes < 0, "warmSpareNodes must be >= 0"),
            (
                self.warm_spare_nodes > 0 and not self.spare_deployment,
                "warmSpareNodes needs spareDeployment (the Deployment of the placeholder pods)",
            ),
        )
        problems = [message for failed, message in rules if failed]
        if problems:
            raise InvalidSpecError("; ".join(problems))


def _required_str(spec: Mapping[str, Any], key: str) -> str:
    value = spec.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidSpecError(f"{key} is required and must be a non-empty string")
    return value


def _optional_str(spec: Mapping[str, Any], key: str) -> str | None:
    value = spec.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidSpecError(f"{key} must be a string")
    return value


def _int(spec: Mapping[str, Any], key: str, default: int | None) -> int:
    value = spec.get(key, default)
    if value is None:
        raise InvalidSpecError(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(f"{key} must be an integer")
    return value


def _number(spec: Mapping[str, Any], key: str, default: float) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidSpecError(f"{key} must be a number")
    return float(value)


def _optional_number(spec: Mapping[str, Any], key: str) -> float | None:
    return None if spec.get(key) is None else _number(spec, key, 0.0)


def _bool(spec: Mapping[str, Any], key: str, default: bool) -> bool:
    value = spec.get(key, default)
    if not isinstance(value, bool):
        raise InvalidSpecError(f"{key} must be true or false")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Worker:
    name: str
    pod: str
    in_flight: int
    state: str  # "ready" | "starting" | "draining"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demand:
    """One reading of `GET /api/v1/pools/{pool}/demand` (see docs/operator.md for the contract)."""

    queue_depth: int = 0
    waiting: int = 0
    in_flight: int = 0
    tokens_per_second: float = 0.0
    oldest_queued_wait_seconds: float = 0.0
    workers: tuple[Worker, ...] = ()

    @classmethod
    def from_json(cls, payload: Any) -> Demand:
        if not isinstance(payload, Mapping):
            raise DemandFormatError("demand must be a JSON object")
        try:
            workers = tuple(
                Worker(
                    name=str(item["name"]),
                    pod=str(item.get("pod") or ""),
                    in_flight=_count(item.get("in_flight", 0)),
                    state=str(item.get("state", "ready")),
                )
                for item in payload.get("workers") or ()
            )
            return cls(
                queue_depth=_count(payload.get("queue_depth", 0)),
                waiting=_count(payload.get("waiting", 0)),
                in_flight=_count(payload.get("in_flight", 0)),
                tokens_per_second=max(0.0, float(payload.get("tokens_per_second") or 0.0)),
                oldest_queued_wait_seconds=max(0.0, float(payload.get("oldest_queued_wait_seconds") or 0.0)),
                workers=workers,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DemandFormatError(f"malformed demand document: {exc!r}") from exc

    @property
    def backlog(self) -> int:
        """Requests not yet on any worker: queued in Celery plus held at the gateway."""
        return self.queue_depth + self.waiting

    @property
    def ready_workers(self) -> int:
        return sum(1 for worker in self.workers if worker.state == "ready")

    def in_flight_on(self, pod: str) -> int:
        return sum(worker.in_flight for worker in self.workers if worker.pod == pod)

    def summary(self, now: float) -> dict[str, Any]:
        """The `status.lastDemand` object."""
        return {
            "queueDepth": self.queue_depth,
            "waiting": self.waiting,
            "inFlight": self.in_flight,
            "tokensPerSecond": round(self.tokens_per_second, 3),
            "oldestQueuedWaitSeconds": round(self.oldest_queued_wait_seconds, 3),
            "readyWorkers": self.ready_workers,
            "observedTime": format_time(now),
        }


def _count(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a count must be a number")
    return max(0, int(value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodView:
    """What the scaler needs of one pod of the worker Deployment."""

    name: str
    ready: bool
    terminating: bool = False
    drain_requested_at: float | None = None  # from DRAIN_MARK_ANNOTATION
    scheduled: bool = True  # spec.nodeName is set
    phase: str = "Running"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolState:
    """The scaler's memory, kept in the ModelPool status between reconciles."""

    last_scale_time: float | None = None
    demand_peak_time: float | None = None
    draining: tuple[str, ...] = ()
    drain_started_time: float | None = None

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> PoolState:
        draining = status.get("draining") or ()
        return cls(
            last_scale_time=parse_time(status.get("lastScaleTime")),
            demand_peak_time=parse_time(status.get("demandPeakTime")),
            draining=tuple(str(name) for name in draining) if isinstance(draining, list) else (),
            drain_started_time=parse_time(status.get("drainStartedTime")),
        )

    def to_status(self) -> dict[str, Any]:
        return {
            "lastScaleTime": format_time(self.last_scale_time),
            "demandPeakTime": format_time(self.demand_peak_time),
            "draining": list(self.draining),
            "drainStartedTime": format_time(self.drain_started_time),
        }


def format_time(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


# ------------------------------------------------------------------------------------------ decisions


def replica_floor(spec: PoolSpec) -> int:
    return spec.min_replicas if spec.allow_scale_to_zero else max(spec.min_replicas, 1)


def desired_replicas(spec: PoolSpec, demand: Demand, current: int) -> int:
    """Replicas the pool needs for this demand reading, clamped to [floor, maxReplicas].

    Each signal votes for a replica count and the largest vote wins:
    - a backlog (queued or held requests) means the current replicas are saturated: never fewer
      than now, and at least one (this is the wake-up from zero);
    - streams in flight need at least one replica;
    - when the oldest queued request has waited past targetQueueWaitSeconds, the backlog is
      spread over replicas at the concurrency the ready workers hold now
      (ready * (in_flight + backlog) / in_flight), or one more replica if none is busy;
    - with targetTokensPerSecondPerReplica, ceil(tokens/s / target).
    Replicas still starting count in `current`, so a slow start does not trigger repeated
    scale-ups: the backlog vote compares against what was already asked for.
    """
    votes = [replica_floor(spec)]
    if demand.backlog > 0:
        votes.append(max(current, 1))
    if demand.in_flight > 0:
        votes.append(1)
    ready = demand.ready_workers
    if demand.backlog > 0 and ready > 0 and demand.oldest_queued_wait_seconds > spec.target_queue_wait_seconds:
        if demand.in_flight > 0:
            per_replica = demand.in_flight / ready
            votes.append(math.ceil((demand.in_flight + demand.backlog) / per_replica - _EPSILON))
        else:
            votes.append(current + 1)
    if spec.target_tokens_per_second_per_replica:
        votes.append(math.ceil(demand.tokens_per_second / spec.target_tokens_per_second_per_replica - _EPSILON))
    return max(replica_floor(spec), min(spec.max_replicas, max(votes)))


def spare_replicas(spec: PoolSpec, replicas: int) -> int:
    """Placeholder pods the spare Deployment should run next to `replicas` workers.

    A placeholder holds a GPU node that a worker of any pool preempts when it finds no free node:
    the worker then starts on a node that is up, with the image pulled (on A10G about a minute with
    a shared model cache, against ~5.5 minutes on a new node; docs/operator.md), and the cluster
    autoscaler adds a node for the evicted placeholder in the background. A pool at maxReplicas
    can never use its spares, so it keeps only as many as it has room to grow
    (`maxReplicas - replicas`): no GPU-hours held for nothing.
    """
    if not spec.spare_deployment:
        return 0
    return max(0, min(spec.warm_spare_nodes, spec.max_replicas - replicas))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What to do now. `replicas` is None when the Deployment's scale stays as it is. `spares` is
    the placeholder count of the pool's spare Deployment after this step (see spare_replicas)."""

    desired: int
    replicas: int | None
    start_drain: tuple[str, ...]
    cancel_drain: tuple[str, ...]
    state: PoolState
    reason: str
    spares: int = 0


def plan(
    *,
    spec: PoolSpec,
    demand: Demand,
    current: int,
    pods: Sequence[PodView],
    state: PoolState,
    now: float,
    stale_drain_grace_seconds: float = 60.0,
) -> Plan:
    """Decide one reconcile step.

    Scale-up is immediate. Scale-down goes through three steps over several reconciles:
    cooldown (scaleDownCooldownSeconds since the last scale event or demand peak), drain (the
    victims stop taking tasks and get the lowest pod-deletion-cost), and only when every victim
    has no stream in flight (or drainTimeoutSeconds passed) the replica count is lowered.
    A drain is cancelled when demand comes back before it finishes.
    """
    desired = desired_replicas(spec, demand, current)
    peak = now if (desired >= current or state.demand_peak_time is None) else state.demand_peak_time
    state = dataclasses.replace(state, demand_peak_time=peak)
    if state.draining:
        step = _continue_drain(spec, demand, current, pods, state, desired, now)
    else:
        step = _decide(spec, demand, current, pods, state, desired, now)
    stale = _stale_drains(pods, step.state.draining, now, spec.drain_timeout_seconds + stale_drain_grace_seconds)
    replicas = current if step.replicas is None else step.replicas
    return dataclasses.replace(
        step, cancel_drain=tuple(dict.fromkeys(step.cancel_drain + stale)), spares=spare_replicas(spec, replicas)
    )


def _decide(
    spec: PoolSpec, demand: Demand, current: int, pods: Sequence[PodView], state: PoolState, desired: int, now: float
) -> Plan:
    hold = Plan(desired=desired, replicas=None, start_drain=(), cancel_drain=(), state=state, reason="steady")
    if desired > current:
        scaled = dataclasses.replace(state, last_scale_time=now)
        return dataclasses.replace(hold, replicas=desired, state=scaled, reason=f"scale up {current} -> {desired}")
    if desired == current:
        return hold
    if current <= spec.max_replicas:  # above max (spec edited): shrink without waiting for the cooldown
        since = max(state.last_scale_time or 0.0, state.demand_peak_time or 0.0)
        left = spec.scale_down_cooldown_seconds - (now - since)
        if left > 0:
            return dataclasses.replace(hold, reason=f"cooldown: {left:.0f}s before scaling {current} -> {desired}")
    victims = _pick_victims(pods, demand, current, current - desired)
    if not victims:  # the replicas to drop have no pod yet: nothing can be in flight on them
        scaled = dataclasses.replace(state, last_scale_time=now)
        return dataclasses.replace(hold, replicas=desired, state=scaled, reason=f"scale down {current} -> {desired}")
    draining = dataclasses.replace(state, draining=victims, drain_started_time=now)
    return dataclasses.replace(
        hold,
        start_drain=victims,
        state=draining,
        reason=f"draining {', '.join(victims)} to scale {current} -> {desired}",
    )


# The ReplicaSet controller deletes Pending pods before Unknown ones, and those before Running ones.
_PHASE_DELETION_ORDER = {"Pending": 0, "Unknown": 1, "Running": 2}


def _pick_victims(pods: Sequence[PodView], demand: Demand, current: int, count: int) -> tuple[str, ...]:
    """The pods a scale-down by `count` will remove, in the ReplicaSet controller's own order.

    The controller (ActivePodsWithRanks) deletes, whatever their deletion cost: pods not yet on a
    node first, then by phase (Pending, Unknown, Running), then pods that are not ready; only
    among the rest does the lowest cost go first. So those pods are the first victims (they are
    drained too: a worker may hold streams while failing its probe), then ready pods with the
    fewest streams in flight, which the drain marks with the lowest cost: the pods drained are
    the pods the controller deletes. Replicas that have no pod at all are dropped first and need
    no victim.
    """
    alive = [pod for pod in pods if not pod.terminating]
    needed = count - max(0, current - len(alive))
    ranked = sorted(
        alive,
        key=lambda pod: (
            pod.scheduled,
            _PHASE_DELETION_ORDER.get(pod.phase, len(_PHASE_DELETION_ORDER)),
            pod.ready,
            demand.in_flight_on(pod.name),
            pod.name,
        ),
    )
    return tuple(pod.name for pod in ranked[: max(0, needed)])


def _continue_drain(
    spec: PoolSpec, demand: Demand, current: int, pods: Sequence[PodView], state: PoolState, desired: int, now: float
) -> Plan:
    target = max(current - len(state.draining), replica_floor(spec))
    done = PoolState(last_scale_time=state.last_scale_time, demand_peak_time=state.demand_peak_time)
    if desired > target:
        replicas = desired if desired > current else None
        if replicas is not None:
            done = dataclasses.replace(done, last_scale_time=now)
        return Plan(
            desired=desired,
            replicas=replicas,
            start_drain=(),
            cancel_drain=state.draining,
            state=done,
            reason=f"demand returned: cancel drain of {', '.join(state.draining)}",
        )
    present = {pod.name for pod in pods if not pod.terminating}
    busy = {name: demand.in_flight_on(name) for name in state.draining if name in present}
    busy = {name: streams for name, streams in busy.items() if streams > 0}
    elapsed = now - (state.drain_started_time if state.drain_started_time is not None else now)
    if busy and elapsed < spec.drain_timeout_seconds:
        detail = ", ".join(f"{name}: {streams}" for name, streams in sorted(busy.items()))
        return Plan(
            desired=desired,
            replicas=None,
            start_drain=(),
            cancel_drain=(),
            state=state,
            reason=f"waiting for drain ({detail} in flight)",
        )
    # Every marked pod has the lowest deletion cost, and the ReplicaSet removes the lowest first:
    # a marked pod that is not one of these victims (a drain left behind, or a drain call that
    # failed after the mark) must lose its mark before the count drops, or it could go instead.
    strays = tuple(
        pod.name
        for pod in pods
        if pod.drain_requested_at is not None and not pod.terminating and pod.name not in state.draining
    )
    if strays:
        return Plan(
            desired=desired,
            replicas=None,
            start_drain=(),
            cancel_drain=strays,
            state=state,
            reason=f"clearing the drain marks of {', '.join(strays)} before scaling down",
        )
    why = "drained" if not busy else f"drain timeout after {elapsed:.0f}s"
    return Plan(
        desired=desired,
        replicas=target,
        start_drain=(),
        cancel_drain=(),
        state=dataclasses.replace(done, last_scale_time=now),
        reason=f"{why}: scale down {current} -> {target}",
    )


def _stale_drains(pods: Iterable[PodView], draining: Sequence[str], now: float, grace: float) -> tuple[str, ...]:
    """Pods this operator drained that outlived their scale-down (the ReplicaSet removed others).

    A drained worker that stays takes no tasks: cancel its drain so it serves again.
    """
    return tuple(
        pod.name
        for pod in pods
        if pod.drain_requested_at is not None
        and pod.name not in draining
        and not pod.terminating
        and now - pod.drain_requested_at > grace
    )

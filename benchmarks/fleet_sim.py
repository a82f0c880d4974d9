"""Fleet simulator: the pool scaler's own decisions on a simulated A10G fleet, against two baselines.

    python -m benchmarks.fleet_sim                      # 20 pools, 24 h, up to 200 nodes (~1-2 min)
    python -m benchmarks.fleet_sim --hours 2 --pools 4  # quicker
    python -m benchmarks.fleet_sim --plot docs/operator-fleet.png --json results.json

Three policies see the same demand trace (same seed) in one run:

- `operator`: `deploy/operator/scaling.py`'s `plan()` (the module the operator runs, imported, not a
  copy) every POOLSCALER_INTERVAL_SECONDS per pool, with the demand document, pod views and status
  the operator would read, and its plan carried out as `poolscaler.py` does (cancel drains, scale,
  mark and drain victims). The ReplicaSet controller's choice of pods to delete is simulated.
- `static`: each pool fixed at the replicas its peak minute needs at the same per-replica target.
- `queue`: what KEDA's Redis scaler does on the Celery queue: desired = ceil(queue length /
  listLength), HPA's scale-up limit and 300 s scale-down stabilisation, no drain choice (the
  ReplicaSet deletes the newest pods; their preStop drain lets their streams finish).

The model, per second: Poisson arrivals per pool from a diurnal or bursty rate; a FIFO queue per
pool (requests that wait longer than the queue timeout are dropped, as the gateway answers 503); each
ready worker holds up to `concurrency` streams; a stream lasts output tokens / per-stream decode
rate (a discrete token mix). Queues and streams are fluid (fractional counts), which is exact for the
means and keeps a day of 20 pools in seconds. A new worker needs a node: a free one (model load
only, warm caches) or a new one (node start, image pull, first model load, compile included);
nodes are capped at `--max-nodes` and a node idle for the cluster autoscaler's
scale-down-unneeded-time is removed. GPU-hours count every node from its request to its removal.
Waits are measured in whole seconds (the step): a wait of 0 means under a second.

Warm spare nodes (the operator policy's `warmSpareNodes`): each pool's spare Deployment holds the
placeholder pods `scaling.plan()` asks for; all placeholders together form one buffer that a worker of
any pool preempts when no node is free (the scheduler does not care which Deployment a lower-priority
pod belongs to). The worker then starts on that node after the placeholder's exit; the evicted
placeholder takes a node a worker leaves, or the cluster autoscaler adds one for it. A placeholder
runs the worker image, so its node has the image once the pull is done; the worker there loads warm
(56 s), which assumes the model cache (weights and vLLM compile cache) is shared by the pool's nodes
(`modelCache.type: pvc`). Spare nodes count in the GPU-hours.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# The operator imports its decisions as the top-level module `scaling` (kopf puts its folder on the
# path): import the same file the same way.
sys.path.insert(0, str(ROOT / "deploy" / "operator"))
import scaling  # noqa: E402

# ----------------------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fleet:
    """A10G figures. Sources: docs/gpu.md (profile, start-up) and the chart's values-a10g.yaml."""

    max_nodes: int = 200
    concurrency: int = 64  # a10g profile: max_num_seqs 64 (worker.concurrency in values-a10g.yaml)
    # Per-stream decode rate: docs/gpu.md estimates ~75-90 tok/s at one stream and ~4,700 tok/s at
    # 64 streams (~73 per stream) for the a10g profile on an A10G (roofline, not measured).
    stream_tokens_per_second: float = 70.0
    # Output tokens per request and their shares (mean ~364 tokens, ~5.2 s of decode).
    token_mix: tuple[tuple[int, float], ...] = (
        (64, 0.15),
        (128, 0.25),
        (256, 0.30),
        (512, 0.18),
        (1024, 0.09),
        (2048, 0.03),
    )
    # Node provisioning (g5 instance boot, join, GPU device plugin): a typical EKS figure, an
    # assumption. Image pull of the worker image on a fresh node: an assumption.
    node_start_seconds: int = 120
    image_pull_seconds: int = 60
    # docs/gpu.md "Start-up": 147 s for an engine compiling from scratch (first start on a node),
    # 56 s for the platform worker with the compile cache of an earlier start.
    cold_load_seconds: int = 147
    warm_load_seconds: int = 56
    node_idle_removal_seconds: int = 600  # cluster autoscaler --scale-down-unneeded-time (default)
    # A worker that preempts a warm spare's placeholder pod waits for it to exit (its grace period).
    spare_eviction_seconds: int = 5
    queue_timeout_seconds: int = 600  # config.queueTimeoutSeconds in values-a10g.yaml
    operator_interval_seconds: int = 15  # POOLSCALER_INTERVAL_SECONDS default
    utilisation_target: float = 0.7  # streams per replica the static fleet and the operator aim at
    # Prompts: mean tokens per request (0: prefill left out, the decode rate alone), of which the
    # share served from the engine's prefix cache (what a cache-aware dispatch raises: a tenant's
    # system prompt and a chat's history are not prefilled again), and a replica's prefill rate
    # (an estimate: E4B's ~9 GFLOP per token at ~35 TFLOP/s, half an A10G's bf16 peak).
    prompt_tokens: int = 0
    cached_prompt_share: float = 0.0
    prefill_tokens_per_second: float = 4000.0

    @property
    def prefill_seconds(self) -> float:
        """What the prefills add to a stream's life: the engine's time goes to the prompts of the
        requests that arrive while the stream runs (at the target's streams, each of their uncached
        prompt tokens at the prefill rate), and the stream's decode waits for them."""
        uncached = self.prompt_tokens * (1.0 - self.cached_prompt_share)
        return self.utilisation_target * self.concurrency * uncached / self.prefill_tokens_per_second

    @property
    def output_share(self) -> float:
        """The share of a stream's life spent decoding (1 without prefill)."""
        decode = self.mean_tokens / self.stream_tokens_per_second
        return decode / (decode + self.prefill_seconds)

    @property
    def replica_tokens_per_second(self) -> float:
        """A replica's output tokens/s at full batch: its plateau."""
        return self.concurrency * self.stream_tokens_per_second * self.output_share

    @property
    def service_steps(self) -> np.ndarray:
        return np.array([
            max(1, math.ceil(tokens / self.stream_tokens_per_second + self.prefill_seconds))
            for tokens, _ in self.token_mix
        ])  # fmt: skip

    @property
    def service_shares(self) -> np.ndarray:
        shares = np.array([share for _, share in self.token_mix])
        return shares / shares.sum()

    @property
    def mean_service_seconds(self) -> float:
        return float((self.service_steps * self.service_shares).sum())

    @property
    def mean_decode_seconds(self) -> float:
        """A request's stream life without prefill: what the pools' demand is stated in (their peak
        streams at this life), so that fleets that prefill differently see the same requests."""
        steps = [max(1, math.ceil(tokens / self.stream_tokens_per_second)) for tokens, _ in self.token_mix]
        return float((np.array(steps) * self.service_shares).sum())

    @property
    def mean_tokens(self) -> float:
        return float(sum(tokens * share for tokens, share in self.token_mix))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolProfile:
    name: str
    peak_streams: float  # streams in flight at the peak of its trace (before Poisson noise), without prefill
    shape: str  # "diurnal" | "bursty" | "batch"
    phase_hours: float  # hour of the daily peak
    trough: float  # share of the peak at the daily low
    spec: scaling.PoolSpec


VALUES_A10G = ROOT / "helm" / "gemma-platform" / "values-a10g.yaml"


def shipped_tokens_target(path: Path = VALUES_A10G) -> float:
    """targetTokensPerSecondPerReplica of the chart's A10G values' interactive pool (the first pool)."""
    import yaml

    values = yaml.safe_load(path.read_text())
    return float(values["pools"][0]["autoscaling"]["targetTokensPerSecondPerReplica"])


# What the chart ships; the simulation's interactive pools run with it.
VALUES_A10G_TOKENS_TARGET = shipped_tokens_target()


def default_pools(count: int, fleet: Fleet, rng: np.random.Generator) -> list[PoolProfile]:
    """`count` pools: mostly interactive (diurnal, some with bursts), ~1 in 10 a scale-to-zero batch
    pool. Sizes fall off like a real tenant mix: a few large pools, a long tail of small ones."""
    per_replica = fleet.concurrency * fleet.utilisation_target
    pools = []
    for index in range(count):
        batch = count >= 5 and index % 10 == 9
        peak_replicas = 1.5 if batch else max(0.6, 24.0 / (1 + index * 0.45))
        shape = "batch" if batch else ("bursty" if index % 3 == 1 else "diurnal")
        spec = scaling.PoolSpec(
            model="google/gemma-4-E4B-it",
            pool=f"pool-{index:02d}",
            gpu_kind="a10g",
            worker_deployment=f"worker-{index:02d}",
            # values-a10g.yaml: interactive pools keep a worker, target 2 s, cooldown 300 s, and a
            # tokens/s target at ~70% of a replica's plateau; the batch pool scales to zero, target 30 s.
            min_replicas=0 if batch else 1,
            max_replicas=max(2, math.ceil(peak_replicas * 2.0)),
            target_queue_wait_seconds=30.0 if batch else 2.0,
            target_tokens_per_second_per_replica=None if batch else VALUES_A10G_TOKENS_TARGET,
            scale_down_cooldown_seconds=1200.0 if batch else 300.0,
            allow_scale_to_zero=batch,
            drain_timeout_seconds=540.0,
            # Bursty pools keep warm spare nodes, about one per 10 replicas of their peak.
            warm_spare_nodes=math.ceil(peak_replicas / 10) if shape == "bursty" else 0,
            spare_deployment=f"worker-{index:02d}-spare",
        )
        pools.append(
            PoolProfile(
                name=spec.pool,
                peak_streams=peak_replicas * per_replica,
                shape=shape,
                phase_hours=float(rng.uniform(10, 20)),
                trough=float(rng.uniform(0.1, 0.3)),
                spec=spec,
            )
        )
    return pools


def demand_trace(pools: Sequence[PoolProfile], fleet: Fleet, seconds: int, rng: np.random.Generator) -> np.ndarray:
    """Arrivals per pool and second (Poisson draws of each pool's rate)."""
    t = np.arange(seconds)
    day = 86_400.0
    rates = np.zeros((len(pools), seconds))
    for row, pool in enumerate(pools):
        peak_rate = pool.peak_streams / fleet.mean_decode_seconds  # Little's law, without prefill
        daily = 0.5 - 0.5 * np.cos(2 * np.pi * (t / day - pool.phase_hours / 24 + 0.5))
        level = pool.trough + (1 - pool.trough) * daily
        if pool.shape == "bursty":
            # Half the diurnal volume, plus bursts (about 6 a day, 5-30 min, up to the peak).
            level = 0.5 * level
            for _ in range(rng.poisson(6 * seconds / day) or 1):
                start, length = int(rng.uniform(0, seconds)), int(rng.uniform(300, 1800))
                ramp = np.clip((t[start : start + length] - start) / 120.0, 0, 1)
                level[start : start + length] += float(rng.uniform(0.5, 1.0)) * ramp
        elif pool.shape == "batch":
            # Idle, with a few jobs a day (20-60 min each).
            level = np.zeros(seconds)
            for _ in range(rng.poisson(3 * seconds / day) or 1):
                start, length = int(rng.uniform(0, seconds)), int(rng.uniform(1200, 3600))
                level[start : start + length] = 1.0
        rates[row] = peak_rate * np.clip(level, 0, None)
    return rng.poisson(rates).astype(np.float64)


def static_replicas(arrivals: np.ndarray, fleet: Fleet) -> list[int]:
    """Replicas that carry each pool's busiest minute at the utilisation target (Little's law)."""
    minutes = arrivals[:, : arrivals.shape[1] // 60 * 60].reshape(arrivals.shape[0], -1, 60).mean(axis=2)
    peak_streams = minutes.max(axis=1) * fleet.mean_service_seconds
    return [max(1, math.ceil(streams / (fleet.concurrency * fleet.utilisation_target))) for streams in peak_streams]


# ---------------------------------------------------------------------------------------- the cluster


@dataclasses.dataclass(eq=False)
class Node:
    ready_at: int
    used: bool = False  # has run a worker (image pulled, compile cache warm)
    pod: Pod | None = None
    idle_since: int | None = None
    spare: bool = False  # holds a warm spare's placeholder pod (lowest priority)
    warm_at: int | None = None  # a placeholder pulled the worker image here by then


@dataclasses.dataclass(eq=False)
class Pod:
    name: str
    pool: int
    slot: int  # row of the pool's worker arrays
    created: int
    node: Node | None = None
    scheduled: bool = False  # on a node that is up (the Pod's spec.nodeName, phase Running)
    ready_at: int | None = None  # when its worker is ready (node + load)
    ready: bool = False
    draining: bool = False  # its worker takes no new tasks
    drain_requested_at: float | None = None  # the operator's mark (lowest deletion cost)
    terminating: bool = False


class Cluster:
    """Nodes, pods, and the ReplicaSet controller's part: create and delete pods to match replicas."""

    def __init__(self, fleet: Fleet, pools: int, slots: int) -> None:
        self.fleet = fleet
        self.nodes: list[Node] = []
        self.pods: list[list[Pod]] = [[] for _ in range(pools)]
        self.replicas = [0] * pools
        self.free_slots = [list(range(slots - 1, -1, -1)) for _ in range(pools)]
        self.pending: deque[Pod] = deque()
        self.events: list[tuple[int, int, str, object]] = []  # (time, seq, kind, object)
        self._seq = 0
        self.pod_starts = 0
        self.new_nodes = 0
        self.counter = 0
        # Insertion-ordered (a set would iterate in id() order: runs of one seed would differ).
        self.terminating: dict[Pod, None] = {}
        self.dirty = True  # which workers take tasks changed since the simulation last looked
        self.spares_wanted = [0] * pools  # placeholder replicas of each pool's spare Deployment
        self.spare_nodes: list[Node] = []
        self.spare_takes = 0  # workers placed on a spare's node

    def at(self, time: int, kind: str, subject: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time, self._seq, kind, subject))

    def alive(self, pool: int) -> list[Pod]:
        return [pod for pod in self.pods[pool] if not pod.terminating]

    def scale(self, pool: int, replicas: int, now: int, inflight: np.ndarray) -> None:
        self.replicas[pool] = replicas
        alive = self.alive(pool)
        for _ in range(replicas - len(alive)):
            self.counter += 1
            slot = self.free_slots[pool].pop()
            pod = Pod(name=f"p{pool:02d}-{self.counter}", pool=pool, slot=slot, created=now)
            self.pods[pool].append(pod)
            self._place(pod, now)
        if len(alive) > replicas:
            for pod in sorted(alive, key=_deletion_rank)[: len(alive) - replicas]:
                self._delete(pod, now, inflight)

    def set_spares(self, pool: int, count: int, now: int) -> None:
        """The operator scaled the pool's spare Deployment to `count` placeholder pods."""
        if self.spares_wanted[pool] != count:
            self.spares_wanted[pool] = count
            self._balance_spares(now)

    def _balance_spares(self, now: int) -> None:
        """Placeholders are one scheduling pool whatever Deployment they belong to: a worker of any
        pool preempts any of them. A placeholder without a node is Pending, and the cluster
        autoscaler adds a node for it (or it takes a node a worker left)."""
        wanted = sum(self.spares_wanted)
        while len(self.spare_nodes) > wanted:  # scaled down: the newest placeholder goes first
            node = self.spare_nodes.pop()
            node.spare = False
            if node.ready_at <= now:
                self._node_free(node, now)
        while len(self.spare_nodes) < wanted:
            free = [node for node in self.nodes if node.pod is None and not node.spare]
            if free:
                node = max(free, key=lambda node: (node.ready_at <= now, node.used))
                node.spare, node.idle_since = True, None
            elif len(self.nodes) < self.fleet.max_nodes:
                node = Node(ready_at=now + self.fleet.node_start_seconds, spare=True)
                self.nodes.append(node)
                self.new_nodes += 1
                self.at(node.ready_at, "node-ready", node)
            else:
                break
            if node.ready_at <= now and node.warm_at is None:
                node.warm_at = now + self.fleet.image_pull_seconds
            self.spare_nodes.append(node)

    def _place(self, pod: Pod, now: int) -> None:
        free = [node for node in self.nodes if node.pod is None and not node.spare]
        if free:  # an idle node, or one still starting whose pod was deleted meanwhile
            node = min(free, key=lambda node: node.ready_at)
            if node.ready_at <= now:
                self._bind(pod, node, now)
            else:
                node.pod, pod.node = pod, node
        elif self.spare_nodes:  # preempt a placeholder: a node that is up (or the soonest up)
            node = min(self.spare_nodes, key=lambda node: (node.ready_at > now, not _warm(node, now), node.ready_at))
            self.spare_nodes.remove(node)
            node.spare = False
            self.spare_takes += 1
            if node.ready_at <= now:
                self._bind(pod, node, now, delay=self.fleet.spare_eviction_seconds)
            else:
                node.pod, pod.node = pod, node
            self._balance_spares(now)
        elif len(self.nodes) < self.fleet.max_nodes:
            node = Node(ready_at=now + self.fleet.node_start_seconds, pod=pod)
            self.nodes.append(node)
            self.new_nodes += 1
            pod.node = node
            self.at(node.ready_at, "node-ready", node)
        else:
            self.pending.append(pod)

    def _bind(self, pod: Pod, node: Node, now: int, delay: int = 0) -> None:
        node.pod, node.idle_since, pod.node = pod, None, node
        self._load(pod, node, now, delay)

    def _load(self, pod: Pod, node: Node, now: int, delay: int = 0) -> None:
        fleet = self.fleet
        pod.scheduled = True
        if node.used or _warm(node, now):
            load = fleet.warm_load_seconds
        elif node.warm_at is not None:  # the placeholder is still pulling the image
            load = node.warm_at - now + fleet.warm_load_seconds
        else:
            load = fleet.image_pull_seconds + fleet.cold_load_seconds
        load += delay
        node.used = True
        pod.ready_at = now + load
        self.pod_starts += 1
        self.at(pod.ready_at, "pod-ready", pod)

    def _delete(self, pod: Pod, now: int, inflight: np.ndarray) -> None:
        pod.terminating, pod.draining = True, True  # preStop: the worker drains, then exits
        self.dirty = True
        if not pod.ready or inflight[pod.pool, pod.slot] <= 1e-9:
            self._gone(pod, now)
        else:
            self.terminating[pod] = None

    def _gone(self, pod: Pod, now: int) -> None:
        self.terminating.pop(pod, None)
        self.pods[pod.pool].remove(pod)
        self.free_slots[pod.pool].append(pod.slot)
        if pod in self.pending:
            self.pending.remove(pod)
        node, pod.node = pod.node, None
        if node is not None:
            node.pod = None
            if node.ready_at <= now:
                self._node_free(node, now)

    def _node_free(self, node: Node, now: int) -> None:
        if self.pending:
            self._bind(self.pending.popleft(), node, now)
        elif len(self.spare_nodes) < sum(self.spares_wanted):  # a Pending placeholder takes it
            node.spare, node.idle_since = True, None
            if node.warm_at is None:
                node.warm_at = now + self.fleet.image_pull_seconds
            self.spare_nodes.append(node)
        else:
            node.idle_since = now
            self.at(now + self.fleet.node_idle_removal_seconds, "node-idle", node)

    def advance(self, now: int, inflight: np.ndarray) -> None:
        """Process the events due now, and remove terminating workers whose streams ended."""
        while self.events and self.events[0][0] <= now:
            _, _, kind, subject = heapq.heappop(self.events)
            if kind == "node-ready":
                node = subject
                if node.pod is not None:
                    self._load(node.pod, node, now)
                elif node.spare:  # its placeholder starts: the image pull begins
                    node.warm_at = now + self.fleet.image_pull_seconds
                else:
                    self._node_free(node, now)
            elif kind == "pod-ready":
                pod = subject
                if pod.node is not None and pod.ready_at == now and not pod.terminating:
                    pod.ready = True
                    self.dirty = True
            elif kind == "node-idle":
                node = subject
                if (
                    node.pod is None
                    and not node.spare
                    and node in self.nodes
                    and node.idle_since is not None
                    and now - node.idle_since >= self.fleet.node_idle_removal_seconds
                ):
                    self.nodes.remove(node)
        for pod in [p for p in self.terminating if inflight[p.pool, p.slot] <= 1e-9]:
            self._gone(pod, now)


def _warm(node: Node, now: int) -> bool:
    """A worker placed here now needs only the warm load (see Fleet: the model cache assumption)."""
    return node.used or (node.warm_at is not None and node.warm_at <= now)


def _deletion_rank(pod: Pod) -> tuple:
    """The ReplicaSet controller's order (ActivePodsWithRanks): unscheduled (Pending) pods, then not
    ready ones, then the lowest pod-deletion-cost, then the newest."""
    cost = int(scaling.DELETION_COST_DRAINING) if pod.drain_requested_at is not None else 0
    return (pod.scheduled, pod.ready, cost, -pod.created)


# --------------------------------------------------------------------------------------- the policies


class OperatorPolicy:
    """scaling.plan() per pool, carried out as poolscaler.autoscale/_carry_out do. `tokens_target`
    replaces the interactive pools' targetTokensPerSecondPerReplica."""

    def __init__(self, pools: Sequence[PoolProfile], tokens_target: float | None = None) -> None:
        self.specs = [
            dataclasses.replace(pool.spec, target_tokens_per_second_per_replica=tokens_target)
            if tokens_target and pool.spec.target_tokens_per_second_per_replica
            else pool.spec
            for pool in pools
        ]
        self.target = tokens_target or VALUES_A10G_TOKENS_TARGET
        self.name = f"operator ({self.target:,.0f} tok/s)"
        self.states = [scaling.PoolState() for _ in pools]

    def initial(self, index: int) -> int:
        return scaling.replica_floor(self.specs[index])

    def tick(self, index: int, now: int, sim: Simulation) -> None:
        cluster, spec = sim.cluster, self.specs[index]
        demand = sim.demand(index, now)
        pods = [
            scaling.PodView(
                name=pod.name,
                ready=pod.ready,
                terminating=pod.terminating,
                drain_requested_at=pod.drain_requested_at,
                scheduled=pod.scheduled,
                phase="Running" if pod.scheduled else "Pending",
            )
            for pod in cluster.pods[index]
        ]
        decision = scaling.plan(
            spec=spec, demand=demand, current=cluster.replicas[index], pods=pods, state=self.states[index], now=now
        )
        by_name = {pod.name: pod for pod in cluster.pods[index]}
        cluster.dirty = True
        for name in decision.cancel_drain:
            if (pod := by_name.get(name)) is not None and not pod.terminating:
                pod.draining, pod.drain_requested_at = False, None
        if decision.replicas is not None and decision.replicas != cluster.replicas[index]:
            cluster.scale(index, decision.replicas, now, sim.inflight)
        for name in decision.start_drain:
            if (pod := by_name.get(name)) is not None:
                pod.draining, pod.drain_requested_at = True, float(now)
        cluster.set_spares(index, decision.spares, now)
        self.states[index] = decision.state

    def initial_spares(self, index: int) -> int:
        return scaling.spare_replicas(self.specs[index], self.initial(index))


class StaticPolicy:
    name = "static"

    def __init__(self, replicas: Sequence[int]) -> None:
        self.replicas = list(replicas)

    def initial(self, index: int) -> int:
        return self.replicas[index]

    def initial_spares(self, index: int) -> int:
        return 0

    def tick(self, index: int, now: int, sim: Simulation) -> None:
        pass


class QueueLengthPolicy:
    """KEDA's Redis list scaler feeding an HPA: desired = ceil(queue length / listLength), at most
    max(2x, +4) per step up, the highest desire of the last 300 s down (HPA's default behaviour),
    activation from zero on any queued request."""

    name = "queue"

    def __init__(self, pools: Sequence[PoolProfile], list_length: int = 5, stabilisation_seconds: int = 300) -> None:
        self.specs = [pool.spec for pool in pools]
        self.list_length = list_length
        self.window = stabilisation_seconds
        self.history: list[deque[tuple[int, int]]] = [deque() for _ in pools]

    def initial(self, index: int) -> int:
        return self.specs[index].min_replicas

    def initial_spares(self, index: int) -> int:
        return 0

    def tick(self, index: int, now: int, sim: Simulation) -> None:
        spec, current = self.specs[index], sim.cluster.replicas[index]
        backlog = sim.backlog(index)
        raw = math.ceil(backlog / self.list_length - 1e-9) if backlog >= 1 else 0
        raw = min(raw, max(2 * current, current + 4))
        history = self.history[index]
        history.append((now, raw))
        while history and history[0][0] < now - self.window:
            history.popleft()
        desired = raw if raw > current else max(value for _, value in history)
        desired = max(spec.min_replicas, min(spec.max_replicas, desired))
        if desired != current:
            sim.cluster.scale(index, desired, now, sim.inflight)


# ----------------------------------------------------------------------------------------- simulation


class Simulation:
    """One policy on the trace. Every policy starts from the same warm fleet (`initial` replicas per
    pool, all ready) and runs `warmup` seconds unmeasured, so what is measured is its steady
    behaviour, not the start."""

    def __init__(
        self,
        pools: Sequence[PoolProfile],
        arrivals: np.ndarray,
        fleet: Fleet,
        policy,
        *,
        initial: Sequence[int],
        warmup: int,
    ) -> None:
        self.pools, self.arrivals, self.fleet, self.policy = pools, arrivals, fleet, policy
        self.initial, self.warmup = list(initial), warmup
        count = len(pools)
        # Worker rows per pool: replicas plus the workers still finishing their streams after a
        # scale-down.
        self.slots = 2 * max(max(pool.spec.max_replicas for pool in pools), max_static(policy)) + 8
        self.cluster = Cluster(fleet, count, self.slots)
        self.queue_len = fleet.queue_timeout_seconds + 1
        self.queue = np.zeros((count, self.queue_len))  # fluid FIFO: requests by arrival second
        self.inflight = np.zeros((count, self.slots))
        self.horizon = int(fleet.service_steps.max()) + 1
        self.service_classes = list(zip(fleet.service_steps.tolist(), fleet.service_shares.tolist(), strict=True))
        self.completions = np.zeros((count, self.slots, self.horizon))
        self.wait_histogram = np.zeros((count, self.queue_len))
        self.dropped = np.zeros(count)
        self.tokens_per_second = np.zeros(count)
        self.node_seconds = 0
        self.spare_node_seconds = 0  # nodes held by warm spares' placeholders (in node_seconds too)
        self.timeline: list[tuple[int, int, float]] = []  # (time, nodes, streams in flight)

    # the control plane's demand document
    def backlog(self, index: int) -> float:
        return float(self.queue[index].sum())

    def demand(self, index: int, now: int) -> scaling.Demand:
        row = self.queue[index]
        queued = int(round(row.sum()))
        ready = [pod for pod in self.cluster.pods[index] if pod.ready]
        oldest = 0.0
        if queued:
            order = np.arange(now + 1, now + 1 + self.queue_len) % self.queue_len  # oldest first
            nonzero = np.nonzero(row[order] > 1e-6)[0]
            if nonzero.size:
                oldest = float(self.queue_len - 1 - nonzero[0])
        workers = tuple(
            scaling.Worker(
                name=f"worker@{pod.name}",
                pod=pod.name,
                in_flight=math.ceil(self.inflight[index, pod.slot] - 1e-6),
                state="draining" if pod.draining else ("ready" if pod.ready else "starting"),
            )
            for pod in self.cluster.pods[index]
            if pod.scheduled
        )
        held = not any(not pod.draining for pod in ready)  # no worker to take them: held at the gateway
        return scaling.Demand(
            queue_depth=0 if held else queued,
            waiting=queued if held else 0,
            in_flight=sum(worker.in_flight for worker in workers),
            tokens_per_second=float(self.tokens_per_second[index]),
            oldest_queued_wait_seconds=oldest,
            workers=workers,
        )

    def run(self) -> dict:
        count, seconds, interval = len(self.pools), self.arrivals.shape[1], self.fleet.operator_interval_seconds
        self._start_warm()
        ticks = [(index * 7) % interval for index in range(count)]  # the pools' timers are not in step
        accepting = np.zeros((count, self.slots), dtype=bool)
        for now in range(seconds):
            cluster = self.cluster
            if now == self.warmup:  # measure from here
                self.wait_histogram[:] = 0
                self.dropped[:] = 0
                cluster.pod_starts = cluster.new_nodes = cluster.spare_takes = 0
            cluster.advance(now, self.inflight)
            for index in range(count):
                if now % interval == ticks[index]:
                    self.policy.tick(index, now, self)
            if cluster.dirty:
                accepting[:] = False
                for pod in (pod for pods in cluster.pods for pod in pods if pod.ready and not pod.draining):
                    accepting[pod.pool, pod.slot] = True
                cluster.dirty = False
            streams = self._step(now, accepting)
            if now >= self.warmup:
                self.node_seconds += len(cluster.nodes)
                self.spare_node_seconds += len(cluster.spare_nodes)
                if now % 60 == 0:
                    self.timeline.append((now, len(cluster.nodes), float(streams.sum())))
        return self.summary()

    def _start_warm(self) -> None:
        """The initial replicas, up and ready (a fleet that has been running)."""
        for index in range(len(self.pools)):
            self.cluster.scale(index, max(self.initial[index], self.policy.initial(index)), 0, self.inflight)
        for pod in (pod for pods in self.cluster.pods for pod in pods):
            pod.node.ready_at, pod.node.used, pod.ready, pod.ready_at, pod.scheduled = 0, True, True, 0, True
        for index in range(len(self.pools)):
            self.cluster.set_spares(index, self.policy.initial_spares(index), 0)
        for node in self.cluster.spare_nodes:
            node.ready_at, node.warm_at = 0, 0
        self.cluster.events.clear()
        self.cluster.new_nodes = 0

    def _step(self, now: int, accepting: np.ndarray) -> np.ndarray:
        """One second of every pool: drop what waited too long, enqueue arrivals, end streams, start
        queued requests FIFO on the accepting workers (spread by free slots). Returns streams per pool."""
        fleet = self.fleet
        column = now % self.queue_len
        self.dropped += self.queue[:, column]  # waited the whole timeout
        self.queue[:, column] = self.arrivals[:, now]
        done_column = now % self.horizon
        self.inflight -= self.completions[:, :, done_column]
        np.maximum(self.inflight, 0, out=self.inflight)
        self.completions[:, :, done_column] = 0
        free = np.maximum(np.where(accepting, fleet.concurrency - self.inflight, 0.0), 0)
        total_free = free.sum(axis=1)
        start = np.minimum(total_free, self.queue.sum(axis=1))
        if start.any():
            order = np.arange(now + 1, now + 1 + self.queue_len) % self.queue_len  # oldest first
            aged = self.queue[:, order]
            before = np.cumsum(aged, axis=1) - aged
            taken = np.clip(start[:, None] - before, 0, aged)
            self.queue[:, order] = aged - taken
            self.wait_histogram += taken[:, ::-1]  # column = wait in seconds
            share = np.divide(free, total_free[:, None], out=np.zeros_like(free), where=total_free[:, None] > 0)
            started = share * start[:, None]
            self.inflight += started
            for steps, share_k in self.service_classes:
                self.completions[:, :, (now + steps) % self.horizon] += started * share_k
        streams = self.inflight.sum(axis=1)
        rate = fleet.stream_tokens_per_second * fleet.output_share  # output tokens/s of a stream
        self.tokens_per_second += (streams * rate - self.tokens_per_second) / 30.0
        return streams

    def summary(self) -> dict:
        interactive = np.array([pool.shape != "batch" for pool in self.pools])
        served = self.wait_histogram.sum()
        return {
            "policy": self.policy.name,
            "gpu_hours": round(self.node_seconds / 3600, 1),
            "p50_wait_s": _percentile(self.wait_histogram.sum(axis=0), 0.50),
            "p99_wait_s": _percentile(self.wait_histogram.sum(axis=0), 0.99),
            "p99_wait_interactive_s": _percentile(self.wait_histogram[interactive].sum(axis=0), 0.99),
            "p99_wait_batch_s": _percentile(self.wait_histogram[~interactive].sum(axis=0), 0.99)
            if (~interactive).any()
            else None,
            "requests": int(round(self.arrivals[:, self.warmup :].sum())),
            "served": int(round(served)),
            "dropped": int(round(self.dropped.sum())),
            "pod_starts": self.cluster.pod_starts,
            "spare_gpu_hours": round(self.spare_node_seconds / 3600, 1),
            "workers_on_spares": self.cluster.spare_takes,
            "new_nodes": self.cluster.new_nodes,
            "peak_nodes": max(nodes for _, nodes, _ in self.timeline),
        }


def max_static(policy) -> int:
    return max(policy.replicas) if isinstance(policy, StaticPolicy) else 0


def _percentile(histogram: np.ndarray, q: float) -> float | None:
    total = histogram.sum()
    if total <= 0:
        return None
    index = int(np.searchsorted(np.cumsum(histogram), q * total - 1e-9))
    return float(index)


# --------------------------------------------------------------------------------------------- report


def simulate(
    *, pools: int = 20, hours: float = 24.0, seed: int = 1, fleet: Fleet | None = None, warmup_hours: float = 1.0,
    tokens_targets: Sequence[float] = (),
) -> dict:  # fmt: skip
    """Every policy on one trace; ``tokens_targets``: more operator rows, each with another
    targetTokensPerSecondPerReplica for the interactive pools."""
    fleet = fleet or Fleet()
    rng = np.random.default_rng(seed)
    profiles = default_pools(pools, fleet, rng)
    warmup = int(warmup_hours * 3600)
    arrivals = demand_trace(profiles, fleet, warmup + int(hours * 3600), rng)
    static = static_replicas(arrivals, fleet)
    if sum(static) > fleet.max_nodes:
        raise SystemExit(f"the static fleet needs {sum(static)} nodes, more than --max-nodes {fleet.max_nodes}")
    results, timelines = [], {}
    # The chart's target, and 70% of this fleet's plateau where that differs (a prompt mix or a
    # cache share other than the one the chart's figure comes from).
    derived = round(fleet.replica_tokens_per_second * fleet.utilisation_target)
    operators = [OperatorPolicy(profiles)]
    for target in (derived, *tokens_targets):
        if round(target) not in {round(VALUES_A10G_TOKENS_TARGET), *(round(o.target) for o in operators)}:
            operators.append(OperatorPolicy(profiles, tokens_target=target))
    policies = (StaticPolicy(static), *operators, QueueLengthPolicy(profiles))
    for policy in policies:
        sim = Simulation(profiles, arrivals, fleet, policy, initial=static, warmup=warmup)
        results.append(sim.run())
        timelines[policy.name] = sim.timeline
    base = results[0]
    for result in results:
        result["gpu_hours_vs_static"] = round(result["gpu_hours"] / base["gpu_hours"], 3)
    goal = {result["policy"]: _goal(result, base) for result in results if result["policy"].startswith("operator")}
    return {
        "pools": pools,
        "hours": hours,
        "seed": seed,
        "warmup_seconds": warmup,
        "static_replicas": static,
        "fleet": dataclasses.asdict(fleet),
        "results": results,
        "goal": goal,
        "timelines": timelines,
    }


def _goal(result: dict, static: dict) -> dict:
    """The target: p99 wait within 10% of static's at <= 60% of its GPU-hours. Waits are whole
    seconds, so against a static p99 under one second "within 10%" means under one second too."""
    if static["p99_wait_s"] < 1:
        p99_ok = result["p99_wait_s"] < 1
    else:
        p99_ok = result["p99_wait_s"] <= static["p99_wait_s"] * 1.1
    return {"p99_within_10pct": p99_ok, "gpu_hours_at_most_60pct": result["gpu_hours_vs_static"] <= 0.6}


def table(report: dict) -> str:
    lines = [
        "| policy | GPU-hours | vs static | p50 wait | p99 wait | p99 interactive | p99 batch | dropped "
        "| pod starts | new nodes | peak nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['policy']} | {r['gpu_hours']:,} | {r['gpu_hours_vs_static']:.2f} | {_s(r['p50_wait_s'])} | "
            f"{_s(r['p99_wait_s'])} | {_s(r['p99_wait_interactive_s'])} | {_s(r['p99_wait_batch_s'])} | "
            f"{r['dropped']:,} | {r['pod_starts']:,} | {r['new_nodes']:,} | {r['peak_nodes']} |"
        )
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else ("< 1 s" if value < 1 else f"{value:.0f} s")


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (nodes_axis, load_axis) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, timeline in report["timelines"].items():
        hours = [(t - report["warmup_seconds"]) / 3600 for t, _, _ in timeline]
        nodes_axis.plot(hours, [n for _, n, _ in timeline], label=name)
    static = report["timelines"]["static"]
    load_axis.plot(
        [(t - report["warmup_seconds"]) / 3600 for t, _, _ in static], [s for _, _, s in static], color="gray"
    )
    nodes_axis.set_ylabel("A10G nodes")
    nodes_axis.legend()
    load_axis.set_ylabel("streams in flight (static)")
    load_axis.set_xlabel("hour")
    figure.suptitle(f"{report['pools']} pools, {report['hours']:g} h, seed {report['seed']}")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=20)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-nodes", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="mean prompt tokens per request (0: no prefill)")
    parser.add_argument("--cached-share", type=float, default=0.0,
                        help="share of prompt tokens served from the prefix cache (cache-aware dispatch)")  # fmt: skip
    parser.add_argument("--prefill-rate", type=float, default=Fleet.prefill_tokens_per_second,
                        help="a replica's prefill tokens/s")  # fmt: skip
    parser.add_argument("--tokens-target", type=float, action="append", default=[],
                        help="also run the operator at this targetTokensPerSecondPerReplica (repeatable)")  # fmt: skip
    parser.add_argument("--plot", type=Path, help="write a PNG of nodes over time (needs matplotlib)")
    parser.add_argument("--json", type=Path, help="write the results (without timelines) as JSON")
    args = parser.parse_args(argv)
    if not 0.0 <= args.cached_share <= 1.0:
        parser.error("--cached-share must be within 0..1")
    fleet = Fleet(max_nodes=args.max_nodes, prompt_tokens=args.prompt_tokens, cached_prompt_share=args.cached_share,
                  prefill_tokens_per_second=args.prefill_rate)  # fmt: skip
    targets = args.tokens_target
    report = simulate(pools=args.pools, hours=args.hours, seed=args.seed, fleet=fleet, tokens_targets=targets)
    print(f"a replica's plateau: {fleet.replica_tokens_per_second:,.0f} output tok/s (prefill "
          f"{fleet.prefill_seconds:.2f} s per stream); the chart ships {VALUES_A10G_TOKENS_TARGET:,.0f}")  # fmt: skip
    print(table(report))
    print(f"static replicas per pool: {report['static_replicas']} (sum {sum(report['static_replicas'])})")
    spares = {r["policy"]: r["spare_gpu_hours"] for r in report["results"] if r["spare_gpu_hours"]}
    print(f"of which warm spare nodes (GPU-hours): {json.dumps(spares)}")
    print(f"goal (operator vs static): {json.dumps(report['goal'])}")
    if args.plot and plot(report, args.plot):
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in report.items() if k != "timelines"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

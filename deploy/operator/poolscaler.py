"""Pool scaler: a kopf operator that sizes each ModelPool's GPU worker Deployment from demand.

Run it with `kopf run --standalone --all-namespaces deploy/operator/poolscaler.py` (kopf puts
this folder on sys.path, which is how `scaling` is found). docs/operator.md describes the
ModelPool resource, the demand contract with the control plane and the drain protocol.

Environment (read and validated by `configure()` at start; the interval when kopf loads this file):
    CONTROL_PLANE_URL                    base URL of the control plane, e.g. http://gemma-web:8000
    OPERATOR_TOKEN / OPERATOR_TOKEN_FILE bearer token for the control plane's operator endpoints
    POOLSCALER_INTERVAL_SECONDS          reconcile period per ModelPool (default 15)
    POOLSCALER_DEMAND_TIMEOUT_SECONDS    timeout of one control-plane call (default 3)
    POOLSCALER_RETRY_SECONDS             retry delay while the control plane is unreachable (default: interval)
    POOLSCALER_STALE_DRAIN_GRACE_SECONDS how long after drainTimeoutSeconds a drained pod that is still
                                         there gets its drain cancelled (default 60)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import kopf
import kubernetes.client
import kubernetes.config
import scaling
from kubernetes.client.exceptions import ApiException

GROUP = "hosting.gemma.dev"
VERSION = "v1alpha1"
PLURAL = "modelpools"

# Kubernetes API calls run in threads (the official client is synchronous); bound each one.
KUBE_TIMEOUT_SECONDS = 10


class ConfigError(ValueError):
    """A setting in the environment is missing or invalid."""


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {raw!r}")
    return value


# The timer's period is fixed when kopf registers the handler, i.e. when this file is loaded.
INTERVAL_SECONDS = _seconds(os.environ, "POOLSCALER_INTERVAL_SECONDS", 15.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    control_plane_url: str
    token: str
    demand_timeout_seconds: float
    retry_seconds: float
    stale_drain_grace_seconds: float

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Config:
        url = environ.get("CONTROL_PLANE_URL", "").strip().rstrip("/")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"CONTROL_PLANE_URL must be an http(s) URL, got {url!r}")
        return cls(
            control_plane_url=url,
            token=_token(environ),
            demand_timeout_seconds=_seconds(environ, "POOLSCALER_DEMAND_TIMEOUT_SECONDS", 3.0),
            retry_seconds=_seconds(environ, "POOLSCALER_RETRY_SECONDS", INTERVAL_SECONDS),
            stale_drain_grace_seconds=_seconds(environ, "POOLSCALER_STALE_DRAIN_GRACE_SECONDS", 60.0),
        )


def _token(environ: Mapping[str, str]) -> str:
    path = environ.get("OPERATOR_TOKEN_FILE", "").strip()
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"OPERATOR_TOKEN_FILE {path!r} cannot be read: {exc}") from exc
    else:
        token = environ.get("OPERATOR_TOKEN", "").strip()
    if not token:
        raise ConfigError("OPERATOR_TOKEN (or OPERATOR_TOKEN_FILE) must hold the control plane's operator token")
    return token


# ----------------------------------------------------------------------------------- control plane


class ControlPlaneError(Exception):
    """The control plane could not be reached or refused the request."""


class ControlPlane:
    """The control plane's operator endpoints: pool demand and worker drain."""

    def __init__(self, *, base_url: str, token: str, timeout_seconds: float) -> None:
        self._base_url = base_url
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def demand(self, pool: str) -> scaling.Demand:
        payload = await self._call("GET", f"/api/v1/pools/{_quote(pool)}/demand", ok={200})
        try:
            return scaling.Demand.from_json(payload)
        except scaling.DemandFormatError as exc:
            raise ControlPlaneError(str(exc)) from exc

    async def drain(self, pool: str, pod: str) -> None:
        # 404: the control plane knows no worker in that pod (not registered yet, or gone), so
        # nothing can be in flight on it; the pod is still marked for removal.
        await self._call("POST", f"/api/v1/pools/{_quote(pool)}/workers/{_quote(pod)}/drain", ok={200, 202, 404})

    async def cancel_drain(self, pool: str, pod: str) -> None:
        await self._call("DELETE", f"/api/v1/pools/{_quote(pool)}/workers/{_quote(pod)}/drain", ok={200, 202, 204, 404})

    async def _call(self, method: str, path: str, *, ok: set[int]) -> Any:
        url = self._base_url + path
        try:
            async with aiohttp.ClientSession(timeout=self._timeout, headers=self._headers) as session:
                async with session.request(method, url) as response:
                    if response.status not in ok:
                        detail = _error_detail(await response.text())
                        raise ControlPlaneError(f"{method} {url}: HTTP {response.status} {detail}".rstrip())
                    if method != "GET":
                        return None
                    return await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise ControlPlaneError(f"{method} {url}: {exc!r}") from exc


def _error_detail(body: str) -> str:
    """The message of an OpenAI-style error body (what the control plane sends), else its start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.strip()[:200]


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


# ------------------------------------------------------------------------------------------ cluster


class DeploymentNotFoundError(Exception):
    pass


class Cluster:
    """The few Kubernetes calls the scaler makes, on the official (synchronous) client."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)

    async def deployment(self, namespace: str, name: str) -> tuple[int, str]:
        """The Deployment's replicas and its pod label selector."""
        try:
            deployment = await asyncio.to_thread(
                self._apps.read_namespaced_deployment, name, namespace, _request_timeout=KUBE_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                raise DeploymentNotFoundError(f"Deployment {namespace}/{name} not found") from exc
            raise
        replicas = deployment.spec.replicas
        return (1 if replicas is None else replicas), label_selector(deployment.spec.selector)

    async def pods(self, namespace: str, selector: str) -> list[scaling.PodView]:
        listing = await asyncio.to_thread(
            self._core.list_namespaced_pod, namespace, label_selector=selector, _request_timeout=KUBE_TIMEOUT_SECONDS
        )
        return [pod_view(pod) for pod in listing.items]

    async def scale(self, namespace: str, name: str, replicas: int) -> None:
        await asyncio.to_thread(
            self._apps.patch_namespaced_deployment_scale,
            name,
            namespace,
            {"spec": {"replicas": replicas}},
            _request_timeout=KUBE_TIMEOUT_SECONDS,
        )

    async def mark_draining(self, namespace: str, pod: str, now: float) -> None:
        annotations = {
            scaling.DELETION_COST_ANNOTATION: scaling.DELETION_COST_DRAINING,
            scaling.DRAIN_MARK_ANNOTATION: scaling.format_time(now),
        }
        await self._annotate(namespace, pod, annotations)

    async def unmark_draining(self, namespace: str, pod: str) -> None:
        annotations = {scaling.DELETION_COST_ANNOTATION: None, scaling.DRAIN_MARK_ANNOTATION: None}
        try:
            await self._annotate(namespace, pod, annotations)
        except ApiException as exc:
            if exc.status != 404:  # the pod is gone: nothing left to unmark
                raise

    async def _annotate(self, namespace: str, pod: str, annotations: dict[str, str | None]) -> None:
        await asyncio.to_thread(
            self._core.patch_namespaced_pod,
            pod,
            namespace,
            {"metadata": {"annotations": annotations}},
            _request_timeout=KUBE_TIMEOUT_SECONDS,
        )


def label_selector(selector: kubernetes.client.V1LabelSelector | None) -> str:
    """A Deployment's structured selector as the string form the list call takes."""
    if selector is None:
        return ""
    parts = [f"{key}={value}" for key, value in sorted((selector.match_labels or {}).items())]
    for expression in selector.match_expressions or ():
        values = ",".join(expression.values or ())
        parts.append(
            {
                "In": f"{expression.key} in ({values})",
                "NotIn": f"{expression.key} notin ({values})",
                "Exists": expression.key,
                "DoesNotExist": f"!{expression.key}",
            }[expression.operator]
        )
    return ",".join(parts)


def pod_view(pod: kubernetes.client.V1Pod) -> scaling.PodView:
    conditions = (pod.status.conditions if pod.status else None) or ()
    phase = pod.status.phase if pod.status else None
    annotations = pod.metadata.annotations or {}
    return scaling.PodView(
        name=pod.metadata.name,
        ready=any(condition.type == "Ready" and condition.status == "True" for condition in conditions),
        # Finished pods are not counted by the ReplicaSet either.
        terminating=pod.metadata.deletion_timestamp is not None or phase in ("Succeeded", "Failed"),
        drain_requested_at=scaling.parse_time(annotations.get(scaling.DRAIN_MARK_ANNOTATION)),
        scheduled=bool(pod.spec and pod.spec.node_name),
        phase=phase or "Pending",
    )


def kube_api_client() -> kubernetes.client.ApiClient:
    """In-cluster service account credentials, or the kubeconfig ($KUBECONFIG) outside a cluster."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        # Read $KUBECONFIG now: the client's own default is frozen when `kubernetes` is imported.
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
        )
    return kubernetes.client.ApiClient(configuration)


# ------------------------------------------------------------------------------------------- handlers


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    try:
        config = Config.from_env(os.environ)
        api_client = kube_api_client()
    except (ConfigError, kubernetes.config.ConfigException) as exc:
        raise kopf.PermanentError(f"pool scaler configuration: {exc}") from exc
    # Two scalers acting on one pool would fight over drains: run one replica (the chart does),
    # without kopf's peering resources.
    settings.peering.standalone = True
    # On shutdown, let a reconcile in progress finish (and record its drain state in the status)
    # rather than abandoning it half-way.
    settings.background.instant_exit_timeout = 10.0
    memo.control_plane = ControlPlane(
        base_url=config.control_plane_url, token=config.token, timeout_seconds=config.demand_timeout_seconds
    )
    memo.cluster = Cluster(api_client)
    memo.config = config
    logger.info(f"pool scaler: every {INTERVAL_SECONDS:g}s, demand from {config.control_plane_url}")


@kopf.timer(GROUP, VERSION, PLURAL, id="autoscale", interval=INTERVAL_SECONDS)
async def autoscale(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    namespace: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """One reconcile of a ModelPool: read demand, decide (scaling.plan), act, record in status.

    Every scaling action is also posted as a Kubernetes Event on the ModelPool (see `announce`).
    """
    now = time.time()
    conditions = list(status.get("conditions") or [])
    try:
        pool = scaling.PoolSpec.from_spec(spec)
    except scaling.InvalidSpecError as exc:
        patch.status["conditions"] = set_condition(conditions, "Ready", False, "InvalidSpec", str(exc), now)
        raise kopf.PermanentError(f"invalid ModelPool spec: {exc}") from exc

    try:
        demand = await memo.control_plane.demand(pool.pool)
    except ControlPlaneError as exc:
        # Without a demand reading nothing changes: no scale, no drain started or ended.
        message = f"demand unavailable: {exc}"
        patch.status["conditions"] = set_condition(conditions, "Ready", False, "ControlPlaneUnavailable", message, now)
        raise kopf.TemporaryError(message, delay=memo.config.retry_seconds) from exc

    try:
        current, selector = await memo.cluster.deployment(namespace, pool.worker_deployment)
        pods = await memo.cluster.pods(namespace, selector)
    except (DeploymentNotFoundError, ApiException) as exc:
        reason = "DeploymentNotFound" if isinstance(exc, DeploymentNotFoundError) else "KubernetesError"
        patch.status["conditions"] = set_condition(conditions, "Ready", False, reason, str(exc), now)
        raise kopf.TemporaryError(str(exc), delay=memo.config.retry_seconds) from exc

    decision = scaling.plan(
        spec=pool,
        demand=demand,
        current=current,
        pods=pods,
        state=scaling.PoolState.from_status(status),
        now=now,
        stale_drain_grace_seconds=memo.config.stale_drain_grace_seconds,
    )
    try:
        state, replicas = await _carry_out(decision, pool, namespace, current, now, memo, logger, body)
    except ApiException as exc:
        # The scale patch failed: keep the previous state (a finished drain stays recorded), retry.
        message = f"scaling {pool.worker_deployment} to {decision.replicas}: {exc.status} {exc.reason}"
        announce(body, "ScaleFailed", message, warning=True)
        patch.status["conditions"] = set_condition(conditions, "Ready", False, "ScaleFailed", message, now)
        raise kopf.TemporaryError(message, delay=memo.config.retry_seconds) from exc

    spares = await _keep_spares(decision, pool, namespace, memo, logger, body)
    conditions = set_condition(conditions, "Ready", True, "Reconciled", decision.reason, now)
    conditions = set_condition(
        conditions,
        "Draining",
        bool(state.draining),
        "Draining" if state.draining else "Idle",
        decision.reason if state.draining else "no drain in progress",
        now,
    )
    patch.status.update(
        {
            "observedGeneration": meta.get("generation"),
            "replicas": replicas,
            "desiredReplicas": decision.desired,
            "spareReplicas": spares,
            "lastDemand": demand.summary(now),
            **state.to_status(),
            "conditions": conditions,
        }
    )


async def _keep_spares(
    decision: scaling.Plan, pool: scaling.PoolSpec, namespace: str, memo: kopf.Memo, logger: Any, body: kopf.Body
) -> int | None:
    """Scale the pool's placeholder Deployment to the plan's spares; return its replicas (None
    when the pool has none or it cannot be read). A failure here is a warning, not a failed
    reconcile: the workers were already scaled, and the next reconcile tries again."""
    if not pool.spare_deployment:
        return None
    cluster: Cluster = memo.cluster
    try:
        current, _ = await cluster.deployment(namespace, pool.spare_deployment)
        if current != decision.spares:
            await cluster.scale(namespace, pool.spare_deployment, decision.spares)
            message = f"{pool.spare_deployment}: warm spare nodes {current} -> {decision.spares}"
            logger.info(message)
            announce(body, "SparesScaled", message)
        return decision.spares
    except (DeploymentNotFoundError, ApiException) as exc:
        message = f"cannot scale the spare Deployment {pool.spare_deployment} (retried later): {exc}"
        logger.warning(message)
        announce(body, "SparesFailed", message, warning=True)
        return None


async def _carry_out(
    decision: scaling.Plan,
    pool: scaling.PoolSpec,
    namespace: str,
    current: int,
    now: float,
    memo: kopf.Memo,
    logger: Any,
    body: kopf.Body,
) -> tuple[scaling.PoolState, int]:
    """Apply a plan; return the state to record and the Deployment's replicas afterwards.

    Drain calls that fail are logged and retried by later reconciles; a failed scale patch
    raises ApiException.
    """
    control_plane: ControlPlane = memo.control_plane
    cluster: Cluster = memo.cluster
    for pod in decision.cancel_drain:
        try:
            # Drain first cancelled, then unmarked: the mark stays as the record until both are done.
            await control_plane.cancel_drain(pool.pool, pod)
            await cluster.unmark_draining(namespace, pod)
            logger.info(f"cancelled the drain of {pod}")
            announce(body, "DrainCancelled", f"cancelled the drain of {pod} ({decision.reason})")
        except (ControlPlaneError, ApiException) as exc:
            logger.warning(f"could not cancel the drain of {pod} (retried later): {exc}")

    state = decision.state
    replicas = current
    if decision.replicas is not None and decision.replicas != current:
        await cluster.scale(namespace, pool.worker_deployment, decision.replicas)  # ApiException: see caller
        replicas = decision.replicas
        logger.info(f"{pool.worker_deployment}: {decision.reason}")
        reason = "ScaledUp" if decision.replicas > current else "ScaledDown"
        announce(body, reason, f"{pool.worker_deployment}: {decision.reason}")

    if decision.start_drain:
        drained = await _start_drains(decision.start_drain, pool, namespace, now, control_plane, cluster, logger)
        state = dataclasses.replace(
            state, draining=drained, drain_started_time=state.drain_started_time if drained else None
        )
        if drained:
            message = f"{pool.worker_deployment}: draining {', '.join(drained)} ({decision.reason})"
            logger.info(message)
            announce(body, "DrainStarted", message)
    return state, replicas


async def _start_drains(
    pods: Sequence[str],
    pool: scaling.PoolSpec,
    namespace: str,
    now: float,
    control_plane: ControlPlane,
    cluster: Cluster,
    logger: Any,
) -> tuple[str, ...]:
    """Mark, then drain, each pod; stop at the first failure and return those fully started.

    The mark comes first so that a drain the control plane accepted is always recorded on the
    pod, even if this process dies right after (the stale-drain cleanup then finds it). A
    partial drain is a smaller scale-down step: the replicas drop by the pods drained.
    """
    drained: list[str] = []
    for pod in pods:
        try:
            await cluster.mark_draining(namespace, pod, now)
        except ApiException as exc:
            logger.warning(f"could not mark {pod} for draining; the scale-down waits: {exc}")
            break
        try:
            await control_plane.drain(pool.pool, pod)
        except ControlPlaneError as exc:
            logger.warning(f"could not drain {pod}; the scale-down waits: {exc}")
            # A marked pod that is not drained would be the ReplicaSet's first pick: unmark it.
            # Should that fail too, the next scale-down clears the mark first (scaling.plan).
            with contextlib.suppress(ApiException):
                await cluster.unmark_draining(namespace, pod)
            break
        drained.append(pod)
    return tuple(drained)


def announce(body: kopf.Body, reason: str, message: str, *, warning: bool = False) -> None:
    """Post a core/v1 Event about a scaling action on the ModelPool (`kubectl describe modelpool`).

    kopf posts the log lines of ordinary handlers as Events, but not those of timers (their logger
    is local, so a periodic handler does not flood the API), hence this explicit call. Posting is
    queued and done in the background by kopf; a failed post is logged, never raised here.
    """
    (kopf.warn if warning else kopf.info)(body, reason=reason, message=message[:1024])


def set_condition(
    conditions: Sequence[Mapping[str, Any]], kind: str, ok: bool, reason: str, message: str, now: float
) -> list[dict[str, Any]]:
    """Conditions with `kind` set; lastTransitionTime moves only when the status flips."""
    status = "True" if ok else "False"
    previous = next((condition for condition in conditions if condition.get("type") == kind), None)
    changed = previous is None or previous.get("status") != status
    updated = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": scaling.format_time(now) if changed else previous.get("lastTransitionTime"),
    }
    return [dict(condition) for condition in conditions if condition.get("type") != kind] + [updated]

"""Health, readiness, Prometheus metrics and the operator's pool endpoints."""

import datetime as dt
import hmac

from django.conf import settings
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.utils import timezone

from billing.selectors import CACHE_GROUPS, cache_hit_rates
from catalog.models import ServedModel
from config.bearer import bearer_token
from gateway.errors import NotFound, OpenAIError, PermissionDenied, Unauthorized, error_response
from gateway.pools import pool_demand, pool_drain, pool_workers
from gateway.views import openai_endpoint


def healthz(http_request):
    return JsonResponse({"status": "ok"})


def readyz(http_request):
    """200 once a ready worker engine serves every enabled model, else 503 naming what is missing.

    A model allowed to scale to zero (cold_start_wait_seconds > 0) counts as ready without workers:
    its requests wait for one, so an idle pool must not take the web servers out of service."""
    models = list(
        ServedModel.objects.filter(is_enabled=True).values_list("model_id", "pool", "cold_start_wait_seconds")
    )
    not_ready = []
    for model_id, pool, cold_start_wait in models:
        if not cold_start_wait and not any(w.state == "ready" for w in pool_workers(pool)):
            not_ready.append(model_id)
    status = 200 if models and not not_ready else 503
    return JsonResponse(
        {"ready": status == 200, "models": [m[0] for m in models], "not_ready": not_ready}, status=status
    )


def _require_token(http_request, expected: str, what: str) -> None:
    if not expected:
        raise PermissionDenied(f"{what} is disabled: set its token in the server's configuration.")
    token = bearer_token(http_request) or ""
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise Unauthorized(f"A valid bearer token is required for {what}.", code="invalid_token")


def _known_pool(pool: str) -> None:
    if not ServedModel.objects.filter(pool=pool).exists():
        raise NotFound(f"No model is registered on pool '{pool}'.", param="pool", code="pool_not_found")


@openai_endpoint("GET")
def demand(http_request, pool: str):
    _require_token(http_request, settings.OPERATOR_TOKEN, "the operator API")
    _known_pool(pool)
    return JsonResponse(pool_demand(pool).as_dict())


@openai_endpoint("POST", "DELETE")
def drain(http_request, pool: str, pod: str):
    _require_token(http_request, settings.OPERATOR_TOKEN, "the operator API")
    _known_pool(pool)
    pool_drain(pool, pod, drain=http_request.method == "POST")
    state = "draining" if http_request.method == "POST" else "ready"
    return JsonResponse({"pool": pool, "pod": pod, "state": state}, status=202)


# The span of the ledger the prefix-cache hit ratios cover: long enough to hold a steady mix of
# requests, short enough to follow a change of routing within minutes.
CACHE_HIT_WINDOW = dt.timedelta(minutes=15)


def _cache_hit_lines(since: dt.datetime) -> list[str]:
    """Prefix-cache hit ratios (cached prompt tokens / prompt tokens) per pool, worker and tenant, from
    the ledger rows that finished since `since`; a group without prompt tokens has no sample."""
    lines = []
    for by in CACHE_GROUPS:
        name = f"gemma_{by}_prefix_cache_hit_ratio"
        help_text = f"Prompt tokens served from the prefix cache / prompt tokens, per {by}, last 15 minutes"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for rate in cache_hit_rates(by=by, start=since):
            if rate["hit_rate"] is not None and rate[by]:
                lines.append(f'{name}{{{by}="{_label(rate[by])}"}} {rate["hit_rate"]:.4f}')
    return lines


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics(http_request):
    try:
        if settings.METRICS_TOKEN:
            _require_token(http_request, settings.METRICS_TOKEN, "metrics")
    except OpenAIError as error:
        return error_response(error)
    lines = []
    series = {
        "gemma_pool_queue_depth": ("gauge", "Requests queued for the pool's workers", lambda d: d.queue_depth),
        "gemma_pool_waiting_requests": ("gauge", "Requests held at a gateway for a worker", lambda d: d.waiting),
        "gemma_pool_in_flight_requests": ("gauge", "Requests running on the pool's engines", lambda d: d.in_flight),
        "gemma_pool_tokens_per_second": ("gauge", "Output tokens/s over the pool", lambda d: d.tokens_per_second),
        "gemma_pool_ready_workers": (
            "gauge", "Workers with a ready engine", lambda d: sum(w.state == "ready" for w in d.workers)
        ),
    }  # fmt: skip
    pools = sorted(set(ServedModel.objects.values_list("pool", flat=True)))
    demands = [pool_demand(pool) for pool in pools]
    for name, (kind, help_text, value) in series.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{pool="{d.pool}"}} {value(d)}' for d in demands]
    lines += _cache_hit_lines(timezone.now() - CACHE_HIT_WINDOW)
    connection.close_if_unusable_or_obsolete()
    return HttpResponse("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4")

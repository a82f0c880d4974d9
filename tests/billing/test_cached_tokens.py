"""Prompt tokens served from the engines' prefix caches: the ledger column, rollups, invoice lines at a
plan's cached-input price, and the hit rates /metrics and the console show."""

import datetime as dt
import json
import uuid

import pytest
from django.utils import timezone

from billing.models import InvoiceLine, UsageRollup
from billing.selectors import cache_hit_rates
from billing.services import invoice_build, rollup_refresh
from catalog.models import ServedModel
from contract.protocol import LEDGER_PENDING, Usage
from core.periods import Period
from ledger.models import UsageRecord
from ledger.services import ledger_flush
from quotas.services import plan_create, tenant_quota_set

pytestmark = pytest.mark.django_db

LAST_MONTH = Period.containing(Period.current().start - dt.timedelta(days=1))


@pytest.fixture
def alice(make_tenant):
    tenant, _ = make_tenant("alice")
    return tenant, tenant.api_keys.get()


def _row(tenant, key, *, prompt: int, cached: int, worker: str = "w1#aa", model: str = "tiny-gemma4", finished=None):
    return UsageRecord.objects.create(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, api_key=key, model=model, prompt_tokens=prompt,
        cached_tokens=cached, completion_tokens=10, total_ms=100, worker=worker,
        finished_at=finished or timezone.now() - dt.timedelta(minutes=1),
    )  # fmt: skip


def test_the_ledger_records_each_requests_cached_tokens_once(alice, redis_client):
    tenant, key = alice
    usage = Usage(request_id="chatcmpl-cached-1", tenant_id=tenant.id, key_id=key.id, model="tiny-gemma4",
                  prompt_tokens=300, cached_tokens=256, completion_tokens=4, total_ms=50, worker="w1#aa",
                  finished_at=timezone.now().timestamp())  # fmt: skip
    stored = json.loads(usage.dumps())
    del stored["cached_tokens"]  # an entry a worker wrote before the field existed
    older = dict(stored, request_id="chatcmpl-cached-2")
    redis_client.hset(LEDGER_PENDING, mapping={usage.request_id: usage.dumps(), older["request_id"]: json.dumps(older)})

    assert ledger_flush() == 2
    redis_client.hset(LEDGER_PENDING, usage.request_id, usage.dumps())  # replayed: not counted twice
    ledger_flush()

    rows = dict(UsageRecord.objects.values_list("request_id", "cached_tokens"))
    assert rows == {"chatcmpl-cached-1": 256, "chatcmpl-cached-2": 0}


def test_rollups_carry_the_cached_tokens(alice, redis_client):
    tenant, key = alice
    for cached in (0, 100, 28):
        _row(tenant, key, prompt=200, cached=cached, finished=LAST_MONTH.start + dt.timedelta(hours=5))
    rollup_refresh(since=LAST_MONTH.start)
    for granularity in ("hour", "day"):
        rollup = UsageRollup.objects.get(tenant=tenant, granularity=granularity)
        assert (rollup.prompt_tokens, rollup.cached_tokens) == (600, 128)


def test_cached_input_tokens_are_their_own_invoice_line_at_the_plans_lower_price(alice):
    tenant, key = alice
    plan = plan_create(name="cache-cheap", price_input_per_1m_micros=200_000, price_cached_input_per_1m_micros=50_000,
                       price_output_per_1m_micros=800_000)  # fmt: skip
    tenant_quota_set(tenant=tenant, plan=plan)
    _row(tenant, key, prompt=1_000_000, cached=600_000, finished=LAST_MONTH.start + dt.timedelta(days=2))

    invoice = invoice_build(tenant=tenant, period=LAST_MONTH)

    lines = {line.kind: line for line in invoice.lines.all()}
    assert (lines["input_tokens"].quantity, lines["input_tokens"].amount_micros) == (400_000, 80_000)
    cached = lines[InvoiceLine.Kind.CACHED_INPUT_TOKENS]
    assert (cached.quantity, cached.unit_price_micros, cached.amount_micros) == (600_000, 50_000, 30_000)
    assert cached.description == "tiny-gemma4: 600000 cached input tokens"
    assert invoice.total_micros == 80_000 + 30_000 + 8  # 10 output tokens at 0.80 per 1M: 8 micro-units


def test_without_a_cached_price_cached_input_tokens_cost_the_input_price(alice):
    tenant, key = alice
    tenant_quota_set(tenant=tenant, plan=plan_create(name="flat", price_input_per_1m_micros=200_000))
    _row(tenant, key, prompt=1_000_000, cached=600_000, finished=LAST_MONTH.start + dt.timedelta(days=2))
    _row(tenant, key, prompt=1_000, cached=0, model="tiny-gemma4:my-adapter",
         finished=LAST_MONTH.start + dt.timedelta(days=2))  # fmt: skip

    invoice = invoice_build(tenant=tenant, period=LAST_MONTH)

    input_lines = invoice.lines.filter(kind__in=["input_tokens", "cached_input_tokens"])
    input_micros = sum(line.amount_micros for line in input_lines)
    assert input_micros == 200_000 + 200
    # No prefix-cache hits on the adapter: no cached line for it.
    assert list(invoice.lines.filter(kind="cached_input_tokens").values_list("model", flat=True)) == ["tiny-gemma4"]


def test_hit_rates_per_pool_worker_and_tenant(alice, make_tenant):
    tenant, key = alice
    bob, _ = make_tenant("bob")
    ServedModel.objects.create(model_id="tiny-gemma4", pool="tiny", context_length=2048)
    ServedModel.objects.create(model_id="other", pool="big", context_length=2048)
    _row(tenant, key, prompt=100, cached=80, worker="w1#aa")
    _row(tenant, key, prompt=100, cached=0, worker="w2#bb")
    _row(tenant, key, prompt=50, cached=25, worker="w2#bb", model="tiny-gemma4:my-adapter")  # the base's pool
    _row(bob, bob.api_keys.get(), prompt=200, cached=50, worker="w3#cc", model="other")
    _row(bob, bob.api_keys.get(), prompt=999, cached=0, worker="")  # cancelled before a worker ran it
    _row(tenant, key, prompt=500, cached=500, finished=timezone.now() - dt.timedelta(hours=2))  # before the span
    since = timezone.now() - dt.timedelta(minutes=15)

    def rates(by, **scope):
        return {rate[by]: rate["hit_rate"] for rate in cache_hit_rates(by=by, start=since, **scope)}

    assert rates("pool") == {"tiny": 105 / 250, "big": 0.25}
    assert rates("worker") == {"w1#aa": 0.8, "w2#bb": 25 / 150, "w3#cc": 0.25}
    assert rates("tenant") == {"alice": 105 / 250, "bob": 0.25}
    assert rates("pool", tenant_id=bob.id) == {"big": 0.25}
    with pytest.raises(ValueError):
        cache_hit_rates(by="model", start=since)


def test_metrics_show_the_hit_rates(client, alice, redis_client):
    tenant, key = alice
    ServedModel.objects.create(model_id="tiny-gemma4", pool="tiny", context_length=2048)
    _row(tenant, key, prompt=100, cached=75, worker='w1#"odd"')

    body = client.get("/metrics").content.decode()

    assert 'gemma_pool_prefix_cache_hit_ratio{pool="tiny"} 0.7500' in body
    assert 'gemma_worker_prefix_cache_hit_ratio{worker="w1#\\"odd\\""} 0.7500' in body
    assert 'gemma_tenant_prefix_cache_hit_ratio{tenant="alice"} 0.7500' in body
    assert "# TYPE gemma_worker_prefix_cache_hit_ratio gauge" in body

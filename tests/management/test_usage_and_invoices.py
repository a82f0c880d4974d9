"""Usage (rollups, filters, granularity) and invoices (JSON, CSV) through the API."""

import csv
import datetime as dt
import io
import uuid

import pytest

from billing.services import rollup_refresh
from core.periods import Period
from ledger.models import UsageRecord
from tenants.models import ApiKey
from tests.management.conftest import call

pytestmark = pytest.mark.django_db

BASE = "/api/v1"
LAST_MONTH = Period.containing(Period.current().start - dt.timedelta(days=1))


def test_usage_by_period_model_key_and_granularity(client, world):
    alice = world["alice"]
    admin_key = ApiKey.objects.get(prefix=alice.admin_prefix)
    for hour, model in ((1, "tiny-gemma4"), (1, "other"), (30, "tiny-gemma4")):
        UsageRecord.objects.create(
            request_id=f"cmpl-{uuid.uuid4().hex}", tenant=alice.tenant, api_key=admin_key, model=model,
            prompt_tokens=100, completion_tokens=36, queue_ms=5, ttft_ms=40, total_ms=1045,
            finished_at=LAST_MONTH.start + dt.timedelta(hours=hour),
        )  # fmt: skip
    rollup_refresh(since=LAST_MONTH.start)

    def usage(query, span=f"period={LAST_MONTH.id}"):
        response = call(client, "GET", f"{BASE}/tenants/alice/usage/?{span}&{query}", alice.admin_key)
        assert response.status_code == 200, response.content
        return response.json()

    whole = usage("granularity=total")
    total = whole["total"]
    assert (total["requests"], total["prompt_tokens"], total["completion_tokens"]) == (4, 311, 130)
    # One bucket for the whole month, starting with it.
    (bucket,) = whole["data"]
    assert dt.datetime.fromisoformat(bucket["bucket_start"]) == LAST_MONTH.start and bucket["requests"] == 4
    quiet = [(LAST_MONTH.end + dt.timedelta(hours=h)).strftime("%Y-%m-%dT%H:%M:%SZ") for h in (0, 1)]
    assert usage("granularity=total", span=f"start={quiet[0]}&end={quiet[1]}")["data"] == []  # no usage: no bucket
    days = usage("granularity=day")["data"]
    assert [d["requests"] for d in days] == [3, 1]
    hours = usage("granularity=hour&model=tiny-gemma4")["data"]
    assert [h["requests"] for h in hours] == [1, 1, 1]
    by_key = usage(f"granularity=total&key={alice.admin_prefix}")["total"]
    assert by_key["completion_tokens"] == 108
    # 35 decode tokens in 1000 ms each: the rollups keep decode speed, and delivered tokens/s per bucket.
    assert by_key["decode_tokens_per_second"] == 35.0
    assert hours[1]["delivered_tokens_per_second"] == round(36 / 3600, 3)


def test_an_invoice_as_json_and_csv(client, world):
    alice = world["alice"]
    as_json = call(client, "GET", f"{BASE}/tenants/alice/invoices/{alice.invoice}/", alice.admin_key).json()
    as_csv = call(client, "GET", f"{BASE}/tenants/alice/invoices/{alice.invoice}/csv/", alice.admin_key)

    rows = list(csv.DictReader(io.StringIO(as_csv.content.decode())))
    assert as_csv["Content-Type"].startswith("text/csv")
    assert [line["quantity"] for line in as_json["lines"]] == [11, 22]
    assert as_json["total_micros"] == (11 * 100 + 500_000) // 1_000_000 + (22 * 200 + 500_000) // 1_000_000
    assert int(rows[-1]["amount_micros"]) == as_json["total_micros"] and len(rows) == 3


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client, world):
    alice = world["alice"]
    admin_key = ApiKey.objects.get(prefix=alice.admin_prefix)
    for cached in (0, 96):
        UsageRecord.objects.create(
            request_id=f"cmpl-{uuid.uuid4().hex}", tenant=alice.tenant, api_key=admin_key, model="tiny-gemma4",
            prompt_tokens=128, cached_tokens=cached, completion_tokens=8, total_ms=100,
            finished_at=LAST_MONTH.start + dt.timedelta(hours=2),
        )  # fmt: skip
    rollup_refresh(since=LAST_MONTH.start)
    url = f"{BASE}/tenants/alice/usage/?period={LAST_MONTH.id}&granularity=hour&model=tiny-gemma4"
    response = call(client, "GET", url, alice.admin_key)
    assert response.status_code == 200, response.content
    bucket = next(b for b in response.json()["data"] if b["requests"] == 2)
    assert (bucket["prompt_tokens"], bucket["cached_tokens"]) == (256, 96)


def test_a_plan_prices_cached_input_tokens_of_its_own_or_at_the_input_price(client, world, operator_token):
    created = call(client, "POST", f"{BASE}/plans/", operator_token,
                   {"name": "cache-plan", "price_input_per_1m_micros": 200_000})  # fmt: skip
    assert created.status_code == 201, created.content
    assert created.json()["price_cached_input_per_1m_micros"] is None  # the input price
    patched = call(client, "PATCH", f"{BASE}/plans/cache-plan/", operator_token,
                   {"price_cached_input_per_1m_micros": 50_000})  # fmt: skip
    assert patched.status_code == 200, patched.content
    assert patched.json()["price_cached_input_per_1m_micros"] == 50_000
    refused = call(client, "PATCH", f"{BASE}/plans/cache-plan/", operator_token,
                   {"price_cached_input_per_1m_micros": -1})  # fmt: skip
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "price_cached_input_per_1m_micros"

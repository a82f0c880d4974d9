"""Rollups and invoices are derived from the ledger and always equal its sums."""

import csv
import datetime as dt
import io
import random
import uuid

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Sum

from billing.models import Invoice, InvoiceLine, UsageRollup
from billing.services import invoice_as_csv, invoice_build, invoice_close, rollup_refresh
from core.errors import Conflict
from core.periods import Period
from ledger.models import UsageRecord
from management.serializers import InvoiceOutput
from quotas.services import plan_create, tenant_quota_set
from tenants.services import apikey_create

pytestmark = pytest.mark.django_db

LAST_MONTH = Period.containing(Period.current().start - dt.timedelta(days=1))


def _ledger_rows(tenant, keys, n, *, start, span_hours, models=("tiny-gemma4", "gemma-4-e4b")):
    rng = random.Random(tenant.name)
    rows = []
    for _ in range(n):
        finished = start + dt.timedelta(seconds=rng.randrange(int(span_hours * 3600)))
        completion = rng.randint(0, 300)
        rows.append(UsageRecord(
            request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, api_key=rng.choice(keys),
            model=rng.choice(models), prompt_tokens=rng.randint(1, 500), completion_tokens=completion,
            queue_ms=rng.randint(0, 50), ttft_ms=rng.randint(10, 90), total_ms=rng.randint(200, 4000),
            status=rng.choice(["ok", "ok", "ok", "cancelled"]), finished_at=finished,
        ))  # fmt: skip
    UsageRecord.objects.bulk_create(rows)
    return rows


@pytest.fixture
def alice(make_tenant):
    tenant, _ = make_tenant("alice")
    second, _ = apikey_create(tenant=tenant, name="batch")
    return tenant, [tenant.api_keys.exclude(pk=second.pk).get(), second]


def test_hourly_and_daily_rollups_equal_the_ledger_sums(alice, make_tenant, redis_client):
    tenant, keys = alice
    bob, _ = make_tenant("bob")
    start = LAST_MONTH.start + dt.timedelta(days=3)
    _ledger_rows(tenant, keys, 400, start=start, span_hours=60)
    _ledger_rows(bob, [bob.api_keys.get()], 50, start=start, span_hours=60)

    rollup_refresh(since=LAST_MONTH.start)
    rollup_refresh(since=LAST_MONTH.start)  # idempotent: a second run changes nothing

    ledger = UsageRecord.objects.filter(tenant=tenant).aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    for granularity in ("hour", "day"):
        rolled = UsageRollup.objects.filter(tenant=tenant, granularity=granularity).aggregate(
            p=Sum("prompt_tokens"), c=Sum("completion_tokens"), n=Sum("requests")
        )
        assert (rolled["p"], rolled["c"], rolled["n"]) == (ledger["p"], ledger["c"], 400), granularity
    # Per key and model in one hour, too.
    bucket = UsageRollup.objects.filter(tenant=tenant, granularity="hour").first()
    in_ledger = UsageRecord.objects.filter(
        tenant=tenant, api_key=bucket.api_key, model=bucket.model, finished_at__gte=bucket.bucket_start,
        finished_at__lt=bucket.bucket_start + dt.timedelta(hours=1),
    )  # fmt: skip
    assert bucket.requests == in_ledger.count()
    assert bucket.completion_tokens == (in_ledger.aggregate(c=Sum("completion_tokens"))["c"] or 0)


def test_a_late_ledger_row_updates_its_old_bucket(alice, redis_client):
    tenant, keys = alice
    start = LAST_MONTH.start + dt.timedelta(days=1)
    _ledger_rows(tenant, keys, 10, start=start, span_hours=1)
    rollup_refresh(since=LAST_MONTH.start)
    late = _ledger_rows(tenant, keys, 1, start=start, span_hours=1)[0]  # flushed after PostgreSQL came back

    rollup_refresh()

    day = UsageRollup.objects.filter(tenant=tenant, granularity="day").aggregate(n=Sum("requests"))["n"]
    assert day == 11 and UsageRecord.objects.filter(pk=late.pk).exists()


def test_an_invoice_equals_the_ledger_at_plan_prices(alice):
    tenant, keys = alice
    plan = plan_create(
        name="pro", price_input_per_1m_micros=150_000, price_output_per_1m_micros=600_000,
        reserved_throughput_fee_micros=20_000_000, guaranteed_tokens_per_second=50,
    )  # fmt: skip
    tenant_quota_set(tenant=tenant, plan=plan)
    _ledger_rows(tenant, keys, 300, start=LAST_MONTH.start, span_hours=24 * 20)
    _ledger_rows(tenant, keys, 5, start=Period.current().start, span_hours=1)  # next period: not on it

    invoice = invoice_build(tenant=tenant, period=LAST_MONTH)

    rows = UsageRecord.objects.filter(tenant=tenant, finished_at__lt=LAST_MONTH.end)
    by_kind = {kind: sum(line.quantity for line in invoice.lines.filter(kind=kind)) for kind in InvoiceLine.Kind}
    assert by_kind["input_tokens"] == rows.aggregate(n=Sum("prompt_tokens"))["n"]
    assert by_kind["output_tokens"] == rows.aggregate(n=Sum("completion_tokens"))["n"]
    assert by_kind["reserved_throughput"] == 50
    assert invoice.total_micros == sum(line.amount_micros for line in invoice.lines.all())
    for line in invoice.lines.exclude(kind="reserved_throughput"):
        assert line.amount_micros == (line.quantity * line.unit_price_micros + 500_000) // 1_000_000
    assert all(isinstance(line.amount_micros, int) for line in invoice.lines.all())


def test_a_closed_invoice_never_changes(alice):
    tenant, keys = alice
    plan = plan_create(name="pro", price_input_per_1m_micros=1_000_000, price_output_per_1m_micros=2_000_000)
    tenant_quota_set(tenant=tenant, plan=plan)
    _ledger_rows(tenant, keys, 20, start=LAST_MONTH.start, span_hours=48)
    invoice = invoice_close(invoice=invoice_build(tenant=tenant, period=LAST_MONTH))
    closed_total = invoice.total_micros
    # Later: more (late) usage and a price change; the closed invoice stays as it was.
    _ledger_rows(tenant, keys, 20, start=LAST_MONTH.start, span_hours=48)
    plan.price_output_per_1m_micros = 9_000_000
    plan.save()

    again = invoice_build(tenant=tenant, period=LAST_MONTH)

    assert again.pk == invoice.pk and again.status == "closed" and again.total_micros == closed_total
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.filter(pk=invoice.pk).update(total_micros=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        InvoiceLine.objects.filter(invoice=invoice).delete()
    with pytest.raises(IntegrityError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE billing_invoiceline SET amount_micros = 0 WHERE invoice_id = %s", [invoice.pk])
    assert Invoice.objects.get(pk=invoice.pk).total_micros == closed_total


def test_an_open_period_cannot_be_closed(alice):
    tenant, _ = alice
    with pytest.raises(Conflict):
        invoice_close(invoice=invoice_build(tenant=tenant, period=Period.current()))


def test_invoice_exports_carry_every_line_and_the_total(alice):
    tenant, keys = alice
    tenant_quota_set(
        tenant=tenant, plan=plan_create(name="pro", price_input_per_1m_micros=3, price_output_per_1m_micros=7)
    )
    _ledger_rows(tenant, keys, 30, start=LAST_MONTH.start, span_hours=10)
    invoice = invoice_build(tenant=tenant, period=LAST_MONTH)

    as_json = InvoiceOutput(invoice).data  # the management API's JSON of an invoice
    rows = list(csv.DictReader(io.StringIO(invoice_as_csv(invoice))))

    assert len(as_json["lines"]) == invoice.lines.count() == len(rows) - 1
    assert rows[-1]["kind"] == "total" and int(rows[-1]["amount_micros"]) == as_json["total_micros"]
    assert sum(int(r["amount_micros"]) for r in rows[:-1]) == invoice.total_micros


def _usage(tenant, key, *, finished_at: dt.datetime, completion_tokens: int = 7):
    from contract.protocol import Usage

    return Usage(request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant_id=tenant.id, key_id=key.id, model="tiny-gemma4",
                 prompt_tokens=3, completion_tokens=completion_tokens, total_ms=100, finish_reason="length",
                 finished_at=finished_at.timestamp())  # fmt: skip


def test_closing_a_period_writes_its_usage_still_buffered_in_redis_first(alice, redis_client):
    from billing.services import invoices_close_period
    from contract.protocol import LEDGER_PENDING

    tenant, keys = alice
    _ledger_rows(tenant, keys, 5, start=LAST_MONTH.start, span_hours=24)
    late = _usage(tenant, keys[0], finished_at=LAST_MONTH.end - dt.timedelta(seconds=1), completion_tokens=11)
    redis_client.hset(LEDGER_PENDING, late.request_id, late.dumps())  # not flushed when the month ended

    assert invoices_close_period(period=LAST_MONTH) == 1

    invoice = Invoice.objects.get(tenant=tenant, period_start=LAST_MONTH.start)
    assert invoice.status == "closed"
    assert UsageRecord.objects.filter(request_id=late.request_id).exists()
    output = invoice.lines.filter(kind="output_tokens").aggregate(total=Sum("quantity"))["total"]
    assert output == UsageRecord.objects.filter(tenant=tenant, finished_at__lt=LAST_MONTH.end).aggregate(
        total=Sum("completion_tokens"))["total"]  # fmt: skip


def test_an_invoice_with_usage_the_ledger_rejected_stays_open_until_it_is_settled(alice, make_tenant, redis_client):
    from billing.services import invoices_close_period
    from ledger.services import LEDGER_REJECTED

    tenant, keys = alice
    bob, _ = make_tenant("bob")
    _ledger_rows(tenant, keys, 5, start=LAST_MONTH.start, span_hours=24)
    _ledger_rows(bob, list(bob.api_keys.all()), 5, start=LAST_MONTH.start, span_hours=24)
    refused = _usage(tenant, keys[0], finished_at=LAST_MONTH.start + dt.timedelta(hours=30))
    redis_client.hset(LEDGER_REJECTED, refused.request_id, refused.dumps())
    next_month = _usage(tenant, keys[0], finished_at=LAST_MONTH.end + dt.timedelta(hours=1))
    redis_client.hset(LEDGER_REJECTED, next_month.request_id, next_month.dumps())  # another period's

    assert invoices_close_period(period=LAST_MONTH) == 1  # bob's

    assert Invoice.objects.get(tenant=bob, period_start=LAST_MONTH.start).status == "closed"
    assert Invoice.objects.get(tenant=tenant, period_start=LAST_MONTH.start).status == "draft"
    redis_client.hdel(LEDGER_REJECTED, refused.request_id)  # an operator settled it
    assert invoices_close_period(period=LAST_MONTH) == 1
    assert Invoice.objects.get(tenant=tenant, period_start=LAST_MONTH.start).status == "closed"

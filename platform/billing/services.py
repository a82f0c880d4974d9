"""Rollups and invoices, derived from the usage ledger (the only source of truth for usage)."""

import csv
import datetime as dt
import io
import logging

from django.db import transaction
from django.utils import timezone

from billing.models import Invoice, InvoiceLine, UsageRollup
from billing.selectors import TRUNC, ledger_aggregates, ledger_rows
from config.redis_client import get_redis
from core.errors import Conflict
from core.periods import Period
from ledger.models import UsageRecord
from ledger.services import ledger_flush, ledger_unwritten
from quotas.models import Plan, TenantQuota
from tenants.models import Tenant

log = logging.getLogger(__name__)

MICROS_PER_MILLION_TOKENS = 1_000_000
_WATERMARK = "billing:rollup:watermark"
# A ledger row is stamped before its transaction commits: look back this far past the last run.
_WATERMARK_SLACK = dt.timedelta(minutes=5)
_FIRST_RUN_LOOKBACK = dt.timedelta(days=3)
_STEP = {"hour": dt.timedelta(hours=1), "day": dt.timedelta(days=1)}


# -- rollups -------------------------------------------------------------------------------------
def rollup_buckets(*, granularity: str, buckets: list[dt.datetime]) -> int:
    """Recompute the given buckets from the ledger (idempotent); returns the rollup rows written."""
    written = 0
    step = _STEP[granularity]
    for start in buckets:
        rows = ledger_rows(start=start, end=start + step).order_by()
        groups = ledger_aggregates(rows, "tenant_id", "api_key_id", "model")
        with transaction.atomic():
            UsageRollup.objects.filter(granularity=granularity, bucket_start=start).delete()
            UsageRollup.objects.bulk_create(
                [UsageRollup(granularity=granularity, bucket_start=start, **group) for group in groups]
            )
            written += len(groups)
    return written


def rollup_refresh(*, since: dt.datetime | None = None) -> int:
    """Recompute every hourly and daily bucket that received ledger rows since the last run."""
    redis = get_redis()
    started = timezone.now()
    if since is None:
        mark = redis.get(_WATERMARK)
        since = dt.datetime.fromisoformat(mark) - _WATERMARK_SLACK if mark else started - _FIRST_RUN_LOOKBACK
    fresh = UsageRecord.objects.filter(recorded_at__gte=since).order_by()
    written = 0
    for granularity, trunc in TRUNC.items():
        buckets = sorted(fresh.annotate(b=trunc("finished_at", tzinfo=dt.UTC)).values_list("b", flat=True).distinct())
        written += rollup_buckets(granularity=granularity, buckets=buckets)
    redis.set(_WATERMARK, started.isoformat())
    return written


# -- invoices ------------------------------------------------------------------------------------
def _amount(quantity: int, price_per_million: int) -> int:
    """Tokens x price per 1M tokens, in micro-units, rounded half up (integers only)."""
    return (quantity * price_per_million + MICROS_PER_MILLION_TOKENS // 2) // MICROS_PER_MILLION_TOKENS


def _plan_of(tenant: Tenant) -> Plan | None:
    quota = TenantQuota.objects.select_related("plan").filter(tenant=tenant).first()
    return quota.plan if quota else None


def _prices(plan: Plan | None, model: str) -> tuple[int, int, int]:
    """(input, cached input, output) price per 1M tokens of `model` under `plan`. A tenant's adapter
    ("<base>:<name>") has the plan's adapter prices where it sets them, else the base prices; cached
    input tokens have the plan's cached-input price where it sets one, else the input price."""
    if plan is None:
        return 0, 0, 0
    price_in, price_out = plan.price_input_per_1m_micros, plan.price_output_per_1m_micros
    if ":" in model:
        price_in = _first_set(plan.price_adapter_input_per_1m_micros, price_in)
        price_out = _first_set(plan.price_adapter_output_per_1m_micros, price_out)
    return price_in, _first_set(plan.price_cached_input_per_1m_micros, price_in), price_out


def _first_set(value: int | None, default: int) -> int:
    return default if value is None else value


def _invoice_lines(tenant: Tenant, period: Period, plan: Plan | None) -> list[InvoiceLine]:
    lines = []
    per_model = ledger_aggregates(ledger_rows(start=period.start, end=period.end, tenant=tenant).order_by(), "model")
    for group in sorted(per_model, key=lambda g: g["model"]):
        model = group["model"]
        price_in, price_cached, price_out = _prices(plan, model)
        cached = group["cached_tokens"]
        for kind, tokens, price, what in (
            (InvoiceLine.Kind.INPUT_TOKENS, group["prompt_tokens"] - cached, price_in, "input"),
            (InvoiceLine.Kind.CACHED_INPUT_TOKENS, cached, price_cached, "cached input"),
            (InvoiceLine.Kind.OUTPUT_TOKENS, group["completion_tokens"], price_out, "output"),
        ):
            if kind == InvoiceLine.Kind.CACHED_INPUT_TOKENS and not tokens:
                continue  # no prefix-cache hits: no line
            lines.append(InvoiceLine(
                kind=kind, model=model, description=f"{model}: {tokens} {what} tokens",
                quantity=tokens, unit_price_micros=price, amount_micros=_amount(tokens, price),
            ))  # fmt: skip
    if plan and plan.reserved_throughput_fee_micros:
        lines.append(InvoiceLine(
            kind=InvoiceLine.Kind.RESERVED_THROUGHPUT,
            description=f"Reserved throughput: {plan.guaranteed_tokens_per_second} tokens/s ({plan.name})",
            quantity=plan.guaranteed_tokens_per_second, unit_price_micros=plan.reserved_throughput_fee_micros,
            amount_micros=plan.reserved_throughput_fee_micros,
        ))  # fmt: skip
    return lines


@transaction.atomic
def invoice_build(*, tenant: Tenant, period: Period) -> Invoice:
    """The tenant's invoice for the period, (re)computed from the ledger; a closed one is returned as is."""
    invoice, _ = Invoice.objects.select_for_update().get_or_create(
        tenant=tenant,
        period_start=period.start,
        defaults={"period_end": period.end, "number": f"{tenant.name}-{period.id}"},
    )
    if invoice.status == Invoice.Status.CLOSED:
        return invoice
    plan = _plan_of(tenant)
    lines = _invoice_lines(tenant, period, plan)
    invoice.lines.all().delete()
    for line in lines:
        line.invoice = invoice
    InvoiceLine.objects.bulk_create(lines)
    invoice.plan_name = plan.name if plan else ""
    invoice.total_micros = sum(line.amount_micros for line in lines)
    invoice.save()
    return invoice


@transaction.atomic
def invoice_close(*, invoice: Invoice) -> Invoice:
    """Recompute a last time and close: from then on the invoice never changes (`invoice_build` returns
    it as it is). Conflict while its period is not over; closing a closed invoice returns it."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.status == Invoice.Status.CLOSED:
        return invoice
    if timezone.now() < invoice.period_end:
        raise Conflict(
            f"The period of {invoice.number} ends at {invoice.period_end.isoformat()}; it cannot close yet.",
            code="conflict",
        )
    invoice = invoice_build(tenant=invoice.tenant, period=Period.containing(invoice.period_start))
    invoice.status, invoice.closed_at = Invoice.Status.CLOSED, timezone.now()
    invoice.save(update_fields=["status", "closed_at", "updated_at"])
    return invoice


def invoices_close_period(*, period: Period) -> int:
    """Build and close every tenant's invoice for an ended period (tenants with usage or a plan);
    returns how many this call closed.

    Usage of the period still buffered in Redis is written to the ledger first. A tenant with usage
    of the period that is not in the ledger (Redis still holds it because PostgreSQL refused the
    write, or the ledger rejected it) keeps an open invoice: a closed invoice never changes, so it
    closes on a later run, once that usage is written (an operator settles rejected entries, which
    the console lists)."""
    ledger_flush()
    unwritten = ledger_unwritten(start=period.start, end=period.end)
    held = {usage.tenant_id for usages in unwritten.values() for usage in usages}
    tenant_ids = set(ledger_rows(start=period.start, end=period.end).values_list("tenant_id", flat=True))
    tenant_ids |= set(TenantQuota.objects.filter(plan__isnull=False).values_list("tenant_id", flat=True))
    closed = 0
    for tenant in Tenant.objects.filter(id__in=tenant_ids | held):
        invoice = invoice_build(tenant=tenant, period=period)
        if invoice.status == Invoice.Status.CLOSED:
            continue
        if tenant.id in held:
            log.warning("invoice %s stays open: usage of %s is not in the ledger yet", invoice.number, period.id)
            continue
        invoice_close(invoice=invoice)
        closed += 1
    return closed


CSV_COLUMNS = ["invoice", "tenant", "period_start", "period_end", "status", "currency", "kind", "model",
               "description", "quantity", "unit_price_micros", "amount_micros"]  # fmt: skip


def invoice_as_csv(invoice: Invoice) -> str:
    """One row per line item, then a TOTAL row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    head = [invoice.number, invoice.tenant.name, invoice.period_start.isoformat(), invoice.period_end.isoformat(),
            invoice.status, invoice.currency]  # fmt: skip
    for line in invoice.lines.all():
        writer.writerow(head + [line.kind, line.model, line.description, line.quantity, line.unit_price_micros,
                                line.amount_micros])  # fmt: skip
    writer.writerow(head + ["total", "", "Total", "", "", invoice.total_micros])
    return out.getvalue()

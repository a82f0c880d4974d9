from decimal import Decimal

from django import template

register = template.Library()


@register.filter
def money(micros, currency: str = "USD") -> str:
    """Integer micro-units as money: 1234567 → "USD 1.23"; amounts under a cent keep their digits."""
    if micros is None:
        return "–"
    amount = Decimal(int(micros)) / Decimal(1_000_000)
    places = Decimal("0.01") if amount == 0 or abs(amount) >= Decimal("0.01") else Decimal("0.000001")
    return f"{currency} {amount.quantize(places):,}"


@register.filter
def limit(value) -> str:
    """A limit for display: None is "no limit"."""
    return "no limit" if value is None else f"{int(value):,}"


@register.filter
def percent(ratio) -> str:
    """A ratio for display as a percentage with one decimal: 0.4567 → "45.7%"; None is "–"."""
    return "–" if ratio is None else f"{ratio * 100:.1f}%"

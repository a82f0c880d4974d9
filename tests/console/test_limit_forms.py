"""The console's limit forms refuse a value its database column cannot hold (a form error on the
field, not a 500 when the quota is saved)."""

import pytest

from console.forms import KeyQuotaForm, PlanForm, TenantQuotaForm

BIGINT_MAX = 2**63 - 1

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("form_class", [TenantQuotaForm, KeyQuotaForm])
@pytest.mark.parametrize("field", ["rpm", "budget_tokens"])
def test_a_limit_beyond_its_column_is_a_form_error(form_class, field):
    form = form_class(data={field: str(10_000_000_000_000_000_000)})
    assert not form.is_valid()
    assert list(form.errors) == [field]


def test_the_largest_limit_a_column_holds_is_accepted():
    form = TenantQuotaForm(data={"rpm": str(BIGINT_MAX)})
    assert form.is_valid(), form.errors
    assert form.limits()["rpm"] == BIGINT_MAX


def test_a_plan_beyond_its_columns_is_a_form_error():
    form = PlanForm(data={"name": "gold", "rpm": str(BIGINT_MAX + 1), "fair_share_weight": str(2**31),
                          "guaranteed_tokens_per_second": "0", "price_input": "0", "price_output": "0",
                          "reserved_fee": "0"})  # fmt: skip
    assert not form.is_valid()
    assert {"rpm", "fair_share_weight"} <= set(form.errors)

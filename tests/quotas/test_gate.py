"""The admission gate (quotas/gate.py): what it refuses for a limit is a 429 recorded for the
tenant's console (quotas/refusals.py), the request of n choices without max_tokens included."""

import uuid

import pytest

from catalog.models import ServedModel
from core.errors import InvalidRequest, RateLimited
from quotas.gate import admission_check, admission_gate
from quotas.limits import limits_for
from quotas.refusals import refusals_recent
from quotas.services import tenant_quota_set
from tenants.services import KeyPrincipal

pytestmark = pytest.mark.django_db

PROMPT = 2


@pytest.fixture
def alice(make_tenant, redis_client):
    """alice with a token budget that leaves 4 tokens once a first request of 10 + 10 is admitted."""
    tenant, _ = make_tenant("alice")
    key = tenant.api_keys.get()
    tenant_quota_set(tenant=tenant, budget_tokens=24)
    principal = KeyPrincipal(key_id=key.id, tenant_id=tenant.id, tenant_name=tenant.name, allowed_models=(),
                             key_prefix=key.prefix)  # fmt: skip
    return principal, limits_for(tenant_id=tenant.id, key_id=key.id)


def _gate(alice, *, prompt: int, max_tokens: int, implicit: bool, choices: int):
    principal, limits = alice
    model = ServedModel(model_id="m", path="unused", pool="gate-test", context_length=4096)
    return admission_gate(
        principal=principal, limits=limits, model=model, request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt_tokens=prompt, max_tokens=max_tokens, implicit_max_tokens=implicit, choices=choices, ready_workers=[],
    )  # fmt: skip


def test_n_choices_without_max_tokens_are_refused_and_recorded_when_fewer_tokens_than_choices_are_left(alice):
    principal, limits = alice
    assert _gate(alice, prompt=10, max_tokens=10, implicit=False, choices=1).max_tokens == 10  # 4 left

    # Three choices need three tokens besides the prompt's two: one is missing.
    check = dict(principal=principal, limits=limits, prompt_tokens=PROMPT, max_tokens=3 * 1000,
                 implicit_max_tokens=True, prompt_param="messages", choices=3)  # fmt: skip
    with pytest.raises(RateLimited) as early:
        admission_check(**check)  # before tokenizing: the same answer, nothing reserved
    with pytest.raises(RateLimited) as refused:
        _gate(alice, prompt=PROMPT, max_tokens=3 * 1000, implicit=True, choices=3)
    for error in (early.value, refused.value):
        assert (error.status, error.code) == (429, "insufficient_quota")
        assert error.headers["x-ratelimit-exceeded"] == "budget_tokens" and "Retry-After" in error.headers
    recorded = refusals_recent(tenant_id=principal.tenant_id)
    assert [(r.limit, r.code, r.key_prefix) for r in recorded] == [("budget_tokens", "insufficient_quota",
                                                                   principal.key_prefix)] * 2  # fmt: skip

    # Two choices fit in the two tokens left: max_tokens is lowered to one each.
    admitted = _gate(alice, prompt=PROMPT, max_tokens=2 * 1000, implicit=True, choices=2)
    assert admitted.max_tokens == 2


def test_an_implicit_max_tokens_over_a_limits_whole_size_per_choice_is_a_400(alice):
    principal, limits = alice
    with pytest.raises(InvalidRequest) as too_large:  # 2 + 30 > 24, whatever the wait
        admission_check(principal=principal, limits=limits, prompt_tokens=PROMPT, max_tokens=30 * 1000,
                        implicit_max_tokens=True, prompt_param="messages", choices=30, counters=False)  # fmt: skip
    assert (too_large.value.code, too_large.value.param) == ("exceeds_limit", "max_tokens")
    assert refusals_recent(tenant_id=principal.tenant_id) == []

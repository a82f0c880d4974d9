"""Property-based fuzzing of the management API's write endpoints: any body is a 2xx or a 4xx in the
documented error shape (docs/api.md), never a 5xx."""

import pytest
from django.test import Client
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.json_strategies import FUZZ, bodies, texts

BASE = "/api/v1"
_COUNTS = st.integers(min_value=-1, max_value=2**64) | st.none()
_LIMITS = {name: _COUNTS for name in ("rpm", "input_tpm", "output_tpm", "concurrency", "budget_tokens")}
_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,70}", fullmatch=True) | texts
_MODELS = st.lists(texts, max_size=3)
_PLAN = _LIMITS | {
    "name": _NAMES, "display_name": texts, "allowed_models": _MODELS, "price_input_per_1m_micros": _COUNTS,
    "price_output_per_1m_micros": _COUNTS, "reserved_throughput_fee_micros": _COUNTS,
    "guaranteed_tokens_per_second": _COUNTS, "fair_share_weight": _COUNTS,
}  # fmt: skip
# (method, path, body fields): every write endpoint; {key} is the tenant's key prefix.
WRITES = [
    ("post", "/plans/", _PLAN),
    ("patch", "/plans/fuzz-plan/", _PLAN),
    ("post", "/tenants/", {"name": _NAMES, "display_name": texts, "plan": _NAMES}),
    ("patch", "/tenants/fuzz/", {"display_name": texts, "is_active": st.booleans(), "plan": _NAMES}),
    ("patch", "/tenants/fuzz/quota/", _LIMITS | {"plan": _NAMES}),
    ("post", "/tenants/fuzz/keys/", {"name": texts, "expires_at": texts, "allowed_models": _MODELS,
                                     "is_admin": st.booleans()}),
    ("patch", "/tenants/fuzz/keys/{key}/quota/", _LIMITS),
    ("post", "/tenants/fuzz/keys/{key}/rotate/", {"grace_seconds": _COUNTS}),
    ("post", "/tenants/fuzz/invoices/", {"period": st.from_regex(r"\d{4}-\d{2}", fullmatch=True) | texts}),
]  # fmt: skip
REQUESTS = st.one_of([st.tuples(st.just(method), st.just(path), bodies(fields)) for method, path, fields in WRITES])


@pytest.fixture
def prefix(db, make_tenant, redis_client):
    from quotas.services import plan_create
    from tenants.models import ApiKey

    tenant, _ = make_tenant("fuzz")
    plan_create(name="fuzz-plan")
    return ApiKey.objects.get(tenant=tenant).prefix


@settings(FUZZ, max_examples=80)
@given(request=REQUESTS)
def test_the_write_endpoints_answer_any_body_with_a_2xx_or_a_documented_4xx(operator_token, prefix, request):
    method, path, raw = request
    client = Client(raise_request_exception=False)
    response = getattr(client, method)(
        f"{BASE}{path.format(key=prefix)}", data=raw, content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {operator_token}",
    )  # fmt: skip
    event(f"{method} {path}: {response.status_code}")  # --hypothesis-show-statistics shows the mix
    assert response.status_code < 500, response.content
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] in {"invalid_request_error", "authentication_error", "permission_error"}

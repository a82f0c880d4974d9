"""A plan's adapter limit holds under concurrent uploads: the count and the insert happen under a
lock on the tenant's row, so uploads of one tenant that arrive together cannot all see room."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection
from django.test import Client

from adapters.models import Adapter
from quotas.services import plan_create, tenant_quota_set
from tests.adapters.conftest import stored_files
from tests.adapters.lora import lora_files
from tests.adapters.test_adapters_api import upload

UPLOADS = 6


# Each upload runs in a thread of its own, with its own PostgreSQL connection: committed data only.
@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_never_exceed_the_plans_adapter_limit(people, store_dir):
    alice, bob = people["alice"], people["bob"]
    plan = plan_create(name="two-adapters", max_adapters=2)
    tenant_quota_set(tenant=alice.tenant, plan=plan)
    tenant_quota_set(tenant=bob.tenant, plan=plan)
    files = [lora_files(seed=seed) for seed in range(UPLOADS)]
    start = threading.Barrier(UPLOADS)

    def one(index: int) -> int:
        try:
            start.wait()  # every upload is in flight at once
            who, tenant = (alice, "alice") if index % 2 else (bob, "bob")
            return upload(Client(), who.admin_key, tenant, files[index], name=f"tuned-{index}").status_code
        finally:
            connection.close()

    with ThreadPoolExecutor(UPLOADS) as pool:
        statuses = list(pool.map(one, range(UPLOADS)))

    assert sorted(statuses) == [201] * 4 + [409] * 2, statuses
    assert Adapter.objects.filter(tenant=alice.tenant).count() == 2
    assert Adapter.objects.filter(tenant=bob.tenant).count() == 2
    # The refused uploads' files are gone again: only the kept adapters' files remain.
    kept = {adapter.digest for adapter in Adapter.objects.all()}
    assert {path.parent.name for path in stored_files(store_dir)} == kept

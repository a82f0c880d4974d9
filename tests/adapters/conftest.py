"""Adapters on the tiny model: alice, bob and charlie with admin and plain keys, the tiny model
served as `tiny-gemma4`, and an empty adapter store of the test's own."""

from dataclasses import dataclass

import pytest

from catalog import selectors
from catalog.models import ServedModel
from tenants.services import apikey_create, tenant_create

BASE = "tiny-gemma4"


@dataclass
class Who:
    tenant: object
    admin_key: str
    key: str


@pytest.fixture
def store_dir(settings, tmp_path):
    settings.ADAPTER_STORE_DIR = tmp_path / "adapters"
    return settings.ADAPTER_STORE_DIR


@pytest.fixture
def base_model(db, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(selectors, "_cache", {"at": float("-inf"), "models": {}})
    return ServedModel.objects.create(model_id=BASE, path=str(tiny_model_dir), pool="tiny", context_length=2048)


@pytest.fixture
def people(db, redis_client, store_dir, base_model):
    found = {}
    for name in ("alice", "bob", "charlie"):
        tenant = tenant_create(name=name)
        _, admin = apikey_create(tenant=tenant, name="admin", is_admin=True)
        _, plain = apikey_create(tenant=tenant, name="app")
        found[name] = Who(tenant, admin, plain)
    return found


def stored_files(store_dir) -> list:
    return sorted(p for p in store_dir.rglob("*") if p.is_file()) if store_dir.exists() else []

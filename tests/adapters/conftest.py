"""Adapters on the tiny model: alice, bob and charlie with admin and plain keys, the tiny model
served as `tiny-gemma4`, and an empty adapter store of the test's own (a directory, or with
`s3_store` a bucket of its own on a real S3-compatible server)."""

import uuid
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


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint URL of an S3-compatible server running for the session (tests/adapters/s3.py)."""
    from tests.adapters.s3 import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(settings, tmp_path, s3_endpoint):
    """The configured adapter store is an S3Store on a new bucket (prefix `adapters`); the test's
    own download cache."""
    from adapters import store
    from tests.adapters.s3 import ACCESS_KEY, SECRET_KEY

    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    settings.ADAPTER_STORE_URL = f"s3://{bucket}/adapters"
    settings.ADAPTER_S3_ENDPOINT_URL = s3_endpoint
    settings.ADAPTER_S3_ACCESS_KEY_ID, settings.ADAPTER_S3_SECRET_ACCESS_KEY = ACCESS_KEY, SECRET_KEY
    settings.ADAPTER_CACHE_DIR = tmp_path / "adapter-cache"
    configured = store.adapter_store()
    configured.client.make_bucket(bucket)
    return configured


def bucket_keys(s3) -> list[str]:
    """Every object key in the S3 store's bucket."""
    return sorted(o.object_name for o in s3.client.list_objects(s3.bucket, recursive=True))


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

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


def _configure_store(monkeypatch, **variables) -> None:
    """The adapter store's environment for one test (contract/adapter_store.py reads it once per
    process: read again now; the fixture clears it again after the test)."""
    from contract.adapter_store import store_config

    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))
    store_config.cache_clear()


@pytest.fixture
def store_dir(monkeypatch, tmp_path):
    from contract.adapter_store import store_config

    _configure_store(monkeypatch, ADAPTER_STORE_DIR=tmp_path / "adapters")
    yield tmp_path / "adapters"
    store_config.cache_clear()


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint URL of an S3-compatible server running for the session (tests/adapters/s3.py)."""
    from tests.adapters.s3 import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(monkeypatch, tmp_path, s3_endpoint):
    """The configured adapter store is an S3Store on a new bucket (prefix `adapters`); the test's
    own download cache."""
    from contract import adapter_store as store
    from tests.adapters.s3 import ACCESS_KEY, SECRET_KEY

    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    _configure_store(
        monkeypatch, ADAPTER_STORE_URL=f"s3://{bucket}/adapters", ADAPTER_S3_ENDPOINT_URL=s3_endpoint,
        ADAPTER_S3_ACCESS_KEY_ID=ACCESS_KEY, ADAPTER_S3_SECRET_ACCESS_KEY=SECRET_KEY,
        ADAPTER_CACHE_DIR=tmp_path / "adapter-cache",
    )  # fmt: skip
    configured = store.adapter_store()
    configured.client.make_bucket(bucket)
    yield configured
    store.store_config.cache_clear()


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

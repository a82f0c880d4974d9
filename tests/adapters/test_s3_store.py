"""The S3 adapter store against a real S3-compatible server: objects keyed by digest, downloads
verified against the digest and renamed into place, uploads through the management API landing in
the bucket, and nothing stored for a refused upload."""

import asyncio
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from adapters.models import Adapter
from contract.adapter_store import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterCorrupt,
    AdapterMissing,
    AdapterStoreUnavailable,
    S3Store,
    adapter_digest,
)
from tests.adapters.conftest import BASE, bucket_keys
from tests.adapters.lora import lora_files
from tests.adapters.test_adapters_api import URL, _auth, upload
from workers.adapters import AdapterResolver, AdapterUnavailable


def _files(seed: int = 1) -> dict[str, bytes]:
    config, weights = lora_files(seed=seed)
    return {CONFIG_NAME: config, WEIGHTS_NAME: weights}


def _cache_entries(s3: S3Store) -> list[str]:
    return sorted(p.name for p in s3.cache_dir.iterdir()) if s3.cache_dir.exists() else []


def test_put_exists_local_path_and_delete_over_s3(s3_store):
    files = _files()
    digest = adapter_digest(files)
    assert not s3_store.exists(digest)
    with pytest.raises(AdapterMissing):
        s3_store.local_path(digest)

    s3_store.put(digest, files)
    s3_store.put(digest, files)  # idempotent
    assert s3_store.exists(digest)
    assert bucket_keys(s3_store) == [f"adapters/{digest[:2]}/{digest}/{name}" for name in sorted(files)]
    path = s3_store.local_path(digest)
    assert path == s3_store.cache_dir / digest
    assert {name: (path / name).read_bytes() for name in files} == files
    assert _cache_entries(s3_store) == [digest]  # no download folder left behind

    s3_store.delete(digest)
    s3_store.delete(digest)  # a no-op when absent
    assert not s3_store.exists(digest) and bucket_keys(s3_store) == []
    assert _cache_entries(s3_store) == []
    with pytest.raises(AdapterMissing):
        s3_store.local_path(digest)


def test_files_that_do_not_match_their_digest_are_refused(s3_store):
    files, other = _files(1), _files(2)
    digest = adapter_digest(files)
    with pytest.raises(AdapterCorrupt):
        s3_store.put(digest, other)
    assert bucket_keys(s3_store) == []

    # Altered in the bucket behind the store's back: the download is refused and nothing is cached.
    s3_store.put(digest, files)
    forged = other[WEIGHTS_NAME]
    s3_store.client.put_object(s3_store.bucket, s3_store.key(digest, WEIGHTS_NAME), io.BytesIO(forged), len(forged))
    with pytest.raises(AdapterCorrupt):
        s3_store.local_path(digest)
    assert _cache_entries(s3_store) == []


def test_concurrent_downloads_of_one_adapter_give_one_whole_copy(s3_store):
    files = _files()
    digest = adapter_digest(files)
    s3_store.put(digest, files)
    # A second store on the same cache folder stands for another process of the same machine.
    other_process = S3Store(client=s3_store.client, bucket=s3_store.bucket, prefix=s3_store.prefix,
                            cache_dir=s3_store.cache_dir)  # fmt: skip
    downloads = []
    fget = s3_store.client.fget_object

    def counted(*args, **kwargs):
        downloads.append(args[1])
        return fget(*args, **kwargs)

    s3_store.client.fget_object = counted
    start = threading.Barrier(8)

    def fetch(index: int):
        start.wait()
        return (s3_store if index % 2 else other_process).local_path(digest)

    try:
        with ThreadPoolExecutor(8) as pool:
            paths = set(pool.map(fetch, range(8)))
    finally:
        del s3_store.client.fget_object
    assert paths == {s3_store.cache_dir / digest}
    assert {name: (s3_store.cache_dir / digest / name).read_bytes() for name in files} == files
    assert _cache_entries(s3_store) == [digest]
    # Threads of one store download once; the two stores at most once each.
    assert len(downloads) in (2, 4), downloads


@pytest.mark.django_db
def test_an_upload_through_the_api_lands_in_the_bucket_and_a_delete_removes_it(
    client, people, s3_store, django_capture_on_commit_callbacks
):
    alice = people["alice"]
    with django_capture_on_commit_callbacks(execute=True):
        created = upload(client, alice.admin_key, "alice")
    assert created.status_code == 201, created.content
    digest = created.json()["digest"]
    config, weights = lora_files()
    assert digest == adapter_digest({CONFIG_NAME: config, WEIGHTS_NAME: weights})
    assert bucket_keys(s3_store) == [f"adapters/{digest[:2]}/{digest}/{CONFIG_NAME}",
                                     f"adapters/{digest[:2]}/{digest}/{WEIGHTS_NAME}"]  # fmt: skip
    stored = s3_store.client.get_object(s3_store.bucket, s3_store.key(digest, WEIGHTS_NAME))
    try:
        assert stored.read() == weights
    finally:
        stored.close()
        stored.release_conn()

    # bob uploads the same files: one stored copy, kept until neither adapter names it.
    assert upload(client, people["bob"].admin_key, "bob").status_code == 201
    with django_capture_on_commit_callbacks(execute=True):
        gone = client.delete(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key))
    assert gone.status_code == 204 and len(bucket_keys(s3_store)) == 2
    with django_capture_on_commit_callbacks(execute=True):
        gone = client.delete(f"{URL.format(tenant='bob')}{BASE}:support-bot/", **_auth(people["bob"].admin_key))
    assert gone.status_code == 204 and bucket_keys(s3_store) == []


@pytest.mark.django_db
def test_a_refused_upload_stores_nothing_in_the_bucket(client, people, s3_store):
    config, weights = lora_files()
    reply = upload(client, people["alice"].admin_key, "alice", (config, weights[:-100]))
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "adapter_truncated"
    assert not Adapter.objects.exists() and bucket_keys(s3_store) == []


@pytest.mark.django_db
def test_an_upload_while_the_bucket_cannot_be_used_is_a_503_and_stores_nothing(client, people, s3_store):
    s3_store.client.remove_bucket(s3_store.bucket)  # e.g. a bucket that was never created
    reply = upload(client, people["alice"].admin_key, "alice")
    assert reply.status_code == 503, reply.content
    assert reply.json()["error"]["code"] == "adapter_store_unavailable" and reply["Retry-After"] == "10"
    assert not Adapter.objects.exists()
    files = _files()
    with pytest.raises(AdapterStoreUnavailable):
        s3_store.put(adapter_digest(files), files)


class _Engine:
    def __init__(self):
        self.loaded = []

    async def load_adapter(self, lora):
        self.loaded.append((lora.lora_int_id, lora.lora_path))


def test_a_worker_loads_an_adapter_from_the_s3_store(s3_store, tmp_path):
    from tests.adapters.test_routing import _request

    files = _files()
    digest = adapter_digest(files)
    s3_store.put(digest, files)
    (tmp_path / "worker").mkdir()
    resolver, engine = AdapterResolver(s3_store, cache_dir=tmp_path / "worker"), _Engine()
    lora = asyncio.run(resolver.lora_request(_request(42, digest), engine))
    assert engine.loaded == [(42, lora.lora_path)]
    assert (tmp_path / "worker" / digest / WEIGHTS_NAME).read_bytes() == files[WEIGHTS_NAME]
    with pytest.raises(AdapterUnavailable):  # not in the bucket
        asyncio.run(resolver.lora_request(_request(43, "cd" * 32), engine))


KEYS = {"ADAPTER_S3_ACCESS_KEY_ID": "key", "ADAPTER_S3_SECRET_ACCESS_KEY": "secret"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**KEYS, "ADAPTER_STORE_URL": "https://bucket/prefix"}, "ADAPTER_STORE_URL must be s3://bucket[/prefix]"),
        ({**KEYS, "ADAPTER_STORE_URL": "s3://b", "ADAPTER_S3_ENDPOINT_URL": "minio:9000"}, "ADAPTER_S3_ENDPOINT_URL"),
        ({"ADAPTER_STORE_URL": "s3://bucket"}, "set ADAPTER_S3_ACCESS_KEY_ID and ADAPTER_S3_SECRET_ACCESS_KEY"),
    ],
    ids=["not-s3", "endpoint-without-scheme", "no-keys"],
)
def test_a_bad_store_configuration_stops_the_process_at_start(env, message):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    base = {k: os.environ[k] for k in ("PATH", "DATABASE_URL", "REDIS_URL") if k in os.environ}
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**base, "SECRET_KEY": "x", "DJANGO_SETTINGS_MODULE": "config.settings", **env},
    )  # fmt: skip
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]

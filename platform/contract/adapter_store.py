"""The adapter store: adapters' files, content-addressed (a SHA-256 digest of the files names them).

One interface, `AdapterStore`, two implementations chosen by ADAPTER_STORE_URL:
- `FilesystemStore` (the default, for `make up` and the tests): a directory every web and worker
  process reads (ADAPTER_STORE_DIR). Files are written to a temporary folder and renamed into place,
  so a reader never sees a half-written adapter.
- `S3Store` (`s3://bucket/prefix`): an S3-compatible bucket (MinIO in docker-compose and the chart,
  or any S3 endpoint), one object per file under `<prefix>/<digest[:2]>/<digest>/`. `local_path`
  downloads the files into a local cache (ADAPTER_CACHE_DIR), checks them against the digest and
  renames the folder into place: a half-downloaded or altered adapter is never handed out.
The same files uploaded twice are stored once.

Part of the contract: the control plane writes an adapter's files (adapters/services.py) and a
worker reads them back by the digest its request carries (`RequestInput.adapter_digest`), so both
must agree on the digest, the file names, the layout and the configuration that locates them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from contract.env import ConfigError, env_str

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FILE_NAMES = (CONFIG_NAME, WEIGHTS_NAME)
# The repository (platform/contract/ is two levels down): `make up` keeps its files under .run/.
_REPO_DIR = Path(__file__).resolve().parents[2]


def adapter_digest(files: Mapping[str, bytes]) -> str:
    """The store's address of an adapter: SHA-256 over its files' names and digests, in name order."""
    outer = hashlib.sha256()
    for name in sorted(files):
        outer.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return outer.hexdigest()


def _checked(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not an adapter digest: {digest!r}")
    return digest


def _check_files(digest: str, files: Mapping[str, bytes]) -> None:
    if set(files) != set(FILE_NAMES):
        raise ValueError(f"an adapter is the files {', '.join(FILE_NAMES)}; got {', '.join(sorted(files))}")
    if adapter_digest(files) != _checked(digest):
        raise AdapterCorrupt(f"the files are not those of adapter {digest}")


class AdapterMissing(LookupError):
    """The store holds no adapter under this digest."""


class AdapterCorrupt(AdapterMissing):
    """Files under this digest (given to `put`, or found in the store) are not the adapter it names."""


class AdapterStoreUnavailable(OSError):
    """The store cannot be reached or refused the operation (an S3 endpoint down, a missing bucket,
    wrong keys): nothing was decided about the adapter; try again later."""


_MISSING_CODES = ("NoSuchKey", "NoSuchObject", "ResourceNotFound")


@contextlib.contextmanager
def _s3_errors(what: str) -> Iterator[None]:
    """S3 and connection errors as AdapterStoreUnavailable (a missing object is the caller's case)."""
    from minio.error import MinioException, S3Error
    from urllib3.exceptions import HTTPError

    try:
        yield
    except S3Error as exc:
        if exc.code in _MISSING_CODES:
            raise
        raise AdapterStoreUnavailable(f"the adapter store refused to {what}: {exc.code}: {exc.message}") from exc
    except (MinioException, HTTPError) as exc:
        raise AdapterStoreUnavailable(f"the adapter store could not {what}: {exc}") from exc


class AdapterStore(Protocol):
    def put(self, digest: str, files: Mapping[str, bytes]) -> None:
        """Store `files` under `digest` (idempotent); AdapterCorrupt when they do not match it."""

    def local_path(self, digest: str) -> Path:
        """A local directory holding the adapter's files (for the engine); AdapterMissing if none,
        AdapterCorrupt if the stored files do not match the digest."""

    def delete(self, digest: str) -> None:
        """Forget the adapter's files (a no-op when absent)."""

    def exists(self, digest: str) -> bool: ...


def _rename_into_place(staging: Path, final: Path) -> None:
    """Move a complete folder to its final name; another writer of the same digest may have won."""
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise


def _remove_dir(path: Path) -> None:
    """Remove a folder so that a reader sees it whole or not at all (renamed away first)."""
    if not path.is_dir():
        return
    doomed = Path(tempfile.mkdtemp(prefix=".del-", dir=path.parent))
    try:
        os.rename(path, doomed / "x")
    except FileNotFoundError:  # removed meanwhile by another process
        pass
    shutil.rmtree(doomed, ignore_errors=True)


class FilesystemStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _dir(self, digest: str) -> Path:
        return self.root / _checked(digest)[:2] / digest

    def put(self, digest: str, files: Mapping[str, bytes]) -> None:
        _check_files(digest, files)
        final = self._dir(digest)
        if final.is_dir():
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".put-", dir=final.parent))
        try:
            for name, data in files.items():
                (staging / name).write_bytes(data)
            _rename_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def local_path(self, digest: str) -> Path:
        path = self._dir(digest)
        if not (path / WEIGHTS_NAME).is_file():
            raise AdapterMissing(f"the adapter store has no adapter {digest}")
        return path

    def delete(self, digest: str) -> None:
        _remove_dir(self._dir(digest))

    def exists(self, digest: str) -> bool:
        return (self._dir(digest) / WEIGHTS_NAME).is_file()


class S3Store:
    """Adapters in an S3-compatible bucket; `client` is a `minio.Minio`.

    `put` writes the config first and the weights last: an adapter exists once its weights object
    does (each object is written whole or not at all). `local_path` downloads into `cache_dir`
    (one folder per digest, verified, then renamed into place; threads of one process asking for the
    same digest download it once, processes sharing the folder may each download it and one rename
    wins). A cached copy is reused as long as the process lives: its contents were verified.
    """

    def __init__(self, *, client: Any, bucket: str, prefix: str = "", cache_dir: Path) -> None:
        self.client, self.bucket = client, bucket
        self.prefix = prefix.strip("/")
        self.cache_dir = Path(cache_dir)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def key(self, digest: str, name: str) -> str:
        """The object key of one of the adapter's files."""
        path = f"{_checked(digest)[:2]}/{digest}/{name}"
        return f"{self.prefix}/{path}" if self.prefix else path

    def put(self, digest: str, files: Mapping[str, bytes]) -> None:
        import io

        _check_files(digest, files)
        if self.exists(digest):  # the same files again (content-addressed): one HEAD, no upload
            return
        with _s3_errors("store an adapter"):
            for name in (CONFIG_NAME, WEIGHTS_NAME):  # the weights last: they mark the adapter complete
                data = files[name]
                self.client.put_object(self.bucket, self.key(digest, name), io.BytesIO(data), len(data))

    def exists(self, digest: str) -> bool:
        from minio.error import S3Error

        try:
            with _s3_errors("look an adapter up"):
                self.client.stat_object(self.bucket, self.key(digest, WEIGHTS_NAME))
        except S3Error:  # a missing object (_s3_errors converts the others)
            return False
        return True

    def delete(self, digest: str) -> None:
        from minio.deleteobjects import DeleteObject

        # The weights first: from then on the adapter no longer exists for any reader.
        objects = [DeleteObject(self.key(digest, name)) for name in (WEIGHTS_NAME, CONFIG_NAME)]
        with _s3_errors("delete an adapter"):
            errors = list(self.client.remove_objects(self.bucket, objects))  # lazy: consuming it deletes
        if errors:
            raise AdapterStoreUnavailable(f"the adapter store could not delete {digest}: {errors[0]}")
        _remove_dir(self.cache_dir / digest)

    def local_path(self, digest: str) -> Path:
        final = self.cache_dir / _checked(digest)
        if final.is_dir():
            return final
        with self._lock(digest):
            if not final.is_dir():
                self._download(digest, final)
        return final

    def _lock(self, digest: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(digest, threading.Lock())

    def _download(self, digest: str, final: Path) -> None:
        from minio.error import S3Error

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".get-", dir=self.cache_dir))
        try:
            files = {}
            for name in FILE_NAMES:
                try:
                    with _s3_errors("fetch an adapter"):
                        self.client.fget_object(self.bucket, self.key(digest, name), str(staging / name))
                except S3Error:  # a missing object (_s3_errors converts the others)
                    raise AdapterMissing(f"the adapter store has no adapter {digest}") from None
                files[name] = (staging / name).read_bytes()
            if adapter_digest(files) != digest:
                raise AdapterCorrupt(f"the adapter store's files under {digest} do not match that digest")
            _rename_into_place(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def parse_store_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of an `s3://bucket/prefix` URL; ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"ADAPTER_STORE_URL must be s3://bucket[/prefix], got {url!r}")
    return parsed.netloc, parsed.path.strip("/")


# A store that does not answer fails an upload (503) or a request in seconds, not after the client's
# default of five minutes per attempt.
S3_CONNECT_SECONDS, S3_READ_SECONDS, S3_RETRIES = 5.0, 60.0, 3


def s3_client(*, endpoint_url: str, access_key: str, secret_key: str, region: str) -> Any:
    """A `minio.Minio` client for an endpoint URL (http:// or https://; empty: AWS S3), with bounded
    timeouts and retries; thread-safe (one connection pool per client)."""
    import certifi
    import urllib3
    from minio import Minio

    parsed = urlparse(endpoint_url or "https://s3.amazonaws.com")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"ADAPTER_S3_ENDPOINT_URL must be http(s)://host[:port], got {endpoint_url!r}")
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=S3_CONNECT_SECONDS, read=S3_READ_SECONDS), maxsize=16,
        cert_reqs="CERT_REQUIRED", ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=S3_RETRIES, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
    )  # fmt: skip
    return Minio(
        parsed.netloc, access_key=access_key or None, secret_key=secret_key or None,
        secure=parsed.scheme == "https", region=region or None, http_client=http,
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _s3_store(url: str, endpoint: str, access_key: str, secret_key: str, region: str, cache_dir: str) -> S3Store:
    bucket, prefix = parse_store_url(url)
    client = s3_client(endpoint_url=endpoint, access_key=access_key, secret_key=secret_key, region=region)
    return S3Store(client=client, bucket=bucket, prefix=prefix, cache_dir=Path(cache_dir))


@dataclass(frozen=True)
class StoreConfig:
    """Where adapters' files live, from the environment (both sides read it the same way)."""

    url: str  # ADAPTER_STORE_URL: s3://bucket[/prefix]; empty: the directory below
    directory: Path  # ADAPTER_STORE_DIR
    endpoint: str  # ADAPTER_S3_ENDPOINT_URL (empty: AWS S3)
    access_key: str  # ADAPTER_S3_ACCESS_KEY_ID
    secret_key: str  # ADAPTER_S3_SECRET_ACCESS_KEY
    region: str  # ADAPTER_S3_REGION
    cache_dir: Path  # ADAPTER_CACHE_DIR: an S3 store's local copies


@functools.cache
def store_config() -> StoreConfig:
    """The store's configuration, read once per process (the control plane's settings read it at
    start, so a bad value stops the process there); ConfigError names a bad variable."""
    config = StoreConfig(
        url=env_str("ADAPTER_STORE_URL", ""),
        directory=Path(env_str("ADAPTER_STORE_DIR", str(_REPO_DIR / ".run" / "adapters"))),
        endpoint=env_str("ADAPTER_S3_ENDPOINT_URL", ""),
        access_key=env_str("ADAPTER_S3_ACCESS_KEY_ID", ""),
        secret_key=env_str("ADAPTER_S3_SECRET_ACCESS_KEY", ""),
        region=env_str("ADAPTER_S3_REGION", "us-east-1"),
        cache_dir=Path(env_str("ADAPTER_CACHE_DIR", str(Path(tempfile.gettempdir()) / "gemma-adapter-cache"))),
    )
    if config.url:
        parsed = urlparse(config.url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError(f"ADAPTER_STORE_URL must be s3://bucket[/prefix], got {config.url!r}")
        if config.endpoint and urlparse(config.endpoint).scheme not in ("http", "https"):
            raise ConfigError(f"ADAPTER_S3_ENDPOINT_URL must be an http(s):// URL, got {config.endpoint!r}")
        if not (config.access_key and config.secret_key):
            raise ConfigError(
                "ADAPTER_STORE_URL is an S3 bucket: set ADAPTER_S3_ACCESS_KEY_ID and ADAPTER_S3_SECRET_ACCESS_KEY"
            )
    return config


def adapter_store() -> AdapterStore:
    """The configured store: an `S3Store` when ADAPTER_STORE_URL is set (one per process and
    configuration, so its download locks are shared), else a `FilesystemStore` on ADAPTER_STORE_DIR."""
    config = store_config()
    if config.url:
        return _s3_store(
            config.url, config.endpoint, config.access_key, config.secret_key, config.region, str(config.cache_dir)
        )
    return FilesystemStore(config.directory)

"""The adapter store: adapters' files, content-addressed (a SHA-256 digest of the files names them).

One interface, `AdapterStore`; `FilesystemStore` keeps them in a directory every web and worker
process reads (ADAPTER_STORE_DIR: `.run/adapters` for `make up` and the tests, a shared volume in a
cluster). Files are written to a temporary folder and renamed into place, so a reader never sees a
half-written adapter; the same files uploaded twice are stored once.
"""

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FILE_NAMES = (CONFIG_NAME, WEIGHTS_NAME)


def adapter_digest(files: Mapping[str, bytes]) -> str:
    """The store's address of an adapter: SHA-256 over its files' names and digests, in name order."""
    outer = hashlib.sha256()
    for name in sorted(files):
        outer.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return outer.hexdigest()


class AdapterMissing(LookupError):
    """The store holds no adapter under this digest."""


class AdapterStore(Protocol):
    def put(self, digest: str, files: Mapping[str, bytes]) -> None:
        """Store `files` under `digest` (idempotent)."""

    def local_path(self, digest: str) -> Path:
        """A local directory holding the adapter's files (for the engine); AdapterMissing if none."""

    def delete(self, digest: str) -> None:
        """Forget the adapter's files (a no-op when absent)."""

    def exists(self, digest: str) -> bool: ...


class FilesystemStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _dir(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not an adapter digest: {digest!r}")
        return self.root / digest[:2] / digest

    def put(self, digest: str, files: Mapping[str, bytes]) -> None:
        final = self._dir(digest)
        if final.is_dir():
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".put-", dir=final.parent))
        try:
            for name, data in files.items():
                (staging / name).write_bytes(data)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():  # not another writer of the same files winning the race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def local_path(self, digest: str) -> Path:
        path = self._dir(digest)
        if not (path / WEIGHTS_NAME).is_file():
            raise AdapterMissing(f"the adapter store has no adapter {digest}")
        return path

    def delete(self, digest: str) -> None:
        path = self._dir(digest)
        if not path.is_dir():
            return
        # Renamed away first, so a reader sees the adapter whole or not at all.
        doomed = Path(tempfile.mkdtemp(prefix=".del-", dir=path.parent))
        os.rename(path, doomed / "x")
        shutil.rmtree(doomed, ignore_errors=True)

    def exists(self, digest: str) -> bool:
        return (self._dir(digest) / WEIGHTS_NAME).is_file()


def adapter_store() -> AdapterStore:
    """The configured store (settings.ADAPTER_STORE_DIR)."""
    from django.conf import settings

    return FilesystemStore(settings.ADAPTER_STORE_DIR)

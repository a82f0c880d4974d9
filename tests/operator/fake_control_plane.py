"""A test double of the control plane's operator endpoints, served over real HTTP (aiohttp).

It implements the demand contract of docs/operator.md: bearer-token auth, the demand document
per pool, and worker drain / cancel. A drained worker shows `state: "draining"` in the demand
until its drain is cancelled; its in-flight count is whatever the test sets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web


@dataclasses.dataclass
class FakeWorker:
    pod: str
    in_flight: int = 0
    state: str = "ready"


@dataclasses.dataclass
class FakePool:
    queue_depth: int = 0
    waiting: int = 0
    tokens_per_second: float = 0.0
    oldest_queued_wait_seconds: float = 0.0
    workers: dict[str, FakeWorker] = dataclasses.field(default_factory=dict)


class FakeControlPlane:
    def __init__(self, token: str) -> None:
        self.token = token
        self.pools: dict[str, FakePool] = {}
        self.calls: list[tuple[str, str]] = []  # (method, path) of every authenticated call
        self.drain_calls: list[tuple[str, str, str]] = []  # (method, pool, pod)
        self.unauthorized = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---------------------------------------------------------------- test-side controls

    def set_pool(self, pool: str, *, workers: dict[str, int] | None = None, **demand: Any) -> FakePool:
        """Replace a pool's demand; `workers` maps pod name -> streams in flight (ready workers)."""
        state = FakePool(**demand)
        for pod, in_flight in (workers or {}).items():
            state.workers[pod] = FakeWorker(pod=pod, in_flight=in_flight)
        self.pools[pool] = state
        return state

    def set_in_flight(self, pool: str, pod: str, in_flight: int) -> None:
        self.pools[pool].workers[pod].in_flight = in_flight

    def drains(self, method: str = "POST") -> list[str]:
        return [pod for verb, _, pod in self.drain_calls if verb == method]

    # ---------------------------------------------------------------- server

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/api/v1/pools/{pool}/demand", self._demand)
        app.router.add_post("/api/v1/pools/{pool}/workers/{pod}/drain", self._drain)
        app.router.add_delete("/api/v1/pools/{pool}/workers/{pod}/drain", self._cancel)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return web.json_response({"detail": "unauthorized"}, status=401)
        self.calls.append((request.method, request.path))
        return await handler(request)

    async def _demand(self, request: web.Request) -> web.Response:
        name = request.match_info["pool"]
        pool = self.pools.get(name)
        if pool is None:
            return web.json_response({"detail": "no such pool"}, status=404)
        workers = list(pool.workers.values())
        return web.json_response(
            {
                "pool": name,
                "queue_depth": pool.queue_depth,
                "waiting": pool.waiting,
                "in_flight": sum(worker.in_flight for worker in workers),
                "tokens_per_second": pool.tokens_per_second,
                "oldest_queued_wait_seconds": pool.oldest_queued_wait_seconds,
                "workers": [
                    {
                        "name": f"worker@{worker.pod}",
                        "pod": worker.pod,
                        "in_flight": worker.in_flight,
                        "state": worker.state,
                        "last_seen": 1732950000.0,
                    }
                    for worker in workers
                ],
            }
        )

    async def _drain(self, request: web.Request) -> web.Response:
        pool, pod = request.match_info["pool"], request.match_info["pod"]
        self.drain_calls.append(("POST", pool, pod))
        worker = self.pools.get(pool, FakePool()).workers.get(pod)
        if worker is None:
            return web.json_response({"detail": "no such worker"}, status=404)
        worker.state = "draining"
        return web.json_response({"pod": pod, "state": "draining"}, status=202)

    async def _cancel(self, request: web.Request) -> web.Response:
        pool, pod = request.match_info["pool"], request.match_info["pod"]
        self.drain_calls.append(("DELETE", pool, pod))
        worker = self.pools.get(pool, FakePool()).workers.get(pod)
        if worker is None:
            return web.json_response({"detail": "no such worker"}, status=404)
        worker.state = "ready"
        return web.json_response({"pod": pod, "state": "ready"})

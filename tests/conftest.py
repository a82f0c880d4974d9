"""Suite-wide test setup: real PostgreSQL and Redis, the tiny Gemma 4 model, and the live stack.

DATABASE_URL / REDIS_URL name the servers (make test starts embedded ones when unset). The suite uses
its own Redis database index (TEST_REDIS_DB, default 15) so it never flushes an operator's data.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


TINY_MODEL_ID = "tiny-gemma4"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random-weight Gemma 4 model, built once and kept in .run/ between runs."""
    from workers.tinymodel import build_tiny_model

    return build_tiny_model(ROOT / ".run" / "models" / TINY_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_mm_model_dir() -> Path:
    """The tiny random-weight multimodal Gemma 4 model (text and vision), built once into .run/."""
    from workers.tinymodel_mm import build_tiny_mm_model

    return build_tiny_mm_model(ROOT / ".run" / "models" / f"{TINY_MODEL_ID}-mm")


@pytest.fixture
def redis_client():
    """A client on the suite's Redis database, emptied before the test."""
    import redis

    from tenants import services

    client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    client.flushdb()
    services._last_used_tried.clear()  # this process's marks of `lastused:*` keys just flushed
    yield client
    client.close()


@pytest.fixture
def make_tenant(db):
    """Factory: make_tenant("alice") → (tenant, plaintext key)."""
    from tenants.services import apikey_create, tenant_create

    def make(name: str, **key_options):
        tenant = tenant_create(name=name)
        _, plaintext = apikey_create(tenant=tenant, **key_options)
        return tenant, plaintext

    return make


@pytest.fixture
def redis_round_trips(monkeypatch) -> list[int]:
    """The commands of each round trip this process's clients make from here on (a pipeline is one)."""
    from redis.client import Pipeline, Redis

    trips: list[int] = []
    command, execute = Redis.execute_command, Pipeline.execute

    def one(self, *args, **kwargs):  # a pipeline queues its commands with its own execute_command
        trips.append(1)
        return command(self, *args, **kwargs)

    def many(self, *args, **kwargs):
        trips.append(len(self.command_stack))
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(Redis, "execute_command", one)
    monkeypatch.setattr(Pipeline, "execute", many)
    return trips


from tests.clock import clock  # noqa: E402, F401  (the product's clock, moved by a test)
from tests.e2e.stack import live_stack, stack_database_url, stack_redis_url, tiny_stack  # noqa: E402, F401  (session fixture: gunicorn + Celery + vLLM)


def pytest_collection_modifyitems(config, items):
    """Run the browser tests last: the end-to-end timing checks (concurrency speed-up, disconnects,
    worker loss) ran measurably slower after them on a 2-core machine, for a reason not found yet
    (a fresh stack per module did not help); the order keeps those checks meaningful."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)

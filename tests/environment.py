"""Test environment defaults, loaded as a pytest plugin (`-p tests.environment` in pyproject.toml).

It must run before pytest-django configures Django, which happens before any conftest.py is read.
"""

import os
from urllib.parse import urlparse, urlunparse


def _test_redis_url() -> str:
    parsed = urlparse(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    return urlunparse(parsed._replace(path=f"/{os.environ.get('TEST_REDIS_DB', '15')}"))


os.environ.setdefault("SECRET_KEY", "test-secret-key-not-for-production")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gemma")
os.environ["REDIS_URL"] = _test_redis_url()
os.environ.setdefault("DJANGO_DEBUG", "1")
# The test process itself connects without a pool: tests point the connection elsewhere to simulate
# an outage, which a pool's already-open connections would ignore. The live stack uses the pool.
os.environ.setdefault("DATABASE_POOL", "0")
os.environ.setdefault("OPERATOR_TOKEN", "test-operator-token")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

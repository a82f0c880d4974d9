"""Control-plane micro-benchmark: admission decisions and ledger writes per second, on one core.

    python -m benchmarks.controlplane [--seconds 5] [--core 0]

The process pins itself to one core (``os.sched_setaffinity``, as ``taskset -c 0`` would) and runs
the gateway's own functions in a loop against real Redis and PostgreSQL (the servers named by
DATABASE_URL / REDIS_URL, or the embedded ones of .run/; a ``gemma_bench_cp`` database and Redis
database ``--redis-db`` (default 13) are recreated for it). Redis and PostgreSQL are separate server processes,
not pinned: the number is what one gateway core sustains, as a gateway process sees it.

Measured operations:

- key check: ``apikey_authenticate`` (prefix lookup, Redis-cached record, constant-time HMAC compare);
- quota script: ``quota_admit`` alone (one Lua call: RPM, TPM, concurrency, budget; reserves);
- quota script, check only: ``quota_admit(check_only=True)`` (the same Lua call, reserving nothing);
- admission decision: key check + the tenant's limits (Redis-cached) + ``quota_admit``; the
  reservation is then released so limits never bind;
- admission decision as served: the same with the gateway's two early checks before it (one with a
  lower bound of the prompt's size, one with its exact size: three admission Lua calls per request);
- ledger write, one per request: the worker's pending entry, then ``ledger_flush(request_ids=[rid])``
  (settles the quota and inserts the row), the gateway's fast path when a request ends;
- ledger write, batched: the periodic flush draining 500 pending entries per INSERT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable

from benchmarks.procs import ROOT

DATABASE = "gemma_bench_cp"


def _setup_django(redis_db: int) -> None:
    from benchmarks.platform_stack import recreate_database, with_database, with_redis_db
    from deploy.local.services import ensure_services

    services = ensure_services(ROOT / ".run")
    recreate_database(services["DATABASE_URL"], DATABASE)
    os.environ.update(
        DATABASE_URL=with_database(services["DATABASE_URL"], DATABASE),
        REDIS_URL=with_redis_db(services["REDIS_URL"], redis_db),
        SECRET_KEY=os.environ.get("SECRET_KEY") or uuid.uuid4().hex * 2,
        DJANGO_SETTINGS_MODULE="config.settings",
        LOG_LEVEL="WARNING",
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from config.redis_client import get_redis

    get_redis().flushdb()


def rate(name: str, operation: Callable[[], int], seconds: float) -> dict:
    """Run ``operation`` (which returns how many items it handled) for ``seconds``; items per second."""
    operation()  # warm caches and connections
    items, started = 0, time.perf_counter()
    cpu_started = time.process_time()
    while time.perf_counter() - started < seconds:
        items += operation()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    result = {"operation": name, "per_second": round(items / wall, 1), "items": items,
              "us_per_item": round(1e6 * wall / items, 1), "process_cpu_share": round(cpu / wall, 2)}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def _fixtures():
    from quotas.services import plan_create, tenant_quota_set
    from tenants.services import apikey_create, tenant_create

    tenant = tenant_create(name=f"cp-{uuid.uuid4().hex[:8]}")
    # Generous limits, so every limit is checked by the script and none binds during the run.
    plan = plan_create(name=f"cp-{uuid.uuid4().hex[:8]}", rpm=10**9, input_tpm=10**12, output_tpm=10**12,
                       concurrency=10**6, budget_tokens=10**15)  # fmt: skip
    tenant_quota_set(tenant=tenant, plan=plan)
    api_key, plaintext = apikey_create(tenant=tenant, name="cp")
    return tenant, api_key, plaintext


def run(seconds: float) -> list[dict]:
    from config.redis_client import get_redis
    from contract.protocol import LEDGER_PENDING, Usage
    from ledger.services import ledger_flush
    from quotas.admission import quota_admit, quota_release
    from quotas.limits import limits_for
    from tenants.services import apikey_authenticate

    tenant, api_key, plaintext = _fixtures()
    redis = get_redis()

    def key_check() -> int:
        apikey_authenticate(plaintext=plaintext)
        return 1

    limits = limits_for(tenant_id=tenant.id, key_id=api_key.id)

    def quota_script() -> int:
        rid = uuid.uuid4().hex
        quota_admit(request_id=rid, tenant_id=tenant.id, key_id=api_key.id, limits=limits, prompt_tokens=128,
                    max_tokens=128, implicit_max_tokens=False)  # fmt: skip
        return 1

    def quota_check_only() -> int:
        quota_admit(request_id="check", tenant_id=tenant.id, key_id=api_key.id, limits=limits, prompt_tokens=128,
                    max_tokens=128, implicit_max_tokens=False, check_only=True)  # fmt: skip
        return 1

    def admission(early_checks: int = 0) -> int:
        principal = apikey_authenticate(plaintext=plaintext)
        request_limits = limits_for(tenant_id=principal.tenant_id, key_id=principal.key_id)
        rid = uuid.uuid4().hex
        for _ in range(early_checks):
            quota_admit(request_id="check", tenant_id=principal.tenant_id, key_id=principal.key_id,
                        limits=request_limits, prompt_tokens=128, max_tokens=128, implicit_max_tokens=False,
                        check_only=True)  # fmt: skip
        quota_admit(request_id=rid, tenant_id=principal.tenant_id, key_id=principal.key_id, limits=request_limits,
                    prompt_tokens=128, max_tokens=128, implicit_max_tokens=False)  # fmt: skip
        quota_release(request_id=rid)
        return 1

    def usage(rid: str) -> Usage:
        return Usage(request_id=rid, tenant_id=tenant.id, key_id=api_key.id, model="tiny-gemma4", prompt_tokens=128,
                     completion_tokens=128, queue_ms=2, ttft_ms=40, total_ms=900, finish_reason="length",
                     worker="bench", finished_at=time.time())  # fmt: skip

    def ledger_single() -> int:
        rid = uuid.uuid4().hex
        redis.hset(LEDGER_PENDING, rid, usage(rid).dumps())  # what the worker writes at the end
        return ledger_flush(request_ids=[rid])

    def ledger_batched() -> int:
        pipe = redis.pipeline(transaction=False)
        for _ in range(500):
            rid = uuid.uuid4().hex
            pipe.hset(LEDGER_PENDING, rid, usage(rid).dumps())
        pipe.execute()
        return ledger_flush()

    results = [
        rate("key check", key_check, seconds),
        rate("quota script (quota_admit)", quota_script, seconds),
        rate("quota script, check only (quota_admit(check_only=True))", quota_check_only, seconds),
        rate("admission decision (key check + limits + quota script)", admission, seconds),
        rate("admission decision as served (+ 2 early checks)", lambda: admission(early_checks=2), seconds),
        rate("ledger write, one per request (fast path)", ledger_single, seconds),
        rate("ledger write, batched flush (500 per batch)", ledger_batched, seconds),
    ]
    return results


def markdown(results: list[dict], core: int) -> str:
    rows = ["| operation | per second | µs each | CPU share of the pinned core |", "|---|--:|--:|--:|"]
    rows += [f"| {r['operation']} | {r['per_second']:,.0f} | {r['us_per_item']:,.1f} | {r['process_cpu_share']:.2f} |"
             for r in results]  # fmt: skip
    return "\n".join(rows) + f"\n\n(one process pinned to core {core}; Redis and PostgreSQL are separate servers)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each measurement")
    parser.add_argument("--core", type=int, default=0, help="the core to pin this process to")
    parser.add_argument("--redis-db", type=int, default=13, help="the Redis database index it empties and uses")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    _setup_django(args.redis_db)
    results = run(args.seconds)
    print(markdown(results, args.core))
    return 0


if __name__ == "__main__":
    sys.exit(main())

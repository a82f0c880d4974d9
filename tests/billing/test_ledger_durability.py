"""The ledger loses nothing when PostgreSQL goes away during traffic.

Workers keep finishing requests (usage into the Redis buffer, as serving.RequestEvents.finish does) while the
ledger flush runs every few milliseconds; midway PostgreSQL becomes unreachable (the flush's
connection is pointed at a closed port and dropped), later it comes back. Every request must then be
in the ledger exactly once, and quotas must have settled during the outage.
"""

import threading
import time
import uuid

import pytest
from django.db import connection

from contract.protocol import LEDGER_PENDING
from ledger.models import UsageRecord
from ledger.services import ledger_flush
from quotas.admission import resv_key
from quotas.limits import limits_for
from tests.quotas.helpers import admit, thread_redis, worker_reports

pytestmark = pytest.mark.django_db(transaction=True)

REQUESTS = 300


def _unreachable_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])  # closed again when this returns: nothing listens there


def test_postgres_down_during_traffic_then_back_loses_no_row(make_tenant, redis_client):
    tenant, _ = make_tenant("alice")
    key_id = tenant.api_keys.get().id
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    produced: list[str] = []
    stop = threading.Event()

    def workers():
        while len(produced) < REQUESTS:
            rid, _ = admit(limits, tenant, key_id)
            worker_reports(thread_redis(), rid, tenant, key_id, prompt=10, completion=5)
            produced.append(rid)
            time.sleep(0.002)
        stop.set()

    traffic = threading.Thread(target=workers)
    traffic.start()
    real_port = connection.settings_dict["PORT"]
    failed_flushes, phase = 0, "up"
    try:
        while not stop.is_set():
            if phase == "up" and len(produced) > REQUESTS // 4:
                phase = "down"  # PostgreSQL goes away
                connection.close()
                connection.settings_dict["PORT"] = _unreachable_port()
            elif phase == "down" and len(produced) > 3 * REQUESTS // 4:
                phase = "back"
                connection.settings_dict["PORT"] = real_port
                connection.close()
            before = redis_client.hlen(LEDGER_PENDING)
            ledger_flush()
            if phase == "down":
                failed_flushes += 1
                assert redis_client.hlen(LEDGER_PENDING) >= before  # nothing dropped while it is down
            time.sleep(0.01)
    finally:
        connection.settings_dict["PORT"] = real_port
        connection.close()
        traffic.join()
    pending_at_restart = redis_client.hlen(LEDGER_PENDING)
    ledger_flush()

    rows = set(UsageRecord.objects.filter(tenant=tenant).values_list("request_id", flat=True))
    lost = set(produced) - rows
    print(f"\nrequests={len(produced)} flushes while down={failed_flushes} "
          f"pending at the end={pending_at_restart} ledger rows={len(rows)} lost={len(lost)}")  # fmt: skip
    assert failed_flushes > 0
    assert not lost and len(rows) == REQUESTS
    assert redis_client.hlen(LEDGER_PENDING) == 0
    # Quotas settled from the Redis buffer even while PostgreSQL was down.
    assert not any(redis_client.exists(resv_key(rid)) for rid in produced)


def _finished_requests(redis_client, tenant, key_id: int, rids: list[str]) -> list[str]:
    """The worker reported these requests' usage (3 prompt, 4 completion tokens each)."""
    for rid in rids:
        worker_reports(redis_client, rid, tenant, key_id, prompt=3, completion=4)
    return rids


def test_a_flush_retried_after_a_crash_writes_each_row_once(make_tenant, redis_client):
    tenant, _ = make_tenant("bob")
    key_id = tenant.api_keys.get().id
    rids = _finished_requests(redis_client, tenant, key_id, [f"cmpl-{uuid.uuid4().hex}" for _ in range(20)])
    ledger_flush()
    _finished_requests(redis_client, tenant, key_id, rids[:10])  # delivered again after they were flushed
    ledger_flush()
    assert UsageRecord.objects.filter(tenant=tenant).count() == 20


def test_an_entry_the_ledger_refuses_does_not_hold_back_the_others(make_tenant, redis_client):
    from ledger.services import LEDGER_REJECTED

    tenant, _ = make_tenant("carol")
    key_id = tenant.api_keys.get().id
    good = _finished_requests(redis_client, tenant, key_id, [f"cmpl-{uuid.uuid4().hex}" for _ in range(5)])
    # A request whose API key was deleted while it ran (no such key in the database any more).
    orphan = worker_reports(redis_client, "cmpl-orphan", tenant, key_id + 10_000, prompt=3, completion=4)

    assert ledger_flush() == 6

    assert set(UsageRecord.objects.filter(tenant=tenant).values_list("request_id", flat=True)) == set(good)
    assert redis_client.hlen(LEDGER_PENDING) == 0  # nothing stays behind to block the next flushes
    assert redis_client.hget(LEDGER_REJECTED, "cmpl-orphan") == orphan.dumps()  # kept for an operator


def _blocked_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


def test_two_writers_of_the_same_entries_never_deadlock(make_tenant):
    """The gateway's ledger writer and the periodic flush can write the same pending entries at once,
    each in its own order (a batch's, HSCAN's). Writer A holds its first row's insert open; writer B,
    given the two rows in the other order, must wait for A on that row rather than take the other one
    first (which A needs next: a deadlock, and a flush that fails)."""
    from django.db import transaction

    from contract.protocol import Usage
    from ledger.services import ledger_write

    tenant, _ = make_tenant("dave")
    key_id = tenant.api_keys.get().id
    first, second = (
        Usage(request_id=f"cmpl-{n}-{uuid.uuid4().hex}", tenant_id=tenant.id, key_id=key_id, model="m",
              finished_at=time.time())
        for n in (1, 2)
    )  # fmt: skip
    outcome: dict[str, object] = {}
    b_pid: list[int] = []

    def writer_b():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                b_pid.append(cursor.fetchone()[0])
            ledger_write([second, first])
            outcome["b"] = "written"
        except Exception as exc:  # recorded for the assertion below
            outcome["b"] = exc
        finally:
            connection.close()

    with transaction.atomic():
        ledger_write([first])  # writer A: its first row, not committed yet
        thread = threading.Thread(target=writer_b)
        thread.start()
        while not (b_pid and _blocked_on_a_lock(b_pid[0])):
            assert thread.is_alive(), outcome
            time.sleep(0.01)  # waits on B's state in PostgreSQL, not on a clock
        ledger_write([second])  # writer A's second row
    thread.join()

    assert outcome["b"] == "written"
    assert set(UsageRecord.objects.filter(tenant=tenant).values_list("request_id", flat=True)) == {
        first.request_id,
        second.request_id,
    }

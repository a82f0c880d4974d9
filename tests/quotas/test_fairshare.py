"""Fair share of a saturated pool: one tenant's flood does not starve another.

The engine is a test double (a request holds its pool slot for SERVICE seconds); admission, the
fair-share slots and settle are the product's Lua scripts on the real Redis.
"""

import threading
import time

import pytest

from quotas.admission import quota_settle
from quotas.fairshare import fair_share_acquire, pool_prefix
from quotas.limits import limits_for
from tests.quotas.helpers import admit, thread_redis

pytestmark = pytest.mark.django_db

CAPACITY = 4  # the pool runs four requests at once
SERVICE = 0.2  # seconds one request holds its slot in the double engine
POLL = 0.02


class _Slots:
    """The order in which requests got a pool slot, whoever they were."""

    def __init__(self) -> None:
        self.taken = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self.taken += 1
            return self.taken


def _serve(limits, tenant, key_id, log: list, weight: int = 1, slots: _Slots | None = None, passed=None):
    """The gateway's path for one request: admit, wait for a fair slot, run, settle. With `slots`,
    `passed` gets how many requests took a slot while this one waited (itself included)."""
    rid, admitted = admit(limits, tenant, key_id)
    started = time.monotonic()
    taken_before = slots.taken if slots else 0
    fair_share_acquire(pool="tiny", request_id=rid, tenant_id=tenant.id, weight=weight, capacity=CAPACITY,
                       timeout=120, poll=POLL, redis=thread_redis())  # fmt: skip
    log.append(time.monotonic() - started)
    if slots is not None:
        passed.append(slots.take() - taken_before)
    time.sleep(SERVICE)
    quota_settle(request_id=rid, prompt_tokens=10, completion_tokens=5, redis=thread_redis())


def test_a_tenant_with_200_queued_does_not_starve_another_tenants_5(make_tenant, redis_client):
    alice, _ = make_tenant("alice")
    bob, _ = make_tenant("bob")
    alice_key, bob_key = alice.api_keys.get().id, bob.api_keys.get().id
    alice_limits = limits_for(tenant_id=alice.id, key_id=alice_key)
    bob_limits = limits_for(tenant_id=bob.id, key_id=bob_key)
    alice_waits, bob_waits, bob_passed, slots = [], [], [], _Slots()

    flood = [
        threading.Thread(target=_serve, args=(alice_limits, alice, alice_key, alice_waits, 1, slots, []))
        for _ in range(200)
    ]
    for thread in flood:
        thread.start()
    deadline = time.monotonic() + 30
    while int(redis_client.hget(f"{pool_prefix('tiny')}:waitn", alice.id) or 0) < 100:
        assert time.monotonic() < deadline, "alice's backlog never formed"
        time.sleep(0.01)
    backlog = int(redis_client.hget(f"{pool_prefix('tiny')}:waitn", alice.id))

    bobs = [
        threading.Thread(target=_serve, args=(bob_limits, bob, bob_key, bob_waits, 1, slots, bob_passed))
        for _ in range(5)
    ]
    for thread in bobs:
        thread.start()
    for thread in bobs + flood:
        thread.join()

    fifo_wait = backlog / CAPACITY * SERVICE  # where bob would stand behind alice's backlog in a FIFO queue
    print(f"\nalice backlog={backlog}; bob waits (s)={[round(w, 3) for w in sorted(bob_waits)]}, passed by "
          f"{sorted(bob_passed)} slots; alice max wait={max(alice_waits):.2f}s; FIFO: ~{fifo_wait:.2f}s")  # fmt: skip
    assert len(bob_waits) == 5 and len(alice_waits) == 200
    # Bob's five get slots as soon as they free, not after alice's backlog: counted in slots taken
    # while each waited (a FIFO queue would let the whole backlog pass), not in seconds, which a
    # loaded machine stretches.
    assert max(bob_passed) <= 4 * CAPACITY < backlog
    assert max(alice_waits) > fifo_wait / 2
    assert redis_client.zcard(f"{pool_prefix('tiny')}:run") == 0  # every slot was given back by settle


def test_a_tenant_alone_on_the_pool_gets_all_of_it(make_tenant, redis_client):
    alice, _ = make_tenant("alice")
    key = alice.api_keys.get().id
    limits = limits_for(tenant_id=alice.id, key_id=key)
    rids = [admit(limits, alice, key)[0] for _ in range(CAPACITY)]
    for rid in rids:
        # No slot is ever given back here: one that had to wait for another's would time out
        # (ServiceUnavailable), so each acquire returning is the check.
        fair_share_acquire(pool="tiny", request_id=rid, tenant_id=alice.id, weight=1, capacity=CAPACITY,
                           timeout=30, poll=POLL)  # fmt: skip
    assert redis_client.zcard(f"{pool_prefix('tiny')}:run") == CAPACITY


def test_slots_of_a_saturated_pool_follow_the_plans_weights(make_tenant, redis_client):
    alice, _ = make_tenant("alice")
    bob, _ = make_tenant("bob")
    keys = {t.id: t.api_keys.get().id for t in (alice, bob)}
    limits = {t.id: limits_for(tenant_id=t.id, key_id=keys[t.id]) for t in (alice, bob)}
    weights = {alice.id: 3, bob.id: 1}
    logs = {alice.id: [], bob.id: []}
    threads = [
        threading.Thread(target=_serve, args=(limits[t.id], t, keys[t.id], logs[t.id], weights[t.id]))
        for _ in range(40)
        for t in (alice, bob)
    ]
    for thread in threads:
        thread.start()
    samples = []
    while any(thread.is_alive() for thread in threads):
        per = redis_client.hgetall(f"{pool_prefix('tiny')}:per")
        waiting = redis_client.hgetall(f"{pool_prefix('tiny')}:waitn")
        if all(int(waiting.get(str(t.id), 0)) > 0 for t in (alice, bob)):  # both backlogged
            samples.append((int(per.get(str(alice.id), 0)), int(per.get(str(bob.id), 0))))
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    alice_share = sum(a for a, _ in samples) / max(1, sum(a + b for a, b in samples))
    print(f"\nweights 3:1 on {CAPACITY} slots: alice held {alice_share:.0%} of them over {len(samples)} samples")
    assert len(samples) > 10
    assert 0.65 <= alice_share <= 0.85

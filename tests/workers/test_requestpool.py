"""A model worker's Celery pool (workers/requestpool.py) on the real engine (CPU, tiny model), real
Redis and Celery's own pool machinery: a request's task holds its slot until the request's end but
no thread meanwhile; other tasks still run on the pool's threads; a warm stop waits for every
request handed off.

The tracer Celery hands the pool (``fast_trace_task``, which decodes a message and runs the task)
is replaced by a function that runs the task's body with the request id: what is under test is the
pool and the task body, not Celery's message decoding.
"""

import asyncio
import concurrent.futures
import threading
import uuid

import pytest

from contract import protocol
from contract.protocol import RequestInput, Usage
from workers.celery_app import app
from workers.requestpool import BLOCKING_TASK_THREADS, RequestPool, hand_off
from workers.tasks import generate  # registers the task, as the worker does at start

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _traced(runtime):
    """Stands for Celery's tracer: (task name, request id) -> the task body's run, then its result."""

    def trace(task_name: str, request_id: str):
        runtime.run_request(request_id)
        return (0, None, 0.0)  # Celery's (failed, retval, runtime)

    return trace


@pytest.fixture
def runtime(engine_host):
    from workers.serving import WorkerRuntime

    runtime = WorkerRuntime(
        node="w-pool", model="tiny-gemma4", model_path="unused", pool="tiny", profile="cpu", slots=400,
        engine=engine_host,
    )  # fmt: skip
    runtime.relay.start()
    yield runtime
    asyncio.run_coroutine_threadsafe(runtime.relay.stop(), engine_host.loop).result(timeout=30)


def _queue(redis_client, prompt_ids, max_tokens: int, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        request = RequestInput(
            request_id=f"cmpl-{uuid.uuid4().hex[:12]}", model="tiny-gemma4", prompt_token_ids=list(prompt_ids),
            params=dict(GREEDY, max_tokens=max_tokens), tenant_id=1, key_id=1, enqueued_at=0.0,
        )  # fmt: skip
        redis_client.set(protocol.input_key(request.request_id), request.dumps())
        ids.append(request.request_id)
    return ids


def _ended(redis_client, rid: str) -> bool:
    return any(fields["t"] == "done" for _, fields in redis_client.xrange(protocol.events_key(rid)))


def test_requests_hold_their_slots_until_their_end_and_no_thread_meanwhile(runtime, chat_prompt_ids, redis_client):
    pool = RequestPool(limit=400, app=app)
    rids = _queue(redis_client, chat_prompt_ids[:8], 4, 300)
    threads_before = set(threading.enumerate())
    released, early, accepted = [], [], []
    all_released = threading.Event()

    def release(rid):
        def on_success(result):
            if not _ended(redis_client, rid):
                early.append(rid)  # the slot came free before the request's end was in Redis
            released.append(rid)
            if len(released) == len(rids):
                all_released.set()

        return on_success

    for rid in rids:  # one thread applies them all, as Celery's consumer does
        pool.apply_async(
            _traced(runtime), args=(generate.name, rid), callback=release(rid),
            accept_callback=lambda pid, at: accepted.append(pid),
        )  # fmt: skip
    # Every request was handed to the engine's loop before its task returned: none of them started
    # a thread (the threads pool started one per request in flight, up to its limit).
    assert len(set(threading.enumerate()) - threads_before) <= BLOCKING_TASK_THREADS
    assert all_released.wait(600)
    pool.on_stop()

    assert sorted(released) == sorted(rids) and early == [] and len(accepted) == len(rids)
    assert runtime.in_flight == 0 and pool.info["handed-off"] == 0
    pending = redis_client.hgetall(protocol.LEDGER_PENDING)
    for rid in rids:
        usage = Usage.loads(pending[rid])
        assert (usage.status, usage.completion_tokens, usage.worker) == ("ok", 4, runtime.name)


def test_a_warm_stop_waits_for_the_requests_handed_off(runtime, chat_prompt_ids, redis_client):
    pool = RequestPool(limit=8, app=app)
    rids = _queue(redis_client, chat_prompt_ids[:8], 64, 3)
    for rid in rids:
        pool.apply_async(_traced(runtime), args=(generate.name, rid), callback=lambda result: None)

    pool.on_stop()

    assert all(_ended(redis_client, rid) for rid in rids)
    assert runtime.in_flight == 0


def test_a_request_the_gateway_took_back_frees_its_slot_at_once(runtime, redis_client):
    pool = RequestPool(limit=4, app=app)
    results = []
    pool.apply_async(_traced(runtime), args=(generate.name, "cmpl-gone"), callback=results.append)
    pool.on_stop()
    assert results == [(0, None, 0.0)] and runtime.in_flight == 0


def test_a_task_that_fails_before_its_hand_off_reports_its_failure_at_once(runtime):
    pool = RequestPool(limit=4, app=app)
    results = []

    def failing_trace(task_name, request_id):
        return (1, "raised before the hand-off", 0.0)  # what Celery's tracer returns for a failed body

    pool.apply_async(failing_trace, args=(generate.name, "cmpl-x"), callback=results.append)
    assert results == [(1, "raised before the hand-off", 0.0)]
    pool.on_stop()


def test_tasks_that_do_not_hand_off_run_on_the_pools_few_threads():
    pool = RequestPool(limit=400, app=app)
    ran_on = []
    done = threading.Event()

    def trace(task_name):
        ran_on.append(threading.get_ident())
        done.set()
        return (0, None, 0.0)

    pool.apply_async(trace, args=("ledger.flush",), callback=lambda result: None)
    assert done.wait(30)
    pool.on_stop()
    assert ran_on != [threading.get_ident()]
    assert pool.executor._max_workers == BLOCKING_TASK_THREADS


def test_outside_the_pool_a_task_body_waits_itself():
    assert hand_off(concurrent.futures.Future()) is False

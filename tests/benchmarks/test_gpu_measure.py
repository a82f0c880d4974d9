"""Load shapes, numbers and the start barrier of the GPU bench (benchmarks/gpu/measure.py)."""

import json
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.gpu import measure


def test_prompts_are_deterministic_distinct_and_inside_the_vocabulary():
    first = measure.prompts(7, 16, length=128, high=1000)
    assert first == measure.prompts(7, 16, length=128, high=1000)
    assert len({tuple(p) for p in first}) == 16
    assert all(len(p) == 128 and all(measure.PROMPT_ID_LOW <= t < 1000 for t in p) for p in first)
    assert measure.prompts(8, 16, high=1000) != first


def test_summarize_counts_tokens_over_wall_time_and_per_request_latencies():
    started = 100.0
    records = [
        measure.RequestRecord(submitted=100.0, first_token=100.1, finished=102.1, tokens=201),
        measure.RequestRecord(submitted=100.0, first_token=100.3, finished=104.0, tokens=371),
    ]
    level = measure.summarize(2, records, started)
    assert level.tokens == 572
    assert level.wall_s == pytest.approx(4.0)
    assert level.tokens_per_s == pytest.approx(143.0)
    assert level.ttft_ms_p50 == pytest.approx(200.0)
    assert level.tpot_ms_p50 == pytest.approx(10.0)  # (2.0 s / 200) and (3.7 s / 370)
    assert level.errors == 0
    assert (level.duration_s_p50, level.duration_s_max) == (pytest.approx(3.05), pytest.approx(4.0))


def test_summarize_of_requests_that_produced_nothing_has_no_latencies():
    level = measure.summarize(1, [measure.RequestRecord(1.0, None, 2.0, 0)], 1.0, errors=1)
    assert (level.tokens, level.ttft_ms_p50, level.tpot_ms_p50, level.errors) == (0, None, None, 1)


def test_the_gpu_turn_is_exclusive(tmp_path):
    lock = tmp_path / "gpu.lock"
    order = []

    def second():
        with measure.gpu_turn(lock):
            order.append("second")

    with measure.gpu_turn(lock):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first done")
    thread.join(5)
    assert order == ["first done", "second"]


def test_the_start_barrier_marks_the_engine_and_waits_for_go(tmp_path):
    assert measure.wait_for_start(tmp_path, "stock", ok=True, timeout=0.2) is False
    assert (tmp_path / "stock.ready").exists()
    assert measure.wait_for_start(tmp_path, "h200", ok=False, timeout=0) is False
    assert (tmp_path / "h200.failed").exists()
    (tmp_path / "go").touch()
    assert measure.wait_for_start(tmp_path, "stock", ok=True, timeout=5) is True


def test_run_releases_the_platform_first_and_the_engines_once_it_is_done(tmp_path, monkeypatch):
    from benchmarks.gpu import run

    monkeypatch.setattr(run, "BARRIER", tmp_path)
    script = (
        "import sys, time; from pathlib import Path; from benchmarks.gpu import measure;"
        "name, go = sys.argv[1], sys.argv[2];"
        "assert measure.wait_for_start(Path(sys.argv[3]), name, ok=True, timeout=20, go=go);"
        "Path(sys.argv[3], name + '.measured').write_text(str(time.monotonic()))"
    )

    def fake(name, go):
        argv = [sys.executable, "-c", script, name, go, str(tmp_path)]
        return subprocess.Popen(argv, cwd=run.ROOT)

    procs = {"platform": fake("platform", "go-platform"), "stock": fake("stock", "go"), "h200": fake("h200", "go")}
    run._release(procs, deadline=time.time() + 30)
    assert all(proc.wait(10) == 0 for proc in procs.values())
    platform_done = float((tmp_path / "platform.measured").read_text())
    assert all(float((tmp_path / f"{n}.measured").read_text()) > platform_done for n in ("stock", "h200"))


def test_drive_keeps_clients_sending_while_the_next_request_fits_in_the_level():
    import asyncio

    async def one(i, n):
        t0 = time.perf_counter()
        await asyncio.sleep(0.2)
        return measure.RequestRecord(t0, t0 + 0.01, time.perf_counter(), 5)

    # 4 x 0.2 s fit in 0.99 s, a fifth would not; the margin (47 ms per request) is for a loaded machine.
    records, started, errors = asyncio.run(measure.drive(3, 0.99, one))
    assert errors == [] and len(records) == 3 * 4
    level = measure.summarize(3, records, started)
    assert level.max_generating == 3 and level.wall_s < 0.99
    once, _, _ = asyncio.run(measure.drive(2, 0, one))
    assert len(once) == 2  # every client sends at least one request


def test_drive_with_counts_sends_exactly_that_many_requests_per_client_whatever_the_time():
    import asyncio

    async def one(i, n):
        return measure.RequestRecord(0.0, 0.1, 0.2, 1)

    records, _, errors = asyncio.run(measure.drive(3, 0, one, counts=[2, 1, 4]))
    assert errors == []
    assert sorted(r.client for r in records) == [0, 0, 1, 2, 2, 2, 2]


def test_drive_counts_a_failed_request_and_ends_that_client():
    import asyncio

    async def one(i, n):
        if i == 1:
            raise RuntimeError("HTTP 500")
        return measure.RequestRecord(0.0, 0.1, 0.2, 1)

    records, _, errors = asyncio.run(measure.drive(2, 0, one))
    assert len(records) == 1 and errors == ["RuntimeError: HTTP 500"]


def test_prompts_of_a_level_are_distinct_per_client_and_request():
    prompts = {tuple(measure.prompt(1, i, n, high=1000)) for i in range(4) for n in range(3)}
    assert len(prompts) == 12 and measure.prompt(1, 2, 1) == measure.prompt(1, 2, 1)


def test_max_generating_counts_overlapping_generations_only():
    records = [
        measure.RequestRecord(0, 1, 3, 5),
        measure.RequestRecord(0, 3, 4, 5),
        measure.RequestRecord(0, None, 4, 0),
    ]
    assert measure.max_generating(records) == 1  # one ends as the next starts


def test_the_level_scale_is_read_from_the_barrier(tmp_path):
    from benchmarks.gpu import run

    assert measure.read_scale(tmp_path) == 1.0
    assert run.level_scale({"a": 100, "b": 100, "gone": 500}, {"a", "b"}, time_left=125) == 0.5
    assert run.level_scale({"a": 100}, {"a"}, time_left=900) == 1.0
    (tmp_path / "scale").write_text("0.5")
    assert measure.read_scale(tmp_path) == 0.5


def test_the_ttft_breakdown_splits_the_clients_time_by_the_workers_times():
    records = [
        measure.RequestRecord(10.0, 10.250, 11.0, 4, "a"),  # 250 ms = 40 queue + 150 engine + 60 rest
        measure.RequestRecord(10.0, 10.300, 11.0, 4, "b"),  # 300 ms = 60 + 200 + 40
        measure.RequestRecord(10.0, None, 11.0, 0, "c"),  # no first token: left out
        measure.RequestRecord(10.0, 10.100, 11.0, 4, "unknown"),  # no ledger row: left out
    ]
    times = {"a": (40, 150), "b": (60, 200), "c": (10, None)}
    breakdown = measure.ttft_breakdown(records, times)
    assert breakdown["requests"] == 2
    assert breakdown["queue_ms_p50"] == 50.0
    assert breakdown["engine_ttft_ms_p50"] == 175.0
    assert breakdown["rest_ms_p50"] == 50.0
    assert breakdown["gateway_ms_p50"] is None  # no header times recorded


def test_the_ttft_breakdown_splits_the_rest_at_the_response_headers():
    record = measure.RequestRecord(10.0, 10.250, 11.0, 4, "a", headers=10.020)  # headers after 20 ms
    breakdown = measure.ttft_breakdown([record], {"a": (40, 150)})
    assert breakdown["gateway_ms_p50"] == 20.0
    assert round(breakdown["relay_ms_p50"], 6) == 40.0  # 250 - 40 - 150 - 20


def test_the_slowest_request_is_timed_by_the_client_and_by_its_ledger_row():
    records = [
        measure.RequestRecord(10.0, 10.080, 12.7, 4, "a", headers=10.010),
        measure.RequestRecord(10.0, 10.090, 15.0, 4, "b", headers=10.020),  # 5.0 s: the outlier
        measure.RequestRecord(10.0, None, 20.0, 0, "c"),  # failed before a first token: left out
    ]
    slowest = measure.slowest_request(records, {"a": (10, 60, 2600), "b": (12, 70, 2700)})
    assert slowest["request_id"] == "b"
    assert [round(slowest[key]) for key in ("duration_ms", "ttft_ms", "headers_ms")] == [5000, 90, 20]
    # Its worker ended 2.7 s after admission: 2.3 s went after the worker's end (or before admission).
    assert (slowest["queue_ms"], slowest["engine_ttft_ms"], slowest["worker_total_ms"]) == (12, 70, 2700)
    assert measure.slowest_request(records[2:], {}) is None


def test_full_concurrency_counts_the_tokens_until_the_first_client_stops():
    record = measure.RequestRecord
    # Client 0: two requests of 11 tokens over [0, 4] and [4, 8]. Client 1: one over [0, 10], so
    # client 0 stops first, at 8: every token of client 0 counts, and client 1's first token plus
    # 10 * (8 - 1) / (10 - 1) of its later ones.
    records = [
        record(0.0, 1.0, 4.0, 11, client=0),
        record(4.0, 5.0, 8.0, 11, client=0),
        record(0.0, 1.0, 10.0, 11, client=1),
    ]
    tokens, seconds = measure.full_concurrency(records, 0.0)
    assert seconds == 8.0 and abs(tokens - (22 + 1 + 10 * 7 / 9)) < 1e-9
    level = measure.summarize(2, records, 0.0)
    assert level.full_s == 8.0 and level.full_tokens_per_s == round((22 + 1 + 70 / 9) / 8, 1)
    # Over the whole level (to the last token at 10 s) the tail with one stream weighs in.
    assert level.tokens_per_s == 3.3


def test_full_concurrency_needs_the_records_clients():
    assert measure.full_concurrency([measure.RequestRecord(0.0, 1.0, 2.0, 5)], 0.0) is None


def test_drive_marks_each_record_with_its_client():
    import asyncio

    async def one(i, n):
        return measure.RequestRecord(0.0, 0.1, 0.2, 1)

    records, _, _ = asyncio.run(measure.drive(3, 0, one))
    assert sorted(r.client for r in records) == [0, 1, 2]


def test_the_turn_order_alternates_the_sides_and_who_goes_first():
    assert measure.turn_order(["platform", "bare"], 3) == [
        "platform:0", "bare:0", "bare:1", "platform:1", "platform:2", "bare:2",
    ]  # fmt: skip


def _take_turns(folder, name: str, levels: int, log: list, fail_at: int | None = None) -> None:
    with measure.Turns(folder, name, folder / "gpu.lock", timeout=30) as turns:
        for index in range(levels):
            with turns.level(index):
                log.append(("start", f"{name}:{index}"))
                if index == fail_at:
                    raise RuntimeError("the side crashed")
                time.sleep(0.05)  # long enough for the other side to overtake, were it not waiting
                log.append(("end", f"{name}:{index}"))


def _run_sides(folder, sides: dict[str, int | None], levels: int) -> list:
    log: list = []

    def side(name, fail_at):
        try:
            _take_turns(folder, name, levels, log, fail_at)
        except RuntimeError:
            pass

    threads = [threading.Thread(target=side, args=(name, fail_at)) for name, fail_at in sides.items()]
    for thread in reversed(threads):  # the side that goes second starts first: it must wait anyway
        thread.start()
    for thread in threads:
        thread.join(30)
    return log


def test_the_sides_measure_one_level_at_a_time_in_the_turn_order(tmp_path):
    order = measure.turn_order(["platform", "bare"], 4)
    (tmp_path / measure.TURN_ORDER_FILE).write_text(json.dumps(order))
    log = _run_sides(tmp_path, {"platform": None, "bare": None}, 4)
    assert [turn for event, turn in log if event == "start"] == order
    # Each turn ends before the next one starts: never two levels on the GPU at once.
    assert log == [(event, turn) for turn in order for event in ("start", "end")]


def test_a_side_that_crashes_holds_up_none_of_the_other_sides_turns(tmp_path):
    order = measure.turn_order(["platform", "bare"], 3)
    (tmp_path / measure.TURN_ORDER_FILE).write_text(json.dumps(order))
    log = _run_sides(tmp_path, {"platform": 0, "bare": None}, 3)
    assert [turn for event, turn in log if event == "end"] == ["bare:0", "bare:1", "bare:2"]


def test_without_a_turn_order_a_run_holds_the_gpu_lock_for_all_its_levels(tmp_path):
    (tmp_path / measure.TURN_ORDER_FILE).write_text('["platform:0", "bare:0"]')  # names neither side below
    log = _run_sides(tmp_path, {"stock": None, "h200": None}, 2)
    runs = [turn.split(":")[0] for event, turn in log if event == "start"]
    assert runs in (["h200", "h200", "stock", "stock"], ["stock", "stock", "h200", "h200"])


def test_with_a_turn_order_run_releases_the_platform_and_its_bare_engine_together(tmp_path, monkeypatch):
    from benchmarks.gpu import run

    monkeypatch.setattr(run, "BARRIER", tmp_path)
    (tmp_path / measure.TURN_ORDER_FILE).write_text('["platform:0", "bare:0"]')
    # The platform side stays up until the bare side has measured, as it does between its turns.
    script = (
        "import sys, time; from pathlib import Path; from benchmarks.gpu import measure;"
        "name, go, folder, other = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4];"
        "assert measure.wait_for_start(folder, name, ok=True, timeout=20, go=go);"
        "(folder / (name + '.measured')).touch()\n"
        "deadline = time.monotonic() + 20\n"
        "while other and not (folder / (other + '.measured')).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
        "assert not other or (folder / (other + '.measured')).exists(), 'the other side was not let measure'\n"
    )

    def fake(name, go, other=""):
        return subprocess.Popen([sys.executable, "-c", script, name, go, str(tmp_path), other], cwd=run.ROOT)

    procs = {"platform": fake("platform", "go-platform", other="bare"), "bare": fake("bare", "go")}
    run._release(procs, deadline=time.time() + 30)
    assert all(proc.wait(10) == 0 for proc in procs.values())
    assert (tmp_path / "bare.measured").exists() and (tmp_path / "platform.measured").exists()


def test_a_side_that_never_started_holds_up_none_of_the_other_sides_turns(tmp_path):
    order = measure.turn_order(["platform", "bare"], 2)
    (tmp_path / measure.TURN_ORDER_FILE).write_text(json.dumps(order))
    measure.wait_for_start(tmp_path, "platform", ok=False, timeout=0)  # what a failed start marks
    log = _run_sides(tmp_path, {"bare": None}, 2)
    assert [turn for event, turn in log if event == "end"] == ["bare:0", "bare:1"]


def test_a_levels_later_turns_get_prompts_of_their_own_and_both_sides_the_same():
    schedule = [32, 128, 128, 32]
    seeds = [measure.turn_seed(7, schedule, index) for index in range(len(schedule))]
    assert seeds[0] == seeds[1] == 7 and seeds[2] == seeds[3] != 7
    first, again = (measure.prompt(seeds[i] + 32, 0, 0) for i in (0, 3))
    assert first != again


def _records(per_client: list[int]) -> list:
    return [measure.RequestRecord(0.0, 0.1, 0.2, 1, client=i) for i, sent in enumerate(per_client) for _ in range(sent)]


def test_the_later_turns_of_a_stream_count_send_what_its_first_turn_sent(tmp_path):
    """Timed turns let the sides of a level differ by a whole wave of requests: only the first turn
    of a stream count is timed, the others (either side's) send as many requests per client."""
    (tmp_path / measure.TURN_ORDER_FILE).write_text(json.dumps(measure.turn_order(["platform", "bare"], 2)))
    first = measure.Turns(tmp_path, "platform", tmp_path / "gpu.lock")
    second = measure.Turns(tmp_path, "bare", tmp_path / "gpu.lock")

    assert first.request_counts(4) is None  # the first turn at 4 streams is timed
    first.keep_request_counts(4, _records([2, 2, 1, 3]))
    assert second.request_counts(4) == [2, 2, 1, 3]
    second.keep_request_counts(4, _records([1, 1, 1, 1]))  # a later turn sets nothing
    assert first.request_counts(4) == [2, 2, 1, 3]
    assert second.request_counts(8) is None  # another stream count has its own first turn


def test_without_a_turn_order_every_level_is_timed(tmp_path):
    turns = measure.Turns(tmp_path, "h200", tmp_path / "gpu.lock")
    turns.keep_request_counts(4, _records([2, 2, 1, 3]))
    assert turns.request_counts(4) is None


def test_engine_steps_counts_the_steps_of_a_level_and_those_with_more_tokens_than_its_streams():
    before = {"128.0": 10.0, "256.0": 50.0, "512.0": 60.0, "+Inf": 61.0}
    after = {"128.0": 10.0, "256.0": 950.0, "512.0": 1_400.0, "+Inf": 1_461.0}
    assert measure.engine_steps(before, after, 256) == {"steps": 1_400, "steps_over_streams": 500}
    # A stream count that is no bound of the histogram: the steps alone.
    assert measure.engine_steps(before, after, 300) == {"steps": 1_400}
    assert measure.engine_steps(None, after, 256) is None


def test_the_steps_histogram_is_read_from_a_metrics_page_as_vllm_writes_it():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from benchmarks.gpu.worker_metrics import step_token_counts_from_text

    registry = CollectorRegistry()
    # vLLM 0.26's metric (vllm/v1/metrics/loggers.py): one series per engine, by label.
    steps = Histogram("vllm:iteration_tokens_total", "tokens per engine step", ["engine"], registry=registry,
                      buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])  # fmt: skip
    itl = Histogram("vllm:inter_token_latency_seconds", "inter-token latency", ["engine"], registry=registry,
                    buckets=[0.01, 0.025, 0.05])  # fmt: skip
    for tokens in (256, 256, 250, 384, 8192):
        steps.labels(engine="0").observe(tokens)
    for seconds in (0.012, 0.016, 0.014):
        itl.labels(engine="0").observe(seconds)
    counts = step_token_counts_from_text(generate_latest(registry).decode())
    assert counts["256.0"] == 3 and counts["512.0"] == 4 and counts["+Inf"] == 5
    assert measure.engine_steps({}, counts, 256) is None  # no reading before: nothing to count from
    expected = {"steps": 5, "steps_over_streams": 2, "itl_ms_mean": 14.0}
    assert measure.engine_steps({"+Inf": 0.0}, counts, 256) == expected
    assert step_token_counts_from_text("# no metrics here\n") is None


def test_engine_steps_give_the_engines_own_mean_time_between_tokens_where_read():
    from benchmarks.gpu.worker_metrics import ITL_COUNT, ITL_SUM

    before = {"256.0": 50.0, "+Inf": 61.0, ITL_SUM: 2.0, ITL_COUNT: 100.0}
    after = {"256.0": 950.0, "+Inf": 1_461.0, ITL_SUM: 14.0, ITL_COUNT: 900.0}
    assert measure.engine_steps(before, after, 256)["itl_ms_mean"] == 15.0
    # No token gap in the turn (or no such histogram): no figure rather than a division by zero.
    assert "itl_ms_mean" not in measure.engine_steps({**before, ITL_COUNT: 900.0}, after, 256)
    assert "itl_ms_mean" not in measure.engine_steps({"+Inf": 1.0}, {"+Inf": 9.0}, 256)


@pytest.mark.django_db(transaction=True)  # the function reads through a connection of its own
def test_the_ledger_gives_each_requests_worker_times_and_leaves_out_rows_still_missing(make_tenant):
    from django.db import connection
    from psycopg.conninfo import make_conninfo

    from ledger.models import UsageRecord

    tenant, _ = make_tenant("bench")
    key_id = tenant.api_keys.get().id
    for request_id, queue_ms, ttft_ms in (("cmpl-a", 12, 80), ("cmpl-b", 30, None)):
        UsageRecord.objects.create(request_id=request_id, tenant=tenant, api_key_id=key_id, model="m", prompt_tokens=9,
                                   completion_tokens=3, total_ms=90, queue_ms=queue_ms, ttft_ms=ttft_ms,
                                   finished_at="2026-01-01T00:00:00Z")  # fmt: skip
    db = connection.settings_dict
    fields = {"dbname": "NAME", "user": "USER", "password": "PASSWORD", "host": "HOST", "port": "PORT"}
    url = make_conninfo(**{field: db[name] for field, name in fields.items() if db[name]})

    times = measure.ledger_worker_times(url, ["cmpl-a", "cmpl-b", "cmpl-never-written"], timeout_s=0.3)

    assert times == {"cmpl-a": (12, 80, 90), "cmpl-b": (30, None, 90)}

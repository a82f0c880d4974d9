"""The benchmark's own logic: percentiles, SSE parsing, per-request timing, summaries, flags, report."""

import json
from collections import Counter

import pytest

from benchmarks import report
from benchmarks.bare import engine_cli_flags
from benchmarks.loadgen import SSEParser, Workload, apply_event, chunk_content, prompt_text
from benchmarks.profiling import frame_key, hot_functions, parse_collapsed, top_inclusive
from benchmarks.stats import RequestResult, first_wave, percentile, ratio, summarize


class TestPercentile:
    def test_it_interpolates_linearly_between_ranks_like_numpy(self):
        values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        assert percentile(values, 50) == pytest.approx(5.5)
        assert percentile(values, 95) == pytest.approx(9.55)
        assert percentile(values, 99) == pytest.approx(9.91)
        assert percentile(values, 0) == 1
        assert percentile(values, 100) == 10

    def test_it_does_not_depend_on_input_order(self):
        assert percentile([10, 1, 5], 50) == 5

    def test_it_returns_none_for_no_values_and_rejects_bad_quantiles(self):
        assert percentile([], 50) is None
        with pytest.raises(ValueError):
            percentile([1], 101)

    def test_a_single_value_is_every_percentile(self):
        assert percentile([7.5], 1) == percentile([7.5], 99) == 7.5


class TestSSEParser:
    def test_it_splits_events_and_ignores_comments(self):
        parser = SSEParser()
        events = parser.feed(b': keep-alive\n\ndata: {"a":1}\n\ndata: [DONE]\n\n')
        assert events == ['{"a":1}', "[DONE]"]

    def test_it_reassembles_events_split_across_reads(self):
        parser = SSEParser()
        assert parser.feed(b'data: {"te') == []
        assert parser.feed(b'xt":"hi"}\n') == []
        assert parser.feed(b"\n") == ['{"text":"hi"}']

    def test_it_accepts_crlf_even_split_between_cr_and_lf(self):
        parser = SSEParser()
        assert parser.feed(b"data: one\r") == []
        assert parser.feed(b"\n\r\n") == ["one"]
        assert parser.feed(b"data: two\r\n\r\n") == ["two"]

    def test_multiple_data_lines_of_one_event_are_joined_with_newlines(self):
        assert SSEParser().feed(b"data: a\ndata:b\nid: 3\n\n") == ["a\nb"]

    def test_a_multibyte_character_split_across_reads_is_kept_whole(self):
        parser = SSEParser()
        payload = 'data: {"text":"é"}\n\n'.encode()
        cut = payload.index("é".encode()) + 1
        assert parser.feed(payload[:cut]) == []
        assert parser.feed(payload[cut:]) == ['{"text":"é"}']


def _chat_chunk(content=None, usage=None, role=False):
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}] if not usage else []}
    if usage:
        body["usage"] = usage
    return json.dumps(body)


class TestApplyEvent:
    def test_only_chunks_with_text_count_as_token_arrivals(self):
        result = RequestResult(sent_at=10.0, ended_at=0)
        apply_event(result, _chat_chunk(role=True), 10.01)
        apply_event(result, _chat_chunk("Hello"), 10.05)
        apply_event(result, _chat_chunk(""), 10.06)
        apply_event(result, _chat_chunk(" world"), 10.09)
        assert result.chunk_times == [10.05, 10.09]
        assert result.ttft == pytest.approx(0.05)

    def test_the_usage_chunk_sets_token_counts_and_done_ends_the_stream(self):
        result = RequestResult(sent_at=0, ended_at=0)
        assert not apply_event(result, _chat_chunk(usage={"prompt_tokens": 12, "completion_tokens": 64}), 1.0)
        assert apply_event(result, "[DONE]", 1.1)
        assert (result.prompt_tokens, result.completion_tokens) == (12, 64)

    def test_an_error_event_marks_the_request_failed(self):
        result = RequestResult(sent_at=0, ended_at=0)
        apply_event(result, json.dumps({"error": {"message": "worker lost", "code": "worker_lost"}}), 1.0)
        assert not result.ok
        assert "worker lost" in result.error

    def test_completion_chunks_carry_text_not_delta(self):
        assert chunk_content({"choices": [{"text": "abc", "index": 0}]}) == "abc"
        assert chunk_content({"choices": []}) == ""


class TestRequestTiming:
    def test_itl_spreads_the_decode_time_over_the_tokens_whatever_the_chunking(self):
        per_token = RequestResult(sent_at=0, ended_at=1, chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5], completion_tokens=5)
        coalesced = RequestResult(sent_at=0, ended_at=1, chunk_times=[0.1, 0.3, 0.5], completion_tokens=5)
        assert per_token.itl == pytest.approx(0.1)
        assert coalesced.itl == pytest.approx(0.1)
        assert coalesced.chunk_gaps() == pytest.approx([0.2, 0.2])

    def test_itl_is_undefined_for_a_single_token(self):
        assert RequestResult(sent_at=0, ended_at=1, chunk_times=[0.1], completion_tokens=1).itl is None


class TestSummarize:
    def test_throughput_counts_only_successful_requests_over_the_level_time(self):
        ok = [RequestResult(0, 1, [0.1 * i, 0.1 * i + 0.5], completion_tokens=64, prompt_tokens=10) for i in range(4)]
        failed = RequestResult(0, 1, error="HTTP 503: busy")
        summary = summarize("platform", 4, [*ok, failed], duration_s=2.0, expected_tokens=64)
        assert summary.output_tok_s == 128.0  # 4 x 64 tokens in 2 s
        assert summary.req_s == 2.0
        assert (summary.errors, summary.short, summary.first_error) == (1, 0, "HTTP 503: busy")
        assert summary.ttft_p50_ms == pytest.approx(150.0)
        assert summary.mean_completion_tokens == 64

    def test_the_first_wave_is_what_the_clients_sent_at_once_when_the_round_began(self):
        # 2 clients: requests 0 and 1 at the start, then each client's next one as its last ended.
        round_results = [
            RequestResult(sent_at=1.2, ended_at=2.0, chunk_times=[1.25]),
            RequestResult(sent_at=0.0, ended_at=1.2, chunk_times=[0.3]),
            RequestResult(sent_at=0.01, ended_at=1.0, chunk_times=[0.41]),
            RequestResult(sent_at=1.0, ended_at=2.0, chunk_times=[1.05]),
        ]
        wave = first_wave(round_results, 2)
        assert [r.sent_at for r in wave] == [0.0, 0.01]
        summary = summarize("platform", 2, round_results, 2.0, expected_tokens=0, first_waves=wave)
        assert summary.first_wave_ttft_p50_ms == pytest.approx(350.0)  # 300 and 400 ms
        assert summary.ttft_p50_ms == pytest.approx(175.0)  # 50, 50, 300 and 400 ms
        assert summarize("platform", 2, round_results, 2.0, expected_tokens=0).first_wave_ttft_p50_ms is None

    def test_requests_shorter_than_asked_are_counted(self):
        short = RequestResult(0, 1, [0.1, 0.2], completion_tokens=10)
        assert summarize("bare", 1, [short], 1.0, expected_tokens=64).short == 1

    def test_ratio_handles_missing_values(self):
        assert ratio(95, 100) == 0.95
        assert ratio(None, 100) is None
        assert ratio(5, 0) is None


class TestWorkload:
    def test_prompts_differ_from_the_first_token_so_no_prefix_is_shared(self):
        assert prompt_text(1, 10).split()[:2] != prompt_text(2, 10).split()[:2]
        assert len(prompt_text(1, 10).split()) == 12

    def test_every_request_asks_for_exactly_the_output_length(self):
        body = Workload("m", output_tokens=32).body(3)
        assert body["max_tokens"] == 32 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}


class TestEngineFlags:
    def test_engine_arguments_become_vllm_server_flags(self):
        flags = engine_cli_flags({
            "model": "/m", "dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": False,
            "enable_prefix_caching": True, "disable_log_stats": True, "speculative_config": {"method": "mtp"},
        })  # fmt: skip
        assert flags == [
            "--model", "/m", "--dtype", "bfloat16", "--max-model-len", "2048", "--no-enforce-eager",
            "--enable-prefix-caching", "--disable-log-stats", "--speculative-config", '{"method": "mtp"}',
        ]  # fmt: skip

    def test_a_false_disable_switch_is_left_out(self):
        assert engine_cli_flags({"disable_log_stats": False}) == []


def _summary(target, level, tput, ttft):
    return summarize(target, level, [RequestResult(0, 1, [ttft / 1000, 0.5], completion_tokens=tput)], 1.0, tput)


class TestReport:
    def test_ratios_compare_the_platform_with_both_other_targets(self):
        rows = report.ratios([_summary("bare", 32, 1000, 100), _summary("platform", 32, 960, 105),
                              _summary("litellm", 32, 400, 160)])  # fmt: skip
        assert rows == [{
            "concurrency": 32, "platform_over_bare": 0.96, "platform_over_litellm": 2.4, "litellm_over_bare": 0.4,
            "platform_ttft_overhead_ms": 5.0, "litellm_ttft_overhead_ms": 60.0,
        }]  # fmt: skip
        assert "- [x] platform throughput ≥ 0.95 of bare at 32 streams: 0.960" in report.goals(rows)

    def test_each_round_is_compared_with_the_bare_round_it_took_turns_with(self):
        bare, platform = _summary("bare", 64, 1000, 100), _summary("platform", 64, 900, 120)
        bare.round_tok_s, platform.round_tok_s = [1000.0, 800.0, 1200.0], [990.0, 640.0, 1200.0]
        assert report.round_ratios([bare, platform]) == {64: [0.99, 0.8, 1.0]}
        assert report.round_ratios_line([bare, platform]) == (
            "Platform / bare, round by round: 64 streams 0.990 / 0.800 / 1.000."
        )
        # Without both targets' rounds there is nothing to compare, and the section leaves it out.
        assert report.round_ratios([bare]) == {} and report.round_ratios_line([bare]) == ""
        assert "\n\n\n" not in report.section([bare], "context", "plot.png")

    def test_the_steps_table_shows_each_round_and_how_full_the_batch_was(self):
        bare, platform = _summary("bare", 32, 1000, 100), _summary("platform", 32, 900, 120)
        bare.round_steps = [{"steps": 524, "steps_over_streams": 16, "tokens_per_step": 31.3}, None]
        table = report.steps_table([bare, platform])
        assert "| bare vLLM server | 32 | 524 (31.3, 16) / – |" in table
        assert "| platform |" not in table  # not counted: no row

    def test_the_generated_section_replaces_only_itself(self, tmp_path):
        doc = tmp_path / "benchmarks.md"
        doc.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\n## GPU profile\n\nkept\n")
        report.write_into(doc, f"{report.BEGIN}\nnew\n{report.END}\n")
        text = doc.read_text()
        assert "old" not in text and "new" in text
        assert text.startswith("# Benchmarks\n\nintro") and text.endswith("## GPU profile\n\nkept\n")


class TestProfiles:
    STACKS = [
        'process 1:"gunicorn";thread (0x1);run (gunicorn/workers/gthread.py:10);_stream (gateway/views.py:200);'
        "xread (redis/commands/core.py:30) 6",
        'process 1:"gunicorn";thread (0x1);run (gunicorn/workers/gthread.py:10);_stream (gateway/views.py:200);'
        "dumps (json/__init__.py:231) 3",
        'process 1:"gunicorn";thread (0x1);run (gunicorn/workers/gthread.py:10) 1',
    ]

    def test_collapsed_stacks_are_parsed_without_process_and_thread_frames(self):
        stacks = parse_collapsed(self.STACKS)
        assert sum(stacks.values()) == 10
        assert all(not f.startswith(("process", "thread")) for frames in stacks for f in frames)

    def test_hot_functions_report_self_and_inclusive_shares(self):
        hot = hot_functions(parse_collapsed(self.STACKS))
        assert (hot[0].key, hot[0].self_pct, hot[0].total_pct) == ("redis/commands/core.py:xread", 60.0, 60.0)
        view = top_inclusive(parse_collapsed(self.STACKS), "gateway/")
        assert (view[0].key, view[0].total_pct, view[0].self_pct) == ("gateway/views.py:_stream", 90.0, 0.0)

    def test_frame_keys_drop_install_prefixes(self):
        frame = "xread (/work/main/.venv/lib/python3.11/site-packages/redis/commands/core.py:3)"
        assert frame_key(frame) == "redis/commands/core.py:xread"
        assert frame_key("<module>") == "<module>"
        assert parse_collapsed(["garbage"]) == Counter()


def test_engine_steps_turn_statistics_on_for_both_engines_and_keep_other_overrides(monkeypatch):
    from benchmarks.run import build_parser, plan_from, turn_engine_statistics_on
    from workers.profiles import engine_args_for

    assert plan_from(build_parser().parse_args(["--engine-steps"])).engine_steps
    assert not plan_from(build_parser().parse_args([])).engine_steps
    monkeypatch.setenv("ENGINE_ARGS_JSON", '{"max_num_seqs": 8}')
    turn_engine_statistics_on()
    args = engine_args_for("cpu", "/m")  # what the bare server and the platform's worker both run
    assert args["disable_log_stats"] is False and args["max_num_seqs"] == 8


def test_the_metrics_wrapper_takes_celery_command_lines_only():
    from benchmarks.gpu.worker_metrics import behind_metrics
    from deploy.local.launcher import worker_command

    argv = worker_command("w", "pool.p", 4)
    wrapped = behind_metrics(argv, 9100)
    assert wrapped[1:4] == ["-m", "benchmarks.gpu.worker_metrics", "9100"] and wrapped[4:] == argv[3:]
    with pytest.raises(ValueError, match="celery"):
        behind_metrics(["python", "manage.py", "runserver"], 9100)


def test_the_platforms_first_token_is_split_by_its_ledgers_worker_times():
    from benchmarks.run import _breakdown_text, _ttft_breakdown

    # Sent at 10.0, headers after 20 ms, first token after 250 ms: 20 gateway + 40 queue + 150 engine + 40 relay.
    timed = RequestResult(sent_at=10.0, ended_at=11.0, chunk_times=[10.25, 10.5], completion_tokens=2,
                          request_id="a", headers_at=10.02)  # fmt: skip
    failed = RequestResult(sent_at=10.0, ended_at=10.1, request_id="b", error="HTTP 429")
    unknown = RequestResult(sent_at=10.0, ended_at=11.0, chunk_times=[10.1], completion_tokens=1, request_id="c")
    times = {"a": (40, 150), "b": (1, 1)}

    breakdown = _ttft_breakdown([timed, failed, unknown], times)

    assert breakdown["requests"] == 1
    parts = (breakdown["gateway_ms_p50"], breakdown["queue_ms_p50"], breakdown["engine_ttft_ms_p50"])
    assert parts == (20.0, 40.0, 150.0)
    assert round(breakdown["relay_ms_p50"], 6) == 40.0
    summary = summarize("platform", 1, [timed], 1.0, 2)
    summary.ttft_breakdown, summary.first_wave_ttft_breakdown = breakdown, breakdown
    assert _breakdown_text(summary).endswith("gateway 20.0 / 20.0, queue 40 / 40, engine 150 / 150, relay 40.0 / 40.0")


def test_the_load_generator_records_the_request_id_and_when_the_headers_came():
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from benchmarks.loadgen import run_level_async

    async def chat(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": "chatcmpl-7"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": {"completion_tokens": 1}}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with TestServer(app, host="127.0.0.1") as server:
            return await run_level_async(str(server.make_url("/v1/chat/completions")), {}, lambda i: {}, 1, 1)

    (result,), _ = asyncio.run(scenario())
    assert result.ok, result.error
    assert result.request_id == "chatcmpl-7"
    assert result.sent_at <= result.headers_at <= result.chunk_times[0]

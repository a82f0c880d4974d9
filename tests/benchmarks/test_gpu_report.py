"""Tables and goal checks of the GPU bench (benchmarks/gpu/report.py)."""

from benchmarks.gpu import report


def result(name, rates, start_s=100.0, errors=None):
    levels = [{"streams": n, "tokens_per_s": rate, "errors": (errors or {}).get(n, 0)} for n, rate in rates.items()]
    return {"name": name, "start_s": start_s, "levels": levels}


RESULTS = report.by_name(
    [
        result("stock", {1: 200.0, 8: 1600.0, 32: 6000.0, 128: 15000.0}),
        result("h200", {1: 360.0, 8: 1700.0, 32: 6100.0, 128: 31000.0}),
        result("bare-h200", {32: 6000.0, 128: 15000.0}),
        result("platform-h200", {32: 5900.0, 128: 14000.0}, errors={128: 3}),
        {"name": "a10g", "error": "EngineDeadError: boom"},
    ]
)


def test_rate_is_none_for_a_failed_engine_a_missing_level_or_a_level_with_errors():
    assert report.rate(RESULTS["stock"], 1) == 200.0
    assert report.rate(RESULTS["a10g"], 1) is None
    assert report.rate(RESULTS["bare-h200"], 1) is None
    assert report.rate(RESULTS["platform-h200"], 128) is None


def test_goals_compare_within_the_same_run_and_say_when_a_side_is_missing():
    rows = {label: (value, met) for label, value, _, met in report.goal_rows(RESULTS)}
    assert rows["h200 vs stock, 1 stream"] == (1.8, True)
    assert rows["h200 vs stock, 128 streams"] == (2.067, True)
    assert rows["platform vs bare engine, 32 streams"] == (0.983, True)
    assert rows["platform vs bare engine, 128 streams"] == (None, None)
    assert rows["platform vs bare engine, 512 streams"] == (None, None)


def test_the_engine_table_shows_ratios_to_the_reference_and_failures():
    table = report.engine_table(RESULTS, ["stock", "h200", "a10g"], (1, 128))
    lines = table.splitlines()
    assert lines[0] == "| engine | start (s) | 1 stream | 128 streams |"
    assert "| stock | 100 | 200 | 15,000 |" in lines
    assert "| h200 | 100 | 360 (1.80x) | 31,000 (2.07x) |" in lines
    assert any(line.startswith("| a10g | failed: EngineDeadError: boom") for line in lines)


def test_render_holds_every_table():
    text = report.render(list(RESULTS.values()))
    assert "Engine configurations" in text and "Platform path" in text and "| goal |" in text
    assert "platform-h200 | 100 | 5,900 (0.98x) | — |" in text


def test_the_full_concurrency_table_compares_the_tokens_until_the_first_client_stopped():
    def level(whole, full):
        return {"streams": 128, "tokens_per_s": whole, "full_tokens_per_s": full}

    results = {
        "bare-h200": {"name": "bare-h200", "levels": [level(18_500.0, 18_600.0)]},
        "platform-h200": {"name": "platform-h200", "levels": [level(16_500.0, 17_670.0)]},
    }
    table = report.engine_table(results, ["bare-h200", "platform-h200"], [128], "bare-h200", "full_tokens_per_s")
    assert "17,670 (0.95x)" in table
    assert "16,500 (0.89x)" in report.engine_table(results, ["bare-h200", "platform-h200"], [128], "bare-h200")
    # A level measured before the field existed has no full-concurrency figure.
    del results["bare-h200"]["levels"][0]["full_tokens_per_s"]
    assert report.rate(results["bare-h200"], 128, "full_tokens_per_s") is None


def test_the_cpu_table_shows_each_part_with_its_wait_for_a_cpu():
    results = {
        "bare-h200": {
            "name": "bare-h200",
            "levels": [
                {
                    "streams": 128,
                    "cpu_s": {
                        "client": 5.0,
                        "engine core": 24.0,
                        "client wait": 0.1,
                        "engine core wait": 0.25,
                        "steal": 1.5,
                    },
                }
            ],
        },
        "platform-h200": {"name": "platform-h200", "levels": [{"streams": 128, "cpu_s": {"web": 6.07}}]},
    }
    lines = report.cpu_table(results, ["bare-h200", "platform-h200"]).splitlines()
    assert "| bare-h200 | 128 | client 5.00 (0.10), engine core 24.00 (0.25), stolen by the host 1.50 |" in lines
    assert "| platform-h200 | 128 | web 6.07 |" in lines


def test_a_level_measured_in_several_turns_is_their_tokens_over_their_seconds():
    def turn(rate, wall, errors=0):
        return {"streams": 128, "tokens_per_s": rate, "wall_s": wall, "errors": errors}

    pooled = {"name": "bare-h200", "levels": [{"streams": 32, "tokens_per_s": 6000.0, "wall_s": 8.0},
                                              turn(10_000.0, 10.0), turn(16_000.0, 20.0)]}  # fmt: skip
    assert report.rate(pooled, 128) == (10_000.0 * 10 + 16_000.0 * 20) / 30
    assert report.rate(pooled, 32) == 6000.0
    # One turn with a failed request fails the level.
    pooled["levels"].append(turn(20_000.0, 15.0, errors=1))
    assert report.rate(pooled, 128) is None


def test_a_side_stopped_before_its_last_turn_shows_the_turns_it_measured_as_cut_short():
    from benchmarks.gpu import measure

    bare = result("bare-h200", {32: 6000.0, 128: 15000.0})
    cut = measure.partial(result("platform-h200", {32: 5700.0}), planned_turns=2)
    table = report.engine_table(report.by_name([bare, cut]), ["bare-h200", "platform-h200"], (32, 128), "bare-h200")
    assert "| platform-h200 (cut short: 1 of 2 turns) | 100 | 5,700 (0.95x) | — |" in table.splitlines()


def test_the_pace_table_takes_each_sides_engine_pace_out_of_the_ratio():
    def turn(rate, itl, wall=10.0):
        return {
            "streams": 256,
            "tokens_per_s": rate,
            "wall_s": wall,
            "engine_steps": {"steps": 1_031, "itl_ms_mean": itl},
        }

    bare = {"name": "bare-h200", "levels": [turn(20_000.0, 12.0), turn(18_000.0, 14.0)]}
    # The platform's engine stepped 10% slower in its turns: a 0.90 ratio is all the engine's pace.
    platform = {"name": "platform-h200", "levels": [turn(17_100.0, 14.3), turn(17_100.0, 14.3)]}
    results = report.by_name([bare, platform])
    assert report.engine_itl(bare, 256) == 13.0
    table = report.pace_table(results, "bare-h200", "platform-h200", (32, 256))
    assert table.splitlines()[2:] == ["| 256 | 0.90 | 13.00 → 14.30 | 0.99 |"]  # no row for 32: not measured
    assert "equal engine pace" in report.render([bare, platform])
    # A turn without the engine's reading leaves the level out.
    platform["levels"].append({"streams": 256, "tokens_per_s": 17_000.0, "wall_s": 10.0})
    assert report.pace_table(report.by_name([bare, platform]), "bare-h200", "platform-h200", (256,)).count("\n") == 1


def test_the_platform_tables_show_levels_run_py_was_asked_for_beside_the_usual_ones():
    level = {"streams": 64, "tokens_per_s": 4_000.0, "wall_s": 10.0}
    text = report.render([{"name": "bare-h200", "start_s": 90.0, "levels": [level]},
                          {"name": "platform-h200", "start_s": 95.0, "levels": [level]}])  # fmt: skip
    assert "| engine | start (s) | 32 streams | 64 streams | 128 streams | 256 streams | 512 streams |" in text
    assert "| platform-h200 | 95 | — | 4,000 (1.00x) | — | — | — |" in text

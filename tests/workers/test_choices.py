"""Tool calls read out of a choice's text (workers/choices.py), without an engine."""

import json

from workers.choices import Choice, parse_tool_calls


def _feed(choice: Choice, parts: list[str], mode: str) -> str:
    return "".join(choice.add_text(part, mode) for part in parts)


def test_auto_mode_streams_text_up_to_a_gemma4_call_and_parses_the_call():
    choice = Choice(0, holding=False)
    parts = ["Let me check. <|tool", '_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>']
    assert _feed(choice, parts, "auto") == "Let me check. "
    end = choice.finish("auto", "")
    assert end["finish_reason"] == "tool_calls"
    [call] = end["tool_calls"]
    # Bare values stay strings, as vLLM's own server reads Gemma 4's syntax.
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo", "days": "2"}
    assert "".join(choice.texts) == "Let me check. "


def test_auto_mode_releases_a_held_partial_marker_that_was_not_a_call():
    choice = Choice(0, holding=False)
    assert _feed(choice, ["a <|to"], "auto") == "a "
    assert _feed(choice, ["p> b"], "auto") == "<|top> b"
    end = choice.finish("auto", "")
    assert end == {"finish_reason": "stop"} and "".join(choice.texts) == "a <|top> b"


def test_a_forced_call_cut_short_is_returned_as_content():
    choice = Choice(0, holding=True)
    choice.finish_reason = "length"
    assert _feed(choice, ['{"city": "Os'], "named") == ""
    assert choice.finish("named", "get_weather") == {"finish_reason": "length"}
    assert "".join(choice.texts) == '{"city": "Os'


def test_required_mode_reads_an_array_of_calls():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert parse_tool_calls(text, "required", "") == [
        {"name": "a", "arguments": '{"x": 1}'},
        {"name": "b", "arguments": "{}"},
    ]
    assert parse_tool_calls('{"x": 1}', "named", "f") == [{"name": "f", "arguments": '{"x": 1}'}]
    assert parse_tool_calls("[1, 2", "required", "") == []


def test_a_raw_control_character_in_a_constrained_string_still_gives_a_call_with_valid_json_arguments():
    """The engine's JSON grammar let one through (xgrammar, random model): strict JSON would drop the call."""
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo\x18", "unit": "celsius"}}]'
    [call] = parse_tool_calls(text, "required", "")
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Oslo\x18", "unit": "celsius"}  # escaped: valid JSON
    [named] = parse_tool_calls('{"city": "Oslo\x18"}', "named", "get_weather")
    assert json.loads(named["arguments"]) == {"city": "Oslo\x18"}

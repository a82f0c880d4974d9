"""The request input and the usage entry read from Redis, across versions (contract/protocol.py)."""

import json

from contract.protocol import RequestInput, Usage


def _input(**extra) -> str:
    request = RequestInput(request_id="cmpl-1", model="m", prompt_token_ids=[1, 2], params={"max_tokens": 4},
                           tenant_id=1, key_id=2, enqueued_at=1.0)  # fmt: skip
    return json.dumps({**json.loads(request.dumps()), **extra})


def test_an_input_of_this_version_round_trips_with_no_unknown_fields():
    request = RequestInput.loads(_input())
    assert request.prompt_token_ids == [1, 2] and request.unknown_fields == ()
    assert "unknown_fields" not in json.loads(request.dumps())


def test_fields_of_a_newer_gateway_are_named_not_fatal():
    request = RequestInput.loads(_input(speculative_hint=3, another=True))
    assert request.request_id == "cmpl-1"
    assert request.unknown_fields == ("another", "speculative_hint")


def test_usage_round_trips_its_cached_tokens():
    usage = Usage(request_id="cmpl-1", tenant_id=1, key_id=2, model="m", prompt_tokens=40, cached_tokens=32)
    assert Usage.loads(usage.dumps()) == usage
    assert json.loads(usage.dumps())["cached_tokens"] == 32


def test_usage_stored_before_cached_tokens_loads_with_none_cached():
    stored = {"request_id": "cmpl-1", "tenant_id": 1, "key_id": 2, "model": "m", "prompt_tokens": 40,
              "completion_tokens": 3, "queue_ms": 1, "ttft_ms": None, "total_ms": 9, "finish_reason": "stop",
              "status": "ok", "worker": "w", "finished_at": 1.0, "extra": {}}  # fmt: skip
    usage = Usage.loads(json.dumps(stored))
    assert usage.cached_tokens == 0 and usage.prompt_tokens == 40 and usage.completion_tokens == 3


def test_usage_fields_of_a_newer_worker_are_dropped_not_fatal():
    usage = Usage(request_id="cmpl-1", tenant_id=1, key_id=2, model="m", prompt_tokens=4)
    usage_loaded = Usage.loads(json.dumps({**json.loads(usage.dumps()), "draft_tokens": 7}))
    assert usage_loaded == usage

"""The request input a worker reads from Redis, across versions (workers/protocol.py)."""

import json

from workers.protocol import RequestInput


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

"""Stand-ins for the gateway's relay tests: a request as the relay gets it, its model, the two as
the lifecycle's `Enqueued`, and a recording `lifecycle.record`."""

import time

MODEL = type("Model", (), {"model_id": "m"})()


def job(request_id: str):
    from contract.protocol import RequestInput

    return RequestInput(request_id=request_id, model="m", prompt_token_ids=[1], params={}, tenant_id=1, key_id=1,
                        enqueued_at=time.time())  # fmt: skip


def enqueued(request_id: str, inference):
    """The request `job(request_id)` of MODEL, admitted and enqueued for `inference` (an InferenceRequest)."""
    from gateway.lifecycle import Enqueued

    return Enqueued(job(request_id), MODEL, inference, {})


def async_append(calls: list):
    """A stand-in for the async `lifecycle.record` that notes each call's request id."""

    async def append(request) -> None:
        calls.append(request.request_id)

    return append

"""Stand-ins for the gateway's relay tests: a request as the relay gets it, its model, and a
recording `dispatch.record`."""

import time

MODEL = type("Model", (), {"model_id": "m"})()


def job(request_id: str):
    from workers.protocol import RequestInput

    return RequestInput(request_id=request_id, model="m", prompt_token_ids=[1], params={}, tenant_id=1, key_id=1,
                        enqueued_at=time.time())  # fmt: skip


def async_append(calls: list):
    """A stand-in for the async `dispatch.record` that notes each call."""

    async def append(request_id: str) -> None:
        calls.append(request_id)

    return append

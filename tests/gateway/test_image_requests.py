"""An image message from the official `openai` client, through the real web tier (gunicorn + uvicorn),
Redis and the ledger, up to the engine.

vLLM's CPU build here cannot load the multimodal model (its Gemma 4 multimodal code imports
transformers' Gemma4Processor, which needs torchvision, and no CPU build of torchvision is on the
package index: docs/api.md), so the test plays the worker over Redis (contract/protocol.py): it
claims the request's input, checks what a worker would hand the engine (the prompt with one image
placeholder, the image's pixels, its token count), and ends the request with the usage an engine
that prefilled the expanded prompt reports. The client's usage and the ledger row must both carry
the image's tokens.
"""

import base64
import io
import threading
import time

import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from contract import protocol
from contract.protocol import RequestInput, Usage
from ledger.models import UsageRecord
from tests.e2e.stack import wait_until
from tests.gateway.web_server import web_server
from workers.images import decode_images

pytestmark = pytest.mark.django_db(transaction=True)

MODEL, POOL, WORKER = "tiny-gemma4-mm", "mm-test", "mm-test-worker"


@pytest.fixture
def server(tiny_mm_model_dir, redis_client, make_tenant, tmp_path):
    """The web tier with the multimodal model registered; yields (base_url, key, tenant)."""
    from django.core.management import call_command

    tenant, key = make_tenant("alice")
    call_command(
        "registermodel", MODEL, "--path", str(tiny_mm_model_dir), "--pool", POOL, "--context-length", "2048", "--images"
    )
    # A heartbeat far in the future stays fresh for the whole test.
    redis_client.zadd(protocol.pool_workers_key(POOL), {WORKER: time.time() + 3600})
    redis_client.hset(protocol.worker_key(WORKER), mapping={"pool": POOL, "state": "ready", "slots": 8})
    with web_server(tmp_path) as (base_url, _):
        yield base_url, key, tenant


def _claim(redis_client) -> RequestInput:
    """What a worker does first: take the one request input there is."""
    found: list[str] = []

    def enqueued() -> bool:
        found.extend(key for key in redis_client.scan_iter(match="req:*:in"))
        return bool(found)

    wait_until(enqueued, "the gateway never enqueued the request", 60)
    return RequestInput.loads(redis_client.getdel(found[0]))


def _finish(redis_client, request: RequestInput, text: str, completion_tokens: int) -> Usage:
    """The events and usage a worker writes, in one MULTI as workers/relay.py does."""
    usage = Usage(
        request_id=request.request_id, tenant_id=request.tenant_id, key_id=request.key_id, model=request.model,
        prompt_tokens=request.prompt_tokens, completion_tokens=completion_tokens, finish_reason="stop",
        worker=WORKER, finished_at=time.time(), total_ms=5,
    )  # fmt: skip
    events = protocol.events_key(request.request_id)
    pipe = redis_client.pipeline(transaction=True)
    pipe.xadd(events, {"t": "start", "w": WORKER})
    pipe.xadd(events, {"t": "delta", "x": text, "n": completion_tokens})
    pipe.xadd(events, {"t": "done", "u": usage.dumps()})
    pipe.hset(protocol.LEDGER_PENDING, request.request_id, usage.dumps())
    pipe.execute()
    return usage


def test_an_image_message_is_answered_and_billed_with_the_images_tokens(server, redis_client, tiny_mm_model_dir):
    base_url, key, tenant = server
    picture = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 30, 30)).save(picture, format="JPEG", quality=95)
    data_url = "data:image/jpeg;base64," + base64.b64encode(picture.getvalue()).decode()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    replies: list = []
    errors: list = []

    def ask() -> None:
        try:
            replies.append(client.chat.completions.create(
                model=MODEL, max_tokens=8,
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What colour is this?"},
                    {"type": "image_url", "image_url": {"url": data_url, "detail": "low"}},
                ]}],
            ))  # fmt: skip
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    request = _claim(redis_client)

    # What the worker hands the engine: one placeholder for the image, and the image itself.
    tokenizer = AutoTokenizer.from_pretrained(tiny_mm_model_dir)
    assert request.prompt_token_ids.count(tokenizer.image_token_id) == 1
    ((image,),) = [decode_images(request.images)["image"]]
    assert image.size == (463, 347)  # shrunk to the model's largest input (70 tokens of 48x48 pixels)
    red, green, blue = image.getpixel((100, 100))
    assert red > 180 and green < 60 and blue < 60
    assert request.images[0]["tokens"] == 65  # 63 soft tokens, a begin and an end marker
    assert request.prompt_tokens == len(request.prompt_token_ids) - 1 + 65

    usage = _finish(redis_client, request, "Red.", 2)
    asking.join(60)
    assert not errors, errors
    (reply,) = replies
    assert reply.choices[0].message.content == "Red."
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (usage.prompt_tokens, 2)

    def recorded() -> bool:
        return UsageRecord.objects.filter(request_id=request.request_id).exists()

    wait_until(recorded, "the ledger row was never written", 60)
    row = UsageRecord.objects.get(request_id=request.request_id)
    assert (row.tenant_id, row.prompt_tokens, row.completion_tokens) == (tenant.id, usage.prompt_tokens, 2)


def test_an_image_for_a_model_without_images_is_refused_by_the_client_library(server, redis_client, tiny_model_dir):
    from catalog.models import ServedModel

    base_url, key, _ = server
    ServedModel.objects.create(model_id="tiny-gemma4", path=str(tiny_model_dir), pool=POOL, context_length=2048)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model="tiny-gemma4",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}
            ],
        )
    assert error.value.body["param"] == "messages[0].content[0]"
    assert error.value.body["code"] == "model_does_not_support_images"
    assert not redis_client.keys("req:*")

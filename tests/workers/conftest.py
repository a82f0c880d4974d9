"""Fixtures for the worker engine tests: the tiny model and one engine for the whole session.

Building the model takes seconds; starting vLLM takes 20-30 s on two cores, so every engine test
shares one ``EngineHost`` (eager mode, the ``cpu`` profile).
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory) -> Path:
    """The tiny random-weight Gemma 4 model, built once per session into a temporary folder."""
    from workers.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gemma4", seed=0)


@pytest.fixture(scope="session")
def engine_host(engine_model_dir):
    """A started ``EngineHost`` on the tiny model, with the worker's default of 8 tokens an output
    once a request shows text (WORKER_ENGINE_STREAM_INTERVAL); shut down (and checked) at the end of
    the session."""
    from tests.workers.engine_stream import open_stream
    from workers.engine import EngineHost, EngineNotReady

    host = EngineHost(str(engine_model_dir), profile="cpu", served_model_name="tiny-gemma4", enforce_eager=True,
                      text_stream_interval=8)  # fmt: skip
    host.start(timeout=300)
    yield host
    host.shutdown()
    assert host.state == "stopped"
    with pytest.raises(EngineNotReady):
        open_stream(host, "after-shutdown", [2, 4, 5], {"max_tokens": 1})


@pytest.fixture(scope="session")
def chat_prompt_ids(engine_model_dir) -> list[int]:
    """A chat prompt tokenized with the model's own chat template (as the gateway does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_model_dir)
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write a short poem about the sea."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
